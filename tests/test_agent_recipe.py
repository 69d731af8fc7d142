"""The agent recipe end to end on a tiny model: multi-turn episodes through the training loop (sync and
asynchronous), their metrics, the tool environment with the calculator task, and resume: a run stopped
or SIGKILLed mid-episode trains every prompt exactly once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.controller.recipe import recipe_name
from megatron_rl.data.sources import PromptStream
from megatron_rl.recipes.agent.tasks import build_calculator_datasets
from megatron_rl.run_config import RunConfig, load_run_config
from tests.test_agent_episodes import EchoEnvironment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "examples", "configs", "agent_calculator.yaml")


def echo_environments(agent, tokenizer):
    """A custom environment (agent.environment): every turn answered until max_turns (multi-turn
    episodes even from a random model, which never writes a tool call)."""
    return lambda: EchoEnvironment(agent.max_turns)


def _overrides(model_path, run_dir, *extra):
    return [f"model.path={model_path}", f"run_dir={run_dir}", "steps=3", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "trainer.micro_batch_size=2",
            "trainer.lr=1e-3", "agent.task.train_size=16", "agent.task.heldout_size=3", "agent.max_turns=3",
            "engine.max_batch_size=8", "engine.max_seq_len=512", "engine.num_threads=1", "eval.max_new_tokens=8",
            "checkpoint.every_steps=1", "logging.wandb=disabled", "logging.plots=false",
            "rollout.drop_uninformative_groups=false", *extra]


def _config(model_path, run_dir, *extra) -> RunConfig:
    return load_run_config(RECIPE, _overrides(model_path, run_dir, *extra))


def _expected_prompt_order(config: RunConfig) -> list[str]:
    train_set, _ = build_calculator_datasets(config.agent.task)
    stream = PromptStream.from_config(train_set, config.data)
    return [p.prompt_id for p in stream.next(config.steps * config.rollout.prompts_per_step)]


def _ledger(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "prompts.jsonl"))]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_recipe_config_is_picked_and_bad_fields_are_named(tmp_path):
    config = load_run_config(RECIPE, [])
    assert recipe_name(config) == "agent" and config.agent.tools == ["calculator"]
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_run_config(RECIPE, ["agent.max_turns=0"])
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        load_run_config(RECIPE, ["agent.tools=[abacus]"])
    with pytest.raises(ConfigError, match="agent.task.digits"):
        load_run_config(RECIPE, ["agent.task.digits=[4]"])


def test_sync_run_trains_on_multi_turn_episodes_on_policy(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "sync")
    config = _config(tiny_chat_model, run_dir, "agent.environment=tests.test_agent_recipe:echo_environments")
    summary = train(config)
    assert summary.steps == 3
    metrics = [m for m in _metrics(run_dir) if "agent/episodes" in m]
    assert len(metrics) == 3
    for m in metrics:
        assert m["agent/turns_per_episode"] == 3.0 and m["agent/episodes"] == 4
        assert m["agent/environment_tokens"] > 0 and m["agent/sampled_tokens"] > 0
        # on-policy: the trainer's log-probs of every sampled token equal the engine's behaviour ones
        assert m["train/logprob_mismatch"] < 1e-4
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "agent_episodes.jsonl"))]
    assert len(episodes) == 12 and all(len(e["turns"]) == 3 for e in episodes)
    assert [p for r in _ledger(run_dir) for p in r["prompts"]] == _expected_prompt_order(config)


def test_tool_environment_run_reports_tool_metrics(tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "tools")
    summary = train(_config(tiny_chat_model, run_dir, "steps=1"))
    assert summary.steps == 1
    (m,) = [m for m in _metrics(run_dir) if "agent/episodes" in m]
    for key in ("turns_per_episode", "tool_calls_per_episode", "tool_errors", "wellformed_tool_call_rate",
                "sampled_tokens", "environment_tokens", "episode_reward"):
        assert f"agent/{key}" in m
    final = json.load(open(os.path.join(run_dir, "summary.json")))
    assert "eval/wellformed_tool_call_rate" in json.dumps(final)


def test_async_run_stopped_mid_episode_resumes_every_prompt_exactly_once(tmp_path, tiny_chat_model):
    """max_staleness 1: at each checkpoint the next step's episodes are in flight; the checkpoint keeps
    their prompts and the resumed run plays them again (no prompt lost or trained twice)."""
    extra = ["rollout.max_staleness=1", "agent.environment=tests.test_agent_recipe:echo_environments",
             "eval.before_training=false", "eval.after_training=false"]
    run_dir = str(tmp_path / "async")
    train(_config(tiny_chat_model, run_dir, *extra, "steps=2"))
    manager = CheckpointManager(run_dir, CheckpointConfig())
    _, buffer = manager.load_tensors(manager.latest(), "rollouts")
    assert len(buffer["episode_groups"]) == 2 and {g["step"] for g in buffer["episode_groups"]} == {2}
    config = _config(tiny_chat_model, run_dir, *extra, "steps=4")
    assert train(config, resume=True).steps == 4
    ledger = _ledger(run_dir)
    assert [r["step"] for r in ledger] == [1, 2, 3, 4]
    assert [p for r in ledger for p in r["prompts"]] == _expected_prompt_order(config)
    assert max(m["rollout/staleness_max"] for m in _metrics(run_dir)) <= 1


@pytest.mark.slow
def test_sigkilled_agent_run_trains_every_prompt_exactly_once(tmp_path, tiny_chat_model):
    """SIGKILL while episodes are in flight (asynchronous), then relaunch with the same command, twice."""
    extra = ["steps=6", "rollout.max_staleness=1", "rollout.placement=disaggregated",
             "agent.environment=tests.test_agent_recipe:echo_environments", "eval.before_training=false",
             "eval.after_training=false"]
    run_dir = str(tmp_path / "killed")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}

    def launch(log):
        return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", RECIPE,
                                 *_overrides(tiny_chat_model, run_dir, *extra)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def last_step() -> int:
        try:
            return _ledger(run_dir)[-1]["step"]
        except (OSError, IndexError, json.JSONDecodeError):
            return 0

    kills = []
    for attempt, target in enumerate([2, 4]):
        with open(tmp_path / f"attempt{attempt}.log", "w") as log:
            proc = launch(log)
            deadline = time.monotonic() + 300
            while last_step() < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # inside the next step: its episodes (and the one after) are generating
            assert proc.poll() is None, open(tmp_path / f"attempt{attempt}.log").read()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills.append(last_step())
    with open(tmp_path / "final.log", "w") as log:
        assert launch(log).wait(timeout=600) == 0, open(tmp_path / "final.log").read()[-3000:]
    print(f"SIGKILLed after steps {kills}")
    ledger = _ledger(run_dir)
    assert [r["step"] for r in ledger] == list(range(1, 7))
    config = _config(tiny_chat_model, run_dir, *extra)
    assert [p for r in ledger for p in r["prompts"]] == _expected_prompt_order(config)
