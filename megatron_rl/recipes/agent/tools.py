"""Tools an agent calls, and the tool-call formats of the chat templates (docs/agents.md).

A model writes tool calls in its chat template's own format; `tool_call_format_for(template)` picks the
format from the template's text and `parse` turns generated text into `ToolCall`s plus one error line per
malformed call (parse never raises):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes), also the
  default for templates without a tool format (SmolLM2), whose prompt then carries `hermes_tools_prompt`;
- "llama3_json": a bare `{"name": ..., "parameters": {...}}` turn, optionally after `<|python_tag|>`;
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "abcdefghi"}]`.
`render_call` writes a call exactly as the template renders an assistant message with `tool_calls`, and
`assistant_message` / `tool_message` build the messages transformers' `apply_chat_template` takes.
Tools run their work in a `Sandbox`: `Calculator` (exact integer arithmetic through `ast`), `PythonTool`.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from megatron_rl.config import ConfigError
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


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: tool `name`, `arguments` (a dict), the exact `text` it was parsed from and, where
    the format carries one (mistral), the call's `id`."""

    name: str
    arguments: dict
    text: str = ""
    id: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
    """The calls found in an assistant turn, one error line per malformed call, and the turn's text
    outside the calls (`content`)."""

    calls: list[ToolCall]
    errors: list[str]
    content: str


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


def tojson(value: Any) -> str:
    """JSON as transformers' chat templates' `tojson` filter writes it."""
    return json.dumps(value, ensure_ascii=False)


# --- tool-call formats --------------------------------------------------------------------------------
class ToolCallFormat:
    """One chat-template family's way of writing tool calls in an assistant turn."""

    name = ""

    def parse(self, text: str) -> ParsedToolCalls:
        raise NotImplementedError

    def render_call(self, call: ToolCall) -> str:
        """The text the template renders for an assistant turn holding just this call."""
        raise NotImplementedError

    def assistant_message(self, content: str, calls: Sequence[ToolCall]) -> dict:
        """An assistant message with `tool_calls`, as `apply_chat_template` takes it (arguments as dicts)."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "id": call_id(call),
                 "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
        return message

    def tool_message(self, call: ToolCall, content: str) -> dict:
        """The message that answers `call` with a tool's `content`."""
        return {"role": "tool", "tool_call_id": call_id(call), "name": call.name, "content": content}


class HermesFormat(ToolCallFormat):
    name = "hermes"
    # a block ends at its closing tag, or (unclosed) at the next opening tag or the end of the text
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        calls, errors, outside, last = [], [], [], 0
        for index, match in enumerate(self._block.finditer(text), start=1):
            outside.append(text[last:match.start()])
            last = match.end()
            closed = match.group(0).endswith("</tool_call>")
            body = match.group(1).strip()
            call, error = _call_from_json(body, match.group(0), ("arguments", "parameters"))
            if error is not None and not closed:
                error = f"<tool_call> without </tool_call> ({error})"
            _collect(index, call, error, calls, errors)
        outside.append(text[last:])
        return ParsedToolCalls(calls, errors, "".join(outside).strip())

    def render_call(self, call: ToolCall) -> str:
        return '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + tojson(call.arguments) + "}\n</tool_call>"


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1/3.2 custom tools: the whole turn is a JSON call (`parameters`, or `arguments`); several
    calls may be separated by ';'. A turn that does not start with '{' is a plain answer."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.strip()
        tagged = body.startswith(self.python_tag)
        if tagged:
            body = body[len(self.python_tag):].strip()
        if not body.startswith("{"):
            return ParsedToolCalls([], [f"tool call 1: {self.python_tag} not followed by a JSON object"]
                                   if tagged else [], text.strip())
        calls, errors = [], []
        decoder, position, index = json.JSONDecoder(), 0, 0
        while position < len(body):
            index += 1
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as err:
                errors.append(f"tool call {index}: invalid JSON: {err}")
                break
            call, error = _call_from_object(value, body[position:end], ("parameters", "arguments"))
            _collect(index, call, error, calls, errors)
            position = end
            while position < len(body) and (body[position].isspace() or body[position] == ";"):
                position += 1
        return ParsedToolCalls(calls, errors, "")

    def render_call(self, call: ToolCall) -> str:
        return '{"name": "' + call.name + '", "parameters": ' + tojson(call.arguments) + "}"


