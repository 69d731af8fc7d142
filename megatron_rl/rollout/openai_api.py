"""OpenAI's /v1 API on `megatron-rl serve` (docs/serving.md): GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, with streaming (server-sent events ending in `data: [DONE]`), log-probs,
prompt echo with prompt log-probs, and OpenAI error objects. Requests join the engine's continuous
batch like every other endpoint's.

Extension for RL agent loops (vLLM's request field `return_token_ids`): each choice also carries
`token_ids` (every sampled token, the stop token included), `token_logprobs` (their behaviour log-probs
under the raw temperature-1 policy, as the engine returns them) and `weight_versions` ([{version,
start, end}] spans over token_ids), and the prompt's `prompt_token_ids` (per choice for completions,
on the response for chat), so a caller trains on exactly what was sampled without re-tokenizing.
"""
from __future__ import annotations

import inspect
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.openai_tools import ToolRequest, ToolStream, history_messages, parse_reply, tool_request
from megatron_rl.rollout.serving import (
    SSE_DONE,
    APIError,
    ServedModel,
    TextStream,
    bad_request,
    checked_bool,
    checked_int,
    checked_token_ids,
    client_key,
    finite_or_none,
    output_text,
    read_json,
    sse,
    token_piece,
    version_spans,
)
from megatron_rl.types import Completion

# Fields accepted with their neutral value only (anything else is refused, never ignored).
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": None, "best_of": 1,
            "parallel_tool_calls": True, "response_format": {"type": "text"}}
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
             "top_k", "min_p", "stop_token_ids", "ignore_eos", "skip_special_tokens", "return_token_ids", *_NEUTRAL}
_COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                            "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents"}


class _Choices:
    """What one OpenAI request asks for, beyond the engine requests themselves."""

    def __init__(self, requests: list[GenerateRequest], zero: bool, stop: list[str] | None, skip_special: bool,
                 return_ids: bool, top: int | None, stream: bool, usage_in_stream: bool):
        self.requests, self.zero, self.stop, self.skip_special = requests, zero, stop, skip_special
        self.return_ids, self.top, self.stream, self.usage_in_stream = return_ids, top, stream, usage_in_stream
        self.id = ""
        self.tools: ToolRequest | None = None  # chat only: the tools in play
        self.client = ""  # who asked (serving.client_key): the fair-admission queue it waits in
        self.created = int(time.time())


def add_openai_routes(app: FastAPI, server: ServedModel) -> None:
    api = _OpenAI(server)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)


