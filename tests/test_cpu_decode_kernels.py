"""The native engine's fused CPU kernels (megatron_rl/kernels/cpu_decode.c) against the torch expressions they
stand for, in fp32 and bf16, and the engine with them against the engine without them.

Tolerances come from the arithmetic. Where the kernel performs the same roundings as the torch expression in the
same order (RoPE, the cache writes) the results are bit-identical. Where it sums in another order (RMSNorm's sum
of squares, attention's dot products and softmax), or computes exp / tanh with another polynomial (about 2 ulp
against torch's Sleef), the fp32 results differ by a few ulp of the operands, and a bf16 result that lands near a
rounding boundary may round the other way: one bf16 ulp (2^-8 relative)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.kernels import cpu_decode
from megatron_rl.models.attention import softmax_with_sinks
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.model import _offset_rms_norm, _rms_norm
from megatron_rl.rollout.native.parity import default_prompts
from megatron_rl.rollout.native.sampling import _inverse_cdf
from tests.test_engine_families import FAMILY_OF, _hf_config, arch_of, random_model

DTYPES = [torch.float32, torch.bfloat16]
FP32_ULP = 2.0 ** -23
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values in [1, 2)


@pytest.fixture(scope="module")
def kernels():
    built = cpu_decode.load()
    if built is None:
        pytest.skip(f"the fused CPU kernels cannot be built here: {cpu_decode.load_error()}")
    return built


def _ulps_apart(got: torch.Tensor, want: torch.Tensor, ulp: float) -> float:
    """Largest |got - want| in units of want's own ulp (its magnitude's power of two times `ulp`)."""
    got, want = got.double(), want.double()
    scale = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))))
    return ((got - want).abs() / (scale * ulp)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [None, 1.0])
def test_rms_norm_with_residual_add_matches_the_torch_expression(kernels, dtype, offset):
    g = torch.Generator().manual_seed(0)
    dim = 576
    x = torch.randn(32, dim, generator=g).to(dtype)
    delta = torch.randn(32, dim, generator=g).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    fused_x = x.clone()
    got = kernels.rms_norm(fused_x, weight, 1e-6, delta=delta, offset=offset)
    summed = x + delta
    assert torch.equal(fused_x, summed)  # the residual add, in place, rounded as torch's
    want = _rms_norm(summed, weight, 1e-6) if offset is None else _offset_rms_norm(summed, weight, 1e-6, offset)
    if dtype == torch.float32:
        # the sum of `dim` positive squares in another order: at most (dim - 1) ulp relative apart, half of it
        # through the rsqrt, plus the rounding of the two products
        assert _ulps_apart(got, want, FP32_ULP) <= 0.5 * (dim - 1) + 2
    else:
        assert _ulps_apart(got, want, BF16_ULP) <= 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_torch(kernels, dtype, activation):
    g = torch.Generator().manual_seed(1)
    gate_up = (3.0 * torch.randn(16, 2 * 1000, generator=g)).to(dtype)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    want = act * up
    got = kernels.gated_act(gate_up, activation)
    # exp / tanh within a few fp32 ulp of torch's (Sleef); GELU's 1 + tanh(z) turns tanh's absolute error near -1
    # (up to 2 ulp of 1) into an absolute error of |gate| / 2 * 2^-22 before the product with up
    cancellation = (gate.float().abs() * up.float().abs() * 2.0 ** -22) if activation == "gelu_tanh" else 0.0
    # fp32: a few roundings apart; bf16: the activation and the product each rounded, either may round the other
    # way (one bf16 ulp, at most 2^-7 relative, each)
    relative = 32 * FP32_ULP if dtype == torch.float32 else 2 * 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= relative * want.float().abs() + cancellation + 1e-30).all()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_and_cache_writes_are_bit_identical_to_transformers(kernels, dtype, rot):
    """transformers' q * cos + rotate_half(q) * sin over the first `rot` dims (partial rotary beyond), k the
    same into its cache rows, v copied; rows scattered over slots and positions as a mixed step's."""
    g = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d, slots, t_alloc = 12, 6, 2, 64, 5, 40
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    cells = torch.randperm(slots * t_alloc, generator=g)[:n]  # distinct (slot, position) pairs
    row_slots, positions = cells // t_alloc, cells % t_alloc
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    cache_rows = (row_slots[:, None] * kv_heads + torch.arange(kv_heads)) * t_alloc + positions[:, None]
    k_cache = torch.zeros(slots, kv_heads, t_alloc, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = kernels.rope_qkv(qkv, heads, kv_heads, d, cos, sin, k_cache, v_cache, cache_rows.contiguous())
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
    rotated = qk[..., :rot] * cos[:, None] + _rotate_half(qk[..., :rot]) * sin[:, None]
    want = torch.cat([rotated, qk[..., rot:]], dim=-1)
    assert torch.equal(q, want[:, :heads])
    assert torch.equal(k_cache.view(-1, d)[cache_rows.view(-1)].view(n, kv_heads, d), want[:, heads:])
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    assert torch.equal(v_cache.view(-1, d)[cache_rows.view(-1)].view(n, kv_heads, d), v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_qk_norm_matches_norm_then_rope(kernels, dtype):
    """Qwen3: each head's q and k RMSNorm-ed (own weights), then rotated."""
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, d = 7, 4, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q_norm, k_norm = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    emb = torch.randn(n, d // 2, generator=g).repeat(1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    cache_rows = torch.arange(n * kv_heads).view(n, kv_heads).contiguous()
    k_cache = torch.zeros(n * kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = kernels.rope_qkv(qkv, heads, kv_heads, d, cos, sin, k_cache, v_cache, cache_rows, q_norm=q_norm,
                         k_norm=k_norm, eps=1e-6)
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
    normed = torch.cat([_rms_norm(qk[:, :heads], q_norm, 1e-6), _rms_norm(qk[:, heads:], k_norm, 1e-6)], dim=1)
    want = normed * cos[:, None] + _rotate_half(normed) * sin[:, None]
    # the norm's sum in another order moves each normed value by up to (d - 1) / 2 ulp (bf16: one rounding the other
    # way); RoPE's sum of two products may cancel, so the bound is in ulps of the head's largest normed value
    ulps, ulp = (0.5 * d + 8, FP32_ULP) if dtype == torch.float32 else (3.0, BF16_ULP)
    bound = ulps * ulp * normed.float().abs().amax(-1, keepdim=True)
    assert ((q.float() - want[:, :heads].float()).abs() <= bound[:, :heads]).all()
    assert ((k_cache.view(n, kv_heads, d).float() - want[:, heads:].float()).abs() <= bound[:, heads:]).all()


def _attention_reference(q, k_cache, v_cache, slots, lens, kv_heads, scale, window=None, softcap=None, sinks=None,
                         dv=None):
    """float64 attention of each decode row over its slot's cached keys, one row at a time."""
    n_dec, heads, dk = q.shape
    group = heads // kv_heads
    dv = dv or dk
    out = torch.zeros(n_dec, heads, dv, dtype=torch.float64)
    for b in range(n_dec):
        length = int(lens[b])
        lo = max(0, length - window) if window else 0
        for h in range(heads):
            g = h // group
            keys = k_cache[slots[b], g, lo:length, :dk].double()
            values = v_cache[slots[b], g, lo:length, :dv].double()
            s = keys @ q[b, h].double() * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                p = softmax_with_sinks(s[None], sinks[h].double().view(1, 1))[0]
            else:
                p = torch.softmax(s, dim=-1)
            out[b, h] = p @ values
    return out.reshape(n_dec, heads * dv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["gqa", "window", "softcap", "sinks", "mqa_wide_group", "odd_head_dim", "latent"])
def test_decode_attention_matches_a_float64_reference(kernels, dtype, variant):
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dk, dv = 8, 2, 64, 64
    window = softcap = sinks = None
    if variant == "mqa_wide_group":
        heads, kv_heads = 20, 1
    if variant == "odd_head_dim":
        dk = dv = 40
    if variant == "latent":  # multi-latent attention: one cache row holds the latent (the values) + rotary key
        heads, kv_heads, dk, dv = 4, 1, 48, 32
    n_dec, slots, t_alloc = 6, 9, 80
    q = torch.randn(n_dec, heads, dk, generator=g).to(dtype)
    k_cache = torch.randn(slots, kv_heads, t_alloc, dk, generator=g).to(dtype)
    v_cache = k_cache if variant == "latent" else torch.randn(slots, kv_heads, t_alloc, dv, generator=g).to(dtype)
    dec_slots = torch.randperm(slots, generator=g)[:n_dec].contiguous()
    lens = torch.tensor([1, 17, 33, 50, 64, 80])  # one key up to the whole allocation; spans not multiples of 16
    if variant == "window":
        window = 20
    if variant == "softcap":
        q = q * 4
        softcap = 5.0
    if variant == "sinks":
        sinks = torch.randn(heads, generator=g)
    scale = 1 / math.sqrt(dk)
    got = kernels.decode_attention(q, k_cache, v_cache, dec_slots, lens, kv_heads=kv_heads, t_alloc=t_alloc, k_row=dk,
                                   v_row=dk if variant == "latent" else dv, dv=dv, scale=scale, window=window,
                                   softcap=softcap, sinks=sinks)
    want = _attention_reference(q, k_cache, v_cache, dec_slots, lens, kv_heads, scale, window, softcap, sinks, dv)
    assert got.shape == (n_dec, heads * dv)
    if dtype == torch.float32:
        # fp32 dot products of dk terms (|q|, |k| ~ sqrt(dk)) and sums of at most 80 weights, against float64:
        # errors of order dk * ulp in the scores, well under 1e-5 in the outputs (|v| ~ 1)
        assert (got.double() - want).abs().max().item() < 1e-5
    else:  # each output rounded to bf16 (|out| < 4: at most 2^-7 absolute) after fp32 arithmetic
        assert (got.double() - want).abs().max().item() <= 2.0 ** -6


def test_plain_sampling_kernel_draws_the_torch_samplers_tokens(kernels):
    g = torch.Generator().manual_seed(5)
    rows, vocab = 24, 3001  # a vocabulary that is no multiple of the 256-token blocks
    logits = 3.0 * torch.randn(rows, vocab, generator=g)
    logits[:, :8] += 12.0 * torch.rand(rows, 8, generator=g)
    uniforms = torch.rand(rows, dtype=torch.float64, generator=g)
    tokens, logprobs = kernels.sample_plain(logits, uniforms)
    shift = logits.amax(dim=-1, keepdim=True)
    want_tokens, total = _inverse_cdf((logits - shift).exp(), uniforms)
    assert tokens.tolist() == want_tokens.tolist()
    exact = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    assert (logprobs.double() - exact).abs().max().item() < 1e-6


def test_plain_sampling_kernel_reads_bf16_logits_as_their_fp32_values(kernels):
    """The engine hands bf16 logits to the sampler unwidened: the draw and the log-probs are those of the
    exact fp32 values, bit for bit."""
    g = torch.Generator().manual_seed(6)
    logits = (4.0 * torch.randn(9, 1000, generator=g)).to(torch.bfloat16)
    uniforms = torch.rand(9, dtype=torch.float64, generator=g)
    tokens, logprobs = kernels.sample_plain(logits, uniforms)
    want_tokens, want_logprobs = kernels.sample_plain(logits.float(), uniforms)
    assert tokens.tolist() == want_tokens.tolist()
    assert torch.equal(logprobs, want_logprobs)


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 45])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [97, 2500])
def test_panel_gemm_matches_a_float64_product(kernels, rows, bias, k):
    """x @ w^T (+ b) in fp32 through the packed panels against float64, within the forward error bound of an fp32
    sum of k products in any order, with or without fused multiply-adds: (k + 2) * 2^-24 * (sum |x_i w_i| + |b|)
    (the +2: the bias add and the result's rounding). Row and column counts are no multiple of the blocks; k = 2500
    is taken in several chunks, the sums carried between them in the output."""
    g = torch.Generator().manual_seed(rows)
    width = kernels.panel_width
    n = 2 * width + 5
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    panels = kernels.pack_panels(w)
    assert panels.shape == (3, k, width)
    assert torch.equal(panels[1], w[width:2 * width].t()) and torch.equal(panels[2, :, :5], w[2 * width:].t())
    assert not panels[2, :, 5:].any()  # zero past the last output row
    _assert_within_the_fp32_product_bound(kernels.linear_panels(x, panels, n, b), x, w, b)


def _assert_within_the_fp32_product_bound(got, x, w, b):
    want = x.double() @ w.double().t()
    products = x.double().abs() @ w.double().abs().t()
    if b is not None:
        want, products = want + b.double(), products + b.double().abs()
    assert ((got.double() - want).abs() <= (x.shape[1] + 2) * 2.0 ** -24 * products).all()


def test_packed_matrix_takes_the_panels_for_decode_steps_and_f_linear_for_long_chunks(kernels, monkeypatch):
    from megatron_rl.rollout.native import weights

    monkeypatch.setattr(kernels, "fp32_gemm_panels", True)  # (an AVX2 build keeps MKL for the engine's GEMMs)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(70, 40, generator=g), torch.randn(70, generator=g)
    packed = weights.PackedMatrix(w, 32, kernels=kernels)
    assert packed.panels is not None and packed.mkl is None and packed.transposed is None  # one copy of w
    calls = []
    real = kernels.linear_panels
    monkeypatch.setattr(kernels, "linear_panels", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 32, weights.PANEL_MAX_ROWS, weights.PANEL_MAX_ROWS + 1):
        x = torch.randn(rows, 40, generator=g)
        _assert_within_the_fp32_product_bound(packed(x, b), x, w, b)
    assert calls == [1, 32, weights.PANEL_MAX_ROWS]


def _generate(kind: str, cpu_kernels: str):
    config = _hf_config(kind)
    _, state = random_model(config, seed=7)
    arch = arch_of(config, FAMILY_OF[kind])
    prompts = default_prompts(arch, lengths=(3, 11, 26, 40), seed=8)
    # a small prefill budget: prompt chunks share steps with decoding rows (the kernels' mixed-step cache writes)
    engine_config = NativeEngineConfig(max_batch_size=4, max_seq_len=96, max_prefill_tokens=16, cpu_kernels=cpu_kernels)
    with NativeEngine(arch, state, config=engine_config, eos_token_ids=[]) as engine:
        return engine.generate([GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n))
                                for i, (p, n) in enumerate(zip(prompts, (24, 16, 9, 30)))])


