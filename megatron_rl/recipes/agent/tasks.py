"""Calculator tasks: multi-digit multiplication and long chain sums, generated from a seed, graded on
the final answer."""
from __future__ import annotations

import random
import re

from megatron_rl.data.prompts import Prompt, PromptDataset, stable_id
from megatron_rl.recipes.agent.config import CalculatorTaskConfig
from megatron_rl.recipes.agent.environment import WorkedExample
from megatron_rl.recipes.agent.tools import ToolCall

_INTEGER = re.compile(r"-?\d[\d,_]*")


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _problem(rng: random.Random, config: CalculatorTaskConfig) -> tuple[str, int]:
    if config.kind == "multiply":
        a, b = (_number(rng, d) for d in config.digits)
        return f"What is {a} * {b}?", a * b
    terms = [_number(rng, config.digits[0]) for _ in range(config.terms)]
    return f"What is {' + '.join(map(str, terms))}?", sum(terms)


def build_calculator_datasets(config: CalculatorTaskConfig) -> tuple[PromptDataset, PromptDataset]:
    """(train, heldout): distinct problems, the held-out ones drawn first."""
    rng = random.Random(config.seed)
    seen: set[str] = set()
    problems: list[Prompt] = []
    while len(problems) < config.heldout_size + config.train_size:
        question, answer = _problem(rng, config)
        if question in seen:
            continue
        seen.add(question)
        content = f"{question} {config.instruction}".strip()
        problems.append(Prompt(prompt_id=stable_id(f"calc-{config.kind}", question, str(answer)),
                               messages=[{"role": "user", "content": content}], question=question,
                               answer=str(answer), metadata={"agent_task": {"kind": config.kind}}))
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
    rng = random.Random(config.seed + 7_777_777)
    out: list[WorkedExample] = []
    while len(out) < count:
        question, answer = _problem(rng, config)
        if question in train_and_heldout:
            continue
        expression = question.removeprefix("What is ").rstrip("?")
        out.append(WorkedExample(f"{question} {config.instruction}".strip(),
                                 ToolCall(name="calculator", arguments={"expression": expression}),
                                 str(answer), f"The answer is {answer}."))
    return out
