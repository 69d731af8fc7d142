"""The RL loop: one loop for synchronous and asynchronous training.

    groups  = rollouts.next_groups(version)          # generate n samples per prompt, score them
    batch   = build_step_batch(groups, ...)          # advantages, behaviour log-probs, staleness
    metrics = policy.train_step(batch, loss_fn)      # recompute log pi, loss, backward, optimizer step
    weights.push(version)                             # weight channel: trainer shards -> rollout engine

`rollout.max_staleness` decides how far generation may run ahead of training; 0 is on-policy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from megatron_rl.checkpoint.manager import COMPLETE, CheckpointError, CheckpointManager
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.config import ConfigError, to_dict
from megatron_rl import ranks
from megatron_rl.placement.core_share import CoreShare
from megatron_rl.placement.generator_ranks import current_launch, join_launch, serve_generator_rank, trainer_world_size
from megatron_rl.controller.curriculum import build_selector, load_executors, save_executors
from megatron_rl.controller.objectives import make_objective
from megatron_rl.controller.producer import RolloutProducer, evaluate
from megatron_rl.data.sources import PromptStream, build_datasets
from megatron_rl.observability.metrics import MetricsLogger, truncate_jsonl, write_plots
from megatron_rl.observability.timeline import Timeline
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.run_config import RunConfig
from megatron_rl.trainer.trainer import MegatronTrainer, load_policy
from megatron_rl.weight_sync.channel import make_weight_channel


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
    nonfinite_steps: int
    """Steps skipped because the loss or a gradient was NaN/Inf (weights untouched)."""
    skipped_prompts: int
    """Prompts skipped because they did not fit the engine's context (rollout.on_overlong_prompt=skip)."""
    checkpoint_failures: int
    """Checkpoint writes that failed during the run (the previous checkpoint stayed the latest)."""
    final_metrics: dict[str, Any]
    """The last step's metrics."""
    eval_before: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric of the starting policy (accuracy, and e.g. the likelihood bound)."""
    eval_after: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric after training."""


def engine_context(config: RunConfig, arch) -> int:
    """Tokens (prompt + response) one engine sequence holds: engine.max_seq_len capped by the model."""
    return min(config.engine.max_seq_len or arch.max_position_embeddings, arch.max_position_embeddings)


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
    if generator.launch_ranks:  # generator ranks of this launch (placement/generator_ranks.py)
        from megatron_rl.placement.generator_ranks import generator_rank_pool

        return generator_rank_pool(config)
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
        from megatron_rl.placement.generator_process import GeneratorProcess

        torch.set_num_threads(rollout.trainer_threads)
        # Lending makes the thread count, and so floating-point summation order, depend on timing.
        lend = (rollout.lend_idle_cores and not rollout.deterministic and config.waltz is None
                and ranks.world_size() == 1)
        cores = CoreShare(trainer_threads=rollout.trainer_threads, generator_threads=rollout.generator_threads) if lend else None
        return GeneratorProcess(model.arch, engine_weights(config, model.state), tokenizer=model.tokenizer, config=config.engine,
                                threads=rollout.generator_threads, verify_weights=rollout.verify_weight_sync,
                                core_share=cores)
    return NativeEngine(model.arch, engine_weights(config, model.state), tokenizer=model.tokenizer,
                        config=config.engine)


class TrainingDivergedError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


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
    objective: Any
    """Its training objective (controller/objectives.py): groups -> batch and loss hook."""
    weights: Any
    """Its weight channel (weight_sync/channel.py): trainer -> engine."""
    version: int = 0
    """Weight version: optimizer steps applied to it (what its samples' staleness is measured against)."""


def check_multi_rank_support(config: RunConfig, world: int) -> None:
    """Fail before any set-up when a run asks for what the multi-rank loop does not do yet."""
    if world == 1:
        return
    unsupported = []
    if config.waltz is not None:
        unsupported.append("waltz (two trainers on the same ranks)")
    if config.curriculum.kind == "pcl":
        unsupported.append("curriculum.kind=pcl (its value model scores candidates on the driver mid-draw)")
    if unsupported:
        raise ConfigError(f"this run has {world} trainer ranks (WORLD_SIZE); the multi-rank RL loop does not "
                          f"support yet: {'; '.join(unsupported)}. Run it on one trainer rank.")


