"""Reward registry, answer extraction, math equivalence, reasoning-gym scoring, and error reporting."""
from __future__ import annotations

import math
import sys
import types

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data.config import DataConfig, SourceConfig
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.sources import build_datasets
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.math_answer import answers_match, have_math_verify
from megatron_rl.rewards.registry import REWARDS, Reward, RewardResult, register_reward
from megatron_rl.rewards.extract import extract_answer, last_boxed, last_number


def prompt(answer: str, pid: str = "p0") -> Prompt:
    return Prompt(prompt_id=pid, messages=[{"role": "user", "content": "q"}], question="q", answer=answer)


@pytest.mark.parametrize("text,expected", [
    ("5 - 9 = -4", "-4"),
    ("12-3", "3"),
    ("The total is 1,234.5.", "1234.5"),
    ("so x = (3)-2", "2"),
    ("ratio 3/4", "3/4"),
    ("\u22127 degrees", "-7"),
    ("first 10 then 20", "20"),
    ("no digits here", None),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_extraction_modes():
    text = r"work: 1+1 \boxed{\frac{1}{2}} then <answer> 42 </answer>" + "\nlast line 7"
    assert extract_answer(text, "answer_tag") == "42"
    assert extract_answer(text, "boxed") == r"\frac{1}{2}"
    assert extract_answer(text, "last_number") == "7"
    assert extract_answer(text, "last_line") == "last line 7"
    assert extract_answer(text, "auto", "42") == "42"  # the tag wins
    assert extract_answer("it is 12. Then 13", "auto", "13") == "13"
    assert extract_answer("use 4*6 - 1\n\n4*6-1", "auto", "4*6-1") == "4*6-1"  # non-numeric: last line
    assert last_boxed(r"\boxed{a{b}c} and \boxed{x^{2}+1}") == "x^{2}+1"
    assert last_boxed(r"\boxed{unclosed") is None


@pytest.mark.parametrize("gold,pred,ok", [
    ("1000", "1,000", True),
    ("0.5", "1/2", True),
    ("-37", "-37.0", True),
    ("3", "5", False),
    ("3", None, False),
    (r"\frac{1}{2}", "0.5", True),
    (r"x^2+1", r"1+x^2", True),
    (r"\sqrt{2}", r"2^{1/2}", True),
    (r"\frac{1}{3}", "0.33", False),
])
def test_answers_match(gold, pred, ok):
    if not have_math_verify() and ("\\" in gold or "^" in gold):
        pytest.skip("symbolic equivalence needs math-verify")
    assert answers_match(gold, pred) is ok


def test_math_reward_extracts_the_final_answer():
    reward = Reward(RewardConfig(name="math"))
    assert reward(r"First 3, so the answer is \boxed{\frac{6}{4}}", prompt("1.5")).reward == 1.0
    assert reward("3 apples plus 4 is 7", prompt("7")).correct is True
    r = reward("7 is what I first thought but it's 8", prompt("7"))
    assert r.reward == 0.0 and r.extracted == "8" and r.ok
    assert reward("", prompt("7")).reward == 0.0
    if have_math_verify():  # a symbolic reference and no boxed answer: math-verify reads the last line
        assert reward("Working...\nIt is 1/2", prompt(r"\frac{1}{2}")).correct
        assert reward(r"so \boxed{1+x^2}", prompt("x^2+1")).correct
        assert not reward(r"so \boxed{1+x^3}", prompt("x^2+1")).correct


def test_exact_match_reward():
    reward = Reward(RewardConfig(name="exact_match"))
    assert reward("<answer>Paris.</answer>", prompt("paris")).correct
    assert not reward("<answer>Lyon</answer>", prompt("paris")).correct


def test_reasoning_gym_reward_uses_the_tasks_scorer():
    cfg = DataConfig(train=SourceConfig(size=10), heldout_size=3)
    _, heldout = build_datasets(cfg)
    reward = Reward(RewardConfig(name="reasoning_gym"))
    p = heldout[0]
    right = reward(f"The sum is {p.answer}.", p)
    assert right.reward == 1.0 and right.correct and right.extracted == p.answer
    wrong = reward(f"{p.answer} no wait, {int(p.answer) + 1}", p)
    assert wrong.reward == 0.0 and not wrong.correct
    assert reward(f"<answer>{p.answer}</answer>", p).reward == 1.0


def test_reasoning_gym_countdown_scoring():
    cfg = DataConfig(train=SourceConfig(task="countdown", task_config={}, size=5), heldout_size=2)
    _, heldout = build_datasets(cfg)
    p = heldout[0]
    reward = Reward(RewardConfig(name="reasoning_gym"))
    assert reward(f"Let me think.\n{p.answer}", p).reward == 1.0
    assert reward("Let me think.\n1 + 2", p).reward < 1.0


def test_raising_reward_is_reported_with_the_sample_not_raised():
    module = types.ModuleType("my_user_rewards")

    def flaky(response, prompt, *, bonus=0.0):
        if "boom" in response:
            raise RuntimeError("scorer exploded")
        return len(response) / 10 + bonus

    def bad_type(response, prompt):
        return "high"

    def not_finite(response, prompt):
        return math.nan

    module.flaky, module.bad_type, module.not_finite = flaky, bad_type, not_finite
    sys.modules["my_user_rewards"] = module
    try:
        reward = Reward(RewardConfig(name="my_user_rewards:flaky", kwargs={"bonus": 1.0}, correct_threshold=1.5))
        good = reward("12345", prompt("x", "ok-1"))
        assert good == RewardResult(reward=1.5, correct=True)
        results = reward.score_batch(["fine", "boom goes the scorer"], [prompt("x", "a"), prompt("x", "bad-7")])
        assert results[0].ok and not results[1].ok
        assert "bad-7" in results[1].error and "scorer exploded" in results[1].error
        assert "boom goes the scorer" in results[1].error and "RuntimeError" in results[1].error
        assert reward.num_errors == 1
        assert "expected a number" in Reward(RewardConfig(name="my_user_rewards:bad_type"))("a", prompt("x")).error
        assert "non-finite" in Reward(RewardConfig(name="my_user_rewards:not_finite"))("a", prompt("x")).error
    finally:
        del sys.modules["my_user_rewards"]


def test_registry_and_config_errors():
    assert {"reasoning_gym", "math", "exact_match"} <= set(REWARDS)

    @register_reward("test_constant_reward")
    def constant(response, prompt):
        return 0.25

    try:
        assert Reward(RewardConfig(name="test_constant_reward"))("x", prompt("1")).reward == 0.25
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_constant_reward")(constant)
    finally:
        REWARDS.unregister("test_constant_reward")
    with pytest.raises(ConfigError, match="name.*unknown reward"):
        RewardConfig(name="nope")
    with pytest.raises(ConfigError, match="cannot import module"):
        RewardConfig(name="no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no attribute"):
        RewardConfig(name="math:no_such_fn")


def test_config_names_match_the_registry():
    """The reward section validates names without importing the reward functions: its registry's built-ins
    are the functions of rewards/registry.py."""
    from megatron_rl.rewards import judge, registry, reward_model

    assert {name: registry.resolve_reward(name) for name in REWARDS} == {
        "reasoning_gym": registry.reasoning_gym_reward, "math": registry.math_reward,
        "exact_match": registry.exact_match_reward, "soft_match": registry.soft_match_reward,
        "judge": judge.judge_reward, "reward_model": reward_model.reward_model_reward,
        "weighted_sum": registry.weighted_sum_reward}
