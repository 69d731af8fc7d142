"""Calculator tasks: multi-digit multiplication and long chain sums, generated from a seed, or the
arithmetic generators of reasoning-gym (products, chain_sum, basic_arithmetic), graded on the final answer."""
from __future__ import annotations

import math
import random
import re
from typing import Iterator

from megatron_rl.config import ConfigError
from megatron_rl.data.reasoning_gym_tasks import create_task_dataset

from megatron_rl.data.prompts import Prompt, PromptDataset, stable_id
from megatron_rl.recipes.agent.config import CalculatorTaskConfig
from megatron_rl.recipes.agent.environment import WorkedExample
from megatron_rl.data.tool_calls import ToolCall

_INTEGER = re.compile(r"-?\d[\d,_]*")


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _problems(config: CalculatorTaskConfig, seed: int, wanted: int) -> Iterator[tuple[str, int, str]]:
    """(question, integer answer, the calculator expression that solves it): enough draws for `wanted`
    distinct problems where the task has that many (the caller drops repeats)."""
    if config.kind != "reasoning_gym":
        rng = random.Random(seed)
        for _ in range(100 * wanted + 1000):  # bounded: a tiny problem space ends the draw instead of spinning
            numbers = [_number(rng, d) for d in config.digits] if config.kind == "multiply" else \
                [_number(rng, config.digits[0]) for _ in range(config.terms)]
            expression = " * ".join(map(str, numbers)) if config.kind == "multiply" else " + ".join(map(str, numbers))
            yield f"What is {expression}?", math.prod(numbers) if config.kind == "multiply" else sum(numbers), expression
        return
    # reasoning-gym draws a fixed-size data set from a seed; twice the problems wanted leaves room for
    # repeats and non-integer answers
    size = 2 * wanted + 16
    try:
        dataset = create_task_dataset(config.reasoning_gym_task, config.task_config, size=size, seed=seed)
    except Exception as exc:  # an unknown task or option: reasoning-gym's own message
        raise ConfigError(f"agent.task: reasoning-gym task {config.reasoning_gym_task!r} with "
                          f"{config.task_config}: {exc}") from exc
    for i in range(size):
        entry = dataset[i]
        expression = (entry.get("metadata") or {}).get("expression")
        answer = str(entry["answer"]).strip()
        if expression is None:
            raise ConfigError(f"agent.task.reasoning_gym_task: {config.reasoning_gym_task!r} entries carry no "
                              "expression for the calculator (use an arithmetic task: products, chain_sum, "
                              "basic_arithmetic)")
        if re.fullmatch(r"-?\d+", answer):
            yield entry["question"].strip(), int(answer), str(expression)


def build_calculator_datasets(config: CalculatorTaskConfig) -> tuple[PromptDataset, PromptDataset]:
    """(train, heldout): distinct problems, the held-out ones drawn first."""
    wanted = config.heldout_size + config.train_size
    seen: set[str] = set()
    problems: list[Prompt] = []
    task = {"kind": config.kind, **({"task": config.reasoning_gym_task} if config.kind == "reasoning_gym" else {})}
    for question, answer, expression in _problems(config, config.seed, wanted):
        if len(problems) == wanted:
            break
        if question in seen:
            continue
        seen.add(question)
        content = f"{question} {config.instruction}".strip()
        problems.append(Prompt(prompt_id=stable_id(f"calc-{config.kind}", question, str(answer)),
                               messages=[{"role": "user", "content": content}], question=question,
                               answer=str(answer), metadata={"agent_task": {**task, "expression": expression}}))
    if len(problems) < wanted:
        raise ConfigError(f"agent.task: the {config.kind} task gave only {len(problems)} distinct problems with an "
                          f"integer answer; train_size + heldout_size = {wanted} (widen its digits or task_config)")
    heldout = PromptDataset("calculator_heldout", problems[:config.heldout_size])
    return PromptDataset("calculator_train", problems[config.heldout_size:]), heldout


def final_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators allowed), or None."""
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "").replace("_", "")
    try:
        return int(digits)
    except ValueError:
        return None


def grade_final_answer(text: str, prompt: Prompt) -> float:
    """1.0 when the final message's last integer is the reference answer, else 0.0."""
    value = final_integer(text)
    return float(value is not None and prompt.answer is not None and value == int(prompt.answer))


def worked_examples(config: CalculatorTaskConfig, count: int) -> list[WorkedExample]:
    """`count` solved problems of the task with the calculator, drawn apart from the data sets' problems
    (another seed; a clash with a training or held-out question is skipped)."""
    train_and_heldout = {p.question for d in build_calculator_datasets(config) for p in d} if count else set()
    out: list[WorkedExample] = []
    for question, answer, expression in _problems(config, config.seed + 7_777_777, count + len(train_and_heldout)):
        if len(out) == count:
            break
        if question in train_and_heldout:
            continue
        out.append(WorkedExample(f"{question} {config.instruction}".strip(),
                                 ToolCall(name="calculator", arguments={"expression": expression}),
                                 str(answer), f"The answer is {answer}."))
    return out
