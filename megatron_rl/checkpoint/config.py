"""The run's checkpoint configuration (`checkpoint:`), importable without torch."""
from __future__ import annotations

import dataclasses

from megatron_rl.config import require


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and how many checkpoints to keep."""

    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end of the run)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    save_at_end: bool = True
    """Save after the last step."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", "must be >= 0")
        require(self.keep_last >= 1, "keep_last", "must be >= 1")
