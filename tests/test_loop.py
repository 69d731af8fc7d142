"""The RL loop end to end on a tiny model with real prompts: metrics, summary, checkpoints, resume."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import load_yaml
from megatron_rl.controller.loop import train
from megatron_rl.run_config import RunConfig
from tests.helpers import sampled_groups

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "quickstart.yaml")


def vowel_fraction(response: str, prompt, **kwargs) -> float:
    """A dense reward a random model's responses differ on: the fraction of vowels in its response."""
    return sum(ch in "aeiou" for ch in response) / max(len(response), 1)


def _config(model_path, run_dir, *extra):
    return load_yaml(RunConfig, QUICKSTART, [
        f"model.path={model_path}", f"run_dir={run_dir}", "steps=3", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4",
        "trainer.lr=1e-3", "data.train.size=64", "data.heldout_size=4", "eval.max_new_tokens=8",
        "engine.max_batch_size=8", "checkpoint.every_steps=1", "logging.wandb=disabled", "logging.plots=false",
        "rollout.drop_uninformative_groups=false", "reward.name=tests.test_loop:vowel_fraction", *extra])


def _final_weights(run_dir):
    pointer = open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()
    return load_file(os.path.join(run_dir, "checkpoints", pointer, "model", "mp_rank_00_000", "model.safetensors"))


def test_loop_writes_metrics_summary_and_checkpoints(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "run")
    summary = train(_config(tiny_chat_model, run_dir))
    with open(os.path.join(run_dir, "summary.json")) as f:
        saved = json.load(f)
    for key in ("accuracy_before", "accuracy_after", "wall_time_s"):
        assert key in saved
    assert 0.0 <= saved["accuracy_after"] <= 1.0 and saved["wall_time_s"] > 0
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        for key in ("train/logprob_mismatch", "train/is_weight_mean", "train/clip_frac", "rollout/accuracy",
                    "rollout/response_length_mean", "perf/generate_time", "perf/train_time",
                    "perf/weight_sync_time", "perf/tokens_per_s", "rollout/staleness_max"):
            assert key in record, key
        assert record["rollout/staleness_max"] == 0  # max_staleness 0: on-policy
        # Identical weights in trainer and engine: the recomputed log-probs match the rollout's.
        assert record["train/logprob_mismatch"] < 1e-4
    assert summary.steps == 3
    trace = json.load(open(os.path.join(run_dir, "timeline_rank0.json")))["traceEvents"]
    names = {e["name"].split(" ")[0] for e in trace if e["ph"] == "X"}
    assert {"train", "weight_sync", "wait_for_rollouts", "generate", "evaluate"} <= names
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step_00000002", "step_00000003"]


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, tiny_chat_model):
    straight = str(tmp_path / "straight")
    train(_config(tiny_chat_model, straight))
    interrupted = str(tmp_path / "interrupted")
    train(_config(tiny_chat_model, interrupted, "steps=1"))
    summary = train(_config(tiny_chat_model, interrupted), resume=True)
    assert summary.steps == 3
    expected, actual = _final_weights(straight), _final_weights(interrupted)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    step2 = load_file(os.path.join(interrupted, "checkpoints", "step_00000002", "model", "mp_rank_00_000",
                                   "model.safetensors"))
    assert any(not torch.equal(actual[n], step2[n]) for n in actual)  # the last step really trained


