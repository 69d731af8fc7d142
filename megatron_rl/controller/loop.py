"""The RL loop: one loop for synchronous and asynchronous training, whatever the algorithm.

    groups  = rollouts.next_groups(version)          # generate n samples per prompt, score them
    batch   = build_step_batch(groups, ...)          # advantages, behaviour log-probs, staleness
    metrics = policy.train_step(batch, loss_fn)      # recompute log pi, loss, backward, optimizer step
    weights.push(version)                             # weight channel: trainer shards -> rollout engine

`rollout.max_staleness` decides how far generation may run ahead of training; 0 is on-policy. What is
trained on what (policies, episodes, curriculum, evaluation) is the recipe's (controller/recipe.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl import ranks
from megatron_rl.checkpoint.manager import COMPLETE, CheckpointError, CheckpointManager, checkpoint_step
from megatron_rl.config import ConfigError, to_dict
from megatron_rl.controller.curriculum import load_executors, save_executors
from megatron_rl.controller.objectives import objective_executors
from megatron_rl.controller.producer import RolloutProducer
from megatron_rl.controller.recipe import PolicyExecutor, RunParts, build_run_parts
from megatron_rl.controller.reporter import RunReporter
from megatron_rl.controller.run_state import RunState, RunSummary
from megatron_rl.controller.stop import StopRequest
from megatron_rl.data.sources import PromptStream
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.observability.run_log import RunDirLock, prepare_run_dir, run_dir_entries, undo_refused_start
from megatron_rl.observability.timeline import Timeline
from megatron_rl.placement.generator_ranks import (
    current_launch,
    join_launch,
    serve_generator_rank,
    trainer_world_size,
)
from megatron_rl.placement.generator_process import name_semaphores_by_owner
from megatron_rl.placement.generators import engine_context

if TYPE_CHECKING:
    from megatron_rl.run_config import RunConfig

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


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


def build_controller(config: RunConfig, *, prepare_selection: bool = True) -> "Controller":
    """Seed, load the starting model, let the run's recipe build its parts, and build the Controller."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    # Tensors are read when first needed: a trainer rank of a Megatron checkpoint at its own layout
    # reads only its shard; the whole model is loaded where an engine or a frozen copy needs it.
    model = load_pretrained(config.model.path, lazy=True)
    if model.tokenizer is None:
        raise ConfigError(f"{config.model.path}: the model has no tokenizer (tokenizer.json) to render prompts")
    model.tokenizer.use_template(config.model.chat_template, config.model.chat_template_kwargs)
    return Controller(config, build_run_parts(config, model), prepare_selection=prepare_selection)


