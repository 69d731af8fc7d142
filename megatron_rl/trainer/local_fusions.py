"""Fused forward and backward passes for the elementwise parts of Megatron's local (non-Transformer-Engine)
layers: RMSNorm, rotary embeddings and SwiGLU, plus torch's fused Adam for Megatron's torch optimizer.

Without Transformer Engine or Apex, Megatron-core builds these from plain torch ops, and autograd then
saves every intermediate and runs one kernel per op both ways (RoPE alone: slice, chunk, neg, cat, two
multiplies and an add per tensor, and their backward with zero-filled slice gradients and concatenations);
on CPU that was a quarter of a SmolLM2 training step. Each function here computes the same maths with
few passes, saves only its inputs (or nothing: RoPE is linear), and writes its input gradient in one
buffer. Results match the unfused ops to rounding (tests/test_local_fusions.py).

trainer/model.py applies them to a built local-spec model (`fuse_model`); the trainer calls `fuse_adam` on its
optimizer.
"""
from __future__ import annotations

import weakref

import megatron.core.transformer.attention as megatron_attention
import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

_original_apply_rotary_pos_emb = megatron_attention.apply_rotary_pos_emb


# --- RMSNorm ----------------------------------------------------------------------------------------
def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)) over the last dim (HF Llama's order of operations: the
    normalised x cast to x's dtype, then scaled); with an `offset` (Gemma's zero-centred weights),
    y = (x * rsqrt(...)) * (offset + weight) in fp32, then cast (Gemma's order). Statistics in fp32 or better.
    Saves x and the per-row rsqrt only."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, offset: float = 0.0):
        rows = x.reshape(-1, x.shape[-1])
        xf = _at_least_fp32(rows)
        rstd = torch.rsqrt(torch.linalg.vecdot(xf, xf).div_(x.shape[-1]).add_(eps)).unsqueeze(-1)
        if offset:
            out = (xf * rstd).mul_(_at_least_fp32(weight) + offset).to(x.dtype)
        else:
            normed = (xf * rstd).to(x.dtype)
            out = normed.mul_(weight) if weight.dtype == x.dtype else weight * normed
        ctx.save_for_backward(rows, weight, rstd)
        ctx.offset = offset
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, rstd = ctx.saved_tensors
        g = _at_least_fp32(grad_out.reshape(rows.shape))
        xhat = _at_least_fp32(rows) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * xhat).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gxhat = g * (_at_least_fp32(weight) + ctx.offset)
            # d/dx of x * r(x): r * (gxhat - xhat * mean(gxhat * xhat))
            mean = torch.linalg.vecdot(gxhat, xhat).div_(rows.shape[-1]).unsqueeze(-1)
            grad_x = gxhat.addcmul_(xhat, mean, value=-1.0).mul_(rstd).to(rows.dtype).view(grad_out.shape)
        return grad_x, grad_weight, None, None


class FusedRMSNorm(torch.nn.Module):
    """torch's `RMSNorm` (what Megatron's local spec builds) with a fused backward: same `weight`. `offset`
    1.0 makes it Gemma's zero-centred norm (scaled by 1 + weight; trainer/model.py sets it)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = 0.0

    @classmethod
    def replacing(cls, norm: torch.nn.RMSNorm) -> FusedRMSNorm:
        """A fused norm holding `norm`'s own weight Parameter (with any tags Megatron put on it)."""
        fused = cls(norm.weight.shape[0], eps=norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps)
        fused.weight = norm.weight
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# --- rotary embeddings ------------------------------------------------------------------------------
def _rotate_into(out: torch.Tensor, x: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """out += rotate_half(x) * sin (sign 1) or rotate_half^T(x) * sin (sign -1), where rotate_half([x1, x2])
    = [-x2, x1] and its transpose is [x2, -x1]."""
    half = x.shape[-1] // 2
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=sign)
    return out


