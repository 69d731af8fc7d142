"""Fused per-token log-probabilities and entropy of a (vocab-parallel) output layer.

`fused_logprobs_and_entropy(hidden, weight, targets)` returns, for every token n,

    logp[n]    = log softmax(hidden[n] @ weight.T / T)[targets[n]]
    entropy[n] = -sum_v p[n, v] log p[n, v]

without ever holding the [N, V] logits: tokens are processed in chunks of `chunk_size` and the vocabulary
in chunks of `vocab_chunk_size`, with an online log-sum-exp across vocabulary chunks. Besides the
inputs, only two fp32 numbers per token are saved for the backward pass (log Z and the entropy); the
backward recomputes each logits chunk and turns it into dL/dlogits in place, then accumulates
grad_hidden += dz @ W and grad_weight += dz.T @ h chunk by chunk (Liger-Kernel's fused-linear-cross-
entropy structure, here with entropy and vocab parallelism).

Math (z = logits / T, g1 = dL/dlogp, g2 = dL/dentropy, H = entropy, log Z = log-sum-exp of z):

    dL/dz[n, v] = g1[n] * 1[v == target[n]] - p[n, v] * (g1[n] + g2[n] * (z[n, v] - log Z[n] + H[n]))

Entropy is accumulated as H = log s - t / s with s = sum exp(z - m) and t = sum exp(z - m) (z - m) for a
running max m: centred, so no cancellation between log Z and E[z].

Vocabulary parallelism (Megatron's `vocab_parallel_cross_entropy`): `weight` holds rows
[vocab_start, vocab_start + V_local) of a vocabulary padded for tensor parallelism; rows at or beyond
`vocab_size` are padding and never enter the softmax (and get zero gradient). Each rank computes its
partial (m, s, t, target logit); one MAX and one SUM all-reduce over `tp_group` combine them, so every
rank returns the full-vocabulary result. In backward, grad_weight stays local (each rank owns its rows)
and grad_hidden is all-reduced over `tp_group` (the input of a column-parallel layer is replicated, the
same reduction Megatron's `copy_to_tensor_model_parallel_region` does). Sequence parallelism would need a
reduce-scatter there instead; it is not supported (it also needs TE/Apex norms, so it never runs on CPU).

Targets outside [0, vocab_size) (for example an ignore index of -100) contribute no target logit and
get no target gradient: their logp is -log Z, meaningless, so mask them in the loss.

Backends: "torch" (chunked torch, any device; the CPU path), "triton" (torch matmuls + one Triton kernel
per chunk for the softmax statistics and one for the in-place gradient; needs Triton; CPU tensors run
the same kernels through Triton's interpreter when TRITON_INTERPRET=1, for tests), "auto" (triton for CUDA tensors when Triton imports, torch otherwise).
Inputs may be fp32 or bf16 (fp16 too); statistics and gradient accumulation are fp32, gradients are
returned in the input dtype.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

# Tile sized on CPU (2 threads; 2 MiB L2 per core): a [512, 4096] fp32 logits tile is 8 MiB; measured best
# of 128x16384, 256x8192, 512x4096, 512x8192, 1024x4096 on the bench shape.
DEFAULT_CHUNK_SIZE = 512
DEFAULT_VOCAB_CHUNK_SIZE = 4096
# On GPU one token chunk spans the whole local vocabulary; bound its bytes instead.
GPU_CHUNK_BYTES = 1 << 30

_NEG = -1.0e30  # finite "minus infinity": exp(_NEG - m) == 0 and 0 * _NEG == 0 (no NaN)


def triton_available() -> bool:
    from megatron_rl.kernels import triton_logprob  # optional Triton: importing it costs ~1 s

    return triton_logprob.AVAILABLE


@dataclasses.dataclass(frozen=True)
class _Config:
    tp_group: object
    vocab_start: int
    n_valid: int  # local rows that are real vocabulary (the rest is padding)
    inv_temperature: float
    chunk_size: int
    vocab_chunk_size: int
    backend: str
    softcap: float | None = None  # logits pass through softcap * tanh(logit / softcap) before the temperature


def fused_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    backend: str = "auto",
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(target) and entropy of softmax(hidden @ weight.T / temperature), fused and chunked.

    hidden: [N, H] (any leading shape is flattened; outputs take that leading shape), fp32 or bf16.
    weight: [V_local, H], the output layer rows this rank owns.
    targets: [N] int64 token ids in the global (unpadded) vocabulary.
    tp_group: process group the vocabulary is split over (None: no split).
    vocab_start: global id of weight's first row; default tp_rank * V_local.
    vocab_size: real (unpadded) global vocabulary size; rows at or beyond it are padding and excluded.
        Default: V_local * tp_size (no padding).
    temperature: logits are divided by it (sampling temperature of the behaviour policy).
    chunk_size / vocab_chunk_size: tokens and vocabulary rows per tile (defaults per backend).
    backend: "auto" | "torch" | "triton" (soft-capped logits take the torch path).
    softcap: the logits pass through softcap * tanh(logit / softcap) before the temperature (Gemma 2's
        final_logit_softcapping); None: none.
    Returns (logprobs, entropy), fp32, shaped like targets; differentiable w.r.t. hidden and weight.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must share the last dim")
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} must have hidden's leading shape {tuple(lead)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    tp_size, tp_rank = 1, 0
    if tp_group is not None:
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    v_local = weight.shape[0]
    if vocab_start is None:
        vocab_start = tp_rank * v_local
    if vocab_size is None:
        vocab_size = v_local * tp_size
    n_valid = max(0, min(v_local, vocab_size - vocab_start))
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    backend = _resolve_backend(backend, hidden)
    if softcap is not None and backend == "triton":
        backend = "torch"  # (the Triton kernel has no soft cap)
    if chunk_size is None:
        if backend == "triton" and hidden.is_cuda:
            chunk_size = max(1, min(h2.shape[0] or 1, GPU_CHUNK_BYTES // (4 * max(n_valid, 1))))
        else:
            chunk_size = DEFAULT_CHUNK_SIZE
    if vocab_chunk_size is None:
        vocab_chunk_size = max(n_valid, 1) if backend == "triton" else DEFAULT_VOCAB_CHUNK_SIZE
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError("chunk_size and vocab_chunk_size must be >= 1")
    cfg = _Config(tp_group, vocab_start, n_valid, 1.0 / float(temperature), int(chunk_size),
                  int(vocab_chunk_size), backend, None if softcap is None else float(softcap))
    logp, ent = _FusedLogprob.apply(h2, weight, t1, cfg)
    return logp.reshape(lead), ent.reshape(lead)


def _resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        return "triton" if hidden.is_cuda and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    return backend


def reference_logprobs_and_entropy(hidden, weight, targets, *, vocab_size=None, temperature=1.0, softcap=None):
    """Unfused reference (full logits in the inputs' dtype promoted to fp32 or better; tests use float64)."""
    w = weight if vocab_size is None else weight[:vocab_size]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = soft_cap(hidden.to(dtype) @ w.to(dtype).T, softcap) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# --------------------------------------------------------------------------------------------------
class _FusedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, cfg: _Config):
        if cfg.backend == "triton":
            from megatron_rl.kernels import triton_logprob as impl  # optional Triton, GPU path only
        else:
            impl = _TorchImpl
        m, s, t, zt = impl.partial_stats(hidden, weight, targets, cfg)
        logp, ent, logz = _combine(m, s, t, zt, cfg.tp_group)
        ctx.save_for_backward(hidden, weight, targets, logz, ent)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, logz, ent = ctx.saved_tensors
        cfg = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_logp is None and g_ent is None:
            return None, None, None, None
        if g_logp is None:
            g_logp = torch.zeros_like(logz)
        impl = _TorchImpl
        if cfg.backend == "triton":
            from megatron_rl.kernels import triton_logprob as impl  # optional Triton, GPU path only
        grad_h, grad_w = impl.grads(hidden, weight, targets, logz, ent, g_logp.float().contiguous(),
                                    None if g_ent is None else g_ent.float().contiguous(), cfg, need_h, need_w)
        if grad_h is not None and cfg.tp_group is not None:
            dist.all_reduce(grad_h, group=cfg.tp_group)
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype), None, None)


