"""SGLang's POST /generate on `megatron-rl serve` (the fields are listed in sglang_api.py): the body
parsed into engine requests, each completion rendered as SGLang's output, whole or streamed as
server-sent events.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from megatron_rl.rollout.client import encode_routed_experts
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
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
    version_spans,
)
from megatron_rl.types import Completion

_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "return_text_in_logprobs", "stream", "group_id", "return_routed_experts",
                    "routed_experts_start_len"}
# sampling_params keys the server honours itself (the rest go to SamplingParams.from_sglang)
_TEXT_OPTIONS = ("no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval")


def completion_json(c: Completion, tokenizer: Any, return_logprob: bool, version: int, latency: float, *,
                    stop: list[str] | None = None, trim_stop: bool = True, skip_special_tokens: bool = True,
                    with_text: bool = False) -> dict[str, Any]:
    """One SGLang /generate output (without prompt log-probs, added by the caller)."""
    text, matched = output_text(c, tokenizer, stop, skip_special_tokens=skip_special_tokens, trim_stop=trim_stop)
    if c.finish_reason == "length":
        reason: dict[str, Any] = {"type": "length", "length": len(c.output_ids)}
    elif c.finish_reason == "abort":
        reason = {"type": "abort", "message": "Aborted"}
    else:
        reason = {"type": "stop", "matched": matched}
    meta: dict[str, Any] = {
        "id": c.request_id, "finish_reason": reason, "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.output_ids), "cached_tokens": 0,
        "weight_version": c.weight_versions[-1] if c.weight_versions else version,
        "weight_versions": version_spans(c.weight_versions), "group_id": c.group_id, "e2e_latency": latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [finite_or_none(lp), t, tokenizer.token_text(t) if with_text and tokenizer is not None else None]
            for lp, t in zip(c.output_logprobs, c.output_ids)]
    return {"text": text, "output_ids": c.output_ids, "meta_info": meta}


class GenerateCall:
    """A parsed /generate body: engine requests plus how to render their outputs."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []     # one per prompt; max_new_tokens 0 never reaches the engine
        self.zero: list[bool] = []
        self.text_options: list[dict[str, Any]] = []
        self.batched = False
        self.return_logprob: list[bool] = []
        self.logprob_start: list[int] = []
        self.top_logprobs: list[int] = []
        self.with_text = False
        self.stream = False
        self.routed_experts_start: int | None = None  # None: no routing record asked for


def records_routing(engine: Any) -> bool:
    """Whether `engine` records MoE routing (`Completion.routed_experts`) for /generate to return."""
    config, arch = getattr(engine, "config", None), getattr(engine, "arch", None)
    return bool(getattr(config, "record_routing", False) and getattr(arch, "is_moe", False))


def require_tokenizer(server: ServedModel, field: str) -> Any:
    if server.tokenizer is None:
        raise bad_request(field, "needs a server started with a tokenizer; send token ids")
    return server.tokenizer


def only_fields(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r} (this server honours: {', '.join(sorted(allowed))})",
                       param=unknown[0])