class Controller:
    """Owns the executors of a run. Every trainer rank of the world constructs one and calls
    `train_step` in lockstep; rank 0, the driver, also holds the engines, the prompt stream and the
    rollout producer, and broadcasts each step's scored groups (megatron_rl/ranks.py)."""

    def __init__(self, config: RunConfig, parts: RunParts, *, prepare_selection: bool = True):
        """`prepare_selection=False` leaves the curriculum's one-off preparation (`selector.prepare`,
        e.g. pre-filtering's rollouts) to the caller: a resuming run calls it after restoring the
        selector's state, which may make it unnecessary."""
        self.config = config
        self.tokenizer = parts.tokenizer
        self.policies = parts.policies
        self.policy = self.policies[0].trainer  # the run's primary policy
        self.engine = self.policies[0].engine
        self.train_data, self.heldout = parts.train_data, parts.heldout
        self.selector = parts.selector
        self.evaluation = parts.evaluation
        self.schedule = parts.schedule
        self.is_driver = ranks.is_driver()
        # A generator process on this host's cores: the trainer takes them back while it works.
        self.cores = getattr(self.engine, "trainer_cores", None)
        self.version = 0
        self.last_prompt_ids: list[str] = []  # the prompts the last train_step consumed, in order
        os.makedirs(config.run_dir, exist_ok=True)
        self.timeline = Timeline(os.path.join(config.run_dir, f"timeline_rank{ranks.rank()}.json"),
                                 process_name=f"rank {ranks.rank()}")
        self.stream: PromptStream | None = None
        self.rollouts: RolloutProducer | None = None
        self.selection_metrics: dict[str, float] = {}
        self.weight_sync_metrics: dict[str, float] = {}
        if self.is_driver:
            self.stream = PromptStream.from_config(self.train_data, config.data)
            self.rollouts = RolloutProducer(parts.episodes, self.tokenizer, self.stream, config.rollout,
                                            seed=config.seed, timeline=self.timeline,
                                            max_prompt_tokens=engine_context(config, self.policy.arch) - 1,
                                            selector=self.selector)
            if prepare_selection:
                self.selection_metrics = self.selector.prepare(self.rollouts)
        rollout = config.rollout
        generator = config.cluster.generator  # engines in other processes hold their own memory ...
        # ... except vLLM servers launched beside the trainer on its GPU, which sleep while it trains (vLLM's CPU
        # build has no sleep mode)
        remote_generators = bool(generator.launch_ranks or generator.urls or (
            generator.backend == "vllm" and not torch.cuda.is_available()))
        self.offload = (rollout.offload_idle and rollout.placement == "colocated" and not rollout.is_async
                        and len(self.policies) == 1 and not remote_generators)
        self._host = "cpu"
        self._device = self.policy._device()
        if self.offload:
            self.policy.move_optimizer_state(self._host)

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
                pushed = p.weights.push(p.version)
                prefix = "" if p is self.policies[0] else f"{p.name}/"
                self.weight_sync_metrics.update({prefix + k: v for k, v in pushed.items()
                                                 if k.startswith("weight_sync/")})
                if pause:
                    if not p.engine.flush_cache():
                        log.warning(f"weight sync {p.version}: the engine refused to flush its prefix cache; "
                                    "cached prefixes keep keys and values of the previous weights")
                    p.engine.resume()
        return time.perf_counter() - start

    def trains(self, policy: PolicyExecutor, step: int) -> bool:
        """Whether `policy` takes an optimizer step at training step `step` (multi-stage schedules)."""
        return self.schedule(policy, step)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (eval/*) on the driver; {} on the other ranks. Every rank calls it (likelihood
        scoring runs on the trainer ranks)."""
        with self.timeline.span("evaluate"):
            return self.evaluation(self.version)

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
            for p in self.policies:  # engine pools: restarts of failed engines, engines serving
                metrics.update(getattr(p.engine, "engine_metrics", None) or {})
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
        if hasattr(self.engine, "restarts"):  # a generator process that died and was restarted (logged there)
            metrics["rollout/generator_restarts"] = float(self.engine.restarts)
        metrics.update(self.weight_sync_metrics)  # a delta sync's bytes sent against a full one's
        self.weight_sync_metrics = {}
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
            batch = trainer.data_parallel_share(step.batch)
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
        close_episodes = getattr(self.rollouts.episodes if self.rollouts else None, "close", None)
        if close_episodes is not None:  # producers that own threads or servers (OpenAI-client agents)
            close_episodes()
        for policy in self.policies:
            if policy.engine is not None:
                policy.engine.close()

    # --- checkpoints ------------------------------------------------------------------------------
    def _policy_checkpoints(self, policy: PolicyExecutor) -> CheckpointManager:
        """Checkpoints of a further policy of a multi-policy run (e.g. WaltzRL's feedback agent):
        RUN_DIR/<name>/checkpoints, written at the same steps as the first policy's."""
        return CheckpointManager(os.path.join(self.config.run_dir, policy.name), self.config.checkpoint)

    def _executor_checkpoints(self, policy: PolicyExecutor) -> dict[str, tuple[Any, CheckpointManager]]:
        """The trainers `policy`'s objective owns besides the policy (PPO's critic), each with its
        checkpoints under RUN_DIR/<name> (<policy>-<name> for a further policy)."""
        prefix = "" if policy is self.policies[0] else f"{policy.name}-"
        return {name: (trainer, CheckpointManager(os.path.join(self.config.run_dir, prefix + name), self.config.checkpoint))
                for name, trainer in objective_executors(policy.objective).items()}

    def save_checkpoint(self, checkpoints: CheckpointManager, step: int, state: RunState,
                        metrics: dict[str, float]) -> None:
        """Every rank writes its files of step `step`: the curriculum's executors, the objectives' own
        trainers (PPO's critic) and further policies under RUN_DIR/<name>/checkpoints, then the run's own
        checkpoint, whose commit makes the step resumable (model and optimizer shards, RNG, data cursor,
        rollout buffer, run state)."""
        driver = self.is_driver
        if driver:  # before the run's own checkpoint, which commits the step
            save_executors(self.selector, self.config.run_dir, self.config.checkpoint, step, self.tokenizer)
        for policy in self.policies:
            for name, (trainer, manager) in self._executor_checkpoints(policy).items():
                manager.save(step, trainer, {"executor": name}, tokenizer=self.tokenizer)
        checkpoints.save(step, self.policy, {
            "version": self.version, "policy_version": self.policies[0].version,
            "step_metrics": {k: float(v) for k, v in metrics.items()
                             if isinstance(v, (int, float)) and math.isfinite(v)} if driver else None,
            "data": self.stream.state_dict() if driver else None,
            "curriculum": self.selector.state_dict() if driver else None,
            "controller": dataclasses.asdict(state)}, tokenizer=self.tokenizer,
            tensors={"rollouts": self.rollouts.state_dict()} if driver else None)
        for policy in self.policies[1:]:
            self._policy_checkpoints(policy).save(step, policy.trainer, {"version": policy.version},
                                                  tokenizer=self.tokenizer)

    def restore(self, checkpoints: CheckpointManager, latest: str) -> tuple[int, RunState, dict | None]:
        """Load checkpoint `latest` (a step directory) into every executor and the producer; return the
        step it resumes at, the run state and that step's metrics."""
        driver = self.is_driver
        for policy in self.policies:  # before the first policy's load: its RNG state wins
            for name, (trainer, manager) in self._executor_checkpoints(policy).items():
                path = os.path.join(manager.root, os.path.basename(os.path.normpath(latest)))
                problem = (f"{path} is missing" if not os.path.isfile(os.path.join(path, COMPLETE))
                           else CheckpointManager.validate(path))
                if problem is not None:
                    raise CheckpointError(f"--resume: the {name!r} of policy {policy.name!r} has no usable checkpoint "
                                          f"for the step of {latest} ({problem}); it must resume from the same step")
                manager.load(path, trainer)
        for policy in self.policies[1:]:
            policy.version = self._load_policy_checkpoint(policy, latest)
        if driver:  # the curriculum's executors (PCL's value model; single-rank runs only)
            load_executors(self.selector, self.config.run_dir, self.config.checkpoint, latest)
        saved = checkpoints.load(latest, self.policy)
        if driver:
            self.selector.load_state_dict(saved.get("curriculum", {}))
            self.selection_metrics = self.selector.prepare(self.rollouts)
        start_step, self.version = saved["step"], saved["version"]
        # The first policy's own version: a WaltzRL conversation agent frozen in stage 1 is behind the
        # step count (checkpoints before policy_version was saved: the step count).
        self.policies[0].version = saved.get("policy_version", self.version)
        if driver:
            self.stream.load_state_dict(saved["data"])
            buffer = checkpoints.load_tensors(latest, "rollouts")
            if buffer is not None:
                self.rollouts.load_state_dict(*buffer)
            else:  # a checkpoint from before rollout buffers were saved
                self.rollouts.resume_at(start_step)
        for policy in self.policies:  # what the engine holds is not what the trainer had sent
            policy.weights.reset()
        self.sync_weights()
        return start_step, RunState.from_checkpoint(saved["controller"]), saved.get("step_metrics")

    def _load_policy_checkpoint(self, policy: PolicyExecutor, first_policy_checkpoint: str) -> int:
        """Restore `policy`'s trainer from its checkpoint of the same step as `first_policy_checkpoint`
        (the first policy's, which decides the step resumed from); return its weight version."""
        manager = self._policy_checkpoints(policy)
        path = os.path.join(manager.root, os.path.basename(first_policy_checkpoint))
        problem = (f"{path} is missing" if not os.path.isfile(os.path.join(path, COMPLETE))
                   else CheckpointManager.validate(path))
        if problem is not None:
            raise CheckpointError(f"--resume: the {policy.name!r} policy has no usable checkpoint for the step of "
                                  f"{first_policy_checkpoint} ({problem}); both policies must resume from the same step")
        return int(manager.load(path, policy.trainer)["version"])


def train(config: RunConfig, *, resume: bool = False, fresh: bool = False) -> RunSummary | None:
    """Run (or resume) training as `config` says; write metrics, plots, checkpoints and summary.json.

    The driver holds the run directory's lock for the whole run. A previous run's files are never
    lost: a fresh start in a directory holding them is refused unless `fresh` (which moves them to
    RUN_DIR/previous_runs/<time>/), and `resume` without a checkpoint is refused where it would cut
    the metrics and ledger back to step 0 (observability/run_log.py: prepare_run_dir).

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
    name_semaphores_by_owner()  # and reclaim the shared memory of dead runs, before this run adds its own
    found = _on_driver(lambda: run_dir_entries(config.run_dir))
    lock = _on_driver(lambda: RunDirLock(config.run_dir))
    try:
        return _train(config, resume=resume, fresh=fresh, started=started)
    except ConfigError:  # refused: leave the run directory as the run found it
        _on_driver(lambda: undo_refused_start(config.run_dir, found))
        raise
    finally:
        if lock is not None:
            lock.close()


def _train(config: RunConfig, *, resume: bool, fresh: bool, started: float) -> RunSummary:
    checkpoints = CheckpointManager(config.run_dir, config.checkpoint)
    report = RunReporter.of_this_rank(config, checkpoints)
    requested = resume
    if not resume and not fresh and ranks.broadcast_records(_on_driver(checkpoints.resumable)):
        resume = True  # a relaunch (a requeued job, a crashed run started again) continues where it stopped
    latest = _latest_checkpoint(checkpoints) if resume else None  # before the slow set-up: a bad checkpoint fails fast
    _on_driver(lambda: prepare_run_dir(config.run_dir, resume=resume, fresh=fresh, checkpoint=latest,
                                       config=to_dict(config), requested=requested, keep=config.data.files()))
    if resume and not requested and latest is not None:
        report.say(f"{config.run_dir} holds this run's checkpoints: resuming from the latest (--fresh starts over)")
    finished = _finished_summary(config, latest)
    if finished is not None:
        report.say(f"{config.run_dir}: this run finished at step {finished.steps}; its summary.json is kept "
                   "(raise `steps` to train further)")
        return finished
    os.makedirs(config.run_dir, exist_ok=True)
    report.write_config()
    report.say(f"loading {config.model.path} and building the run's executors")
    tick = time.perf_counter()
    controller = build_controller(config, prepare_selection=latest is None)
    report.say(f"ready in {time.perf_counter() - tick:.1f}s")
    state, start_step, step_metrics = RunState(), 0, None
    if latest is not None:
        start_step, state, step_metrics = controller.restore(checkpoints, latest)
        report.say(f"resumed from {latest} at step {start_step} (version {controller.version})")
    elif resume:
        report.say(f"--resume: no complete checkpoint in {checkpoints.root}; starting from scratch")
    if latest is None and any(p.trainer.lora is not None and p.trainer.lora.init_from for p in controller.policies):
        # the engines start from the base model: the imported adapters (trainer.lora.init_from) reach them before
        # the first rollout, which would otherwise come from the base instead of the policy being trained
        controller.sync_weights()
    report.open(start_step, resume=resume, step_metrics=step_metrics)
    evaluation = controller.evaluation
    metrics: dict[str, float] = {}
    stop = StopRequest(config.run_dir)
    stopped_at: int | None = None
    try:
        if evaluation.before_training(start_step):
            report.evaluating(len(controller.heldout))
            before = controller.evaluate()
            if before:  # the driver's held-out metrics ({} on the other ranks)
                state.accuracy_before, state.eval_before = before["eval/accuracy"], before
            report.evaluated_before(before, len(controller.heldout))
        for step in report.steps(start_step):
            metrics = controller.train_step()
            done = step + 1
            state.record_step(metrics)
            report.trained(done, controller.last_prompt_ids, controller.rollouts)
            if state.nonfinite_in_a_row >= config.trainer.max_nonfinite_steps_in_a_row:
                report.log(done, metrics)
                raise TrainingDivergedError(
                    f"step {done}: the loss or gradients were NaN/Inf in {state.nonfinite_in_a_row} steps in a "
                    f"row (trainer.max_nonfinite_steps_in_a_row={config.trainer.max_nonfinite_steps_in_a_row}); "
                    f"those steps were skipped and the weights are those of the last finite step. Lower the "
                    f"learning rate or check the loss; resume from {checkpoints.root}")
            if evaluation.due(done, config.steps):
                metrics.update(controller.evaluate())
            stopping = done < config.steps and stop.agreed()
            if checkpoints.due(done, config.steps) or stopping:
                _checkpoint(controller, checkpoints, done, done if stopping else config.steps, state, metrics,
                            report, elapsed=time.perf_counter() - started)
            report.log(done, metrics)
            if stopping:
                stopped_at = done
                report.stopped(done, stop)
                break
        run_after = evaluation.after_training and stopped_at is None
        if run_after:
            report.evaluating(len(controller.heldout))
        after = controller.evaluate() if run_after else {}
        if run_after:
            report.evaluated_after(after, state.accuracy_before)
    finally:
        stop.close()
        report.close()
        controller.close()
    summary = RunSummary.of_run(state, wall_time_s=state.wall_time_s + time.perf_counter() - started,
                                steps=stopped_at or config.steps, heldout_size=len(controller.heldout),
                                final_metrics=metrics, after=after or {"eval/accuracy": None})
    report.finish(summary)
    return summary


def _checkpoint(controller: Controller, checkpoints: CheckpointManager, step: int, last_step: int,
                state: RunState, metrics: dict[str, float], report: RunReporter, *, elapsed: float) -> None:
    """Write step `step`'s checkpoint. The previous checkpoint stays intact if it fails: a transient
    failure (disk full, flaky mount) does not end a long run, but the run's last checkpoint must exist.
    (Every rank gets the same outcome from the collective save.)"""
    tick = time.perf_counter()
    try:
        controller.save_checkpoint(checkpoints, step, dataclasses.replace(state, wall_time_s=state.wall_time_s + elapsed),
                                   metrics)
    except Exception as exc:
        if step == last_step:
            raise
        state.checkpoint_failures += 1
        metrics["perf/checkpoint_failed"] = 1.0
        log.warning(f"step {step}: checkpoint write failed ({type(exc).__name__}: {exc}); the previous "
                    f"checkpoint remains the latest, training continues")
    else:
        report.checkpoint_written(step, time.perf_counter() - tick)
    metrics["perf/checkpoint_time"] = time.perf_counter() - tick


def _on_driver(work):
    """`work()` on the driver (its value there, None elsewhere). If it fails, every rank raises (the
    driver its own error, the others a ConfigError with its message), so no rank waits in a collective
    for a driver that gave up."""
    value, error = None, None
    if ranks.is_driver():
        try:
            value = work()
        except Exception as exc:
            error = exc
    message = ranks.broadcast_records(None if error is None else f"on the driver: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise ConfigError(message)
    return value


def _finished_summary(config: RunConfig, latest: str | None) -> RunSummary | None:
    """The summary of a run that already reached `steps` (relaunched: nothing to train, and its summary,
    final metrics and evaluations included, must stay whole); None otherwise."""
    if latest is None or checkpoint_step(latest) < config.steps:
        return None
    try:
        with open(os.path.join(config.run_dir, "summary.json"), encoding="utf-8") as f:
            return RunSummary(**json.load(f))
    except (OSError, ValueError, TypeError):  # killed before its summary: the run's end is still to do
        return None


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