def _combine(m, s, t, zt, tp_group):
    """Local (max, sum-exp, centred t, target logit) -> (logp, entropy, log Z), reduced over tp_group."""
    if tp_group is not None:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - m_global)
        stacked = torch.stack([s * scale, scale * (t + s * (m - m_global)), zt])
        dist.all_reduce(stacked, group=tp_group)
        s, t, zt = stacked.unbind(0)
        m = m_global
    log_s = torch.log(s)
    logz = m + log_s
    return zt - logz, log_s - t / s, logz


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capped logits and attention scores); x itself when `cap` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


# --------------------------------------------------------------------------------------------------
class _TorchImpl:
    """Chunked torch implementation; reuses two tile buffers so nothing of size [N, V] exists."""

    @staticmethod
    def _local_targets(targets, cfg):
        local = targets - cfg.vocab_start
        owned = (local >= 0) & (local < cfg.n_valid)
        return local, owned

    @staticmethod
    def partial_stats(hidden, weight, targets, cfg):
        n, dev = hidden.shape[0], hidden.device
        w = weight[:cfg.n_valid]
        w32 = w if w.dtype == torch.float32 else w.float()
        m = torch.full((n,), _NEG, dtype=torch.float32, device=dev)
        s = torch.zeros(n, dtype=torch.float32, device=dev)
        t = torch.zeros(n, dtype=torch.float32, device=dev)
        local, owned = _TorchImpl._local_targets(targets, cfg)
        # Target logit directly from the target's row (no [N, V] gather needed).
        zt = torch.zeros(n, dtype=torch.float32, device=dev)
        idx = owned.nonzero().squeeze(1)
        if idx.numel():
            zt[idx] = soft_cap((hidden[idx].float() * w32[local[idx]]).sum(-1), cfg.softcap) * cfg.inv_temperature
        cn, cv = cfg.chunk_size, min(cfg.vocab_chunk_size, max(cfg.n_valid, 1))
        buf_z = torch.empty(min(cn, n), cv, dtype=torch.float32, device=dev)
        buf_e = torch.empty_like(buf_z)
        for n0 in range(0, n, cn):
            h = hidden[n0:n0 + cn]
            h = h if h.dtype == torch.float32 else h.float()
            rows = h.shape[0]
            mc, sc, tc = m[n0:n0 + rows], s[n0:n0 + rows], t[n0:n0 + rows]
            for v0 in range(0, cfg.n_valid, cv):
                wc = w32[v0:v0 + cv]
                z = buf_z[:rows, :wc.shape[0]]
                e = buf_e[:rows, :wc.shape[0]]
                torch.mm(h, wc.T, out=z)
                if cfg.softcap is not None:
                    torch.tanh(z.div_(cfg.softcap), out=z).mul_(cfg.softcap)
                if cfg.inv_temperature != 1.0:
                    z.mul_(cfg.inv_temperature)
                m_new = torch.maximum(mc, z.amax(1))
                z.sub_(m_new.unsqueeze(1))  # z - m_new (<= 0)
                torch.exp(z, out=e)
                s_blk = e.sum(1)
                t_blk = torch.linalg.vecdot(e, z)
                # rescale the running sums to the new max: t is centred on m, so it shifts by s*(m - m_new)
                delta = mc - m_new
                alpha = torch.exp(delta)
                tc.add_(sc * delta).mul_(alpha).add_(t_blk)
                sc.mul_(alpha).add_(s_blk)
                mc.copy_(m_new)
        return m, s, t, zt

    @staticmethod
    def grads(hidden, weight, targets, logz, ent, g1, g2, cfg, need_h, need_w):
        n, dev = hidden.shape[0], hidden.device
        w = weight[:cfg.n_valid]
        w32 = w if w.dtype == torch.float32 else w.float()
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        local, owned = _TorchImpl._local_targets(targets, cfg)
        cn, cv = cfg.chunk_size, min(cfg.vocab_chunk_size, max(cfg.n_valid, 1))
        buf_z = torch.empty(min(cn, n), cv, dtype=torch.float32, device=dev)
        buf_p = torch.empty_like(buf_z)
        buf_d = torch.empty_like(buf_z) if cfg.softcap is not None else None
        a = cfg.inv_temperature
        for n0 in range(0, n, cn):
            h = hidden[n0:n0 + cn]
            h = h if h.dtype == torch.float32 else h.float()
            rows = h.shape[0]
            lz = logz[n0:n0 + rows].unsqueeze(1)
            g1c = g1[n0:n0 + rows].unsqueeze(1)
            if g2 is not None:
                g2c = g2[n0:n0 + rows].unsqueeze(1)
                c0 = g1c + g2c * ent[n0:n0 + rows].unsqueeze(1)  # g1 + g2 * H
            tl_, ow = local[n0:n0 + rows], owned[n0:n0 + rows]
            for v0 in range(0, cfg.n_valid, cv):
                wc = w32[v0:v0 + cv]
                vc = wc.shape[0]
                z = buf_z[:rows, :vc]
                p = buf_p[:rows, :vc]
                torch.mm(h, wc.T, out=z)
                if cfg.softcap is not None:  # z = c tanh(x / c): dz/dx = 1 - tanh(x / c)^2, applied below
                    torch.tanh(z.div_(cfg.softcap), out=z)
                    d = buf_d[:rows, :vc]
                    torch.mul(z, z, out=d).neg_().add_(1.0)
                    z.mul_(cfg.softcap)
                if a != 1.0:
                    z.mul_(a)
                z.sub_(lz)  # log p
                torch.exp(z, out=p)
                # dz = -p * (g1 + g2 * (log p + H))  (times 1/T, folded into the matmuls' alpha)
                if g2 is None:
                    torch.mul(p, g1c, out=z).neg_()
                else:
                    z.mul_(g2c).add_(c0).mul_(p).neg_()
                hit = ow & (tl_ >= v0) & (tl_ < v0 + vc)
                r = hit.nonzero().squeeze(1)
                if r.numel():
                    z[r, tl_[r] - v0] += g1c[r, 0]
                if cfg.softcap is not None:
                    z.mul_(d)
                if need_h:
                    grad_h[n0:n0 + rows].addmm_(z, wc, alpha=a)
                if need_w:
                    grad_w[v0:v0 + vc].addmm_(z.T, h, alpha=a)
        return grad_h, grad_w