class GenerateAPI:
    """The /generate endpoint of the server that mounts it."""

    def __init__(self, server: ServedModel):
        self.server = server
        self.bridge = server.bridge
        self.limits = server.limits

    async def generate(self, request: Request) -> Any:
        call = self.parse(await read_json(request, self.limits.max_body_bytes))
        if call.stream:
            return StreamingResponse(self._stream(call, client_key(request)), media_type="text/event-stream")
        start = time.perf_counter()
        live = [r for r, zero in zip(call.requests, call.zero) if not zero]
        completions = iter(await self.bridge.generate(live, request) if live else [])
        outs = []
        for i, (r, zero) in enumerate(zip(call.requests, call.zero)):
            samples = [_empty(r, sid, self.server.engine.version) for sid in r.sample_ids()] if zero else \
                [next(completions) for _ in range(r.sampling.n)]
            for c in samples:
                outs.append(await self._output(call, i, c, time.perf_counter() - start))
        return outs if (call.batched or len(outs) != 1) else outs[0]

    # --- the request --------------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> GenerateCall:
        only_fields(body, _GENERATE_FIELDS)
        call = GenerateCall()
        prompts = self._prompts(body, call)
        count = len(prompts)

        def per_prompt(name: str) -> list[Any]:
            value = body.get(name)
            values = value if isinstance(value, list) else [value] * count
            if len(values) != count:
                raise bad_request(name, f"has {len(values)} entries for {count} prompts")
            return values

        rids = per_prompt("rid")
        if not all(r is None or (isinstance(r, str) and r) for r in rids):
            raise bad_request("rid", f"must be a string or a list of {count} strings")
        group = body.get("group_id")
        if group is not None and not isinstance(group, str):
            raise bad_request("group_id", "must be a string")
        call.return_logprob = [checked_bool(v, "return_logprob") for v in per_prompt("return_logprob")]
        call.logprob_start = [checked_int(v, "logprob_start_len", low=-1, default=-1)
                              for v in per_prompt("logprob_start_len")]
        call.top_logprobs = [checked_int(v, "top_logprobs_num", low=0, high=self.limits.max_top_logprobs, default=0)
                             for v in per_prompt("top_logprobs_num")]
        call.with_text = checked_bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
        call.stream = checked_bool(body.get("stream"), "stream")
        call.routed_experts_start = self._routed_experts_start(body, prompts)
        for i, (prompt, params, rid) in enumerate(zip(prompts, per_prompt("sampling_params"), rids)):
            if call.logprob_start[i] >= len(prompt):
                raise bad_request("logprob_start_len", f"is {call.logprob_start[i]} but the prompt has {len(prompt)} tokens")
            sampling, options, zero = self._sampling(params)
            call.requests.append(GenerateRequest(rid or uuid.uuid4().hex, prompt, sampling, group_id=group or ""))
            call.text_options.append(options)
            call.zero.append(zero)
        return call

    def _prompts(self, body: dict[str, Any], call: GenerateCall) -> list[list[int]]:
        """The prompts' token ids, from `input_ids` or `text`; sets `call.batched`."""
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is None:
            raise bad_request("input_ids", "or 'text' is required")
        if input_ids is not None and text is not None:
            raise APIError(400, "give either 'input_ids' or 'text', not both", param="text")
        if input_ids is None:
            tokenizer = require_tokenizer(self.server, "text")
            call.batched = isinstance(text, list)
            texts = text if call.batched else [text]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request("text", "must be a string or a list of strings")
            return [tokenizer.encode(t) for t in texts]
        if not isinstance(input_ids, list):
            raise bad_request("input_ids", "must be a list of token ids or a list of such lists")
        call.batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if call.batched else [input_ids]
        for i, p in enumerate(prompts):
            checked_token_ids(p, f"input_ids[{i}]" if call.batched else "input_ids", None)
        return prompts

    def _routed_experts_start(self, body: dict[str, Any], prompts: list[list[int]]) -> int | None:
        start = checked_int(body.get("routed_experts_start_len"), "routed_experts_start_len", low=0, default=0)
        if not checked_bool(body.get("return_routed_experts"), "return_routed_experts"):
            return None
        if not records_routing(self.server.engine):
            raise bad_request("return_routed_experts", "needs a mixture-of-experts model served with "
                              "--enable-return-routed-experts (engine.record_routing)")
        if any(start > len(p) for p in prompts):
            raise bad_request("routed_experts_start_len", f"is {start}, beyond a prompt's length")
        return start

    def _sampling(self, params: Any) -> tuple[SamplingParams, dict[str, Any], bool]:
        """SamplingParams, the text options the server applies itself, and whether max_new_tokens is 0."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise bad_request("sampling_params", f"must be an object, got {type(params).__name__}")
        params = dict(params)
        options = {"no_stop_trim": checked_bool(params.pop("no_stop_trim", None), "sampling_params.no_stop_trim"),
                   "skip_special_tokens": checked_bool(params.pop("skip_special_tokens", None),
                                                       "sampling_params.skip_special_tokens", True),
                   "stream_interval": checked_int(params.pop("stream_interval", None), "sampling_params.stream_interval",
                                                  low=1, default=1)}
        if not checked_bool(params.pop("spaces_between_special_tokens", None),
                            "sampling_params.spaces_between_special_tokens", True):
            raise bad_request("sampling_params.spaces_between_special_tokens", "= false is not supported")
        if params.get("stop_token_ids") is not None:
            checked_token_ids(params["stop_token_ids"], "sampling_params.stop_token_ids", self.bridge.vocab_size)
        checked_int(params.get("n"), "sampling_params.n", low=1, high=self.limits.max_n)
        stop = params.get("stop")
        if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and
                                                              all(isinstance(s, str) for s in stop))):
            raise bad_request("sampling_params.stop", "must be a string or a list of strings")
        zero = params.get("max_new_tokens") == 0
        if zero:
            params["max_new_tokens"] = 1  # validated as a one-token request, never sent to the engine
        sampling = SamplingParams.from_sglang(params)
        options["stop"] = sampling.stop
        return sampling, options, zero

    # --- the response -------------------------------------------------------------------------------
    async def _output(self, call: GenerateCall, i: int, c: Completion, latency: float) -> dict[str, Any]:
        options = call.text_options[i]
        out = completion_json(c, self.server.tokenizer, call.return_logprob[i], self.server.engine.version, latency,
                              stop=options["stop"], trim_stop=not options["no_stop_trim"],
                              skip_special_tokens=options["skip_special_tokens"], with_text=call.with_text)
        if call.return_logprob[i]:
            await self._add_logprob_details(out["meta_info"], c, call.logprob_start[i], call.top_logprobs[i],
                                            call.with_text)
        if call.routed_experts_start is not None and c.routed_experts is not None:
            out["meta_info"]["routed_experts"] = encode_routed_experts(c.routed_experts[call.routed_experts_start:])
        return out

    async def _add_logprob_details(self, meta: dict[str, Any], c: Completion, start: int, top: int,
                                   with_text: bool) -> None:
        """SGLang's input_token_logprobs (from logprob_start_len; -1: none) and top log-probs."""
        meta["input_token_logprobs"] = []
        if start < 0 and top == 0:
            return
        prompt = list(c.prompt_ids)
        full = prompt + list(c.output_ids) if top else prompt
        scored = await self.bridge.token_logprobs(full, top)
        tokenizer = self.server.tokenizer
        text = (lambda t: tokenizer.token_text(t)) if with_text and tokenizer is not None else (lambda t: None)

        def entry(lp: float | None, token: int) -> list[Any]:
            return [finite_or_none(lp), token, text(token)]

        if start >= 0:
            meta["input_token_logprobs"] = [entry(scored[p][0] if scored[p] else None, prompt[p])
                                            for p in range(start, len(prompt))]
        if top:
            if start >= 0:
                meta["input_top_logprobs"] = [None if scored[p] is None else [entry(lp, t) for t, lp in scored[p][1]]
                                              for p in range(start, len(prompt))]
            meta["output_top_logprobs"] = [[entry(lp, t) for t, lp in scored[len(prompt) + k][1]]
                                           if len(prompt) + k < len(scored) else []
                                           for k in range(len(c.output_ids))]

    async def _stream(self, call: GenerateCall, client: str):
        """SGLang's streaming /generate: `data: {...}` with the text and ids so far per sample (field
        `index` for batched input), the last one of each with finish_reason and log-probs; then [DONE]."""
        start = time.perf_counter()
        live = [r for r, zero in zip(call.requests, call.zero) if not zero]
        owner = [i for i, (r, zero) in enumerate(zip(call.requests, call.zero)) if not zero
                 for _ in range(r.sampling.n)]
        texts = [TextStream(self.server.tokenizer, call.text_options[i]["stop"],
                            call.text_options[i]["skip_special_tokens"]) for i in owner]
        ids = [sid for r in live for sid in r.sample_ids()]
        sent = [""] * len(owner)
        try:
            index = 0
            for i, (r, zero) in enumerate(zip(call.requests, call.zero)):
                if zero:
                    for sid in r.sample_ids():
                        empty = _empty(r, sid, self.server.engine.version)
                        yield sse({**await self._output(call, i, empty, 0.0), "index": index})
                        index += 1
            if not live:
                yield SSE_DONE
                return
            async for event in self.bridge.stream(live, client):
                k = event[1]
                i = owner[k]
                if event[0] == "token":
                    sent[k] += texts[k].push(event[2])
                    if len(texts[k].ids) % call.text_options[i]["stream_interval"]:
                        continue
                    meta = {"id": ids[k], "finish_reason": None, "prompt_tokens": len(call.requests[i].prompt_ids),
                            "completion_tokens": len(texts[k].ids), "weight_version": event[4]}
                    yield sse({"text": sent[k], "output_ids": list(texts[k].ids), "meta_info": meta, "index": k})
                else:
                    out = await self._output(call, i, event[2], time.perf_counter() - start)
                    yield sse({**out, "index": k})
            yield SSE_DONE
        except APIError as exc:
            yield sse(exc.body())


def _empty(request: GenerateRequest, sample_id: str, version: int) -> Completion:
    """The answer to max_new_tokens = 0: no tokens, finished by length."""
    return Completion(request_id=sample_id, prompt_ids=list(request.prompt_ids), output_ids=[], output_logprobs=[],
                      weight_versions=[], finish_reason="length", group_id=request.group_id)
