"""RoPE inverse frequencies for every supported `rope_type`, as transformers computes them.

The trainer (`trainer/model.py`) and the native engine both call `rope_inv_freq`, so the positions they
encode cannot drift apart; the formulas follow transformers' `modeling_rope_utils` for the same config
(docs/models.md). cos/sin at position p are cos(p * inv_freq) * attention_scaling (and sin likewise).
"""
from __future__ import annotations

import math

import torch

from megatron_rl.models.arch import ModelArch, RopeScaling


def rope_inv_freq(arch: ModelArch, seq_len: int | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [rotary_dim // 2], attention_scaling) for `arch` (rotary_dim: head_dim unless the family
    rotates only part of each head, `ModelArch.partial_rotary_factor`, whose dims set the frequencies as in HF).

    `seq_len` matters only for 'dynamic' scaling: it is the longest sequence of the forward (HF uses
    max(position_ids) + 1). HF caches the largest length a module has seen; this function is stateless,
    so it equals HF on a model that has not run a longer sequence before.
    """
    dim = arch.rotary_dim
    scaling = arch.rope_scaling
    if scaling is None:
        return _plain(arch.rope_theta, dim, device), 1.0
    if scaling.rope_type == "linear":
        return _plain(arch.rope_theta, dim, device) / scaling.factor, 1.0
    if scaling.rope_type == "dynamic":
        return _dynamic(arch, scaling, seq_len, device), 1.0
    if scaling.rope_type == "llama3":
        return _llama3(arch.rope_theta, dim, scaling, device), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(arch.rope_theta, dim, scaling, device)
    raise AssertionError(f"unreachable: RopeScaling validates rope_type ({scaling.rope_type})")


def _exponents(dim: int, device) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _plain(base: float, dim: int, device) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim, device))


def _dynamic(arch: ModelArch, scaling: RopeScaling, seq_len: int | None, device) -> torch.Tensor:
    dim, limit, factor = arch.rotary_dim, arch.max_position_embeddings, scaling.factor
    if seq_len is None or seq_len <= limit:
        # HF keeps the frequencies computed at init (seq_len = max_position_embeddings) in Python floats.
        base = arch.rope_theta * ((factor * limit / limit) - (factor - 1)) ** (dim / (dim - 2))
        return _plain(base, dim, device)
    # Past the limit HF recomputes from a 0-d int64 tensor, i.e. in fp32; done the same way to match bits.
    length = torch.tensor(seq_len, dtype=torch.int64, device=device)
    base = arch.rope_theta * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, device))


def _llama3(base: float, dim: int, scaling: RopeScaling, device) -> torch.Tensor:
    inv_freq = _plain(base, dim, device)
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, scaling: RopeScaling, device) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    # HF treats a 0 / missing beta as its default (`or`), so this does too.
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1
    context = scaling.original_max_position_embeddings
    truncate = True if scaling.truncate is None else scaling.truncate

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)

    pos_freqs = base ** _exponents(dim, device)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each dimension that keeps its original (extrapolated) frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)
