"""Rollout engines behind one interface (`RolloutEngine`): the native PyTorch engine, the SGLang
adapter (rollout/sglang_engine.py, imports sglang only when constructed), and the HTTP client of
`megatron-rl serve` / SGLang servers."""
from megatron_rl.rollout.client import HTTPEngine
from megatron_rl.rollout.engine import GenerateRequest, RequestError, RolloutEngine, SamplingParams
from megatron_rl.rollout.native import NativeEngine, NativeEngineConfig

__all__ = ["GenerateRequest", "HTTPEngine", "NativeEngine", "NativeEngineConfig", "RequestError", "RolloutEngine",
           "SamplingParams"]
