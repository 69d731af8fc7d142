"""Advantage estimators: pure functions from sequence rewards (and their prompt groups) to advantages.

Inputs are either flat rewards `[N]` with `group_ids` (one id per sample; samples of the same prompt
share an id, in any order), or a `[G, n]` tensor whose rows are the groups (then `group_ids` is None).
The output has the shape of `rewards`. A group of one sample has no baseline to compare against and
gets advantage 0 from the group-relative estimators (it carries no learning signal).

`token_advantages` broadcasts sequence advantages onto the response tokens of a token-aligned batch.

`compute_advantages` dispatches by `AdvantageConfig.estimator` through algorithms/config.py's
ADVANTAGE_ESTIMATORS registry; a user estimator is `fn(rewards, group_ids, config) -> advantages` with
the inputs above, `config` the AdvantageConfig, and returns a tensor of rewards' shape (checked). An
estimator that also declares a `lengths` parameter receives the response lengths in tokens (rewards' shape).

`overlong_penalty` is DAPO's soft length shaping of the rewards (applied before any estimator).
"""
from __future__ import annotations

import inspect
from typing import Hashable, Sequence

import torch

from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS, AdvantageConfig


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Dense group index `[N]` int64 (0 .. G-1, in order of first appearance) for arbitrary group ids."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def _flatten(rewards: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.double()
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards of shape {tuple(rewards.shape)} need group_ids (or pass a [G, n] tensor)")
        g, n = rewards.shape
        return rewards.reshape(-1), torch.arange(g).repeat_interleave(n)
    if rewards.dim() != 1:
        raise ValueError(f"with group_ids, rewards must be [N], got shape {tuple(rewards.shape)}")
    index = group_index(group_ids)
    if index.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {index.numel()} group ids")
    return rewards, index


def _group_stats(r: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group sum and group sum of squares (each [N])."""
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=r.dtype).index_add_(0, index, torch.ones_like(r))
    total = torch.zeros(groups, dtype=r.dtype).index_add_(0, index, r)
    return count[index], total[index], index


def grpo_advantages(rewards: torch.Tensor, group_ids=None, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantage (Shao et al., DeepSeekMath, 2024, arXiv 2402.03300, sec. 4.1.2):

        A_i = (r_i - mean_g r) / (std_g r + eps)

    std is the unbiased (Bessel-corrected) standard deviation of the group's rewards, as in TRL and verl.
    `scale_by_std=False` gives A_i = r_i - mean_g r: Dr.GRPO (Liu et al., 2025, arXiv 2503.20783), the
    advantage of LlamaRL's AIPO (arXiv 2505.24034) and PCL (arXiv 2510.01135). Groups of one sample get 0.
    """
    r, index = _flatten(rewards, group_ids)
    count, total, _ = _group_stats(r, index)
    mean = total / count
    centred = r - mean
    if scale_by_std:
        groups = int(index.max()) + 1 if index.numel() else 0
        sq = torch.zeros(groups, dtype=r.dtype).index_add_(0, index, centred * centred)[index]
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        centred = centred / (std + eps)
    centred = torch.where(count > 1, centred, torch.zeros_like(centred))
    return centred.reshape(torch.as_tensor(rewards).shape)


def rloo_advantages(rewards: torch.Tensor, group_ids=None) -> torch.Tensor:
    """RLOO leave-one-out advantage (Kool et al., 2019, "Buy 4 REINFORCE samples, get a baseline for
    free!"; Ahmadian et al., 2024, arXiv 2402.14740):

        A_i = r_i - 1/(n-1) sum_{j != i} r_j  =  n/(n-1) (r_i - mean_g r)

    Groups of one sample get 0.
    """
    r, index = _flatten(rewards, group_ids)
    count, total, _ = _group_stats(r, index)
    baseline = (total - r) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, r - baseline, torch.zeros_like(r))
    return adv.reshape(torch.as_tensor(rewards).shape)


