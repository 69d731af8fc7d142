"""PPO with a learned critic on the Megatron trainer: token-aligned values that see only their prefix, a
critic that learns its returns, a run that trains policy and critic in the same step (sync and async),
warms the critic up first, and resumes both bit-exactly after a SIGKILL; the critic's checkpoint reshards."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.algorithms.advantages import token_rewards
from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.trainer.config import CriticConfig, ParallelConfig, TrainerConfig
from megatron_rl.types import TrainBatch
from tests.helpers import tiny_state
from tests.test_loop import _config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = ["algorithm.objective=ppo", "algorithm.advantage.estimator=gae", "algorithm.loss.name=ppo_clip",
       "algorithm.critic.trainer.lr=1e-3", "algorithm.critic.head_lr=1e-2", "algorithm.critic.trainer.micro_batch_size=4"]


def _critic(tiny_arch, **fields):
    from megatron_rl.trainer.value import CriticTrainer

    config = CriticConfig(trainer=TrainerConfig(lr=1e-3, micro_batch_size=2), head_lr=1e-2, **fields)
    return CriticTrainer(tiny_arch, config, hf_state=tiny_state(tiny_arch))


def _batch(vocab: int, rows=4, width=12, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width)
    for r in range(rows):
        mask[r, 3:width - r] = 1
    return TrainBatch(tokens=tokens, loss_mask=mask)


def test_critic_values_are_token_aligned_and_causal(tiny_arch):
    critic = _critic(tiny_arch)
    batch = _batch(tiny_arch.vocab_size)
    values = critic.token_values(batch)
    assert values.shape == batch.tokens.shape and torch.all(values == 0)  # a zero head: V = 0 at first
    with torch.no_grad():
        critic.network.value_head.weight.normal_(0, 1.0)
    values = critic.token_values(batch)
    changed = batch.tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % tiny_arch.vocab_size
    after = critic.token_values(TrainBatch(tokens=changed, loss_mask=batch.loss_mask))
    # V[:, t] is the state before token t: columns up to 6 cannot see token 6, column 7 on can
    torch.testing.assert_close(after[:, :7], values[:, :7], rtol=0, atol=0)
    assert (after[:, 7:] - values[:, 7:]).abs().max() > 1e-6
    assert torch.all(values[:, 0] == 0)


def test_the_critic_learns_its_returns(tiny_arch):
    critic = _critic(tiny_arch, value_clip=None)
    batch = _batch(tiny_arch.vocab_size)
    outcome = torch.tensor([1.0, -0.5, 0.25, 2.0])
    batch.values = critic.token_values(batch)
    batch.returns = token_rewards(outcome, batch.loss_mask).float().flip(-1).cumsum(-1).flip(-1) * batch.loss_mask
    normalizer = float(batch.loss_mask.sum())
    losses = [critic.update(batch, normalizer)["critic/value_loss"] for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0], losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_ppo_run_trains_policy_and_critic_and_resumes_bit_exactly(tmp_path, tiny_chat_model, mode):
    extra = [*PPO, *(["rollout.max_staleness=1", "rollout.deterministic=true"] if mode == "async" else [])]
    straight = str(tmp_path / "straight")
    train(_config(tiny_chat_model, straight, *extra))
    records = [json.loads(line) for line in open(os.path.join(straight, "metrics.jsonl"))]
    steps = [r for r in records if "critic/value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("critic/explained_variance", "critic/values_mean", "critic/returns_mean", "critic/value_clip_frac",
                "train/clip_frac", "train/loss"):
        assert all(key in r for r in steps), key
    assert sorted(os.listdir(os.path.join(straight, "critic", "checkpoints"))) == ["latest", "step_00000002",
                                                                                   "step_00000003"]
    interrupted = str(tmp_path / "interrupted")
    train(_config(tiny_chat_model, interrupted, *extra, "steps=1"))
    train(_config(tiny_chat_model, interrupted, *extra), resume=True)
    for sub in ("", "critic"):
        expected, actual = _weights(os.path.join(straight, sub)), _weights(os.path.join(interrupted, sub))
        assert expected.keys() == actual.keys()
        assert all(torch.equal(expected[n], actual[n]) for n in expected), sub or "policy"
    critic_start = _weights(os.path.join(straight, "critic"), "step_00000002")
    assert any(not torch.equal(critic_start[n], expected[n]) for n in expected)  # the critic trained in step 3


def test_the_critic_warms_up_before_the_policy_trains(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "warm")
    train(_config(tiny_chat_model, run_dir, *PPO, "steps=2", "algorithm.critic.warmup_steps=1",
                  "checkpoint.keep_last=5"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    first, second = [r for r in records if "critic/value_loss" in r]
    assert first.get("critic/warmup") == 1.0 and "train/loss" not in first
    assert "critic/warmup" not in second and "train/loss" in second
    policy_1, policy_2 = _weights(run_dir, "step_00000001"), _weights(run_dir, "step_00000002")
    initial = _hf_as_megatron(tiny_chat_model)
    assert all(torch.equal(policy_1[n], initial[n]) for n in policy_1)  # untouched while the critic warmed up
    assert any(not torch.equal(policy_1[n], policy_2[n]) for n in policy_1)
    critic_0 = _weights(os.path.join(run_dir, "critic"), "step_00000001")
    assert critic_0["value_head.weight"].abs().max() > 0  # the critic trained in step 1


@pytest.mark.slow
def test_a_sigkilled_ppo_run_resumes_policy_and_critic_bit_exactly(tmp_path, tiny_chat_model):
    from tests.test_reliability import _last_step, _overrides

    extra = [*PPO, "steps=4", "rollout.max_staleness=1", "rollout.deterministic=true"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}

    def launch(run_dir, log):
        return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train",
                                 os.path.join(REPO, "examples", "configs", "quickstart.yaml"),
                                 *_overrides(tiny_chat_model, run_dir, *extra)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    with open(tmp_path / "straight.log", "w") as log:
        assert launch(straight, log).wait(timeout=300) == 0, open(tmp_path / "straight.log").read()[-3000:]
    with open(tmp_path / "killed.log", "w") as log:
        proc = launch(killed, log)
        deadline = time.monotonic() + 240
        while _last_step(killed) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the kill"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(tmp_path / "relaunch.log", "w") as log:
        assert launch(killed, log).wait(timeout=300) == 0, open(tmp_path / "relaunch.log").read()[-3000:]
    assert "resumed from" in open(tmp_path / "relaunch.log").read()
    for sub in ("", "critic"):
        expected, actual = _weights(os.path.join(straight, sub)), _weights(os.path.join(killed, sub))
        assert all(torch.equal(expected[n], actual[n]) for n in expected), sub or "policy"


def _weights(run_dir: str, step: str | None = None) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(run_dir, CheckpointConfig())
    path = manager.latest() if step is None else os.path.join(manager.root, step)
    return load_file(os.path.join(path, "model", "mp_rank_00_000", "model.safetensors"))


def _hf_as_megatron(model_path: str) -> dict[str, torch.Tensor]:
    from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
    from megatron_rl.models.pretrained import load_pretrained

    model = load_pretrained(model_path)
    return hf_to_megatron(model.state, MegatronLayout(model.arch, tp=1, pp=1))[0][0]


@pytest.mark.parametrize("fields,field", [
    (dict(value_clip=0), "value_clip"), (dict(warmup_steps=-1), "warmup_steps"), (dict(head_lr=2.0), "head_lr"),
    (dict(updates_per_step=0), "updates_per_step"), (dict(init_from=" "), "init_from"),
])
def test_critic_fields_are_bounded(fields, field):
    with pytest.raises(ConfigError) as error:
        CriticConfig(**fields)
    assert error.value.field == field


def test_gae_and_the_ppo_objective_go_together():
    from megatron_rl.algorithms.config import AdvantageConfig
    from megatron_rl.run_config import AlgorithmConfig

    for objective, estimator in (("ppo", "grpo"), ("policy_gradient", "gae")):
        with pytest.raises(ConfigError, match="objective ppo"):
            AlgorithmConfig(objective=objective, advantage=AdvantageConfig(estimator=estimator))
    with pytest.raises(ConfigError) as error:
        CriticConfig(trainer=TrainerConfig(parallel=ParallelConfig(tensor_parallel=2)))
    assert error.value.field == "trainer.parallel"


@pytest.mark.slow
def test_a_ppo_run_checkpointed_at_tp2_resumes_policy_and_critic_on_one_rank(tmp_path, tiny_chat_model):
    """Stopped after step 2 at TP=2 and relaunched at TP=1: the critic's backbone is resharded and its value
    head moved to the new last stage, so step 3's critic and policy losses are the uninterrupted run's
    (within the resharding tolerance: another TP reduces in another order)."""
    from tests.test_checkpoint_reshard import tp2_run_resumed_on_one_rank

    straight, resumed, _ = tp2_run_resumed_on_one_rank(tmp_path, tiny_chat_model, *PPO)
    for key in ("critic/value_loss", "critic/explained_variance", "train/loss", "train/grad_norm"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-4, abs=1e-6), key
    assert resumed["critic/value_loss"] > 0
