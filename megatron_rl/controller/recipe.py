"""What a recipe builds for a run, and which recipe a config asks for.

A recipe turns the config and the starting model into the run's parts; the `Controller`
(controller/loop.py) is built from them and is the same for every algorithm:

    parts = build_run_parts(config, model)   # the recipe's policies, data, producer, selector, evaluation
    controller = Controller(config, parts)

The default recipe (`single_policy`, below) trains one policy on single-turn samples: GRPO / RLOO /
REINFORCE++ with AIPO, PPO or TIS, JEPO and SFT (`algorithm.objective`), under any curriculum
(`curriculum.kind`, PCL included). WaltzRL's two agents are recipes/waltz/recipe.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from megatron_rl import ranks
from megatron_rl.controller.config import RECIPES
from megatron_rl.controller.curriculum import PromptSelector, build_selector
from megatron_rl.controller.episodes import EpisodeProducer, SingleTurnSampling
from megatron_rl.controller.evaluate import HeldoutEvaluation, heldout_metrics
from megatron_rl.controller.objectives import make_objective
from megatron_rl.data.sources import build_datasets
from megatron_rl.placement.generators import make_engine, policy_weight_channel
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.sglang_engine import colocated_engine_kwargs, colocated_memory_fraction
from megatron_rl.sim.planner import make_plan
from megatron_rl.trainer.trainer import MegatronTrainer, load_policy


@dataclasses.dataclass
class PolicyExecutor:
    """One trained policy of a run: its Megatron trainer, its rollout engine and its objective.
    Single-agent runs hold one ('policy'); WaltzRL holds two ('policy' = conversation, 'feedback')."""

    name: str
    """The role its samples carry (Sample.role); metrics of non-primary policies are prefixed by it."""
    trainer: MegatronTrainer
    """The Megatron trainer."""
    engine: Any
    """The rollout engine generating with its weights (None on trainer ranks other than the driver)."""
    objective: Any
    """Its training objective (controller/objectives.py): groups -> batch and loss hook."""
    weights: Any
    """Its weight channel (weight_sync/channel.py): trainer -> engine."""
    version: int = 0
    """Weight version: optimizer steps applied to it (what its samples' staleness is measured against)."""


def train_every_step(policy: PolicyExecutor, step: int) -> bool:
    return True


@dataclasses.dataclass
class RunParts:
    """Everything a recipe builds for the Controller. Driver-only parts are None on other trainer ranks."""

    tokenizer: Any
    """The policy's tokenizer and chat template."""
    policies: list[PolicyExecutor]
    """The trained policies; the first is the run's primary policy (its checkpoints are the run's)."""
    train_data: Any
    """Training prompts (a PromptDataset; empty on trainer ranks other than the driver)."""
    heldout: Any
    """Held-out prompts."""
    episodes: EpisodeProducer | None
    """How a prompt becomes its group of scored samples (driver)."""
    selector: PromptSelector | None
    """The curriculum: which prompts each step generates (driver)."""
    evaluation: HeldoutEvaluation
    """Held-out metrics and their cadence."""
    schedule: Callable[[PolicyExecutor, int], bool] = train_every_step
    """Whether a policy takes an optimizer step at a training step (multi-stage recipes)."""


def colocated_sglang_kwargs(config) -> dict[str, Any]:
    """The in-process SGLang engine's share of the GPU as the planner sizes it (beside the trainer), with
    the memory saver and deterministic inference when the run asks for reproducible sampling."""
    generator = config.cluster.generator
    if generator.backend != "sglang" or generator.urls:
        return {}
    return colocated_engine_kwargs(make_plan(config), deterministic=config.rollout.deterministic)


def colocated_vllm_memory_fraction(config) -> float | None:
    """The GPU share of each vLLM server the run launches beside the trainer (placement colocated, on a GPU), as
    the planner sizes a colocated engine; None where the servers have GPUs of their own (or there is none)."""
    generator = config.cluster.generator
    if generator.backend != "vllm" or generator.urls or config.rollout.placement != "colocated" \
            or not torch.cuda.is_available():
        return None
    return colocated_memory_fraction(make_plan(config))


def build_policy(config, model, *, single_policy: bool = True) -> tuple[PolicyExecutor, PromptSelector | None]:
    """The run's primary policy (trainer, engine on the driver, objective, weight channel) and the
    curriculum's selector, built in the order every run's random state depends on."""
    trainer = load_policy(config.model.path, config.trainer, pretrained=model)
    driver = ranks.is_driver()
    engine = make_engine(config, model, single_policy=single_policy, sglang_kwargs=colocated_sglang_kwargs(config),
                         vllm_memory_fraction=colocated_vllm_memory_fraction(config)) if driver else None
    # A generator process on this host's cores: train on the cores it leaves idle too.
    cores = getattr(engine, "trainer_cores", None)
    if cores is not None:
        trainer.between_layers = cores.apply
    # PCL's value model starts from the policy's weights; so may a user curriculum's executors.
    value_from_policy = config.curriculum.kind not in ("none", "prefilter", "dynamic_sampling")
    selector = build_selector(config.curriculum, data_config=config.data, tokenizer=model.tokenizer,
                              policy_arch=model.arch, policy_state=model.state if value_from_policy else None,
                              pg_collection=trainer.pg) if driver else None
    objective = make_objective(config, model.tokenizer, model, policy=trainer)
    weights = policy_weight_channel(config, trainer, engine)
    return PolicyExecutor("policy", trainer, engine, objective, weights), selector


def build_single_policy(config, model) -> RunParts:
    """The default recipe: one policy, single-turn samples scored by the reward."""
    policy, selector = build_policy(config, model)
    driver = ranks.is_driver()
    reward = Reward(config.reward) if driver else None
    if driver:
        train_data, heldout = policy.objective.prepare_data(*build_datasets(config.data))
        episodes = SingleTurnSampling(policy.engine, model.tokenizer, reward, config.rollout,
                                      greedy_baseline=config.algorithm.advantage.estimator == "remax")
    else:  # trainer ranks receive scored groups from the driver
        train_data, heldout, episodes = [], [], None
    eval_reward = Reward(config.eval.reward) if driver and config.eval.reward is not None else reward
    measure = heldout_metrics(config, engine=policy.engine, policy=policy.trainer, tokenizer=model.tokenizer,
                              prompts=heldout, reward=eval_reward, driver=driver)
    return RunParts(model.tokenizer, [policy], train_data, heldout, episodes, selector,
                    HeldoutEvaluation(config.eval, measure))


def recipe_name(config) -> str:
    """The recipe a config asks for: its `recipe` (a name of controller/config.py's RECIPES or
    'package.module:function'), else WaltzRL when it has a `waltz:` section, the multi-turn agent recipe
    when it has an `agent:` section, else one policy."""
    if config.recipe is not None:
        return config.recipe
    if config.waltz is not None:
        return "waltz"
    return "agent" if config.agent is not None else "single_policy"


def build_run_parts(config, model) -> RunParts:
    return RECIPES.resolve(recipe_name(config))(config, model)
