"""Reward functions chosen in config by name, or user functions by import path `module:function`.

A reward function has the signature

    fn(response: str, prompt: Prompt, **kwargs) -> float | RewardResult

(`response` is the decoded model output, `prompt` the `data.sources.Prompt` it answers; `kwargs` come
from `RewardConfig.kwargs`, plus `extract=` for functions that accept it). `Reward` wraps the chosen
function so that scoring never raises: a function that raises, returns a non-number or a non-finite
value gives a `RewardResult` with `error` set to a message naming the reward, the prompt id and the
start of the response. The loop counts such samples (`num_errors`) and leaves them out of training.

Built-in rewards:
- `reasoning_gym`: the task's own `score_answer` on the extracted answer (needs a reasoning-gym prompt);
- `math`: math final-answer equivalence with math-verify (sympy), against `prompt.answer`;
- `exact_match`: normalised string equality of the extracted answer with `prompt.answer`;
- `judge`: an LLM judge behind any OpenAI-compatible endpoint grades with a rubric (rewards/judge.py);
- `reward_model`: a Bradley-Terry `*ForSequenceClassification` checkpoint (rewards/reward_model.py);
- `weighted_sum`: sum_i weight_i * term_i over other rewards (`kwargs.terms`), each term logged.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from megatron_rl.rewards.config import REWARDS, RewardConfig
from megatron_rl.data.reasoning_gym_tasks import score_answer
from megatron_rl.rewards.extract import (
    ExtractMode,
    answer_tag,
    extract_answer,
    is_numeric,
    last_boxed,
    last_line,
    last_number,
)
from megatron_rl.rewards.math_answer import answers_match

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardResult:
    """The score of one response."""

    reward: float
    """Scalar reward (0.0 when `error` is set)."""
    correct: bool | None = None
    """Whether the response counts as correct (for accuracy); None: not applicable."""
    extracted: str | None = None
    """The final answer the reward read from the response, when it extracts one."""
    error: str | None = None
    """Set when the reward function failed on this sample: the message names reward, prompt and error."""
    terms: dict[str, float] | None = None
    """A weighted sum's terms by name, unweighted (`weighted_sum`; logged as rollout/reward_term/<name>)."""

    @property
    def ok(self) -> bool:
        return self.error is None


