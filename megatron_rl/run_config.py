"""The root of the run's config tree: one section per component, each defined next to its code.

A recipe (`examples/configs/*.yaml`) fills some of these fields; dotted command-line overrides
(`trainer.lr=1e-6`) go on top; `megatron-rl config --describe` lists every field with its doc.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_rl.algorithms.config import (
    AdvantageConfig,
    DistillConfig,
    JepoConfig,
    LossConfig,
    OverlongConfig,
    RolloutCorrectionConfig,
)
from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.config import IMPORTS_FIELD, import_modules, load_yaml, require, split_config_and_overrides
from megatron_rl.controller.config import BUILTIN_RECIPES, EVAL_METRICS, OBJECTIVES, RECIPES, CurriculumConfig
from megatron_rl.data.config import DataConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.observability.metrics import LoggingConfig
from megatron_rl.recipes.agent.config import AgentConfig
from megatron_rl.recipes.jepo.config import LikelihoodEvalConfig
from megatron_rl.recipes.waltz.config import WaltzConfig
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import NativeEngineConfig, RolloutConfig
from megatron_rl.sim.config import ClusterConfig
from megatron_rl.trainer.config import CriticConfig, TrainerConfig


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL objective: how advantages are estimated and which policy loss uses them."""

    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """Advantage estimator (GRPO, RLOO, REINFORCE++, pass@k GRPO, OPO)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss (AIPO, PPO clip, TIS, GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, plain PG), KL and entropy
    terms, normalisation."""
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """Token- or sequence-level importance weights (TIS, IcePop) and rejection masks (geometric-mean and
    KL-estimator criteria) between the trained policy and the sampling engine, on top of any loss."""
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    """DAPO's soft overlong punishment of the rewards and masking of truncated responses."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """PPO's learned critic (objective ppo): initial weights, value clip, warm-up, optimizer."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """On-policy distillation (objective distill): the teacher (a model path or a server URL) and the mix
    of its per-token reverse KL with the reward's advantages."""
    objective: str = "policy_gradient"
    """How scored groups become the trainer's batch and loss (controller/objectives.py): policy_gradient
    (rewards -> advantages -> policy loss), ppo (a learned critic and GAE), distill (on-policy
    distillation from a teacher), jepo (likelihood bound of reference answers, optionally
    combined with a verifier), sft (NLL of the reference answers), or a user objective: a name registered
    with `OBJECTIVES.register` or 'package.module:Class' (docs/extending.md)."""
    jepo: JepoConfig = dataclasses.field(default_factory=JepoConfig)
    """JEPO's bound, advantages, answer marker and reference budget (objective jepo / sft)."""

    def __post_init__(self) -> None:
        OBJECTIVES.check(self.objective, "objective")
        require((self.advantage.estimator == "gae") == (self.objective == "ppo"), "advantage.estimator",
                "gae (a learned critic's advantages) goes with objective ppo, and objective ppo with gae; got "
                f"estimator {self.advantage.estimator} with objective {self.objective}")
        require(self.objective != "distill" or bool(self.distill.teacher.strip()), "distill.teacher",
                "objective distill needs a teacher: a model path or an OpenAI-compatible server URL")


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation during and around training."""

    every_steps: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    max_new_tokens: int = 64
    """Longest response when evaluating."""
    before_training: bool = True
    """Measure the starting policy's held-out accuracy (reported as accuracy_before)."""
    after_training: bool = True
    """Measure the trained policy's held-out accuracy (reported as accuracy_after)."""
    metrics: list[str] = dataclasses.field(default_factory=lambda: ["accuracy"])
    """Held-out metrics: accuracy (greedy, with the reward) and optionally likelihood (the n-sample
    bound of the reference answers' log-likelihood, a proxy NLL; needs references), or user metrics
    (registered with `EVAL_METRICS.register` or 'package.module:function'; docs/extending.md)."""
    likelihood: LikelihoodEvalConfig = dataclasses.field(default_factory=LikelihoodEvalConfig)
    """How the likelihood metric samples chains of thought and scores the references."""
    reward: RewardConfig | None = None
    """The reward that decides held-out accuracy (default: the run's `reward`): e.g. the task's exact checker
    while the run trains on a reward model's scores (docs/reward_models.md)."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", "must be >= 0")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        for name in self.metrics:  # accuracy is the evaluation's own greedy pass, not a registered metric
            EVAL_METRICS.check(name, "metrics", also=("accuracy",))


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything one run needs."""

    imports: list[str] = dataclasses.field(default_factory=list, metadata={IMPORTS_FIELD: True})
    """Modules imported before the rest of the config is validated, on every rank: their decorators
    register user parts (losses, estimators, rewards, ...) that the sections then name (docs/extending.md)."""
    recipe: str | None = None
    """What the run builds (controller/recipe.py): single_policy, waltz, agent, or a user recipe
    'package.module:function' (config, model) -> RunParts. None: waltz with a `waltz:` section, agent
    with an `agent:` section, else single_policy."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The initial policy weights."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """The Megatron policy trainer."""
    engine: NativeEngineConfig = dataclasses.field(default_factory=NativeEngineConfig)
    """The rollout engine (native PyTorch engine)."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Sampling for training and the staleness bound (0: synchronous)."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Advantages and policy loss."""
    curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig)
    """Which prompts each step generates (none, prefilter, dynamic_sampling, or PCL's value model)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Training prompts and the held-out split."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """Reward function."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint frequency and retention."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Metrics outputs (JSONL, W&B, plots)."""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    """Cluster layout (nodes, generator group) and the planner's hardware and assumptions."""
    steps: int = 20
    """Optimizer steps to train."""
    run_dir: str = "runs/default"
    """Directory for metrics, plots, checkpoints and summary.json."""
    seed: int = 1
    """Seed for sampling and initialisation."""
    waltz: WaltzConfig | None = None
    """WaltzRL two-agent safety training (conversation + feedback agent); None: a single-policy run."""
    agent: AgentConfig | None = None
    """Multi-turn tool-using agent training (recipes/agent/: episodes with tools, a calculator task that
    replaces the `data` section); None: single-turn samples."""

    @property
    def records_routing(self) -> bool:
        """Whether the rollout engines record MoE routing: the rollout asks for it or the trainer replays it
        (the records travel with each completion to `TrainBatch.routed_experts`)."""
        return self.engine.record_routing or self.rollout.record_routing or self.trainer.moe_routing_replay

    def __post_init__(self) -> None:
        self.run_dir = os.path.expanduser(self.run_dir)  # as model.path: `~` is the home, never a folder `./~`
        require(self.steps >= 0, "steps", "must be >= 0")
        require(self.agent is None or self.waltz is None, "agent", "an agent run cannot also be a waltz run")
        if self.recipe is not None:
            RECIPES.check(self.recipe, "recipe")
            for name, section in (("waltz", self.waltz), ("agent", self.agent)):
                require(self.recipe != name or section is not None, "recipe",
                        f"recipe {name} needs a `{name}:` section")
                require(section is None or self.recipe == name or self.recipe not in BUILTIN_RECIPES, "recipe",
                        f"recipe {self.recipe} does not use the `{name}:` section (recipe {name} does)")
        require(self.eval.reward is None or (self.waltz is None and self.agent is None
                                             and self.recipe in (None, "single_policy")), "eval.reward",
                "only the single-turn recipe's held-out accuracy takes a reward of its own (agents and WaltzRL "
                "score held-out episodes with their environment and judge)")
        advantage = self.algorithm.advantage
        require(advantage.estimator != "remax" or (self.recipe is None and self.waltz is None and self.agent is None
                                                    and self.algorithm.objective == "policy_gradient"),
                "algorithm.advantage.estimator", "remax generates a greedy baseline per prompt in the single-turn "
                "policy-gradient loop; it is not available with recipes, agents or other objectives")
        group_relative = advantage.estimator in ("grpo", "rloo", "grpo_passk", "opo") or (
            advantage.estimator == "reinforce_pp" and advantage.group_baseline)
        # A group of one is its own baseline: every advantage is 0 (grpo, grpo_passk, opo) or undefined (rloo).
        require(not (self.algorithm.objective == "policy_gradient" and group_relative
                     and self.rollout.samples_per_prompt < 2), "rollout.samples_per_prompt",
                f"must be >= 2 with the group-relative estimator algorithm.advantage.estimator="
                f"{advantage.estimator}{' (group_baseline)' if advantage.estimator == 'reinforce_pp' else ''}, "
                f"got {self.rollout.samples_per_prompt}; use reinforce_pp without group_baseline for one sample per prompt")
        generator = self.cluster.generator
        require(self.rollout.weight_sync == "full" or generator.backend == "native"
                or (self.rollout.weight_sync, generator.backend) == ("adapters", "sglang"), "rollout.weight_sync",
                f"{self.rollout.weight_sync} sends what only the native engine applies (changed elements; LoRA "
                f"adapters also reach SGLang servers); cluster.generator.backend {generator.backend} takes whole "
                "tensors (use rollout.weight_sync=full)")
        if self.rollout.weight_sync == "adapters":
            require(self.trainer.lora.rank > 0, "rollout.weight_sync",
                    "adapters sends LoRA adapters: set trainer.lora.rank > 0 (or use rollout.weight_sync=full)")
            require(generator.precision != "fp8", "rollout.weight_sync",
                    "adapters keeps the engines' base weights: LoRA over an fp8 base is not checked here (use "
                    "cluster.generator.precision bf16, or rollout.weight_sync=full)")
            if generator.backend == "native":
                require(self.rollout.placement == "colocated" and not generator.launch_ranks, "rollout.weight_sync",
                        "adapters feeds the native engine in this process (rollout.placement colocated, no generator "
                        f"ranks) or SGLang servers; got placement {self.rollout.placement}, launch_ranks "
                        f"{generator.launch_ranks} (use rollout.weight_sync=full)")
        require(not (self.rollout.weight_sync == "delta" and generator.precision == "fp8"
                     and self.rollout.placement == "disaggregated"), "rollout.weight_sync",
                "delta cannot feed an fp8 native engine in a generator process: its weights go through "
                "update_weights rounded through fp8 blocks, whole (use rollout.weight_sync=full, or the colocated "
                "placement)")


    def __setstate__(self, state: dict) -> None:
        # A config pickled to another process (a spawned rank) may name parts that only its `imports`
        # register: import them there too before the parts are resolved.
        import_modules(state.get("imports", ()))
        self.__dict__.update(state)


def load_run_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A recipe with dotted overrides, as the CLI commands take them (see `split_config_and_overrides`);
    the modules its `imports:` lists are imported before any section is validated."""
    return load_yaml(RunConfig, *split_config_and_overrides(path, list(overrides)))
