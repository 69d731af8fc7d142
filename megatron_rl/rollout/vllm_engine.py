"""`VLLMEngine`: the RolloutEngine interface over a vLLM server, and `VLLMServer`, which launches one.

Written against vLLM 0.32 (`vllm/entrypoints/scale_out/token_in_token_out/`, `entrypoints/rl/online/api_router.py`,
`entrypoints/serve/dev/`, `model_executor/model_loader/reload/inplace.py`); docs/vllm.md says what runs where.
The server must be started with `--enable-scale-out` (the token-in / token-out route) and the environment variable
`VLLM_SERVER_DEV_MODE=1` (the RL and control routes); `VLLMServer` does both.

How the calls map:
- generate / submit: `POST /inference/v1/generate` with the prompt's token ids and vLLM sampling parameters
  (`n`, `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `logprobs: 0`). Each choice carries its token
  ids, the sampled tokens' log-probs and `weight_versions` spans (output tokens [start, end) sampled by the weights
  labelled `version`; "default" is the launch weights). vLLM's default `logprobs_mode` is `raw_logprobs`: log softmax
  of the model's logits before temperature or truncation, the raw-policy value every engine here returns
  (rollout/engine.py).
- update_weights: the HF-named tensors are written as safetensors into a staging directory on tmpfs, then generation
  is frozen (`POST /pause?mode=keep`: running requests keep their place), the worker reloads in place from that
  directory (`POST /collective_rpc` `reload_weights` with `weights_path`), the version label moves on
  (`/update_weight_version`), the prefix cache is reset with the running requests
  (`/reset_prefix_cache?reset_running_requests=true`: their KV entries are recomputed under the new weights, so no
  cached key or value of the old weights is read again), and generation resumes. vLLM's weight-transfer API
  (`init_weight_transfer_engine`, `update_weights`) has only GPU transports (NCCL, CUDA IPC); the reload from disk is
  the path vLLM offers on every device.
- pause / resume / abort / flush_cache / health: `/pause` (mode keep, or abort), `/resume`, `/abort_requests`,
  `/reset_prefix_cache`, `/health` and `/weight_info`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import save_file

from megatron_rl.config import ConfigError, InfrastructureError, interpreter_has_module
from megatron_rl.models.families import to_hf_config
from megatron_rl.rollout.client import EngineHTTPError, HTTPEngine, _buckets
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
from megatron_rl.rollout.vllm_checksums import ParameterDigests
from megatron_rl.rollout.vllm_transfer import TRANSFER_BACKENDS, VLLMWeightTransfer
from megatron_rl.types import Completion
from megatron_rl.weight_sync.shared_memory import OWNED_DIR_PREFIX, shm_directory

log = logging.getLogger(__name__)

# Where the run finds vLLM's own virtual environment (scripts/setup_vllm_cpu.sh makes it).
VLLM_PYTHON_ENV = "MEGATRON_RL_VLLM_PYTHON"
DEFAULT_VLLM_VENV = ".venv-vllm"


def vllm_python(configured: str = "") -> str:
    """The Python interpreter of the vLLM environment: `configured`, else $MEGATRON_RL_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working directory or the repository; refused by name when there is none."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidates = [configured] if configured else [
        os.environ.get(VLLM_PYTHON_ENV, ""), os.path.join(DEFAULT_VLLM_VENV, "bin", "python"),
        os.path.join(repo, DEFAULT_VLLM_VENV, "bin", "python")]
    for path in candidates:
        if path and os.path.isfile(os.path.expanduser(path)) and os.access(os.path.expanduser(path), os.X_OK):
            python = os.path.abspath(os.path.expanduser(path))
            if not interpreter_has_module(python, "vllm"):  # e.g. a set-up cut short by a full disk: refused here, not at server start
                raise ConfigError(f"cluster.generator.vllm_python: {python} has no vllm module; set it up again "
                                  "with `bash scripts/setup_vllm_cpu.sh` (CPU) or point it at a Python that "
                                  "imports vllm", field="cluster.generator.vllm_python")
            return python
    where = configured or f"${VLLM_PYTHON_ENV} or {DEFAULT_VLLM_VENV}/bin/python"
    raise ConfigError(f"cluster.generator.vllm_python: no vLLM environment at {where}; create one with "
                      "`bash scripts/setup_vllm_cpu.sh` (CPU) or point it at a Python that imports vllm",
                      field="cluster.generator.vllm_python")


