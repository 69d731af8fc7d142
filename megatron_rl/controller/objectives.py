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

import dataclasses
from typing import Any, Callable, Protocol

import torch

from megatron_rl.algorithms.advantages import gae_advantages
from megatron_rl.algorithms.losses import compute_normalizer, make_loss_fn
from megatron_rl.controller.batching import FP8_TOKEN_MULTIPLE, StepBatch, build_step_batch
from megatron_rl.controller.config import OBJECTIVES
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.rollout.client import PromptLogprobScorer
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.trainer.value import CriticTrainer, initial_weights


class Objective(Protocol):
    def prepare_data(self, train, heldout) -> tuple[Any, Any]: ...

    def prepare_step(self, groups: list, trainer_version: int) -> tuple[StepBatch, Callable | None]: ...


def objective_executors(objective) -> dict[str, MegatronTrainer]:
    """The trainers an objective owns besides the policy (PPO's critic), by name: checkpointed with the
    run at every step and restored on resume (controller/loop.py). Objectives without any have none."""
    executors = getattr(objective, "executors", None)
    return executors() if executors is not None else {}


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
        loss = self.config.algorithm.loss
        step = self.build_batch(groups, trainer_version,
                                drop_uninformative=self.config.rollout.drop_uninformative_groups and loss.kl_coef == 0
                                and loss.entropy_coef == 0)
        if step.batch is None:
            return step, None
        return step, self.loss_hook(step)

    def build_batch(self, groups, trainer_version, *, drop_uninformative: bool) -> StepBatch:
        cfg = self.config
        return build_step_batch(groups, advantage=cfg.algorithm.advantage, trainer_version=trainer_version,
                                micro_batch_size=cfg.trainer.micro_batch_size, pad_token_id=self.pad_token_id,
                                drop_uninformative=drop_uninformative,
                                # Transformer Engine's FP8 GEMMs need whole multiples of 16 tokens
                                token_multiple=FP8_TOKEN_MULTIPLE if cfg.trainer.fp8 != "none" else 1,
                                overlong=cfg.algorithm.overlong, max_new_tokens=cfg.rollout.max_new_tokens)

    def loss_hook(self, step: StepBatch):
        """The policy loss over `step.batch` (with its reference log-probs when there is a KL term)."""
        algorithm = self.config.algorithm
        if algorithm.loss.kl_coef > 0:
            step.batch.reference_logprobs = reference_logprobs(self.reference_model, step.batch)
        return make_loss_fn(algorithm.loss, compute_normalizer(step.full_loss_mask, algorithm.loss),
                            correction=algorithm.rollout_correction)


