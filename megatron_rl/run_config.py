"""The root of the run's config tree: one section per component, each defined next to its code.

A recipe (`examples/configs/*.yaml`) fills some of these fields; dotted command-line overrides
(`trainer.lr=1e-6`) go on top; `megatron-rl config --describe` lists every field with its doc.
"""
from __future__ import annotations

import dataclasses

from megatron_rl.algorithms.config import AdvantageConfig, JepoConfig, LossConfig
from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.config import load_yaml, require, split_config_and_overrides
from megatron_rl.controller.config import OBJECTIVES, CurriculumConfig
from megatron_rl.data.config import DataConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.observability.metrics import LoggingConfig
from megatron_rl.recipes.agent.config import AgentConfig
from megatron_rl.recipes.jepo.config import LikelihoodEvalConfig
from megatron_rl.recipes.waltz.config import WaltzConfig
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import NativeEngineConfig, RolloutConfig
from megatron_rl.sim.config import ClusterConfig
from megatron_rl.trainer.config import TrainerConfig


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL objective: how advantages are estimated and which policy loss uses them."""

    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """Advantage estimator (GRPO, RLOO, REINFORCE++)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss (AIPO, PPO clip, TIS, plain PG), KL and entropy terms, normalisation."""
    objective: str = "policy_gradient"
    """How scored groups become the trainer's batch and loss (controller/objectives.py): policy_gradient
    (rewards -> advantages -> policy loss), jepo (likelihood bound of reference answers, optionally
    combined with a verifier), sft (NLL of the reference answers), or a user 'module:Class'."""
    jepo: JepoConfig = dataclasses.field(default_factory=JepoConfig)
    """JEPO's bound, advantages, answer marker and reference budget (objective jepo / sft)."""

    def __post_init__(self) -> None:
        require(self.objective in OBJECTIVES or ":" in self.objective, "objective",
                f"unknown objective {self.objective!r}; registered: {sorted(OBJECTIVES)}, or 'module:Class'")


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
    bound of the reference answers' log-likelihood, a proxy NLL; needs references)."""
    likelihood: LikelihoodEvalConfig = dataclasses.field(default_factory=LikelihoodEvalConfig)
    """How the likelihood metric samples chains of thought and scores the references."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", "must be >= 0")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        unknown = sorted(set(self.metrics) - {"accuracy", "likelihood"})
        require(not unknown, "metrics", f"unknown metrics {unknown}; known: accuracy, likelihood")


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything one run needs."""

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
        require(self.steps >= 0, "steps", "must be >= 0")
        require(self.agent is None or self.waltz is None, "agent", "an agent run cannot also be a waltz run")
        advantage = self.algorithm.advantage
        group_relative = advantage.estimator in ("grpo", "rloo") or (
            advantage.estimator == "reinforce_pp" and advantage.group_baseline)
        # A group of one is its own baseline: every advantage is 0 (grpo) or undefined (rloo).
        require(not (self.algorithm.objective == "policy_gradient" and group_relative
                     and self.rollout.samples_per_prompt < 2), "rollout.samples_per_prompt",
                f"must be >= 2 with the group-relative estimator algorithm.advantage.estimator="
                f"{advantage.estimator}{' (group_baseline)' if advantage.estimator == 'reinforce_pp' else ''}, "
                f"got {self.rollout.samples_per_prompt}; use reinforce_pp without group_baseline for one sample per prompt")


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    """A recipe with dotted overrides, as the CLI commands take them (see `split_config_and_overrides`)."""
    return load_yaml(RunConfig, *split_config_and_overrides(path, overrides))
