"""Scored groups -> the trainer's `TrainBatch` (advantages, behaviour log-probs, staleness)."""
from __future__ import annotations

import dataclasses

import torch

from megatron_rl.algorithms.advantages import compute_advantages, overlong_penalty, token_advantages, token_rewards
from megatron_rl.algorithms.config import AdvantageConfig, OverlongConfig
from megatron_rl.controller.episodes import BASELINE_ROLE, Group
from megatron_rl.types import TrainBatch

FP8_TOKEN_MULTIPLE = 16
"""Token alignment of a micro-batch for Transformer Engine FP8 GEMMs (TE 2.x,
transformer_engine/pytorch/utils.py `assert_dim_for_fp8_exec`): the forward GEMM needs the product of
an input's leading dims (batch x sequence) divisible by 8, and the weight-gradient GEMM reads the input
transposed, tokens last, which must be divisible by 16. Sequences are padded to a multiple of 16, which
holds for any micro-batch size (micro_batch_size 1 included)."""


@dataclasses.dataclass
class StepBatch:
    """A training step's batch and the rollout statistics computed while building it."""

    batch: TrainBatch | None
    """Rows to train on (None when every group was uninformative), padded to the micro-batch size."""
    full_loss_mask: torch.Tensor
    """[N, S] loss mask of ALL samples before uninformative groups were dropped: the loss normaliser
    is computed over it, so dropping zero-advantage rows leaves the gradient unchanged."""
    metrics: dict[str, float]
    """rollout/* metrics: rewards, accuracy, lengths, staleness, reward errors."""


