"""Reliability: runs SIGKILLed at random points resume losing and repeating no prompt (and, in
deterministic mode, end with the weights of an uninterrupted run); fault injection for NaN losses and
gradients, failing checkpoint writes, raising rewards; corrupt and unsafe checkpoints."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.checkpoint.manager import CheckpointError, CheckpointManager, _file_record
from megatron_rl.config import load_yaml
from megatron_rl.controller.loop import TrainingDivergedError, build_controller, train
from megatron_rl.data.sources import PromptStream, build_datasets
from megatron_rl.run_config import RunConfig
from tests.helpers import near_uniform_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "examples", "configs", "quickstart.yaml")


def _overrides(model_path, run_dir, *extra):
    return [f"model.path={model_path}", f"run_dir={run_dir}", "steps=4", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4",
            "trainer.lr=1e-3", "data.train.size=24", "data.heldout_size=4", "eval.before_training=false",
            "eval.after_training=false", "engine.max_batch_size=8", "checkpoint.every_steps=1",
            "logging.wandb=disabled", "logging.plots=false", "rollout.drop_uninformative_groups=false",
            "reward.name=tests.test_loop:vowel_fraction", *extra]


def _config(model_path, run_dir, *extra) -> RunConfig:
    return load_yaml(RunConfig, QUICKSTART, _overrides(model_path, run_dir, *extra))


def _expected_prompt_order(config: RunConfig) -> list[str]:
    train_set, _ = build_datasets(config.data)
    stream = PromptStream.from_config(train_set, config.data)
    return [p.prompt_id for p in stream.next(config.steps * config.rollout.prompts_per_step)]


def _ledger(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "prompts.jsonl"))]


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(run_dir, CheckpointConfig())
    return load_file(os.path.join(manager.latest(), "model", "mp_rank_00_000", "model.safetensors"))


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _last_step(run_dir) -> int:
    try:
        with open(os.path.join(run_dir, "prompts.jsonl")) as f:
            lines = [line for line in f if line.endswith("\n")]
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, json.JSONDecodeError):
        return 0


def _trained_a_step(log_path) -> bool:
    with open(log_path) as f:
        return re.search(r"\bstep \d+/\d+ ", f.read()) is not None


# --- SIGKILL at random points ----------------------------------------------------------------------------

def test_sigkilled_async_run_consumes_every_prompt_once_and_matches_uninterrupted_run(tmp_path, tiny_chat_model):
    """An asynchronous, disaggregated, deterministic run is SIGKILLed at random points (mid-step,
    mid-checkpoint, mid-start-up) and launched again each time with the same command (no flag: a
    relaunch resumes); its prompt ledger lists every prompt of the stream exactly once in order, and its
    final weights equal an uninterrupted run's bit for bit."""
    _kill_and_relaunch(tmp_path, tiny_chat_model, advances=[2, 0, 3, 2], seed=20261130)


@pytest.mark.slow
def test_twelve_sigkills_relaunched_with_and_without_resume_match_the_uninterrupted_run(tmp_path, tiny_chat_model):
    """Twelve group kills, the first during start-up before any checkpoint exists (the relaunch moves that
    attempt's records aside and starts over), several right after a resume or mid-checkpoint; relaunched
    alternately as is and with --resume (both decide alike from what is on disk); nothing is left in
    /dev/shm or the temporary directory."""
    _kill_and_relaunch(tmp_path, tiny_chat_model, advances=[0, 1, 0, 2, 1, 1, 0, 2, 1, 1, 0, 1], seed=20261201,
                       steps=14, min_kills=10, alternate_resume=True)


def test_sigkilled_lora_run_resumes_bit_exactly(tmp_path, tiny_chat_model):
    """The same with LoRA adapters (the checkpoints hold the adapters and their optimizer state, the base is
    named by its checksum): the final adapters equal an uninterrupted run's bit for bit."""
    # Its steps take about 0.1 s here, so a kill lands within one step of its target.
    _kill_and_relaunch(tmp_path, tiny_chat_model, advances=[2, 1], seed=20261204, steps=8, min_kills=2,
                       min_resumes=2, jitter_s=0.1, more=["trainer.lora.rank=4", "trainer.lr=1e-2"])