class MistralFormat(ToolCallFormat):
    """Mistral v0.3: `[TOOL_CALLS]` then a JSON list of calls with 9-character alphanumeric ids; a tool
    message's content is a JSON value, so `tool_message` encodes the text as a JSON string."""

    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedToolCalls:
        head, found, tail = text.partition(self.marker)
        if not found:
            return ParsedToolCalls([], [], text.strip())
        body = tail.strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as err:
            return ParsedToolCalls([], [f"tool call 1: invalid JSON after {self.marker}: {err}"], head.strip())
        items = value if isinstance(value, list) else [value]
        calls, errors = [], []
        if not items:
            errors.append(f"tool call 1: empty list after {self.marker}")
        for index, item in enumerate(items, start=1):
            call, error = _call_from_object(item, json.dumps(item, ensure_ascii=False), ("arguments", "parameters"))
            if call is not None and isinstance(item, dict) and isinstance(item.get("id"), str):
                call = dataclasses.replace(call, id=item["id"])
            _collect(index, call, error, calls, errors)
        if body[end:].strip():
            extra = body[end:].strip()[:60]
            errors.append(f"tool call {len(items) + 1}: unexpected text after the call list: {extra!r}")
        return ParsedToolCalls(calls, errors, head.strip())

    def render_call(self, call: ToolCall) -> str:
        function = tojson({"name": call.name, "arguments": call.arguments})
        return self.marker + " [" + function[:-1] + ', "id": "' + call_id(call) + '"}]'

    def tool_message(self, call: ToolCall, content: str) -> dict:
        return {**super().tool_message(call, content), "content": tojson(content)}


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format named `name` (ConfigError naming the choices otherwise)."""
    if name not in FORMATS:
        raise ConfigError(f"tool_call_format: unknown format {name!r} (choose from {', '.join(FORMATS)})")
    return FORMATS[name]


def tool_call_format_for(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template writes tool calls in, read from the template's text; hermes for a
    template with no tool-call format of its own."""
    text = chat_template or ""
    if MistralFormat.marker in text:
        return FORMATS["mistral"]
    if "<tool_call>" in text:
        return FORMATS["hermes"]
    if "<|start_header_id|>" in text and ('"parameters"' in text or Llama3JsonFormat.python_tag in text):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself renders the `tools` it is given (else use `hermes_tools_prompt`)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def hermes_tools_prompt(tools: Sequence[Tool]) -> str:
    """Tool instructions in the hermes format for a system message, for templates that ignore `tools`."""
    listing = "\n".join(tojson(tool.schema()) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


_ID_ALPHABET = string.ascii_letters + string.digits


def call_id(call: ToolCall) -> str:
    """The call's id if it is a valid 9-character alphanumeric one (Mistral's rule), else a new one derived
    from the call so that the same call gets the same id."""
    if call.id and len(call.id) == 9 and call.id.isalnum():
        return call.id
    digest = hashlib.sha256((call.name + tojson(call.arguments) + (call.id or "")).encode("utf-8")).digest()
    return "".join(_ID_ALPHABET[byte % len(_ID_ALPHABET)] for byte in digest[:9])


def _call_from_json(body: str, text: str, argument_keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err}"
    return _call_from_object(value, text, argument_keys)


def _call_from_object(value: Any, text: str, argument_keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    if not isinstance(value, dict):
        return None, f"expected a JSON object, got {type(value).__name__}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, "missing the string field 'name'"
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # OpenAI style: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return None, f"{name}: '{key}' is a string that is not JSON: {err}"
    if not isinstance(arguments, dict):
        return None, f"{name}: '{key}' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments, text), None


def _collect(index: int, call: ToolCall | None, error: str | None, calls: list, errors: list) -> None:
    if call is not None:
        calls.append(call)
    else:
        errors.append(f"tool call {index}: {error}")


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
