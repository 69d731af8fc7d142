"""`EnginePool`: the generator group as one RolloutEngine: several engine replicas (SGLang servers on
a cluster, or any RolloutEngine), requests spread over them, weights pushed into all of them.

Each request (a whole prompt group: all n samples) goes to the replica with the fewest samples in
flight, so groups stay on one engine (prefix sharing) and replicas stay evenly loaded.

Engines fail without failing the run: a request that fails for a reason of the engine's (unreachable, a
server error; not a refused request) takes that engine out of the pool and goes, as a whole group, to a live
one. An engine that can restart itself (`restart(weights_dir, version)`: a vLLM server the run launched) is
restarted in the background with the current weights and version, then serves again (`rollout/engine_restarts`
counts them; after `max_restarts_per_engine` an engine that keeps dying stays out). Requests wait for an engine
while none is live, and fail with one line naming the dead engines when none comes back within
`dead_engine_timeout_s`. An engine that hangs (requests in flight, none finishing for `hung_engine_timeout_s`:
a deadlocked server that still accepts connections) is taken out the same way: a watchdog sends its groups
whole to a live engine, and whatever the hung engine answers later is ignored. Weights go
either through each replica's own `update_weights`, or, for SGLang servers on a cluster, through one
`BroadcastWeightSender` (weight_sync/distributed.py): an NCCL group between this rank and every
engine GPU, joined lazily on the first update, with block-fp8 quantization when the engines run fp8.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch

from megatron_rl.config import InfrastructureError
from megatron_rl.rollout.client import EngineHTTPError, HTTPEngine, SGLangServer
from megatron_rl.rollout.engine import (
    GenerateRequest,
    NamedTensors,
    RequestError,
    RequestLike,
    as_requests,
    iter_named_tensors,
    wait_all,
)
from megatron_rl.types import Completion
from megatron_rl.weight_sync.distributed import BroadcastWeightSender
from megatron_rl.weight_sync.fp8 import iter_quantized

log = logging.getLogger(__name__)


def wait_until_ready(engines: Sequence[Any], timeout: float, poll_s: float = 5.0) -> None:
    """Block until every engine reports healthy (servers load 100s of GB before they answer)."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        pending = [e for e in pending if not e.health().get("ok")]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(getattr(e, "base_url", repr(e)) for e in pending[:4])
            raise RuntimeError(f"{len(pending)} engine(s) not ready after {timeout:.0f} s: {names}")
        time.sleep(poll_s)


class EnginePoolDead(InfrastructureError):
    """Every engine of the pool failed and none came back in time."""


def is_engine_failure(error: BaseException) -> bool:
    """Whether `error` says the engine is gone or broken (unreachable, a server-side error, a dead process),
    rather than that the request was wrong (RequestError) or the pool gave up (EnginePoolDead)."""
    if isinstance(error, (RequestError, EnginePoolDead)):
        return False
    if isinstance(error, EngineHTTPError):
        return error.status == 0 or error.status >= 500
    return isinstance(error, (ConnectionError, TimeoutError, OSError, BrokenPipeError, EOFError))


def _engine_name(engine: Any) -> str:
    return getattr(engine, "base_url", None) or type(engine).__name__


class _Dispatch:
    """One group sent to one engine; `settled` once its samples are resolved, or handed to another engine."""

    __slots__ = ("request", "samples", "settled")

    def __init__(self, request: GenerateRequest, samples: list[Future]):
        self.request, self.samples, self.settled = request, samples, False