class _RotaryFunction(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin (Megatron's non-interleaved bshd RoPE). Linear in t: nothing saved
    but cos and sin, and the backward is the transposed rotation."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_into(t * cos, t, sin, 1.0)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return _rotate_into(grad_out * cos, grad_out, sin, -1.0), None, None


class _CosSinCache:
    """cos/sin of the last RoPE frequency tensor seen: every layer's q and k of a forward (and every step
    of one sequence length: Megatron caches the frequencies) share one tensor."""

    def __init__(self):
        self._key = None
        self._value = None

    def get(self, freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
        key = (freqs._version, mscale, dtype)
        if self._key is not None and self._key[0]() is freqs and self._key[1:] == key:
            return self._value
        value = ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
        self._key, self._value = (weakref.ref(freqs), *key), value
        return value


_cos_sin = _CosSinCache()


def fused_rotary(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """RoPE over the whole last dim of t [s, b, heads, d] with freqs [s, 1, 1, d] (Megatron's layout)."""
    cos, sin = _cos_sin.get(freqs, mscale, t.dtype)
    return _RotaryFunction.apply(t, cos, sin)


class _PackedFreqsCache:
    """The RoPE frequencies of a packed row, positions restarting at each document: built once per forward
    (every layer's q and k share the frequency tensor and the `cu_seqlens` tensor of the micro-batch)."""

    def __init__(self):
        self._key = None
        self._value = None

    def get(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        key = (weakref.ref(freqs), weakref.ref(cu_seqlens), freqs._version, cu_seqlens._version)
        if self._key is not None and all(a() is b() for a, b in zip(self._key[:2], key[:2])) \
                and self._key[2:] == key[2:]:
            return self._value
        bounds = cu_seqlens.tolist()
        self._key, self._value = key, torch.cat([freqs[:end - start] for start, end in zip(bounds, bounds[1:])])
        return self._value


_packed_freqs = _PackedFreqsCache()


def _apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron's `apply_rotary_pos_emb` with the plain case (full rotary dim, not interleaved, no TE fusion,
    no multi-latent attention; bshd, or a packed thd row without context parallelism) fused; every other
    case goes to Megatron's own."""
    plain = (not config.apply_rope_fusion and not config.rotary_interleaved and not config.multi_latent_attention
             and freqs.shape[-1] == t.shape[-1])
    if plain and cu_seqlens is None and freqs.dim() == t.dim():
        return fused_rotary(t, freqs, mscale)
    if plain and cu_seqlens is not None and t.dim() == 3 and (cp_group is None or cp_group.size() == 1):
        return fused_rotary(t.unsqueeze(1), _packed_freqs.get(freqs, cu_seqlens), mscale).squeeze(1)
    return _original_apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale,
                                          cp_group=cp_group)


def install() -> None:
    """Route Megatron attention's RoPE through `fused_rotary` (same maths; idempotent)."""
    megatron_attention.apply_rotary_pos_emb = _apply_rotary_pos_emb


# --- SwiGLU -----------------------------------------------------------------------------------------
class _SwiGLUFunction(torch.autograd.Function):
    """silu(x1) * x2 for x = [x1, x2] on the last dim; saves x, returns dL/dx in one buffer."""

    @staticmethod
    def forward(ctx, x):
        half = x.shape[-1] // 2
        gate, up = x[..., :half], x[..., half:]
        ctx.save_for_backward(x)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        gate, up = x[..., :half], x[..., half:]
        grad_x = torch.empty_like(x)
        torch.ops.aten.silu_backward.grad_input(grad_out * up, gate, grad_input=grad_x[..., :half])
        torch.mul(F.silu(gate), grad_out, out=grad_x[..., half:])
        return grad_x


class FusedSwiGLUMLP(MLP):
    """Megatron's MLP with its SwiGLU (no biases, no per-token scale, no clamp) fused; other
    configurations run Megatron's own forward."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        config = self.config
        if (per_token_scale is not None or config.add_bias_linear or not config.gated_linear_unit
                or self.activation_func is not F.silu or config.use_te_activation_func
                or config.activation_func_clamp_value is not None or config.glu_linear_offset != 0.0):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, _ = self.linear_fc1(hidden_states)
        return self.linear_fc2(_SwiGLUFunction.apply(intermediate))


# --- hooks into the model build ---------------------------------------------------------------------
def fuse_model(model: torch.nn.Module) -> int:
    """Fuse a built local-spec model in place: every torch RMSNorm with a 1-D weight (the layers', the q/k
    norms, the final norm the block builds itself) becomes a `FusedRMSNorm` on the same Parameter, every
    dense `MLP` a `FusedSwiGLUMLP` (a class swap after the build: a subclass in the layer spec would lose
    the TP group that Megatron passes to `MLP` only), and RoPE goes through `fused_rotary` (`install`).
    Mixture-of-experts experts keep Megatron's MLP. Returns how many modules were swapped."""
    install()
    swapped = 0
    for module in model.modules():
        if type(module) is MLP and not getattr(module.linear_fc1, "is_expert", False):
            module.__class__ = FusedSwiGLUMLP
            swapped += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.RMSNorm and child.elementwise_affine and child.weight.dim() == 1
                    and tuple(child.normalized_shape) == tuple(child.weight.shape)):
                setattr(parent, name, FusedRMSNorm.replacing(child))
                swapped += 1
    return swapped


# --- Adam -------------------------------------------------------------------------------------------
def _fuse(optimizer: torch.optim.Optimizer, *_args) -> None:
    for group in optimizer.param_groups:
        group["foreach"] = None
        group["fused"] = True


def fuse_adam(megatron_optimizer) -> int:
    """Switch the torch Adam/AdamW inside Megatron's optimizer (used when neither TE nor Apex is installed)
    to torch's fused kernel, which CPU and CUDA tensors have: one pass over each tensor instead of a dozen
    per-parameter ops. Kept after a state-dict load (which restores the saved group flags). Returns how
    many torch optimizers were switched."""
    wrappers = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    switched = 0
    for wrapper in wrappers:
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if any(not p.is_floating_point() or p.device.type not in ("cpu", "cuda") for p in params):
            continue
        _fuse(inner)
        inner.register_load_state_dict_post_hook(_fuse)
        switched += 1
    return switched
