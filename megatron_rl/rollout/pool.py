"""`EnginePool`: the generator group as one RolloutEngine: several engine replicas (SGLang servers on
a cluster, or any RolloutEngine), requests spread over them, weights pushed into all of them.

Each request (a whole prompt group: all n samples) goes to the replica with the fewest samples in
flight, so groups stay on one engine (prefix sharing) and replicas stay evenly loaded. Weights go
either through each replica's own `update_weights`, or, for SGLang servers on a cluster, through one
`BroadcastWeightSender` (weight_sync/distributed.py): an NCCL group between this rank and every
engine GPU, joined lazily on the first update, with block-fp8 quantization when the engines run fp8.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

from megatron_rl.rollout.client import HTTPEngine, SGLangServer
from megatron_rl.rollout.engine import (
    GenerateRequest,
    NamedTensors,
    RequestLike,
    as_requests,
    iter_named_tensors,
    wait_all,
)
from megatron_rl.types import Completion
from megatron_rl.weight_sync.distributed import BroadcastWeightSender
from megatron_rl.weight_sync.fp8 import iter_quantized


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


class EnginePool:
    """RolloutEngine over several replicas (see the module docstring)."""

    def __init__(self, engines: Sequence[Any], *, weight_sender_factory=None, fp8_block_size: int | None = None):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)
        self._lock = threading.Lock()
        self._sender_factory = weight_sender_factory
        self._sender = None
        self._fp8_block_size = fp8_block_size
        self._version = min(getattr(e, "version", 0) for e in self.engines)

    @classmethod
    def for_sglang_servers(cls, urls: Sequence[str], *, engine_tp: int, master_address: str, master_port: int,
                           precision: str = "bf16", fp8_block_size: int = 128, api_key: str | None = None,
                           ready_timeout: float = 3600.0, routing: tuple[int, int] | None = None) -> "EnginePool":
        """Generation over each server's /generate, weights over one NCCL group (SGLang's
        update_weights_from_distributed). `routing` (layers, top_k): MoE routing records with every
        completion (servers launched with --enable-return-routed-experts)."""
        def sender():
            return BroadcastWeightSender([SGLangServer(u, api_key=api_key) for u in urls], [engine_tp] * len(urls),
                                         master_address=master_address, master_port=master_port, backend="nccl")

        engines = [HTTPEngine(u, api_key=api_key, routing=routing) for u in urls]
        wait_until_ready(engines, ready_timeout)
        return cls(engines, weight_sender_factory=sender, fp8_block_size=fp8_block_size if precision == "fp8" else None)

    # --- requests -------------------------------------------------------------------------------
    def _pick(self, samples: int) -> int:
        with self._lock:
            index = min(range(len(self.engines)), key=self._in_flight.__getitem__)
            self._in_flight[index] += samples
            return index

    def _done(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        futures: list[Future] = []
        for request in as_requests(requests):
            index = self._pick(request.sampling.n)
            for future in self.engines[index].submit([request]):
                future.add_done_callback(lambda _f, index=index: self._done(index))
                futures.append(future)
        return futures

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Completion]:
        return self.wait(self.submit(requests))

    # --- weights and control --------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        if self._sender_factory is None:
            named = dict(iter_named_tensors(named_tensors))
            for engine in self.engines:
                engine.update_weights(named, version)
        else:
            if self._sender is None:
                self._sender = self._sender_factory()
            named = iter_named_tensors(named_tensors)
            if self._fp8_block_size:
                named = iter_quantized(named, self._fp8_block_size)
            self._sender.push(named, version)
        if version is not None:
            self._version = int(version)

    def _all(self, name: str, *args) -> list[Any]:
        return [getattr(engine, name)(*args) for engine in self.engines]

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
        replicas = self._all("health")
        return {"ok": all(r.get("ok", False) for r in replicas), "version": self._version,
                "running": sum(r.get("running", 0) for r in replicas),
                "waiting": sum(r.get("waiting", 0) for r in replicas), "replicas": replicas}

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._all("close")

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
