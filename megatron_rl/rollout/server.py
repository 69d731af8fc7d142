"""The HTTP server of `megatron-rl serve`, in front of any RolloutEngine (normally the native engine),
on FastAPI + uvicorn. It speaks SGLang's native API (below) and OpenAI's /v1 API (rollout/openai_api.py);
requests from every endpoint share the engine's continuous batch. docs/serving.md documents both.

SGLang-native endpoints (fields as in SGLang 0.5's `entrypoints/http_server.py` / `managers/io_struct.py`):
  POST /generate                 {input_ids | text, sampling_params, rid, return_logprob, logprob_start_len,
                                 top_logprobs_num, return_text_in_logprobs, stream, group_id,
                                 return_routed_experts, routed_experts_start_len} ->
                                 {text, output_ids, meta_info: {id, finish_reason: {type, matched | length},
                                 prompt_tokens, completion_tokens, cached_tokens, weight_version,
                                 weight_versions: [{version, start, end}], output_token_logprobs,
                                 input_token_logprobs, output_top_logprobs, input_top_logprobs,
                                 routed_experts (MoE engines that record routing: base64 int32
                                 [positions start..P+R-1, layers, top_k], as SGLang's)}}
                                 (a list for batched input or n > 1, prompt-major); stream: SSE chunks
                                 with the text so far, then `data: [DONE]`
  POST /tokenize {prompt}, /detokenize {tokens}
  POST /update_weights_from_tensor  JSON {serialized_named_tensors: [base64 safetensors bytes, ...],
                                 load_format: "safetensors", weight_version, flush_cache}, or a raw
                                 safetensors body (Content-Type application/octet-stream) with
                                 ?weight_version=N. Never unpickles; non-finite values are refused.
  POST /update_weights_from_disk {model_path, weight_version}
  POST /update_weight_version    {new_version}
  POST /begin_weight_update, /end_weight_update {weight_version}: bucketed updates applied as one
  GET|POST /flush_cache          200, or 400 while requests run
  GET /health, /health_generate  200 when the engine is healthy, else 503
  GET /get_model_info, /model_info; GET /get_server_info, /server_info
  POST /pause_generation {mode: "abort" (SGLang's default) | "in_place" | "retract"}, /continue_generation
  POST /abort_request {rid, abort_all}

Errors are OpenAI error objects {"error": {message, type, param, code}} naming the field; a field we
cannot honour is refused, never ignored. With an API key every endpoint but /health needs
`Authorization: Bearer <key>`. The server binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from safetensors.torch import load as load_safetensors
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.client import encode_routed_experts
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_rl.rollout.openai_api import add_openai_routes
from megatron_rl.rollout.serving import (
    SSE_DONE,
    APIError,
    ClientGone,
    EngineBridge,
    ServerLimits,
    TextStream,
    bad_request,
    check_finite,
    checked_bool,
    checked_int,
    checked_token_ids,
    error_body,
    finite_or_none,
    output_text,
    read_body,
    read_json,
    sse,
    version_spans,
)
from megatron_rl.types import Completion

log = logging.getLogger(__name__)

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


class _GenerateCall:
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


class RolloutServer:
    """Owns the HTTP server; `serve_forever()` blocks, `start()` serves from a daemon thread."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
                 tokenizer: Any = None, model_path: str = "", model_name: str | None = None,
                 limits: ServerLimits | None = None, backlog: int = 4096):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.api_key = api_key or None
        self.model_path = model_path
        self.model_name = model_name or (os.path.basename(model_path.rstrip("/")) if model_path else "megatron-rl")
        self.limits = limits or ServerLimits()
        self.bridge = EngineBridge(engine, self.limits)
        self.started_at = int(time.time())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # bound here so that a busy port is reported at once and port 0 gets its number before serving;
        # a long listen queue so that bursts of clients wait instead of being reset
        self.socket = socket.create_server((host, port), family=family, backlog=backlog)
        self.app = self._build_app()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", backlog=backlog,
                                timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> RolloutServer:
        self._thread = threading.Thread(target=self.serve_forever, name="rollout-http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        asyncio.run(self._uvicorn.serve(sockets=[self.socket]))

    def shutdown(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.socket.close()

    # --- app ----------------------------------------------------------------------------------------
    def _authorise(self, request: Request) -> None:
        if self.api_key is None or request.url.path in ("/health", "/health_generate"):
            return
        header = request.headers.get("authorization", "")
        if not (header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), self.api_key.encode())):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="megatron-rl serve", docs_url=None, redoc_url=None, openapi_url=None,
                      dependencies=[Depends(self._authorise)])

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(RequestError)
        async def request_error(request: Request, exc: RequestError) -> JSONResponse:
            return JSONResponse(error_body(400, str(exc), exc.field), status_code=400)

        @app.exception_handler(ValueError)
        async def value_error(request: Request, exc: ValueError) -> JSONResponse:  # config errors: the client's
            return JSONResponse(error_body(400, str(exc)), status_code=400)

        @app.exception_handler(ClientGone)
        async def client_gone(request: Request, exc: ClientGone) -> Response:
            return Response(status_code=499)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            message = {404: f"no endpoint {request.url.path}",
                       405: f"{request.url.path} does not accept {request.method}"}.get(exc.status_code, str(exc.detail))
            return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def server_error(request: Request, exc: Exception) -> JSONResponse:
            log.exception("error serving %s", request.url.path)
            return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)

        self._add_native_routes(app)
        add_openai_routes(app, self)
        return app

    def _add_native_routes(self, app: FastAPI) -> None:
        engine, limits = self.engine, self.limits

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Any:
            call = self.parse_generate(await read_json(request, limits.max_body_bytes))
            if call.stream:
                return StreamingResponse(self._generate_stream(call), media_type="text/event-stream")
            start = time.perf_counter()
            live = [r for r, zero in zip(call.requests, call.zero) if not zero]
            completions = iter(await self.bridge.generate(live, request) if live else [])
            outs = []
            for i, (r, zero) in enumerate(zip(call.requests, call.zero)):
                samples = [_empty(r, sid, engine.version) for sid in r.sample_ids()] if zero else \
                    [next(completions) for _ in range(r.sampling.n)]
                for c in samples:
                    outs.append(await self._generate_output(call, i, c, time.perf_counter() - start))
            return outs if (call.batched or len(outs) != 1) else outs[0]

        @app.get("/health")
        @app.get("/health_generate")
        @app.post("/health")
        @app.post("/health_generate")
        async def health() -> JSONResponse:
            state = engine.health()
            return JSONResponse(state, status_code=200 if state.get("ok") else 503)

        @app.get("/get_model_info")
        @app.get("/model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                    "served_model_name": self.model_name, "weight_version": engine.version}

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            state = engine.health()
            host, port = self.address
            return {"model_path": self.model_path, "served_model_name": self.model_name, "host": host, "port": port,
                    "context_length": self.bridge.max_seq_len, "max_running_requests": state.get("max_batch_size"),
                    "max_queued_tokens": self.bridge.max_queued_tokens, "queued_tokens": self.bridge.queued_tokens,
                    "max_request_body_bytes": limits.max_body_bytes, "max_n": limits.max_n,
                    "weight_version": engine.version, "internal_states": [state], "engine": state}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            _only(data, {"prompt", "add_special_tokens", "model"})
            checked_bool(data.get("add_special_tokens"), "add_special_tokens", True)
            prompt = data.get("prompt")
            tokenizer = self._require_tokenizer("prompt")
            if isinstance(prompt, str):
                tokens: Any = tokenizer.encode(prompt)
                count: Any = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [tokenizer.encode(p) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise bad_request("prompt", "must be a string or a list of strings")
            return {"tokens": tokens, "count": count, "max_model_len": self.bridge.max_seq_len}

        @app.post("/detokenize")
        async def detokenize(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            _only(data, {"tokens", "skip_special_tokens", "model"})
            tokens = checked_token_ids(data.get("tokens"), "tokens", self.bridge.vocab_size)
            skip = checked_bool(data.get("skip_special_tokens"), "skip_special_tokens", True)
            return {"text": self._require_tokenizer("tokens").decode(tokens, skip_special_tokens=skip)}

        @app.get("/flush_cache")
        @app.post("/flush_cache")
        async def flush_cache() -> PlainTextResponse:
            if await asyncio.to_thread(engine.flush_cache):
                return PlainTextResponse("Cache flushed.\n")
            return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
            if request.headers.get("content-type", "").startswith("application/octet-stream"):
                payloads = [await read_body(request, limits.max_weights_bytes)]
                version = _opt_int(request.query_params.get("weight_version"), "weight_version")
            else:
                payloads, version = _tensor_payloads(await read_json(request, limits.max_weights_bytes))
            tensors: dict[str, Any] = {}
            for i, payload in enumerate(payloads):
                try:
                    tensors.update(load_safetensors(payload))
                except Exception as exc:  # safetensors raises its own error types
                    raise APIError(400, f"payload {i} is not a valid safetensors buffer: {exc}") from None
            check_finite(tensors)
            count = await asyncio.to_thread(engine.update_weights, tensors, version)
            return {"success": True, "message": f"updated {count} tensors; weight version {engine.version}",
                    "weight_version": engine.version}

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            path = data.get("model_path")
            if not isinstance(path, str) or not path:
                raise bad_request("model_path", "is required")
            version = _opt_int(data.get("weight_version"), "weight_version")
            state = (await asyncio.to_thread(load_pretrained, path)).state
            check_finite(state)
            count = await asyncio.to_thread(engine.update_weights, state, version)
            return {"success": True, "message": f"loaded {count} tensors from {path}", "weight_version": engine.version}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            version = _opt_int(data.get("new_version"), "new_version")
            if version is None:
                raise bad_request("new_version", "is required")
            if data.get("abort_all_requests", True):
                engine.abort(None)
            await asyncio.to_thread(engine.update_weights, {}, version)
            return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

        @app.post("/begin_weight_update")
        async def begin_weight_update() -> dict[str, Any]:
            if not hasattr(engine, "begin_weight_update"):
                raise APIError(400, "this engine does not support weight-update sessions")
            await asyncio.to_thread(engine.begin_weight_update)
            return {"success": True, "message": "weight update session open"}

        @app.post("/end_weight_update")
        async def end_weight_update(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            version = _opt_int(data.get("weight_version"), "weight_version")
            try:
                engine.end_weight_update(version)
            except RuntimeError as exc:
                raise APIError(400, str(exc)) from None
            return {"success": True, "message": f"weight version {engine.version}", "weight_version": engine.version}

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> dict[str, Any]:
            mode = (await read_json(request, limits.max_body_bytes)).get("mode", "abort")
            if mode not in ("abort", "in_place", "retract"):
                raise bad_request("mode", f"must be 'abort', 'in_place' or 'retract', got {mode!r}")
            await asyncio.to_thread(engine.pause)
            if mode == "abort":
                engine.abort(None)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation() -> dict[str, Any]:
            engine.resume()
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.post("/abort_request")
        async def abort_request(request: Request) -> dict[str, Any]:
            data = await read_json(request, limits.max_body_bytes)
            if data.get("abort_all"):
                engine.abort(None)
            else:
                rid = data.get("rid")
                rids = rid if isinstance(rid, list) else [rid]
                if not rids or not all(isinstance(r, str) and r for r in rids):
                    raise bad_request("rid", "must be a request id (or set abort_all)")
                engine.abort(rids)
            return {"success": True}

    def _require_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(field, "needs a server started with a tokenizer; send token ids")
        return self.tokenizer

    # --- /generate ----------------------------------------------------------------------------------
    def parse_generate(self, body: dict[str, Any]) -> _GenerateCall:
        _only(body, _GENERATE_FIELDS)
        call = _GenerateCall()
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is None:
            raise bad_request("input_ids", "or 'text' is required")
        if input_ids is not None and text is not None:
            raise APIError(400, "give either 'input_ids' or 'text', not both", param="text")
        if input_ids is None:
            tokenizer = self._require_tokenizer("text")
            call.batched = isinstance(text, list)
            texts = text if call.batched else [text]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request("text", "must be a string or a list of strings")
            prompts = [tokenizer.encode(t) for t in texts]
        else:
            if not isinstance(input_ids, list):
                raise bad_request("input_ids", "must be a list of token ids or a list of such lists")
            call.batched = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = input_ids if call.batched else [input_ids]
            for i, p in enumerate(prompts):
                checked_token_ids(p, f"input_ids[{i}]" if call.batched else "input_ids", None)
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
        start = checked_int(body.get("routed_experts_start_len"), "routed_experts_start_len", low=0, default=0)
        if checked_bool(body.get("return_routed_experts"), "return_routed_experts"):
            if not self.records_routing:
                raise bad_request("return_routed_experts", "needs a mixture-of-experts model served with "
                                  "--enable-return-routed-experts (engine.record_routing)")
            if any(start > len(p) for p in prompts):
                raise bad_request("routed_experts_start_len", f"is {start}, beyond a prompt's length")
            call.routed_experts_start = start
        for i, (prompt, params, rid) in enumerate(zip(prompts, per_prompt("sampling_params"), rids)):
            if call.logprob_start[i] >= len(prompt):
                raise bad_request("logprob_start_len", f"is {call.logprob_start[i]} but the prompt has {len(prompt)} tokens")
            sampling, options, zero = self._sampling(params)
            call.requests.append(GenerateRequest(rid or uuid.uuid4().hex, prompt, sampling, group_id=group or ""))
            call.text_options.append(options)
            call.zero.append(zero)
        return call

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

    async def _generate_output(self, call: _GenerateCall, i: int, c: Completion, latency: float) -> dict[str, Any]:
        options = call.text_options[i]
        out = completion_json(c, self.tokenizer, call.return_logprob[i], self.engine.version, latency,
                              stop=options["stop"], trim_stop=not options["no_stop_trim"],
                              skip_special_tokens=options["skip_special_tokens"], with_text=call.with_text)
        if call.return_logprob[i]:
            await self._add_logprob_details(out["meta_info"], c, call.logprob_start[i], call.top_logprobs[i],
                                            call.with_text)
        if call.routed_experts_start is not None and c.routed_experts is not None:
            out["meta_info"]["routed_experts"] = encode_routed_experts(c.routed_experts[call.routed_experts_start:])
        return out

    @property
    def records_routing(self) -> bool:
        """Whether the engine records MoE routing (`Completion.routed_experts`) for /generate to return."""
        config, arch = getattr(self.engine, "config", None), getattr(self.engine, "arch", None)
        return bool(getattr(config, "record_routing", False) and getattr(arch, "is_moe", False))

    async def _add_logprob_details(self, meta: dict[str, Any], c: Completion, start: int, top: int,
                                   with_text: bool) -> None:
        """SGLang's input_token_logprobs (from logprob_start_len; -1: none) and top log-probs."""
        meta["input_token_logprobs"] = []
        if start < 0 and top == 0:
            return
        prompt = list(c.prompt_ids)
        full = prompt + list(c.output_ids) if top else prompt
        scored = await self.bridge.token_logprobs(full, top)
        text = (lambda t: self.tokenizer.token_text(t)) if with_text and self.tokenizer is not None else (lambda t: None)

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

    async def _generate_stream(self, call: _GenerateCall):
        """SGLang's streaming /generate: `data: {...}` with the text and ids so far per sample (field
        `index` for batched input), the last one of each with finish_reason and log-probs; then [DONE]."""
        start = time.perf_counter()
        live = [r for r, zero in zip(call.requests, call.zero) if not zero]
        owner = [i for i, (r, zero) in enumerate(zip(call.requests, call.zero)) if not zero
                 for _ in range(r.sampling.n)]
        texts = [TextStream(self.tokenizer, call.text_options[i]["stop"], call.text_options[i]["skip_special_tokens"])
                 for i in owner]
        ids = [sid for r in live for sid in r.sample_ids()]
        sent = [""] * len(owner)
        try:
            index = 0
            for i, (r, zero) in enumerate(zip(call.requests, call.zero)):
                if zero:
                    for sid in r.sample_ids():
                        yield sse({**await self._generate_output(call, i, _empty(r, sid, self.engine.version), 0.0),
                                   "index": index})
                        index += 1
            if not live:
                yield SSE_DONE
                return
            async for event in self.bridge.stream(live):
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
                    out = await self._generate_output(call, i, event[2], time.perf_counter() - start)
                    yield sse({**out, "index": k})
            yield SSE_DONE
        except APIError as exc:
            yield sse(exc.body())


def _empty(request: GenerateRequest, sample_id: str, version: int) -> Completion:
    """The answer to max_new_tokens = 0: no tokens, finished by length."""
    return Completion(request_id=sample_id, prompt_ids=list(request.prompt_ids), output_ids=[], output_logprobs=[],
                      weight_versions=[], finish_reason="length", group_id=request.group_id)


def _only(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r} (this server honours: {', '.join(sorted(allowed))})",
                       param=unknown[0])


def _tensor_payloads(data: dict[str, Any]) -> tuple[list[bytes], int | None]:
    load_format = data.get("load_format")
    if load_format not in (None, "safetensors"):
        raise bad_request("load_format", f"= {load_format!r} is not supported: send load_format='safetensors' "
                                         "(this server never unpickles payloads)")
    if load_format is None:
        raise bad_request("load_format", "must be 'safetensors': SGLang's default pickled "
                                         "(MultiprocessingSerializer) payloads are refused; this server never unpickles")
    payloads = data.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
        raise bad_request("serialized_named_tensors", "must be a list of base64 strings")
    try:
        decoded = [base64.b64decode(p, validate=True) for p in payloads]
    except ValueError as exc:
        raise bad_request("serialized_named_tensors", f"holds invalid base64 ({exc})") from None
    return decoded, _opt_int(data.get("weight_version"), "weight_version")


def _opt_int(value: Any, field: str) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise bad_request(field, f"must be an integer version, got {value!r}") from None


__all__ = ["RequestError", "RolloutServer", "ServerLimits", "completion_json", "version_spans"]
