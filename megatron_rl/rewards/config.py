"""The reward section (`reward:`), importable without the reward functions' dependencies (math-verify, sympy)."""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.config import Registry, require
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
    "weighted_sum": "megatron_rl.rewards.registry:weighted_sum_reward",
})


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """Which reward function scores the responses."""

    name: str = "reasoning_gym"
    """A registered reward (reasoning_gym, math, exact_match, soft_match, judge (an LLM judge at an
    OpenAI-compatible URL, rewards/judge.py), reward_model (an HF *ForSequenceClassification checkpoint,
    rewards/reward_model.py), weighted_sum (kwargs.terms: [{name, weight, kwargs}] of other rewards, e.g. a
    rule-based check plus a reward model, each term logged), or one a module of `imports:`
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
        if self.name == "weighted_sum":
            terms = self.kwargs.get("terms")
            require(isinstance(terms, list) and len(terms) > 0, "kwargs.terms",
                    "weighted_sum needs a non-empty list of terms [{name, weight, kwargs}]")
            for i, term in enumerate(terms):
                require(isinstance(term, dict) and set(term) <= {"name", "weight", "kwargs"} and "name" in term,
                        f"kwargs.terms[{i}]", f"must be a mapping with name and optional weight, kwargs; got {term!r}")
                require(term["name"] != "weighted_sum", f"kwargs.terms[{i}].name", "a term cannot be weighted_sum")
                REWARDS.check(term["name"], f"kwargs.terms[{i}].name")
                weight = term.get("weight", 1.0)
                require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and abs(weight) <= 1000,
                        f"kwargs.terms[{i}].weight", f"must be a number in [-1000, 1000], got {weight!r}")
                require(isinstance(term.get("kwargs", {}), dict), f"kwargs.terms[{i}].kwargs", "must be a mapping")
