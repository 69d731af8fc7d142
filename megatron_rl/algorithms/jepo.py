"""JEPO: Jensen's evidence lower bound policy optimisation (Tang, Wang, Madaan, Munos 2025, arXiv 2503.19618;
docs/algorithms.md section 7), its "combined" variant with a verifier, and the SFT baseline on the same rows.

The chain of thought c is a latent variable; the policy is trained to raise a lower bound of
log pi(a* | x), a* the reference answer (long-form: a worked solution, a proof). With
l_i = log pi(a* | x, c_i) summed over the reference's tokens and c_1..c_n ~ pi( . | x):

    Jensen bound       L_1 = E[ l ]                              grad = E[ l grad log pi(c) + grad l ]
    multi-sample bound L_n = E[ log (1/n) sum_i exp(l_i) ]       (tighter, monotone in n)

Per prompt (a group of n samples), the loss is

    loss_g = -(1/n) sum_i A~_i log pi(c_i | x)  -  beta_sup * B_g  (+ kl_coef * sum_t KL_t, entropy term)

    multi:  B_g = logmeanexp_i l_i,  A_i = n * (B_g - logmeanexp_{j != i} l_j)
    jensen: B_g = mean_i l_i,        A_i = l_i - mean_{j != i} l_j        (leave-one-out baseline)

The baselines (logmeanexp / mean over the OTHER samples) do not depend on c_i, so they leave the
expected gradient unchanged: with `normalize_advantages=False`, no clipping and beta_sup = 1 the
expected gradient of loss_g is exactly -grad L_n (tests/test_jepo.py checks it against autograd of the
closed-form bound, enumerated on a tiny model in float64). The factor n in the multi-sample A_i is what
makes that so under the paper's (1/n) sum_i convention; normalisation divides it out again.
A group with a single usable sample has no baseline: its A_i is the bound's own score (n * l_i).

Paper defaults and where this code departs from them:
- A~_i = clip(A_i / std(A), -1, 1). Here std is over the group's usable samples, because each
  micro-batch holds whole groups and the PG term and the bound come from ONE forward pass of the rows
  x + c_i + a* (no separate scoring pass); the paper's batch-wide std would need a no-grad pass first.
  A group whose advantages are all equal (or that has < 2 usable samples) gets A~ = 0 for them.
- A sample without the answer marker has no place to put a*: it gets A~ = format_penalty (-10) on its
  own tokens and is left out of the bound (and out of std(A)). `missing_marker: append` instead appends
  the marker and scores a* after it (a departure for models that seldom write the marker).
- Off-policy correction (asynchronous runs, max_staleness >= 1): the PG term is handed to the
  configured policy loss (AIPO by default), so each token carries the detached weight min(pi/mu, rho);
  the bound term grad B_g is not reweighted (the a* tokens are teacher-forced, not sampled).
- beta (KL to a reference) is `LossConfig.kl_coef` on the c tokens, summed over tokens like the PG term.
- Normaliser: losses are summed over groups and divided by the global number of rows (groups * n),
  i.e. the mean over prompts of loss_g.

Combined mode: a group with at least one sample verified correct uses the verifier (RL) loss
-(1/n) sum_i A_i^RL log pi(y_i | x) on the full generated response (advantages from the configured
estimator, e.g. GRPO), other groups use the JEPO loss. Mode `verifier` uses the verifier loss for every
group (the baseline combined mode is compared against, through the same code path).

SFT: -log pi(a* | x) on rows x + a*, summed over tokens, divided by the global number of rows.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from megatron_rl.algorithms.config import JepoConfig
from megatron_rl.algorithms.losses import get_loss
from megatron_rl.types import TrainBatch

# --- advantages -------------------------------------------------------------------------------------------

def _logmeanexp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log mean_j exp(x_j) over the last dim where mask is True. A row with no selected entry gives a
    finite meaningless value (callers mask it): an all -inf row would put NaN into the backward pass."""
    empty = ~mask.any(-1, keepdim=True)
    filled = torch.where(mask, x, torch.where(empty, torch.zeros_like(x), torch.full_like(x, float("-inf"))))
    count = mask.sum(-1).to(x.dtype)
    return torch.logsumexp(filled, dim=-1) - torch.log(count.clamp(min=1))


