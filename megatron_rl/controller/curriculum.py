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

import logging
import os
import time
from typing import Any

from megatron_rl.algorithms.pcl import has_mixed_rewards
from megatron_rl.checkpoint.manager import CheckpointError, CheckpointManager
from megatron_rl.controller.config import SELECTORS, CurriculumConfig
from megatron_rl.controller.episodes import BASELINE_ROLE, Group
from megatron_rl.data.prompts import Prompt, PromptDataset
from megatron_rl.data.sources import PromptStream

log = logging.getLogger(__name__)


def scored_rewards(group: Group) -> list[float]:
    """The rewards of a group's trained samples that were scored without error (not a baseline response's)."""
    return [s.reward.reward for s in group.samples if s.reward.ok and s.role != BASELINE_ROLE]


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
            log.info(f"prefilter: restored {len(self.kept_indices)} prompts from the checkpoint")
            return {}
        start = time.perf_counter()
        pool = producer.stream.next_indexed(self.config.prefilter_pool)
        groups = producer.rollout([prompt for _, prompt in pool], tag="prefilter", seed=7919)
        kept = [index for (index, _), g in zip(pool, groups) if has_mixed_rewards(scored_rewards(g))]
        if not kept:
            raise RuntimeError(f"curriculum.kind=prefilter: none of the {len(pool)} pool prompts had mixed rewards "
                               "under the initial policy; raise curriculum.prefilter_pool")
        self._keep(producer.stream.dataset, kept)
        log.info(f"prefilter: kept {len(kept)} of {len(pool)} prompts ({time.perf_counter() - start:.1f} s)")
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
        mixed = [g for g in groups if has_mixed_rewards(scored_rewards(g))]
        self._metrics = {"curriculum/candidates": float(len(groups)), "curriculum/mixed_candidates": float(len(mixed)),
                         "curriculum/short_groups": float(max(count - len(mixed), 0))}
        return mixed[:count]

    def observe(self, groups: list[Group], step: int) -> dict[str, float]:
        return self._metrics


def save_executors(selector: PromptSelector, run_dir: str, config, step: int, tokenizer=None) -> None:
    """Checkpoint step `step` of each of the selector's executors (weights, optimizer, scheduler) under
    RUN_DIR/<name>/checkpoints, as the run's further policies are. Call it before the run's own
    checkpoint of that step: that one's `latest` pointer commits the step, so a resumable step always
    has its executors' checkpoints."""
    for name, trainer in selector.executors().items():
        CheckpointManager(os.path.join(run_dir, name), config).save(step, trainer, {"executor": name},
                                                                    tokenizer=tokenizer)


def load_executors(selector: PromptSelector, run_dir: str, config, checkpoint: str) -> None:
    """Restore the selector's executors from their checkpoints of the same step as the run's
    `checkpoint` (a step directory). Call it before loading the run's checkpoint (whose RNG state must
    be the one that stays). A missing or unusable executor checkpoint is an error naming it: resuming
    with a fresh value model would silently change the curriculum."""
    for name, trainer in selector.executors().items():
        manager = CheckpointManager(os.path.join(run_dir, name), config)
        path = os.path.join(manager.root, os.path.basename(os.path.normpath(checkpoint)))
        problem = manager.validate(path) if os.path.isfile(os.path.join(path, "COMPLETE")) else "no complete checkpoint"
        if problem is not None:
            raise CheckpointError(f"{path}: the '{name}' executor's checkpoint for {checkpoint} is unusable "
                                  f"({problem}); the run cannot resume with its state")
        manager.load(path, trainer)


def build_selector(config: CurriculumConfig, *, data_config, tokenizer, policy_arch=None, policy_state=None,
                   pg_collection=None) -> PromptSelector:
    if config.kind == "none":
        return PromptSelector()
    if config.kind == "prefilter":
        return Prefilter(config, data_config)
    if config.kind == "dynamic_sampling":
        return DynamicSampling(config)
    # Curricula that bring their own executors (PCL's value model, a user's) live with their recipe.
    return SELECTORS.resolve(config.kind)(config, tokenizer=tokenizer, policy_arch=policy_arch,
                                          policy_state=policy_state, pg_collection=pg_collection)
