"""`HTTPEngine`: a RolloutEngine that talks to `megatron-rl serve` (or, for generation and control, an
SGLang server) over HTTP. Standard library only.

generate() sends one batched /generate call; submit() sends one call per request from a thread pool,
so a caller streaming prompts keeps the server's continuous batch full. update_weights() sends
safetensors buckets (raw octet-stream bodies, never pickles) inside a begin/end weight-update session,
so the server applies all buckets between the same two decoding steps (our own server's protocol;
SGLang servers take weights through `SGLangServer` and weight_sync/distributed.py).

Written against SGLang 0.5.23 (docs/gpu.md; tests/test_sglang_contract.py checks every body against
tests/fixtures/sglang_0.5.23_contract.json): `/abort_request` takes one `rid` string per call; the info
endpoints are `/model_info` and `/server_info` (the `/get_*` ones are deprecated); a server launched
from the checkpoint reports weight version "default", which is our version 0.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import save as save_safetensors

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import (
    GenerateRequest,
    NamedTensors,
    RequestError,
    RequestLike,
    as_requests,
    iter_named_tensors,
    submit_each,
    wait_all,
)
from megatron_rl.types import Completion

log = logging.getLogger(__name__)
from megatron_rl.weight_sync.distributed import DEFAULT_GROUP_NAME


class EngineHTTPError(RuntimeError):
    """A non-400 HTTP failure (server error, auth, unreachable)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def encode_routed_experts(record: torch.Tensor) -> str:
    """A routing record [positions, layers, top_k] as SGLang returns one in `meta_info.routed_experts`:
    base64 of its int32 bytes (sglang/srt/state_capturer/routed_experts.py, 0.5.23)."""
    return base64.b64encode(record.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, layers: int, top_k: int) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` -> the int16 record `Completion.routed_experts` holds, [positions,
    layers, top_k]. With `routed_experts_start_len` 0 (what we send) the positions are [0, prompt + output
    - 1): every token fed through the model, the experts each layer routed it to (prefix-cache hits
    included: SGLang keeps the record with the cached KV). Raises ValueError when the size does not fit
    the model's layers x top_k (a server of another model)."""
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    if flat.numel() % (layers * top_k):
        raise ValueError(f"meta_info.routed_experts holds {flat.numel()} expert ids, not a multiple of "
                         f"layers x top_k = {layers} x {top_k} (is the server running this model?)")
    return flat.view(-1, layers, top_k).to(torch.int16)


def completion_from_json(out: dict[str, Any], prompt_ids: list[int], group_id: str,
                         routing: tuple[int, int] | None = None) -> Completion:
    """An SGLang /generate output dict (with return_logprob) -> Completion. `routing` (layers, top_k):
    decode the MoE routing record the request asked for (`return_routed_experts`)."""
    meta = out.get("meta_info", {})
    output_ids = list(out.get("output_ids") or [])
    routed = None
    if routing is not None:
        # the server's launch does not match the run (a user's mistake, one line): a config error
        if not meta.get("routed_experts"):
            raise ConfigError("cluster.generator.urls: the server returned no meta_info.routed_experts for a request with "
                              "return_routed_experts: launch SGLang with --enable-return-routed-experts",
                              field="cluster.generator.urls")
        try:
            routed = decode_routed_experts(meta["routed_experts"], *routing)
        except ValueError as exc:
            raise ConfigError(f"cluster.generator.urls: {exc}", field="cluster.generator.urls") from None
    logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
    spans = meta.get("weight_versions")
    if spans:
        versions = [0] * len(output_ids)
        for span in spans:
            for i in range(int(span["start"]), min(int(span["end"]), len(output_ids))):
                versions[i] = _version_int(span["version"])
    else:
        versions = [_version_int(meta.get("weight_version"))] * len(output_ids)
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else (reason or "abort")
    if kind not in ("stop", "length", "abort"):
        kind = "abort"
    return Completion(request_id=str(meta.get("id", "")), prompt_ids=list(prompt_ids), output_ids=output_ids,
                      output_logprobs=logprobs, weight_versions=versions, finish_reason=kind,
                      group_id=meta.get("group_id") or group_id, routed_experts=routed)


def _version_int(value: Any) -> int:
    if value is None or value == "default":
        return 0  # SGLang's weight_version before any update: the checkpoint it was launched from
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


# How each server URL is paused, shared by the clients of one server in this process (the HTTPEngine
# that generates and the SGLangServer that syncs weights): a weight sync pauses a server itself only if
# nobody else has, and flushes the cache only where the pause freed the running requests.
_PAUSE_MODES: dict[str, str] = {}
_PAUSE_LOCK = threading.Lock()


def pause_mode(base_url: str) -> str | None:
    with _PAUSE_LOCK:
        return _PAUSE_MODES.get(base_url.rstrip("/"))


def _set_pause_mode(base_url: str, mode: str | None) -> None:
    with _PAUSE_LOCK:
        if mode is None:
            _PAUSE_MODES.pop(base_url.rstrip("/"), None)
        else:
            _PAUSE_MODES[base_url.rstrip("/")] = mode


class HTTPEngine:
    """RolloutEngine over HTTP (see the module docstring). Thread-safe."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 3600.0,
                 max_workers: int = 64, bucket_bytes: int = 512 << 20, routing: tuple[int, int] | None = None):
        """`routing` (the MoE model's layers, top_k): ask for every completion's routing record
        (`return_routed_experts`) and return it as `Completion.routed_experts`."""
        self.base_url = base_url.rstrip("/")
        self.routing = routing
        self.api_key = api_key
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout-http-client")
        self._adapter: tuple[str, int] | None = None  # (SGLang LoRA name, weight version) new requests use

    # --- transport ------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                content_type: str = "application/json") -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, _decode(resp.read(), resp.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as exc:
            payload = _decode(exc.read(), exc.headers.get("Content-Type", "") if exc.headers else "")
            message = payload.get("error", {}).get("message", str(payload)) if isinstance(payload, dict) else str(payload)
            if exc.code == 400:
                raise RequestError(message) from None
            raise EngineHTTPError(exc.code, message) from None
        except urllib.error.URLError as exc:
            raise EngineHTTPError(0, f"cannot reach {self.base_url}: {exc.reason}") from None

    # --- RolloutEngine --------------------------------------------------------------------------
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[Completion]:
        if not requests:
            return []
        body = {"input_ids": [list(map(int, r.prompt_ids)) for r in requests],
                "sampling_params": [r.sampling.to_sglang() for r in requests],
                "rid": [r.request_id for r in requests], "return_logprob": True}
        if self.routing is not None:
            body["return_routed_experts"] = True
        adapter = self._adapter
        if adapter is not None:  # SGLang's lora_path names a loaded adapter (its lora_name)
            body["lora_path"] = [adapter[0]] * len(requests)
        _, outs = self.request("POST", "/generate", body)
        if isinstance(outs, dict):
            outs = [outs]
        expected = [(r, k) for r in requests for k in range(r.sampling.n)]
        if len(outs) != len(expected):
            raise EngineHTTPError(200, f"server returned {len(outs)} outputs for {len(expected)} samples")
        completions = [completion_from_json(out, r.prompt_ids, r.group_id, self.routing)
                       for out, (r, _) in zip(outs, expected)]
        if adapter is not None:  # a request runs on one adapter from start to end: every token is its version
            for completion in completions:
                completion.weight_versions = [adapter[1]] * len(completion.output_ids)
        return completions

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Completion]:
        return self._generate_batch(as_requests(requests))

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        return submit_each(requests, lambda request: self._pool.submit(self._generate_batch, [request]))

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        count = 0
        self.request("POST", "/begin_weight_update", {})
        try:
            for bucket in _buckets(iter_named_tensors(named_tensors), self.bucket_bytes):
                payload = save_safetensors(bucket)
                self.request("POST", "/update_weights_from_tensor", raw=payload,
                             content_type="application/octet-stream")
                count += len(bucket)
        finally:
            self.request("POST", "/end_weight_update", {"weight_version": version})
        return count

    def load_adapter(self, path: str, version: int) -> None:
        """LoRA: load the PEFT directory `path` (on storage the server reads) as adapter `policy-v<version>`
        (`/load_lora_adapter`, servers launched with --enable-lora), generate every new request with it, and unload
        the previous one in the background (SGLang unloads an adapter once the requests using it have finished)."""
        name = f"policy-v{version}"
        try:
            self.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except RequestError as exc:
            if "already exists" not in str(exc):  # left by an earlier attempt of this run (a resumed one): replace it
                raise
            self.request("POST", "/unload_lora_adapter", {"lora_name": name})
            self.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        previous, self._adapter = self._adapter, (name, int(version))
        if previous is not None and previous[0] != name:
            self._pool.submit(self._unload, previous[0])

    def _unload(self, name: str) -> None:
        try:
            self.request("POST", "/unload_lora_adapter", {"lora_name": name})
        except (RequestError, EngineHTTPError) as exc:  # a leftover adapter costs memory, not correctness
            log.warning(f"{self.base_url}: unloading LoRA adapter {name} failed: {exc}")

    def pause(self, mode: str = "retract") -> None:
        """Pause generation. retract (default) moves running requests back to the queue and frees their
        KV cache, so the flush that follows a paused weight update succeeds (SGLang refuses to flush
        while requests run, which in_place leaves them doing); they resume under the new weights."""
        self.request("POST", "/pause_generation", {"mode": mode})
        _set_pause_mode(self.base_url, mode)

    def resume(self) -> None:
        self.request("POST", "/continue_generation", {})
        _set_pause_mode(self.base_url, None)

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        if request_ids is None:
            self.request("POST", "/abort_request", {"abort_all": True})
            return
        # SGLang's AbortReq.rid is one string (a list is a 422); it aborts every request whose id starts with it
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            self.request("POST", "/abort_request", {"rid": str(rid)})

    def flush_cache(self) -> bool:
        try:
            self.request("POST", "/flush_cache")
            return True
        except (RequestError, EngineHTTPError):
            return False

    def health(self) -> dict[str, Any]:
        """ok when /health answers 200; version from /model_info (what SGLang reports there)."""
        try:
            self.request("GET", "/health")
            _, info = self.request("GET", "/model_info")
        except (EngineHTTPError, RequestError) as exc:
            return {"ok": False, "error": str(exc), "url": self.base_url}
        version = _version_int(info.get("weight_version")) if isinstance(info, dict) else -1
        return {"ok": True, "version": version, "url": self.base_url}

    @property
    def version(self) -> int:
        _, info = self.request("GET", "/model_info")
        return _version_int(info.get("weight_version"))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "HTTPEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterable[dict[str, torch.Tensor]]:
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    seen_storage: set[int] = set()
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen_storage:
            t = t.clone()  # safetensors refuses tensors that share memory (tied weights)
        seen_storage.add(t.untyped_storage().data_ptr())
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size, seen_storage = {}, 0, {t.untyped_storage().data_ptr()}
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def _decode(data: bytes, content_type: str) -> Any:
    if "json" in content_type:
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            pass
    return data.decode(errors="replace")


class SGLangServer:
    """The weight-update endpoints of one SGLang 0.5.23 HTTP server, a `WeightUpdateSession` for
    weight_sync/distributed.py: `/init_weights_update_group`, `/begin_weight_update`, bucket after bucket
    `/update_weights_from_distributed`, `/end_weight_update`, and the pause around them (request fields
    as sglang/srt/managers/io_struct.py names them)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 3600.0):
        self.http = HTTPEngine(base_url, api_key=api_key, timeout=timeout)

    def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            _, out = self.http.request("POST", path, body)
        except (RequestError, EngineHTTPError) as exc:  # SGLang answers a refused update with 400
            raise RuntimeError(f"{self.http.base_url}{path} failed: {exc}") from None
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"{self.http.base_url}{path} failed: {out.get('message')}")

    @property
    def paused_mode(self) -> str | None:
        return pause_mode(self.http.base_url)

    def pause(self, mode: str) -> None:
        self.http.pause(mode)

    def resume(self) -> None:
        self.http.resume()

    def begin_weight_update(self) -> None:
        self._post("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._post("/end_weight_update", {})

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name=DEFAULT_GROUP_NAME, backend="nccl") -> None:
        self._post("/init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                  "rank_offset": rank_offset, "world_size": world_size,
                                                  "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names, dtypes, shapes, version=None, group_name=DEFAULT_GROUP_NAME,
                                        flush_cache=False) -> None:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_distributed", body)


class PromptLogprobScorer:
    """Per-token log-probs of whole token sequences from an OpenAI-compatible server (`megatron-rl serve`,
    vLLM): one /v1/completions request per sequence with the ids as the prompt, `echo` and `logprobs`, and
    one generated token (servers refuse max_tokens 0), whose entry is dropped. The teacher of on-policy
    distillation when it runs as a server."""

    def __init__(self, base_url: str, *, model: str = "", api_key: str | None = None, timeout: float = 300.0,
                 max_workers: int = 8):
        url = base_url.rstrip("/")
        self.http = HTTPEngine(url[:-len("/v1")] if url.endswith("/v1") else url, api_key=api_key, timeout=timeout,
                               max_workers=max_workers)
        self.model = model

    def _score(self, ids: list[int]) -> list[float]:
        body = {"prompt": [int(t) for t in ids], "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        _, response = self.http.request("POST", "/v1/completions", body)
        try:
            values = response["choices"][0]["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise EngineHTTPError(200, f"{self.http.base_url}: the completion has no prompt log-probs "
                                       "(logprobs.token_logprobs); the server must support echo with logprobs") from None
        if len(values) < len(ids):
            raise EngineHTTPError(200, f"{self.http.base_url}: {len(values)} log-probs for a prompt of {len(ids)} tokens")
        return [0.0 if v is None else float(v) for v in values[:len(ids)]]

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for every token of each sequence (0.0 for the first)."""
        futures = [self.http._pool.submit(self._score, list(ids)) for ids in sequences]
        return [f.result() for f in futures]

    def close(self) -> None:
        self.http.close()
