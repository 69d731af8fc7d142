"""The reward section (`reward:`), importable without the reward functions' dependencies (math-verify, sympy)."""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.config import Registry
from megatron_rl.rewards.extract import ExtractMode

# The rewards registry (rewards/registry.py's signature), here so that a config names a reward without
# importing its dependencies; `registry.register_reward` is REWARDS.register (docs/extending.md).
REWARDS = Registry("reward", {
    "reasoning_gym": "megatron_rl.rewards.registry:reasoning_gym_reward",
    "math": "megatron_rl.rewards.registry:math_reward",
    "exact_match": "megatron_rl.rewards.registry:exact_match_reward",
    "soft_match": "megatron_rl.rewards.registry:soft_match_reward",
    "judge": "megatron_rl.rewards.judge:judge_reward",
    "reward_model": "megatron_rl.rewards.reward_model:reward_model_reward",
})


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """Which reward function scores the responses."""

    name: str = "reasoning_gym"
    """A registered reward (reasoning_gym, math, exact_match, soft_match, judge (an LLM judge at an
    OpenAI-compatible URL, rewards/judge.py), reward_model (an HF *ForSequenceClassification checkpoint,
    rewards/reward_model.py), or one a module of `imports:`
    registers with `register_reward`) or a user function 'package.module:function'."""
    extract: ExtractMode = "auto"
    """How the final answer is found in the response (auto: answer tag, boxed, last number when the
    reference is a number, else last line); passed to functions that take an `extract` argument."""
    correct_threshold: float = 1.0
    """A response counts as correct (accuracy) when its reward is >= this (unless the function says)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for the reward function."""

    def __post_init__(self) -> None:
        REWARDS.check(self.name, "name")
