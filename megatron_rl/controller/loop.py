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
from typing import Any

import torch
from tqdm import tqdm

from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.checkpoints_tools import load_pretrained
from megatron_rl.config import to_dict
from megatron_rl.controller.objectives import make_objective
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
    eval_before: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric of the starting policy (accuracy, and e.g. the likelihood bound)."""
    eval_after: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric after training."""


def make_engine(config: RunConfig, model):
    """The generator executor for the configured placement (see RolloutConfig.placement)."""
    rollout = config.rollout
    if rollout.placement == "disaggregated":
        from megatron_rl.controller.generator_process import GeneratorProcess

        torch.set_num_threads(rollout.trainer_threads)
        return GeneratorProcess(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine,
                                threads=rollout.generator_threads, verify_weights=rollout.verify_weight_sync)
    return NativeEngine(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine)


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
        self.objective = make_objective(config, self.tokenizer, model, policy=self.policy)
        del model
        self.reward = Reward(config.reward)
        self.train_data, self.heldout = self.objective.prepare_data(*build_datasets(config.data))
        self.stream = PromptStream.from_config(self.train_data, config.data)
        self.version = 0
        os.makedirs(config.run_dir, exist_ok=True)
        self.timeline = Timeline(os.path.join(config.run_dir, "timeline_rank0.json"))
        self.rollouts = RolloutProducer(self.engine, self.tokenizer, self.stream, self.reward, config.rollout,
                                        seed=config.seed, timeline=self.timeline)

    def sync_weights(self) -> float:
        start = time.perf_counter()
        with self.timeline.span("weight_sync", version=self.version):
            pause = self.config.rollout.weight_update == "pause"
            if pause:
                self.engine.pause()
            self.engine.update_weights(self.policy.export_hf_state(), self.version)
            if pause:
                self.engine.flush_cache()
                self.engine.resume()
        return time.perf_counter() - start

    def evaluate(self) -> dict[str, float]:
        with self.timeline.span("evaluate"):
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        result = evaluate(self.engine, self.tokenizer, list(self.heldout), self.reward,
                          max_new_tokens=self.config.eval.max_new_tokens, progress=True)
        if "likelihood" in self.config.eval.metrics:
            from megatron_rl.rewards.likelihood import evaluate_likelihood

            result.update(evaluate_likelihood(self.engine, self.policy, self.tokenizer, list(self.heldout),
                                              self.config.eval.likelihood, seed=self.config.seed))
        return {f"eval/{k}": v for k, v in result.items()}

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        reward_before = self.rollouts.reward_time
        with self.timeline.span("wait_for_rollouts", version=self.version):
            groups = self.rollouts.next_groups(self.version)
        generated = time.perf_counter()
        step, loss_fn = self.objective.prepare_step(groups, self.version)
        metrics = dict(step.metrics)
        if step.batch is not None:
            with self.timeline.span("train", version=self.version, rows=step.batch.batch_size):
                metrics.update(self.policy.train_step(step.batch, loss_fn))
        trained = time.perf_counter()
        self.version += 1
        sync_time = self.sync_weights()
        elapsed = time.perf_counter() - start
        reward_time = self.rollouts.reward_time - reward_before
        metrics.update({"perf/generate_time": generated - start - reward_time, "perf/reward_time": reward_time,
                        "perf/train_time": trained - generated,
                        "perf/weight_sync_time": sync_time, "perf/step_time": elapsed,
                        "perf/tokens_per_s": metrics["rollout/response_tokens"] / max(elapsed, 1e-9),
                        "train/version": float(self.version)})
        return metrics

    def close(self) -> None:
        self.timeline.write()
        self.engine.close()


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
            saved = checkpoints.load(latest, controller.policy)
            start_step, controller.version = saved["step"], saved["version"]
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
            state["eval_before"] = before
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
                         final_metrics=metrics, eval_before=state.get("eval_before", {}),
                         eval_after={k: v for k, v in after.items() if v is not None})
    with open(os.path.join(config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(summary), f, indent=2)
    return summary
