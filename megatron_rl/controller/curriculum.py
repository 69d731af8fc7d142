"""Prompt selection between the prompt stream and the rollout producer: a curriculum chosen by config.

The `RolloutProducer` asks its selector for each step's prompts and hands it the scored groups; the
controller reports each trained step's groups back. One interface, used the same way by the
synchronous and the asynchronous loop:

    prompts = selector.draw(stream, m, step)        # which prompts to generate for `step`: (index, prompt)
    groups  = selector.keep_groups(groups, m)       # which scored groups the step trains on
    metrics = selector.observe(groups, step)        # after the policy step: learn from the rollouts

Kinds (`curriculum.kind`):
- none:             the next m prompts of the stream (plain GRPO).
- prefilter:        before training, roll out `prefilter_pool` prompts once with the initial policy
                    and keep those with mixed rewards; train on that subset.
- dynamic_sampling: DAPO (Yu et al. 2025, arXiv 2503.14476): roll out k*m candidates, keep up to m
                    groups with mixed rewards (DAPO samples more batches when fewer than m qualify;
                    here the step trains on the ones it has and logs how many were short).
- pcl:              Prompt Curriculum Learning (Gao, Kim, Sun et al. 2025, arXiv 2510.01135): a value
                    model scores k*m candidates in one forward pass, the m with V(x) closest to tau are
                    generated, and V is regressed on their observed mean rewards after the step, so it
                    lags the policy by one step (optionally with a replay of the most recent earlier
                    pairs, `curriculum.value.replay_prompts`: a departure for small m).

The value model is its own executor (`ValueTrainer`): on the policy trainer's ranks and process groups,
with its own weights and optimizer; in the disaggregated placement its updates, like the policy's,
overlap the generator process's generation. A selector's executors (`executors()`) are checkpointed
with the run, each under RUN_DIR/<name>/checkpoints (`save_executors` / `load_executors`), and its
plain state (`state_dict()`) inside the run's checkpoint, so a resumed PCL run continues with the
value model and optimizer state it had.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Literal

import torch

from megatron_rl.algorithms.pcl import explained_variance, has_mixed_rewards, select_closest_to_target, value_targets
from megatron_rl.config import require
from megatron_rl.controller.producer import Group
from megatron_rl.data.sources import Prompt, PromptDataset, PromptStream
from megatron_rl.trainer.value import ValueModelConfig


@dataclasses.dataclass(kw_only=True)
class CurriculumConfig:
    """Which prompts each step generates: all (none), a pre-filtered subset, dynamic sampling, or PCL."""

    kind: Literal["none", "prefilter", "dynamic_sampling", "pcl"] = "none"
    """none: plain stream order; prefilter: mixed-reward prompts of one initial rollout; dynamic_sampling:
    roll out k*m, keep mixed-reward groups (DAPO); pcl: value-model selection (PCL)."""
    candidates_factor: int = 4
    """k: candidates drawn per selected prompt (dynamic_sampling and pcl draw k*m prompts a step)."""
    target: float = 0.5
    """tau: pcl keeps the m candidates whose predicted reward V(x) is closest to it."""
    prefilter_pool: int = 256
    """prefilter: prompts rolled out once (n samples each) with the initial policy before training."""
    value: ValueModelConfig = dataclasses.field(default_factory=ValueModelConfig)
    """pcl: the value model."""

    def __post_init__(self) -> None:
        require(self.candidates_factor >= 1, "candidates_factor", "must be >= 1")
        require(self.prefilter_pool >= 1, "prefilter_pool", "must be >= 1")


def _rewards(group: Group) -> list[float]:
    return [s.reward.reward for s in group.samples if s.reward.ok]


class PromptSelector:
    """Plain stream order (curriculum.kind none); the base of the other selectors."""

    def prepare(self, producer) -> dict[str, float]:
        """Once, before training (after the engine holds the initial weights)."""
        return {}

    def draw(self, stream: PromptStream, count: int, step: int) -> list[tuple[int, Prompt]]:
        """The prompts to generate for `step`, each with its index in the training data set."""
        return stream.next_indexed(count)

    def keep_groups(self, groups: list[Group], count: int) -> list[Group]:
        return groups

    def observe(self, groups: list[Group], step: int) -> dict[str, float]:
        return {}

    def executors(self) -> dict[str, Any]:
        """Trainers the selector owns, by name: checkpointed with the run (`save_executors`)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state saved in the run's checkpoint and restored on resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Prefilter(PromptSelector):
    """Pre-filtering once: the pool's prompts whose initial-policy rollouts had mixed rewards."""

    def __init__(self, config: CurriculumConfig, data_config):
        self.config = config
        self.data_config = data_config
        self.stream: PromptStream | None = None
        self.kept_indices: list[int] = []  # prefiltered position -> training data set index
        self._restored: dict[str, Any] | None = None

    def prepare(self, producer) -> dict[str, float]:
        if self._restored is not None:  # a resumed run: the filtered subset and its cursor, no new rollouts
            self._keep(producer.stream.dataset, [int(i) for i in self._restored["kept_indices"]])
            self.stream.load_state_dict(self._restored["stream"])
            print(f"prefilter: restored {len(self.kept_indices)} prompts from the checkpoint")
            return {}
        start = time.perf_counter()
        pool = producer.stream.next_indexed(self.config.prefilter_pool)
        groups = producer.rollout([prompt for _, prompt in pool], tag="prefilter", seed=7919)
        kept = [index for (index, _), g in zip(pool, groups) if has_mixed_rewards(_rewards(g))]
        if not kept:
            raise RuntimeError(f"curriculum.kind=prefilter: none of the {len(pool)} pool prompts had mixed rewards "
                               "under the initial policy; raise curriculum.prefilter_pool")
        self._keep(producer.stream.dataset, kept)
        print(f"prefilter: kept {len(kept)} of {len(pool)} prompts ({time.perf_counter() - start:.1f} s)")
        return {"curriculum/prefilter_kept": float(len(kept)), "curriculum/prefilter_pool": float(len(pool)),
                "curriculum/prefilter_time": time.perf_counter() - start}

    def _keep(self, dataset: PromptDataset, indices: list[int]) -> None:
        self.kept_indices = indices
        self.stream = PromptStream(PromptDataset("prefiltered", [dataset[i] for i in indices]),
                                   seed=self.data_config.shuffle_seed, shuffle=self.data_config.shuffle)

    def state_dict(self) -> dict[str, Any]:
        # Which prompts passed the filter and where the filtered stream is: a resumed run continues
        # with them instead of filtering again with the (by then trained) policy.
        if self.stream is None:
            return {}
        return {"kept_indices": list(self.kept_indices), "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes effect in `prepare` (which needs the training data set); a state without the filtered
        subset (a checkpoint from before it was saved) filters again."""
        self._restored = state if state.get("kept_indices") else None

    def draw(self, stream: PromptStream, count: int, step: int) -> list[tuple[int, Prompt]]:
        if self.stream is None:
            raise RuntimeError("Prefilter.prepare() must run before training")
        return [(self.kept_indices[i], prompt) for i, prompt in self.stream.next_indexed(count)]


class DynamicSampling(PromptSelector):
    """DAPO dynamic sampling: generate k*m candidates, train on up to m groups with mixed rewards."""

    def __init__(self, config: CurriculumConfig):
        self.config = config
        self._metrics: dict[str, float] = {}

    def draw(self, stream: PromptStream, count: int, step: int) -> list[tuple[int, Prompt]]:
        return stream.next_indexed(count * self.config.candidates_factor)

    def keep_groups(self, groups: list[Group], count: int) -> list[Group]:
        mixed = [g for g in groups if has_mixed_rewards(_rewards(g))]
        self._metrics = {"curriculum/candidates": float(len(groups)), "curriculum/mixed_candidates": float(len(mixed)),
                         "curriculum/short_groups": float(max(count - len(mixed), 0))}
        return mixed[:count]

    def observe(self, groups: list[Group], step: int) -> dict[str, float]:
        return self._metrics


class PCLSelector(PromptSelector):
    """Value-model selection at intermediate difficulty; V trained on each step's rollouts."""

    def __init__(self, config: CurriculumConfig, value_model, tokenizer):
        self.config = config
        self.value = value_model
        self.tokenizer = tokenizer
        self._predicted: dict[str, float] = {}  # prompt id -> V(x) at selection time
        self._draw_metrics: dict[int, dict[str, float]] = {}
        self._history: list[tuple[float, float]] = []  # (predicted, realised) over the run
        self._replay: list[tuple[list[int], float]] = []  # recent (prompt tokens, mean reward), oldest first

    def draw(self, stream: PromptStream, count: int, step: int) -> list[tuple[int, Prompt]]:
        start = time.perf_counter()
        indexed = stream.next_indexed(count * self.config.candidates_factor)
        candidates = [prompt for _, prompt in indexed]
        values = self.value.predict([self.tokenizer.encode_chat(p.messages) for p in candidates],
                                    pad_token_id=self.tokenizer.pad_token_id)
        chosen = select_closest_to_target(values, count, self.config.target)
        for i in chosen:
            self._predicted[candidates[i].prompt_id] = float(values[i])
        self._draw_metrics[step] = {
            "curriculum/select_time": time.perf_counter() - start,
            "curriculum/candidate_value_mean": float(values.mean()),
            "curriculum/candidate_value_std": float(values.std()) if len(values) > 1 else 0.0,
            "curriculum/selected_value_mean": float(values[chosen].mean()),
            "curriculum/selected_distance_mean": float((values[chosen] - self.config.target).abs().mean()),
        }
        return [indexed[i] for i in chosen]

    def executors(self) -> dict[str, Any]:
        return {"value": self.value}

    def state_dict(self) -> dict[str, Any]:
        # Predictions of prompts drawn but not yet observed (asynchronous runs), the run's
        # (predicted, realised) pairs behind curriculum/value_explained_variance_run, and V's replay.
        return {"predicted": dict(self._predicted), "history": [list(pair) for pair in self._history],
                "replay": [[list(tokens), target] for tokens, target in self._replay]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._predicted = dict(state.get("predicted", {}))
        self._history = [tuple(pair) for pair in state.get("history", [])]
        self._replay = [(list(tokens), float(target)) for tokens, target in state.get("replay", [])]

    def observe(self, groups: list[Group], step: int) -> dict[str, float]:
        metrics = dict(self._draw_metrics.pop(step, {}))
        groups = [g for g in groups if _rewards(g)]
        if not groups:
            return metrics
        realised = value_targets([_rewards(g) for g in groups])
        predicted = torch.tensor([self._predicted.pop(g.prompt.prompt_id, float("nan")) for g in groups])
        known = ~torch.isnan(predicted)
        self._history.extend(zip(predicted[known].tolist(), realised[known].tolist()))
        history = torch.tensor(self._history) if self._history else torch.zeros(0, 2)
        metrics.update({
            "curriculum/predicted_reward_mean": float(predicted[known].mean()) if known.any() else float("nan"),
            "curriculum/realised_reward_mean": float(realised.mean()),
            "curriculum/value_abs_error": float((predicted[known] - realised[known]).abs().mean()) if known.any() else float("nan"),
            "curriculum/value_explained_variance": explained_variance(predicted[known], realised[known]),
            "curriculum/value_explained_variance_run": explained_variance(history[:, 0], history[:, 1]),
        })
        start = time.perf_counter()
        # V is regressed on this step's groups and the replay of earlier steps' (value.replay_prompts).
        current = [(self.tokenizer.encode_chat(g.prompt.messages), float(r)) for g, r in zip(groups, realised.tolist())]
        batch = current + self._replay
        metrics.update(self.value.update([tokens for tokens, _ in batch], torch.tensor([t for _, t in batch]),
                                         pad_token_id=self.tokenizer.pad_token_id))
        keep = self.config.value.replay_prompts
        self._replay = (self._replay + current)[-keep:] if keep else []
        metrics["curriculum/value_update_time"] = time.perf_counter() - start
        metrics["curriculum/value_train_prompts"] = float(len(batch))
        return metrics


def save_executors(selector: PromptSelector, run_dir: str, config, step: int, tokenizer=None) -> None:
    """Checkpoint step `step` of each of the selector's executors (weights, optimizer, scheduler) under
    RUN_DIR/<name>/checkpoints, as the run's further policies are. Call it before the run's own
    checkpoint of that step: that one's `latest` pointer commits the step, so a resumable step always
    has its executors' checkpoints."""
    from megatron_rl.checkpoint.manager import CheckpointManager

    for name, trainer in selector.executors().items():
        CheckpointManager(os.path.join(run_dir, name), config).save(step, trainer, {"executor": name},
                                                                    tokenizer=tokenizer)


def load_executors(selector: PromptSelector, run_dir: str, config, checkpoint: str) -> None:
    """Restore the selector's executors from their checkpoints of the same step as the run's
    `checkpoint` (a step directory). Call it before loading the run's checkpoint (whose RNG state must
    be the one that stays). A missing or unusable executor checkpoint is an error naming it: resuming
    with a fresh value model would silently change the curriculum."""
    from megatron_rl.checkpoint.manager import CheckpointError, CheckpointManager

    for name, trainer in selector.executors().items():
        manager = CheckpointManager(os.path.join(run_dir, name), config)
        path = os.path.join(manager.root, os.path.basename(os.path.normpath(checkpoint)))
        problem = manager.validate(path) if os.path.isfile(os.path.join(path, "COMPLETE")) else "no complete checkpoint"
        if problem is not None:
            raise CheckpointError(f"{path}: the '{name}' executor's checkpoint for {checkpoint} is unusable "
                                  f"({problem}); the run cannot resume with its state")
        manager.load(path, trainer)


def build_value_model(config: ValueModelConfig, *, policy_arch, policy_state, pg_collection):
    """The value executor, initialised from the policy's starting weights or from `config.init_from`."""
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.trainer.value import ValueTrainer

    arch, state = policy_arch, policy_state
    if config.init_from != "policy":
        source = load_pretrained(config.init_from)
        if source.arch.vocab_size != policy_arch.vocab_size:
            raise ValueError(f"curriculum.value.init_from={config.init_from!r}: vocabulary {source.arch.vocab_size} "
                             f"differs from the policy's {policy_arch.vocab_size} (the value model reads the "
                             "policy's prompt tokens)")
        arch, state = source.arch, source.state
    return ValueTrainer(arch, config, hf_state=state, pg_collection=pg_collection)


def build_selector(config: CurriculumConfig, *, data_config, tokenizer, policy_arch=None, policy_state=None,
                   pg_collection=None) -> PromptSelector:
    if config.kind == "none":
        return PromptSelector()
    if config.kind == "prefilter":
        return Prefilter(config, data_config)
    if config.kind == "dynamic_sampling":
        return DynamicSampling(config)
    value = build_value_model(config.value, policy_arch=policy_arch, policy_state=policy_state,
                              pg_collection=pg_collection)
    return PCLSelector(config, value, tokenizer)