def reinforce_pp_advantages(rewards: torch.Tensor, group_ids=None, *, group_baseline: bool = False,
                            eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ batch-normalised advantage (Hu, 2025, arXiv 2501.03262):

        A_i = (r_i - mean_batch r) / (std_batch r + eps)

    (the paper's per-token KL-shaped return reduces to r_i for a sequence reward and no KL in the reward).
    `group_baseline=True` is its "REINFORCE++-baseline" variant: subtract the group mean first, then
    normalise by the batch std of the centred rewards. std is unbiased; a batch of one sample gets 0.
    """
    r, index = _flatten(rewards, group_ids)
    if group_baseline:
        count, total, _ = _group_stats(r, index)
        r = r - total / count
    if r.numel() < 2:
        return torch.zeros_like(r).reshape(torch.as_tensor(rewards).shape)
    adv = (r - r.mean()) / (r.std(unbiased=True) + eps)
    return adv.reshape(torch.as_tensor(rewards).shape)


def token_advantages(sequence_advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast sequence advantages `[B]` onto response tokens: `[B, S]` = A_b on tokens where
    `loss_mask` is 1, and 0 elsewhere (the `TrainBatch.advantages` layout)."""
    if sequence_advantages.dim() != 1 or sequence_advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"sequence advantages {tuple(sequence_advantages.shape)} do not match "
                         f"loss_mask rows {tuple(loss_mask.shape)}")
    adv = sequence_advantages.to(loss_mask.dtype if loss_mask.is_floating_point() else torch.float32)
    return adv[:, None] * (loss_mask != 0).to(adv.dtype)


def grpo_passk_advantages(rewards: torch.Tensor, group_ids=None, *, scale_by_std: bool = True,
                          eps: float = 1e-6) -> torch.Tensor:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595; verl's `grpo_passk`): only the best sample of
    each group is reinforced, by how much it beats the second best,

        A_best = (r_max - r_second) / (std_g r + eps),   A_i = 0 for the others,

    so the policy is rewarded for one good sample among k rather than for the average. The best is the
    first maximum in sample order (torch.topk's choice); std is unbiased; `scale_by_std=False` drops it.
    Groups of one sample get 0 (verl refuses them)."""
    r, index = _flatten(rewards, group_ids)
    advantages = torch.zeros_like(r)
    for group in range(int(index.max()) + 1 if index.numel() else 0):
        members = (index == group).nonzero().flatten()
        if len(members) < 2:
            continue
        scores = r[members]
        top, where = torch.topk(scores, 2)
        gap = top[0] - top[1]
        advantages[members[where[0]]] = gap / (scores.std() + eps) if scale_by_std else gap
    return advantages.reshape(torch.as_tensor(rewards).shape)


def opo_advantages(rewards: torch.Tensor, group_ids=None, *, lengths: torch.Tensor) -> torch.Tensor:
    """OPO, on-policy RL with the optimal reward baseline (Hao et al. 2025, arXiv 2505.23585): the baseline
    that minimises the gradient variance for sequence rewards is the length-weighted mean of the group,

        A_i = r_i - sum_j |y_j| r_j / sum_j |y_j|

    `lengths` are the response lengths in tokens. Groups of one sample get 0 (verl's `opo` gives them r_i)."""
    r, index = _flatten(rewards, group_ids)
    lengths = torch.as_tensor(lengths, dtype=r.dtype).reshape(-1)
    if lengths.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {lengths.numel()} lengths")
    groups = int(index.max()) + 1 if index.numel() else 0
    weighted = torch.zeros(groups, dtype=r.dtype).index_add_(0, index, lengths * r)[index]
    total = torch.zeros(groups, dtype=r.dtype).index_add_(0, index, lengths)[index]
    count, _, _ = _group_stats(r, index)
    adv = torch.where(count > 1, r - weighted / total.clamp(min=1), torch.zeros_like(r))
    return adv.reshape(torch.as_tensor(rewards).shape)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                   lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438) over the token steps of
    each row, the positions where `mask` is 1 (all [B, S]):

        delta_t = r_t + gamma V_next(t) - V_t,   A_t = delta_t + gamma lam A_next(t),   R_t = A_t + V_t

    where next(t) is the row's next position with mask 1 (V and A are 0 past the last): positions with
    mask 0 (the prompt, padding, an agent's tool output between turns) are not steps and pass V and A
    through unchanged, as verl's `compute_gae_advantage_return` does. Returns (advantages, returns);
    `whiten` standardises the advantages over the masked positions of the whole batch (mean 0, unbiased
    variance 1, as verl and OpenRLHF do). Nothing here has a gradient."""
    if not (token_rewards.shape == values.shape == mask.shape):
        raise ValueError(f"GAE needs rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
                         f"mask {tuple(mask.shape)} of one [B, S] shape")
    m = (mask != 0).to(values.dtype)
    rewards, values = token_rewards.to(values.dtype), values.detach()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        running = torch.where(m[:, t] > 0, step, running)
        advantages[:, t] = running
    returns = (advantages + values) * m
    if whiten:
        count = m.sum()
        if count < 2:
            raise ValueError("GAE's whitening needs at least 2 loss tokens in the batch")
        mean = (advantages * m).sum() / count
        variance = (((advantages - mean) ** 2) * m).sum() / count * count / (count - 1)
        advantages = (advantages - mean) * torch.rsqrt(variance + 1e-8)
    return advantages * m, returns


def token_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S]: each row's sequence reward on its last position with mask 1, 0 elsewhere (an outcome
    reward as the per-token rewards of GAE)."""
    m = (mask != 0)
    has = m.any(-1)
    last = m.shape[1] - 1 - m.flip(-1).to(torch.int8).argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float64 if not sequence_rewards.is_floating_point()
                      else sequence_rewards.dtype)
    rows = has.nonzero().flatten()
    out[rows, last[rows]] = sequence_rewards[rows].to(out.dtype)
    return out


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to the rewards:

        R_length(L) = 0                                   if L <= L_max - L_cache
                    = (L_max - L_cache - L) / L_cache     if L_max - L_cache < L <= L_max
                    = -1                                  if L > L_max

    times `penalty`, with L_max = `max_tokens` (the response budget) and L_cache = `buffer_tokens` (0: no
    penalty). Equal to verl's DAPO reward manager for L <= L_max, the only lengths an engine returns."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if buffer_tokens <= 0:
        return torch.zeros_like(lengths)
    shaped = ((max_tokens - buffer_tokens) - lengths) / buffer_tokens
    return penalty * shaped.clamp(min=-1.0, max=0.0)


# The estimators as algorithms/config.py's ADVANTAGE_ESTIMATORS calls them: (rewards, group_ids, config).

def grpo_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig) -> torch.Tensor:
    return grpo_advantages(rewards, group_ids, scale_by_std=config.scale_by_std, eps=config.eps)


def rloo_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig) -> torch.Tensor:
    return rloo_advantages(rewards, group_ids)