def resolve_weight_transfer(setting: str, *, colocated: bool = False) -> str:
    """`cluster.generator.vllm_weight_transfer` for this machine: auto is nccl with a GPU, else reload, and reload
    for servers that share the trainer's GPUs (`colocated`), where nccl is refused by name (NCCL refuses two ranks
    on one GPU, and trainer rank 0 would share one with a worker); nccl without a GPU, and ipc anywhere but
    beside the trainer on its GPU, are refused by name."""
    if setting == "auto":
        return "nccl" if torch.cuda.is_available() and not colocated else "reload"
    if setting == "nccl" and not torch.cuda.is_available():
        raise ConfigError("cluster.generator.vllm_weight_transfer: nccl needs a GPU in this process; without one use "
                          "reload (a server on this host) or gloo (docs/vllm.md)",
                          field="cluster.generator.vllm_weight_transfer")
    if setting == "nccl" and colocated:
        raise ConfigError("cluster.generator.vllm_weight_transfer: nccl between the trainer and vLLM servers on its own "
                          "GPUs (rollout.placement colocated) would put two ranks on one GPU, which NCCL refuses; use "
                          "ipc, reload or auto", field="cluster.generator.vllm_weight_transfer")
    if setting == "ipc" and not (colocated and torch.cuda.is_available()):
        raise ConfigError("cluster.generator.vllm_weight_transfer: ipc maps trainer rank 0's GPU memory into the server, "
                          "so it needs the server on that GPU (rollout.placement colocated, with a GPU)",
                          field="cluster.generator.vllm_weight_transfer")
    return setting


def check_plugin(python: str, transfer: str) -> None:
    """The gloo transfer needs megatron_rl's vLLM plugin in vLLM's environment: refused by name without it."""
    if transfer == "gloo" and not interpreter_has_module(python, "megatron_rl_vllm"):
        raise ConfigError(f"cluster.generator.vllm_weight_transfer: gloo needs megatron_rl's vLLM plugin in {python}'s "
                          "environment; install it with `bash scripts/setup_vllm_cpu.sh` or "
                          f"`{python} -m pip install --no-deps ./plugins/vllm`",
                          field="cluster.generator.vllm_weight_transfer")


def device_server_args() -> list[str]:
    """`vllm serve` flags this machine needs. On CPU: --no-enable-chunked-prefill, because vLLM 0.32's CPU build
    fails a seeded request whose prompt is split over steps ("CPU Generator does not use offset": rewinding the
    request's generator after a discarded partial-prefill sample needs CUDA generators' offsets), and every
    rollout request here is seeded."""
    return [] if torch.cuda.is_available() else ["--no-enable-chunked-prefill"]


def _version_label(value: Any, launch_version: int) -> int:
    if value is None or value == "default":
        return launch_version  # the weights the server was launched with
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def vllm_sampling_params(request: GenerateRequest) -> dict[str, Any]:
    """vLLM `SamplingParams` (JSON) for one request: all its n samples, the sampled token's log-prob only."""
    s = request.sampling
    params: dict[str, Any] = {"n": s.n, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                              "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p, "ignore_eos": s.ignore_eos,
                              "logprobs": 0, "detokenize": bool(s.stop)}
    if s.seed is not None:
        params["seed"] = s.seed
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.stop:
        params["stop"] = list(s.stop)
        params["include_stop_str_in_output"] = True  # as every engine here: the stopping tokens stay in the output
    return params