class EnginePool:
    """RolloutEngine over several replicas (see the module docstring)."""

    def __init__(self, engines: Sequence[Any], *, weight_sender_factory=None, fp8_block_size: int | None = None,
                 dead_engine_timeout_s: float = 600.0, max_restarts_per_engine: int = 5,
                 hung_engine_timeout_s: float = 0.0):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)
        self._lock = threading.Lock()
        self._live = threading.Condition(self._lock)
        self._dead: dict[int, str] = {}  # engine index -> why it was taken out
        self.restarts = 0
        self.max_restarts_per_engine = max_restarts_per_engine  # an engine that keeps dying stays out after these
        self._restarts_of = [0] * len(self.engines)
        self._weights_lock = threading.Lock()
        self._missed: tuple[dict, int | None] | None = None  # the last weights an engine that is down did not get
        # Engines whose weights live only in their server (vLLM's weight transfer) have nothing on disk to restart
        # from: the pool keeps the last weights it pushed for them (one host copy; views of the trainer's own
        # tensors when it runs in this process).
        self._keeps_latest = any(hasattr(e, "restart") and not getattr(e, "stages_weights", True) for e in self.engines)
        self._latest: tuple[dict, int | None] | None = None
        self._adapter: tuple[str, int] | None = None  # LoRA: the PEFT directory and version the engines serve
        self.dead_engine_timeout_s = dead_engine_timeout_s
        self._redispatch = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-pool-redispatch")
        self._sender_factory = weight_sender_factory
        self._sender = None
        self._fp8_block_size = fp8_block_size
        self._version = min(getattr(e, "version", 0) for e in self.engines)
        self._flight: list[set[_Dispatch]] = [set() for _ in self.engines]
        self._progress = [time.monotonic()] * len(self.engines)  # when each engine last finished a sample
        self.hung_engine_timeout_s = hung_engine_timeout_s
        self._closed = threading.Event()
        if hung_engine_timeout_s > 0:
            threading.Thread(target=self._watch_for_hangs, name="engine-pool-watchdog", daemon=True).start()

    @classmethod
    def for_sglang_servers(cls, urls: Sequence[str], *, engine_tp: int, master_address: str, master_port: int,
                           precision: str = "bf16", fp8_block_size: int = 128, api_key: str | None = None,
                           ready_timeout: float = 3600.0, routing: tuple[int, int] | None = None,
                           **pool_options: Any) -> "EnginePool":
        """Generation over each server's /generate, weights over one NCCL group (SGLang's
        update_weights_from_distributed). `routing` (layers, top_k): MoE routing records with every
        completion (servers launched with --enable-return-routed-experts). `pool_options`: EnginePool's own
        (dead_engine_timeout_s, hung_engine_timeout_s, max_restarts_per_engine)."""
        def sender():
            return BroadcastWeightSender([SGLangServer(u, api_key=api_key) for u in urls], [engine_tp] * len(urls),
                                         master_address=master_address, master_port=master_port, backend="nccl")

        engines = [HTTPEngine(u, api_key=api_key, routing=routing) for u in urls]
        wait_until_ready(engines, ready_timeout)
        return cls(engines, weight_sender_factory=sender, fp8_block_size=fp8_block_size if precision == "fp8" else None,
                   **pool_options)

    # --- requests -------------------------------------------------------------------------------
    def _pick(self, samples: int) -> int:
        """The live engine with the fewest samples in flight; waits while none is live (a restart may bring
        one back), and raises EnginePoolDead after dead_engine_timeout_s."""
        deadline = time.monotonic() + self.dead_engine_timeout_s
        with self._live:
            while len(self._dead) == len(self.engines):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EnginePoolDead("no rollout engine left: " + "; ".join(
                        f"{_engine_name(self.engines[i])}: {why}" for i, why in sorted(self._dead.items())) +
                        f" (none came back within {self.dead_engine_timeout_s:.0f} s)")
                self._live.wait(min(left, 5.0))
            live = [i for i in range(len(self.engines)) if i not in self._dead]
            index = min(live, key=self._in_flight.__getitem__)
            self._in_flight[index] += samples
            return index

    def _dispatch(self, request: GenerateRequest, samples: list[Future]) -> None:
        """Send `request` to a live engine; its completions resolve `samples`, or, when the engine failed,
        the whole group goes again to another engine."""
        try:
            index = self._pick(request.sampling.n)
        except EnginePoolDead as exc:
            for future in samples:
                if not future.done():
                    future.set_exception(exc)
            return
        dispatch = _Dispatch(request, samples)
        with self._lock:
            if not self._flight[index]:
                self._progress[index] = time.monotonic()  # an idle engine's clock starts with its first request
            self._flight[index].add(dispatch)
        try:
            inner = self.engines[index].submit([request])
        except Exception as exc:
            inner = [Future()]
            inner[0].set_exception(exc)
        remaining = [len(inner)]

        def finished(_future: Future) -> None:
            with self._lock:
                self._progress[index] = time.monotonic()
                remaining[0] -= 1
                if remaining[0] or dispatch.settled:
                    return  # more to come, or the watchdog gave the group to another engine
                dispatch.settled = True
                self._flight[index].discard(dispatch)
                self._in_flight[index] -= request.sampling.n
            errors = [f.exception() for f in inner if f.exception() is not None]
            if errors and is_engine_failure(errors[0]):
                self._take_out(index, f"{type(errors[0]).__name__}: {errors[0]}")
                self._redispatch.submit(self._dispatch, request, samples)
                return
            for future, result in zip(samples, inner):
                if result.exception() is not None:
                    future.set_exception(result.exception())
                else:
                    future.set_result(result.result())

        for future in inner:
            future.add_done_callback(finished)

    def _watch_for_hangs(self) -> None:
        """Take out every live engine with groups in flight that finished nothing for hung_engine_timeout_s;
        its groups go to the live engines."""
        timeout = self.hung_engine_timeout_s
        while not self._closed.wait(min(5.0, timeout / 4)):
            now = time.monotonic()
            for index in range(len(self.engines)):
                with self._lock:
                    if index in self._dead or not self._flight[index] or now - self._progress[index] < timeout:
                        continue
                    stranded = [d for d in self._flight[index] if not d.settled]
                    for dispatch in stranded:
                        dispatch.settled = True
                        self._in_flight[index] -= dispatch.request.sampling.n
                    self._flight[index].clear()
                self._take_out(index, f"hung: {len(stranded)} group(s) in flight and none finished in {timeout:.0f} s")
                for dispatch in stranded:
                    self._redispatch.submit(self._dispatch, dispatch.request, dispatch.samples)

    def _take_out(self, index: int, why: str) -> None:
        with self._lock:
            if index in self._dead:
                return
            self._dead[index] = why
        engine = self.engines[index]
        restart = hasattr(engine, "restart") and self._restarts_of[index] < self.max_restarts_per_engine
        log.warning(f"rollout engine {_engine_name(engine)} failed ({why}); its requests go to the other engines"
                    + ("; restarting it" if restart else "; it stays out" if hasattr(engine, "restart") else ""))
        if restart:
            self._restarts_of[index] += 1
            threading.Thread(target=self._restart, args=(index,), name=f"engine-restart-{index}", daemon=True).start()

    def _restart(self, index: int) -> None:
        engine = self.engines[index]
        try:
            weights_dir, version = self._freshest_weights(index)
            engine.restart(weights_dir, version)
            with self._weights_lock:  # weights newer than any on disk: pushed while it was down, or never on disk
                newer = [w for w in (self._missed, self._latest) if w is not None and w[1] is not None and w[1] > version]
                if newer:
                    named, version = max(newer, key=lambda w: w[1])
                    engine.update_weights(named, version)
                if self._adapter is not None:  # LoRA: the adapters the others serve
                    engine.load_adapter(*self._adapter)
                    version = self._adapter[1]
                with self._live:
                    self._dead.pop(index, None)
                    if not self._dead:
                        self._missed = None
                    self.restarts += 1
                    self._live.notify_all()
        except Exception as exc:  # it stays out; the others carry on
            log.warning(f"rollout engine {_engine_name(engine)} could not be restarted: {exc}")
            return
        log.warning(f"rollout engine {_engine_name(engine)} restarted with weight version {version}")

    def _freshest_weights(self, index: int) -> tuple[str | None, int]:
        """The newest weights an engine of the pool holds on disk and their version (`staged_weights()`), for
        the restarted engine `index` to load; (None, its launch version) when no engine has been updated."""
        candidates = []
        for engine in self.engines:
            try:
                candidates.append(engine.staged_weights())
            except Exception as exc:  # a dead engine that cannot say: ask the others
                if not is_engine_failure(exc) and not isinstance(exc, AttributeError):
                    raise
        if not candidates:
            raise RuntimeError("no engine of the pool can say which weights it serves (staged_weights)")
        return max(candidates, key=lambda c: c[1])

    @property
    def engine_metrics(self) -> dict[str, float]:
        with self._lock:
            return {"rollout/engine_restarts": float(self.restarts), "rollout/engines_live": float(
                len(self.engines) - len(self._dead))}

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        futures: list[Future] = []
        for request in as_requests(requests):
            samples = [Future() for _ in range(request.sampling.n)]
            futures.extend(samples)
            self._dispatch(request, samples)
        return futures

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Completion]:
        return self.wait(self.submit(requests))

    # --- weights and control --------------------------------------------------------------------
    @property
    def takes_weight_deltas(self) -> bool:
        """Whether a delta sync can feed this pool (weight_sync/delta.py, sent as plain named tensors): its
        engines apply them (generator ranks, over the broadcast group) and none is restarted from scratch."""
        return (self._sender_factory is not None and not self._fp8_block_size
                and all(getattr(e, "takes_weight_deltas", False) for e in self.engines))

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engines hold their weights in (a delta is computed in it)."""
        names = {self.engines[i].health().get("dtype") for i in range(len(self.engines)) if i not in self._dead}
        if len(names) != 1 or None in names:
            raise RuntimeError(f"the pool's engines report weight dtypes {sorted(map(str, names))}: one is needed")
        return getattr(torch, names.pop())

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        if self._sender_factory is None:
            named = dict(iter_named_tensors(named_tensors))
            with self._weights_lock:
                for index, engine in enumerate(self.engines):
                    if index not in self._dead:
                        try:
                            engine.update_weights(named, version)
                        except Exception as exc:
                            if not is_engine_failure(exc):
                                raise
                            self._take_out(index, f"weight update failed: {exc}")
                    if index in self._dead:  # kept for its restart (held only while an engine is down)
                        self._missed = (named, version)
                if self._keeps_latest:
                    self._latest = (named, version)
        else:
            if self._sender is None:
                self._sender = self._sender_factory()
            named = iter_named_tensors(named_tensors)
            if self._fp8_block_size:
                named = iter_quantized(named, self._fp8_block_size)
            self._sender.push(named, version)
        if version is not None:
            self._version = int(version)

    def load_adapters(self, path: str, version: int) -> None:
        """LoRA: every live engine loads the PEFT directory `path` as the adapters of weight version `version`
        (`HTTPEngine.load_adapter`); an engine restarted later loads it too."""
        with self._weights_lock:
            self._adapter = (path, int(version))
            self._all("load_adapter", path, int(version))
        self._version = int(version)

    def _all(self, name: str, *args) -> list[Any]:
        """`name` on every live engine (an engine failing there is taken out, not the caller)."""
        out = []
        for index, engine in enumerate(self.engines):
            if index in self._dead:
                continue
            try:
                out.append(getattr(engine, name)(*args))
            except Exception as exc:
                if not is_engine_failure(exc):
                    raise
                self._take_out(index, f"{name} failed: {exc}")
        return out

    def release_memory_occupation(self) -> dict[str, int]:
        """Colocated engines free their memory for the trainer's step (those that can)."""
        self._all("release_memory_occupation")
        return {}

    def resume_memory_occupation(self) -> None:
        self._all("resume_memory_occupation")

    def pause(self) -> None:
        self._all("pause")

    def resume(self) -> None:
        self._all("resume")

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        ids = None if request_ids is None else list(request_ids)
        self._all("abort", ids)

    def flush_cache(self) -> bool:
        return all(self._all("flush_cache"))

    def health(self) -> dict[str, Any]:
        replicas = [engine.health() for engine in self.engines]
        return {"ok": any(r.get("ok", False) for r in replicas), "version": self._version,
                "restarts": self.restarts, "dead": {_engine_name(self.engines[i]): why for i, why in self._dead.items()},
                "running": sum(r.get("running", 0) for r in replicas),
                "waiting": sum(r.get("waiting", 0) for r in replicas), "replicas": replicas}

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        self._closed.set()
        if self._sender is not None:
            self._sender.close()
        self._redispatch.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
