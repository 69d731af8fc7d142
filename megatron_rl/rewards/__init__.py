"""Reward functions: a registry chosen by name in config, user functions by `module:function`.

    reward = Reward(RewardConfig(name="reasoning_gym"))
    result = reward(response_text, prompt)        # RewardResult(reward, correct, extracted, error)
    if not result.ok: count and skip the sample   # a raising reward never kills the run
"""
from megatron_rl.rewards.extract import extract_answer
from megatron_rl.rewards.math_answer import answers_match, have_math_verify
from megatron_rl.rewards.registry import (
    REWARDS,
    Reward,
    RewardConfig,
    RewardResult,
    exact_match_reward,
    math_reward,
    reasoning_gym_reward,
    register_reward,
    resolve_reward,
)

__all__ = [
    "REWARDS", "Reward", "RewardConfig", "RewardResult", "answers_match", "exact_match_reward",
    "extract_answer", "have_math_verify", "math_reward", "reasoning_gym_reward", "register_reward",
    "resolve_reward",
]
