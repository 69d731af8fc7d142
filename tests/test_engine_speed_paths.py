"""Exactness of the native engine's fast decode paths (issue #26): the fused raw-policy sampler (one exp pass
shared by sampling and the log-prob) against float64 references, and sampled decoding through the fused
SDPA attention over the KV cache against transformers' full forward."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.parity import default_prompts
from megatron_rl.rollout.native.sampling import inverse_cdf, sample_tokens
from megatron_rl.rollout.native.weights import PackedMatrix
from tests.test_engine_families import FAMILY_OF, _hf_config, arch_of, random_model


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(rows, vocab, generator=g) + 10.0
    logits[:, :8] += 12.0 * torch.rand(rows, 8, generator=g)  # peaked rows: a few tokens hold most mass
    return logits


def test_plain_sampling_draws_the_exact_cdf_token_with_float64_logprobs():
    logits = _logits(24, 3000, seed=0)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(24)]
    tokens, logprobs = sample_tokens(logits, params, [torch.Generator().manual_seed(i) for i in range(24)])
    uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                          for i in range(24)])
    exact = torch.softmax(logits.double(), -1)
    cdf = exact.cumsum(-1)
    reference = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    assert tokens.tolist() == reference.tolist()
    assert tokens.tolist() == inverse_cdf(exact, uniforms).tolist()
    ref_lp = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    assert logprobs.dtype == torch.float32
    assert (logprobs.double() - ref_lp).abs().max().item() < 1e-6


def test_plain_rows_sample_the_same_beside_greedy_and_truncated_rows():
    logits = _logits(6, 2000, seed=1)
    plain = SamplingParams(temperature=1.0)
    alone_tokens, alone_lp = sample_tokens(logits, [plain] * 6, [torch.Generator().manual_seed(i) for i in range(6)])
    mixed = [plain, SamplingParams(temperature=0.0), plain, SamplingParams(top_k=5), plain, plain]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    tokens, lp = sample_tokens(logits, mixed, gens)
    ref_lp = torch.log_softmax(logits.double(), -1)
    for i, p in enumerate(mixed):
        if p is plain:
            assert tokens[i] == alone_tokens[i] and abs(lp[i].item() - alone_lp[i].item()) < 1e-5
        assert abs(lp[i].item() - ref_lp[i, tokens[i]].item()) < 1e-5
    assert tokens[1] == logits[1].argmax()
    assert tokens[3] in logits[3].topk(5).indices


@pytest.mark.parametrize("cpu_kernels", ["auto", "disabled"])
@pytest.mark.parametrize("kind", ["smollm2", "qwen3"])
def test_sampled_decode_logprobs_match_transformers_forward(kind, cpu_kernels):
    """Sequences of different lengths decode together (the fused CPU kernels, or torch's SDPA with the additive
    mask of the batched attention), with answers of different lengths (decode batches of 4, 3, 2 rows: packed and
    transposed GEMMs)."""
    config = _hf_config(kind)
    model, state = random_model(config, seed=3)
    arch = arch_of(config, FAMILY_OF[kind])
    prompts = default_prompts(arch, lengths=(2, 9, 17, 30), seed=4)
    with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=4, max_seq_len=64, cpu_kernels=cpu_kernels),
                      eos_token_ids=[]) as engine:
        outs = engine.generate([GenerateRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=i))
                                for i, (p, n) in enumerate(zip(prompts, (20, 14, 8, 5)))])
    model = model.double()
    for p, out in zip(prompts, outs):
        assert len(out.output_ids) == len(out.output_logprobs) > 0
        with torch.inference_mode():
            logits = model(torch.tensor([p + out.output_ids])).logits[0]
        ref = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(out.output_logprobs, dtype=torch.float64)).abs().max().item() < 1e-5, kind


@pytest.mark.parametrize("dtype,mkl", [("bf16", True), ("fp32", False)])
def test_onednn_packed_gemms_decode_as_the_unpacked_path(dtype, mkl, monkeypatch):
    """Weights packed for oneDNN (bf16, the fast path on CPUs with bf16 matrix units; fp32 on torch builds
    without MKL, e.g. ARM) against the same engine computing with plain F.linear on the arena: the same
    greedy tokens and log-probs; the packed copies serve the 4-row decode steps, the shrinking tail and
    the prefill alike."""
    from megatron_rl.rollout.native.weights import PackedMatrix

    has_mkl = torch.backends.mkl.is_available()
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl and has_mkl)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    try:  # oneDNN's bf16 GEMMs need bf16-capable vector units (AVX-512 BF16 / AMX); AVX2-only CPUs have none
        PackedMatrix(torch.zeros(8, 8, dtype=torch_dtype), 4)(torch.zeros(4, 8, dtype=torch_dtype))
    except (AttributeError, RuntimeError) as exc:
        pytest.skip(f"no oneDNN {dtype} GEMMs on this CPU: {str(exc).splitlines()[0]}")
    config = _hf_config("qwen2")
    model, state = random_model(config, seed=5)
    arch = arch_of(config, FAMILY_OF["qwen2"])
    prompts = default_prompts(arch, lengths=(3, 8, 13, 21), seed=6)
    requests = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, (12, 9, 5, 2)))]
    outputs = {}
    for prepack in (True, False):
        # (fp32 with AVX-512 takes the fused kernels' own packed GEMM: tests/test_cpu_decode_kernels.py)
        config_ = NativeEngineConfig(max_batch_size=4, max_seq_len=64, dtype=dtype, prepack_weights=prepack,
                                     cpu_kernels="disabled")
        with NativeEngine(arch, state, config=config_, eos_token_ids=[]) as engine:
            assert (engine.weights.packed is not None) == (prepack and torch.backends.mkldnn.is_available())
            if prepack and engine.weights.packed is not None:
                assert all(m.onednn is not None for m in engine.weights.packed[0])
            outputs[prepack] = engine.generate(requests)
    for packed, plain in zip(outputs[True], outputs[False]):
        assert packed.output_ids == plain.output_ids
        assert torch.allclose(torch.tensor(packed.output_logprobs), torch.tensor(plain.output_logprobs), atol=1e-6)


def test_gemm_floor_times_every_product_of_a_decode_step(monkeypatch):
    """`bench rollout`'s GEMM floor multiplies `rows` rows by every layer's qkv, o, gate_up and down
    matrices and by the lm_head, through the engine's own packed weights, in layer order."""
    from megatron_rl.rollout import bench_generate

    config = _hf_config("smollm2")
    _, state = random_model(config, seed=7)
    arch = arch_of(config, FAMILY_OF["smollm2"])
    shapes = []
    real = PackedMatrix.__call__
    with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=4, max_seq_len=64), eos_token_ids=[]) as engine:
        if engine.weights.packed is None:
            pytest.skip("torch without MKL or oneDNN")
        monkeypatch.setattr(PackedMatrix, "__call__", lambda self, x, bias=None: shapes.append(
            (tuple(x.shape), tuple(self.shape))) or real(self, x, bias))
        seconds = bench_generate.decode_gemm_seconds(engine.weights, rows=3, repeats=1)
    h, q, kv, f = arch.hidden_size, arch.q_size, arch.kv_size, arch.ffn_hidden_size
    step = [((3, h), (q + 2 * kv, h)), ((3, q), (h, q)), ((3, h), (2 * f, h)), ((3, f), (h, f))] * arch.num_layers
    step.append(((3, h), (arch.vocab_size, h)))
    assert shapes == step * 2 and seconds > 0  # a warm-up pass and one timed pass