def _kill_and_relaunch(tmp_path, tiny_chat_model, *, advances, seed, steps=10, min_kills=3, alternate_resume=False,
                       min_resumes=3, jitter_s=0.4, more=()):
    extra = [f"steps={steps}", "rollout.max_staleness=2", "rollout.placement=disaggregated",
             "rollout.deterministic=true", "checkpoint.keep_last=2", *more]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}

    def launch(run_dir, log, resume=False):
        return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", QUICKSTART,
                                 *_overrides(tiny_chat_model, run_dir, *extra), *(["--resume"] if resume else [])],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    straight = str(tmp_path / "straight")
    with open(tmp_path / "straight.log", "w") as log:
        assert launch(straight, log).wait(timeout=300) == 0, open(tmp_path / "straight.log").read()[-3000:]

    run_dir = str(tmp_path / "killed")
    rng = random.Random(seed)
    kills = []
    # Steps to let pass before each kill; 0 kills during start-up or right after a resume.
    for attempt, advance in enumerate(advances):
        log_path = tmp_path / f"attempt{attempt}.log"
        with open(log_path, "w") as log:
            proc = launch(run_dir, log, resume=alternate_resume and attempt % 2 == 1)
            target = min(_last_step(run_dir) + advance, steps - 1)
            deadline = time.monotonic() + 240
            # The ledger still shows the killed attempt's steps until this one resumes: when the target is
            # capped at the last step, only this attempt's own trained step says it got there.
            while ((_last_step(run_dir) < target or (advance and not _trained_a_step(log_path)))
                   and proc.poll() is None and time.monotonic() < deadline):
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, jitter_s))  # anywhere inside a step: generating, training, checkpointing
            generators = _children(proc.pid)
            if proc.poll() is not None:
                break  # it finished before the kill point
            if alternate_resume:  # the whole group, as a node failure or `scancel -s KILL` does
                os.killpg(proc.pid, signal.SIGKILL)
            else:  # the controller alone: its generator process must notice and exit
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills.append(_last_step(run_dir))
            # The generator process notices its controller is gone, exits and removes the shared weights.
            until = time.monotonic() + 20
            while any(_alive(pid) for pid in generators) and time.monotonic() < until:
                time.sleep(0.1)
            assert not any(_alive(pid) for pid in generators), "orphaned generator process"
    print(f"SIGKILLed after steps {kills}")
    assert len(kills) >= min_kills, kills
    with open(tmp_path / "final.log", "w") as log:
        final = launch(run_dir, log, resume=alternate_resume and len(kills) % 2 == 1)
        assert final.wait(timeout=300) == 0, open(tmp_path / "final.log").read()[-3000:]
    resumed = sum("resumed from" in open(tmp_path / f"attempt{i}.log").read() for i in range(1, len(kills)))
    resumed += "resumed from" in open(tmp_path / "final.log").read()
    assert resumed >= min_resumes, f"kill points {kills}: too few resumes restored a checkpoint"

    ledger = _ledger(run_dir)
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    consumed = [pid for r in ledger for pid in r["prompts"]]
    assert consumed == _expected_prompt_order(_config(tiny_chat_model, run_dir, *extra))
    assert [r["prompts"] for r in ledger] == [r["prompts"] for r in _ledger(straight)]
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # the metrics step resumed too
    expected, actual = _final_weights(straight), _final_weights(run_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    previous = load_file(os.path.join(straight, "checkpoints", f"step_{steps - 1:08d}", "model", "mp_rank_00_000",
                                      "model.safetensors"))
    assert any(not torch.equal(actual[n], previous[n]) for n in actual)  # the last step really trained
    if alternate_resume:  # whatever the kills left, the last relaunch reclaimed
        from tests.test_bad_input_more import _shm_leaks  # (that module imports this one)

        assert _shm_leaks(shm_before) == [], "shared memory of killed attempts left in /dev/shm"
        leftovers = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.endswith((".tmp", ".old"))]
        assert leftovers == [], leftovers


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_restores_the_rollout_buffer(tmp_path, tiny_chat_model, mode):
    """Sync, and non-deterministic async (generation 2 steps ahead, in-flight weight updates): the
    prompts buffered at the checkpoint are trained on after resume, none skipped, none repeated, and
    their samples keep the weight versions that generated them."""
    extra = ["rollout.max_staleness=2", "rollout.placement=disaggregated"] if mode == "async" else []
    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir, *extra, "steps=2"))
    manager = CheckpointManager(run_dir, CheckpointConfig())
    tensors, buffer = manager.load_tensors(manager.latest(), "rollouts")
    if mode == "sync":
        assert buffer["groups"] == [] and buffer["admitted_steps"] == 2
    else:
        assert len(buffer["groups"]) == 2 * 2  # steps 2 and 3 were admitted (max_staleness 2) before the save
        assert {g["step"] for g in buffer["groups"]} == {2, 3}
        assert tensors["weight_versions"].max() <= 2
        assert len(tensors["output_ids"]) == len(tensors["output_logprobs"]) > 0
    extra.append("steps=5")
    summary = train(_config(tiny_chat_model, run_dir, *extra), resume=True)
    assert summary.steps == 5
    ledger = _ledger(run_dir)
    assert [r["step"] for r in ledger] == [1, 2, 3, 4, 5]
    assert [p for r in ledger for p in r["prompts"]] == _expected_prompt_order(_config(tiny_chat_model, run_dir, *extra))
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert max(m["rollout/staleness_max"] for m in metrics) <= 2


