"""The RL loop: one loop for synchronous and asynchronous training.

    groups  = rollouts.next_groups(version)          # generate n samples per prompt, score them
    batch   = build_step_batch(groups, ...)          # advantages, behaviour log-probs, staleness
    metrics = policy.train_step(batch, loss_fn)      # recompute log pi, loss, backward, optimizer step
    engine.update_weights(policy weights, version)   # weight channel: trainer -> rollout engine

`rollout.max_staleness` decides how far generation may run ahead of training; 0 is on-policy.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from megatron_rl.algorithms import compute_normalizer, make_loss_fn
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.checkpoints_tools import load_pretrained
from megatron_rl.config import to_dict
from megatron_rl.controller.batching import build_step_batch
from megatron_rl.controller.rollouts import RolloutProducer, evaluate
from megatron_rl.data.sources import PromptStream, build_datasets
from megatron_rl.observability.metrics import MetricsLogger, write_plots
from megatron_rl.observability.timeline import Timeline
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.run_config import RunConfig
from megatron_rl.trainer.trainer import MegatronTrainer


@dataclasses.dataclass
class RunSummary:
    """What `summary.json` holds at the end of a run."""

    accuracy_before: float | None
    """Held-out greedy accuracy of the starting policy (fraction)."""
    accuracy_after: float | None
    """Held-out greedy accuracy after training (fraction)."""
    wall_time_s: float
    """Wall time of the whole run, set-up and evaluations included (summed over resumed segments)."""
    steps: int
    """Optimizer steps completed."""
    heldout_size: int
    """Held-out prompts evaluated."""
    reward_errors: int
    """Samples whose reward function failed (skipped, counted)."""
    final_metrics: dict[str, Any]
    """The last step's metrics."""


def make_engine(config: RunConfig, model):
    """The generator executor for the configured placement (see RolloutConfig.placement)."""
    rollout = config.rollout
    if rollout.placement == "disaggregated":
        from megatron_rl.controller.generator_process import GeneratorProcess

        torch.set_num_threads(rollout.trainer_threads)
        return GeneratorProcess(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine,
                                threads=rollout.generator_threads, verify_weights=rollout.verify_weight_sync)
    return NativeEngine(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine)


@dataclasses.dataclass
class PolicyExecutor:
    """One trained policy of a run: its Megatron trainer, its rollout engine and its objective.
    Single-agent runs hold one ('policy'); WaltzRL holds two ('policy' = conversation, 'feedback')."""

    name: str
    """The role its samples carry (Sample.role); metrics of non-primary policies are prefixed by it."""
    trainer: MegatronTrainer
    """The Megatron trainer."""
    engine: Any
    """The rollout engine generating with its weights."""
    algorithm: Any
    """Its AlgorithmConfig (advantage estimator and loss)."""
    version: int = 0
    """Weight version: optimizer steps applied to it (what its samples' staleness is measured against)."""


