"""The reward section (`reward:`), importable without the reward functions' dependencies (math-verify, sympy)."""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.config import import_object, require
from megatron_rl.rewards.extract import ExtractMode

# The registered rewards' names (rewards/registry.py); `register_reward` adds a user reward's name here.
REWARD_NAMES: set[str] = {"reasoning_gym", "math", "exact_match", "soft_match"}


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """Which reward function scores the responses."""

    name: str = "reasoning_gym"
    """A registered reward (reasoning_gym, math, exact_match) or a user function 'module:function'."""
    extract: ExtractMode = "auto"
    """How the final answer is found in the response (auto: answer tag, boxed, last number when the
    reference is a number, else last line); passed to functions that take an `extract` argument."""
    correct_threshold: float = 1.0
    """A response counts as correct (accuracy) when its reward is >= this (unless the function says)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for the reward function."""

    def __post_init__(self) -> None:
        if ":" not in self.name:
            require(self.name in REWARD_NAMES, "name", f"unknown reward {self.name!r}: registered "
                    f"{sorted(REWARD_NAMES)}, or give a user function as 'module:function'")
            return
        try:  # a user function: importing its module now names a typo before the run starts
            fn = import_object(self.name, "reward")
        except ValueError as exc:
            require(False, "name", str(exc))
        require(callable(fn), "name", f"reward {self.name!r}: {self.name.partition(':')[2]!r} is not callable")
