"""Prompt Curriculum Learning (Gao, Kim, Sun et al. 2025, arXiv 2510.01135): pure functions.

A value model V(x) predicts the policy's expected reward on prompt x from the prompt alone. Each step
k*m candidate prompts are scored by V and the m whose prediction is closest to tau (0.5: intermediate
difficulty, where a 0/1-reward group most often has mixed rewards and so non-zero advantages) are
generated. V is regressed on the policy's own rollouts of the selected prompts:

    L_V = sum_i ( V(x_i) - (1/n) sum_j r(x_i, y_ij) )^2                      (paper, sum over the m prompts)

Departure: `value_loss` divides by the number of prompts (a mean, not a sum), so the learning rate
does not depend on m; the minimiser and the direction of every gradient step are the same.

The baselines the paper compares against live here too: dynamic sampling (DAPO, Yu et al. 2025,
arXiv 2503.14476: roll out all candidates and keep the groups with mixed rewards) needs
`has_mixed_rewards`; plain GRPO and pre-filtering need nothing beyond it.
"""
from __future__ import annotations

import torch


def select_closest_to_target(values: torch.Tensor | list[float], count: int, target: float = 0.5) -> list[int]:
    """Indices of the `count` values closest to `target` (|v - target| ascending), in candidate order.

    Ties are broken by candidate position: of two equally distant candidates the earlier one wins,
    so the selection is a deterministic function of (values, count, target). With fewer than `count`
    candidates, all of them are returned."""
    distance = (torch.as_tensor(values, dtype=torch.float64).flatten() - target).abs()
    if count >= distance.numel():
        return list(range(distance.numel()))
    # A stable sort on the distance keeps candidate order among ties.
    order = torch.sort(distance, stable=True).indices[:count]
    return sorted(order.tolist())


def value_targets(rewards: list[list[float]]) -> torch.Tensor:
    """[m] the mean reward of each prompt's n samples: the regression target of V (paper: (1/n) sum_j r)."""
    if any(len(r) == 0 for r in rewards):
        raise ValueError("every prompt needs at least one scored sample to give a value target")
    return torch.tensor([sum(r) / len(r) for r in rewards], dtype=torch.float32)


def value_loss(predictions: torch.Tensor, targets: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """sum_i (V(x_i) - target_i)^2 / normalizer; normalizer defaults to the number of prompts (a mean).

    Pass the global prompt count as `normalizer` when `predictions` is one micro-batch of a larger
    batch: the shares of all micro-batches then sum to the global loss (the trainer's loss-hook contract)."""
    if predictions.shape != targets.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} and targets {tuple(targets.shape)} differ in shape")
    normalizer = float(predictions.numel()) if normalizer is None else float(normalizer)
    dtype = torch.promote_types(predictions.dtype, torch.float32)  # bf16 predictions are squared in fp32
    return (predictions.to(dtype) - targets.to(dtype)).pow(2).sum() / max(normalizer, 1.0)


def explained_variance(predictions: torch.Tensor | list[float], observed: torch.Tensor | list[float]) -> float:
    """1 - Var(observed - predicted) / Var(observed): 1 is perfect, 0 is no better than the mean, and
    negative is worse. NaN when the observations have no variance (nothing to explain)."""
    pred = torch.as_tensor(predictions, dtype=torch.float64).flatten()
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    if obs.numel() < 2 or float(obs.var(unbiased=False)) == 0.0:
        return float("nan")
    return 1.0 - float((obs - pred).var(unbiased=False) / obs.var(unbiased=False))


def has_mixed_rewards(rewards: list[float]) -> bool:
    """True when a group's rewards are not all equal: its group-relative advantages are not all zero
    (DAPO's dynamic-sampling criterion, 0 < accuracy < 1 for 0/1 rewards)."""
    return len(rewards) > 1 and max(rewards) != min(rewards)
