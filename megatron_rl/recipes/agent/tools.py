"""Tools an agent calls (docs/agents.md), run in a `Sandbox`: `Calculator` (exact integer arithmetic through
`ast`), `PythonTool`; checking a parsed call's arguments against its tool's schema, and running it. How a
model writes the calls is the template's tool-call format (data/tool_calls.py).
"""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from megatron_rl.data.tool_calls import ToolCall, tojson
from megatron_rl.recipes.agent.arithmetic import ExpressionError, evaluate_arithmetic  # noqa: F401 (re-exported)
from megatron_rl.recipes.agent.sandbox import Sandbox


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool returns to the model: `content` is the tool message's text (it carries the error text
    too); `error` is one line when the call failed, else None."""

    content: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object

    def schema(self) -> dict:
        """The OpenAI function schema `apply_chat_template(tools=[...])` renders."""
        ...

    def run(self, arguments: dict, sandbox: Sandbox) -> ToolResult:
        ...


def function_schema(tool: Tool) -> dict:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def hermes_tools_prompt(tools: Sequence[Tool]) -> str:
    """Tool instructions in the hermes format for a system message, for templates that ignore `tools`."""
    listing = "\n".join(tojson(tool.schema()) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


# --- running calls --------------------------------------------------------------------------------------
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def check_arguments(arguments: dict, schema: dict) -> str | None:
    """One line naming what is wrong with `arguments` for an object `schema` (required fields, unknown
    fields when additionalProperties is false, top-level JSON types), None when they fit."""
    properties = schema.get("properties", {})
    for field in schema.get("required", []):
        if field not in arguments:
            return f"missing required argument '{field}'"
    for field, value in arguments.items():
        if field not in properties:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument '{field}' (expected {', '.join(properties) or 'none'})"
            continue
        kind = properties[field].get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        if kinds and not any(_is_json_type(value, k) for k in kinds):
            return f"argument '{field}' must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def _is_json_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool], sandbox: Sandbox) -> ToolResult:
    """Run one parsed call: an unknown tool, bad arguments or a failing tool is an error result."""
    tool = tools.get(call.name)
    if tool is None:
        return error_result(f"unknown tool '{call.name}' (available: {', '.join(tools) or 'none'})")
    problem = check_arguments(call.arguments, tool.parameters)
    if problem is not None:
        return error_result(f"{call.name}: {problem}")
    try:
        return tool.run(call.arguments, sandbox)
    except Exception as err:  # a tool's own bug must not end the episode; the model sees one line
        return error_result(f"{call.name} failed: {type(err).__name__}: {err}")


def error_result(error: str) -> ToolResult:
    line = " ".join(error.split())
    return ToolResult(f"Error: {line}", line)


# --- tools --------------------------------------------------------------------------------------------
class Calculator:
    """Exact arithmetic on integers (any size) and floats: + - * / // % ** and parentheses."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression with + - * / // % ** and parentheses; integers are "
                   "exact at any size. Example: 12345*6789")
    parameters: ClassVar[dict] = {"type": "object", "additionalProperties": False, "required": ["expression"],
                                  "properties": {"expression": {"type": "string",
                                                                "description": "the expression, e.g. (2+3)**10"}}}

    def schema(self) -> dict:
        return function_schema(self)

    def run(self, arguments: dict, sandbox: Sandbox) -> ToolResult:
        result = sandbox.call("megatron_rl.recipes.agent.arithmetic:calculate", {"expression": arguments["expression"]})
        if not result.ok:
            return error_result(result.error or "failed")
        if "error" in result.value:
            return error_result(result.value["error"])
        return ToolResult(result.value["result"])


class PythonTool:
    """Run a Python script; what it prints is the result, and a last bare expression is shown as in a REPL."""

    name = "python"
    description = ("Run Python 3 code in a sandbox without network access and return what it prints (the "
                   "value of a last bare expression is printed too). Files persist between calls.")
    parameters: ClassVar[dict] = {"type": "object", "additionalProperties": False, "required": ["code"],
                                  "properties": {"code": {"type": "string", "description": "the Python code to run"}}}

    def schema(self) -> dict:
        return function_schema(self)

    def run(self, arguments: dict, sandbox: Sandbox) -> ToolResult:
        result = sandbox.run_python(echo_last_expression(arguments["code"]))
        parts = [text.rstrip("\n") for text in (result.stdout, result.stderr) if text.strip()]
        if not result.ok:
            parts.append(f"Error: {result.error}")
            return ToolResult("\n".join(parts), result.error)
        return ToolResult("\n".join(parts) if parts else "(no output)")


def echo_last_expression(code: str) -> str:
    """`code` with a last bare expression statement wrapped to print its repr when not None (a REPL's
    echo); line numbers are kept. Code that does not parse is returned as is (the sandbox reports it)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    node = tree.body[-1]
    if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "print":
        return code
    lines = code.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode("utf-8")))
    raw = code.encode("utf-8")
    start = offsets[node.lineno - 1] + node.col_offset
    end = offsets[node.end_lineno - 1] + node.end_col_offset
    segment = raw[start:end].decode("utf-8")
    wrapped = f"(lambda __value: __value is None or print(repr(__value)))(({segment}))"
    return (raw[:start].decode("utf-8") + wrapped + raw[end:].decode("utf-8"))