def build_step_batch(groups: list[Group], *, advantage: AdvantageConfig, trainer_version: int,
                     micro_batch_size: int, pad_token_id: int, drop_uninformative: bool,
                     token_multiple: int = 1, overlong: OverlongConfig | None = None,
                     max_new_tokens: int = 0) -> StepBatch:
    """`token_multiple`: FP8_TOKEN_MULTIPLE when the trainer runs FP8 GEMMs; the batch and every
    micro-batch the trainer trims from it then keep whole multiples of it in columns (TrainBatch).
    `overlong` (with the response budget `max_new_tokens`): DAPO's length penalty on the rewards before the
    advantages, and truncated responses out of the loss (their rewards still count in their group).
    With `advantage.estimator: gae` the batch's advantages are each row's (shaped) reward on its last
    response token, for the actor-critic objective to turn into GAE advantages with its critic's values."""
    samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples if s.reward.ok and s.role != BASELINE_ROLE]
    rewards = torch.tensor([s.reward.reward for _, s in samples], dtype=torch.float64)
    baselines = group_baselines(groups)
    response_lengths = torch.tensor([len(s.completion.output_ids) for _, s in samples], dtype=torch.float64)
    overlong = overlong or OverlongConfig()
    shaped = rewards + overlong_penalty(response_lengths, max_new_tokens, overlong.buffer_tokens, overlong.penalty)
    group_ids = torch.tensor([gi for gi, _ in samples])
    if advantage.estimator == "gae":
        advantages = shaped.float()
    else:
        baseline = torch.tensor([baselines.get(gi, float("nan")) for gi, _ in samples], dtype=torch.float64)
        advantages = (compute_advantages(shaped, group_ids, advantage, lengths=response_lengths,
                                         baselines=baseline).float() if samples else torch.zeros(0))

    lengths = [len(s.completion.prompt_ids) + len(s.completion.output_ids) for _, s in samples]
    width = max(lengths, default=2)
    rows = len(samples)
    tokens = torch.full((rows, width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    behaviour = torch.zeros(rows, width)
    for r, (_, sample) in enumerate(samples):
        c = sample.completion
        p, n = len(c.prompt_ids), len(c.output_ids)
        tokens[r, :p + n] = torch.tensor(c.prompt_ids + c.output_ids)
        loss_mask[r, p:p + n] = 1.0 if c.output_mask is None else torch.tensor(c.output_mask, dtype=torch.float32)
        if overlong.mask_truncated and c.finish_reason == "length":
            loss_mask[r] = 0.0
        behaviour[r, p:p + n] = torch.tensor(c.output_logprobs, dtype=torch.float32)
    spread = token_rewards if advantage.estimator == "gae" else token_advantages
    token_adv = spread(advantages, loss_mask).float() if rows else torch.zeros(0, width)
    routed = routing_records([s.completion for _, s in samples], width)

    keep = torch.ones(rows, dtype=torch.bool)
    if drop_uninformative:
        for gi in set(group_ids.tolist()):
            members = group_ids == gi
            if torch.all(advantages[members] == 0):
                keep &= ~members
    kept = int(keep.sum())
    batch = None
    if kept:
        padded = -(-kept // micro_batch_size) * micro_batch_size
        # longest rows first: each micro-batch is trimmed to its own longest row (MegatronTrainer.train_step)
        index = sorted(keep.nonzero().flatten().tolist(), key=lambda r: -lengths[r])
        pad_rows = padded - kept

        def take(t: torch.Tensor, fill: float) -> torch.Tensor:
            extra = torch.full((pad_rows, width), fill, dtype=t.dtype)
            return torch.cat([t[index], extra])

        if routed is not None:  # padding rows have no record
            routed = torch.cat([routed[index], routed.new_full((pad_rows, *routed.shape[1:]), -1)])
        batch = TrainBatch(tokens=take(tokens, pad_token_id), loss_mask=take(loss_mask, 0.0),
                           advantages=take(token_adv, 0.0), behaviour_logprobs=take(behaviour, 0.0),
                           routed_experts=routed, token_multiple=token_multiple).token_aligned()

    metrics = rollout_metrics(groups, rewards, advantages, trainer_version, kept)
    if overlong.buffer_tokens > 0:
        metrics["rollout/overlong_penalty_mean"] = float((shaped - rewards).mean()) if len(samples) else 0.0
    return StepBatch(batch, loss_mask, metrics)


def group_baselines(groups: list[Group]) -> dict[int, float]:
    """Group index -> the reward of its baseline response (ReMax's greedy one), for groups that have one
    scored without error."""
    return {gi: s.reward.reward for gi, g in enumerate(groups) for s in g.samples
            if s.role == BASELINE_ROLE and s.reward.ok}


def routing_records(completions: list, width: int) -> torch.Tensor | None:
    """[N, width, layers, top_k] int64 MoE routing records of the completions' tokens (`Completion.routed_experts`;
    -1 where a row has none), or None when no completion carries one (dense models, recording off)."""
    records = [c.routed_experts for c in completions]
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(records), width, *first.shape[1:]), -1, dtype=torch.long)
    for row, (completion, record) in enumerate(zip(completions, records)):
        if record is None:
            continue
        if record.dim() != 3 or record.shape[1:] != first.shape[1:]:
            raise ValueError(f"completion {completion.request_id!r}: routed_experts has shape {tuple(record.shape)}, "
                             f"expected [positions, {first.shape[1]}, {first.shape[2]}]")
        n = min(record.shape[0], width)
        out[row, :n] = record[:n].long()
    return out


def rollout_metrics(groups: list[Group], rewards: torch.Tensor, advantages: torch.Tensor, trainer_version: int,
                    trained_samples: int) -> dict[str, float]:
    """rollout/* metrics of a step: `rewards` and `advantages` [N] of the samples whose reward is ok."""
    rows = rewards.numel()
    kept = trained_samples
    all_samples = [s for g in groups for s in g.samples if s.role != BASELINE_ROLE]
    ok = [s for s in all_samples if s.reward.ok]
    response_lengths = torch.tensor([len(s.completion.output_ids) for s in all_samples], dtype=torch.float32)
    staleness = torch.tensor([trainer_version - s.completion.weight_version for s in all_samples], dtype=torch.float32)
    truncated = sum(s.completion.finish_reason == "length" for s in all_samples)
    metrics = {
        "rollout/reward_mean": float(rewards.mean()) if rows else 0.0,
        "rollout/reward_std": float(rewards.std()) if rows > 1 else 0.0,
        "rollout/accuracy": sum(bool(s.reward.correct) for s in ok) / max(len(ok), 1),
        "rollout/response_length_mean": float(response_lengths.mean()) if len(all_samples) else 0.0,
        "rollout/response_length_max": float(response_lengths.max()) if len(all_samples) else 0.0,
        "rollout/truncated_fraction": truncated / max(len(all_samples), 1),
        "rollout/effective_ratio": float((advantages != 0).float().mean()) if rows else 0.0,
        "rollout/trained_samples": float(kept),
        "rollout/reward_errors": float(len(all_samples) - len(ok)),
        "rollout/staleness_mean": float(staleness.mean()) if len(all_samples) else 0.0,
        "rollout/staleness_max": float(staleness.max()) if len(all_samples) else 0.0,
        "rollout/response_tokens": float(response_lengths.sum()),
    }
    terms: dict[str, list[float]] = {}
    for sample in ok:  # a weighted sum's terms, each averaged over the samples that have it
        for name, value in (sample.reward.terms or {}).items():
            terms.setdefault(name, []).append(value)
    metrics.update({f"rollout/reward_term/{name}": sum(values) / len(values) for name, values in terms.items()})
    return metrics
