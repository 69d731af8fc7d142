"""Configuration of the algorithms, importable without torch: advantage estimators (`algorithm.advantage:`),
policy losses (`algorithm.loss:`), rollout correction (`algorithm.rollout_correction:`), overlong shaping
(`algorithm.overlong:`), the JEPO bound (`algorithm.jepo:`) and WaltzRL's rewards (`waltz.reward:`)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import RECIPE_PATH_FIELD, Registry, require

# The registries of advantages.py and losses.py, here so that a config names their parts without
# importing torch; the built-ins are imported on first use (docs/extending.md).

# fn(rewards [N] or [P, G], group_ids, config: AdvantageConfig) -> advantages, rewards' shape.
ADVANTAGE_ESTIMATORS = Registry("estimator", {
    "grpo": "megatron_rl.algorithms.advantages:grpo_estimator",
    "rloo": "megatron_rl.algorithms.advantages:rloo_estimator",
    "reinforce_pp": "megatron_rl.algorithms.advantages:reinforce_pp_estimator",
    "grpo_passk": "megatron_rl.algorithms.advantages:grpo_passk_estimator",
    "opo": "megatron_rl.algorithms.advantages:opo_estimator",
    "remax": "megatron_rl.algorithms.advantages:remax_estimator",
})
# The `PolicyLoss` signature of losses.py; `losses.register_loss` is LOSSES.register.
LOSSES = Registry("loss", {
    "pg": "megatron_rl.algorithms.losses:pg_loss",
    "ppo_clip": "megatron_rl.algorithms.losses:ppo_clip_loss",
    "aipo": "megatron_rl.algorithms.losses:aipo_loss",
    "tis": "megatron_rl.algorithms.losses:tis_loss",
    "gspo": "megatron_rl.algorithms.losses:gspo_loss",
    "cispo": "megatron_rl.algorithms.losses:cispo_loss",
    "gmpo": "megatron_rl.algorithms.losses:gmpo_loss",
    "sapo": "megatron_rl.algorithms.losses:sapo_loss",
    "clip_cov": "megatron_rl.algorithms.losses:clip_cov_loss",
    "kl_cov": "megatron_rl.algorithms.losses:kl_cov_loss",
})
# Losses whose terms are per sequence, not per token: they need `aggregation: seq_mean`.
SEQUENCE_LEVEL_LOSSES = ("gmpo",)


# Bounds past which a value is a typo rather than a setting: an importance ratio (clip range, cap) of
# 1000 or a loss-term weight of 1000 times the policy loss.
MAX_RATIO = 1000.0
MAX_COEF = 1000.0


@dataclasses.dataclass(kw_only=True)
class AdvantageConfig:
    """How sequence rewards become advantages."""

    estimator: str = "grpo"
    """grpo: (r - group mean) / group std; rloo: r - mean of the other samples of the group;
    reinforce_pp: batch-normalised (r - batch mean) / batch std; grpo_passk: only each group's best sample
    gets an advantage, r_max - r_second (pass@k training); opo: r - the length-weighted group mean (the
    optimal baseline); remax: r - the reward of a greedy response to the same prompt (one extra greedy
    generation per prompt, single-turn runs); gae: generalised advantage estimation with a learned critic (objective ppo only);
    or a user estimator registered with `ADVANTAGE_ESTIMATORS.register` or 'package.module:function'
    (docs/extending.md)."""
    scale_by_std: bool = True
    """grpo and grpo_passk: divide by the group std. False gives r - group mean (Dr.GRPO, AIPO, PCL)."""
    group_baseline: bool = False
    """reinforce_pp only: subtract the group mean before batch normalisation (REINFORCE++-baseline)."""
    eps: float = 1e-6
    """Added to the std in the denominators."""
    gamma: float = 1.0
    """gae only: discount per token (verl and OpenRLHF default: 1.0)."""
    lam: float = 1.0
    """gae only: GAE's lambda (1.0: the Monte-Carlo return minus V; verl's default 1.0, PPO papers 0.95)."""

    def __post_init__(self) -> None:
        # gae is the actor-critic objective's own (objective: ppo): token-level, it needs the critic's values
        ADVANTAGE_ESTIMATORS.check(self.estimator, "estimator", also=("gae",))
        require(0 <= self.eps <= 1, "eps", f"must be in [0, 1], got {self.eps!r}")
        require(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma!r}")
        require(0 <= self.lam <= 1, "lam", f"must be in [0, 1], got {self.lam!r}")


@dataclasses.dataclass(kw_only=True)
class LossConfig:
    """The policy loss: which surrogate, its clipping, the KL / entropy terms and the normalisation."""

    name: str = "aipo"
    """Registered loss: pg (on-policy REINFORCE), ppo_clip, aipo (LlamaRL), tis (truncated IS), gspo
    (sequence-level ratio), cispo (clipped detached IS weight), gmpo (geometric-mean ratio; needs
    aggregation seq_mean), sapo (soft adaptive gates), clip_cov / kl_cov (covariance-selected tokens), or a
    user loss registered with `register_loss` or 'package.module:function' (docs/extending.md;
    docs/algorithms.md has each one's formula)."""
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_norm"] = "token_mean"
    """How per-token terms are summed and normalised over the global batch (see module docstring)."""
    max_response_tokens: int = 0
    """seq_sum_norm only: the constant length L in the normaliser N_seq * L (must be > 0 then)."""
    clip_eps_low: float = 0.2
    """ppo_clip / tis / gspo / cispo / gmpo / clip_cov: lower clip, the ratio is clipped to
    [1 - clip_eps_low, 1 + clip_eps_high] (gmpo: the log-ratio to [-clip_eps_low, clip_eps_high]). GSPO's
    paper uses 3e-4 / 4e-4 on its sequence ratio; CISPO's leaves the lower side open (clip_eps_low near 1)."""
    clip_eps_high: float = 0.2
    """The upper clip, as clip_eps_low (DAPO's clip-higher uses 0.28; CISPO's paper 0.28 and up)."""
    dual_clip_c: float | None = None
    """ppo_clip / tis: dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the loss is at most -c*A. None disables."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for tokens with A > 0 (paper: 1.0)."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for tokens with A <= 0 (paper: 1.05, sharper on negative updates)."""
    cov_ratio: float = 0.0002
    """clip_cov / kl_cov: the share of a micro-batch's loss tokens selected by their covariance of
    log-prob and advantage (Cui et al. 2025: 2e-4; at least one token is selected)."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance in (clip_cov_lb, clip_cov_ub) are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: the candidates' upper bound."""
    kl_cov_coef: float = 1.0
    """kl_cov: weight of the |log pi - log mu| penalty on the selected tokens (Cui et al. 2025: 1; verl's
    ppo_kl_coef)."""
    aipo_rho: float = 4.0
    """aipo: upper clip rho of the detached importance weight min(pi/mu, rho); LlamaRL uses rho in [2, 10]."""
    tis_cap: float = 2.0
    """tis: cap C of the importance weight pi_prox/mu."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """tis: truncate (weight min(w, C)) or mask (tokens with w > C get weight 0, "masked IS")."""
    kl_coef: float = 0.0
    """Coefficient of the KL(pi || pi_ref) penalty in the loss. > 0: the objective keeps a frozen,
    forward-only copy of the starting weights as pi_ref (one extra forward per step); 0: none."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman, "Approximating KL divergence", 2020): k1 = log pi - log ref,
    k2 = (log pi - log ref)^2 / 2, k3 = ref/pi - log(ref/pi) - 1."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (subtracted from the loss); needs per-token entropies."""
    log_ratio_clamp: float = 20.0
    """Clamp of log pi - log mu before exp, for numerical safety."""

    def __post_init__(self) -> None:
        LOSSES.check(self.name, "name")
        require(self.aggregation != "seq_sum_norm" or self.max_response_tokens > 0, "max_response_tokens",
                "must be > 0 with aggregation seq_sum_norm")
        require(self.max_response_tokens >= 0, "max_response_tokens", "must be >= 0")
        require(0 <= self.clip_eps_low < 1, "clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low!r}")
        require(0 <= self.clip_eps_high <= MAX_RATIO, "clip_eps_high",
                f"must be in [0, {MAX_RATIO:g}], got {self.clip_eps_high!r}")
        require(self.dual_clip_c is None or 1 < self.dual_clip_c <= MAX_RATIO, "dual_clip_c",
                f"must be in (1, {MAX_RATIO:g}] (or null), got {self.dual_clip_c!r}")
        require(0 < self.aipo_rho <= MAX_RATIO, "aipo_rho", f"must be in (0, {MAX_RATIO:g}], got {self.aipo_rho!r}")
        require(0 < self.tis_cap <= MAX_RATIO, "tis_cap", f"must be in (0, {MAX_RATIO:g}], got {self.tis_cap!r}")
        require(0 <= self.kl_coef <= MAX_COEF, "kl_coef", f"must be in [0, {MAX_COEF:g}], got {self.kl_coef!r}")
        require(0 <= self.entropy_coef <= MAX_COEF, "entropy_coef",
                f"must be in [0, {MAX_COEF:g}], got {self.entropy_coef!r}")
        require(0 < self.log_ratio_clamp <= 88, "log_ratio_clamp",
                f"must be in (0, 88] (exp(88) is near float32's largest), got {self.log_ratio_clamp!r}")
        require(0 < self.sapo_tau_pos <= MAX_RATIO, "sapo_tau_pos",
                f"must be in (0, {MAX_RATIO:g}], got {self.sapo_tau_pos!r}")
        require(0 < self.sapo_tau_neg <= MAX_RATIO, "sapo_tau_neg",
                f"must be in (0, {MAX_RATIO:g}], got {self.sapo_tau_neg!r}")
        require(0 < self.cov_ratio <= 1, "cov_ratio", f"must be in (0, 1], got {self.cov_ratio!r}")
        require(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_ub",
                f"must be > clip_cov_lb ({self.clip_cov_lb!r}), got {self.clip_cov_ub!r}")
        require(0 <= self.kl_cov_coef <= MAX_COEF, "kl_cov_coef",
                f"must be in [0, {MAX_COEF:g}], got {self.kl_cov_coef!r}")
        require(self.name not in SEQUENCE_LEVEL_LOSSES or self.aggregation == "seq_mean", "aggregation",
                f"loss {self.name} has one term per sequence: it needs seq_mean, got {self.aggregation}")


# The rejection criteria of `RolloutCorrectionConfig.reject` (verl's `rollout_rs` options, same meaning):
# token_*: per token; seq_sum_* / seq_mean_* / seq_max_*: the sum / mean / max of the per-token statistic
# over a sequence. k1 = log(mu/pi) (bounds: a ratio band [lo, hi], compared in log space), k2 = (log pi/mu)^2
# / 2, k3 = pi/mu - 1 - log(pi/mu) (bounds: an upper value). seq_mean_k1 is the geometric-mean ratio mask.
REJECTION_CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclasses.dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection masks for the gap between the policy being trained (pi) and the
    engine that sampled (mu): staleness in the asynchronous loop and the engine's own numerics (bf16, fp8,
    other kernels). Applied on top of any loss: its per-token terms are multiplied by the weights and by the
    mask (algorithms/rollout_correction.py; verl's rollout correction, the same options)."""

    weights: Literal["none", "token", "sequence"] = "none"
    """none; token: w_t = pi(y_t)/mu(y_t) per token; sequence: w = prod_t pi/mu for every token of a
    sequence. Detached, truncated at weight_cap (TIS) or, with weight_floor, zero outside the band (IcePop)."""
    weight_cap: float = 2.0
    """Upper bound of the weights: truncated to it (TIS), or the band's upper edge with weight_floor."""
    weight_floor: float | None = None
    """With a value: IcePop-style masking, a weight outside [weight_floor, weight_cap] becomes 0."""
    reject: dict[str, float | list[float]] = dataclasses.field(default_factory=dict)
    """Rejection criteria and thresholds, all of which must pass for a token to stay in the loss: e.g.
    {seq_mean_k1: [0.999, 1.001], token_k3: 0.5}. k1 criteria take a [lo, hi] ratio band, the others one
    upper bound (see REJECTION_CRITERIA above for the statistics)."""

    def __post_init__(self) -> None:
        require(0 < self.weight_cap <= MAX_RATIO, "weight_cap", f"must be in (0, {MAX_RATIO:g}], got {self.weight_cap!r}")
        require(self.weight_floor is None or 0 <= self.weight_floor < self.weight_cap, "weight_floor",
                f"must be in [0, weight_cap) (or null), got {self.weight_floor!r}")
        require(isinstance(self.reject, dict), "reject", "must be a mapping of criterion to threshold")
        for name, bound in self.reject.items():
            require(name in REJECTION_CRITERIA, "reject",
                    f"unknown criterion {name!r}; known: {', '.join(REJECTION_CRITERIA)}")
            if name.endswith("k1"):
                ok = (isinstance(bound, (list, tuple)) and len(bound) == 2
                      and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bound)
                      and 0 < bound[0] < bound[1])
                require(ok, "reject", f"{name} takes a ratio band [lo, hi] with 0 < lo < hi, got {bound!r}")
            else:
                ok = isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > 0
                require(ok, "reject", f"{name} takes one upper bound > 0, got {bound!r}")

    @property
    def active(self) -> bool:
        return self.weights != "none" or bool(self.reject)


