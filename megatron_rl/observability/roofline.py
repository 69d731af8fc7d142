"""Rooflines: how fast a decode step or a training step could run on this machine.

`measure_ceilings` times this process's dense matmul throughput and streaming read bandwidth (about a
second); `decode_roofline` and `train_roofline` turn a `ModelArch` into the tokens/s those ceilings allow, so
a bench can say what fraction of the machine it reaches, not only how it compares with a baseline.

Counting conventions:
- Weights a step multiplies with: every parameter except an untied input embedding (a lookup reads one row
  per token, not the table). A tied embedding is counted once, as the output projection.
- Attention scores and the weighted sum cost 2 * 2 * layers * q_size flops per (query, key) pair; causal
  training attends to (sequence_length + 1) / 2 keys per query on average, decode to all `context` keys.
- Training is 3x the forward flops (forward, input gradients, weight gradients), compute bound.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from megatron_rl.models.arch import ModelArch

_MATMUL_SIZES = (1024, 2048)
_BF16_PROBE_SIZE = 128
_STREAM_BYTES = 256 * 2**20  # well beyond any last-level cache, so reads come from memory


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What this process measured: dense matmul GFLOP/s and streaming read GB/s (10^9 bytes)."""

    matmul_gflops: float
    """fp32 matmul throughput."""
    memory_gbs: float
    """Streaming read bandwidth."""
    matmul_gflops_bf16: float | None = None
    """bf16 matmul throughput (from a small probe only where bf16 is slow); None where torch has no bf16
    matmul here."""
    threads: int = 1
    """torch intra-op threads during the measurement."""

    def matmul_for(self, bytes_per_param: int) -> float:
        """The matmul ceiling for weights stored with `bytes_per_param` bytes (2: bf16 where measured)."""
        if bytes_per_param <= 2 and self.matmul_gflops_bf16:
            return self.matmul_gflops_bf16
        return self.matmul_gflops


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[int]:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def _best_rate(work: float, step, seconds: float) -> float:
    """The best work/s of repeated `step()` calls within `seconds` (at least two calls, one of them warm-up)."""
    step()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        best = max(best, work / max(elapsed, 1e-9))
        if time.perf_counter() >= deadline:
            return best


def _matmul_gflops(dtype: torch.dtype, seconds: float, size: int) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    return _best_rate(2 * size**3 / 1e9, lambda: torch.mm(a, b, out=out), seconds)


