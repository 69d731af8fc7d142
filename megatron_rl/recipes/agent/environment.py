"""Environments of multi-turn agent episodes: what the model's messages do, and when an episode ends.

An episode alternates the policy and its environment:

    messages = env.reset(prompt)                 # the chat the first turn answers
    while True:
        text = <the policy's next assistant message>
        step = env.step(text)                    # new tool / user messages, reward, done
        if step.done: break
        messages += [assistant(text), *step.messages]

`ToolEnvironment` runs the tools the model calls (parsed by a `ToolCallFormat` from tools.py, run in a
`Sandbox` from sandbox.py) and answers each call with a tool message; a message without a tool call is
the final answer, graded by the task. The episode producer (episodes.py) turns the turns into one
token-exact trajectory.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Protocol, Sequence

from megatron_rl.data.prompts import Prompt
from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits
from megatron_rl.data.tool_calls import ToolCall, ToolCallFormat, template_renders_tools
from megatron_rl.recipes.agent.tools import Tool, hermes_tools_prompt, run_tool_call


@dataclasses.dataclass
class EnvStep:
    """What the environment answers to one assistant message."""

    messages: list[dict[str, Any]]
    """Messages to append after the assistant's (tool results, a user reply); empty when done."""
    reward: float | None
    """The episode's reward when it ends here (None while it goes on)."""
    done: bool
    """The episode is over (a final answer, or the turn budget spent)."""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Counts of this step for metrics: tool_calls, malformed_calls, tool_errors, and `end` when done."""


class Environment(Protocol):
    """One episode's environment (a fresh one per episode: it may keep state between turns)."""

    max_turns: int
    """Assistant messages allowed per episode; the environment ends the episode at the last one."""
    tools: Sequence[Tool]
    """Tools offered to the model (their schemas reach chat templates that render tools); may be empty."""

    def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        """Start the episode of `prompt`: the messages the first turn answers."""

    def step(self, assistant_text: str) -> EnvStep:
        """React to the policy's assistant message."""

    def close(self) -> None:
        """Release what the episode held (the sandbox)."""


Grader = Callable[[str, Prompt], float]
"""(final assistant message, prompt) -> reward."""


@dataclasses.dataclass(frozen=True)
class WorkedExample:
    """A solved problem shown as earlier chat turns: question, the tool call, its result, the answer."""

    question: str
    call: ToolCall
    result: str
    answer: str


def tool_instructions(tools: Sequence[Tool], tool_format: ToolCallFormat) -> str:
    """A system-prompt text describing the tools and how to call them, for chat templates that do not
    render `tools` themselves (SmolLM2's, for one)."""
    if tool_format.name == "hermes":
        text = hermes_tools_prompt(tools)
    else:
        example = tools[0]
        arguments = {name: "..." for name in (example.parameters or {}).get("properties", {})}
        text = "You can call these tools:\n" + "\n".join(json.dumps(t.schema()["function"]) for t in tools) + (
            "\nTo call a tool, reply with exactly:\n"
            + tool_format.render_call(ToolCall(name=example.name, arguments=arguments, text="")))
    return text + ("\n\nThe result comes back in a tool message. When you know the answer, reply with the final "
                   "answer only, without a tool call.")


def with_tool_instructions(messages: Sequence[dict[str, Any]], tools: Sequence[Tool],
                           tool_format: ToolCallFormat) -> list[dict[str, Any]]:
    """`messages` with the tool instructions at the end of the system message (one is added when there
    is none): for chat templates that do not render `tools` themselves."""
    messages = [dict(m) for m in messages]
    text = tool_instructions(tools, tool_format)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + text
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages


def renders_tools(chat_template: Any) -> bool:
    """Whether the chat template (or any of a named set) renders `tools` itself."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(template_renders_tools(t) for t in templates)


class ToolEnvironment:
    """Tool use: each tool call in an assistant message is run and answered with a tool message; a
    message without a tool call is the final answer, graded by `grade`. Malformed calls are answered
    with their error (the model may retry) and counted. At the `max_turns`-th assistant message the
    episode ends whatever it says (a tool call there earns reward 0). The tool instructions go into the
    system message when the chat template does not render `tools` itself; `examples` are shown as
    earlier turns of the chat (a small model imitates the format)."""

    def __init__(self, tools: Sequence[Tool], tool_format: ToolCallFormat, grade: Grader, *, max_turns: int,
                 limits: SandboxLimits | None = None, chat_template: Any = None,
                 examples: Sequence[WorkedExample] = ()):
        self.tools = list(tools)
        self.by_name = {tool.name: tool for tool in self.tools}
        self.tool_format = tool_format
        self.grade = grade
        self.max_turns = max_turns
        self.limits = limits or SandboxLimits()
        self.examples = list(examples)
        self.instructions_in_system = not renders_tools(chat_template)
        self.sandbox: Sandbox | None = None
        self.prompt: Prompt | None = None
        self.turns = 0

    def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        self.prompt, self.turns = prompt, 0
        messages = [dict(m) for m in prompt.messages]
        if self.examples:  # after the prompt's own system message, before its question
            at = 1 if messages and messages[0]["role"] == "system" else 0
            messages[at:at] = [m for example in self.examples for m in self._shown(example)]
        if self.instructions_in_system and self.tools:
            messages = with_tool_instructions(messages, self.tools, self.tool_format)
        return messages

    def _shown(self, example: WorkedExample) -> list[dict[str, Any]]:
        return [{"role": "user", "content": example.question},
                {"role": "assistant", "content": self.tool_format.render_call(example.call)},
                self.tool_format.tool_message(example.call, example.result),
                {"role": "assistant", "content": example.answer}]

    def step(self, assistant_text: str) -> EnvStep:
        self.turns += 1
        parsed = self.tool_format.parse(assistant_text)
        info = {"tool_calls": len(parsed.calls), "malformed_calls": len(parsed.errors), "tool_errors": 0}
        if not parsed.calls and not parsed.errors:
            return EnvStep([], self.grade(assistant_text, self.prompt), True, {**info, "end": "answer"})
        if self.turns >= self.max_turns:
            return EnvStep([], 0.0, True, {**info, "end": "max_turns"})
        messages = []
        for call in parsed.calls:
            if self.sandbox is None:
                self.sandbox = Sandbox(self.limits).__enter__()
            result = run_tool_call(call, self.by_name, self.sandbox)
            info["tool_errors"] += result.error is not None
            messages.append(self.tool_format.tool_message(call, result.content))
        for error in parsed.errors:
            messages.append({"role": "tool", "content": f"Error: {error}"})
        return EnvStep(messages, None, False, info)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
