"""Fused log-prob + entropy: forward and backward against a float64 full-logits reference.

Error metric: relative error of the whole tensor, ||got - want|| / ||want||. Tolerances: 1e-5 for the
fp32 torch path; 2e-5 for the Triton kernels (run through Triton's interpreter on CPU tensors at tiny
shapes, in a spawned process with TRITON_INTERPRET=1); bf16 inputs: log-probs 1e-5 (fp32 statistics of exactly upcast inputs), gradients 1e-2 (returned
in bf16)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.kernels import logprob as L
from megatron_rl.kernels.logprob import (
    fused_logprobs_and_entropy,
    reference_logprobs_and_entropy,
)
from megatron_rl.placement.launch import run_distributed

needs_triton = pytest.mark.skipif(not L.triton_available(), reason="triton not importable")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(n, h, v, seed=0, dtype=torch.float32, vocab_size=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.7).to(dtype)
    targets = torch.randint(0, vocab_size or v, (n,), generator=g)
    g1, g2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, targets, g1, g2


def _reference(hidden, weight, targets, g1, g2, vocab_size, temperature, softcap=None):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(h, w, targets, vocab_size=vocab_size, temperature=temperature,
                                             softcap=softcap)
    loss = (lp * g1.double()).sum() + (0 if g2 is None else (ent * g2.double()).sum())
    loss.backward()
    gw = torch.zeros_like(w)
    gw[:w.grad.shape[0]] = w.grad
    return lp, ent, h.grad, gw


def _fused(hidden, weight, targets, g1, g2, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(h, w, targets, **kw)
    loss = (lp * g1).sum() + (0 if g2 is None else (ent * g2).sum())
    loss.backward()
    return lp, ent, h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy_grad", [True, False])
@pytest.mark.parametrize("softcap", [None, 3.0])  # (Gemma 2's soft-capped logits; 3 caps the O(5) logits here)
def test_torch_matches_float64_reference(temperature, with_entropy_grad, softcap):
    # V=203 is no multiple of the vocab chunk 50; rows 190.. are padding; 37 tokens in chunks of 8
    hidden, weight, targets, g1, g2 = _inputs(37, 24, 203, vocab_size=190)
    targets[0] = 189  # the last real row
    g2 = g2 if with_entropy_grad else None
    want = _reference(hidden, weight, targets, g1, g2, 190, temperature, softcap)
    got = _fused(hidden, weight, targets, g1, g2, vocab_size=190, temperature=temperature, chunk_size=8,
                 vocab_chunk_size=50, backend="torch", softcap=softcap)
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == torch.float32
        assert rel(a, b) <= 1e-5, name
    assert torch.all(got[3][190:] == 0), "padding rows must get no gradient"


def test_padding_rows_excluded():
    hidden, weight, targets, g1, _ = _inputs(9, 8, 40, vocab_size=30)
    weight[30:] = 50.0  # huge logits in the padding: they must not count
    lp, ent = fused_logprobs_and_entropy(hidden, weight, targets, vocab_size=30, backend="torch")
    want_lp, want_ent = reference_logprobs_and_entropy(hidden.double(), weight.double(), targets, vocab_size=30)
    assert rel(lp, want_lp) <= 1e-5 and rel(ent, want_ent) <= 1e-5


def test_default_chunks_leading_dims_and_ignore_index():
    hidden, weight, targets, g1, g2 = _inputs(2 * 300, 16, 9000)  # > one default vocab chunk (8192)
    lp, ent = fused_logprobs_and_entropy(hidden.view(2, 300, 16), weight, targets.view(2, 300), backend="torch")
    assert lp.shape == (2, 300) == ent.shape
    want_lp, want_ent = reference_logprobs_and_entropy(hidden.double(), weight.double(), targets)
    assert rel(lp.reshape(-1), want_lp) <= 1e-5 and rel(ent.reshape(-1), want_ent) <= 1e-5
    # ignore index: finite, no target gradient, no NaN anywhere
    t = targets.clone()
    t[:5] = -100
    h = hidden.clone().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(h, weight, t, backend="torch")
    (lp * (t >= 0)).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(h.grad).all() and torch.all(h.grad[:5] == 0)


def test_bf16_inputs():
    hidden, weight, targets, g1, g2 = _inputs(33, 16, 100, dtype=torch.bfloat16)
    want = _reference(hidden, weight, targets, g1, g2, None, 1.0)
    got = _fused(hidden, weight, targets, g1, g2, chunk_size=16, vocab_chunk_size=48, backend="torch")
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    assert rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5
    assert rel(got[2], want[2]) <= 1e-2 and rel(got[3], want[3]) <= 1e-2


def test_auto_backend_without_triton(monkeypatch):
    monkeypatch.setattr(L, "triton_available", lambda: False)
    hidden, weight, targets, _, _ = _inputs(5, 8, 20)
    lp, _ = fused_logprobs_and_entropy(hidden, weight, targets)  # auto -> torch
    assert rel(lp, reference_logprobs_and_entropy(hidden.double(), weight.double(), targets)[0]) <= 1e-5
    with pytest.raises(RuntimeError, match="triton"):
        fused_logprobs_and_entropy(hidden, weight, targets, backend="triton")
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs_and_entropy(hidden, weight, targets, temperature=0.0)


def _triton_worker(rank, world_size, dtype):
    # a fresh process with TRITON_INTERPRET=1 set before triton is imported (Triton's interpreter on CPU)
    hidden, weight, targets, g1, g2 = _inputs(11, 8, 53, dtype=dtype, vocab_size=45)
    return _fused(hidden, weight, targets, g1, g2, vocab_size=45, temperature=0.8, chunk_size=4, backend="triton")


@needs_triton
def test_triton_interpreter_matches_reference(monkeypatch):
    # tiny: the interpreter runs each program in numpy. V=45 (< and not a multiple of the block), padding 45..52
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, targets, g1, g2 = _inputs(11, 8, 53, dtype=dtype, vocab_size=45)
        want = _reference(hidden, weight, targets, g1, g2, 45, 0.8)
        got = run_distributed(_triton_worker, 1, dtype)[0]
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        assert rel(got[0], want[0]) <= 2e-5 and rel(got[1], want[1]) <= 2e-5
        assert rel(got[2], want[2]) <= tol and rel(got[3], want[3]) <= tol
        assert torch.all(got[3][45:] == 0)


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    if not L.triton_available():
        pytest.skip("triton not importable")
    from megatron_rl.kernels import _triton

    if _triton.interpreting():
        pytest.skip("this process runs Triton's interpreter")
    hidden, weight, targets, _, _ = _inputs(3, 8, 20)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_logprobs_and_entropy(hidden, weight, targets, backend="triton")


# ------------------------------------------------------------------------------------------------ TP=2
def _tp_worker(rank, world_size, backend):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    vocab, padded = 90, 96  # rank 1 owns rows 48..95, of which 90..95 are padding
    hidden, weight, targets, g1, g2 = _inputs(21, 12, padded, vocab_size=vocab, seed=3)
    targets[:4] = torch.tensor([0, 47, 48, 89])  # both sides of the split, and the last real id
    per = padded // world_size
    lp, ent, gh, gw = _fused(hidden, weight[rank * per:(rank + 1) * per], targets, g1, g2, tp_group=dist.group.WORLD,
                             vocab_size=vocab, temperature=0.9, chunk_size=8, vocab_chunk_size=20, backend=backend)
    return lp, ent, gh, gw


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_vocab_parallel_tp2_gloo(backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    results = run_distributed(_tp_worker, 2, backend)
    hidden, weight, targets, g1, g2 = _inputs(21, 12, 96, vocab_size=90, seed=3)
    targets[:4] = torch.tensor([0, 47, 48, 89])
    lp, ent, gh, gw = _reference(hidden, weight, targets, g1, g2, 90, 0.9)
    tol = 1e-5 if backend == "torch" else 2e-5
    for rank, (r_lp, r_ent, r_gh, r_gw) in enumerate(results):
        assert rel(r_lp, lp) <= tol and rel(r_ent, ent) <= tol
        assert rel(r_gh, gh) <= tol, "grad_hidden must be all-reduced over the TP group"
        assert rel(r_gw, gw[rank * 48:(rank + 1) * 48]) <= tol
    assert torch.all(results[1][3][42:] == 0)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gpu_matches_torch(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, targets, g1, g2 = (x.cuda() for x in _inputs(3000, 256, 32000, dtype=dtype, vocab_size=31990))
    want = _reference(hidden, weight, targets, g1, g2, 31990, 1.0)
    got = _fused(hidden, weight, targets, g1, g2, vocab_size=31990, chunk_size=1024, backend="triton")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        assert rel(a, b) <= tol