def test_deterministic_mode_generates_step_s_with_version_s_minus_staleness(tmp_path, tiny_chat_model):
    config = _config(tiny_chat_model, str(tmp_path / "det"), "rollout.max_staleness=2", "rollout.deterministic=true",
                     "rollout.placement=disaggregated", "steps=5", "rollout.max_new_tokens=16")
    controller = build_controller(config)
    versions = []
    original = controller.rollouts.next_groups

    def recording(version):
        groups = original(version)
        versions.append({v for g in groups for s in g.samples for v in s.completion.weight_versions})
        return groups

    controller.rollouts.next_groups = recording
    try:
        for _ in range(5):
            controller.train_step()
    finally:
        controller.close()
    assert versions == [{max(0, s - 2)} for s in range(5)]


# --- fault injection -----------------------------------------------------------------------------------

class _NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward (a finite loss whose gradients are poisoned)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _loss(kind):
    def loss_fn(logprobs, micro_batch, entropy):
        masked = (logprobs * micro_batch.loss_mask).sum() / micro_batch.loss_mask.sum().clamp(min=1)
        if kind == "nan_loss":
            masked = masked * float("nan")
        elif kind == "inf_loss":
            masked = masked + float("inf")
        elif kind == "nan_grad":
            masked = _NaNGradient.apply(masked)
        return -masked, {}
    return loss_fn


@pytest.fixture(scope="module")
def tiny_trainer(tiny_chat_model):
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    model = load_pretrained(tiny_chat_model)
    return MegatronTrainer(model.arch, TrainerConfig(lr=1e-2, micro_batch_size=2), hf_state=model.state)


@pytest.mark.parametrize("kind", ["nan_loss", "inf_loss", "nan_grad"])
def test_nonfinite_step_is_skipped_and_leaves_weights_untouched(tiny_trainer, kind):
    from megatron_rl.types import TrainBatch

    tokens = torch.randint(0, 1000, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(4, 12)
    mask[:, 6:] = 1.0
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    metrics = tiny_trainer.train_step(batch, _loss("finite"))  # Adam has state to protect
    assert metrics["train/nonfinite"] == 0.0 and metrics["train/update_skipped"] == 0.0
    weights = {k: v.clone() for k, v in tiny_trainer.shard_state().items()}
    adam = {k: v.clone() for k, v in tiny_trainer.optimizer.state_dict()["state"][0].items()
            if isinstance(v, torch.Tensor)}
    steps, lr_steps = tiny_trainer.step_count, tiny_trainer.scheduler.num_steps
    metrics = tiny_trainer.train_step(batch, _loss(kind))
    assert metrics["train/nonfinite"] == 1.0 and metrics["train/update_skipped"] == 1.0
    for name, tensor in tiny_trainer.shard_state().items():
        assert torch.equal(tensor, weights[name]), name
    after = tiny_trainer.optimizer.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in adam.items())
    assert (tiny_trainer.step_count, tiny_trainer.scheduler.num_steps) == (steps, lr_steps)
    metrics = tiny_trainer.train_step(batch, _loss("finite"))  # and training goes on normally
    assert metrics["train/nonfinite"] == 0.0
    assert any(not torch.equal(t, weights[n]) for n, t in tiny_trainer.shard_state().items())


