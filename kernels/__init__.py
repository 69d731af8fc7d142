"""Kernels with a torch reference for each (installed as `megatron_rl.kernels`).

- `logprob.fused_logprobs_and_entropy`: chunked, vocab-parallel log p(target) + entropy with a
  recomputing backward; Triton kernels on GPU (`triton_logprob.py`), chunked torch elsewhere.
- `reshard`: Megatron TP/PP shards -> engine-TP HF shards from a plan built once (torch copies or a
  Triton segment-copy kernel, `triton_reshard.py`), and flat per-dtype weight buckets.
- `bench.bench_logprob` (`megatron-rl bench logprob`), `gpu_bench` (for a GPU: `python -m
  megatron_rl.kernels.gpu_bench`).
Triton is optional (`pip install triton`, or the `gpu` extra); nothing here imports it unless asked.
"""
from megatron_rl.kernels.logprob import fused_logprobs_and_entropy, reference_logprobs_and_entropy
from megatron_rl.kernels.reshard import (
    Bucket,
    BucketLayout,
    EngineLayout,
    ReshardPlan,
    allocate_buckets,
    build_reshard_plan,
    execute_plan,
    pack_tensors,
    plan_buckets,
    reshard_to_buckets,
    unpack_buckets,
)

__all__ = [
    "fused_logprobs_and_entropy", "reference_logprobs_and_entropy", "Bucket", "BucketLayout", "EngineLayout",
    "ReshardPlan", "allocate_buckets", "build_reshard_plan", "execute_plan", "pack_tensors", "plan_buckets",
    "reshard_to_buckets", "unpack_buckets",
]
