"""Shared-memory weight channel between trainer ranks and a generator process on one host.

The engine-side tensors (HF names at the engine's layout) live in flat per-dtype buckets backed by
files in /dev/shm, so every process on the host can map them by path: the generator process reads
them, and each trainer rank writes its own Megatron shard's part straight into them through the
reshard plan (`write_shard`), with no gather of the model on one rank. This is LlamaRL's direct
memory access weight sync, with the host's shared memory as the wire; on GPUs the same plan drives
CUDA IPC or NCCL transports.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import uuid
from typing import Iterable, Mapping

import torch

from megatron_rl.weight_sync.delta import write_changed
from megatron_rl.weight_sync.reshard import (
    Bucket,
    BucketLayout,
    ReshardPlan,
    plan_buckets,
)

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
# Every file this module creates is named for its owner's pid, so that a later run can tell the files of
# a dead run (SIGKILLed with its whole process group: nobody left to unlink them) from a live one's.
_WEIGHTS_PREFIX = "megatron_rl_weights_"
# Directories of weights staged for an external engine to read (rollout/vllm_engine.py), named the same way.
OWNED_DIR_PREFIX = "megatron_rl_staging_"
_OWNED_NAME = re.compile(r"^(?:megatron_rl_weights_|megatron_rl_staging_|sem\.mp-megatron_rl-)(\d+)[_-]")


def shm_directory() -> str:
    return _SHM_DIR or os.path.join(os.path.expanduser("~"), ".cache", "megatron_rl_shm")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def reclaim_stale(directory: str | None = None) -> list[str]:
    """Remove the shared weight files, staging directories and semaphores (`sem.mp-megatron_rl-PID-*`, see
    placement/generator_process.py) whose owner pid is no longer alive; one line on stderr says what
    was freed. Returns the removed paths."""
    directory = directory or shm_directory()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed, freed, owners = [], 0, set()
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
                shutil.rmtree(path)
            else:
                size = os.path.getsize(path)
                os.unlink(path)
        except OSError:
            continue  # another process reclaimed it first
        removed.append(path)
        freed += size
        owners.add(int(match.group(1)))
    if removed:
        log.warning(f"reclaimed {len(removed)} shared-memory files ({freed / 2**20:.1f} MiB) in {directory} left by "
                    f"dead runs (pids {', '.join(map(str, sorted(owners)))})")
    return removed


class WeightMismatchError(RuntimeError):
    """A tensor's checksum differs between trainer and generator after a weight sync."""


@dataclasses.dataclass(frozen=True)
class SharedBucketsDescriptor:
    """What another process needs to map the buckets: file paths and layouts (picklable, small)."""

    paths: tuple[str, ...]
    layouts: tuple[BucketLayout, ...]


class SharedBuckets:
    """Flat per-dtype buckets in named shared memory. The creator owns (and unlinks) the files."""

    def __init__(self, descriptor: SharedBucketsDescriptor, *, owner: bool):
        self.descriptor = descriptor
        self.owner = owner
        self.buckets = [Bucket(layout, _map(path, layout)) for path, layout in zip(descriptor.paths, descriptor.layouts)]

    @classmethod
    def create(cls, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]] = (), *, bucket_bytes: int = 64 << 20,
               layouts: Iterable[BucketLayout] | None = None, directory: str | None = None) -> "SharedBuckets":
        """Buckets planned from `specs` (name, shape, dtype), or laid out exactly as `layouts` say."""
        layouts = tuple(layouts) if layouts is not None else tuple(plan_buckets(list(specs), bucket_bytes))
        directory = directory or shm_directory()
        os.makedirs(directory, exist_ok=True)
        reclaim_stale(directory)
        token = uuid.uuid4().hex[:12]
        paths = []
        for index, layout in enumerate(layouts):
            path = os.path.join(directory, f"{_WEIGHTS_PREFIX}{os.getpid()}_{token}_{index}")
            with open(path, "wb") as f:
                f.truncate(layout.nbytes)
            paths.append(path)
        return cls(SharedBucketsDescriptor(tuple(paths), layouts), owner=True)

    @classmethod
    def attach(cls, descriptor: SharedBucketsDescriptor) -> "SharedBuckets":
        return cls(descriptor, owner=False)

    def views(self) -> dict[str, torch.Tensor]:
        """HF name -> view into shared memory (writes are visible to every process that mapped it)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            out.update(bucket.unpack())
        return out

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for layout in self.descriptor.layouts)

    def unlink(self) -> None:
        if self.owner:
            for path in self.descriptor.paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _map(path: str, layout: BucketLayout) -> torch.Tensor:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shared weight buffer {path} is gone (was its owner closed?)")
    return torch.from_file(path, shared=True, size=layout.numel, dtype=layout.dtype)


def write_shard(plan: ReshardPlan, pp_rank: int, tp_rank: int, shard: Mapping[str, torch.Tensor],
                destinations: Mapping[int, Mapping[str, torch.Tensor]], *, partial: bool = False,
                only_changed: bool = False) -> int:
    """Copy Megatron shard (pp_rank, tp_rank) into every engine rank's HF-named destination tensors it
    feeds, following the reshard plan. Returns the bytes written. Each trainer rank calls this for its
    own shard; together they fill the destinations completely (the plan covers every element once).
    `partial`: the destinations hold only some of the tensors (one bucket); the others are skipped.
    `only_changed`: write only the elements whose bits differ from the destination's (a delta sync into
    memory the trainer can read; the destination ends up the same)."""
    written = 0
    with torch.no_grad():
        for engine_rank, copies in plan.copies_from(pp_rank, tp_rank).items():
            targets = destinations[engine_rank]
            for copy in copies:
                if partial and copy.dst not in targets:
                    continue
                source = shard[copy.src[2]].detach()
                s2 = source.view(source.shape[0], -1) if source.dim() != 1 else source.view(-1, 1)
                target = targets[copy.dst]
                d2 = target.view(target.shape[0], -1) if target.dim() != 1 else target.view(-1, 1)
                for sr, sc, dr, dc, nr, nc in copy.segments:
                    if only_changed:
                        written += write_changed(d2[dr:dr + nr, dc:dc + nc], s2[sr:sr + nr, sc:sc + nc])
                    else:
                        d2[dr:dr + nr, dc:dc + nc].copy_(s2[sr:sr + nr, sc:sc + nc])
                        written += nr * nc * target.element_size()
    return written
