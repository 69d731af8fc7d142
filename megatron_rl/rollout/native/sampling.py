"""Sampling and log-probs of the native engine: see `sample_tokens` and the module docstring of
rollout/engine.py. Each sample owns a torch.Generator seeded from its request's seed (`_sample_seed`),
drawing exactly one float64 uniform per token (inverted through the CDF by `inverse_cdf`), so its
tokens do not depend on which other requests share its batch.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_rl.kernels.cpu_decode import CpuDecodeKernels
from megatron_rl.rollout.engine import SamplingParams


def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits each row samples from: z / T, then top-k, then top-p (on the top-k-renormalised
    distribution: the smallest set of most likely tokens whose mass reaches top_p), then min-p;
    removed tokens get -inf. Rows must not be greedy (temperature > 0)."""
    z = logits
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        z = z / torch.tensor(temps, device=z.device, dtype=z.dtype)[:, None]
    else:
        z = z.clone()
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        rows = [i for i, k in enumerate(top_k) if 0 < k < z.shape[-1]]
        if rows:
            k_max = max(top_k[i] for i in rows)
            sub = z[rows]
            values = sub.topk(k_max, dim=-1).values
            kth = values.gather(1, torch.tensor([top_k[i] - 1 for i in rows], device=z.device)[:, None])
            z[rows] = sub.masked_fill(sub < kth, float("-inf"))
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        sub = z[rows]
        sorted_z, order = sub.sort(dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        before = sorted_p.cumsum(dim=-1) - sorted_p   # mass of strictly more likely tokens
        top_p = torch.tensor([params[i].top_p for i in rows], device=z.device, dtype=z.dtype)[:, None]
        sorted_z.masked_fill_(before >= top_p, float("-inf"))
        z[rows] = torch.empty_like(sub).scatter_(-1, order, sorted_z)
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if rows:
        sub = z[rows]
        probs = torch.softmax(sub, dim=-1)
        min_p = torch.tensor([params[i].min_p for i in rows], device=z.device, dtype=z.dtype)[:, None]
        z[rows] = sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return z


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  kernels: CpuDecodeKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [R, V] (fp32, or the model's activation dtype: widened to fp32
    first, which the kernels do row by row); returns (tokens [R] long, logprobs [R] fp32).

    Greedy rows (temperature 0 or top_k 1) take argmax(logits). Other rows draw exactly from
    p = softmax(filtered_logits) by inverting its CDF at one float64 uniform from the row's own
    generator (one draw per token, so a sample's tokens do not depend on its batch neighbours).
    The returned log-prob is always log_softmax(logits)[token] of the raw logits: the engine's
    policy at temperature 1 without truncation. `kernels`: the fused CPU kernels, which sample plain rows in one
    pass (the same draw, to float rounding).
    """
    if params and all(_plain(p) for p in params):
        if kernels is not None and logits.device.type == "cpu" and kernels.supports(logits.dtype):
            return kernels.sample_plain(logits.contiguous(), _uniforms(generators, logits.device))
        return _sample_plain(logits.float(), generators)
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        tokens[index] = logits.index_select(0, index).argmax(dim=-1)
    if sampled:
        every = len(sampled) == logits.shape[0]
        index = torch.tensor(sampled, device=logits.device)
        sub_params = [params[i] for i in sampled]
        if all(_plain(p) for p in sub_params):
            probs = (logprobs if every else logprobs.index_select(0, index)).exp()
        else:
            probs = torch.softmax(filtered_logits(logits if every else logits.index_select(0, index), sub_params), dim=-1)
        tokens[index] = inverse_cdf(probs, _uniforms([generators[i] for i in sampled], logits.device))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _plain(params: SamplingParams) -> bool:
    """Sampling from the raw policy: temperature 1, no truncation (the RL rollout case)."""
    return not params.greedy and params.temperature == 1.0 and params.top_k < 0 and params.top_p >= 1.0 \
        and params.min_p == 0.0


def _uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """One float64 uniform from each row's own generator."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=g.device) for g in generators]).to(device)


def _sample_plain(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` when every row samples the raw policy: one exp pass gives the unnormalised
    probabilities exp(z - max) that are sampled from, and their float64 total (from the CDF) gives the
    log-prob z[t] - max - log(total): no separate log_softmax pass over the vocabulary."""
    shift = logits.amax(dim=-1, keepdim=True)
    probs = (logits - shift).exp_()
    tokens, total = _inverse_cdf(probs, _uniforms(generators, logits.device))
    chosen = logits.gather(1, tokens[:, None]) - shift
    return tokens, (chosen.double() - total.log()).squeeze(1).to(logits.dtype)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The token t of each row with CDF(t-1) <= u * total < CDF(t), for probs [R, V] (unnormalised,
    >= 0) and uniforms [R] in [0, 1). Two levels (blocks of `block` tokens, then tokens within the
    chosen block), each a float64 cumulative sum, so even 1e-9-probability tokens get their share
    without a float64 pass over the whole vocabulary. Zero-probability tokens are never chosen."""
    return _inverse_cdf(probs, uniforms, block)[0]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """`inverse_cdf`, and each row's float64 total mass [R, 1]."""
    rows, vocab = probs.shape
    n_blocks = -(-vocab // block)
    if n_blocks * block != vocab:
        probs = F.pad(probs, (0, n_blocks * block - vocab))
    blocks = probs.view(rows, n_blocks, block)
    cdf = blocks.sum(-1).double().cumsum(-1)                        # [R, n_blocks]
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cdf, target, right=True).clamp_(max=n_blocks - 1)          # [R, 1]
    lower = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    mass = cdf.gather(1, b) - lower
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, block)).squeeze(1).double().cumsum(-1)   # [R, block]
    # position inside the block, rescaled to the block's own float64 total
    within = ((target - lower) / mass).clamp_(0.0, 1.0) * inner[:, -1:]
    within = torch.minimum(within, torch.nextafter(inner[:, -1:], torch.zeros_like(within)))
    j = torch.searchsorted(inner, within, right=True).clamp_(max=block - 1)
    return (b * block + j).squeeze(1), total


_SEED_MIX = 0x9E3779B97F4A7C15


def _sample_seed(seed: int, k: int, n: int) -> int:
    """Seed of sample k of an n-sample request (the request's seed itself when n == 1)."""
    if n == 1:
        return seed
    return ((seed % 2**64) * _SEED_MIX + k + 1) % 2**64
