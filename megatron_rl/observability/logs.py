"""How the library's log records reach the terminal: configured once, by the `megatron-rl` entry point.

Library modules only do `log = logging.getLogger(__name__)`; without `configure_logging` (the library
used from Python, the tests) their records go wherever the embedding program sends them.

On the terminal: progress (INFO) on stdout, where the step lines have always been, and problems
(WARNING and above) on stderr, each line stamped with the UTC time like the step lines. The driver
(rank 0) reports progress; the other ranks of a torchrun / srun launch would repeat it N times, so they
log warnings only, prefixed with their rank.
"""
from __future__ import annotations

import logging
import os
import sys
import time

PACKAGES = ("megatron_rl",)  # whose loggers the CLI configures


class _TerminalHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr. The streams are looked up at each record,
    not captured once: W&B's console wrap and pytest's capture replace sys.stdout / sys.stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a closed or broken stream must not take the run down with it
            self.handleError(record)


class _UTCFormatter(logging.Formatter):
    converter = time.gmtime


def launch_rank() -> int:
    """This process's rank in its torchrun / srun launch (0 when launched alone), read from the
    environment: logging is configured before torch.distributed is initialised."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def configure_logging(rank: int | None = None) -> None:
    """Send our packages' records to the terminal (idempotent: calling it again replaces the handler)."""
    rank = launch_rank() if rank is None else rank
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler = _TerminalHandler()
    handler.setFormatter(_UTCFormatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _TerminalHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
