"""Kernels, each with its torch reference.

- `logprob.fused_logprobs_and_entropy`: chunked, vocab-parallel log p(target) + entropy with a
  recomputing backward; Triton kernels on GPU (`triton_logprob.py`), chunked torch elsewhere
  (`logprob.reference_logprobs_and_entropy` is the plain reference).
- `triton_reshard.py`: the segment-copy kernel behind `megatron_rl/weight_sync/reshard.py`'s plans.
- `bench_logprob.py`: `megatron-rl bench logprob`.
Triton is optional (`pip install triton`, or the `gpu` extra); nothing here imports it unless asked.
"""