class _OpenAI:
    def __init__(self, server: ServedModel):
        self.server = server
        self.bridge = server.bridge
        self.limits = server.limits

    # --- endpoints ----------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                            "created": self.server.started_at, "owned_by": "megatron-rl",
                                            "root": self.server.model_path or self.server.model_name,
                                            "max_model_len": self.bridge.max_seq_len}]}

    async def completions(self, request: Request) -> Any:
        body = await read_json(request, self.limits.max_body_bytes)
        _only(body, _COMPLETION_FIELDS)
        prompts, prompt_texts = self._prompts(body.get("prompt"))
        logprobs = checked_int(body.get("logprobs"), "logprobs", low=0, high=self.limits.max_top_logprobs)
        echo = checked_bool(body.get("echo"), "echo")
        choices = self._requests(body, prompts, default_max_tokens=16, top=logprobs, id_prefix="cmpl")
        choices.client = client_key(request, body.get("user"))
        if choices.stream and (logprobs is not None or echo):
            raise bad_request("logprobs" if logprobs is not None else "echo", "is not supported with stream=true")
        if choices.stream:
            return self._stream(choices, chat=False)
        completions = await self._run(choices, request)
        out = []
        for k, c in enumerate(completions):
            p = k // choices.requests[0].sampling.n
            text, _ = output_text(c, self.server.tokenizer, choices.stop, skip_special_tokens=choices.skip_special)
            choice: dict[str, Any] = {"index": k, "text": text or "", "logprobs": None,
                                      "finish_reason": c.finish_reason}
            if echo:
                choice["text"] = (prompt_texts[p] or "") + (text or "")
            if logprobs is not None:
                choice["logprobs"] = await self._completion_logprobs(c, logprobs, echo)
            if choices.return_ids:
                choice["prompt_token_ids"] = list(c.prompt_ids)
                choice.update(self._token_extension(c))
            out.append(choice)
        return {"id": choices.id, "object": "text_completion", "created": choices.created,
                "model": self.server.model_name, "choices": out, "usage": _usage(choices, completions)}

    async def chat_completions(self, request: Request) -> Any:
        body = await read_json(request, self.limits.max_body_bytes)
        _only(body, _CHAT_FIELDS)
        if body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise bad_request("max_completion_tokens", "and 'max_tokens' exclude each other")
            body["max_tokens"] = body["max_completion_tokens"]
        prompt, tools = self._render_chat(body)
        want_logprobs = checked_bool(body.get("logprobs"), "logprobs")
        top = checked_int(body.get("top_logprobs"), "top_logprobs", low=0, high=self.limits.max_top_logprobs)
        if top is not None and not want_logprobs:
            raise bad_request("top_logprobs", "needs logprobs=true")
        choices = self._requests(body, [prompt], default_max_tokens=None, top=(top or 0) if want_logprobs else None,
                                 id_prefix="chatcmpl")
        choices.client = client_key(request, body.get("user"))
        choices.tools = tools
        if tools is not None:  # call markers may be special tokens ([TOOL_CALLS], <|python_tag|>)
            choices.skip_special = False
        if choices.stream and want_logprobs:
            raise bad_request("logprobs", "is not supported with stream=true")
        if choices.stream:
            return self._stream(choices, chat=True)
        completions = await self._run(choices, request)
        out = []
        for k, c in enumerate(completions):
            text, _ = output_text(c, self.server.tokenizer, choices.stop, skip_special_tokens=choices.skip_special)
            message: dict[str, Any] = {"role": "assistant", "content": text or ""}
            finish = c.finish_reason
            if tools is not None:
                reply = parse_reply(text or "", tools)
                message["content"] = reply.content
                if reply.tool_calls:
                    message["tool_calls"] = reply.tool_calls
                    finish = "tool_calls"
            choice: dict[str, Any] = {"index": k, "message": message, "logprobs": None, "finish_reason": finish}
            if want_logprobs:
                choice["logprobs"] = {"content": await self._chat_logprobs(c, top or 0)}
            if choices.return_ids:
                choice.update(self._token_extension(c))
            out.append(choice)
        response = {"id": choices.id, "object": "chat.completion", "created": choices.created,
                    "model": self.server.model_name, "choices": out, "usage": _usage(choices, completions)}
        if choices.return_ids:
            response["prompt_token_ids"] = list(prompt)
        return response

    # --- request parsing ----------------------------------------------------------------------------
    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in (self.server.model_name, self.server.model_path):
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.server.model_name}'",
                           param="model", code="model_not_found")

    def _tokenizer(self, field: str) -> Any:
        if self.server.tokenizer is None:
            raise bad_request(field, "needs a server started with a tokenizer; send token ids")
        return self.server.tokenizer

    def _prompts(self, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
        """Completions' prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
        if isinstance(prompt, str):
            return [self._tokenizer("prompt").encode(prompt)], [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise bad_request("prompt", "must be a string, a list of strings, or (lists of) token ids")
        if all(isinstance(p, str) for p in prompt):
            tokenizer = self._tokenizer("prompt")
            return [tokenizer.encode(p) for p in prompt], list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [checked_token_ids(prompt, "prompt", self.bridge.vocab_size)]
        elif all(isinstance(p, list) for p in prompt):
            ids = [checked_token_ids(p, f"prompt[{i}]", self.bridge.vocab_size) for i, p in enumerate(prompt)]
        else:
            raise bad_request("prompt", "must be a string, a list of strings, or (lists of) token ids")
        tokenizer = self.server.tokenizer
        return ids, [tokenizer.decode(p, skip_special_tokens=False) if tokenizer is not None else None for p in ids]

    def _render_chat(self, body: dict[str, Any]) -> tuple[list[int], ToolRequest | None]:
        """The prompt's ids, and the tools in play (tool_choice: none or no tools: None)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages", "must be a non-empty list of messages")
        flat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(f"messages[{i}]", "must be an object with a 'role'")
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise bad_request(f"messages[{i}].content", "parts other than {type: text} are not supported")
                message = {**message, "content": "".join(p["text"] for p in content)}
            elif content is not None and not isinstance(content, str):
                raise bad_request(f"messages[{i}].content", "must be a string or a list of text parts")
            flat.append(message)
        tokenizer = self._tokenizer("messages")
        template = _template_text(tokenizer, body.get("tools"))
        tools = tool_request(body, template, self.server.tool_call_parser)
        flat = history_messages(flat, template)
        accepts = inspect.signature(tokenizer.encode_chat).parameters
        kwargs: dict[str, Any] = {}
        for name in ("tools", "documents", "add_generation_prompt", "continue_final_message"):
            if body.get(name) is not None and not (name == "tools" and tools is None):
                if name not in accepts:
                    raise bad_request(name, "is not supported by this server's chat tokenizer")
                kwargs[name] = body[name]
        if tools is not None and tools.opening and kwargs.get("continue_final_message"):
            raise bad_request("tool_choice", f"= {tools.choice!r} starts the assistant turn itself: it excludes "
                                             "continue_final_message")
        template_kwargs = body.get("chat_template_kwargs")
        if template_kwargs:
            if not isinstance(template_kwargs, dict):
                raise bad_request("chat_template_kwargs", "must be an object")
            if "chat_template_kwargs" in accepts:
                kwargs["chat_template_kwargs"] = template_kwargs
            elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepts.values()):
                clash = sorted(set(template_kwargs) & set(accepts))
                if clash:
                    raise bad_request(f"chat_template_kwargs.{clash[0]}", "is a named argument, not a template variable")
                kwargs.update(template_kwargs)
            else:
                raise bad_request("chat_template_kwargs", "is not supported by this server's chat tokenizer")
        try:
            if tools is not None and tools.opening:  # the turn starts with the call: tokenized as one text
                return tokenizer.encode(tokenizer.render_chat(flat, **kwargs) + tools.opening), tools
            return tokenizer.encode_chat(flat, **kwargs), tools
        except (ValueError, TypeError) as exc:  # template errors (ConfigError) and bad message shapes
            raise bad_request("messages", f"cannot be rendered with the chat template: {exc}") from None

    def _requests(self, body: dict[str, Any], prompts: list[list[int]], *, default_max_tokens: int | None,
                  top: int | None, id_prefix: str) -> _Choices:
        self._check_model(body)
        for name, neutral in _NEUTRAL.items():
            if body.get(name) is not None and body[name] != neutral and not (name == "best_of" and body[name] == body.get("n")):
                raise bad_request(name, f"= {body[name]!r} is not supported (only {neutral!r})")
        context = self.bridge.max_seq_len
        max_tokens = checked_int(body.get("max_tokens"), "max_tokens", low=0)
        for i, p in enumerate(prompts):
            if not p:
                raise bad_request("prompt", "is empty (a prompt needs at least one token)")
            wanted = max_tokens if max_tokens is not None else default_max_tokens
            if context and len(p) + (wanted or 1) > context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                                    f"requested {len(p) + (wanted or 1)} tokens ({len(p)} in the prompt, "
                                    f"{wanted or 1} in the completion). Please reduce the prompt or max_tokens.",
                               param="max_tokens" if max_tokens is not None else "prompt", code="context_length_exceeded")
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not math.isfinite(temperature) or not 0 <= temperature <= 2):
            raise bad_request("temperature", f"must be a number in [0, 2], got {temperature!r}")
        top_p = body.get("top_p")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0 < top_p <= 1):
            raise bad_request("top_p", f"must be a number in (0, 1], got {top_p!r}")
        n = checked_int(body.get("n"), "n", low=1, high=self.limits.max_n, default=1)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise bad_request("stop", "must be a non-empty string or a list of them")
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None:
            checked_token_ids(stop_ids, "stop_token_ids", self.bridge.vocab_size)
        seed = checked_int(body.get("seed"), "seed", low=-2**63, high=2**63 - 1)
        stream = checked_bool(body.get("stream"), "stream")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise bad_request("stream_options", "must be {include_usage: bool}, and only with stream=true")
        usage_in_stream = checked_bool((options or {}).get("include_usage"), "stream_options.include_usage")
        skip_special = checked_bool(body.get("skip_special_tokens"), "skip_special_tokens", True)
        return_ids = checked_bool(body.get("return_token_ids"), "return_token_ids")
        requests = []
        base_id = uuid.uuid4().hex
        for i, p in enumerate(prompts):
            budget = max_tokens if max_tokens is not None else (default_max_tokens or (context - len(p)))
            try:
                sampling = SamplingParams(
                    max_new_tokens=max(budget, 1), temperature=1.0 if temperature is None else float(temperature),
                    top_p=1.0 if top_p is None else float(top_p), n=n, stop=stop, seed=seed,
                    top_k=checked_int(body.get("top_k"), "top_k", low=-1, default=-1),
                    min_p=0.0 if body.get("min_p") is None else body["min_p"], stop_token_ids=stop_ids,
                    ignore_eos=checked_bool(body.get("ignore_eos"), "ignore_eos"))
            except ValueError as exc:
                raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None
            requests.append(GenerateRequest(f"{id_prefix}-{base_id}-{i}", p, sampling))
        choices = _Choices(requests, max_tokens == 0, stop, skip_special, return_ids, top, stream, usage_in_stream)
        choices.id = f"{id_prefix}-{base_id}"
        return choices

    # --- running ------------------------------------------------------------------------------------
    async def _run(self, choices: _Choices, request: Request) -> list[Completion]:
        if choices.zero:  # max_tokens 0 (prompt scoring with echo): nothing for the engine to do
            return _empty(choices)
        return await self.bridge.generate(choices.requests, request, choices.client)

    def _token_extension(self, c: Completion) -> dict[str, Any]:
        return {"token_ids": list(c.output_ids), "token_logprobs": [finite_or_none(x) for x in c.output_logprobs],
                "weight_versions": version_spans(c.weight_versions),
                "weight_version": c.weight_versions[-1] if c.weight_versions else self.server.engine.version}

    async def _scored(self, c: Completion, top: int, echo: bool):
        """Prompt scores (when echoing) and top alternatives of the output tokens."""
        if not top and not echo:
            return None
        ids = list(c.prompt_ids) + list(c.output_ids) if top else list(c.prompt_ids)
        return await self.bridge.token_logprobs(ids, top)

    async def _completion_logprobs(self, c: Completion, top: int, echo: bool) -> dict[str, Any]:
        """One entry per prompt token (when echoing) and per generated token, the stop token that ended the
        text included (as OpenAI-compatible servers report it; lm-eval's parser drops the last entry of a
        one-token log-likelihood request, whatever that token is)."""
        tokenizer = self.server.tokenizer
        text = (lambda t: token_piece(tokenizer, t)[0])
        scored = await self._scored(c, top, echo)
        P = len(c.prompt_ids)
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if echo:
            for p, token in enumerate(c.prompt_ids):
                tokens.append(text(token))
                values.append(None if scored[p] is None else finite_or_none(scored[p][0]))
                tops.append(None if scored[p] is None else
                            {**{text(t): finite_or_none(lp) for t, lp in scored[p][1]},
                             text(token): finite_or_none(scored[p][0])})
        for k in range(len(c.output_ids)):
            token, lp = c.output_ids[k], finite_or_none(c.output_logprobs[k])
            alternatives = scored[P + k][1] if top and scored is not None and P + k < len(scored) else []
            tokens.append(text(token))
            values.append(lp)
            tops.append({**{text(t): finite_or_none(v) for t, v in alternatives}, text(token): lp})
        offsets, position = [], 0
        for piece in tokens:
            offsets.append(position)
            position += len(piece)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def _chat_logprobs(self, c: Completion, top: int) -> list[dict[str, Any]]:
        """One entry per generated token, the stop token that ended the message included."""
        tokenizer = self.server.tokenizer
        scored = await self._scored(c, top, False)
        P = len(c.prompt_ids)

        def entry(token: int, lp: float) -> dict[str, Any]:
            piece, data = token_piece(tokenizer, token)
            return {"token": piece, "logprob": finite_or_none(lp), "bytes": list(data)}

        content = []
        for k in range(len(c.output_ids)):
            alternatives = scored[P + k][1] if top and scored is not None and P + k < len(scored) else []
            content.append({**entry(c.output_ids[k], c.output_logprobs[k]),
                            "top_logprobs": [entry(t, v) for t, v in alternatives]})
        return content

    def _stream(self, choices: _Choices, *, chat: bool) -> StreamingResponse:
        return StreamingResponse(self._events(choices, chat), media_type="text/event-stream")

    async def _events(self, choices: _Choices, chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": choices.id, "object": kind, "created": choices.created, "model": self.server.model_name}

        def chunk(index: int, piece: str | None, finish: str | None, extra: dict[str, Any] | None = None,
                  calls: list[dict] | None = None) -> str:
            if chat:
                delta: dict[str, Any] = {} if piece is None else {"content": piece}
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return sse({**head, "choices": [{**choice, **(extra or {})}]})

        n_samples = sum(r.sampling.n for r in choices.requests)
        if chat:
            for k in range(n_samples):
                yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        tokenizer = self.server.tokenizer
        texts = [TextStream(tokenizer, choices.stop, choices.skip_special) for _ in range(n_samples)]
        tool_streams = [ToolStream(choices.tools) for _ in range(n_samples)] if choices.tools else None
        completions: list[Completion | None] = [None] * n_samples
        try:
            if choices.zero:
                events: Any = _done_events(_empty(choices))
            else:
                events = self.bridge.stream(choices.requests, choices.client)
            async for event in events:
                k = event[1]
                if event[0] == "token":
                    piece = texts[k].push(event[2])
                    if piece and tool_streams:
                        piece = tool_streams[k].push(piece)
                    if piece:
                        yield chunk(k, piece, None)
                    continue
                c = completions[k] = event[2]
                final, _ = output_text(c, tokenizer, choices.stop, skip_special_tokens=choices.skip_special)
                rest = texts[k].finish(final)
                finish = c.finish_reason
                if tool_streams:
                    rest, calls = tool_streams[k].finish(final or "")
                    if calls:
                        yield chunk(k, None, None, calls=[{"index": j, **call} for j, call in enumerate(calls)])
                        finish = "tool_calls"
                if rest:
                    yield chunk(k, rest, None)
                extra = None
                if choices.return_ids:
                    extra = self._token_extension(c)
                    if not chat:
                        extra["prompt_token_ids"] = list(c.prompt_ids)
                yield chunk(k, None if chat else "", finish, extra)
            if choices.usage_in_stream:
                yield sse({**head, "choices": [], "usage": _usage(choices, [c for c in completions if c is not None])})
            yield SSE_DONE
        except APIError as exc:
            yield sse(exc.body())


def _empty(choices: _Choices) -> list[Completion]:
    return [Completion(request_id=sid, prompt_ids=list(r.prompt_ids), output_ids=[], output_logprobs=[],
                       weight_versions=[], finish_reason="length", group_id=r.group_id)
            for r in choices.requests for sid in r.sample_ids()]


async def _done_events(completions: list[Completion]) -> AsyncIterator[tuple]:
    for k, c in enumerate(completions):
        yield ("done", k, c)


def _usage(choices: _Choices, completions: list[Completion]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in choices.requests)
    completion = sum(len(c.output_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _template_text(tokenizer: Any, tools: Any) -> str | None:
    """The chat template that renders a request (with tools: a model's "tool_use" template where it has one,
    as transformers picks it)."""
    template = getattr(tokenizer, "template_for", None)
    return template(bool(tools)) if template is not None else None


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(unknown[0], "is not supported by this server")