class ActorCriticObjective(PolicyGradientObjective):
    """PPO with a learned critic and GAE (`algorithm.objective: ppo`, `algorithm.advantage.estimator: gae`;
    Schulman et al. 2017; the default algorithm of verl and OpenRLHF). Each step, on every trainer rank:

        V = critic.token_values(batch)                        # V(s_t) before each response token, current critic
        A, R = GAE(rewards on each row's last token, V, gamma, lam), A whitened over the batch
        critic.update(batch: returns R, clip centre V)        # the critic's optimizer step(s), its DP share
        the policy loss (algorithm.loss, e.g. ppo_clip) on A  # unless the critic is still warming up

    Values are recomputed at training time by the critic as it is then, for samples of any age: in the
    asynchronous loop (`rollout.max_staleness >= 1`) the engine's behaviour log-probs mu correct the policy
    loss for staleness, while the baseline is always the current critic's (there is no behaviour-time critic
    to store; a value is a baseline, so its age biases nothing). The critic's weights and optimizer are
    checkpointed with the run (`executors`) and resume with it, at the same layout or another."""

    def __init__(self, config, tokenizer, model=None, policy=None):
        super().__init__(config, tokenizer, model, policy)
        self.critic = None
        if policy is not None and model is not None:  # (an objective built only to filter data has none)
            critic = config.algorithm.critic
            arch, state = initial_weights(critic.init_from, model.arch, model.state, "algorithm.critic.init_from")
            self.critic = CriticTrainer(arch, critic, hf_state=state, pg_collection=policy.pg)

    def executors(self) -> dict[str, MegatronTrainer]:
        return {"critic": self.critic} if self.critic is not None else {}

    def prepare_step(self, groups, trainer_version):
        algorithm = self.config.algorithm
        # every sample teaches the critic, the uninformative groups included
        step = self.build_batch(groups, trainer_version, drop_uninformative=False)
        if step.batch is None:
            return step, None
        batch = step.batch
        batch.values = self.critic.token_values(batch) * (batch.loss_mask != 0)
        advantages, returns = gae_advantages(batch.advantages.double(), batch.values.double(), batch.loss_mask,
                                             gamma=algorithm.advantage.gamma, lam=algorithm.advantage.lam)
        batch.advantages, batch.returns = advantages.float(), returns.float()
        step.metrics.update(value_metrics(batch))
        share = self.critic.data_parallel_share(batch)
        step.metrics.update(self.critic.update(share, normalizer=max(float((batch.loss_mask != 0).sum()), 1.0)))
        if trainer_version < algorithm.critic.warmup_steps:
            step.metrics["critic/warmup"] = 1.0
            return dataclasses.replace(step, batch=None), None
        return step, self.loss_hook(step)


class DistillationObjective(PolicyGradientObjective):
    """On-policy distillation (`algorithm.objective: distill`; GKD, Agarwal et al. 2024, arXiv 2306.13649;
    Qwen3, arXiv 2505.09388; Thinking Machines' "On-Policy Distillation", 2025): the student samples, a
    frozen teacher scores the sampled tokens, and each token's advantage is

        A_t = coef * (log pi_teacher(y_t) - log mu(y_t) - b) + rl_coef * A_reward

    (mu: the engine's log-prob of the token it sampled, the student's behaviour policy; b: with `baseline`,
    the step's mean log-ratio over its loss tokens, else 0). With the configured
    policy loss, the gradient is that of the per-token reverse KL(pi || pi_teacher) on the student's own
    samples (discount 0: each token is charged its own divergence), importance-corrected for staleness like
    any other advantage. The teacher runs forward-only on the policy's ranks (any supported family and
    size with the student's tokenizer), or behind an OpenAI-compatible URL returning prompt log-probs.
    Logged: distill/reverse_kl (mean of log mu - log pi_teacher over the loss tokens, a k1 estimate),
    distill/teacher_logprob_mean."""

    def __init__(self, config, tokenizer, model=None, policy=None):
        super().__init__(config, tokenizer, model, policy)
        distill = config.algorithm.distill
        self.teacher = self.scorer = None
        if distill.teacher_is_url:
            self.scorer = PromptLogprobScorer(distill.teacher, model=distill.teacher_model, timeout=distill.timeout_s)
        elif policy is not None and model is not None:
            teacher = load_pretrained(distill.teacher)
            if teacher.tokenizer is not None and tokenizer is not None and \
                    teacher.tokenizer.hf_tokenizer.get_vocab() != tokenizer.hf_tokenizer.get_vocab():
                raise ValueError(f"algorithm.distill.teacher={distill.teacher!r}: its tokenizer differs from the "
                                 "student's (the teacher scores the student's token ids)")
            if teacher.arch.vocab_size < model.arch.vocab_size:
                raise ValueError(f"algorithm.distill.teacher={distill.teacher!r}: vocabulary {teacher.arch.vocab_size}"
                                 f" is smaller than the student's {model.arch.vocab_size}")
            self.teacher = MegatronTrainer(teacher.arch, policy.config, pg_collection=policy.pg,
                                           hf_state=teacher.state, frozen=True)

    def teacher_logprobs(self, batch) -> torch.Tensor:
        """[B, S] log pi_teacher of every token of `batch` (0 in column 0)."""
        if self.scorer is not None:  # each row up to its last loss token; rows without any (padding) are not sent
            rows = (batch.loss_mask != 0).any(-1).nonzero().flatten().tolist()
            last = _last_columns(batch.loss_mask)
            scored = self.scorer.score([batch.tokens[r, :int(last[r]) + 1].tolist() for r in rows])
            out = torch.zeros(batch.tokens.shape)
            for r, values in zip(rows, scored):
                out[r, :len(values)] = torch.tensor(values)
            return out
        if self.teacher is None:
            raise RuntimeError("objective distill built without the policy trainer has no teacher to score with")
        return self.teacher.compute_logprobs(batch)

    def prepare_step(self, groups, trainer_version):
        distill = self.config.algorithm.distill
        # every sample carries the teacher's signal, whatever its reward
        step = self.build_batch(groups, trainer_version, drop_uninformative=False)
        if step.batch is None:
            return step, None
        batch = step.batch
        m = batch.loss_mask != 0
        teacher = self.teacher_logprobs(batch)
        gap = torch.where(m, teacher - batch.behaviour_logprobs, torch.zeros_like(teacher))
        count = max(int(m.sum()), 1)
        step.metrics.update({"distill/reverse_kl": float(-gap.sum()) / count,
                             "distill/teacher_logprob_mean": float(teacher[m].sum()) / count})
        if distill.baseline:
            gap = torch.where(m, gap - float(gap.sum()) / count, gap)
        batch.advantages = distill.coef * gap + distill.rl_coef * batch.advantages
        return step, self.loss_hook(step)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()


