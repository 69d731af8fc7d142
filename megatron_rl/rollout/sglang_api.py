"""SGLang's native API on `megatron-rl serve` (fields as in SGLang 0.5's `entrypoints/http_server.py` /
`managers/io_struct.py`; /generate itself is in sglang_generate.py):

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
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load as load_safetensors

from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.serving import (
    APIError,
    ServedModel,
    bad_request,
    check_finite,
    checked_bool,
    checked_token_ids,
    read_body,
    read_json,
)
from megatron_rl.rollout.sglang_generate import GenerateAPI, only_fields, require_tokenizer


def add_sglang_routes(app: FastAPI, server: ServedModel) -> None:
    api = _SGLang(server)
    app.api_route("/generate", methods=["POST", "PUT"])(GenerateAPI(server).generate)
    for path in ("/health", "/health_generate"):
        app.get(path)(api.health)
        app.post(path)(api.health)
    app.get("/get_model_info")(api.model_info)
    app.get("/model_info")(api.model_info)
    app.get("/get_server_info")(api.server_info)
    app.get("/server_info")(api.server_info)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/flush_cache")(api.flush_cache)
    app.post("/flush_cache")(api.flush_cache)
    app.post("/update_weights_from_tensor")(api.update_weights_from_tensor)
    app.post("/update_weights_from_disk")(api.update_weights_from_disk)
    app.post("/update_weight_version")(api.update_weight_version)
    app.post("/begin_weight_update")(api.begin_weight_update)
    app.post("/end_weight_update")(api.end_weight_update)
    app.post("/pause_generation")(api.pause_generation)
    app.post("/continue_generation")(api.continue_generation)
    app.post("/abort_request")(api.abort_request)


class _SGLang:
    """The native endpoints but /generate, on the server's engine."""

    def __init__(self, server: ServedModel):
        self.server = server
        self.engine = server.engine
        self.limits = server.limits

    # --- state and info -----------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        state = self.engine.health()
        return JSONResponse(state, status_code=200 if state.get("ok") else 503)

    async def model_info(self) -> dict[str, Any]:
        server = self.server
        return {"model_path": server.model_path, "tokenizer_path": server.model_path, "is_generation": True,
                "served_model_name": server.model_name, "weight_version": self.engine.version}

    async def server_info(self) -> dict[str, Any]:
        server, bridge, limits = self.server, self.server.bridge, self.limits
        state = self.engine.health()
        host, port = server.address
        return {"model_path": server.model_path, "served_model_name": server.model_name, "host": host, "port": port,
                "context_length": bridge.max_seq_len, "max_running_requests": state.get("max_batch_size"),
                "max_queued_tokens": bridge.max_queued_tokens, "queued_tokens": bridge.queued_tokens,
                "max_request_body_bytes": limits.max_body_bytes, "max_n": limits.max_n,
                "weight_version": self.engine.version, "internal_states": [state], "engine": state}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        only_fields(data, {"prompt", "add_special_tokens", "model"})
        checked_bool(data.get("add_special_tokens"), "add_special_tokens", True)
        prompt = data.get("prompt")
        tokenizer = require_tokenizer(self.server, "prompt")
        if isinstance(prompt, str):
            tokens: Any = tokenizer.encode(prompt)
            count: Any = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [tokenizer.encode(p) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise bad_request("prompt", "must be a string or a list of strings")
        return {"tokens": tokens, "count": count, "max_model_len": self.server.bridge.max_seq_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        only_fields(data, {"tokens", "skip_special_tokens", "model"})
        tokens = checked_token_ids(data.get("tokens"), "tokens", self.server.bridge.vocab_size)
        skip = checked_bool(data.get("skip_special_tokens"), "skip_special_tokens", True)
        return {"text": require_tokenizer(self.server, "tokens").decode(tokens, skip_special_tokens=skip)}

    async def flush_cache(self) -> PlainTextResponse:
        if await asyncio.to_thread(self.engine.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)

    # --- weights ------------------------------------------------------------------------------------
    async def update_weights_from_tensor(self, request: Request) -> dict[str, Any]:
        engine, limits = self.engine, self.limits
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

    async def update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            raise bad_request("model_path", "is required")
        version = _opt_int(data.get("weight_version"), "weight_version")
        state = (await asyncio.to_thread(load_pretrained, path)).state
        check_finite(state)
        count = await asyncio.to_thread(self.engine.update_weights, state, version)
        return {"success": True, "message": f"loaded {count} tensors from {path}",
                "weight_version": self.engine.version}

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        version = _opt_int(data.get("new_version"), "new_version")
        if version is None:
            raise bad_request("new_version", "is required")
        if data.get("abort_all_requests", True):
            self.engine.abort(None)
        await asyncio.to_thread(self.engine.update_weights, {}, version)
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    async def begin_weight_update(self) -> dict[str, Any]:
        if not hasattr(self.engine, "begin_weight_update"):
            raise APIError(400, "this engine does not support weight-update sessions")
        await asyncio.to_thread(self.engine.begin_weight_update)
        return {"success": True, "message": "weight update session open"}

    async def end_weight_update(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        version = _opt_int(data.get("weight_version"), "weight_version")
        try:
            self.engine.end_weight_update(version)
        except RuntimeError as exc:
            raise APIError(400, str(exc)) from None
        return {"success": True, "message": f"weight version {self.engine.version}",
                "weight_version": self.engine.version}

    # --- generation control -------------------------------------------------------------------------
    async def pause_generation(self, request: Request) -> dict[str, Any]:
        mode = (await read_json(request, self.limits.max_body_bytes)).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise bad_request("mode", f"must be 'abort', 'in_place' or 'retract', got {mode!r}")
        await asyncio.to_thread(self.engine.pause)
        if mode == "abort":
            self.engine.abort(None)
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self) -> dict[str, Any]:
        self.engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def abort_request(self, request: Request) -> dict[str, Any]:
        data = await read_json(request, self.limits.max_body_bytes)
        if data.get("abort_all"):
            self.engine.abort(None)
        else:
            rid = data.get("rid")
            rids = rid if isinstance(rid, list) else [rid]
            if not rids or not all(isinstance(r, str) and r for r in rids):
                raise bad_request("rid", "must be a request id (or set abort_all)")
            self.engine.abort(rids)
        return {"success": True}


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
