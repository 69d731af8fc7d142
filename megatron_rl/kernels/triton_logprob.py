"""Triton kernels of the fused log-prob (see `logprob.py` for the math and the public entry point).

Structure (as Liger-Kernel's fused linear cross-entropy): per token chunk, a cuBLAS matmul writes the
[rows, V_local] logits tile in fp32; `_stats_kernel` reads it once (one program per row, online
max / sum-exp / centred entropy term / target logit over BLOCK_V columns); in backward the tile is
recomputed and `_grad_kernel` overwrites it in place with dL/dlogits (one read, one write), then two
matmuls accumulate grad_hidden and grad_weight. Only padding-free columns [0, n_valid) are launched.

Tolerance: the statistics are the same fp32 sums as the torch path in a different order; tests accept
2e-5 relative error (interpreter on CPU, TRITON_INTERPRET=1) and the GPU test 1e-4 for fp32 inputs (with
TF32 off; the matmuls follow `torch.backends.cuda.matmul.allow_tf32` as the caller set it). bf16 inputs:
logits tiles are fp32 (cuBLAS out_dtype where torch has it, else upcast), dL/dlogits is cast to bf16 for
the two gradient matmuls (as Liger-Kernel does), gradients accumulate in fp32.

Triton is optional: `AVAILABLE` is False when it does not import, and nothing here is called then.
"""
from __future__ import annotations

import torch

from megatron_rl.kernels._triton import AVAILABLE, check_device, tl, triton

_NEG = -1.0e30


def _block_v(n_cols: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(max(n_cols, 1))))


if AVAILABLE:

    @triton.jit
    def _stats_kernel(z_ptr, stride_z, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, n_cols, inv_t,
                      BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        tgt = tl.load(tgt_ptr + row)
        m = -1.0e30
        s = 0.0
        t = 0.0
        zt = 0.0
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
            z = tl.where(mask, z, -1.0e30)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = z - m_new
            e = tl.where(mask, tl.exp(d), 0.0)
            s_blk = tl.sum(e, axis=0)
            t_blk = tl.sum(tl.where(mask, e * d, 0.0), axis=0)
            delta = m - m_new
            alpha = tl.exp(delta)
            t = (t + s * delta) * alpha + t_blk
            s = s * alpha + s_blk
            m = m_new
            zt += tl.sum(tl.where(cols == tgt, z, 0.0), axis=0)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        tl.store(zt_ptr + row, zt)

    @triton.jit
    def _grad_kernel(z_ptr, stride_z, tgt_ptr, logz_ptr, ent_ptr, g1_ptr, g2_ptr, n_cols, inv_t,
                     HAS_G2: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        tgt = tl.load(tgt_ptr + row)
        lz = tl.load(logz_ptr + row)
        g1 = tl.load(g1_ptr + row)
        if HAS_G2:
            g2 = tl.load(g2_ptr + row)
            c0 = g1 + g2 * tl.load(ent_ptr + row)
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            logp = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t - lz
            p = tl.exp(logp)
            if HAS_G2:
                dz = -p * (c0 + g2 * logp)
            else:
                dz = -p * g1
            dz = tl.where(cols == tgt, dz + g1, dz) * inv_t
            tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=mask)


_MM_OUT_DTYPE: bool | None = None


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (fp32 accumulation; bf16 inputs use cuBLAS's out_dtype when it exists)."""
    global _MM_OUT_DTYPE
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    if _MM_OUT_DTYPE is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    return torch.mm(a.float(), b.float())


def _local_targets(targets, cfg):
    local = targets - cfg.vocab_start
    owned = (local >= 0) & (local < cfg.n_valid)
    return torch.where(owned, local, torch.full_like(local, -1)).contiguous()


def partial_stats(hidden, weight, targets, cfg):
    n, dev = hidden.shape[0], hidden.device
    w = weight[:cfg.n_valid]
    tgt = _local_targets(targets, cfg)
    m = torch.full((n,), _NEG, dtype=torch.float32, device=dev)
    s = torch.zeros(n, dtype=torch.float32, device=dev)
    t = torch.zeros(n, dtype=torch.float32, device=dev)
    zt = torch.zeros(n, dtype=torch.float32, device=dev)
    if cfg.n_valid == 0:
        return m, s, t, zt
    check_device(hidden)
    block = _block_v(cfg.n_valid)
    for n0 in range(0, n, cfg.chunk_size):
        h = hidden[n0:n0 + cfg.chunk_size]
        rows = h.shape[0]
        z = _mm32(h, w.T)
        _stats_kernel[(rows,)](z, z.stride(0), tgt[n0:], m[n0:], s[n0:], t[n0:], zt[n0:],
                               cfg.n_valid, cfg.inv_temperature, BLOCK_V=block)
    return m, s, t, zt


def grads(hidden, weight, targets, logz, ent, g1, g2, cfg, need_h, need_w):
    n, dev = hidden.shape[0], hidden.device
    w = weight[:cfg.n_valid]
    tgt = _local_targets(targets, cfg)
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
    if cfg.n_valid == 0:
        return grad_h, grad_w
    block = _block_v(cfg.n_valid)
    for n0 in range(0, n, cfg.chunk_size):
        h = hidden[n0:n0 + cfg.chunk_size]
        rows = h.shape[0]
        z = _mm32(h, w.T)
        _grad_kernel[(rows,)](z, z.stride(0), tgt[n0:], logz[n0:], ent[n0:], g1[n0:],
                              g1[n0:] if g2 is None else g2[n0:], cfg.n_valid, cfg.inv_temperature,
                              HAS_G2=g2 is not None, BLOCK_V=block)
        dz = z if h.dtype == torch.float32 else z.to(h.dtype)
        if need_h:
            grad_h[n0:n0 + rows] += _mm32(dz, w)
        if need_w:
            grad_w[:cfg.n_valid] += _mm32(dz.T, h)
    return grad_h, grad_w