def jepo_bound(l: torch.Tensor, valid: torch.Tensor, bound: str) -> torch.Tensor:
    """B_g per group [G] from l [G, n] over the usable samples `valid` [G, n] (differentiable in l).
    A group without usable samples gets 0 (it contributes nothing to the bound)."""
    if bound == "multi":
        value = _logmeanexp(l, valid)
    elif bound == "jensen":
        value = (l * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown JEPO bound {bound!r} (multi, jensen)")
    return torch.where(valid.any(-1), value, torch.zeros_like(value))


def jepo_raw_advantages(l: torch.Tensor, valid: torch.Tensor, bound: str) -> torch.Tensor:
    """Leave-one-out advantages A [G, n] (module docstring) from detached l [G, n]; 0 where not valid."""
    l = l.detach()
    n = l.shape[-1]
    usable = valid.to(l.dtype)
    m = usable.sum(-1, keepdim=True)
    if bound == "multi":
        total = _logmeanexp(l, valid).unsqueeze(-1)
        eye = torch.eye(n, dtype=torch.bool, device=l.device)
        others = valid.unsqueeze(-2) & ~eye  # [G, i, j]: usable j != i
        loo = _logmeanexp(l.unsqueeze(-2).expand(*l.shape[:-1], n, n), others)
        adv = torch.where(m > 1, n * (total - loo), n * l)
    elif bound == "jensen":
        total = (l * usable).sum(-1, keepdim=True)
        loo_mean = (total - l * usable) / (m - 1).clamp(min=1)
        adv = torch.where(m > 1, (n / m.clamp(min=1)) * (l - loo_mean), n * l)
    else:
        raise ValueError(f"unknown JEPO bound {bound!r} (multi, jensen)")
    return torch.where(valid, adv, torch.zeros_like(adv))


def jepo_advantages(l: torch.Tensor, valid: torch.Tensor, config: JepoConfig) -> torch.Tensor:
    """The advantages A~ [G, n] the PG term uses: raw leave-one-out advantages, normalised by their std
    over the group's usable samples, clipped; `format_penalty` for samples that are not usable."""
    adv = jepo_raw_advantages(l, valid, config.bound)
    if config.normalize_advantages:
        usable = valid.to(adv.dtype)
        m = usable.sum(-1, keepdim=True)
        mean = (adv * usable).sum(-1, keepdim=True) / m.clamp(min=1)
        std = torch.sqrt((((adv - mean) * usable) ** 2).sum(-1, keepdim=True) / m.clamp(min=1))
        informative = (m > 1) & (std > 1e-12 * (1 + mean.abs()))
        adv = torch.where(informative, adv / std.clamp(min=1e-30), torch.zeros_like(adv))
    if config.advantage_clip is not None:
        adv = adv.clamp(-config.advantage_clip, config.advantage_clip)
    return torch.where(valid, adv, torch.full_like(adv, config.format_penalty))


# --- the trainer's rows -------------------------------------------------------------------------------------

@dataclasses.dataclass
class JepoTrainBatch(TrainBatch):
    """Rows x + c_i + a* (JEPO groups) or x + y_i (verifier groups), whole groups of `group_size` rows in
    order, so that every micro-batch of a multiple of group_size rows holds complete groups.
    `loss_mask` marks the policy-gradient tokens (c_i, or y_i in verifier groups); `advantages` holds
    the verifier advantages of verifier-group rows (JEPO advantages are computed in the loss)."""

    answer_mask: torch.Tensor | None = None
    """[B, S] float: 1 on the reference a* tokens scored under the policy (l_i = sum of their log-probs);
    all 0 in a row whose sample has no answer marker, in verifier groups and in padding rows."""
    verifier_rows: torch.Tensor | None = None
    """[B] bool: the row belongs to a group trained with the verifier loss (combined / verifier modes)."""
    group_size: int = 1
    """n, rows per group."""

    def loss_positions(self) -> torch.Tensor:
        """The policy-gradient tokens and the scored reference tokens (the bound reads their log-probs)."""
        positions = super().loss_positions()
        return positions if self.answer_mask is None else positions | (self.answer_mask != 0)

    def __post_init__(self) -> None:
        if self.verifier_rows is None:
            self.verifier_rows = torch.zeros(self.tokens.shape[0], dtype=torch.bool)
        if self.verifier_rows.shape != (self.tokens.shape[0],):
            raise ValueError(f"JepoTrainBatch.verifier_rows has shape {tuple(self.verifier_rows.shape)}, "
                             f"expected ({self.tokens.shape[0]},)")
        rows = self.verifier_rows
        self.verifier_rows = None  # the base check compares every tensor field with tokens' [B, S]
        try:
            super().__post_init__()
        finally:
            self.verifier_rows = rows
        if self.tokens.shape[0] % self.group_size:
            raise ValueError(f"JepoTrainBatch of {self.tokens.shape[0]} rows is not whole groups of {self.group_size}")


# --- losses ---------------------------------------------------------------------------------------------

def make_jepo_loss_fn(config: JepoConfig, loss_config, normalizer: float):
    """The trainer's loss hook for JEPO / combined / verifier rows (module docstring). `normalizer` is
    the global number of rows (groups * n). The PG term goes through the registered policy loss
    `loss_config.name` (AIPO by default: the off-policy correction), with token_mean aggregation over
    `normalizer`, which makes it (1/normalizer) sum_i A~_i sum_t (...) -- a sum of sequence terms."""
    pg = get_loss(loss_config.name)
    summed = dataclasses.replace(loss_config, aggregation="token_mean")

    def loss_fn(logprobs: torch.Tensor, micro_batch: JepoTrainBatch, entropy: torch.Tensor | None = None):
        n = micro_batch.group_size
        rows, width = logprobs.shape
        if rows % n:
            raise ValueError(f"JEPO micro-batch of {rows} rows does not hold whole groups of {n} "
                             f"(set trainer.micro_batch_size to a multiple of rollout.samples_per_prompt)")
        answer = micro_batch.answer_mask.to(logprobs.dtype)
        l = (torch.where(answer > 0, logprobs, torch.zeros_like(logprobs))).sum(-1).view(-1, n)
        valid = (answer.sum(-1) > 0).view(-1, n)
        verifier = micro_batch.verifier_rows.view(-1, n)
        jepo_groups = ~verifier
        adv = jepo_advantages(l, valid, config)
        pad = micro_batch.loss_mask.sum(-1).view(-1, n) == 0  # padding rows carry no tokens at all
        seq_adv = torch.where(verifier, torch.zeros_like(adv), adv)
        token_adv = seq_adv.reshape(-1, 1).to(logprobs.dtype) * (micro_batch.loss_mask != 0).to(logprobs.dtype)
        if micro_batch.advantages is not None:
            verifier_tok = verifier.reshape(-1, 1).to(logprobs.dtype)
            token_adv = token_adv + verifier_tok * micro_batch.advantages.to(logprobs.dtype)
        loss, metrics = pg(logprobs, micro_batch.behaviour_logprobs, token_adv, micro_batch.loss_mask, summed,
                           normalizer, reference_logprobs=micro_batch.reference_logprobs, entropy=entropy)
        bound = jepo_bound(l, valid & jepo_groups, config.bound)
        if config.beta_sup > 0:
            loss = loss - config.beta_sup * bound.sum() * n / normalizer  # mean over groups of B_g
        scored = valid & jepo_groups
        groups_scored = scored.any(-1)
        metrics = dict(metrics)
        zero = logprobs.new_zeros(())
        metrics["jepo_bound"] = (bound.detach() * groups_scored).sum() / groups_scored.sum().clamp(min=1) \
            if groups_scored.any() else zero
        metrics["jepo_ref_logprob"] = (l.detach() * scored).sum() / scored.sum().clamp(min=1) if scored.any() else zero
        real = ~pad
        jepo_real = real & jepo_groups
        metrics["jepo_format_ok"] = (valid & jepo_real).sum().to(logprobs.dtype) / jepo_real.sum().clamp(min=1)
        metrics["jepo_verifier_groups"] = (verifier & real).any(-1).sum().to(logprobs.dtype)
        metrics["jepo_adv_abs"] = (adv.detach().abs() * scored).sum() / scored.sum().clamp(min=1) if scored.any() else zero
        metrics["loss"] = loss.detach()
        return loss, {k: v.detach().float() for k, v in metrics.items()}

    return loss_fn


def make_sft_loss_fn(normalizer: float):
    """SFT baseline: -(1/normalizer) sum_rows log pi(a* | x), the reference's tokens summed (`loss_mask`
    marks a*). With normalizer = the number of rows it is the mean sequence NLL of the references."""

    def loss_fn(logprobs: torch.Tensor, micro_batch: TrainBatch, entropy: torch.Tensor | None = None):
        m = (micro_batch.loss_mask != 0).to(logprobs.dtype)
        nll = -(torch.where(m > 0, logprobs, torch.zeros_like(logprobs))).sum(-1)
        loss = nll.sum() / normalizer
        rows = (m.sum(-1) > 0)
        metrics = {"sft_nll_seq": nll.detach().sum() / rows.sum().clamp(min=1),
                   "sft_nll_token": nll.detach().sum() / m.sum().clamp(min=1),
                   "response_tokens": m.sum(), "loss": loss.detach()}
        return loss, {k: v.detach().float() for k, v in metrics.items()}

    return loss_fn


def proxy_nll(l: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Held-out proxy NLL per prompt [G]: -log mean_i pi(a*|x,c_i) over the usable samples (the n-sample
    bound of log pi(a*|x), negated); nan for a prompt with no usable sample."""
    value = -_logmeanexp(l.double(), valid)
    return torch.where(valid.any(-1), value, torch.full_like(value, math.nan))
