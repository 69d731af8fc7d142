"""Tool calling on `megatron-rl serve`'s /v1/chat/completions through the official `openai` client, for the
three tool-call formats of the published templates (Qwen2.5: hermes, Llama 3.1: llama3_json, Mistral v0.3:
mistral): calls parsed into `tool_calls` (whole and streamed), `tool_choice` none / auto / required / named,
a multi-turn history with calls rendered token-equal to transformers' `apply_chat_template`, and a 400
naming the field where a template cannot render tools.

The model side is scripted (an engine that answers with a chosen text, token by token, through the same
engine interface), since no tiny random model writes a tool call; one test runs the native engine on the
forced call opening of a named tool_choice."""
from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import Future

import httpx
import pytest
from transformers import AutoTokenizer

from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.data.tool_calls import ToolCall, tool_call_format_for
from megatron_rl.models.arch import ModelArch
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.types import Completion
from tests.chat_families import FAMILIES, save_family_tokenizer
from tests.helpers import tiny_state

openai = pytest.importorskip("openai")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
CALL = ToolCall("get_weather", {"city": "Zürich", "unit": "celsius"})
ANSWER = "It is 21 degrees in Zürich."
PREAMBLE = {"hermes": "Let me look that up.\n", "llama3_json": "", "mistral": ""}
CASES = {"qwen2.5": "hermes", "llama-3.1": "llama3_json", "mistral-v0.3": "mistral"}


class ScriptedEngine:
    """Answers each request with `script(prompt_text)` (then the end-of-turn token), streaming it token by
    token through `on_token` from another thread, as the native engine does."""

    version = 0

    def __init__(self, tokenizer: ChatTokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.max_seq_len = 4096

    def health(self):
        return {"max_seq_len": self.max_seq_len, "max_batch_size": 4}

    def submit(self, requests, on_token=None):
        futures = []
        for request in requests:
            text = self.script(self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False))
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
            for sample_id in request.sample_ids():
                future = Future()
                futures.append(future)
                threading.Thread(target=self._play, args=(future, sample_id, request, ids, on_token)).start()
        return futures

    def _play(self, future, sample_id, request, ids, on_token):
        future.set_running_or_notify_cancel()
        for token in ids:
            if on_token is not None:
                on_token(sample_id, token, -0.5, self.version)
        future.set_result(Completion(sample_id, list(request.prompt_ids), ids, [-0.5] * len(ids),
                                     [self.version] * len(ids), "stop", request.group_id))

    def abort(self, ids=None):
        pass


def _script(fmt):
    """A model that calls get_weather, then answers once the tool's result is in the prompt; a turn forced
    to open a call is continued with the rest of that call."""
    call_text = PREAMBLE[fmt.name] + fmt.render_call(CALL)

    def script(prompt_text: str) -> str:
        for opening in (fmt.call_opening(CALL.name), fmt.call_opening(None)):
            if prompt_text.endswith(opening):
                return fmt.render_call(CALL)[len(opening):]
        return ANSWER if "21 degrees" in prompt_text else call_text
    return script


@pytest.fixture(scope="module")
def vocabulary(smollm2):
    return smollm2.tokenizer.hf_tokenizer.backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, vocabulary):
    root = tmp_path_factory.mktemp("families")
    for name in CASES:
        save_family_tokenizer(root / name, FAMILIES[name], vocabulary)
    return root


@pytest.fixture(scope="module", params=list(CASES))
def family(request, family_dirs):
    """(name, HF directory, our tokenizer, transformers' tokenizer, the format, a client of a scripted server)."""
    name = request.param
    path = family_dirs / name
    tokenizer = ChatTokenizer.from_hf_dir(path)
    fmt = tool_call_format_for(tokenizer.chat_template)
    assert fmt.name == CASES[name]
    server = RolloutServer(ScriptedEngine(tokenizer, _script(fmt)), port=0, tokenizer=tokenizer, model_name=name)
    server.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield name, path, tokenizer, AutoTokenizer.from_pretrained(path), fmt, client
    server.shutdown()


def _ask(name):
    # Mistral's template takes no system message apart from the last user turn's
    return [{"role": "user", "content": "What is the weather in Zürich?"}]