def _dp_nonfinite_worker(rank, world_size, arch, state):
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch

    torch.set_num_threads(1)
    trainer = MegatronTrainer(arch, TrainerConfig(parallel=ParallelConfig(), micro_batch_size=2, lr=1e-2,
                                                  vocab_divisible_by=1), hf_state=state)
    assert trainer.dp_size == 2
    tokens = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(rank))
    mask = torch.zeros(2, 10)
    mask[:, 4:] = 1.0
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    before = {k: v.clone() for k, v in trainer.shard_state().items()}
    skipped = trainer.train_step(batch, _loss("nan_loss" if rank == 0 else "finite"))  # poisoned on one rank only
    unchanged = all(torch.equal(v, before[k]) for k, v in trainer.shard_state().items())
    stepped = trainer.train_step(batch, _loss("finite"))
    changed = any(not torch.equal(v, before[k]) for k, v in trainer.shard_state().items())
    return skipped["train/nonfinite"], unchanged, stepped["train/nonfinite"], changed


def test_nonfinite_verdict_is_agreed_by_every_data_parallel_rank(tiny_arch):
    from megatron_rl.placement.launch import run_distributed
    from tests.helpers import near_uniform_state

    results = run_distributed(_dp_nonfinite_worker, 2, tiny_arch, near_uniform_state(tiny_arch))
    assert results == [(1.0, True, 0.0, True)] * 2


def _poison_losses(monkeypatch, bad_calls):
    """Make the loop's loss NaN on the given (0-based) train steps (the policy-gradient objective builds
    its loss with make_loss_fn at each step)."""
    import megatron_rl.controller.objectives as objectives

    real = objectives.make_loss_fn
    calls = {"n": 0}

    def make_loss_fn(*args, **kwargs):
        fn = real(*args, **kwargs)
        poisoned = calls["n"] in bad_calls
        calls["n"] += 1

        def wrapped(logprobs, micro_batch, entropy):
            loss, metrics = fn(logprobs, micro_batch, entropy)
            return (loss * float("nan") if poisoned else loss), metrics
        return wrapped

    monkeypatch.setattr(objectives, "make_loss_fn", make_loss_fn)


def test_run_stops_after_configured_nonfinite_steps_in_a_row(tmp_path, tiny_chat_model, monkeypatch):
    _poison_losses(monkeypatch, bad_calls={1, 3, 4})
    run_dir = str(tmp_path / "nan")
    with pytest.raises(TrainingDivergedError, match=r"step 5: .*NaN/Inf in 2 steps in a row.*max_nonfinite_steps_in_a_row=2"):
        train(_config(tiny_chat_model, run_dir, "steps=6", "trainer.max_nonfinite_steps_in_a_row=2"))
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["train/nonfinite"] for m in metrics] == [0.0, 1.0, 0.0, 1.0, 1.0]
    root = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000004"]  # step 5 never saved
    shards = [load_file(os.path.join(root, f"step_0000000{s}", "model", "mp_rank_00_000", "model.safetensors"))
              for s in (3, 4)]
    assert all(torch.equal(shards[0][k], shards[1][k]) for k in shards[0])  # step 4 was skipped
    state = json.load(open(os.path.join(root, "step_00000004", "state.json")))
    assert state["controller"]["nonfinite_steps"] == 2 and state["controller"]["nonfinite_in_a_row"] == 1


