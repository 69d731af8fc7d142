"""Held-out evaluation: what a run measures before, during and after training, and when.

`HeldoutEvaluation` is the run's evaluator: the recipe gives it what to measure (a function returning
named metrics; by default `accuracy` below plus the metrics `eval.metrics` names) and it owns the cadence
(`eval.before_training`, `eval.every_steps`, `eval.after_training`). Every rank calls it: a metric may
score on the trainer ranks (JEPO's likelihood); the driver's result is the one logged.
"""
from __future__ import annotations

from typing import Callable, Sequence

from tqdm import tqdm

from megatron_rl.controller.config import EVAL_METRICS
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.types import Completion

# Held-out metrics beside accuracy (`eval.metrics`, controller/config.py's EVAL_METRICS):
# fn(engine, policy, tokenizer, prompts, config) -> dict; each lives with its recipe and is imported when
# a run asks for it. On the trainer ranks other than the driver it is called with engine None and no
# prompts (it joins collectives).


class HeldoutEvaluation:
    """The run's held-out evaluation and its cadence (`eval:` section)."""

    def __init__(self, config, measure: Callable[[int], dict[str, float]]):
        """`measure(step)`: the held-out metrics after `step` optimizer steps, by name."""
        self.config = config
        self.measure = measure

    def before_training(self, start_step: int) -> bool:
        return start_step == 0 and self.config.before_training

    def due(self, step: int, last_step: int) -> bool:
        """Whether step `step` (1-based) evaluates on its way (the last step's is `after_training`)."""
        every = self.config.every_steps
        return bool(every) and step % every == 0 and step < last_step

    @property
    def after_training(self) -> bool:
        return self.config.after_training

    def __call__(self, step: int) -> dict[str, float]:
        """Held-out metrics after `step` steps as eval/NAME ({} on trainer ranks other than the driver)."""
        return {f"eval/{k}": v for k, v in self.measure(step).items()}


def heldout_metrics(run_config, *, engine, policy, tokenizer: ChatTokenizer, prompts: Sequence[Prompt],
                    reward: Reward | None, driver: bool) -> Callable[[int], dict[str, float]]:
    """The default held-out measurement: greedy accuracy with the reward (driver), then each further
    metric `eval.metrics` names (EVAL_METRICS), on every rank."""
    extra = []
    for name in run_config.eval.metrics:
        if name != "accuracy":  # the greedy pass below
            extra.append(EVAL_METRICS.resolve(name))

    def measure(step: int) -> dict[str, float]:
        if not driver:
            for metric in extra:
                metric(None, policy, tokenizer, [], run_config)
            return {}
        result = evaluate(engine, tokenizer, list(prompts), reward, max_new_tokens=run_config.eval.max_new_tokens,
                          progress=True)
        for metric in extra:
            result.update(metric(engine, policy, tokenizer, list(prompts), run_config))
        return result

    return measure


def evaluate(engine, tokenizer: ChatTokenizer, prompts: Sequence[Prompt], reward: Reward, *,
             max_new_tokens: int, samples: int = 1, temperature: float = 0.0, seed: int = 0,
             progress: bool = False) -> dict[str, float]:
    """Held-out accuracy: greedy (samples=1, temperature 0) or mean@k (fraction correct over k samples)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=samples,
                            seed=seed if temperature > 0 else None)
    requests = [GenerateRequest(request_id=f"eval-{i}-{p.prompt_id}", prompt_ids=tokenizer.encode_chat(p.messages),
                                sampling=params, group_id=p.prompt_id) for i, p in enumerate(prompts)]
    futures = engine.submit(requests)
    completions: list[Completion] = []
    chunk = 16 * samples  # the engine keeps every request in flight; waiting in chunks feeds the bar
    with tqdm(total=len(prompts), desc="evaluate", disable=not progress, leave=False) as bar:
        for start in range(0, len(futures), chunk):
            completions.extend(engine.wait(futures[start:start + chunk]))
            bar.update(len(futures[start:start + chunk]) // samples)
    correct = total = errors = 0
    lengths = []
    for index, prompt in enumerate(prompts):
        for completion in completions[index * samples:(index + 1) * samples]:
            result = reward(tokenizer.decode(completion.output_ids), prompt)
            correct += int(bool(result.correct))
            errors += int(not result.ok)
            total += 1
            lengths.append(len(completion.output_ids))
    return {"accuracy": correct / max(total, 1), "samples": total, "reward_errors": errors,
            "response_length_mean": sum(lengths) / max(len(lengths), 1)}
