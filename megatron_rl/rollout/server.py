"""An HTTP server compatible with SGLang's native API, in front of any RolloutEngine (normally the
native engine): `megatron-rl serve`. Standard library only (ThreadingHTTPServer); every request runs
on its own thread, and concurrent /generate calls share the engine's continuous batch.

Endpoints (request / response fields as in `sglang/srt/entrypoints/http_server.py` and
`managers/io_struct.py`, SGLang 0.5):
  POST /generate                 {input_ids | text, sampling_params, return_logprob, rid} ->
                                 {text, output_ids, meta_info: {id, finish_reason: {type, ...}, prompt_tokens,
                                 completion_tokens, cached_tokens, weight_version, weight_versions: [{version,
                                 start, end}], output_token_logprobs: [[logprob, token_id, null], ...]}}
                                 (a list for batched input or n > 1, prompt-major)
  POST /update_weights_from_tensor  JSON {serialized_named_tensors: [base64 safetensors bytes, ...],
                                 load_format: "safetensors", weight_version, flush_cache}, or a raw
                                 safetensors body (Content-Type application/octet-stream) with
                                 ?weight_version=N. Never unpickles: SGLang's pickled/CUDA-IPC payloads
                                 are refused with 400.
  POST /update_weights_from_disk {model_path, weight_version}
  POST /update_weight_version    {new_version}
  POST /begin_weight_update, /end_weight_update {weight_version}: bucketed updates applied as one
  GET|POST /flush_cache          200, or 400 while requests run
  GET /health, /health_generate  200 when the engine is healthy, else 503
  GET /get_model_info, /model_info, /get_server_info, /server_info
  POST /pause_generation {mode: "abort" (SGLang's default) | "in_place" | "retract"}, /continue_generation
  POST /abort_request {rid, abort_all}

Bad requests get HTTP 400 with {"error": {"message": ...}} naming the field; other requests are not
affected. With an API key every endpoint but /health needs `Authorization: Bearer <key>`. The server
binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from safetensors.torch import load as load_safetensors

from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams
from megatron_rl.types import Completion

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 256 << 20
MAX_WEIGHTS_BYTES = 64 << 30


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def finish_reason_json(completion: Completion) -> dict[str, Any]:
    if completion.finish_reason == "length":
        return {"type": "length", "length": len(completion.output_ids)}
    if completion.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted"}
    out: dict[str, Any] = {"type": "stop"}
    if completion.output_ids:
        out["matched"] = completion.output_ids[-1]
    return out


def version_spans(versions: list[int]) -> list[dict[str, int]]:
    """Per-token versions -> SGLang's [{version, start, end}] spans."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def completion_json(c: Completion, tokenizer: Any, return_logprob: bool, version: int, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": c.request_id, "finish_reason": finish_reason_json(c), "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.output_ids), "cached_tokens": 0,
        "weight_version": c.weight_versions[-1] if c.weight_versions else version,
        "weight_versions": version_spans(c.weight_versions), "group_id": c.group_id, "e2e_latency": latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.output_logprobs, c.output_ids)]
    out: dict[str, Any] = {"output_ids": c.output_ids, "meta_info": meta}
    out["text"] = tokenizer.decode(c.output_ids) if tokenizer is not None else None
    return out