def _last_columns(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last column with a loss token (0 for a row without any)."""
    m = mask != 0
    return torch.where(m.any(-1), m.shape[1] - 1 - m.flip(-1).to(torch.int8).argmax(-1), torch.zeros_like(m[:, 0],
                                                                                                        dtype=torch.long))


def value_metrics(batch) -> dict[str, float]:
    """critic/* statistics of the values the step's advantages were computed with: explained variance
    1 - Var(R - V) / Var(R) over the loss tokens (1: V predicts the returns; <= 0: no better than their
    mean), and the means of V and R."""
    m = batch.loss_mask != 0
    values, returns = batch.values[m].double(), batch.returns[m].double()
    if values.numel() < 2:
        return {}
    variance = returns.var()
    explained = 1.0 - (returns - values).var() / variance if variance > 0 else torch.tensor(float("nan"))
    return {"critic/explained_variance": float(explained), "critic/values_mean": float(values.mean()),
            "critic/returns_mean": float(returns.mean())}


def frozen_reference(config, model, policy):
    """The KL penalty's pi_ref (`algorithm.loss.kl_coef > 0`): a forward-only copy of the starting
    weights on the policy's own ranks and process groups (one extra forward per step, no backward).
    None without a KL term. A resumed run rebuilds it from `model`, the starting weights again."""
    if config.algorithm.loss.kl_coef <= 0 or policy is None:  # (an objective built only to filter data)
        return None
    if getattr(policy, "lora", None) is not None:  # the frozen base is the policy with its adapters off: no second copy
        return AdapterFreeBase(policy)
    return MegatronTrainer(model.arch, policy.config, pg_collection=policy.pg, hf_state=model.state, frozen=True)


class AdapterFreeBase:
    """pi_ref of a LoRA policy: the policy's own frozen base, scored with its adapters switched off."""

    def __init__(self, policy):
        self.policy = policy

    def compute_logprobs(self, batch):
        with self.policy.adapters_disabled():
            return self.policy.compute_logprobs(batch)


def reference_logprobs(reference_model, batch):
    if reference_model is None:
        raise RuntimeError("algorithm.loss.kl_coef > 0 needs a reference model: build the objective with the "
                           "pretrained model and the policy trainer (policy=...), whose process groups it shares")
    return reference_model.compute_logprobs(batch)
