"""The loop's configuration, importable without torch: the curriculum hook (`curriculum:`) and the names
of the registered training objectives (`algorithm.objective`)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import require
from megatron_rl.trainer.config import ValueModelConfig

# Training objectives (controller/objectives.py), name -> "module:Class": imported when a run builds one,
# so that validating a config imports no algorithm (and no torch).
OBJECTIVES: dict[str, str] = {
    "policy_gradient": "megatron_rl.controller.objectives:PolicyGradientObjective",
    "jepo": "megatron_rl.recipes.jepo.objective:JepoObjective",
    "sft": "megatron_rl.recipes.jepo.objective:SftObjective",
}


@dataclasses.dataclass(kw_only=True)
class CurriculumConfig:
    """Which prompts each step generates: all (none), a pre-filtered subset, dynamic sampling, or PCL."""

    kind: Literal["none", "prefilter", "dynamic_sampling", "pcl"] = "none"
    """none: plain stream order; prefilter: mixed-reward prompts of one initial rollout; dynamic_sampling:
    roll out k*m, keep mixed-reward groups (DAPO); pcl: value-model selection (PCL)."""
    candidates_factor: int = 4
    """k: candidates drawn per selected prompt (dynamic_sampling and pcl draw k*m prompts a step)."""
    target: float = 0.5
    """tau: pcl keeps the m candidates whose predicted reward V(x) is closest to it."""
    prefilter_pool: int = 256
    """prefilter: prompts rolled out once (n samples each) with the initial policy before training."""
    value: ValueModelConfig = dataclasses.field(default_factory=ValueModelConfig)
    """pcl: the value model."""

    def __post_init__(self) -> None:
        require(self.candidates_factor >= 1, "candidates_factor", "must be >= 1")
        require(self.prefilter_pool >= 1, "prefilter_pool", "must be >= 1")


