"""Work-conserving core sharing between a trainer process and its generator process on one CPU host.

A fixed split (generator on `generator_threads` cores, trainer on `trainer_threads`) wastes the
cores of whichever side is idle: the trainer waits for rollouts at the start of a step, the generator
waits for admission once it has finished the next step's groups. Training and generation both scale
almost linearly with cores here (1 -> 2 cores: 2.0x each, measured by `megatron-rl bench async`), so
an idle core is lost throughput that overlap alone cannot win back.

Each side publishes whether it has work in a shared flag and, at every point where torch's thread
count can change cheaply (before each trainer layer's forward and backward, before each engine
decode step), runs on its own share while the other side is busy and on all the cores while the
other side is idle. The re-check has to be that frequent: a side still running on a core the other
has just taken back oversubscribes the host, and its OpenMP barriers wait on a descheduled thread.
The flags live in shared memory (a `multiprocessing` RawArray inherited by the spawned generator).
"""
from __future__ import annotations

import contextlib
import multiprocessing
from typing import Iterator, Literal

import torch

Role = Literal["trainer", "generator"]
_INDEX = {"trainer": 0, "generator": 1}


class CoreShare:
    """One side's view of the host's cores (`for_role`); picklable, so it can cross a spawn."""

    def __init__(self, *, trainer_threads: int, generator_threads: int, context=None):
        if trainer_threads < 1 or generator_threads < 1:
            raise ValueError("each side needs at least one thread")
        ctx = context or multiprocessing.get_context("spawn")
        self.shares = (trainer_threads, generator_threads)
        self._busy = ctx.RawArray("b", 2)  # [trainer busy, generator busy]
        self._role: int | None = None
        self.switches = 0  # thread-count changes made by this side (a process-local count)

    def for_role(self, role: Role) -> "CoreShare":
        view = object.__new__(CoreShare)
        view.shares, view._busy, view._role, view.switches = self.shares, self._busy, _INDEX[role], 0
        return view

    def _me(self) -> int:
        if self._role is None:
            raise RuntimeError("use CoreShare.for_role('trainer' | 'generator')")
        return self._role

    @property
    def total(self) -> int:
        return sum(self.shares)

    def set_busy(self, busy: bool) -> None:
        self._busy[self._me()] = int(busy)

    def peer_busy(self) -> bool:
        return bool(self._busy[1 - self._me()])

    def threads(self) -> int:
        """Own share while the peer works; every core while it idles."""
        return self.shares[self._me()] if self.peer_busy() else self.total

    def apply(self) -> int:
        """Set torch's thread count for the next piece of work; returns it."""
        wanted = self.threads()
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
            self.switches += 1
        return wanted

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Mark this side busy for the block (and take the right number of threads for it)."""
        self.set_busy(True)
        self.apply()
        try:
            yield
        finally:
            self.set_busy(False)
