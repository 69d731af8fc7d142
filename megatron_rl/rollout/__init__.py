"""Rollout engines behind one interface (`RolloutEngine`): the native PyTorch engine, the SGLang
adapter, and the HTTP client of `megatron-rl serve` / SGLang servers."""
from megatron_rl.rollout.engine import GenerateRequest, RequestError, RolloutEngine, SamplingParams
from megatron_rl.rollout.native import NativeEngine, NativeEngineConfig

__all__ = ["GenerateRequest", "NativeEngine", "NativeEngineConfig", "RequestError", "RolloutEngine",
           "SamplingParams"]
