"""The native rollout engine: a pre-norm decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch with a
per-slot KV cache, continuous batching, exact seeded sampling and in-place weight updates. Runs on CPU
or one GPU.

This module holds `NativeEngine`: its public API, the threads that drive it and its weight updates.
The model is in model.py (weights in weights.py), sampling in sampling.py, the KV cache in
kv_cache.py and the scheduling of one step in scheduler.py (mixed into NativeEngine).

Threads. One thread at a time runs steps (the "driver"). A blocking `generate()` drives in the
calling thread; `run_forever()` makes the calling thread the permanent driver (a dedicated engine
process); otherwise a background thread drives whatever `submit()` queued. Keeping the compute on the
thread that already uses torch matters on small CPUs: a second thread running torch ops creates a
second OpenMP pool, libgomp then throttles its spin-waits, and every parallel op pays a futex wake-up
(~25% slower decoding measured here). All public methods are thread-safe.

Weight updates happen between two steps under the model lock (`update_weights`), whether paused or
not; tokens sampled after an update carry the new version. Sequences in flight keep the KV entries
computed under the old weights (the usual partial-rollout semantics of asynchronous RL: their
`weight_versions` show the switch).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from megatron_rl.config import ConfigError
from megatron_rl.kernels import cpu_decode
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import canonical_hf_state
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import (
    GenerateRequest,
    NamedTensors,
    RequestError,
    RequestLike,
    as_request,
    iter_named_tensors,
    validate_request,
)
from megatron_rl.rollout.native.kv_cache import KVCache
from megatron_rl.rollout.native.lora import EngineAdapters
from megatron_rl.rollout.native.model import LlamaModel, _Batch, dynamic_rope_base
from megatron_rl.rollout.native.sampling import _sample_seed
from megatron_rl.rollout.native.scheduler import _Scheduler, _Seq
from megatron_rl.rollout.native.weights import LlamaWeights
from megatron_rl.types import Completion

log = logging.getLogger(__name__)


def context_limit(arch: ModelArch) -> int:
    """Longest sequence the engine serves for `arch`: max_position_embeddings, except with dynamic
    RoPE, which exists to stretch the context: up to `factor` times it."""
    limit = arch.max_position_embeddings
    if dynamic_rope_base(arch) is not None:
        limit = int(limit * max(1.0, arch.rope_scaling.factor))
    return limit


IDLE_TRIM_S = 1.0  # idle this long after work, a dedicated engine process hands its freed heap back


def return_freed_heap() -> None:
    """Hand memory freed inside the C heap back to the system (glibc keeps it otherwise: a load spike's
    activations, a loaded checkpoint's buffers); nothing where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class NativeEngine(_Scheduler):
    """The native rollout engine (see the module docstring). Thread-safe; implements RolloutEngine."""

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor] | NamedTensors | None, *,
                 tokenizer: Any = None, config: NativeEngineConfig | None = None, version: int = 0,
                 eos_token_ids: Sequence[int] | None = None, weight_arena: torch.Tensor | None = None,
                 core_share: Any = None):
        """`state`: HF-named weights to copy in. Or `weight_arena`: a flat buffer laid out by
        `weight_arena_layout` that already holds the weights, used in place (e.g. shared memory).
        `core_share`: the generator's side of a core share with a trainer process on the same host
        (placement/core_share.py: `set_busy(bool)`, `apply()`): each step runs on the cores the
        trainer is not using, and an idle engine says so."""
        self.config = config = config or NativeEngineConfig()
        self.core_share = core_share
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = config.dtype
        if dtype == "auto":
            dtype = "bf16" if self.device.type == "cuda" else "fp32"
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.arch = arch
        self.tokenizer = tokenizer
        self._dynamic_rope_base = dynamic_rope_base(arch)
        limit = context_limit(arch)
        self.max_seq_len = min(config.max_seq_len or limit, limit)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.stop_token_ids if tokenizer is not None else []
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        if (state is None) == (weight_arena is None):
            raise ValueError("NativeEngine needs exactly one of `state` (weights to copy) and `weight_arena`")
        self.kv_cache = KVCache(arch, config.max_batch_size, self.max_seq_len, self.device, self.dtype)
        self.weights = LlamaWeights(arch, self.device, self.dtype, weight_arena)
        if state is not None:
            if isinstance(state, dict):  # (a family's published form, e.g. GPT-OSS's stacked experts)
                state = canonical_hf_state(state, arch)
            self.weights.load(iter_named_tensors(state), strict=True)
        kernels = self._cpu_kernels(config.cpu_kernels)
        if config.prepack_weights:
            self.weights.enable_packing(self.kv_cache.slots, kernels=kernels)
        self.model = LlamaModel(self.weights, self.max_seq_len)
        self.model.kernels = kernels
        self._version = int(version)
        self._epoch = 0                                  # bumped by every weight load
        # shared state (guarded by _cv)
        self._cv = threading.Condition(threading.Lock())
        self._model_lock = threading.Lock()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []                   # index == slot
        self._abort_pending = False
        self._paused = False
        self._hold = 0
        self._closing = False
        self._callers = 0                                # threads driving steps inside generate()
        self._driver = threading.Lock()                  # held by whichever thread runs steps
        self._last_error: str | None = None
        self._stats = collections.Counter()
        self._seed_rng = random.Random()
        self._thread = threading.Thread(target=self._loop, name="native-rollout-engine", daemon=True)
        self._thread.start()

    def _cpu_kernels(self, mode: str) -> cpu_decode.CpuDecodeKernels | None:
        """The fused CPU kernels `engine.cpu_kernels` asks for, or None for torch ops."""
        if mode == "disabled":
            return None
        if self.device.type != "cpu" or not cpu_decode.CpuDecodeKernels.supports(self.dtype):
            if mode == "required":
                raise ConfigError(f"engine.cpu_kernels=required: the fused kernels run on CPU in fp32 or bf16, "
                                  f"this engine is on {self.device} in {self.dtype}")
            return None
        kernels = cpu_decode.load()
        if kernels is None and mode == "required":
            raise ConfigError(f"engine.cpu_kernels=required: the fused CPU kernels cannot be built here: "
                              f"{cpu_decode.load_error()}")
        return kernels

    @classmethod
    def from_pretrained(cls, source: Any, config: NativeEngineConfig | None = None, **kwargs: Any) -> "NativeEngine":
        """Build from a path / alias understood by `load_pretrained` (e.g. 'smollm2-135m') or a Pretrained."""
        pretrained = load_pretrained(source) if isinstance(source, str) else source
        return cls(pretrained.arch, pretrained.state, tokenizer=pretrained.tokenizer, config=config, **kwargs)

    # --- public API -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def prepare(self, requests: Sequence[RequestLike]) -> list[GenerateRequest]:
        """Normalise and validate requests (raises RequestError naming the request and field)."""
        out = []
        for i, item in enumerate(requests):
            request = as_request(item, i)
            validate_request(request, vocab_size=self.arch.vocab_size, max_seq_len=self.max_seq_len,
                             has_tokenizer=self.tokenizer is not None)
            out.append(request)
        return out

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest,
               on_token: Callable[[str, int, float, int], None] | None = None) -> list[Future]:
        """Queue requests; one Future[Completion] per sample. `on_token(sample_id, token_id, logprob,
        version)` is called on the step thread as each token is sampled (for streaming: keep it cheap,
        it runs under the engine's lock)."""
        if isinstance(requests, GenerateRequest):
            requests = [requests]
        prepared = self.prepare(requests)
        seqs = []
        for request in prepared:
            params = request.sampling
            base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            for k, sample_id in enumerate(request.sample_ids()):
                seqs.append(_Seq(sample_id, request.request_id, request.group_id, list(map(int, request.prompt_ids)),
                                 params, _sample_seed(base_seed, k, params.n), stop_ids, Future()))
                seqs[-1].on_token = on_token
        with self._cv:
            if self._closing:
                raise RuntimeError(f"engine is closed{': ' + self._last_error if self._last_error else ''}")
            self._waiting.extend(seqs)
            self._stats["submitted"] += len(seqs)
            self._cv.notify_all()
        return [s.future for s in seqs]

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest, timeout: float | None = None) -> list[Completion]:
        """Blocking: the calling thread runs the steps itself (other submitted requests share them)."""
        futures = self.submit(requests)
        self._drive(futures, timeout)
        return [f.result() for f in futures]

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        """Results of submitted futures; the calling thread runs the steps meanwhile (like generate)."""
        futures = list(futures)
        self._drive(futures, timeout)
        return [f.result() for f in futures]

    def run_forever(self) -> None:
        """Drive steps in the calling thread until close(): for a process dedicated to the engine,
        whose main thread runs this while other threads (HTTP handlers, IPC) only submit. Requests
        then never wait for the background thread, and torch keeps a single OpenMP pool."""
        with self._cv:
            self._callers += 1
        trimmed_after, idle_since = self._stats["steps"], None
        try:
            while not self._closing:
                if self._driver.acquire(timeout=0.05):
                    try:
                        self._steps_while(lambda: not self._closing)
                    finally:
                        self._driver.release()
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._abort_pending or self._can_step(), timeout=0.05)
                    busy, steps = bool(self._waiting or self._running), self._stats["steps"]
                if busy or steps == trimmed_after:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= IDLE_TRIM_S:  # once per spell of idleness after work
                    return_freed_heap()
                    trimmed_after, idle_since = steps, None
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def caller_driven(self) -> Iterator[None]:
        """Keep the background thread idle while open: steps run only in threads inside `wait` /
        `generate` (see rollout.engine.caller_driven)."""
        with self._cv:
            self._callers += 1
        try:
            yield
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()

    def _steps_while(self, keep_going) -> None:
        """Run engine steps on this thread (the caller holds the driver lock) while there is work and
        `keep_going()`; a failing step kills the engine (every waiter gets the error) and re-raises."""
        try:
            with torch.inference_mode():
                while keep_going() and self._step_once():
                    pass
        except BaseException as exc:
            self._die(exc)
            raise

    def pause(self) -> None:
        """Stop stepping; returns once no step is running. Running requests keep their KV state."""
        with self._cv:
            self._paused = True
        with self._model_lock:
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        ids = None if request_ids is None else ({request_ids} if isinstance(request_ids, str) else set(request_ids))
        with self._cv:
            for seq in itertools.chain(self._waiting, self._running):
                if ids is None or seq.sample_id in ids or seq.parent_id in ids:
                    seq.aborted = True
                    self._abort_pending = True
            self._cv.notify_all()

    def begin_weight_update(self) -> None:
        """Hold generation until end_weight_update (several update_weights calls then apply as one)."""
        with self._cv:
            self._hold += 1
        with self._model_lock:
            pass

    def end_weight_update(self, version: int | None = None) -> None:
        with self._cv:
            if self._hold <= 0:
                raise RuntimeError("end_weight_update without begin_weight_update")
            if version is not None:
                self._version = int(version)
            self._hold -= 1
            self._cv.notify_all()

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Copy HF-named tensors into the engine (a dict, (name, tensor) pairs or dict buckets) and set
        the version. Returns the number of tensors loaded. Names and shapes are checked per tensor;
        an error leaves the tensors before it applied and the version unchanged."""
        return self._apply_weights(lambda: self.weights.load(iter_named_tensors(named_tensors)), version)

    def update_adapters(self, named_tensors: NamedTensors, *, scaling: float, version: int | None = None) -> int:
        """Replace the LoRA adapters the engine applies beside its base weights (PEFT-named lora_A / lora_B
        factors, `scaling` = alpha / rank; rollout/native/lora.py) and set the version; the base weights stay as
        they are. An empty set removes the adapters. Returns the bytes the adapters hold."""
        named = dict(iter_named_tensors(named_tensors))
        adapters = EngineAdapters(self.arch, named, scaling=scaling, device=self.device, dtype=self.dtype) \
            if named else None  # checked before the engine pauses

        def switch() -> int:
            self.model.adapters = adapters
            return 0 if adapters is None else adapters.nbytes

        return self._apply_weights(switch, version)

    def adopt_weight_arena(self, arena: torch.Tensor, version: int | None = None) -> None:
        """Switch to weights that already sit in `arena` (laid out by `weight_arena_layout`): no copy,
        only GEMM re-packing where enabled. The caller must not write `arena` while the engine uses it
        (double-buffer: write the other arena, then adopt it)."""
        weights = LlamaWeights(self.arch, self.device, self.dtype, arena)
        if self.config.prepack_weights:
            weights.enable_packing(self.kv_cache.slots, kernels=self.model.kernels, lazily=True)  # (between steps)

        def switch() -> None:
            self.weights = self.model.w = weights

        self._apply_weights(switch, version)

    def _apply_weights(self, change, version: int | None):
        """Run `change()` between two steps as a new weights epoch, then set `version`; an error
        leaves the version unchanged."""
        self.begin_weight_update()
        try:
            with self._model_lock:
                with self._cv:
                    self._epoch += 1
                result = change()
        except BaseException:
            self.end_weight_update(None)
            raise
        with self._cv:
            self._stats["weight_updates"] += 1
        self.end_weight_update(version)
        return result

    def release_memory_occupation(self) -> dict[str, int]:
        """Give up what an idle engine holds so a colocated trainer can use it (SGLang's
        release_memory_occupation): the KV cache is freed, and on a GPU the weights move to host
        memory. Generation holds until `resume_memory_occupation`. Returns the bytes released per kind."""
        with self._cv:
            if self._running or self._waiting:
                raise RuntimeError("release_memory_occupation: requests are still running or waiting")
            self._hold += 1
        with self._model_lock:
            kv_bytes = self.kv_cache.free()
            weight_bytes = self.weights.arena.numel() * self.weights.arena.element_size()
            if self.device.type == "cuda":
                self._host_arena = self.weights.arena.to("cpu")
                self.weights = self.model.w = None  # drops the device arena
                torch.cuda.empty_cache()
        return {"kv_cache_bytes": kv_bytes, "weight_bytes": weight_bytes if self.device.type == "cuda" else 0}

    def resume_memory_occupation(self) -> None:
        """Undo `release_memory_occupation` (weights back on the device, the KV cache re-allocated on use)."""
        host = getattr(self, "_host_arena", None)
        if host is not None:
            self._host_arena = None
            arena = host.to(self.device)
            with self._model_lock:
                self.weights = self.model.w = LlamaWeights(self.arch, self.device, self.dtype, arena)
        self.end_weight_update(None)

    def flush_cache(self) -> bool:
        """Free the KV cache memory; refused (False) while requests are running or waiting."""
        with self._cv:
            if self._running or self._waiting:
                return False
            with self._model_lock:
                self.kv_cache.free()
            return True

    def named_weights(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """HF-named views of the engine's current weights (all, or those in `names`), for checksums."""
        table = self.weights._targets
        return {n: table[n] for n in (table if names is None else names) if n in table}

    def health(self) -> dict[str, Any]:
        with self._cv:
            return {"ok": self._thread.is_alive() and not self._closing, "version": self._version,
                    "running": len(self._running), "waiting": len(self._waiting), "paused": self._paused,
                    "last_error": self._last_error, "engine": "native", "device": str(self.device),
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "max_batch_size": self.kv_cache.slots, "max_seq_len": self.max_seq_len,
                    **{k: v for k, v in self._stats.items()}}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            for seq in itertools.chain(self._waiting, self._running):
                seq.aborted = True
            self._abort_pending = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @torch.inference_mode()
    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Raw fp32 logits [P, vocab] of every position of one sequence, through the engine's own
        forward (a private one-slot cache). For tests and debugging."""
        ids = list(map(int, token_ids))
        if not 0 < len(ids) <= self.max_seq_len:
            raise RequestError(f"token_ids has {len(ids)} tokens; need 1..{self.max_seq_len}", field="token_ids")
        cache = KVCache.scratch(self.arch, len(ids), self.device, self.dtype)
        dev = self.device
        batch = _Batch(tokens=torch.tensor(ids, device=dev), positions=torch.arange(len(ids), device=dev),
                       dec_slots=torch.empty(0, dtype=torch.long, device=dev),
                       dec_lens=torch.empty(0, dtype=torch.long, device=dev), dec_first_slot=-1,
                       chunks=[(0, 0, 0, len(ids))], logit_rows=torch.arange(len(ids), device=dev),
                       rope_lens=torch.full((len(ids),), len(ids), device=dev))
        with self._model_lock:
            return self.model.forward(batch, cache)

    # --- the step thread --------------------------------------------------------------------------
    def _can_step(self) -> bool:
        return not self._paused and not self._hold and bool(self._waiting or self._running)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as exc:  # the step thread must never die silently: fail everything queued
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.exception("native engine stopped")
        with self._cv:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._closing = True
            seqs = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._cv.notify_all()
        for seq in seqs:
            seq.finish = RuntimeError(f"native engine stopped: {self._last_error}")
        self._resolve(seqs)

    def _serve(self) -> None:
        """The background driver: steps whenever there is work and no blocking caller drives."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or (
                    (self._abort_pending or self._can_step()) and self._callers == 0))
                closing = self._closing
            if closing:
                with self._driver:
                    with self._cv:
                        finished = self._reap_aborted()
                    self._resolve(finished)
                return
            if not self._driver.acquire(timeout=0.05):
                continue
            try:
                while self._callers == 0 and self._step_once():
                    pass
            finally:
                self._driver.release()

    def _drive(self, futures: list[Future], timeout: float | None) -> None:
        """Run steps in the calling thread until `futures` are done. Keeping the compute on the
        caller's thread (usually the only thread using torch) avoids a second OpenMP thread pool,
        which makes libgomp throttle its spin-waits and every parallel op ~10x slower to start."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._callers += 1
        try:
            while not all(f.done() for f in futures):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"generate did not finish within {timeout} s")
                if self._driver.acquire(timeout=0.02):
                    try:
                        self._steps_while(lambda: not all(f.done() for f in futures))
                    finally:
                        self._driver.release()
                    if not all(f.done() for f in futures):
                        with self._cv:  # paused or holding for an update: wait for a change
                            self._cv.wait(timeout=0.02)
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()