@pytest.mark.parametrize("kind", ["smollm2", "qwen3"])
def test_engine_with_the_kernels_decodes_as_without(kernels, kind):
    """Greedy tokens equal and log-probs within 1e-5 in fp32 (the kernels' reorderings, as between packed and
    unpacked GEMMs), with prompt chunks and decoding rows in the same steps."""
    with_kernels, without = _generate(kind, "required"), _generate(kind, "disabled")
    for a, b in zip(with_kernels, without):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


def test_required_cpu_kernels_without_a_compiler_are_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_decode, "_loaded", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("MEGATRON_RL_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="cpu_kernels=required.*no-such-compiler-here"):
        _generate("smollm2", "required")
    # auto: the torch ops (the reason kept for the log), with the same greedy tokens as ever
    fallback = [c.output_ids for c in _generate("smollm2", "auto")]
    assert "no-such-compiler-here" in cpu_decode.load_error()
    assert fallback == [c.output_ids for c in _generate("smollm2", "disabled")]


@pytest.mark.parametrize("prepack", [False, True])
def test_weight_update_reaches_the_kernels_as_a_fresh_engine_would(kernels, prepack):
    """The kernels read the weight arena in place (nothing compiled holds a copy; the fp32 GEMM panels are
    re-packed from it): after `update_weights` the engine decodes bit for bit as a fresh engine built with the
    new weights."""
    config = _hf_config("qwen3")
    _, old = random_model(config, seed=11)
    _, new = random_model(config, seed=12)
    arch = arch_of(config, FAMILY_OF["qwen3"])
    prompts = default_prompts(arch, lengths=(5, 19), seed=13)
    engine_config = NativeEngineConfig(max_batch_size=2, max_seq_len=64, cpu_kernels="required",
                                       prepack_weights=prepack)

    def requests():
        return [GenerateRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i))
                for i, p in enumerate(prompts)]

    with NativeEngine(arch, old, config=engine_config, eos_token_ids=[]) as engine:
        before = engine.generate(requests())
        engine.update_weights(new)
        updated = engine.generate(requests())
    with NativeEngine(arch, new, config=engine_config, eos_token_ids=[]) as fresh_engine:
        fresh = fresh_engine.generate(requests())
    assert [c.output_ids for c in updated] == [c.output_ids for c in fresh]
    assert [c.output_logprobs for c in updated] == [c.output_logprobs for c in fresh]
    assert [c.output_logprobs for c in updated] != [c.output_logprobs for c in before]
