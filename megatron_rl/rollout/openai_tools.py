"""OpenAI tool calling on /v1/chat/completions (docs/serving.md): the request's `tools` and `tool_choice`,
assistant `tool_calls` in the history, and the model's calls parsed back into `tool_calls` in the format of
its chat template (data/tool_calls.py: hermes, llama3_json, mistral), whole or streamed.

`tool_choice`: "none" renders no tools and parses nothing; "auto" (the default with tools) renders them and
parses whatever calls the model writes; "required" and a named function are enforced by starting the
assistant turn with the format's call opening (the named function's name included). Without constrained
decoding the arguments are the model's own: a call that does not parse comes back as `content`, as OpenAI's
own contract allows (its `arguments` may be invalid JSON too).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from megatron_rl.data.tool_calls import FORMATS, ToolCallFormat, template_reads, tool_call_format_for
from megatron_rl.rollout.serving import bad_request

PARSERS = ("auto", *FORMATS, "none")
"""`serve --tool-call-parser`: auto (from the chat template's text), a format by name, or none."""

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: `tools` to render, `choice` (auto / required / named, with
    `name`), the `format` the model writes calls in, and `opening`: the text the assistant turn is forced
    to start with (empty for auto)."""

    tools: list[dict]
    choice: str
    name: str | None
    format: ToolCallFormat
    opening: str


def tool_request(body: dict[str, Any], template: str | None, parser: str) -> ToolRequest | None:
    """The request's tools, validated (a 400 naming the field otherwise); None when no tool is in play
    (no `tools`, or `tool_choice: none`). `template`: the chat template that will render the request."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "needs 'tools'")
        return None
    names = _checked_tools(tools)
    if choice is None or choice == "auto":
        choice, name = "auto", None
    elif choice == "none":
        return None
    elif choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request("tool_choice.function.name", f"= {name!r} is not one of the request's tools "
                                                           f"({', '.join(names)})")
        choice = "named"
    else:
        raise bad_request("tool_choice", "must be 'none', 'auto', 'required' or "
                                         "{type: function, function: {name: ...}}")
    if not template_reads(template, "tools"):
        raise bad_request("tools", "cannot be rendered: this model's chat template has no tool support "
                                   "(serve a model whose template renders 'tools')")
    if parser == "none":
        raise bad_request("tools", "calls are not parsed by this server (started with --tool-call-parser none); "
                                   "send tool_choice: none to render the tools and read calls from 'content'")
    fmt = tool_call_format_for(template) if parser == "auto" else FORMATS[parser]
    opening = "" if choice == "auto" else fmt.call_opening(name)
    return ToolRequest(list(tools), choice, name, fmt, opening)


def _checked_tools(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        raise bad_request("tools", "must be a list of {type: function, function: {...}}")
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(where, "must be {type: function, function: {name, description, parameters}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise bad_request(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise bad_request(f"{where}.function.name", f"= {name!r} is given twice")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad_request(f"{where}.function.description", "must be a string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad_request(f"{where}.function.parameters", "must be a JSON schema object")
        names.append(name)
    return names


def history_messages(messages: list[dict], template: str | None) -> list[dict]:
    """The history as chat templates take it: an assistant message's `tool_calls[j].function.arguments`, a
    JSON string in OpenAI's API, becomes the object templates render (as vLLM and transformers do); a 400
    names a malformed call, or a history with calls that the template would drop."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            out.append(message)
            continue
        where = f"messages[{i}].tool_calls"
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(where, "must be a list, on an assistant message")
        if calls and not template_reads(template, "tool_calls"):
            raise bad_request(where, "cannot be rendered: this model's chat template has no tool support")
        converted = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise bad_request(f"{where}[{j}]", "must be {id, type: function, function: {name, arguments}}")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as err:
                    raise bad_request(f"{where}[{j}].function.arguments", f"is not JSON: {err}") from None
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}[{j}].function.arguments", "must be a JSON object")
            converted.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    return out


@dataclasses.dataclass
class ToolReply:
    """An assistant turn's `content` (None when it holds only calls) and its `tool_calls` (OpenAI's shape)."""

    content: str | None
    tool_calls: list[dict]


def parse_reply(text: str, request: ToolRequest) -> ToolReply:
    """The generated `text` (the forced opening not included) as content and tool calls; a turn whose calls
    do not all parse is returned whole as content, with no calls."""
    full = request.opening + text
    parsed = request.format.parse(full)
    if parsed.errors or not parsed.calls:
        return ToolReply(full, [])
    calls = [{"id": request.format.new_call_id(), "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
             for call in parsed.calls]
    return ToolReply(parsed.content or None, calls)


class ToolStream:
    """One streamed sample's text with tools in play: text that cannot be part of a call goes out as
    content as it comes; from where a call may begin, it is held until the end and then parsed."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> str:
        """The content that may go out now, given the next piece of text."""
        self.text += piece
        if self.request.opening:  # the whole turn is a call
            return ""
        safe = self.request.format.call_start(self.text)
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self, final_text: str) -> tuple[str, list[dict]]:
        """The rest of the content, and the calls, once the sample has ended (`final_text`: its whole
        stop-trimmed text)."""
        reply = parse_reply(final_text, self.request)
        content = reply.content or ""  # the whole turn, opening included, when it holds no call
        streamed = self.text[:self.sent]
        rest = content[len(streamed):] if content.startswith(streamed) else ""
        return rest, reply.tool_calls
