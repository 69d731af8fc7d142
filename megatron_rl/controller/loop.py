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


def engine_weights(config: RunConfig, state):
    """The trainer's HF-named weights as the generator runs them: rounded through block-wise fp8 when
    `cluster.generator.precision` is fp8 (LlamaRL's fp8 generators), else unchanged."""
    generator = config.cluster.generator
    if generator.precision != "fp8" or generator.backend == "sglang":  # SGLang runs real fp8 GEMMs itself
        return state
    from megatron_rl.weight_sync.fp8 import fake_quantize_state

    return fake_quantize_state(state, generator.fp8_block_size)


def make_engine(config: RunConfig, model):
    """The generator executor for the configured placement (see RolloutConfig.placement)."""
    rollout = config.rollout
    generator = config.cluster.generator
    if generator.urls:  # a generator group of SGLang servers (examples/slurm_common.sh starts them)
        import socket

        from megatron_rl.rollout.pool import EnginePool

        return EnginePool.for_sglang_servers(generator.urls, engine_tp=generator.engine_tp,
                                             master_address=socket.getfqdn(), master_port=generator.weight_update_group_port,
                                             precision=generator.precision, fp8_block_size=generator.fp8_block_size)
    if generator.backend == "sglang":  # one in-process SGLang engine on this machine's GPUs
        from megatron_rl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(config.model.path, tp_size=generator.engine_tp,
                            **({"quantization": "fp8"} if generator.precision == "fp8" else {}))
    if rollout.placement == "disaggregated":
        from megatron_rl.controller.generator_process import GeneratorProcess

        torch.set_num_threads(rollout.trainer_threads)
        return GeneratorProcess(model.arch, engine_weights(config, model.state), tokenizer=model.tokenizer, config=config.engine,
                                threads=rollout.generator_threads, verify_weights=rollout.verify_weight_sync)
    return NativeEngine(model.arch, engine_weights(config, model.state), tokenizer=model.tokenizer,
                        config=config.engine)


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
        del model
        self.reward = Reward(config.reward)
        self.train_data, self.heldout = build_datasets(config.data)
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
            self.engine.update_weights(engine_weights(self.config, self.policy.export_hf_state()), self.version)
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
        return {f"eval/{k}": v for k, v in result.items()}

    def train_step(self) -> dict[str, float]:
        cfg = self.config
        start = time.perf_counter()
        reward_before = self.rollouts.reward_time
        with self.timeline.span("wait_for_rollouts", version=self.version):
            groups = self.rollouts.next_groups(self.version)
        generated = time.perf_counter()
        step = build_step_batch(groups, advantage=cfg.algorithm.advantage, trainer_version=self.version,
                                micro_batch_size=cfg.trainer.micro_batch_size, pad_token_id=self.tokenizer.pad_token_id,
                                drop_uninformative=cfg.rollout.drop_uninformative_groups and cfg.algorithm.loss.kl_coef == 0
                                and cfg.algorithm.loss.entropy_coef == 0)
        metrics = dict(step.metrics)
        if step.batch is not None:
            normalizer = compute_normalizer(step.full_loss_mask, cfg.algorithm.loss)
            with self.timeline.span("train", version=self.version, rows=step.batch.batch_size):
                metrics.update(self.policy.train_step(step.batch, make_loss_fn(cfg.algorithm.loss, normalizer)))
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
                         final_metrics=metrics)
    with open(os.path.join(config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(summary), f, indent=2)
    return summary