def test_a_stop_request_checkpoints_and_a_plain_relaunch_resumes(tmp_path, tiny_chat_model):
    """What Slurm's time-limit signal leads to (examples/slurm_common.sh writes RUN_DIR/STOP): the run
    checkpoints at the next step boundary and ends; the same command again continues it, bit-exactly."""
    from megatron_rl.controller.stop import STOP_FILE

    straight = str(tmp_path / "straight")
    train(_config(tiny_chat_model, straight, "checkpoint.every_steps=0"))
    stopped = str(tmp_path / "stopped")
    os.makedirs(stopped)
    open(os.path.join(stopped, STOP_FILE), "w").close()
    summary = train(_config(tiny_chat_model, stopped, "checkpoint.every_steps=0"))
    assert summary.steps == 1
    assert not os.path.exists(os.path.join(stopped, STOP_FILE))  # served: the relaunch must not stop at once
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["latest", "step_00000001"]
    summary = train(_config(tiny_chat_model, stopped, "checkpoint.every_steps=0"))  # no --resume: it resumes
    assert summary.steps == 3
    expected, actual = _final_weights(straight), _final_weights(stopped)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    trained = [json.loads(line)["step"] for line in open(os.path.join(stopped, "metrics.jsonl"))
               if "rollout/reward_mean" in line]
    assert trained == [1, 2, 3]


