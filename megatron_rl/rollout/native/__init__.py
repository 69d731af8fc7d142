"""The native rollout engine (`NativeEngine`): a pre-norm decoder (the Llama, Mistral, Qwen2 and Qwen3
families of models/families.py) in plain PyTorch with a per-slot KV cache, continuous batching, exact
seeded sampling and in-place weight updates, on CPU or one GPU.

- engine.py: `NativeEngine` (implements rollout.engine.RolloutEngine): public API, driver threads,
  weight updates and memory release.
- scheduler.py: the step scheduler mixed into it (admission, chunked prefill, prefix sharing, decode)
  and the in-flight sample `_Seq`.
- kv_cache.py: `KVCache`, the per-slot KV cache (allocation, written lengths, freeing).
- model.py: `LlamaModel`, the forward pass over the KV cache (on CPU through the fused kernels of
  kernels/cpu_decode.py where they build: `engine.cpu_kernels`).
- weights.py: `weight_arena_layout` and `LlamaWeights`, the flat weight arena and its GEMM packing.
- sampling.py: `sample_tokens`, `filtered_logits`, `inverse_cdf` and per-sample seeds.
- parity.py: `engine_parity`, the engine's column of `megatron-rl parity` (greedy tokens and log-probs
  against transformers' `generate`).
"""
from megatron_rl.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