def completions_from_vllm(response: dict[str, Any], request: GenerateRequest, launch_version: int) -> list[Completion]:
    """The `/inference/v1/generate` response for `request` -> its n Completions, in sample order."""
    choices = sorted(response.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if len(choices) != request.sampling.n:
        raise EngineHTTPError(200, f"vLLM returned {len(choices)} choices for n={request.sampling.n}")
    out = []
    for sample_id, choice in zip(request.sample_ids(), choices):
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise EngineHTTPError(200, f"vLLM returned {len(content)} log-probs for {len(ids)} tokens")
        versions = [launch_version] * len(ids)
        for span in choice.get("weight_versions") or []:
            for i in range(int(span["start"]), min(int(span["end"]), len(ids))):
                versions[i] = _version_label(span["version"], launch_version)
        reason = choice.get("finish_reason") or "abort"
        out.append(Completion(request_id=sample_id, prompt_ids=list(request.prompt_ids), output_ids=ids,
                              output_logprobs=[float(c["logprob"]) for c in content], weight_versions=versions,
                              finish_reason=reason if reason in ("stop", "length") else "abort",
                              group_id=request.group_id))
    return out


class VLLMEngine:
    """RolloutEngine over one vLLM server (see the module docstring). Thread-safe. `server`: the process this
    engine launched (stopped on close); `launch_version`: the weight version the server was launched with."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 3600.0, max_workers: int = 64,
                 launch_version: int = 0, staging_dir: str | None = None, server: "VLLMServer | None" = None,
                 tied_embeddings: bool = False, launch_dir: str | None = None, weight_transfer: str = "reload",
                 transfer_workers: int = 1, transfer_address: str = "127.0.0.1", sleep_mode: bool = False,
                 verify_weights: bool = False, weight_dtype: torch.dtype | None = None):
        """`launch_dir`: the weights the server was launched from, removed on close. `tied_embeddings`: the model
        ties its output layer to the embedding and the server was launched untied (`launch_model_dir`): every
        update sends the embedding as `lm_head.weight` too. `staging_dir`: where updates are written (default:
        tmpfs, named by this process's pid so that a dead run's directory is reclaimed). `weight_transfer`:
        reload (from the staging directory), or nccl / gloo through vLLM's weight-transfer API
        (rollout/vllm_transfer.py; the server launched with that backend), with `transfer_workers` worker
        processes (TP x PP) reaching this host at `transfer_address`. `sleep_mode`: the server was launched with
        `--enable-sleep-mode` beside the trainer, and sleeps while it trains (`release_memory_occupation`).
        `verify_weights`: read the weights back after every update (rollout/vllm_checksums.py), as the server holds
        them in `weight_dtype` (None: as sent)."""
        if weight_transfer not in ("reload", *TRANSFER_BACKENDS):
            raise ValueError(f"weight_transfer {weight_transfer!r}: reload, {', '.join(TRANSFER_BACKENDS)}")
        self.weight_transfer = weight_transfer
        self.sleep_mode = sleep_mode
        self.verify_weights = verify_weights
        self.weight_dtype = weight_dtype
        self._transfer_options = dict(backend=weight_transfer, workers=transfer_workers, master_address=transfer_address)
        self._transfer: VLLMWeightTransfer | None = None
        self.tied_embeddings = tied_embeddings
        self.launch_dir = launch_dir
        self.http = HTTPEngine(base_url, api_key=api_key, timeout=timeout, max_workers=max_workers)
        self.base_url = self.http.base_url
        self.launch_version = int(launch_version)
        self.server = server
        self._staging_root = staging_dir or os.path.join(
            shm_directory(), f"{OWNED_DIR_PREFIX}{os.getpid()}-vllm-{re.sub(r'[^A-Za-z0-9]+', '_', self.base_url)}")
        self._staged: str | None = None
        self._staged_version = self.launch_version
        self._paused: str | None = None
        self._update_lock = threading.Lock()
        self._server_lock = threading.Lock()
        self._closed = False

    # --- transport ------------------------------------------------------------------------------
    def _post(self, path: str, body: Any = None) -> Any:
        _, out = self.http.request("POST", path, {} if body is None else body)
        if isinstance(out, dict) and (out.get("success") is False or "error" in out):
            raise EngineHTTPError(200, f"{self.base_url}{path}: {out.get('error') or out}")
        return out

    def _generate(self, request: GenerateRequest) -> list[Completion]:
        body = {"request_id": request.request_id, "token_ids": [int(t) for t in request.prompt_ids],
                "sampling_params": vllm_sampling_params(request)}
        _, response = self.http.request("POST", "/inference/v1/generate", body)
        if not isinstance(response, dict):
            raise EngineHTTPError(200, f"{self.base_url}/inference/v1/generate: not a JSON object: {str(response)[:200]}")
        return completions_from_vllm(response, request, self.launch_version)

    # --- RolloutEngine --------------------------------------------------------------------------
    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        return submit_each(requests, lambda request: self.http._pool.submit(self._generate, request))

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Completion]:
        futures = [self.http._pool.submit(self._generate, r) for r in as_requests(requests)]
        return [c for f in futures for c in f.result()]

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Write the tensors to a staging directory and reload them in place (or send them through vLLM's
        weight-transfer API), generation frozen meanwhile; returns how many tensors went. With `verify_weights`,
        the server's parameters are then read back and compared (`verify_readback`)."""
        with self._update_lock:
            named = iter_named_tensors(named_tensors)
            if self.tied_embeddings:
                named = with_output_layer(named)
            digests = ParameterDigests(self.weight_dtype) if self.verify_weights else None
            if digests is not None:
                named = digests.observe(named)
            count = self._reload(named, version) if self.weight_transfer == "reload" else \
                self._transfer_weights(named, version)
            if digests is not None:
                self.verify_readback(digests)
            return count

    def verify_readback(self, digests: ParameterDigests) -> dict[str, Any]:
        """The server's parameters (`/weight_checker` checksum) against `digests` of what was sent; a mismatch
        fails the sync (RuntimeError naming the parameters), and a read-back that compares nothing too."""
        result = digests.compare(self._post("/weight_checker", {"action": "checksum"})["checksums"])
        if result["mismatched"] or not result["compared"]:
            raise RuntimeError(f"{self.base_url}: weight read-back after the update: {len(result['mismatched'])} of "
                               f"{result['compared']} parameters differ from what was sent "
                               f"({', '.join(result['mismatched'][:5]) or 'none comparable'})")
        log.info("%s: read back %d parameters, all equal to what was sent (%d not comparable here)", self.base_url,
                 result["compared"], len(result["not_compared"]))
        return result

    def _reload(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None) -> int:
        target = os.path.join(self._staging_root, f"v{version if version is not None else 'next'}-{time.time_ns()}")
        os.makedirs(target)
        count = 0
        try:
            for index, bucket in enumerate(_buckets(named, 1 << 30)):
                save_file(bucket, os.path.join(target, f"model-{index:05d}.safetensors"))
                count += len(bucket)
            with self._generation_frozen():
                self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": target}})
                if version is not None:
                    self._post("/update_weight_version", {"new_version": str(int(version))})
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        if self._staged is not None:  # the server reads its model from the newest directory from now on
            shutil.rmtree(self._staged, ignore_errors=True)
        self._staged = target
        self._staged_version = self.launch_version if version is None else int(version)
        return count

    def _transfer_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None) -> int:
        if self._transfer is None:
            self._transfer = VLLMWeightTransfer(self._post, **self._transfer_options)
        try:
            with self._generation_frozen():
                sent = self._transfer.send(named, version)
        except BaseException:
            self._transfer.close()  # what the group holds is unknown now: the next update forms it again
            self._transfer = None
            raise
        return int(sent["tensors"])

    @contextlib.contextmanager
    def _generation_frozen(self):
        """Generation frozen in place around a weight update (unless the caller paused it), and the prefix cache
        reset with the running requests before it goes on: their KV entries are recomputed under the new weights."""
        pause_here = self._paused is None
        if pause_here:
            self._post("/pause?mode=keep")
        try:
            yield
            self._post("/reset_prefix_cache?reset_running_requests=true")
        finally:
            if pause_here:
                self._post("/resume")

    @property
    def stages_weights(self) -> bool:
        """Whether the weights this engine serves are on disk after an update (`staged_weights`), from where a
        restarted server reloads them; with a weight transfer they are only in the server."""
        return self.weight_transfer == "reload"

    def staged_weights(self) -> tuple[str | None, int]:
        """The directory of the weights this engine serves (None: its launch weights) and their version."""
        return self._staged, self._staged_version

    def restart(self, weights_dir: str | None, version: int) -> None:
        """Relaunch the server this engine launched (same flags and port), load `weights_dir` (None: the launch
        weights) and label them `version`: a pool's dead engine serving again with the current weights."""
        with self._server_lock:
            if self.server is None or self._closed:
                raise RuntimeError(f"{self.base_url}: closed, or a server this run did not launch")
            self.server.stop()
            self.server = self.server.relaunch()
            if self._transfer is not None:  # the group died with the server: the next update forms a new one
                self._transfer.close(notify=False)
                self._transfer = None
        self.server.wait_ready(self.server.ready_timeout)  # fails at once if close() stopped it meanwhile
        self._paused = None
        if weights_dir is not None:
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
        if version != self.launch_version or weights_dir is not None:
            self._post("/update_weight_version", {"new_version": str(int(version))})

    def pause(self, mode: str = "retract") -> None:
        """retract / in_place: requests stay queued (vLLM's keep; a flush after an update recomputes their KV
        under the new weights); abort: vLLM aborts them (finish_reason abort)."""
        self._post(f"/pause?mode={'abort' if mode == 'abort' else 'keep'}")
        self._paused = mode

    @property
    def paused_mode(self) -> str | None:
        return self._paused

    def resume(self) -> None:
        self._post("/resume")
        self._paused = None

    def release_memory_occupation(self) -> dict[str, int]:
        """Colocated on a GPU: the server sleeps (level 1: its weights to host memory, its KV cache freed) once
        the requests it holds have finished, so the trainer has the GPU for its step."""
        if self.sleep_mode:
            self._post("/sleep?level=1&mode=wait")
        return {}

    def resume_memory_occupation(self) -> None:
        """Undo `release_memory_occupation`: weights back on the GPU, the KV cache allocated again."""
        if self.sleep_mode:
            self._post("/wake_up")

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        ids = None if request_ids is None else ([request_ids] if isinstance(request_ids, str) else list(request_ids))
        self._post("/abort_requests", {"request_ids": ids} if ids else {})

    def flush_cache(self) -> bool:
        try:
            self._post("/reset_prefix_cache?reset_running_requests=true")
            return True
        except (RequestError, EngineHTTPError):
            return False

    def health(self) -> dict[str, Any]:
        if self.server is not None and not self.server.alive():
            return {"ok": False, "error": f"vLLM server process exited ({self.server.returncode()})",
                    "url": self.base_url, "engine": "vllm"}
        try:
            self.http.request("GET", "/health")
            return {"ok": True, "version": self.version, "paused": self._paused is not None, "url": self.base_url,
                    "engine": "vllm"}
        except (EngineHTTPError, RequestError) as exc:
            return {"ok": False, "error": str(exc), "url": self.base_url, "engine": "vllm"}

    @property
    def version(self) -> int:
        _, info = self.http.request("GET", "/weight_info")
        return _version_label(info.get("weight_version") if isinstance(info, dict) else None, self.launch_version)

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.close(notify=self.server is None)  # a server we stop needs no notice
            self._transfer = None
        self.http.close()
        with self._server_lock:  # a restart in progress launches nothing after this
            self._closed = True
            server = self.server
        if server is not None:
            server.stop()
        shutil.rmtree(self._staging_root, ignore_errors=True)
        if self.launch_dir is not None:
            shutil.rmtree(self.launch_dir, ignore_errors=True)

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def with_output_layer(named: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    for name, tensor in named:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


def launch_model_dir(path: str, arch, state: dict[str, Any], tokenizer) -> bool:
    """Write the HF directory (config.json, tokenizer, safetensors) a vLLM server is launched from; returns
    whether the model's embeddings are tied. A tied model is written untied (`lm_head.weight` a copy of the
    embedding, `tie_word_embeddings` false): vLLM's in-place reload replaces the embedding's tensor and leaves
    a tied output layer on the old one (seen on the CPU build: greedy outputs diverge after the first update),
    so every update sends both."""
    tied = bool(arch.tie_word_embeddings)
    named: Iterable[tuple[str, Any]] = state.items()
    if tied:
        arch = dataclasses.replace(arch, tie_word_embeddings=False)
        named = with_output_layer(state.items())
    os.makedirs(path, exist_ok=True)
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = to_hf_config(arch, dtype=dtype, torch_dtype=dtype)
    if tokenizer is not None:
        config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
        tokenizer.save_hf(path)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    files = []
    for index, bucket in enumerate(_buckets(named, 1 << 30)):
        files.append(os.path.join(path, f"model-{index:05d}.safetensors"))
        save_file(bucket, files[-1])
    if len(files) == 1:  # the name transformers looks for, too
        os.replace(files[0], os.path.join(path, "model.safetensors"))
    return tied


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process in the vLLM environment, in its own session (stopped with
    its whole process tree; a SIGKILLed run's server follows it through the parent-death signal)."""

    def __init__(self, model_dir: str, *, python: str, port: int | None = None, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | None = None, ready_timeout: float = 600.0):
        self._launch = dict(model_dir=model_dir, python=python, args=tuple(args), env=dict(env or {}),
                            log_path=log_path, ready_timeout=ready_timeout)
        self.ready_timeout = ready_timeout
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
                   "--port", str(self.port), "--enable-scale-out", *args]
        environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # the run's own environment must not leak into vLLM's
            environment.pop(name, None)
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.command = command
        self.shm_files: set[str] = set()  # shared-memory files its processes held (removed by `stop` if left)
        # Started from one thread that lives as long as this process: the parent-death signal fires when the
        # thread that forked the child ends (Linux), and a restart runs in a short-lived thread.
        self.process = _LAUNCHER.submit(subprocess.Popen, command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=environment, start_new_session=True, preexec_fn=_die_with_parent).result()

    def relaunch(self) -> "VLLMServer":
        """The same server again (same flags, same port), once this one has stopped."""
        return VLLMServer(port=self.port, **self._launch)

    def alive(self) -> bool:
        return self.process.poll() is None

    def returncode(self) -> int | None:
        return self.process.poll()

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers; refused in one line (with the log's last lines) when the process exits first."""
        deadline = time.monotonic() + timeout
        probe = HTTPEngine(self.url, timeout=5.0, max_workers=1)
        try:
            while True:
                if not self.alive():
                    raise InfrastructureError(f"vLLM server on port {self.port} exited with {self.returncode()} "
                                              f"while starting: {self.tail()}")
                with contextlib.suppress(EngineHTTPError, RequestError):
                    probe.request("GET", "/health")
                    self.shm_files |= _shm_files_of(_processes_in_group(self.process.pid))  # its message queues
                    return
                if time.monotonic() > deadline:
                    raise InfrastructureError(f"vLLM server on port {self.port} not ready after {timeout:.0f} s: "
                                              f"{self.tail()}")
                time.sleep(1.0)
        finally:
            probe.close()

    def tail(self, lines: int = 3) -> str:
        if not self.log_path or not os.path.isfile(self.log_path):
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - 4096))
            text = f.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) + f" (log: {self.log_path})"

    def stop(self, grace: float = 20.0) -> None:
        if self.alive():
            self.shm_files |= _shm_files_of(_processes_in_group(self.process.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
                os.killpg(self.process.pid, signal.SIGCONT)  # a stopped (hung) server handles the SIGTERM now
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        else:  # the server is gone; its workers may not be
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # until the last of its processes is gone
            try:
                os.killpg(self.process.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        _remove_unheld(self.shm_files)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def _processes_in_group(pgid: int) -> list[str]:
    """The pids (as /proc names) of the live processes in process group `pgid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:  # field 5, pgrp, after "(comm)"
                    found.append(pid)
    return found


def _shm_files_of(pids: Iterable[str]) -> set[str]:
    """The files in the shared-memory directory that the processes `pids` have mapped or open."""
    prefix = shm_directory().rstrip("/") + "/"
    held = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                held.update(line.split(maxsplit=5)[5].strip() for line in maps
                            if prefix in line and len(line.split(maxsplit=5)) == 6 and "(deleted)" not in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(target)
    return held


def _remove_unheld(paths: set[str]) -> list[str]:
    """Remove those of `paths` (a stopped vLLM server's shared memory: its message queues, semaphores) that no
    live process holds. A server killed with SIGKILL (a restart after a crash, the OOM killer) cannot unlink
    them: about 400 MB each time on CPU. Only files its own processes held are ever candidates (a 32-byte
    named semaphore vLLM's API server creates and does not hold is not one of them, and stays)."""
    present = {p for p in paths if os.path.exists(p)}
    if not present:
        return []
    held = _shm_files_of(filter(str.isdigit, os.listdir("/proc")))
    removed = []
    for path in sorted(present - held):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    if removed:
        log.info("removed %d shared-memory file(s) a stopped vLLM server left: %s", len(removed), ", ".join(removed))
    return removed


_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-server-launcher")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching thread (`_LAUNCHER`'s, alive as long as the process)
    dies, however the process dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
