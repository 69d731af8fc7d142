"""`SGLangEngine`: the RolloutEngine interface over `sglang.Engine` (SGLang's offline engine, GPU).

Written against SGLang 0.5.23 (`sglang/srt/entrypoints/engine.py`, `managers/tokenizer_manager.py`,
`managers/tokenizer_control_mixin.py`, `managers/io_struct.py`). Importing this module never imports
sglang; constructing an engine does, and raises a clear error when it is missing.

How the calls map:
- generate / submit: `Engine.async_generate(input_ids=..., sampling_params=..., return_logprob=True,
  rid=...)` scheduled on the engine's event loop, which a background thread runs (so many requests are
  in flight at once and join SGLang's continuous batch). `meta_info.output_token_logprobs` gives
  (logprob, token_id, text) per token; `meta_info.weight_versions` spans (or `weight_version`) give the
  version of each token. MoE routing records (`routing`): `enable_return_routed_experts` on the engine,
  `return_routed_experts=True` per request, `meta_info.routed_experts` decoded (rollout/client.py).
- Log-probs: SGLang returns log-probs of the temperature-scaled distribution unless the environment
  variable SGLANG_RETURN_ORIGINAL_LOGPROB=1 is set before its scheduler starts; we set it so that every
  engine returns the raw policy's log-probs (see rollout/engine.py).
- update_weights: inside one weight-update session (`begin_weight_update`, then
  `update_weights_from_tensor(UpdateWeightsFromTensorReqInput(serialized_named_tensors=...,
  weight_version=str(version), flush_cache=...))`, then `end_weight_update`: 0.5.23 refuses updates
  outside one), with generation paused in place unless the caller paused it (otherwise the update
  waits on SGLang's writer lock for every running request). The cache is flushed only when the
  caller's pause retracted the running requests (a flush with requests running fails the update).
  Tensors are serialized per TP rank as `Engine._serialize_tensors_per_rank` does (CUDA IPC).
  `update_weights_from_distributed` / `init_weights_update_group` / `begin_weight_update` /
  `end_weight_update` pass through for NCCL broadcasts (weight_sync/distributed.py drives them).
- pause / resume: `pause_generation(PauseGenerationReqInput(mode="retract"))` (running requests go back
  to the queue, their KV freed, so the flush after a paused update succeeds) / `continue_generation`;
  abort: `tokenizer_manager.abort_request(rid=..., abort_all=...)`; flush_cache,
  release/resume_memory_occupation: the Engine's own coroutines.
- Memory: built with `enable_memory_saver=True` (without it release_memory_occupation frees nothing)
  and, colocated, `mem_fraction_static` from the plan (`colocated_memory_fraction`);
  `enable_deterministic_inference` when rollouts must be reproducible (sampling_seed is ignored
  without it).
Its tests run only where sglang imports and CUDA is present (tests/test_rollout_contract.py); the
request types it builds are checked against 0.5.23's in tests/test_sglang_contract.py.
"""
from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import threading
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

from megatron_rl.config import ConfigError
from megatron_rl.rollout.client import completion_from_json
from megatron_rl.rollout.engine import (
    GenerateRequest,
    NamedTensors,
    RequestLike,
    iter_named_tensors,
    submit_each,
    wait_all,
)
from megatron_rl.types import Completion


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def colocated_memory_fraction(plan) -> float:
    """The GPU share of an engine beside the trainer (a `sim.planner.Plan`; SGLang's mem_fraction_static, vLLM's
    gpu_memory_utilization): its own copy of the weights (sharded by TP only; an MoE engine holds every expert)
    plus the planned KV cache, as a share of the GPU, rounded up to 0.01. The engines' defaults (most of the
    GPU) would leave the trainer nothing."""
    hbm = plan.hardware.hbm_bytes
    trainer = plan.trainer_memory
    weights = plan.engine_memory.get("weights", trainer["weights"] * plan.pp)
    experts = plan.engine_memory.get("expert_weights", trainer.get("expert_weights", 0.0) * plan.pp * getattr(plan, "ep", 1))
    engine = weights + experts + plan.engine_memory["kv_cache"]
    # the trainer's resident terms (dense and expert weights, gradients, optimizer; activations are freed)
    resident = sum(v for k, v in trainer.items() if k.endswith(("weights", "gradients", "optimizer")))
    if resident + engine > plan.usable_bytes:
        raise ConfigError(f"field 'cluster': a colocated engine needs {engine / 2**30:.1f} GiB next to the "
                          f"trainer's {resident / 2**30:.1f} GiB, over the {plan.usable_bytes / 2**30:.1f} GiB usable")
    return math.ceil(engine / hbm * 100) / 100


def colocated_engine_kwargs(plan, *, deterministic: bool) -> dict[str, Any]:
    """`sglang.Engine` arguments for a colocated engine of `plan` (see the module docstring)."""
    return {"mem_fraction_static": colocated_memory_fraction(plan), "enable_memory_saver": True,
            "enable_deterministic_inference": deterministic}


