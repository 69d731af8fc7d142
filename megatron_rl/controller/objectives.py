"""Training objectives: how a step's scored groups become the trainer's batch and loss hook.

The loop is the same for every algorithm (controller/loop.py); an objective decides only

    batch_and_loss = objective.prepare_step(groups, trainer_version)   # (StepBatch, loss_fn)
    train, heldout = objective.prepare_data(train, heldout)            # e.g. drop unusable prompts

`AlgorithmConfig.objective` names one: a name of controller/config.py's OBJECTIVES registry (built in, or
registered by a module of the run's `imports:`) or 'package.module:Class' for a user objective. Each is constructed as `Class(config: RunConfig, tokenizer, model, policy=None)` (model: the
loaded pretrained model, for objectives that need its architecture or a frozen reference copy; policy:
the trainer, whose process groups such a copy shares).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from megatron_rl.algorithms.losses import compute_normalizer, make_loss_fn
from megatron_rl.controller.batching import FP8_TOKEN_MULTIPLE, StepBatch, build_step_batch
from megatron_rl.controller.config import OBJECTIVES
from megatron_rl.trainer.trainer import MegatronTrainer


class Objective(Protocol):
    def prepare_data(self, train, heldout) -> tuple[Any, Any]: ...

    def prepare_step(self, groups: list, trainer_version: int) -> tuple[StepBatch, Callable | None]: ...


def resolve_objective(name: str) -> type:
    return OBJECTIVES.resolve(name)


def make_objective(config, tokenizer, model, policy=None) -> Objective:
    return resolve_objective(config.algorithm.objective)(config, tokenizer, model, policy=policy)


class PolicyGradientObjective:
    """Sequence rewards -> group advantages -> the configured policy loss (GRPO / RLOO / REINFORCE++ with
    AIPO / PPO / TIS): `build_step_batch` and `make_loss_fn`."""

    def __init__(self, config, tokenizer, model=None, policy=None):
        self.config = config
        self.pad_token_id = tokenizer.pad_token_id
        self.reference_model = frozen_reference(config, model, policy)

    def prepare_data(self, train, heldout):
        return train, heldout

    def prepare_step(self, groups, trainer_version):
        cfg = self.config
        loss = cfg.algorithm.loss
        step = build_step_batch(groups, advantage=cfg.algorithm.advantage, trainer_version=trainer_version,
                                micro_batch_size=cfg.trainer.micro_batch_size, pad_token_id=self.pad_token_id,
                                drop_uninformative=cfg.rollout.drop_uninformative_groups and loss.kl_coef == 0
                                and loss.entropy_coef == 0,
                                # Transformer Engine's FP8 GEMMs need whole multiples of 16 tokens
                                token_multiple=FP8_TOKEN_MULTIPLE if cfg.trainer.fp8 != "none" else 1,
                                overlong=cfg.algorithm.overlong, max_new_tokens=cfg.rollout.max_new_tokens)
        if step.batch is None:
            return step, None
        if loss.kl_coef > 0:
            step.batch.reference_logprobs = reference_logprobs(self.reference_model, step.batch)
        return step, make_loss_fn(loss, compute_normalizer(step.full_loss_mask, loss),
                                  correction=cfg.algorithm.rollout_correction)


def frozen_reference(config, model, policy):
    """The KL penalty's pi_ref (`algorithm.loss.kl_coef > 0`): a forward-only copy of the starting
    weights on the policy's own ranks and process groups (one extra forward per step, no backward).
    None without a KL term. A resumed run rebuilds it from `model`, the starting weights again."""
    if config.algorithm.loss.kl_coef <= 0 or policy is None:  # (an objective built only to filter data)
        return None

    return MegatronTrainer(model.arch, policy.config, pg_collection=policy.pg, hf_state=model.state, frozen=True)


def reference_logprobs(reference_model, batch):
    if reference_model is None:
        raise RuntimeError("algorithm.loss.kl_coef > 0 needs a reference model: build the objective with the "
                           "pretrained model and the policy trainer (policy=...), whose process groups it shares")
    return reference_model.compute_logprobs(batch)
