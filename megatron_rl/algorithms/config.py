"""Configuration of the algorithms, importable without torch: advantage estimators (`algorithm.advantage:`),
policy losses (`algorithm.loss:`), the JEPO bound (`algorithm.jepo:`) and WaltzRL's rewards (`waltz.reward:`)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import Registry, require

# The registries of advantages.py and losses.py, here so that a config names their parts without
# importing torch; the built-ins are imported on first use (docs/extending.md).

# fn(rewards [N] or [P, G], group_ids, config: AdvantageConfig) -> advantages, rewards' shape.
ADVANTAGE_ESTIMATORS = Registry("estimator", {
    "grpo": "megatron_rl.algorithms.advantages:grpo_estimator",
    "rloo": "megatron_rl.algorithms.advantages:rloo_estimator",
    "reinforce_pp": "megatron_rl.algorithms.advantages:reinforce_pp_estimator",
})
# The `PolicyLoss` signature of losses.py; `losses.register_loss` is LOSSES.register.
LOSSES = Registry("loss", {
    "pg": "megatron_rl.algorithms.losses:pg_loss",
    "ppo_clip": "megatron_rl.algorithms.losses:ppo_clip_loss",
    "aipo": "megatron_rl.algorithms.losses:aipo_loss",
    "tis": "megatron_rl.algorithms.losses:tis_loss",
})


# Bounds past which a value is a typo rather than a setting: an importance ratio (clip range, cap) of
# 1000 or a loss-term weight of 1000 times the policy loss.
MAX_RATIO = 1000.0
MAX_COEF = 1000.0


@dataclasses.dataclass(kw_only=True)
class AdvantageConfig:
    """How sequence rewards become advantages."""

    estimator: str = "grpo"
    """grpo: (r - group mean) / group std; rloo: r - mean of the other samples of the group;
    reinforce_pp: batch-normalised (r - batch mean) / batch std; or a user estimator registered with
    `ADVANTAGE_ESTIMATORS.register` or 'package.module:function' (docs/extending.md)."""
    scale_by_std: bool = True
    """grpo only: divide by the group std. False gives r - group mean (Dr.GRPO, AIPO, PCL)."""
    group_baseline: bool = False
    """reinforce_pp only: subtract the group mean before batch normalisation (REINFORCE++-baseline)."""
    eps: float = 1e-6
    """Added to the std in the denominators."""

    def __post_init__(self) -> None:
        ADVANTAGE_ESTIMATORS.check(self.estimator, "estimator")
        require(0 <= self.eps <= 1, "eps", f"must be in [0, 1], got {self.eps!r}")


@dataclasses.dataclass(kw_only=True)
class LossConfig:
    """The policy loss: which surrogate, its clipping, the KL / entropy terms and the normalisation."""

    name: str = "aipo"
    """Registered loss: pg (on-policy REINFORCE), ppo_clip, aipo (LlamaRL), tis (truncated IS), or a user
    loss registered with `register_loss` or 'package.module:function' (docs/extending.md)."""
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_norm"] = "token_mean"
    """How per-token terms are summed and normalised over the global batch (see module docstring)."""
    max_response_tokens: int = 0
    """seq_sum_norm only: the constant length L in the normaliser N_seq * L (must be > 0 then)."""
    clip_eps_low: float = 0.2
    """ppo_clip / tis: lower clip, the ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""
    clip_eps_high: float = 0.2
    """ppo_clip / tis: upper clip (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = None
    """ppo_clip / tis: dual-clip constant c > 1 (Ye et al. 2020): for A < 0 the loss is at most -c*A. None disables."""
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