def test_single_nonfinite_step_is_counted_and_the_run_goes_on(tmp_path, tiny_chat_model, monkeypatch):
    _poison_losses(monkeypatch, bad_calls={1})
    run_dir = str(tmp_path / "nan1")
    summary = train(_config(tiny_chat_model, run_dir, "steps=3", "checkpoint.keep_last=3"))
    assert summary.nonfinite_steps == 1
    root = os.path.join(run_dir, "checkpoints")
    weights = [load_file(os.path.join(root, f"step_0000000{s}", "model", "mp_rank_00_000", "model.safetensors"))
               for s in (1, 2, 3)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # step 2 skipped: untouched
    assert any(not torch.equal(weights[1][k], weights[2][k]) for k in weights[0])  # step 3 trained


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, tiny_chat_model, monkeypatch):
    import megatron_rl.checkpoint.manager as manager_module

    run_dir = str(tmp_path / "ckfail")
    real_save = manager_module.torch.save
    calls = {"n": 0}

    def failing_save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if "step_00000002" in str(path) and "rng" in str(path):  # mid-checkpoint: model and optimizer written
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(manager_module.torch, "save", failing_save)
    summary = train(_config(tiny_chat_model, run_dir, "steps=3", "checkpoint.keep_last=5"))
    assert summary.checkpoint_failures == 1
    root = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000003"]  # no step 2, no .tmp
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m.get("perf/checkpoint_failed", 0.0) for m in metrics] == [0.0, 1.0, 0.0]

    # The same failure on a manager directly: the exception reaches the caller, `latest` is unchanged.
    manager = CheckpointManager(run_dir, CheckpointConfig(keep_last=5))
    before = open(os.path.join(root, "latest")).read()
    controller_state = json.load(open(os.path.join(root, "step_00000003", "state.json")))

    class _Trainer:  # only what save() reads; its model shard comes from the real checkpoint
        tp_rank = pp_rank = 0
        step_count = 3
        pg = type("Groups", (), {"dp": type("DataParallel", (), {"rank": staticmethod(lambda: 0)})()})()
        config = type("TrainerConfig", (), {"use_distributed_optimizer": False})()

        def __init__(self):
            from megatron_rl.models.pretrained import read_megatron_layout

            self.layout = read_megatron_layout(os.path.join(root, "step_00000003", "model"))
            self.optimizer = self.scheduler = type("S", (), {"state_dict": staticmethod(lambda: {})})()

        def shard_state(self):
            return load_file(os.path.join(root, "step_00000003", "model", "mp_rank_00_000", "model.safetensors"))

    with pytest.raises(OSError, match="No space left"):
        manager.save(2, _Trainer(), {"version": 2, "data": controller_state["data"], "controller": {}})
    assert open(os.path.join(root, "latest")).read() == before
    assert not any(n.endswith(".tmp") for n in os.listdir(root))
    assert manager.latest().endswith("step_00000003")


def test_raising_reward_is_counted_and_its_samples_skipped(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "reward")
    summary = train(_config(tiny_chat_model, run_dir, "steps=2", "reward.name=tests.test_reliability:flaky_reward",
                            "checkpoint.every_steps=0"))
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    errors = [m["rollout/reward_errors"] for m in metrics]
    trained = [m["rollout/trained_samples"] for m in metrics]
    assert summary.reward_errors == sum(errors) > 0
    assert all(t == 8 - e for t, e in zip(trained, errors))  # 2 prompts x 4 samples, failed ones left out


def flaky_reward(response: str, prompt, **kwargs) -> float:
    """Raises for responses with an even number of characters (about half of them)."""
    if len(response) % 2 == 0:
        raise RuntimeError("judge unavailable")
    return len(response) / 100.0


# --- corrupt, partial and unsafe checkpoints -----------------------------------------------------------

@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory, tiny_chat_model):
    run_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    train(_config(tiny_chat_model, run_dir, "steps=2", "checkpoint.keep_last=2"))
    return run_dir


def _copy(run_dir, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(run_dir, copy)
    return copy, CheckpointManager(copy, CheckpointConfig(keep_last=2)), os.path.join(copy, "checkpoints")


@pytest.mark.parametrize("damage, message", [
    ("truncate_model", r"model/mp_rank_00_000/model.safetensors has \d+ bytes, the manifest says \d+ \(truncated\?\)"),
    ("flip_optimizer", r"optimizer/rank_00000.pt does not match its checksum"),
    ("delete_rng", r"rng/rank_00000.pt is missing"),
    ("bad_state_json", r"state.json"),
    ("flip_rollouts", r"rollouts.safetensors does not match its checksum"),
])
def test_corrupt_checkpoint_is_reported_and_the_previous_one_used(checkpointed_run, tmp_path, caplog, damage, message):
    _, manager, root = _copy(checkpointed_run, tmp_path)
    newest = os.path.join(root, "step_00000002")
    if damage == "truncate_model":
        path = os.path.join(newest, "model", "mp_rank_00_000", "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage in ("flip_optimizer", "flip_rollouts"):
        path = os.path.join(newest, "optimizer", "rank_00000.pt") if damage == "flip_optimizer" else \
            os.path.join(newest, "rollouts.safetensors")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    elif damage == "delete_rng":
        os.remove(os.path.join(newest, "rng", "rank_00000.pt"))
    else:
        open(os.path.join(newest, "state.json"), "w").write('{"step": 2, "vers')
    assert manager.latest().endswith("step_00000001")
    assert f"checkpoint step_00000002 is unusable" in caplog.text
    import re

    assert re.search(message, manager.validate(newest)), manager.validate(newest)


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(checkpointed_run, tmp_path, tiny_chat_model):
    copy, manager, root = _copy(checkpointed_run, tmp_path)
    for name in ("step_00000001", "step_00000002"):
        os.remove(os.path.join(root, name, "optimizer", "rank_00000.pt"))
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*step_00000002: optimizer/rank_00000.pt is "
                                              r"missing; step_00000001: optimizer/rank_00000.pt is missing"):
        train(_config(tiny_chat_model, copy, "steps=3"), resume=True)


def test_partial_checkpoint_from_a_killed_save_is_ignored(checkpointed_run, tmp_path):
    _, manager, root = _copy(checkpointed_run, tmp_path)
    shutil.copytree(os.path.join(root, "step_00000002"), os.path.join(root, "step_00000003.tmp"))
    os.remove(os.path.join(root, "step_00000003.tmp", "COMPLETE"))
    shutil.copytree(os.path.join(root, "step_00000002"), os.path.join(root, "step_00000004"))
    os.remove(os.path.join(root, "step_00000004", "COMPLETE"))  # renamed in place, but never completed
    assert manager.latest().endswith("step_00000002")


def test_metrics_of_the_checkpointed_step_survive_a_kill_before_they_were_logged(checkpointed_run, tmp_path,
                                                                                 tiny_chat_model):
    """A kill after the checkpoint of step 2 committed and before step 2's metrics line was written:
    the resumed run writes that line from the checkpoint, so metrics.jsonl still has every step once."""
    copy, _, _ = _copy(checkpointed_run, tmp_path)
    path = os.path.join(copy, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)]
    logged_step_2 = [r for r in records if r["step"] == 2][0]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if r["step"] < 2)
    train(_config(tiny_chat_model, copy, "steps=3", "checkpoint.keep_last=2"), resume=True)
    resumed = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in resumed if "train/loss" in r] == [1, 2, 3]
    restored = [r for r in resumed if r["step"] == 2][0]
    assert restored["train/loss"] == logged_step_2["train/loss"]