def test_stop_signals_are_noted_and_the_handlers_restored(tmp_path):
    import signal

    from megatron_rl.controller.stop import StopRequest

    previous = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest(str(tmp_path))
    assert stop.reason() is None and not stop.agreed()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.reason() == "SIGUSR1" and stop.agreed()
    stop.close()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, tiny_chat_model):
    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointManager

    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir))
    manager = CheckpointManager(run_dir, CheckpointConfig(keep_last=2))
    shard = os.path.join(run_dir, "checkpoints", "step_00000003", "model", "mp_rank_00_000", "model.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(100)
    assert manager.latest().endswith("step_00000002")


def test_async_disaggregated_run_respects_staleness_and_verifies_weights(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "async")
    train(_config(tiny_chat_model, run_dir, "steps=4", "rollout.max_staleness=1", "rollout.placement=disaggregated",
                  "rollout.verify_weight_sync=true", "checkpoint.every_steps=0"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert len(steps) == 4
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps[1:])  # generation really ran ahead
    # Off-policy samples: the importance weights differ from 1 (AIPO corrects them).
    assert any(abs(r["train/is_weight_mean"] - 1.0) > 1e-6 for r in steps[1:])


def test_pause_mode_weight_updates(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "pause")
    summary = train(_config(tiny_chat_model, run_dir, "steps=2", "rollout.weight_update=pause",
                            "checkpoint.every_steps=0"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["train/version"] for r in records if "train/version" in r] == [1.0, 2.0]
    assert summary.steps == 2


def test_killed_generator_mid_run_loses_no_prompt(tmp_path, tiny_chat_model):
    from megatron_rl.controller.loop import build_controller
    from megatron_rl.data.sources import PromptStream

    config = _config(tiny_chat_model, str(tmp_path / "fault"), "rollout.max_staleness=1",
                     "rollout.placement=disaggregated", "rollout.max_new_tokens=16")
    controller = build_controller(config)
    expected = [p.prompt_id for p in PromptStream.from_config(controller.train_data, config.data).next(2 * 4)]
    consumed = []
    original = controller.rollouts.next_groups

    def recording(version):
        groups = original(version)  # also admits the next step's groups (max_staleness 1)
        if version == 1:  # those were submitted an instant ago: still in flight when the generator dies
            assert controller.rollouts.pending_prompt_ids()
            controller.engine.kill()
        consumed.extend(g.prompt.prompt_id for g in groups)
        assert all(len(g.samples) == config.rollout.samples_per_prompt for g in groups)
        return groups

    controller.rollouts.next_groups = recording
    try:
        for _ in range(4):
            controller.train_step()
        assert controller.engine.restarts == 1
        assert consumed == expected  # every prompt consumed exactly once, in order, despite the crash
    finally:
        controller.close()


def test_kl_reference_is_a_frozen_copy_of_the_starting_policy(tmp_path, tiny_chat_model):
    """algorithm.loss.kl_coef > 0 with the policy-gradient objective: pi_ref holds the starting weights
    (forward only: no gradient buffers or optimizer state), stays put while the policy moves, and the
    loss reports the k3 estimate of KL(pi || pi_ref) over the response tokens."""
    from megatron_rl.algorithms.losses import kl_penalty
    from megatron_rl.controller.objectives import PolicyGradientObjective
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.trainer.trainer import MegatronTrainer

    config = _config(tiny_chat_model, str(tmp_path / "run"), "algorithm.loss.kl_coef=0.5", "trainer.lr=1e-2")
    model = load_pretrained(tiny_chat_model)
    policy = MegatronTrainer(model.arch, config.trainer, hf_state=model.state)
    objective = PolicyGradientObjective(config, model.tokenizer, model, policy=policy)
    reference = objective.reference_model
    memory = reference.memory_bytes()
    assert memory["params"] > 0 and memory["grads"] == 0 and memory["optimizer"] == 0

    groups = sampled_groups(model, ["What is 17 + 25?", "Write a haiku about the sea."], samples=4, max_new_tokens=8)
    step, loss_fn = objective.prepare_step(groups, trainer_version=0)
    mask = step.batch.loss_mask.bool()
    start = policy.compute_logprobs(step.batch)
    assert torch.allclose(step.batch.reference_logprobs[mask], start[mask], atol=1e-6)
    with pytest.raises(RuntimeError, match="frozen"):
        reference.train_step(step.batch, loss_fn)
    assert policy.train_step(step.batch, loss_fn)["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    policy.train_step(step.batch, loss_fn)

    again, loss_fn = objective.prepare_step(groups, trainer_version=2)
    assert torch.equal(again.batch.reference_logprobs, step.batch.reference_logprobs)
    moved = policy.compute_logprobs(again.batch)
    assert (moved[mask] - start[mask]).abs().max() > 1e-3
    kl = kl_penalty(moved, start, "k3") * mask
    micro = config.trainer.micro_batch_size  # the trainer averages each micro-batch's token mean
    expected = torch.stack([kl[r:r + micro].sum() / mask[r:r + micro].sum() for r in range(0, len(kl), micro)]).mean()
    assert policy.train_step(again.batch, loss_fn)["train/kl_ref"] == pytest.approx(float(expected), rel=1e-4)


def test_loop_with_a_kl_penalty_reports_its_divergence_from_the_start(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir, "algorithm.loss.kl_coef=0.1", "steps=2", "checkpoint.every_steps=0"))
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    kl = [r["train/kl_ref"] for r in steps if "train/kl_ref" in r]
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 1e-7


def test_a_bf16_engine_samples_for_an_fp32_trainer(tmp_path, tiny_chat_model):
    """`engine.dtype=bf16` (the fast CPU path where bf16 matrix units exist, and the usual GPU setup): each
    step's weight sync rounds the fp32 policy into the engine's bf16 arena, so the recomputed log-probs
    differ from the behaviour log-probs by bf16 rounding only, every step, however far training moves the
    weights; a stale or partial sync would leave the engine on the old policy."""
    run_dir = str(tmp_path / "bf16")
    train(_config(tiny_chat_model, run_dir, "engine.dtype=bf16", "checkpoint.every_steps=0", "steps=4"))
    steps = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward_mean" in r]
    mismatch = [r["train/logprob_mismatch"] for r in steps]
    assert len(mismatch) == 4 and all(1e-4 < m < 2e-2 for m in mismatch), mismatch
    stale = str(tmp_path / "stale")  # the control: the same run with a generator one version behind
    train(_config(tiny_chat_model, stale, "engine.dtype=bf16", "checkpoint.every_steps=0", "steps=4",
                  "rollout.max_staleness=1", "rollout.placement=disaggregated", "rollout.deterministic=true"))
    behind = [r["train/logprob_mismatch"] for r in map(json.loads, open(os.path.join(stale, "metrics.jsonl")))
              if "rollout/reward_mean" in r and r["rollout/staleness_max"] == 1]
    assert behind and min(behind) > 2e-2, behind