@dataclasses.dataclass(kw_only=True)
class OverlongConfig:
    """DAPO's length shaping (Yu et al. 2025, arXiv 2503.14476, sec. 3.4): a soft penalty on responses that
    run into the last `buffer_tokens` of the length budget, and optionally no loss on truncated ones."""

    buffer_tokens: int = 0
    """Length of the soft-punishment interval (paper: 4096 of 20480); 0 turns the penalty off. A response
    of L tokens with budget L_max gets reward += penalty * min(0, (L_max - buffer_tokens - L) / buffer_tokens)."""
    penalty: float = 1.0
    """The penalty at the budget's end (paper and verl: 1.0)."""
    mask_truncated: bool = False
    """Overlong filtering: responses cut at the budget (finish reason `length`) keep their reward in the
    group's statistics but leave the loss (and its normaliser)."""

    def __post_init__(self) -> None:
        require(self.buffer_tokens >= 0, "buffer_tokens", f"must be >= 0, got {self.buffer_tokens!r}")
        require(0 <= self.penalty <= MAX_COEF, "penalty", f"must be in [0, {MAX_COEF:g}], got {self.penalty!r}")


@dataclasses.dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation (`algorithm.objective: distill`; Agarwal et al. 2024, GKD, arXiv 2306.13649;
    Qwen3's strong-to-weak distillation, arXiv 2505.09388): a frozen teacher scores the tokens the student
    sampled, and the per-token reverse KL log mu - log pi_teacher enters the policy loss as a negative
    advantage (controller/objectives.py: DistillationObjective)."""

    teacher: str = dataclasses.field(default="", metadata={RECIPE_PATH_FIELD: True})
    """The teacher: a model path (any form `model.path` accepts, any supported family and size, the
    student's tokenizer), run forward-only on the policy's ranks; or the base URL of an OpenAI-compatible
    server that returns prompt log-probs (`megatron-rl serve`, vLLM), e.g. http://host:8000/v1."""
    teacher_model: str = ""
    """With a URL teacher: the `model` field of its requests (empty: the server's only model)."""
    coef: float = 1.0
    """Weight of the distillation advantage coef * (log pi_teacher - log mu) per token."""
    rl_coef: float = 0.0
    """Weight of the reward's advantages (algorithm.advantage) added to it; 0: pure distillation."""
    baseline: bool = True
    """Subtract the step's mean distillation advantage over its loss tokens: a constant baseline, so the
    gradient's expectation is unchanged (E[grad log pi] = 0) and its variance lower. A student far from its
    teacher has every token's log-ratio strongly negative; without the baseline that shared part is pure
    noise in a small batch. False: the raw per-token reverse KL as in GKD and Thinking Machines' recipe."""
    timeout_s: float = 300.0
    """With a URL teacher: seconds per scoring request."""

    def __post_init__(self) -> None:
        require(0 <= self.coef <= MAX_COEF, "coef", f"must be in [0, {MAX_COEF:g}], got {self.coef!r}")
        require(0 <= self.rl_coef <= MAX_COEF, "rl_coef", f"must be in [0, {MAX_COEF:g}], got {self.rl_coef!r}")
        require(self.coef > 0 or self.rl_coef > 0, "coef", "coef and rl_coef are both 0: nothing to learn from")
        require(0 < self.timeout_s <= 86400, "timeout_s", f"must be in (0, 86400], got {self.timeout_s!r}")

    @property
    def teacher_is_url(self) -> bool:
        return self.teacher.startswith(("http://", "https://"))


@dataclasses.dataclass(kw_only=True)
class JepoConfig:
    """JEPO's bound, advantages, answer marker and reference budget (used by the `jepo` objective)."""

    mode: Literal["jepo", "combined", "verifier"] = "jepo"
    """jepo: the likelihood bound only (no verifier needed); combined: the verifier loss for prompts with
    a sample verified correct, JEPO otherwise; verifier: the verifier loss for every prompt (baseline)."""
    bound: Literal["multi", "jensen"] = "multi"
    """multi: the multi-sample bound L_n = E log mean_i pi(a*|x,c_i); jensen: L_1 = E log pi(a*|x,c)
    averaged over the n samples with a leave-one-out baseline."""
    answer_marker: str = "The final answer is"
    """Text that ends the chain of thought; a* is scored right after it in place of the model's answer."""
    beta_sup: float = 1.0
    """Weight of the supervised term -beta_sup * B_g (paper: 1 on unverifiable data, 0 to 1e-2 on math)."""
    normalize_advantages: bool = True
    """Divide the advantages by their std over the group's usable samples (paper: std(A))."""
    advantage_clip: float | None = 1.0
    """Clip the (normalised) advantages to [-c, c] (paper: 1). None: no clipping."""
    format_penalty: float = -10.0
    """Advantage of a sample without the answer marker (paper: -10); it is left out of the bound."""
    missing_marker: Literal["penalty", "append"] = "penalty"
    """A sample without the marker: penalty (the paper: format_penalty, out of the bound), or append
    (departure, for small models that rarely write it: the marker is appended to the chain of thought as
    context, not trained on, and a* scored after it, as the likelihood evaluation does)."""
    max_reference_tokens: int = 512
    """Longest reference a* (tokens, end-of-turn token included) a prompt may have."""
    on_bad_reference: Literal["error", "skip"] = "error"
    """A prompt without a reference, with one over max_reference_tokens, or with one that does not fit
    the model's context after the prompt and max_new_tokens: error names the prompt and its source row;
    skip drops the prompt and counts it (rollout/bad_reference_skipped)."""
    score_end_of_turn: bool = True
    """Score the tokenizer's end-of-turn (eos) token after a* as part of the reference."""

    def __post_init__(self) -> None:
        require(self.beta_sup >= 0, "beta_sup", "must be >= 0")
        require(self.advantage_clip is None or self.advantage_clip > 0, "advantage_clip", "must be > 0 (or null)")
        require(bool(self.answer_marker.strip()), "answer_marker", "must not be empty")
        require(self.max_reference_tokens >= 1, "max_reference_tokens", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class WaltzRewardConfig:
    """Weights of the feedback reward R_f = alpha * DIR * R_label + lambda * R_label + gamma * R_format."""

    alpha: float = 1.0
    """Weight of the label-gated Dynamic Improvement Reward."""
    label_weight: float = 1.0
    """lambda: weight of the label reward in stage 1."""
    stage2_label_weight: float = 0.0
    """lambda in stage 2. The paper uses 0; then a false flag on a good answer earns as much as the
    correct "no flag" (module docstring), and a feedback agent with a weak stage 1 drifts to flagging
    everything. > 0 is a departure from the paper that prices false flags in stage 2 too."""
    format_weight: float = 1.0
    """gamma: weight of the format reward."""
    gate_dir_by_label: bool = True
    """Multiply DIR by R_label (the paper's design; False only for the ablation)."""

    def __post_init__(self) -> None:
        require(self.alpha >= 0, "alpha", "must be >= 0")
        require(self.label_weight >= 0, "label_weight", "must be >= 0")
        require(self.stage2_label_weight >= 0, "stage2_label_weight", "must be >= 0")
        require(self.format_weight >= 0, "format_weight", "must be >= 0")