class Exploit:
    """Any class: unpickling it would run code of the file's choosing."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_with_pickled_objects_is_refused(checkpointed_run, tmp_path):
    _, manager, root = _copy(checkpointed_run, tmp_path)
    path = os.path.join(root, "step_00000002", "rng", "rank_00000.pt")
    torch.save({"torch": torch.get_rng_state(), "payload": Exploit()}, path)
    manifest_path = os.path.join(root, "step_00000002", "MANIFEST.json")  # even when sizes and checksums agree
    manifest = json.load(open(manifest_path))
    manifest["rng/rank_00000.pt"] = _file_record(path)
    json.dump(manifest, open(manifest_path, "w"))
    assert "refused to load" in manager.validate(os.path.join(root, "step_00000002"))
    assert manager.latest().endswith("step_00000001")


def test_checkpoint_without_manifest_is_unusable(checkpointed_run, tmp_path, caplog):
    """Delete the manifest and flip a byte inside a weight: the file still parses, so only the manifest
    could tell. The checkpoint is refused (one line on stderr) and the previous one used."""
    _, manager, root = _copy(checkpointed_run, tmp_path)
    newest = os.path.join(root, "step_00000002")
    os.remove(os.path.join(newest, "MANIFEST.json"))
    weights = os.path.join(newest, "model", "mp_rank_00_000", "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[-5] ^= 0x01  # the last tensor's bytes: still a readable safetensors file
    open(weights, "wb").write(bytes(data))
    load_file(weights)
    assert manager.latest().endswith("step_00000001")
    err = caplog.text  # a warning: on stderr under the CLI (observability/logs.py)
    assert "checkpoint step_00000002 is unusable (MANIFEST.json is missing (its files cannot be checked)); " \
           "falling back to the previous one" in err


def test_resume_with_another_model_is_named(checkpointed_run, tmp_path, tiny_chat_model):
    """The checkpoint's tensors do not fit the model of this run's model.path: one error naming both."""
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.models.pretrained import load_pretrained

    tiny = load_pretrained(tiny_chat_model)
    wider = dataclasses.replace(tiny.arch, hidden_size=128, ffn_hidden_size=256)
    other = str(tmp_path / "other_model")
    save_hf(other, wider, near_uniform_state(wider), tiny.tokenizer)
    copy, _, _ = _copy(checkpointed_run, tmp_path)
    with pytest.raises(CheckpointError, match=r"step_00000002: the checkpoint was written for another model than "
                                              r"this run's model.path \(tensor .* is \[.*\] there, \[.*\] in this "
                                              r"run's model\)"):
        train(_config(other, copy, "steps=3"), resume=True)
