"""Policy-gradient losses: pure functions of token-aligned log-probs, one signature, chosen by name.

Every loss in `LOSSES` (algorithms/config.py's registry) has the signature

    loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
         reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None) -> (loss, metrics)

with all tensors `[B, S]` and token-aligned like `TrainBatch` (entry [b, t] is token t of row b):
`logprobs` = log pi_theta (with grad, from the trainer), `behaviour_logprobs` = log mu (from the rollout
engine that sampled the tokens), `advantages` = per-token advantage (usually the sequence advantage
broadcast by `token_advantages`), `mask` = 1 on response tokens that enter the loss.

The normaliser. `loss` is this micro-batch's *share of the global loss*: sums over its tokens (or
sequences) divided by `normalizer`, a number computed once over the whole global batch (all
micro-batches, all data-parallel ranks) by `compute_normalizer`:

- `token_mean`   (DAPO token-level loss, Yu et al. 2025, arXiv 2503.14476):
      L = sum_{b,t} m_bt l_bt / N_tokens                         normalizer = global count of loss tokens
- `seq_mean`     (GRPO as written, Shao et al. 2024; PCL's "token-level ratio averaged per sequence"):
      L = sum_b [ sum_t m_bt l_bt / |y_b| ] / N_seq              normalizer = global count of rows with >= 1 loss token
- `seq_sum_norm` (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783: a constant length normaliser):
      L = sum_{b,t} m_bt l_bt / (N_seq * max_response_tokens)    normalizer = N_seq * config.max_response_tokens

Summing the shares of any split of the global batch into micro-batches gives the global loss (tested),
which is what the trainer's loss hook requires. The KL and entropy terms are aggregated the same way.

`rollout_weights` (algorithms/rollout_correction.py, when `algorithm.rollout_correction` is on) are
detached per-token weights that multiply the policy-gradient terms (not the KL and entropy terms), as verl
applies its rollout-correction weights; a user loss that does not take the keyword cannot be combined with
rollout correction weights (refused when the loss hook is made).

Metrics are detached scalar means over this micro-batch's loss tokens (the trainer averages them over
micro-batches): importance weight pi/mu mean/max/min at token level and (as the geometric mean over each
sequence) at sequence level, clip fraction, mismatch |log pi - log mu|, approx_kl (k3 estimate of
KL(mu || pi)), kl_ref, entropy, and the per-token loss terms.

Numerics: log pi - log mu is clamped to +-`config.log_ratio_clamp` before exp (as verl does) and
masked positions are zeroed before any arithmetic so padding can never produce inf/NaN gradients.
"""
from __future__ import annotations

import inspect
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_rl.algorithms.config import LOSSES, LossConfig, RolloutCorrectionConfig
from megatron_rl.algorithms.rollout_correction import rollout_correction