class Controller:
    """Owns the executors of a run. Every trainer rank of the world constructs one and calls
    `train_step` in lockstep; rank 0, the driver, also holds the engines, the prompt stream and the
    rollout producer, and broadcasts each step's scored groups (ranks.py)."""

    def __init__(self, config: RunConfig, *, prepare_selection: bool = True):
        """`prepare_selection=False` leaves the curriculum's one-off preparation (`selector.prepare`,
        e.g. pre-filtering's rollouts) to the caller: a resuming run calls it after restoring the
        selector's state, which may make it unnecessary."""
        self.config = config
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        # Tensors are read when first needed: a trainer rank of a Megatron checkpoint at its own layout
        # reads only its shard; the whole model is loaded where an engine or a frozen copy needs it.
        model = load_pretrained(config.model.path, lazy=True)
        if model.tokenizer is None:
            raise ConfigError(f"{config.model.path}: the model has no tokenizer (tokenizer.json) to render prompts")
        self.tokenizer = model.tokenizer
        self.policy = load_policy(config.model.path, config.trainer, pretrained=model)
        self.is_driver = ranks.is_driver()
        self.engine = make_engine(config, model) if self.is_driver else None
        # A generator process on this host's cores: train on the cores it leaves idle too.
        self.cores: CoreShare | None = getattr(self.engine, "trainer_cores", None)
        if self.cores is not None:
            self.policy.between_layers = self.cores.apply
        value_from_policy = config.curriculum.kind == "pcl"  # PCL's value model starts from the policy's weights
        self.selector = build_selector(config.curriculum, data_config=config.data, tokenizer=self.tokenizer,
                                       policy_arch=model.arch, policy_state=model.state if value_from_policy else None,
                                       pg_collection=self.policy.pg) if self.is_driver else None
        self.objective = make_objective(config, self.tokenizer, model, policy=self.policy)
        self.weights = self.weight_channel(self.policy, self.engine)
        self.policies = [PolicyExecutor("policy", self.policy, self.engine, self.objective, self.weights)]
        # Hooks of multi-policy runs (set by e.g. setup_waltz): which policy trains at which step, and
        # the run's own held-out evaluation. None: every policy trains every step; accuracy evaluation.
        self.train_schedule: Callable[[PolicyExecutor, int], bool] | None = None
        self.evaluate_hook: Callable[[], dict[str, float]] | None = None
        episodes = None
        self.reward: Reward | None = None
        if config.waltz is not None:
            from megatron_rl.recipes.waltz.recipe import setup_waltz

            self.train_data, self.heldout, episodes = setup_waltz(self, config, model)
        elif self.is_driver:
            self.reward = Reward(config.reward)
            self.train_data, self.heldout = self.objective.prepare_data(*build_datasets(config.data))
        else:  # trainer ranks receive scored groups from the driver
            self.train_data, self.heldout = [], []
        del model
        self.version = 0
        self.last_prompt_ids: list[str] = []  # the prompts the last train_step consumed, in order
        os.makedirs(config.run_dir, exist_ok=True)
        self.timeline = Timeline(os.path.join(config.run_dir, f"timeline_rank{ranks.rank()}.json"),
                                 process_name=f"rank {ranks.rank()}")
        self.stream: PromptStream | None = None
        self.rollouts: RolloutProducer | None = None
        self.selection_metrics: dict[str, float] = {}
        if self.is_driver:
            self.stream = PromptStream.from_config(self.train_data, config.data)
            self.rollouts = RolloutProducer(self.engine, self.tokenizer, self.stream, self.reward, config.rollout,
                                            seed=config.seed, timeline=self.timeline,
                                            max_prompt_tokens=engine_context(config, self.policy.arch) - 1,
                                            selector=self.selector, episodes=episodes)
            if prepare_selection:
                self.selection_metrics = self.selector.prepare(self.rollouts)
        rollout = config.rollout
        remote_generators = bool(config.cluster.generator.launch_ranks or config.cluster.generator.urls)
        self.offload = (rollout.offload_idle and rollout.placement == "colocated" and rollout.max_staleness == 0
                        and len(self.policies) == 1 and not remote_generators)
        self._host = "cpu"
        self._device = self.policy._device()
        if self.offload:
            self.policy.move_optimizer_state(self._host)

    def weight_channel(self, trainer, engine):
        """The weight channel from `trainer` to `engine` (fp8 engines get block-rounded weights)."""
        generator = self.config.cluster.generator
        fp8_engine = generator.precision == "fp8" and generator.backend != "sglang"
        return make_weight_channel(trainer, engine, transform=(
            (lambda state: engine_weights(self.config, state)) if fp8_engine else None))

    def _memory_to_trainer(self) -> dict[str, float]:
        """Colocated offload: the idle engine's memory goes to the trainer for its step."""
        released = (self.engine.release_memory_occupation() if self.engine is not None else None) or {}
        moved = self.policy.move_optimizer_state(self._device)
        held = self.policy.memory_bytes()
        return {"memory/engine_kv_cache_released_bytes": float(released.get("kv_cache_bytes", 0)),
                "memory/engine_weights_offloaded_bytes": float(released.get("weight_bytes", 0)),
                "memory/trainer_optimizer_onloaded_bytes": float(moved),
                **{f"memory/trainer_{k}_bytes": float(v) for k, v in held.items()}}

    def _memory_to_engine(self) -> None:
        self.policy.move_optimizer_state(self._host)
        if self.engine is not None:
            self.engine.resume_memory_occupation()

    def sync_weights(self, policy: PolicyExecutor | None = None) -> float:
        """Trainer -> engine weights of `policy` (default: every policy)."""
        start = time.perf_counter()
        if self.config.rollout.deterministic and self.is_driver:  # responses in flight finish under the old weights
            self.rollouts.drain()
        for p in [policy] if policy is not None else self.policies:
            with self.timeline.span("weight_sync", version=p.version, policy=p.name):
                pause = self.config.rollout.weight_update == "pause" and p.engine is not None
                if pause:
                    p.engine.pause()
                p.weights.push(p.version)
                if pause:
                    p.engine.flush_cache()
                    p.engine.resume()
        return time.perf_counter() - start

    def trains(self, policy: PolicyExecutor, step: int) -> bool:
        """Whether `policy` takes an optimizer step at training step `step` (multi-stage schedules)."""
        return self.train_schedule(policy, step) if self.train_schedule is not None else True

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (eval/*) on the driver; {} on the other ranks. Every rank calls it (likelihood
        scoring runs on the trainer ranks)."""
        with self.timeline.span("evaluate"):
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        if not self.is_driver:
            if "likelihood" in self.config.eval.metrics:
                from megatron_rl.recipes.jepo.likelihood import evaluate_likelihood

                evaluate_likelihood(None, self.policy, self.tokenizer, [], self.config.eval.likelihood,
                                    seed=self.config.seed)
            return {}
        if self.evaluate_hook is not None:
            return {f"eval/{k}": v for k, v in self.evaluate_hook().items()}
        result = evaluate(self.engine, self.tokenizer, list(self.heldout), self.reward,
                          max_new_tokens=self.config.eval.max_new_tokens, progress=True)
        if "likelihood" in self.config.eval.metrics:
            from megatron_rl.recipes.jepo.likelihood import evaluate_likelihood

            result.update(evaluate_likelihood(self.engine, self.policy, self.tokenizer, list(self.heldout),
                                              self.config.eval.likelihood, seed=self.config.seed))
        return {f"eval/{k}": v for k, v in result.items()}

    def _next_groups(self) -> tuple[list, dict[str, float]]:
        """The step's scored groups on every rank (produced by the driver, broadcast to the trainer
        ranks) and the driver's rollout metrics ({} on the other ranks)."""
        groups, metrics = None, {}
        if self.is_driver:
            self.rollouts.begin_step(self.version)
            with self.timeline.span("wait_for_rollouts", version=self.version):
                groups = self.rollouts.next_groups(self.version)
            metrics = self.rollouts.pop_metrics()
            metrics["rollout/skipped_prompts"] = float(len(self.rollouts.last_skipped))
        if ranks.world_size() > 1:
            with self.timeline.span("broadcast_rollouts", version=self.version):
                groups = ranks.broadcast_records(groups)
        return groups, metrics

    def train_step(self) -> dict[str, float]:
        """One training step on every rank; the full metrics (rollout/*, perf/*) on the driver."""
        start = time.perf_counter()
        reward_before = self.rollouts.reward_time if self.is_driver else 0.0
        groups, metrics = self._next_groups()
        self.last_prompt_ids = [g.prompt.prompt_id for g in groups]
        generated = time.perf_counter()
        # The trainer works from here to the end of the weight sync; a core-sharing generator runs on
        # its own share meanwhile and on every core while the trainer waits for rollouts.
        with self.cores.working() if self.cores is not None else contextlib.nullcontext():
            sync_time = train_time = response_tokens = 0.0
            for policy in self.policies:
                own = groups if len(self.policies) == 1 else [
                    dataclasses.replace(g, samples=[s for s in g.samples if s.role == policy.name]) for g in groups]
                prefix = "" if policy is self.policies[0] else f"{policy.name}/"
                policy_metrics = self._train_policy(policy, own)
                train_time += policy_metrics.pop("perf/train_time")
                response_tokens += policy_metrics["rollout/response_tokens"]
                metrics.update({prefix + k: v for k, v in policy_metrics.items()})
            trained = time.perf_counter()
            if self.is_driver:
                metrics.update(self.selector.observe(groups, step=self.version))
            observed = time.perf_counter()
            for policy in self.policies:
                if self.trains(policy, self.version):
                    policy.version += 1
                    sync_time += self.sync_weights(policy)
        self.version += 1
        elapsed = time.perf_counter() - start
        reward_time = self.rollouts.reward_time - reward_before if self.is_driver else 0.0
        metrics.update({"perf/generate_time": generated - start - reward_time, "perf/reward_time": reward_time,
                        "perf/train_time": train_time, "perf/curriculum_time": observed - trained,
                        "rollout/generated_samples_total": float(self.rollouts.generated_samples if self.is_driver else 0),
                        "perf/weight_sync_time": sync_time, "perf/step_time": elapsed,
                        "perf/tokens_per_s": response_tokens / max(elapsed, 1e-9),
                        "train/version": float(self.version)})
        metrics.update(self.selection_metrics)  # the curriculum's one-off preparation, logged with step 1
        self.selection_metrics = {}
        return metrics

    def _train_policy(self, policy: PolicyExecutor, groups) -> dict[str, float]:
        """Batch `policy`'s samples with its objective and take its optimizer step (if it trains now)."""
        step, loss_fn = policy.objective.prepare_step(groups, policy.version)
        metrics = dict(step.metrics)
        started = time.perf_counter()
        if step.batch is not None and self.trains(policy, self.version):
            trainer = policy.trainer
            micro = trainer.config.micro_batch_size
            batch = step.batch.padded_rows(micro * trainer.dp_size).data_parallel_share(
                trainer.pg.dp.rank(), trainer.dp_size, micro)
            if self.offload:
                metrics.update(self._memory_to_trainer())
            with self.timeline.span("train", version=policy.version, rows=batch.batch_size, policy=policy.name):
                metrics.update(trainer.train_step(batch, loss_fn))
            if self.offload:
                self._memory_to_engine()
        metrics["perf/train_time"] = time.perf_counter() - started
        return metrics

    def close(self) -> None:
        self.timeline.write()
        for policy in self.policies:
            if policy.engine is not None:
                policy.engine.close()


def policy_checkpoints(config: RunConfig, policy: PolicyExecutor) -> CheckpointManager:
    """Checkpoints of a further policy of a multi-policy run (e.g. WaltzRL's feedback agent):
    RUN_DIR/<name>/checkpoints, written at the same steps as the first policy's."""
    return CheckpointManager(os.path.join(config.run_dir, policy.name), config.checkpoint)


def _has_step(path: str, step: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return any(json.loads(line).get("step") == step for line in f if line.strip())


def load_policy_checkpoint(config: RunConfig, policy: PolicyExecutor, first_policy_checkpoint: str) -> int:
    """Restore `policy`'s trainer from its checkpoint of the same step as `first_policy_checkpoint`
    (the first policy's, which decides the step resumed from); return its weight version."""
    manager = policy_checkpoints(config, policy)
    path = os.path.join(manager.root, os.path.basename(first_policy_checkpoint))
    problem = (f"{path} is missing" if not os.path.isfile(os.path.join(path, COMPLETE))
               else CheckpointManager.validate(path))
    if problem is not None:
        raise CheckpointError(f"--resume: the {policy.name!r} policy has no usable checkpoint for the step of "
                              f"{first_policy_checkpoint} ({problem}); both policies must resume from the same step")
    return int(manager.load(path, policy.trainer)["version"])


def train(config: RunConfig, *, resume: bool = False) -> RunSummary | None:
    """Run (or resume) training as `config` says; write metrics, plots, checkpoints and summary.json.

    Launched directly it is a world of one; under torchrun / srun every trainer rank calls it, and
    the driver (rank 0) alone writes the run directory's logs, ledger and summary (checkpoints are
    written by every rank, each its own files).

    Besides metrics, `prompts.jsonl` records which prompts each step trained on (and which it skipped):
    on resume it is cut back to the checkpoint's step like metrics.jsonl, so after any number of
    crashes and resumes it lists every consumed prompt exactly once."""
    started = time.perf_counter()
    generator_ranks = config.cluster.generator.launch_ranks
    check_multi_rank_support(config, trainer_world_size(generator_ranks))
    if join_launch(config.trainer.parallel, generator_ranks).role == "generator":
        serve_generator_rank(config, current_launch())
        return None
    driver = ranks.is_driver()
    os.makedirs(config.run_dir, exist_ok=True)
    if driver:
        with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(to_dict(config), f, indent=2)
    checkpoints = CheckpointManager(config.run_dir, config.checkpoint)
    latest = _latest_checkpoint(checkpoints) if resume else None  # before the slow set-up: a bad checkpoint fails fast
    controller = Controller(config, prepare_selection=latest is None)
    state: dict[str, Any] = {"accuracy_before": None, "reward_errors": 0, "wall_time_s": 0.0, "nonfinite_steps": 0,
                             "nonfinite_in_a_row": 0, "skipped_prompts": 0, "checkpoint_failures": 0}
    start_step = 0
    resumed_step_metrics: dict[str, float] | None = None
    if resume:
        if latest is None:
            if driver:
                print(f"--resume: no complete checkpoint in {checkpoints.root}; starting from scratch")
        else:
            for policy in controller.policies[1:]:  # before the first policy's load: its RNG state wins
                policy.version = load_policy_checkpoint(config, policy, latest)
            if driver:  # the curriculum's executors (PCL's value model; single-rank runs only)
                load_executors(controller.selector, config.run_dir, config.checkpoint, latest)
            saved = checkpoints.load(latest, controller.policy)
            if driver:
                controller.selector.load_state_dict(saved.get("curriculum", {}))
                controller.selection_metrics = controller.selector.prepare(controller.rollouts)
            start_step, controller.version = saved["step"], saved["version"]
            resumed_step_metrics = saved.get("step_metrics")
            # The first policy's own version: a WaltzRL conversation agent frozen in stage 1 is behind the
            # step count (checkpoints before policy_version was saved: the step count).
            controller.policies[0].version = saved.get("policy_version", controller.version)
            if driver:
                controller.stream.load_state_dict(saved["data"])
                buffer = checkpoints.load_tensors(latest, "rollouts")
                if buffer is not None:
                    controller.rollouts.load_state_dict(*buffer)
                else:  # a checkpoint from before rollout buffers were saved
                    controller.rollouts.resume_at(start_step)
            state.update(saved["controller"])
            controller.sync_weights()
            if driver:
                print(f"resumed from {latest} at step {start_step} (version {controller.version})")
    ledger = logger = None
    if driver:
        ledger_path = os.path.join(config.run_dir, "prompts.jsonl")
        truncate_jsonl(ledger_path, start_step)
        truncate_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), start_step)
        truncate_jsonl(os.path.join(config.run_dir, "episodes.jsonl"), start_step)  # multi-agent episode records
        truncate_jsonl(os.path.join(config.run_dir, "eval_episodes.jsonl"), start_step)
        logger = MetricsLogger(config.run_dir, config.logging, to_dict(config), resume=resume and start_step > 0)
        if resumed_step_metrics and not _has_step(os.path.join(config.run_dir, "metrics.jsonl"), start_step):
            logger.log(start_step, resumed_step_metrics)  # killed after the checkpoint, before its metrics line
        ledger = open(ledger_path, "a", encoding="utf-8")
    metrics: dict[str, float] = {}
    try:
        if start_step == 0 and config.eval.before_training:
            before = controller.evaluate()
            if driver:
                state["accuracy_before"] = before["eval/accuracy"]
                state["eval_before"] = before
                logger.log(0, before)
                print(f"held-out accuracy before training: {before['eval/accuracy']:.3f} "
                      f"({len(controller.heldout)} prompts)")
        progress = tqdm(range(start_step, config.steps), desc="train", initial=start_step, total=config.steps,
                        disable=config.logging.console_every > 0 or not driver)
        for step in progress:
            metrics = controller.train_step()
            done = step + 1
            state["reward_errors"] += int(metrics.get("rollout/reward_errors", 0))
            state["skipped_prompts"] += int(metrics.get("rollout/skipped_prompts", 0))
            nonfinite = bool(metrics.get("train/nonfinite", 0.0))  # agreed by every trainer rank
            state["nonfinite_steps"] += int(nonfinite)
            state["nonfinite_in_a_row"] = state["nonfinite_in_a_row"] + 1 if nonfinite else 0
            if driver:
                ledger.write(json.dumps({"step": done, "prompts": controller.last_prompt_ids,
                                         "skipped": controller.rollouts.last_skipped}) + "\n")
                ledger.flush()
            if state["nonfinite_in_a_row"] >= config.trainer.max_nonfinite_steps_in_a_row:
                if driver:
                    logger.log(done, metrics)
                raise TrainingDivergedError(
                    f"step {done}: the loss or gradients were NaN/Inf in {state['nonfinite_in_a_row']} steps in a "
                    f"row (trainer.max_nonfinite_steps_in_a_row={config.trainer.max_nonfinite_steps_in_a_row}); "
                    f"those steps were skipped and the weights are those of the last finite step. Lower the "
                    f"learning rate or check the loss; resume from {checkpoints.root}")
            if config.eval.every_steps and done % config.eval.every_steps == 0 and done < config.steps:
                metrics.update(controller.evaluate())
            if (config.checkpoint.every_steps and done % config.checkpoint.every_steps == 0) or (
                    done == config.steps and config.checkpoint.save_at_end):
                tick = time.perf_counter()
                segment = state["wall_time_s"] + (tick - started)
                try:
                    if driver:  # before the run's own checkpoint, which commits the step
                        save_executors(controller.selector, config.run_dir, config.checkpoint, done,
                                       controller.tokenizer)
                    checkpoints.save(done, controller.policy, {
                        "version": controller.version, "policy_version": controller.policies[0].version,
                        "step_metrics": {k: float(v) for k, v in metrics.items()
                                         if isinstance(v, (int, float)) and math.isfinite(v)} if driver else None,
                        "data": controller.stream.state_dict() if driver else None,
                        "curriculum": controller.selector.state_dict() if driver else None,
                        "controller": {**state, "wall_time_s": segment}}, tokenizer=controller.tokenizer,
                        tensors={"rollouts": controller.rollouts.state_dict()} if driver else None)
                    for policy in controller.policies[1:]:  # further policies: RUN_DIR/<name>/checkpoints
                        policy_checkpoints(config, policy).save(done, policy.trainer, {"version": policy.version},
                                                                tokenizer=controller.tokenizer)
                except Exception as exc:
                    # The previous checkpoint is intact; a transient failure (disk full, flaky mount)
                    # should not end a long run, but the last checkpoint of the run must exist.
                    # (Every rank gets the same outcome from the collective save.)
                    if done == config.steps:
                        raise
                    state["checkpoint_failures"] += 1
                    metrics["perf/checkpoint_failed"] = 1.0
                    print(f"step {done}: checkpoint write failed ({type(exc).__name__}: {exc}); the previous "
                          f"checkpoint remains the latest, training continues", file=sys.stderr)
                metrics["perf/checkpoint_time"] = time.perf_counter() - tick
            if driver:
                logger.log(done, metrics)
        after = {"eval/accuracy": None}
        if config.eval.after_training:
            after = controller.evaluate() or after
        if config.eval.after_training and driver:
            logger.log(config.steps, after)
            print(f"held-out accuracy after training: {after['eval/accuracy']:.3f}"
                  + (f" (before: {state['accuracy_before']:.3f})" if state["accuracy_before"] is not None else ""))
    finally:
        if driver:
            ledger.close()
            logger.close()
        controller.close()
    summary = RunSummary(accuracy_before=state["accuracy_before"], accuracy_after=after["eval/accuracy"],
                         wall_time_s=state["wall_time_s"] + time.perf_counter() - started, steps=config.steps,
                         heldout_size=len(controller.heldout), reward_errors=state["reward_errors"],
                         nonfinite_steps=state["nonfinite_steps"], skipped_prompts=state["skipped_prompts"],
                         checkpoint_failures=state["checkpoint_failures"], final_metrics=metrics, eval_before=state.get("eval_before", {}),
                         eval_after={k: v for k, v in after.items() if v is not None})
    if driver:
        if config.logging.plots:
            write_plots(config.run_dir)
        with open(os.path.join(config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)
    return summary


def _latest_checkpoint(checkpoints: CheckpointManager) -> str | None:
    """The checkpoint to resume from, chosen (and validated) once by the driver for every rank; a
    CheckpointError (no usable checkpoint) is raised on every rank alike."""
    found: tuple[str, str | None] | None = None
    if ranks.is_driver():
        try:
            found = ("ok", checkpoints.latest())
        except CheckpointError as exc:
            found = ("error", str(exc))
    kind, value = ranks.broadcast_records(found)
    if kind == "error":
        raise CheckpointError(value)
    return value
