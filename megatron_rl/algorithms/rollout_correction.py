"""Rollout correction: importance weights and rejection masks for the gap between the policy being trained
(pi) and the engine that sampled the tokens (mu), applied on top of any policy loss.

The gap has two sources: staleness (the asynchronous loop trains on samples of older weights) and the
engine's own numerics (bf16 or fp8 engines, other kernels, other reductions), which make mu differ from pi
even at the same weights (Yao, Liu et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"; Liu, Li et al. 2025, "When speed kills stability"). With log r_t = log pi(y_t) - log mu(y_t),
pi detached:

- weights `token`:     w_t = r_t;  `sequence`: w_t = prod_s r_s (the sequence's ratio, on each of its tokens).
  Truncated: w = min(w, cap) (TIS), or with a floor, IcePop-style masking: w = 0 outside [floor, cap].
- rejection criteria (all must pass; a rejected token leaves the loss): per token or per sequence
  (sum / mean / max over its tokens) of k1 = log(mu/pi) inside a ratio band [lo, hi] (compared as
  log lo <= k1 <= log hi), or of k2 = (log r)^2 / 2, k3 = r - 1 - log r under an upper bound.
  `seq_mean_k1` is the geometric-mean ratio mask (exp of the mean log-ratio of a sequence).

The options and their arithmetic are verl's (`verl/trainer/ppo/rollout_corr_helper.py`, 0.9.1) so that a
configuration carries over; tests compare against it. As there, log-ratios are clamped to +-20 before exp,
the weights are detached and zero on padding. Departures: the weights are computed per micro-batch inside
the loss (no batch normalisation of the weights, which would need the whole batch's pi before the step);
metrics are detached tensors (the trainer averages them over micro-batches).
"""
from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.config import RolloutCorrectionConfig

SAFETY_BOUND = 20.0


def _masked_mean(x: torch.Tensor, m: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def correction_weights(log_ratio: torch.Tensor, mask: torch.Tensor, config: RolloutCorrectionConfig,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights `[B, S]` (zero on padding) and their metrics; `log_ratio` = log pi - log mu."""
    m = mask.to(log_ratio.dtype)
    if config.weights == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif config.weights == "sequence":
        total = (log_ratio * m).sum(-1, keepdim=True)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout correction weights {config.weights!r}: token or sequence")
    raw = raw * m
    if config.weight_floor is None:
        weights = raw.clamp(max=config.weight_cap)
    else:
        inside = (raw >= config.weight_floor) & (raw <= config.weight_cap)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    weights = weights.detach()
    mean = _masked_mean(weights, m)
    normalised = weights.clamp(min=0.0, max=config.weight_cap) / (mean + 1e-8)
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_max": weights.masked_fill(m == 0, float("-inf")).max() if m.sum() else mean,
        # effective sample size as a share of the tokens: (mean w)^2 / mean(w^2); 0 when every weight is 0
        "rollout_is_ess": torch.where(mean > 0, 1.0 / _masked_mean(normalised * normalised, m).clamp(min=1e-12),
                                      torch.zeros_like(mean)),
        "rollout_is_high_frac": _masked_mean((raw > config.weight_cap).to(m.dtype), m),
    }
    if config.weight_floor is not None:
        metrics["rollout_is_out_of_band_frac"] = _masked_mean(
            ((raw < config.weight_floor) | (raw > config.weight_cap)).to(m.dtype), m)
    return weights, metrics


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, config: RolloutCorrectionConfig,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`[B, S]` keep mask (1 where every criterion of `config.reject` passes, 0 elsewhere and on padding)."""
    m = mask.to(log_ratio.dtype)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe * safe, "k3": torch.exp(safe) - 1.0 - safe}
    keep = torch.ones_like(m, dtype=torch.bool)
    metrics: dict[str, torch.Tensor] = {}
    for name, bound in config.reject.items():
        level, estimator = name.rsplit("_", 1)
        stat = per_token[estimator]
        if level == "seq_sum":
            stat = (stat * m).sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = _masked_mean(stat, m, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            largest = stat.masked_fill(m == 0, float("-inf")).max(-1, keepdim=True).values
            stat = torch.where(torch.isinf(largest), torch.zeros_like(largest), largest)
        if estimator == "k1":
            passes = (stat >= math.log(bound[0])) & (stat <= math.log(bound[1]))
        else:
            passes = stat <= bound
        passes = passes.expand_as(keep)
        metrics[f"rollout_rs_{name}_masked_frac"] = _masked_mean((~passes).to(m.dtype), m)
        keep &= passes
    keep_f = keep.to(m.dtype) * m
    metrics["rollout_rs_masked_frac"] = _masked_mean(1.0 - keep_f, m)
    rows = m.sum(-1) > 0
    dropped_rows = ((m - keep_f).sum(-1) > 0) & rows
    metrics["rollout_rs_seq_masked_frac"] = dropped_rows.to(m.dtype).sum() / rows.sum().clamp(min=1)
    return keep_f, metrics


def rollout_correction(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       config: RolloutCorrectionConfig,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(weights or None, keep mask, metrics) for this micro-batch. `logprobs` are pi's (detached here),
    `behaviour_logprobs` mu's; both `[B, S]`, token-aligned with `mask`."""
    m = (mask != 0).to(logprobs.dtype)
    log_ratio = (logprobs.detach() - behaviour_logprobs.to(logprobs.dtype)) * m
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if config.weights != "none":
        weights, weight_metrics = correction_weights(log_ratio, m, config)
        metrics.update(weight_metrics)
    keep = m
    if config.reject:
        keep, reject_metrics = rejection_mask(log_ratio, m, config)
        metrics.update(reject_metrics)
    return weights, keep, metrics
