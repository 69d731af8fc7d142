"""Stopping a run early, cleanly: at the next step boundary the run writes a checkpoint and exits 0, so
that a relaunch (or Slurm's requeue) resumes it with nothing lost.

Asked for by SIGTERM or SIGUSR1 (what `scancel` and Slurm's `--signal` before the time limit send), or
by a `STOP` file in the run directory: examples/slurm_common.sh writes that file, because a signal sent
to the batch script does not reliably cross srun and torchrun to every trainer rank. Ranks may notice
at different steps, so they agree (any rank's request stops all) before anyone acts on it.
"""
from __future__ import annotations

import os
import signal
import threading

from megatron_rl import ranks

STOP_FILE = "STOP"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, STOP_FILE)
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def reason(self) -> str | None:
        """Why this rank was asked to stop, if it was."""
        if self.signal_name is not None:
            return self.signal_name
        if os.path.exists(self.path):
            return f"{self.path} exists"
        return None

    def agreed(self) -> bool:
        """True on every rank iff any rank was asked to stop (a collective: call it on every rank)."""
        return not ranks.all_ranks_agree(self.reason() is None)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