class RolloutServer:
    """Owns the HTTP server; `serve_forever()` blocks, `start()` serves from a daemon thread."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
                 tokenizer: Any = None, model_path: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.api_key = api_key or None
        self.model_path = model_path
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "RolloutServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="rollout-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- endpoint implementations (each returns (status, json-able body or str)) ------------------
    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("stream"):
            raise HTTPError(400, "stream=true is not supported by this server")
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is None:
            raise HTTPError(400, "either 'input_ids' or 'text' is required")
        if input_ids is not None and text is not None:
            raise HTTPError(400, "give either 'input_ids' or 'text', not both")
        if input_ids is None:
            if self.tokenizer is None:
                raise HTTPError(400, "'text' needs a server started with a tokenizer; send 'input_ids'")
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not all(isinstance(t, str) for t in texts):
                raise HTTPError(400, "field 'text' must be a string or a list of strings")
            prompts = [self.tokenizer.encode(t) for t in texts]
        else:
            if not isinstance(input_ids, list):
                raise HTTPError(400, "field 'input_ids' must be a list of token ids or a list of such lists")
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = input_ids if batched else [input_ids]
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise HTTPError(400, f"field 'input_ids[{i}]' must be a list of integer token ids"
                                    if batched else "field 'input_ids' must be a list of integer token ids")
        n = len(prompts)
        params = body.get("sampling_params")
        params_list = params if isinstance(params, list) else [params] * n
        if len(params_list) != n:
            raise HTTPError(400, f"field 'sampling_params' has {len(params_list)} entries for {n} prompts")
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else ([rid] if rid is not None else [None] * n)
        if len(rids) != n or not all(r is None or isinstance(r, str) for r in rids):
            raise HTTPError(400, f"field 'rid' must be a string or a list of {n} strings")
        return_logprob = body.get("return_logprob", False)
        if isinstance(return_logprob, list):
            return_logprob = any(return_logprob)
        group = body.get("group_id")
        requests = []
        for i, (prompt, sp, r) in enumerate(zip(prompts, params_list, rids)):
            sampling = SamplingParams.from_sglang(sp)
            rid_i = r or uuid.uuid4().hex
            requests.append(GenerateRequest(rid_i, prompt, sampling, group_id=group if isinstance(group, str) else ""))
        start = time.perf_counter()
        futures = self.engine.submit(requests)        # validates every request before queueing any
        completions = [f.result() for f in futures]
        latency = time.perf_counter() - start
        version = self.engine.version
        outs = [completion_json(c, self.tokenizer, bool(return_logprob), version, latency) for c in completions]
        return 200, outs if (batched or len(outs) != 1) else outs[0]

    def update_weights_from_tensor(self, body: bytes, content_type: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        if content_type.startswith("application/octet-stream"):
            payloads = [body]
            version = _opt_int(query.get("weight_version", [None])[0], "weight_version")
        else:
            data = _parse_json(body)
            load_format = data.get("load_format")
            if load_format not in (None, "safetensors"):
                raise HTTPError(400, f"load_format={load_format!r} is not supported: send "
                                     "load_format='safetensors' (this server never unpickles payloads)")
            if load_format is None:
                raise HTTPError(400, "field 'load_format' must be 'safetensors': SGLang's default pickled "
                                     "(MultiprocessingSerializer) payloads are refused; this server never unpickles")
            payloads = data.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
                raise HTTPError(400, "field 'serialized_named_tensors' must be a list of base64 strings")
            try:
                payloads = [base64.b64decode(p, validate=True) for p in payloads]
            except ValueError as exc:
                raise HTTPError(400, f"field 'serialized_named_tensors': invalid base64 ({exc})") from None
            version = _opt_int(data.get("weight_version"), "weight_version")
        tensors = {}
        for i, payload in enumerate(payloads):
            try:
                tensors.update(load_safetensors(payload))
            except Exception as exc:  # safetensors raises its own error types
                raise HTTPError(400, f"payload {i} is not a valid safetensors buffer: {exc}") from None
        count = self.engine.update_weights(tensors, version)
        return 200, {"success": True, "message": f"updated {count} tensors; weight version {self.engine.version}",
                     "weight_version": self.engine.version}

    def update_weights_from_disk(self, data: dict[str, Any]) -> tuple[int, Any]:
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            raise HTTPError(400, "field 'model_path' is required")
        version = _opt_int(data.get("weight_version"), "weight_version")
        pretrained = load_pretrained(path)
        count = self.engine.update_weights(pretrained.state, version)
        return 200, {"success": True, "message": f"loaded {count} tensors from {path}",
                     "weight_version": self.engine.version}

    def info(self) -> dict[str, Any]:
        health = self.engine.health()
        return {"model_path": self.model_path, "is_generation": True, "weight_version": self.engine.version,
                "engine": health}


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
        raise HTTPError(400, f"field '{field}' must be an integer version, got {value!r}") from None


def _parse_json(body: bytes) -> Any:
    if not body:
        return {}
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None


class _Handler(BaseHTTPRequestHandler):
    server_state: RolloutServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        log.debug("%s - %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _send(self, status: int, body: Any) -> None:
        if isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
            ctype = "text/plain; charset=utf-8"
        else:
            data = json.dumps(body).encode()
            ctype = "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self, limit: int) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            raise HTTPError(400, "invalid Content-Length") from None
        if size > limit:
            raise HTTPError(413, f"request body of {size} bytes exceeds the limit of {limit}")
        return self.rfile.read(size)

    def _authorised(self, path: str) -> bool:
        key = self.server_state.api_key
        if key is None or path in ("/health", "/health_generate"):
            return True
        header = self.headers.get("Authorization", "")
        return header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), key.encode())

    def _dispatch(self, method: str) -> None:
        state = self.server_state
        parsed = urllib.parse.urlsplit(self.path)
        path = parsed.path.rstrip("/") or "/"
        query = urllib.parse.parse_qs(parsed.query)
        try:
            if not self._authorised(path):
                self._read_body(MAX_JSON_BYTES)
                raise HTTPError(401, "missing or wrong API key (Authorization: Bearer <key>)")
            limit = MAX_WEIGHTS_BYTES if path == "/update_weights_from_tensor" else MAX_JSON_BYTES
            body = self._read_body(limit)
            routes: dict[str, tuple[tuple[str, ...], Callable[[], tuple[int, Any]]]] = {
                "/generate": (("POST", "PUT"), lambda: state.generate(_require_object(_parse_json(body)))),
                "/health": (("GET", "POST"), lambda: self._health()),
                "/health_generate": (("GET", "POST"), lambda: self._health()),
                "/get_model_info": (("GET",), lambda: (200, state.info())),
                "/model_info": (("GET",), lambda: (200, state.info())),
                "/get_server_info": (("GET",), lambda: (200, state.info())),
                "/server_info": (("GET",), lambda: (200, state.info())),
                "/flush_cache": (("GET", "POST"), lambda: (200, "Cache flushed.\n") if state.engine.flush_cache()
                                 else (400, "Cache not flushed: requests are running.\n")),
                "/update_weights_from_tensor": (("POST",), lambda: state.update_weights_from_tensor(
                    body, self.headers.get("Content-Type", ""), query)),
                "/update_weights_from_disk": (("POST",), lambda: state.update_weights_from_disk(
                    _require_object(_parse_json(body)))),
                "/update_weight_version": (("POST",), lambda: self._set_version(_require_object(_parse_json(body)))),
                "/begin_weight_update": (("POST",), lambda: self._begin_update()),
                "/end_weight_update": (("POST",), lambda: self._end_update(_require_object(_parse_json(body)))),
                "/pause_generation": (("POST",), lambda: self._pause(_require_object(_parse_json(body)))),
                "/continue_generation": (("POST",), lambda: self._continue()),
                "/abort_request": (("POST",), lambda: self._abort(_require_object(_parse_json(body)))),
            }
            if path not in routes:
                raise HTTPError(404, f"no endpoint {path}")
            methods, handler = routes[path]
            if method not in methods:
                raise HTTPError(405, f"{path} accepts {', '.join(methods)}")
            status, payload = handler()
        except HTTPError as exc:
            status, payload = exc.status, {"error": {"message": str(exc)}}
        except ValueError as exc:  # RequestError and config errors: the client's to fix
            status, payload = 400, {"error": {"message": str(exc)}}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            log.exception("error serving %s", path)
            status, payload = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        try:
            self._send(status, payload)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _health(self) -> tuple[int, Any]:
        health = self.server_state.engine.health()
        return (200 if health.get("ok") else 503), health

    def _set_version(self, data: dict[str, Any]) -> tuple[int, Any]:
        version = _opt_int(data.get("new_version"), "new_version")
        if version is None:
            raise HTTPError(400, "field 'new_version' is required")
        engine = self.server_state.engine
        if data.get("abort_all_requests", True):
            engine.abort(None)
        engine.update_weights({}, version)
        return 200, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def _begin_update(self) -> tuple[int, Any]:
        engine = self.server_state.engine
        if not hasattr(engine, "begin_weight_update"):
            raise HTTPError(400, "this engine does not support weight-update sessions")
        engine.begin_weight_update()
        return 200, {"success": True, "message": "weight update session open"}

    def _end_update(self, data: dict[str, Any]) -> tuple[int, Any]:
        engine = self.server_state.engine
        version = _opt_int(data.get("weight_version"), "weight_version")
        try:
            engine.end_weight_update(version)
        except RuntimeError as exc:
            raise HTTPError(400, str(exc)) from None
        return 200, {"success": True, "message": f"weight version {engine.version}", "weight_version": engine.version}

    def _pause(self, data: dict[str, Any]) -> tuple[int, Any]:
        mode = data.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise HTTPError(400, f"field 'mode' must be 'abort', 'in_place' or 'retract', got {mode!r}")
        engine = self.server_state.engine
        engine.pause()
        if mode == "abort":
            engine.abort(None)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self) -> tuple[int, Any]:
        self.server_state.engine.resume()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort(self, data: dict[str, Any]) -> tuple[int, Any]:
        engine = self.server_state.engine
        if data.get("abort_all"):
            engine.abort(None)
        else:
            rid = data.get("rid")
            rids = rid if isinstance(rid, list) else [rid]
            if not rids or not all(isinstance(r, str) and r for r in rids):
                raise HTTPError(400, "field 'rid' must be a request id (or set abort_all)")
            engine.abort(rids)
        return 200, {"success": True}


def _require_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


__all__ = ["RolloutServer", "RequestError", "completion_json", "version_spans"]