RewardFn = Callable[..., "float | RewardResult"]


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` (selectable as `RewardConfig.name`; a name
    taken is refused). The built-ins below are listed in `REWARDS` by path."""
    return REWARDS.register(name)


def resolve_reward(name: str) -> RewardFn:
    """A registered reward by name, or a callable by import path `package.module:function`."""
    return REWARDS.resolve(name)


def _describe_sample(prompt: Any, response: str) -> str:
    pid = getattr(prompt, "prompt_id", "?")
    excerpt = response if len(response) <= 80 else response[:77] + "..."
    return f"prompt {pid} (response {excerpt!r})"


class Reward:
    """The configured reward function, made safe: `__call__` never raises."""

    def __init__(self, config: RewardConfig | None = None):
        self.config = config or RewardConfig()
        self.fn = resolve_reward(self.config.name)
        kwargs = dict(self.config.kwargs)
        try:
            params = inspect.signature(self.fn).parameters
            takes_extract = "extract" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            takes_extract = False
        if takes_extract and "extract" not in kwargs:
            kwargs["extract"] = self.config.extract
        self.kwargs = kwargs
        self.num_errors = 0

    def __call__(self, response: str, prompt: Any) -> RewardResult:
        try:
            value = self.fn(response, prompt, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported, not raised
            value = exc
        return self._result(value, response, prompt)

    def _result(self, value: Any, response: str, prompt: Any) -> RewardResult:
        """A function's return value (or the exception it raised) as a checked RewardResult."""
        try:
            if isinstance(value, Exception):
                raise value
            if isinstance(value, RewardResult):
                result = value
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"reward function returned {type(value).__name__}, expected a number "
                                f"or RewardResult")
            else:
                result = RewardResult(reward=float(value))
            if not math.isfinite(result.reward):
                raise ValueError(f"reward function returned a non-finite reward {result.reward}")
            if result.correct is None:
                result.correct = result.reward >= self.config.correct_threshold
            return result
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported, not raised
            self.num_errors += 1
            message = (f"reward {self.config.name!r} failed on {_describe_sample(prompt, response)}: "
                       f"{type(exc).__name__}: {exc}")
            logger.warning(message)
            return RewardResult(reward=0.0, correct=False, error=message)

    def score_batch(self, responses: Sequence[str], prompts: Sequence[Any]) -> list[RewardResult]:
        """Every response scored; a function with a `score_batch` attribute (e.g. the LLM judge, which asks
        concurrently) scores the batch at once, returning per sample a value or the exception it raised."""
        if len(responses) != len(prompts):
            raise ValueError(f"{len(responses)} responses but {len(prompts)} prompts")
        batch = getattr(self.fn, "score_batch", None)
        if batch is None:
            return [self(r, p) for r, p in zip(responses, prompts)]
        try:
            values = list(batch(list(responses), list(prompts), **self.kwargs))
            if len(values) != len(responses):
                raise ValueError(f"score_batch returned {len(values)} results for {len(responses)} responses")
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: each sample's reward error
            values = [exc] * len(responses)
        return [self._result(v, r, p) for v, r, p in zip(values, responses, prompts)]


# --- built-in rewards -------------------------------------------------------------------------------------

def reasoning_gym_reward(response: str, prompt: Any, *, extract: ExtractMode = "auto") -> RewardResult:
    """reasoning-gym's own `score_answer(extracted answer, entry)` for the prompt's task."""
    meta = (getattr(prompt, "metadata", None) or {}).get("reasoning_gym")
    if not meta:
        raise ValueError("the prompt has no reasoning-gym metadata (use a reasoning_gym data source, "
                         "or another reward)")
    entry = meta["entry"]
    answer = extract_answer(response, extract, entry.get("answer"))
    score = score_answer(meta["task"], meta["config"], answer, entry)
    return RewardResult(reward=score, extracted=answer)


def math_reward(response: str, prompt: Any, *, extract: ExtractMode = "auto") -> RewardResult:
    """1.0 when the extracted final answer is equivalent to `prompt.answer` (math-verify), else 0.0.

    Extraction `auto` prefers a boxed answer, then an answer tag, then the last number (when the
    reference is numeric), else the last line."""
    gold = getattr(prompt, "answer", None)
    if gold is None:
        raise ValueError("the prompt has no reference answer")
    if extract == "auto":
        answer = last_boxed(response)
        if answer is None:
            answer = answer_tag(response)
        if answer is None and is_numeric(gold):
            answer = last_number(response)
        isolated = answer is not None
        if answer is None:
            answer = last_line(response)
    else:
        answer = extract_answer(response, extract, gold)
        isolated = extract not in ("last_line", "none")
    ok = answers_match(gold, answer, isolated=isolated)
    return RewardResult(reward=1.0 if ok else 0.0, correct=ok, extracted=answer)


def exact_match_reward(response: str, prompt: Any, *, extract: ExtractMode = "auto") -> RewardResult:
    """1.0 when the extracted answer equals `prompt.answer` up to case, surrounding space and a final period."""
    gold = getattr(prompt, "answer", None)
    if gold is None:
        raise ValueError("the prompt has no reference answer")
    answer = extract_answer(response, extract, gold)

    def norm(s: str) -> str:
        return " ".join(s.strip().rstrip(".").split()).casefold()

    ok = answer is not None and norm(answer) == norm(gold)
    return RewardResult(reward=1.0 if ok else 0.0, correct=ok, extracted=answer)


def soft_match_reward(response: str, prompt: Any, *, extract: ExtractMode = "auto", judge: str | None = None,
                      **judge_kwargs: Any) -> RewardResult:
    """JEPO's soft match (arXiv 2503.19618): the math verifier against the prompt's short answer when it
    has a checkable one (`metadata['short_answer']` with `metadata['verifiable']`, as CHAMP prompts
    carry), else `judge` ('module:function' called as judge(response, prompt, **kwargs), returning a
    number or RewardResult; e.g. an LLM judge). Without a judge such a prompt is a counted reward error."""
    meta = getattr(prompt, "metadata", None) or {}
    short = meta.get("short_answer")
    if short and meta.get("verifiable", True):
        return math_reward(response, SimpleNamespace(answer=short), extract=extract)
    if judge is None:
        raise ValueError("no verifiable short answer and no judge configured (reward.kwargs.judge)")
    value = resolve_reward(judge)(response, prompt, **judge_kwargs)
    return value if isinstance(value, RewardResult) else RewardResult(reward=float(value))


def weighted_sum_batch(responses: Sequence[str], prompts: Sequence[Any], *, terms: Sequence[dict[str, Any]],
                       extract: ExtractMode = "auto") -> list[RewardResult | Exception]:
    """sum_i weight_i * r_i over the rewards `terms` names ([{name, weight, kwargs}], checked by RewardConfig),
    each scored as a whole batch by its own `Reward` (a judge or reward model asks once per batch). A sample
    any term failed on is that term's error; `correct` is the first term's (the rule-based check, when it
    comes first), else the threshold on the sum."""
    parts = [(term["name"], float(term.get("weight", 1.0)),
              Reward(RewardConfig(name=term["name"], extract=extract, kwargs=dict(term.get("kwargs", {})))))
             for term in terms]
    scored = [(name, weight, reward.score_batch(responses, prompts)) for name, weight, reward in parts]
    results = []
    for i in range(len(responses)):
        failed = next((s[i].error for _, _, s in scored if not s[i].ok), None)
        if failed is not None:
            results.append(ValueError(failed))
            continue
        values = {name: s[i].reward for name, _, s in scored}
        total = sum(weight * s[i].reward for _, weight, s in scored)
        results.append(RewardResult(reward=total, correct=scored[0][2][i].correct, extracted=scored[0][2][i].extracted,
                                    terms=values))
    return results


def weighted_sum_reward(response: str, prompt: Any, **kwargs: Any) -> RewardResult:
    result = weighted_sum_batch([response], [prompt], **kwargs)[0]
    if isinstance(result, Exception):
        raise result
    return result


weighted_sum_reward.score_batch = weighted_sum_batch  # type: ignore[attr-defined]
