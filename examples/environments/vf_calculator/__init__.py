"""A `verifiers` (0.4, `verifiers.v1`) environment: multi-digit products with a calculator tool.

Written against the library alone (no megatron_rl import), as an Environments Hub package would be: a
local data set generated from a seed (no download), one tool, and a rubric of two rewards. Train on it
with `agent.environment: verifiers:vf-calculator` (examples/configs/agent_verifiers.yaml; the loader
turns the id into the module name `vf_calculator`, found through `agent.verifiers.import_paths`).
"""
from __future__ import annotations

import random
import re

import verifiers.v1 as vf

from vf_calculator.tools import CalculatorTools

SYSTEM_PROMPT = "You are a helpful assistant."
INSTRUCTION = "Use the calculator tool, then give the final answer as a number."


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d[\d,]*", text)
    return int(found[-1].replace(",", "")) if found else None


class ProductData(vf.TaskData):
    answer: int


class ProductTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProductTaskConfig) -> list[vf.Toolset]:
        return [CalculatorTools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(last_integer(trace.last_reply or "") == self.data.answer)

    @vf.reward(weight=0.1)
    async def used_calculator(self, trace: vf.Trace) -> float:
        """A call the model made (the worked example's call in the prompt is text, not a tool call)."""
        return float(any(m.role == "assistant" and m.tool_calls for m in trace.messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ProductTasksetConfig(vf.TasksetConfig):
    task: ProductTaskConfig = ProductTaskConfig()
    num_examples: int = 288
    digits: list[int] = [4, 3]
    seed: int = 2024
    worked_example: bool = True


def _worked_example(rng: random.Random, digits: list[int]) -> list[dict]:
    a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in digits)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + f"{a} * {b}" + '"}}\n</tool_call>'
    return [{"role": "user", "content": f"What is {a} * {b}? {INSTRUCTION}"},
            {"role": "assistant", "content": call},
            {"role": "tool", "tool_call_id": "call_example", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": f"The answer is {a * b}."}]


class ProductTaskset(vf.Taskset[ProductTask, ProductTasksetConfig]):
    def load(self):
        config = self.config
        rng = random.Random(config.seed)
        example = _worked_example(random.Random(config.seed + 7_777_777), config.digits) if config.worked_example else []
        seen = set()
        while len(seen) < config.num_examples:
            a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in config.digits)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            prompt = [{"role": "system", "content": SYSTEM_PROMPT}, *example,
                      {"role": "user", "content": f"What is {a} * {b}? {INSTRUCTION}"}]
            yield ProductTask(ProductData(id=f"product-{a}x{b}", prompt=prompt, answer=a * b), config.task)


__all__ = ["ProductTaskset"]
