"""JEPO's evaluation configuration (`eval.likelihood:`), importable without torch (the objective's own
section, `algorithm.jepo:`, is in algorithms/config.py next to the bound it parameterises)."""
from __future__ import annotations

import dataclasses

from megatron_rl.config import require


@dataclasses.dataclass(kw_only=True)
class LikelihoodEvalConfig:
    """The held-out likelihood metric (eval.metrics: [likelihood])."""

    samples: int = 4
    """n: chains of thought per prompt in the bound log mean_i pi(a*|x,c_i)."""
    max_new_tokens: int = 64
    """Longest chain of thought sampled before the marker."""
    temperature: float = 1.0
    """Sampling temperature of the chains of thought (1: the policy itself, as the bound assumes)."""
    answer_marker: str = "The final answer is"
    """Text after which the reference is scored (keep it equal to algorithm.jepo.answer_marker)."""
    score_end_of_turn: bool = True
    """Score the end-of-turn token after the reference too."""
    micro_batch_rows: int = 8
    """Rows per scoring forward pass."""

    def __post_init__(self) -> None:
        require(self.samples >= 1, "samples", "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.temperature > 0, "temperature", "must be > 0 (the bound needs samples of the policy)")
        require(bool(self.answer_marker.strip()), "answer_marker", "must not be empty")
        require(self.micro_batch_rows >= 1, "micro_batch_rows", "must be >= 1")