class Controller:
    """Owns the executors of a colocated run (trainer and engine share this process's cores)."""

    def __init__(self, config: RunConfig):
        self.config = config
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        model = load_pretrained(config.model.path)
        if model.tokenizer is None:
            raise ValueError(f"{config.model.path}: the model has no tokenizer (tokenizer.json) to render prompts")
        self.tokenizer = model.tokenizer
        self.policy = MegatronTrainer(model.arch, config.trainer, hf_state=model.state)
        self.engine = make_engine(config, model)
        self.policies = [PolicyExecutor("policy", self.policy, self.engine, config.algorithm)]
        self.version = 0
        os.makedirs(config.run_dir, exist_ok=True)
        self.timeline = Timeline(os.path.join(config.run_dir, "timeline_rank0.json"))
        # Hooks of multi-policy runs (set by e.g. setup_waltz): which policy trains at which step, and
        # the run's own held-out evaluation. None: every policy trains every step; accuracy evaluation.
        self.train_schedule: Callable[[PolicyExecutor, int], bool] | None = None
        self.evaluate_hook: Callable[[], dict[str, float]] | None = None
        episodes = None
        self.reward: Reward | None = None
        if config.waltz is not None:
            from megatron_rl.controller.waltz_run import setup_waltz

            self.train_data, self.heldout, episodes = setup_waltz(self, config, model)
        else:
            self.reward = Reward(config.reward)
            self.train_data, self.heldout = build_datasets(config.data)
        del model
        self.stream = PromptStream.from_config(self.train_data, config.data)
        self.rollouts = RolloutProducer(self.engine, self.tokenizer, self.stream, self.reward,
                                        config.rollout, seed=config.seed, timeline=self.timeline, episodes=episodes)

    def sync_weights(self, policy: PolicyExecutor | None = None) -> float:
        """Trainer -> engine weights of `policy` (default: every policy)."""
        start = time.perf_counter()
        for p in [policy] if policy is not None else self.policies:
            with self.timeline.span("weight_sync", version=p.version, policy=p.name):
                pause = self.config.rollout.weight_update == "pause"
                if pause:
                    p.engine.pause()
                p.engine.update_weights(p.trainer.export_hf_state(), p.version)
                if pause:
                    p.engine.flush_cache()
                    p.engine.resume()
        return time.perf_counter() - start

    def trains(self, policy: PolicyExecutor, step: int) -> bool:
        """Whether `policy` takes an optimizer step at training step `step` (multi-stage schedules)."""
        return self.train_schedule(policy, step) if self.train_schedule is not None else True

    def evaluate(self) -> dict[str, float]:
        with self.timeline.span("evaluate"):
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        if self.evaluate_hook is not None:
            return {f"eval/{k}": v for k, v in self.evaluate_hook().items()}
        result = evaluate(self.engine, self.tokenizer, list(self.heldout), self.reward,
                          max_new_tokens=self.config.eval.max_new_tokens, progress=True)
        return {f"eval/{k}": v for k, v in result.items()}

    def train_step(self) -> dict[str, float]:
        cfg = self.config
        start = time.perf_counter()
        reward_before = self.rollouts.reward_time
        self.rollouts.episodes.begin_step(self.version)
        with self.timeline.span("wait_for_rollouts", version=self.version):
            groups = self.rollouts.next_groups(self.version)
        generated = time.perf_counter()
        metrics: dict[str, float] = self.rollouts.episodes.pop_metrics()
        sync_time = train_time = 0.0
        response_tokens = 0.0
        for policy in self.policies:
            own = [dataclasses.replace(g, samples=[s for s in g.samples if s.role == policy.name]) for g in groups]
            prefix = "" if policy is self.policies[0] else f"{policy.name}/"
            policy_metrics = self._train_policy(policy, own)
            train_time += policy_metrics.pop("_train_time")
            response_tokens += policy_metrics["rollout/response_tokens"]
            metrics.update({prefix + k: v for k, v in policy_metrics.items()})
            if self.trains(policy, self.version):
                policy.version += 1
                sync_time += self.sync_weights(policy)
        self.version += 1
        elapsed = time.perf_counter() - start
        reward_time = self.rollouts.reward_time - reward_before
        metrics.update({"perf/generate_time": generated - start - reward_time, "perf/reward_time": reward_time,
                        "perf/train_time": train_time,
                        "perf/weight_sync_time": sync_time, "perf/step_time": elapsed,
                        "perf/tokens_per_s": response_tokens / max(elapsed, 1e-9),
                        "train/version": float(self.version)})
        return metrics

    def _train_policy(self, policy: PolicyExecutor, groups) -> dict[str, float]:
        cfg, algorithm = self.config, policy.algorithm
        step = build_step_batch(groups, advantage=algorithm.advantage, trainer_version=policy.version,
                                micro_batch_size=policy.trainer.config.micro_batch_size,
                                pad_token_id=self.tokenizer.pad_token_id,
                                drop_uninformative=cfg.rollout.drop_uninformative_groups and algorithm.loss.kl_coef == 0
                                and algorithm.loss.entropy_coef == 0)
        metrics = dict(step.metrics)
        started = time.perf_counter()
        if step.batch is not None and self.trains(policy, self.version):
            normalizer = compute_normalizer(step.full_loss_mask, algorithm.loss)
            with self.timeline.span("train", version=policy.version, rows=step.batch.batch_size, policy=policy.name):
                metrics.update(policy.trainer.train_step(step.batch, make_loss_fn(algorithm.loss, normalizer)))
        metrics["_train_time"] = time.perf_counter() - started
        return metrics

    def close(self) -> None:
        self.timeline.write()
        for policy in self.policies:
            policy.engine.close()


