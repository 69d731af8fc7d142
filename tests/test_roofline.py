"""Rooflines: the formulas against counts done by hand for a tiny architecture, and the measured ceilings."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_rl.models.arch import ModelArch
from megatron_rl.observability import roofline

# 1 layer, d=4, ffn 6, 2 query heads of width 2 sharing 1 key/value head, vocab 10, untied.
TINY = ModelArch(vocab_size=10, num_layers=1, hidden_size=4, ffn_hidden_size=6, num_attention_heads=2,
                 num_query_groups=1, max_position_embeddings=16)
# Weights a token multiplies with, counted by hand: q 4x4, k 4x2, v 4x2, o 4x4, gate/up/down 3 x 4x6,
# two norms of 4, the final norm 4, the output head 10x4 (the input embedding is a lookup).
TINY_MATMUL_PARAMS = 16 + 8 + 8 + 16 + 72 + 8 + 4 + 40
# Per (query, key) pair: scores 2 * q_size (4) and weighted sum 2 * q_size, 1 layer.
TINY_ATTENTION_PAIR_FLOPS = 16


def ceilings(matmul: float, memory: float, bf16: float | None = None) -> roofline.Ceilings:
    return roofline.Ceilings(matmul_gflops=matmul, memory_gbs=memory, matmul_gflops_bf16=bf16)


def test_parameter_and_attention_counts():
    assert roofline.matmul_parameters(TINY) == TINY_MATMUL_PARAMS == 172
    # Tied: the one table is counted as the output head, the lookup adds nothing.
    assert roofline.matmul_parameters(dataclasses.replace(TINY, tie_word_embeddings=True)) == 172
    assert roofline.attention_flops_per_pair(TINY) == TINY_ATTENTION_PAIR_FLOPS
    # k and v, 1 layer, 1 group of width 2, fp32.
    assert roofline.kv_cache_bytes_per_token(TINY, 4) == 2 * 1 * 2 * 4


def test_decode_roofline_memory_and_compute_bound():
    batch, context = 3, 5
    step_bytes = 172 * 4 + batch * context * 16          # 928: weights once + the KV caches
    step_flops = batch * (2 * 172 + context * 16)        # 1272
    memory_bound = roofline.decode_roofline(TINY, batch, context, ceilings(matmul=1e6, memory=1.0))
    assert memory_bound == pytest.approx(batch / (step_bytes / 1e9))
    compute_bound = roofline.decode_roofline(TINY, batch, context, ceilings(matmul=1.0, memory=1e6))
    assert compute_bound == pytest.approx(batch / (step_flops / 1e9))
    # bf16 weights: half the weight and cache bytes, and the bf16 matmul ceiling.
    half = roofline.decode_roofline(TINY, batch, context, ceilings(matmul=1e6, memory=1.0),
                                    weight_bytes_per_param=2)
    assert half == pytest.approx(batch / ((172 * 2 + batch * context * 8) / 1e9))
    bf16_compute = roofline.decode_roofline(TINY, batch, context, ceilings(matmul=1.0, memory=1e6, bf16=4.0),
                                            weight_bytes_per_param=2)
    assert bf16_compute == pytest.approx(batch / (step_flops / 4e9))


def test_train_roofline():
    # 2 sequences of 4 tokens: per token 2 * 172 + 16 * (4 + 1) / 2 = 384 forward flops, x3 with backward.
    flops = 3 * 384 * 8
    assert roofline.train_flops(TINY, 8, sequence_length=4) == flops
    assert roofline.train_roofline(TINY, 8, ceilings(matmul=2.0, memory=1.0), sequence_length=4) == \
        pytest.approx(8 / (flops / 2e9))
    # One sequence of all 8 tokens: 16 * 9 / 2 = 72 attention flops per token.
    assert roofline.train_flops(TINY, 8) == 3 * (344 + 72) * 8


def test_fields_and_line():
    c = ceilings(matmul=50.0, memory=20.0)
    fields = roofline.roofline_fields(25.0, 100.0, c)
    assert fields["roofline_tokens_s"] == 100.0 and fields["roofline_fraction"] == 0.25
    assert fields["matmul_gflops"] == 50.0 and fields["memory_gbs"] == 20.0
    line = roofline.roofline_line("trainer", 25.0, 100.0, c)
    assert line.startswith("trainer: 25.0 tokens/s = 25.0% of the roofline 100.0 tokens/s") and "\n" not in line


def test_measured_ceilings_positive_and_threads_restored():
    before = torch.get_num_threads()
    measured = roofline.measure_ceilings(seconds=0.2, threads=1)
    assert torch.get_num_threads() == before
    assert measured.threads == 1
    for value in (measured.matmul_gflops, measured.memory_gbs):
        assert value > 0 and math.isfinite(value)
    assert measured.matmul_gflops_bf16 is None or (measured.matmul_gflops_bf16 > 0
                                                   and math.isfinite(measured.matmul_gflops_bf16))
    # Sanity against the clock: a 2-core CPU neither does 1 PFLOP/s nor reads 10 TB/s.
    assert measured.matmul_gflops < 1e6 and measured.memory_gbs < 1e4