class SGLangEngine:
    """RolloutEngine over an in-process `sglang.Engine` (see the module docstring)."""

    def __init__(self, model_path: str, *, version: int = 0, routing: tuple[int, int] | None = None,
                 **engine_kwargs: Any):
        """`routing` (the MoE model's layers, top_k): record every completion's routing
        (`enable_return_routed_experts`, `return_routed_experts`) into `Completion.routed_experts`."""
        os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
        try:
            import sglang  # optional (gpu extra): imported when an SGLang engine is built
        except ImportError as exc:
            raise ConfigError(f"the SGLang backend needs the 'sglang' package (pip install sglang): {exc}") from None
        engine_kwargs.setdefault("enable_memory_saver", True)  # else release_memory_occupation frees nothing
        self.routing = routing
        if routing is not None:
            engine_kwargs["enable_return_routed_experts"] = True
        self._engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        self._tm = self._engine.tokenizer_manager
        self._loop: asyncio.AbstractEventLoop = self._engine.loop
        self._version = int(version)
        self._paused: str | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine-loop", daemon=True)
        self._thread.start()
        self._call(self._tm.update_weight_version(self._io().UpdateWeightVersionReqInput(
            new_version=str(self._version), abort_all_requests=False)))

    # --- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _io() -> Any:
        from sglang.srt.managers import io_struct  # optional SGLang (gpu extra)

        return io_struct

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        n = request.sampling.n
        rids = request.sample_ids()
        out = await self._engine.async_generate(
            input_ids=[list(request.prompt_ids)] * n if n > 1 else list(request.prompt_ids),
            sampling_params=[{**request.sampling.to_sglang(), "n": 1}] * n if n > 1 else request.sampling.to_sglang(),
            return_logprob=True, rid=rids if n > 1 else rids[0],
            **({"return_routed_experts": True} if self.routing is not None else {}))
        outs = out if isinstance(out, list) else [out]
        return [completion_from_json(o, request.prompt_ids, request.group_id, self.routing) for o in outs]

    # --- RolloutEngine --------------------------------------------------------------------------
    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        return submit_each(requests, lambda request: asyncio.run_coroutine_threadsafe(self._generate(request), self._loop))

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Completion]:
        return [f.result() for f in self.submit(requests)]

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        io = self._io()
        named = list(iter_named_tensors(named_tensors))
        payloads = self._engine._serialize_tensors_per_rank(named, None)
        obj = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, flush_cache=self._paused in ("retract", "abort"),
            weight_version=None if version is None else str(version))
        pause_here = self._paused is None
        if pause_here:
            self.pause("in_place")
        try:
            self.begin_weight_update()
            try:
                success, message = self._call(self._tm.update_weights_from_tensor(obj, None))
            finally:
                self.end_weight_update()
        finally:
            if pause_here:
                self.resume()
        if not success:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")
        if version is not None:
            self._version = int(version)
        return len(named)

    @property
    def paused_mode(self) -> str | None:
        return self._paused

    def begin_weight_update(self) -> None:
        success, message = self._call(self._tm.begin_weight_update(self._io().BeginWeightUpdateReqInput(), None))
        if not success:
            raise RuntimeError(f"SGLang begin_weight_update failed: {message}")

    def end_weight_update(self) -> None:
        success, message = self._call(self._tm.end_weight_update(self._io().EndWeightUpdateReqInput(), None))
        if not success:
            raise RuntimeError(f"SGLang end_weight_update failed: {message}")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        obj = self._io().InitWeightsUpdateGroupReqInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)
        success, message = self._call(self._tm.init_weights_update_group(obj, None))
        if not success:
            raise RuntimeError(f"SGLang init_weights_update_group failed: {message}")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int | None = None, group_name: str = "weight_update_group",
                                        flush_cache: bool = False) -> None:
        """The trainer broadcasts each tensor over the group after this call is issued."""
        obj = self._io().UpdateWeightsFromDistributedReqInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
            weight_version=None if version is None else str(version))
        success, message = self._call(self._tm.update_weights_from_distributed(obj, None))
        if not success:
            raise RuntimeError(f"SGLang update_weights_from_distributed failed: {message}")
        if version is not None:
            self._version = int(version)

    def pause(self, mode: str = "retract") -> None:
        self._call(self._tm.pause_generation(self._io().PauseGenerationReqInput(mode=mode)))
        self._paused = mode

    def resume(self) -> None:
        self._call(self._tm.continue_generation(self._io().ContinueGenerationReqInput()))
        self._paused = None

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        if request_ids is None:
            self._loop.call_soon_threadsafe(lambda: self._tm.abort_request(abort_all=True))
            return
        for rid in ([request_ids] if isinstance(request_ids, str) else list(request_ids)):
            self._loop.call_soon_threadsafe(lambda rid=rid: self._tm.abort_request(rid=rid))

    def flush_cache(self) -> bool:
        return bool(self._call(self._tm.flush_cache()).success)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call(self._tm.release_memory_occupation(self._io().ReleaseMemoryOccupationReqInput(tags=tags), None))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call(self._tm.resume_memory_occupation(self._io().ResumeMemoryOccupationReqInput(tags=tags), None))

    def health(self) -> dict[str, Any]:
        return {"ok": self._thread.is_alive(), "version": self._version, "paused": self._paused is not None,
                "engine": "sglang"}

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._engine.shutdown()