def train(config: RunConfig, *, resume: bool = False) -> RunSummary:
    """Run (or resume) training as `config` says; write metrics, plots, checkpoints and summary.json."""
    started = time.perf_counter()
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_dict(config), f, indent=2)
    controller = Controller(config)
    checkpoints = CheckpointManager(config.run_dir, config.checkpoint)
    state: dict[str, Any] = {"accuracy_before": None, "reward_errors": 0, "wall_time_s": 0.0}
    start_step = 0
    if resume:
        latest = checkpoints.latest()
        if latest is None:
            print(f"--resume: no complete checkpoint in {checkpoints.root}; starting from scratch")
        else:
            if len(controller.policies) > 1:
                raise ValueError("--resume of a multi-policy (waltz) run is not supported yet; start a new run_dir")
            saved = checkpoints.load(latest, controller.policy)
            start_step, controller.version = saved["step"], saved["version"]
            controller.policies[0].version = controller.version
            controller.stream.load_state_dict(saved["data"])
            controller.rollouts.resume_at(start_step)
            state.update(saved["controller"])
            controller.sync_weights()
            print(f"resumed from {latest} at step {start_step} (version {controller.version})")
    logger = MetricsLogger(config.run_dir, config.logging, to_dict(config), resume=resume and start_step > 0)
    metrics: dict[str, float] = {}
    try:
        if start_step == 0 and config.eval.before_training:
            before = controller.evaluate()
            state["accuracy_before"] = before["eval/accuracy"]
            logger.log(0, before)
            print(f"held-out accuracy before training: {before['eval/accuracy']:.3f} ({len(controller.heldout)} prompts)")
        progress = tqdm(range(start_step, config.steps), desc="train", initial=start_step, total=config.steps,
                        disable=config.logging.console_every > 0)
        for step in progress:
            metrics = controller.train_step()
            state["reward_errors"] += int(metrics["rollout/reward_errors"])
            done = step + 1
            if config.eval.every_steps and done % config.eval.every_steps == 0 and done < config.steps:
                metrics.update(controller.evaluate())
            if (config.checkpoint.every_steps and done % config.checkpoint.every_steps == 0) or (
                    done == config.steps and config.checkpoint.save_at_end):
                tick = time.perf_counter()
                segment = state["wall_time_s"] + (tick - started)
                checkpoints.save(done, controller.policy, {
                    "version": controller.version, "data": controller.stream.state_dict(),
                    "controller": {**state, "wall_time_s": segment}}, tokenizer=controller.tokenizer)
                for policy in controller.policies[1:]:  # further policies: RUN_DIR/<name>/checkpoints
                    CheckpointManager(os.path.join(config.run_dir, policy.name), config.checkpoint).save(
                        done, policy.trainer, {"version": policy.version}, tokenizer=controller.tokenizer)
                metrics["perf/checkpoint_time"] = time.perf_counter() - tick
            logger.log(done, metrics)
        after = {"eval/accuracy": None}
        if config.eval.after_training:
            after = controller.evaluate()
            logger.log(config.steps, after)
            print(f"held-out accuracy after training: {after['eval/accuracy']:.3f}"
                  + (f" (before: {state['accuracy_before']:.3f})" if state["accuracy_before"] is not None else ""))
    finally:
        logger.close()
        controller.close()
    if config.logging.plots:
        write_plots(config.run_dir)
    summary = RunSummary(accuracy_before=state["accuracy_before"], accuracy_after=after["eval/accuracy"],
                         wall_time_s=state["wall_time_s"] + time.perf_counter() - started, steps=config.steps,
                         heldout_size=len(controller.heldout), reward_errors=state["reward_errors"],
                         final_metrics=metrics)
    with open(os.path.join(config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(summary), f, indent=2)
    return summary
