"""Fused RMSNorm, RoPE, SwiGLU and Adam (trainer/local_fusions.py) against the plain torch ops they
replace: the same outputs and gradients (autograd through the unfused ops as the reference)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.trainer import local_fusions


def _grads(fn, *inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


def _close(dtype):
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rms_norm_matches_hf_llama_order(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen, dtype=dtype) * 3
    weight = torch.randn(16, generator=gen, dtype=dtype)
    grad_out = torch.randn(5, 3, 16, generator=gen, dtype=dtype)

    def reference(x, w):  # transformers' LlamaRMSNorm
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    fused = lambda x, w: local_fusions._RMSNormFunction.apply(x, w, 1e-5)
    (ref_out, ref_grads), (out, grads) = (_grads(f, x, weight, grad_out=grad_out) for f in (reference, fused))
    torch.testing.assert_close(out, ref_out, **_close(dtype))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **_close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (Gemma's norm computes in fp32 always)
def test_zero_centred_rms_norm_matches_gemma3(dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 16, generator=gen, dtype=torch.float64) * 3).to(dtype)
    weight = (0.3 * torch.randn(16, generator=gen, dtype=torch.float64)).to(dtype)
    grad_out = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
    hf = Gemma3RMSNorm(16, eps=1e-6).to(dtype)
    assert transformers.__version__  # the reference is transformers' own module

    def reference(x, w):
        return torch.func.functional_call(hf, {"weight": w}, (x,))

    fused = lambda x, w: local_fusions._RMSNormFunction.apply(x, w, 1e-6, 1.0)
    (ref_out, ref_grads), (out, grads) = (_grads(f, x, weight, grad_out=grad_out) for f in (reference, fused))
    # bf16: both compute in fp32 and round once on the way out, gradients too: at most one bf16 ulp apart
    # (2^-7 relative), plus fp32 summation-order differences where cancellation leaves values near zero
    close = {"rtol": 2 ** -7, "atol": 1e-4} if dtype == torch.bfloat16 else _close(dtype)
    torch.testing.assert_close(out, ref_out, **close)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **close)


def test_fuse_model_swaps_torch_norms_keeping_their_parameters():
    model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    weight = model[0].weight
    weight.sequence_parallel = True  # a tag Megatron's gradient reduction reads
    x = torch.randn(3, 8)
    expected = model(x)
    assert local_fusions.fuse_model(model) == 1
    assert isinstance(model[0], local_fusions.FusedRMSNorm) and model[0].weight is weight and model[0].eps == 1e-6
    assert isinstance(model[2], torch.nn.LayerNorm)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rotary_matches_megatron_unfused(dtype):
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
    )

    gen = torch.Generator().manual_seed(1)
    seq, batch, heads, dim = 7, 2, 3, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=dtype), inv_freq)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    # A strided query, as Megatron's q/k/v split makes it.
    t = torch.randn(seq, batch, heads, 2 * dim, generator=gen, dtype=dtype)[..., :dim]
    grad_out = torch.randn(seq, batch, heads, dim, generator=gen, dtype=dtype)
    for mscale in (1.0, 1.3):
        ref_out, (ref_grad,) = _grads(lambda t, m=mscale: _apply_rotary_pos_emb_bshd(t, freqs, mscale=m), t,
                                      grad_out=grad_out)
        out, (grad,) = _grads(lambda t, m=mscale: local_fusions.fused_rotary(t, freqs, m), t, grad_out=grad_out)
        torch.testing.assert_close(out, ref_out, **_close(dtype))
        torch.testing.assert_close(grad, ref_grad, **_close(dtype))


def test_rotary_cos_sin_cache_follows_the_frequencies():
    freqs = torch.rand(4, 1, 1, 6)
    t = torch.randn(4, 1, 2, 6)
    first = local_fusions.fused_rotary(t, freqs)
    freqs.mul_(2.0)  # in-place change: the cache must notice
    changed = local_fusions.fused_rotary(t, freqs)
    expected = local_fusions.fused_rotary(t, freqs.clone())
    torch.testing.assert_close(changed, expected)
    assert not torch.allclose(first, changed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swiglu_matches_silu_times_up(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 20, generator=gen, dtype=dtype) * 2
    grad_out = torch.randn(6, 2, 10, generator=gen, dtype=dtype)

    def reference(x):
        gate, up = torch.chunk(x, 2, -1)
        return F.silu(gate) * up

    (ref_out, (ref_grad,)), (out, (grad,)) = (_grads(f, x, grad_out=grad_out)
                                              for f in (reference, local_fusions._SwiGLUFunction.apply))
    torch.testing.assert_close(out, ref_out, **_close(dtype))
    torch.testing.assert_close(grad, ref_grad, **_close(dtype))


class _Wrapper:  # the shape of Megatron's FP32Optimizer: the torch optimizer under `.optimizer`
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_fused_adam_matches_torch_adamw_and_survives_a_state_load():
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(33, 7, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    twins = copy.deepcopy(params)
    fused = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=False)
    assert local_fusions.fuse_adam(_Wrapper(fused)) == 1
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    fused.load_state_dict(plain.state_dict())  # a checkpoint saved unfused keeps the fused kernel
    assert all(group["fused"] for group in fused.param_groups)
    assert local_fusions.fuse_adam(_Wrapper(torch.optim.SGD(params, lr=0.1))) == 0