def _memory_gbs(seconds: float) -> float:
    data = torch.ones(_STREAM_BYTES // 4, dtype=torch.float32)
    return _best_rate(_STREAM_BYTES / 1e9, data.sum, seconds)


def measure_ceilings(seconds: float = 1.0, threads: int | None = None) -> Ceilings:
    """Measure this process's matmul and memory ceilings in about `seconds` (with `threads` torch threads;
    None: the current setting). Each figure is the best of its repeats and, for matmuls, of two sizes
    (blocked kernels such as AMX's reach their peak only on large products): a ceiling, not a typical speed."""
    with _torch_threads(threads) as used:
        fp32 = max(_matmul_gflops(torch.float32, 0.2 * seconds, size) for size in _MATMUL_SIZES)
        try:
            # Small probes first: without native bf16 kernels one full-size product takes seconds.
            probe = _matmul_gflops(torch.bfloat16, 0.05 * seconds, size=_BF16_PROBE_SIZE)
            native = probe >= 0.5 * _matmul_gflops(torch.float32, 0.05 * seconds, size=_BF16_PROBE_SIZE)
            bf16 = max(_matmul_gflops(torch.bfloat16, 0.2 * seconds, size) for size in _MATMUL_SIZES) \
                if native else probe
        except RuntimeError:  # no bf16 matmul kernel at all
            bf16 = None
        memory = _memory_gbs(0.4 * seconds)
    return Ceilings(matmul_gflops=fp32, memory_gbs=memory, matmul_gflops_bf16=bf16, threads=used)


def matmul_parameters(arch: ModelArch) -> int:
    """Parameters a token multiplies with: all but an untied input embedding (a lookup, not a matmul)."""
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return arch.num_parameters() - embedding


def attention_flops_per_pair(arch: ModelArch) -> int:
    """Forward flops of one (query, key) pair over all layers: q.k scores and the weighted sum of values (under
    multi-latent attention, as the engine computes it: in the latent, kv_lora_rank + rotary dims per head)."""
    if arch.is_mla:
        return 2 * arch.num_layers * arch.num_attention_heads * (2 * arch.kv_lora_rank + arch.qk_rope_head_dim)
    return 2 * 2 * arch.num_layers * arch.q_size


def kv_cache_bytes_per_token(arch: ModelArch, bytes_per_value: int) -> int:
    """Key and value cache bytes of one token over all layers (`ModelArch.kv_cache_width` per layer)."""
    return arch.num_layers * arch.kv_cache_width * bytes_per_value


def decode_roofline(arch: ModelArch, batch: int, context: int, ceilings: Ceilings,
                    weight_bytes_per_param: int = 4) -> float:
    """Tokens/s of decoding `batch` sequences at `context` tokens each: per step the weights are read once
    and every sequence's KV cache is read (stored like the weights); the step takes the longer of its
    memory time and its matmul time."""
    params = matmul_parameters(arch)
    step_bytes = params * weight_bytes_per_param + batch * context * kv_cache_bytes_per_token(
        arch, weight_bytes_per_param)
    step_flops = batch * (2 * params + context * attention_flops_per_pair(arch))
    step_seconds = max(step_bytes / (ceilings.memory_gbs * 1e9),
                       step_flops / (ceilings.matmul_for(weight_bytes_per_param) * 1e9))
    return batch / step_seconds


def train_flops(arch: ModelArch, tokens: int, sequence_length: int | None = None) -> float:
    """Flops of one forward + backward pass over `tokens` tokens in sequences of `sequence_length`
    (None: one sequence of all the tokens), causal attention included."""
    seq = tokens if sequence_length is None else sequence_length
    forward_per_token = 2 * matmul_parameters(arch) + attention_flops_per_pair(arch) * (seq + 1) / 2
    return 3 * forward_per_token * tokens


def train_roofline(arch: ModelArch, tokens: int, ceilings: Ceilings, *, sequence_length: int | None = None,
                   bytes_per_param: int = 4) -> float:
    """Tokens/s of training steps of `tokens` tokens (6 * params * tokens flops plus attention) at the
    matmul ceiling for weights of `bytes_per_param` bytes."""
    seconds = train_flops(arch, tokens, sequence_length) / (ceilings.matmul_for(bytes_per_param) * 1e9)
    return tokens / seconds


def roofline_fields(achieved_tokens_s: float, roofline_tokens_s: float, ceilings: Ceilings) -> dict:
    """The roofline keys of a bench's JSON line."""
    return {"roofline_tokens_s": round(roofline_tokens_s, 1),
            "roofline_fraction": round(achieved_tokens_s / roofline_tokens_s, 4),
            "matmul_gflops": round(ceilings.matmul_gflops, 1),
            "matmul_gflops_bf16": None if ceilings.matmul_gflops_bf16 is None
            else round(ceilings.matmul_gflops_bf16, 1),
            "memory_gbs": round(ceilings.memory_gbs, 2)}


def roofline_line(name: str, achieved_tokens_s: float, roofline_tokens_s: float, ceilings: Ceilings) -> str:
    """One human line: what was reached, against what roofline, from which ceilings."""
    bf16 = "" if ceilings.matmul_gflops_bf16 is None else f", bf16 {ceilings.matmul_gflops_bf16:.1f}"
    return (f"{name}: {achieved_tokens_s:.1f} tokens/s = {100 * achieved_tokens_s / roofline_tokens_s:.1f}% of "
            f"the roofline {roofline_tokens_s:.1f} tokens/s (matmul {ceilings.matmul_gflops:.1f}{bf16} GFLOP/s, "
            f"memory {ceilings.memory_gbs:.2f} GB/s, {ceilings.threads} threads)")