def reinforce_pp_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, group_ids, group_baseline=config.group_baseline, eps=config.eps)


def grpo_passk_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig) -> torch.Tensor:
    return grpo_passk_advantages(rewards, group_ids, scale_by_std=config.scale_by_std, eps=config.eps)


def opo_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig, *, lengths) -> torch.Tensor:
    if lengths is None:
        raise ValueError("advantage estimator opo needs the response lengths")
    return opo_advantages(rewards, group_ids, lengths=lengths)


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2024, arXiv 2310.10505): REINFORCE with the reward of the greedy response to the same
    prompt as the baseline, A_i = r_i - r(greedy). One greedy generation per prompt replaces a critic. A
    sample whose group has no baseline (NaN: the greedy response's reward failed) gets 0."""
    rewards = torch.as_tensor(rewards)
    baselines = torch.as_tensor(baselines, dtype=rewards.dtype if rewards.is_floating_point() else torch.float64)
    if baselines.shape != rewards.shape:
        raise ValueError(f"{rewards.numel()} rewards but baselines of shape {tuple(baselines.shape)}")
    return torch.where(torch.isnan(baselines), torch.zeros_like(baselines), rewards - baselines)


def remax_estimator(rewards: torch.Tensor, group_ids, config: AdvantageConfig, *, baselines) -> torch.Tensor:
    if baselines is None:
        raise ValueError("advantage estimator remax needs each sample's baseline reward (its greedy response's)")
    return remax_advantages(rewards, baselines)


def compute_advantages(rewards: torch.Tensor, group_ids=None, config: AdvantageConfig | None = None, *,
                       lengths: torch.Tensor | None = None, baselines: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence advantages with the estimator `config` names (default GRPO); same shape as `rewards`.
    `lengths`: response lengths in tokens, for estimators that declare a `lengths` parameter (opo);
    `baselines`: each sample's baseline reward (NaN: none), for those that declare `baselines` (remax)."""
    config = config or AdvantageConfig()
    estimator = ADVANTAGE_ESTIMATORS.resolve(config.estimator)
    declared = inspect.signature(estimator).parameters
    extra = {name: value for name, value in (("lengths", lengths), ("baselines", baselines)) if name in declared}
    advantages = estimator(rewards, group_ids, config, **extra)
    if not isinstance(advantages, torch.Tensor) or advantages.shape != rewards.shape:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"advantage estimator {config.estimator!r} returned {got}, "
                         f"not a tensor of the rewards' shape {tuple(rewards.shape)}")
    return advantages
