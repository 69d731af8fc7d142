"""The tool-call formats of chat templates (docs/agents.md, docs/serving.md): how a model writes the calls
in an assistant turn, parsed back into `ToolCall`s, and the messages `apply_chat_template` takes.

A model writes tool calls in its chat template's own format; `tool_call_format_for(template)` picks the
format from the template's text and `parse` turns generated text into `ToolCall`s plus one error line per
malformed call (parse never raises):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes), also the
  default for templates without a tool format (SmolLM2);
- "llama3_json": a bare `{"name": ..., "parameters": {...}}` turn, optionally after `<|python_tag|>`;
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "abcdefghi"}]`.
`render_call` writes a call exactly as the template renders an assistant message with `tool_calls`, and
`assistant_message` / `tool_message` build the messages transformers' `apply_chat_template` takes.
Used by the agent recipe (recipes/agent/tools.py) and by the server's /v1/chat/completions.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from megatron_rl.config import ConfigError


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

    def call_start(self, text: str) -> int:
        """Where in a partial assistant turn a call may begin: text before it is plain content whatever
        comes next (len(text) when no call can start in it)."""
        raise NotImplementedError

    def call_opening(self, name: str | None) -> str:
        """The text that starts an assistant turn with a call (of `name`, up to its arguments' value)."""
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

    def new_call_id(self) -> str:
        """A fresh id for a call the server returns (OpenAI's shape)."""
        return f"call_{secrets.token_hex(12)}"


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

    def call_start(self, text: str) -> int:
        return _marker_start(text, "<tool_call>")

    def call_opening(self, name: str | None) -> str:
        return '<tool_call>\n{"name": "' + (name + '", "arguments":' if name else "")


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

    def call_start(self, text: str) -> int:
        body = text.lstrip()  # a call is the whole turn: it can begin only at its start
        if body.startswith(("{", self.python_tag)) or self.python_tag.startswith(body):
            return 0
        return len(text)

    def call_opening(self, name: str | None) -> str:
        return '{"name": "' + (name + '", "parameters":' if name else "")


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

    def new_call_id(self) -> str:  # its template refuses any id but 9 letters and digits
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def call_start(self, text: str) -> int:
        return _marker_start(text, self.marker)

    def call_opening(self, name: str | None) -> str:
        return self.marker + ' [{"name": "' + (name + '", "arguments":' if name else "")


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


def template_reads(chat_template: str | None, variable: str) -> bool:
    """Whether the template reads `variable` (tools, tool_calls) at all."""
    return bool(chat_template) and re.search(rf"\b{variable}\b", chat_template) is not None


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself renders the `tools` it is given (else use `hermes_tools_prompt`)."""
    return template_reads(chat_template, "tools")


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


def _marker_start(text: str, marker: str) -> int:
    """Where `marker` is in `text`, or where a partial `marker` ends it, else len(text)."""
    found = text.find(marker)
    if found >= 0:
        return found
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def _collect(index: int, call: ToolCall | None, error: str | None, calls: list, errors: list) -> None:
    if call is not None:
        calls.append(call)
    else:
        errors.append(f"tool call {index}: {error}")