def _streamed(stream):
    """The content and the tool calls a streaming response adds up to (as the openai client's helpers do)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_a_tool_call_comes_back_in_tool_calls_whole_and_streamed(family):
    name, _, _, _, fmt, client = family
    out = client.chat.completions.create(model=name, messages=_ask(name), tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == CALL.name
    assert json.loads(call.function.arguments) == CALL.arguments
    assert choice.message.content == (PREAMBLE[fmt.name].strip() or None)
    if fmt.name == "mistral":  # its template refuses any other id in the next turn
        assert len(call.id) == 9 and call.id.isalnum()
    content, calls, finish = _streamed(client.chat.completions.create(model=name, messages=_ask(name), tools=TOOLS,
                                                                      stream=True))
    assert finish == "tool_calls" and content.strip() == PREAMBLE[fmt.name].strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(CALL.name, CALL.arguments)]
    assert calls[0]["id"]


def test_a_multi_turn_tool_conversation_renders_token_equal_to_transformers(family):
    name, _, _, reference, _, client = family
    messages = _ask(name)
    first = client.chat.completions.create(model=name, messages=messages, tools=TOOLS)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    messages += [assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                             "name": CALL.name, "content": "21 degrees"}]
    second = client.chat.completions.create(model=name, messages=messages, tools=TOOLS,
                                            extra_body={"return_token_ids": True})
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    # transformers renders calls whose arguments are objects (what OpenAI's JSON strings decode to)
    history = copy.deepcopy(messages)
    for call in history[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = reference.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert second.prompt_token_ids == list(expected)
    text = reference.decode(expected)
    assert '"city": "Zürich"' in text and "21 degrees" in text


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_choice_open_the_call(family, choice):
    name, _, tokenizer, reference, fmt, client = family
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": CALL.name}}
    out = client.chat.completions.create(model=name, messages=_ask(name), tools=TOOLS, tool_choice=tool_choice,
                                         extra_body={"return_token_ids": True})
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (CALL.name, CALL.arguments)
    assert out.choices[0].finish_reason == "tool_calls"
    opening = fmt.call_opening(CALL.name if choice == "named" else None)
    rendered = reference.apply_chat_template(_ask(name), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tokenizer.encode(rendered + opening)
    content, calls, finish = _streamed(client.chat.completions.create(
        model=name, messages=_ask(name), tools=TOOLS, tool_choice=tool_choice, stream=True))
    assert (content, finish) == ("", "tool_calls") and calls[0]["name"] == CALL.name


def test_tool_choice_none_renders_no_tools_and_parses_nothing(family):
    name, _, tokenizer, reference, fmt, client = family
    out = client.chat.completions.create(model=name, messages=_ask(name), tools=TOOLS, tool_choice="none",
                                         extra_body={"return_token_ids": True})
    expected = reference.apply_chat_template(_ask(name), add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    text = PREAMBLE[fmt.name] + fmt.render_call(CALL)  # as plain text: special tokens skipped, as without tools
    assert out.choices[0].message.content == tokenizer.decode(tokenizer.encode(text))


def test_a_malformed_call_is_content(family_dirs):
    tokenizer = ChatTokenizer.from_hf_dir(family_dirs / "qwen2.5")
    broken = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    server = RolloutServer(ScriptedEngine(tokenizer, lambda _: broken), port=0, tokenizer=tokenizer).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="megatron-rl", messages=_ask("qwen2.5"), tools=TOOLS)
        assert out.choices[0].message.content == broken and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"
        content, calls, _ = _streamed(client.chat.completions.create(model="megatron-rl", messages=_ask("qwen2.5"),
                                                                     tools=TOOLS, stream=True))
        assert content == broken and calls == []
    finally:
        server.shutdown()


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_name_the_field(family_dirs, body, param):
    tokenizer = ChatTokenizer.from_hf_dir(family_dirs / "qwen2.5")
    server = RolloutServer(ScriptedEngine(tokenizer, lambda _: "ok"), port=0, tokenizer=tokenizer).start()
    try:
        request = {"messages": _ask("qwen2.5"), **body}
        reply = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    finally:
        server.shutdown()


def test_a_template_without_tools_is_a_400_naming_tools(smollm2, family_dirs):
    """SmolLM2's template ignores tools and calls: rendering without them would silently drop them."""
    server = RolloutServer(ScriptedEngine(smollm2.tokenizer, lambda _: "ok"), port=0,
                           tokenizer=smollm2.tokenizer).start()
    try:
        reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": _ask(""), "tools": TOOLS}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
        history = [*_ask(""), {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
        reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": history}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[1].tool_calls"
        # tool_choice none: the tools are not rendered, as with any template
        reply = httpx.post(server.url + "/v1/chat/completions",
                           json={"messages": _ask(""), "tools": TOOLS, "tool_choice": "none"}, timeout=30)
        assert reply.status_code == 200
    finally:
        server.shutdown()
    tokenizer = ChatTokenizer.from_hf_dir(family_dirs / "qwen2.5")
    server = RolloutServer(ScriptedEngine(tokenizer, lambda _: "ok"), port=0, tokenizer=tokenizer,
                           tool_call_parser="none").start()
    try:
        reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": _ask(""), "tools": TOOLS}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
        assert "--tool-call-parser none" in reply.json()["error"]["message"]
    finally:
        server.shutdown()


def test_the_native_engine_continues_a_named_call_opening(family_dirs):
    """The real engine on the forced opening: the prompt ends with it and the sampled tokens continue it."""
    tokenizer = ChatTokenizer.from_hf_dir(family_dirs / "qwen2.5")
    arch = ModelArch(vocab_size=tokenizer.vocab_size, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_query_groups=2, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=512)
    engine = NativeEngine(arch, tiny_state(arch, seed=5), tokenizer=tokenizer,
                          config=NativeEngineConfig(max_batch_size=2, max_seq_len=512))
    server = RolloutServer(engine, port=0, tokenizer=tokenizer).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        opening = tool_call_format_for(tokenizer.chat_template).call_opening("add")
        out = client.chat.completions.create(
            model="megatron-rl", messages=_ask("qwen2.5"), tools=TOOLS, max_tokens=8, temperature=0,
            tool_choice={"type": "function", "function": {"name": "add"}}, extra_body={"return_token_ids": True})
        rendered = tokenizer.render_chat(_ask("qwen2.5"), tools=TOOLS)
        assert out.prompt_token_ids == tokenizer.encode(rendered + opening)
        (direct,) = engine.generate([_greedy(out.prompt_token_ids, 8)])
        assert out.choices[0].token_ids == direct.output_ids
        # random weights write no valid arguments: the turn, opening included, comes back as content
        generated = tokenizer.decode(direct.output_ids, skip_special_tokens=False)
        if out.choices[0].message.tool_calls:
            assert out.choices[0].message.tool_calls[0].function.name == "add"
        else:
            assert out.choices[0].message.content.startswith(opening)
            assert generated.startswith(out.choices[0].message.content[len(opening):])
    finally:
        server.shutdown()
        engine.close()


def _greedy(prompt_ids, max_new_tokens):
    return GenerateRequest("direct", list(prompt_ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))