class PolicyLoss(Protocol):
    def __call__(self, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, config: LossConfig, normalizer: float, *,
                 reference_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                 proximal_logprobs: torch.Tensor | None = None, rollout_weights: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


# --- normaliser ---------------------------------------------------------------------------------------

def compute_normalizer(loss_mask: torch.Tensor | list[torch.Tensor], config: LossConfig, *,
                       group=None) -> float:
    """The global normaliser for `config.aggregation` (see the module docstring).

    `loss_mask` is the whole global batch's `[B, S]` mask, or a list of its pieces (micro-batches or
    rows of different lengths). With a torch.distributed `group`, each rank passes its own rows and the
    counts are summed over the group. Never 0 (an empty batch gives 1, so the loss is 0, not NaN).
    """
    masks = loss_mask if isinstance(loss_mask, (list, tuple)) else [loss_mask]
    tokens = sum(float((m != 0).sum()) for m in masks)
    seqs = sum(float(((m != 0).sum(-1) > 0).sum()) for m in masks)
    if group is not None:
        counts = torch.tensor([tokens, seqs], dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        tokens, seqs = counts.tolist()
    if config.aggregation == "token_mean":
        value = tokens
    elif config.aggregation == "seq_mean":
        value = seqs
    else:
        value = seqs * config.max_response_tokens
    return max(value, 1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig, normalizer: float) -> torch.Tensor:
    """This micro-batch's share: sum of masked per-token terms (per-sequence means for seq_mean) / normalizer."""
    m = (mask != 0).to(per_token.dtype)
    if config.aggregation == "seq_mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / normalizer
    return (per_token * m).sum() / normalizer


# --- shared pieces ----------------------------------------------------------------------------------

# k3 grows like exp(-log pi/ref): one token far less likely under pi than under the reference would make
# the loss (and its gradient) inf. As verl's low_var_kl: the log-ratio is clamped to +-20 before the exp
# and the estimate to [-10, 10] (docs/algorithms.md, section 6).
K3_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by the policy (Schulman 2020); k3
    bounded to [0, K3_MAX]."""
    log_ratio = logprobs - reference_logprobs  # log pi/ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        bounded = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(-bounded) + bounded - 1.0).clamp(-K3_MAX, K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


def _masked_stats(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = m.sum()
    if n == 0:
        zero = x.new_zeros(())
        return zero, zero, zero
    mean = (x * m).sum() / n
    return mean, x.masked_fill(m == 0, float("-inf")).max(), x.masked_fill(m == 0, float("inf")).min()


def _mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)


def _finish(pg_token: torch.Tensor, metrics: dict[str, torch.Tensor], logprobs: torch.Tensor,
            behaviour_logprobs: torch.Tensor | None, mask: torch.Tensor, config: LossConfig, normalizer: float,
            reference_logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
            rollout_weights: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weight the policy-gradient terms by the rollout correction, add KL and entropy terms, aggregate, and
    fill the shared metrics."""
    m = (mask != 0).to(logprobs.dtype)
    if rollout_weights is not None:
        pg_token = pg_token * rollout_weights.to(pg_token.dtype).detach()
    loss = aggregate(pg_token, mask, config, normalizer)
    metrics["pg_loss"] = _mean(pg_token, m)
    if config.kl_coef > 0 and reference_logprobs is None:
        raise ValueError("LossConfig.kl_coef > 0 needs reference_logprobs (a reference model)")
    if reference_logprobs is not None:
        ref = torch.where(m > 0, reference_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
        kl = kl_penalty(logprobs, ref, config.kl_estimator)
        metrics["kl_ref"] = _mean(kl, m)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * aggregate(kl, mask, config, normalizer)
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("LossConfig.entropy_coef > 0 needs per-token entropies (entropy=[B, S])")
    if entropy is not None:
        ent = torch.where(m > 0, entropy.to(logprobs.dtype), torch.zeros_like(logprobs))
        metrics["entropy"] = _mean(ent, m)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(ent, mask, config, normalizer)
    if behaviour_logprobs is not None:
        diff = (logprobs.detach() - behaviour_logprobs.to(logprobs.dtype)) * m
        ratio = torch.exp(diff.clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
        mean, hi, lo = _masked_stats(ratio, m)
        metrics.setdefault("is_weight_mean", mean)
        metrics.setdefault("is_weight_max", hi)
        metrics.setdefault("is_weight_min", lo)
        # the geometric mean of each sequence's ratios (GSPO's sequence ratio); 0 for a micro-batch without
        # loss tokens, as the token statistics (every micro-batch reports the same metrics)
        rows = (m.sum(-1) > 0).to(m.dtype)
        seq_ratio = torch.exp((diff.sum(-1) / m.sum(-1).clamp(min=1)).clamp(-config.log_ratio_clamp,
                                                                            config.log_ratio_clamp))
        metrics["seq_is_weight_mean"], metrics["seq_is_weight_max"], metrics["seq_is_weight_min"] = \
            _masked_stats(seq_ratio, rows)
        metrics["logprob_mismatch"] = _mean(diff.abs(), m)
        # k3 estimate of KL(mu || pi) from tokens sampled by mu: r - 1 - log r with r = pi/mu.
        metrics["approx_kl"] = _mean(ratio - 1.0 - diff, m)
    metrics["response_tokens"] = m.sum()
    metrics["loss"] = loss.detach()
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def _prepare(logprobs, behaviour_logprobs, advantages, mask, *, need_behaviour: bool, name: str):
    if logprobs.shape != mask.shape or advantages.shape != mask.shape:
        raise ValueError(f"{name}: logprobs {tuple(logprobs.shape)}, advantages {tuple(advantages.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [B, S]")
    m = mask != 0
    zero = torch.zeros_like(logprobs)
    logp = torch.where(m, logprobs, zero)
    adv = torch.where(m, advantages.to(logprobs.dtype), zero)
    mu = None
    if behaviour_logprobs is not None:
        if behaviour_logprobs.shape != mask.shape:
            raise ValueError(f"{name}: behaviour_logprobs {tuple(behaviour_logprobs.shape)} must be [B, S]")
        mu = torch.where(m, behaviour_logprobs.to(logprobs.dtype), zero)
    elif need_behaviour:
        raise ValueError(f"{name} needs behaviour_logprobs (the rollout engine's log mu)")
    return logp, mu, adv, m.to(logprobs.dtype)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, config: LossConfig, m: torch.Tensor,
                       metrics: dict[str, torch.Tensor], *, dual_clip: bool = True) -> torch.Tensor:
    """-min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A), optionally dual-clipped; per token."""
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
    loss = -torch.minimum(surr1, surr2)
    metrics["clip_frac"] = _mean((surr2 < surr1).to(m.dtype), m)
    if dual_clip and config.dual_clip_c is not None:
        bound = -config.dual_clip_c * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_frac"] = _mean(dual.to(m.dtype), m)
    return loss


# --- the losses ---------------------------------------------------------------------------------------

def register_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under `name` (selectable as `LossConfig.name`; a name taken
    is refused). The built-ins below are listed in `LOSSES` by path, so configs name them without torch."""
    return LOSSES.register(name)


def get_loss(name: str) -> PolicyLoss:
    """A registered loss, a built-in, or a user loss 'package.module:function'."""
    return LOSSES.resolve(name)


def pg_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
            reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """Vanilla on-policy policy gradient (REINFORCE, Williams 1992): l_t = -A_t log pi(y_t).

    No importance correction: correct only when the samples come from pi_theta itself. The value is not
    a meaningful objective, its gradient is. Behaviour log-probs, when given, feed only the metrics.
    Normaliser: `config.aggregation` (module docstring)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=False, name="pg")
    return _finish(-adv * logp, {}, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def ppo_clip_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
                  reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), old policy = behaviour policy mu:

        r_t = pi(y_t)/mu(y_t),  l_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)

    with asymmetric clipping (DAPO clip-higher, arXiv 2503.14476) and optional dual-clip (Ye et al. 2020,
    arXiv 1912.09729): for A_t < 0, l_t = min(l_t, -c A_t). Normaliser: `config.aggregation`."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True,
                                name="ppo_clip")
    metrics: dict[str, torch.Tensor] = {}
    ratio = torch.exp((logp - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    per_token = _clipped_surrogate(ratio, adv, config, m, metrics)
    return _finish(per_token, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def aipo_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
              reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """AIPO, LlamaRL's asynchronous importance-weighted policy optimisation (Wu et al. 2025,
    arXiv 2505.24034; docs/algorithms.md section 1):

        l_t = -sg[ min(pi(y_t)/mu(y_t), rho) ] * A_t * log pi(y_t)

    The weight is detached (stop-gradient) and clipped from above only, so grad l_t =
    -min(pi/mu, rho) A_t grad log pi. mu's log-probs are the rollout engine's, so the weight absorbs both
    staleness and the inference/training numeric mismatch. Departure: the paper sums over tokens; the
    normaliser here is `config.aggregation` (a positive constant per global batch: same direction).
    `clip_frac` is the fraction of tokens with pi/mu > rho."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="aipo")
    ratio = torch.exp((logp.detach() - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    weight = ratio.clamp(max=config.aipo_rho)
    metrics = {"clip_frac": _mean((ratio > config.aipo_rho).to(m.dtype), m)}
    return _finish(-weight * adv * logp, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def tis_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
             reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """Truncated importance sampling for the rollout/training mismatch (Yao, Liu et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; decoupled PPO, Hilton et al. 2022,
    arXiv 2110.00641, as used by AReaL):

        w_t = min(pi_prox(y_t)/mu(y_t), C)   (detached; tis_mode=mask: w_t = 0 where the ratio > C)
        l_t = w_t * -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t),  r_t = pi(y_t)/pi_prox(y_t)

    pi_prox = `proximal_logprobs` (the trainer's own log-probs of the batch before this update) when
    given; otherwise pi_prox = sg[pi], so r_t = 1 with gradient grad log pi and the loss's gradient equals
    AIPO's with rho = C (and the PPO clip never binds). Normaliser: `config.aggregation`."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="tis")
    lo, hi = -config.log_ratio_clamp, config.log_ratio_clamp
    if proximal_logprobs is None:
        prox = logp.detach()
    else:
        prox = torch.where(m > 0, proximal_logprobs.to(logp.dtype), torch.zeros_like(logp))
    is_ratio = torch.exp((prox - mu).clamp(lo, hi))
    if config.tis_mode == "truncate":
        weight = is_ratio.clamp(max=config.tis_cap)
    else:
        weight = torch.where(is_ratio > config.tis_cap, torch.zeros_like(is_ratio), is_ratio)
    metrics = {"is_clip_frac": _mean((is_ratio > config.tis_cap).to(m.dtype), m)}
    ratio = torch.exp((logp - prox).clamp(lo, hi))
    per_token = weight * _clipped_surrogate(ratio, adv, config, m, metrics)
    return _finish(per_token, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def gspo_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
              reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """GSPO, group sequence policy optimisation (Zheng et al. 2025, arXiv 2507.18071), in its token form:

        s_i = exp( (1/|y_i|) sum_t log pi(y_it)/mu(y_it) )           (the sequence's length-normalised ratio)
        s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]                     (value s_i, gradient s_i grad log pi(y_it))
        l_it = -min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it)

    With per-token advantages this is GSPO-token (the paper's eq. 13); with a sequence advantage and
    `aggregation: seq_mean` (the paper's) its value and gradient equal the sequence objective
    -min(s_i A_i, clip(s_i) A_i) (tested). The paper clips s_i at 3e-4 / 4e-4 (clip_eps_low / _high).
    Departures: other aggregations are allowed (verl's default is token_mean); the log-ratio is clamped to
    +-log_ratio_clamp (verl clamps the combined log-ratio at 10 from above only). No dual clip."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="gspo")
    lengths = m.sum(-1).clamp(min=1)
    seq_log_ratio = ((logp - mu) * m).sum(-1) / lengths
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(log_ratio.clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    metrics: dict[str, torch.Tensor] = {}
    per_token = _clipped_surrogate(ratio, adv, config, m, metrics, dual_clip=False)
    return _finish(per_token, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def cispo_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
               reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, 2025, arXiv 2506.13585, eq. 4):

        l_t = -sg[ clip(pi(y_t)/mu(y_t), 1-eps_low, 1+eps_high) ] * A_t * log pi(y_t)

    The weight is clipped and detached, so no token loses its gradient (PPO's clip drops the gradient of
    clipped tokens, which are often the rare reflective ones). The paper clips the upper side only (a very
    large eps_low). Normaliser: `config.aggregation` (the paper: token_mean)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="cispo")
    ratio = torch.exp((logp.detach() - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    weight = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    metrics = {"clip_frac": _mean((weight != ratio).to(m.dtype), m)}
    return _finish(-weight * adv * logp, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def gmpo_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
              reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673, eq. 5), one term per
    sequence:

        l_i = -A_i * exp( (1/|y_i|) sum_t sgn(A_i) min(sgn(A_i) log r_it, sgn(A_i) clip(log r_it, -eps_low, eps_high)) )

    with r_it = pi/mu and A_i the sequence's mean advantage over its tokens: the geometric mean of the
    token ratios, clipped per token in log space (the paper's wider range is eps = 0.4). Needs
    `aggregation: seq_mean` (checked by LossConfig). Rollout-correction weights enter as their geometric
    mean over the sequence (as verl does). Departure from verl's `geo_mean`: a row without loss tokens does
    not count in the mean (verl's torch.mean over rows counts it as 0)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="gmpo")
    lengths = m.sum(-1).clamp(min=1)
    log_ratio = (logp - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    sign = torch.sign(adv)
    clipped = log_ratio.clamp(-config.clip_eps_low, config.clip_eps_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp((kept * m).sum(-1) / lengths)
    seq_adv = (adv * m).sum(-1) / lengths
    per_seq = -seq_adv * seq_ratio
    if rollout_weights is not None:
        per_seq = per_seq * torch.exp((torch.log(rollout_weights.to(logp.dtype).detach() + 1e-10) * m).sum(-1) / lengths)
    out_of_range = (log_ratio != clipped).to(m.dtype)
    metrics = {"clip_frac": _mean(out_of_range * (adv > 0), m), "clip_frac_lower": _mean(out_of_range * (adv < 0), m)}
    # one term per sequence, on each of its tokens: seq_mean aggregation gives back per_seq
    return _finish(per_seq[:, None] * m, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy)


def sapo_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
              reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """SAPO, soft adaptive policy optimisation (Gao et al., Qwen 2025, arXiv 2511.20347): a smooth gate in
    place of the hard clip,

        l_t = -f(r_t; tau_t) A_t,   f(r; tau) = (4 / tau) * sigmoid(tau (r - 1)),   r_t = pi/mu,

    tau_t = sapo_tau_pos for A_t > 0 and sapo_tau_neg otherwise; f'(1) = 1, so on-policy tokens get the
    plain policy gradient and far-off-policy ones a gradient that decays smoothly instead of vanishing at
    a clip edge. Normaliser: `config.aggregation` (the paper and verl use seq_mean; verl forces it)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True, name="sapo")
    ratio = torch.exp((logp - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    tau = torch.where(adv > 0, torch.full_like(adv, config.sapo_tau_pos), torch.full_like(adv, config.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _finish(-gate * adv, {}, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def _covariance(adv: torch.Tensor, logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-token centred product (A - mean A)(log pi - mean log pi) over this micro-batch's loss tokens."""
    return (adv - _mean(adv, m)) * (logp.detach() - _mean(logp.detach(), m))


def _selection_generator(m: torch.Tensor) -> torch.Generator:
    """clip_cov's random choice among its candidates: a generator seeded by the micro-batch's token count, so
    that a run (and a resumed one) makes the same choices without touching the global RNG."""
    return torch.Generator().manual_seed(0x5EED + int(m.sum()))


def clip_cov_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
                  reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """Clip-Cov (Cui et al. 2025, "The entropy mechanism of RL for reasoning language models",
    arXiv 2505.22617, sec. 4): the PPO clipped surrogate, plus the gradient of a few high-covariance tokens
    detached, which keeps the policy's entropy from collapsing:

        cov_t = (A_t - mean A)(log pi_t - mean log pi)      over this micro-batch's loss tokens
        candidates: tokens not clipped by PPO with clip_cov_lb < cov_t < clip_cov_ub
        detach max(1, floor(cov_ratio * N_tokens)) candidates chosen at random:  l_t = 0 for them

    As the paper's code (and verl's `clip_cov`), the chosen tokens' loss is multiplied by 0. The covariance
    and the choice are per micro-batch; the random choice uses its own seeded generator (`_selection_generator`)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True,
                                name="clip_cov")
    ratio = torch.exp((logp - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    clipped = (surr2 > surr1) & (m > 0)
    cov = _covariance(adv, logp, m).masked_fill((m == 0) | clipped, float("-inf"))
    candidates = torch.nonzero((cov > config.clip_cov_lb) & (cov < config.clip_cov_ub) & (m > 0))
    keep = torch.ones_like(adv)
    if len(candidates):
        chosen = torch.randperm(len(candidates), generator=_selection_generator(m))
        chosen = candidates[chosen[:min(max(int(config.cov_ratio * float(m.sum())), 1), len(candidates))].to(
            candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    metrics = {"clip_frac": _mean(clipped.to(m.dtype), m), "cov_detached_frac": _mean(1.0 - keep, m)}
    return _finish(torch.maximum(surr1, surr2) * keep, metrics, logp, mu, mask, config, normalizer,
                   reference_logprobs, entropy, rollout_weights)


def kl_cov_loss(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
                reference_logprobs=None, entropy=None, proximal_logprobs=None, rollout_weights=None):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 4): the unclipped surrogate -r_t A_t, and on the
    max(1, floor(cov_ratio * N_tokens)) tokens of largest covariance (as in clip_cov) a KL penalty:

        l_t = -r_t A_t + kl_cov_coef * |log pi_t - log mu_t|     for the selected tokens, -r_t A_t otherwise

    Selection per micro-batch, by torch.topk over the loss tokens in row-major order (verl's `kl_cov`)."""
    logp, mu, adv, m = _prepare(logprobs, behaviour_logprobs, advantages, mask, need_behaviour=True,
                                name="kl_cov")
    log_ratio = (logp - mu).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    per_token = -adv * ratio
    valid = (m > 0).reshape(-1)
    selected = torch.zeros_like(valid)
    if valid.any():
        flat_adv, flat_logp = adv.detach().reshape(-1)[valid], logp.detach().reshape(-1)[valid]
        cov = (flat_adv - flat_adv.mean()) * (flat_logp - flat_logp.mean())
        top = torch.topk(cov, max(1, int(len(cov) * config.cov_ratio)), largest=True).indices
        selected[valid.nonzero().flatten()[top]] = True
    selected = selected.reshape(m.shape)
    per_token = torch.where(selected, per_token + config.kl_cov_coef * log_ratio.abs(), per_token)
    metrics = {"cov_penalised_frac": _mean(selected.to(m.dtype), m)}
    return _finish(per_token, metrics, logp, mu, mask, config, normalizer, reference_logprobs, entropy,
                   rollout_weights)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float | None, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's critic loss (Schulman et al. 2017; the clipped form of OpenAI's baselines, TRL and verl's
    `compute_value_loss`), this micro-batch's share of a token-mean over the global batch:

        l_t = 1/2 max( (V_t - R_t)^2, (clip(V_t, V_old,t - c, V_old,t + c) - R_t)^2 )

    `values` V (with grad), `old_values` the critic's values when the advantages were computed, `returns`
    R (GAE's), all [B, S]; `clip` None: the plain squared error. `normalizer`: the global count of loss
    tokens (compute_normalizer with token_mean)."""
    m = (mask != 0).to(values.dtype)
    old = torch.where(m > 0, old_values.to(values.dtype), torch.zeros_like(values))
    target = torch.where(m > 0, returns.to(values.dtype), torch.zeros_like(values))
    v = torch.where(m > 0, values, torch.zeros_like(values))
    plain = (v - target) ** 2
    if clip is None:
        per_token, clipped_frac = plain, torch.zeros((), dtype=values.dtype)
    else:
        bounded = (torch.clamp(v, old - clip, old + clip) - target) ** 2
        per_token = torch.maximum(plain, bounded)
        clipped_frac = _mean((bounded > plain).to(m.dtype), m)
    loss = 0.5 * (per_token * m).sum() / normalizer
    metrics = {"value_loss": _mean(0.5 * per_token, m), "value_clip_frac": clipped_frac,
               "values_mean": _mean(v.detach(), m)}
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, normalizer: float,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward model's pairwise loss (Bradley & Terry 1952; as InstructGPT trains its RM, Ouyang et al. 2022,
    arXiv 2203.02155, eq. 1, and TRL's RewardTrainer), this micro-batch's share of a mean over the global
    batch of pairs:

        l_i = -log sigmoid(r(x_i, y_i^chosen) - r(x_i, y_i^rejected))

    `chosen` and `rejected` [P] the scores of the pairs' two answers (with grad); `normalizer`: the global
    number of pairs. Metrics: the share of pairs ranked right (`accuracy`, a tie counts half) and the mean
    margin r_chosen - r_rejected."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} scores differ in shape")
    dtype = torch.promote_types(chosen.dtype, torch.float32)
    margin = chosen.to(dtype) - rejected.to(dtype)
    loss = -torch.nn.functional.logsigmoid(margin).sum() / max(float(normalizer), 1.0)
    right = (margin > 0).to(dtype) + 0.5 * (margin == 0).to(dtype)
    metrics = {"accuracy": right.mean() if margin.numel() else margin.new_zeros(()),
               "margin": margin.detach().mean() if margin.numel() else margin.new_zeros(())}
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                mask: torch.Tensor, config: LossConfig, normalizer: float, **kwargs,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch to the loss `config.name` names."""
    return get_loss(config.name)(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, **kwargs)


def make_loss_fn(config: LossConfig, normalizer: float, correction: RolloutCorrectionConfig | None = None):
    """The trainer's loss hook `loss_fn(logprobs, micro_batch, entropy) -> (loss, metrics)` for one global batch.

    `normalizer` comes from `compute_normalizer(global_batch.loss_mask, config)` (or per-rank masks and
    the data-parallel group): compute it once per optimizer step, before splitting into micro-batches.
    `correction`: rollout correction weights and rejection (algorithms/rollout_correction.py), computed per
    micro-batch from this forward's (detached) log-probs and the behaviour log-probs; rejected tokens leave
    the loss but stay in the normaliser, which was fixed before the forward."""
    loss = get_loss(config.name)
    correct = correction is not None and correction.active
    if correct and correction.weights != "none" and "rollout_weights" not in inspect.signature(loss).parameters:
        raise ValueError(f"loss {config.name!r} takes no rollout_weights keyword: it cannot be combined with "
                         f"algorithm.rollout_correction.weights {correction.weights!r}")

    def loss_fn(logprobs: torch.Tensor, micro_batch, entropy: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if micro_batch.advantages is None:
            raise ValueError("TrainBatch.advantages is None: compute advantages before training")
        mask, extra, correction_metrics = micro_batch.loss_mask, {}, {}
        if correct:
            if micro_batch.behaviour_logprobs is None:
                raise ValueError("algorithm.rollout_correction needs the engine's behaviour log-probs")
            weights, mask, correction_metrics = rollout_correction(logprobs, micro_batch.behaviour_logprobs,
                                                                   micro_batch.loss_mask, correction)
            if weights is not None:
                extra["rollout_weights"] = weights
        value, metrics = loss(logprobs, micro_batch.behaviour_logprobs, micro_batch.advantages, mask, config,
                              normalizer, reference_logprobs=micro_batch.reference_logprobs, entropy=entropy,
                              **extra)
        metrics.update({k: v.detach().float() for k, v in correction_metrics.items()})
        return value, metrics

    return loss_fn
