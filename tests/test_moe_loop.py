"""A mixture-of-experts policy through the whole RL loop (tiny upcycled model, SmolLM2's tokenizer): the engine
records its routing, the records reach the trainer's batch, the trainer replays them, and the moe/* metrics
say how often its own router would have chosen differently; synchronous and asynchronous runs."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.controller.loop import train
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.models.upcycle import UpcycleRecipe, upcycle_state
from tests.test_loop import _config


@pytest.fixture(scope="module")
def tiny_moe_model(tmp_path_factory, tiny_chat_model):
    dense = load_pretrained(tiny_chat_model)
    # noise: experts that differ, so a routing choice changes the output and replay matters
    arch, state = upcycle_state(dense.arch, dense.state, UpcycleRecipe(num_experts=4, top_k=2, expert_noise=0.05))
    path = str(tmp_path_factory.mktemp("tiny_moe") / "hf")
    save_hf(path, arch, state, dense.tokenizer)
    return path


def _step_metrics(run_dir):
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in records if "rollout/reward_mean" in r]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_moe_run_replays_the_engine_routing(tmp_path, tiny_moe_model, placement):
    run_dir = str(tmp_path / placement)
    extra = ["steps=2", "trainer.moe_routing_replay=true", f"rollout.placement={placement}"]
    if placement == "disaggregated":
        extra += ["rollout.max_staleness=1", "rollout.deterministic=true"]
    summary = train(_config(tiny_moe_model, run_dir, *extra))
    assert summary.steps == 2
    steps = _step_metrics(run_dir)
    assert len(steps) == 2
    for record in steps:
        # the routing record arrived: the trainer measured its own router against it
        assert "moe/routing_mismatch" in record, sorted(k for k in record if k.startswith("moe/"))
        assert 0.0 <= record["moe/routing_mismatch"] <= 1.0
        if record["rollout/staleness_max"] == 0:
            # same weights, the engine's experts replayed: the recomputed log-probs are the behaviour ones
            assert record["train/logprob_mismatch"] < 1e-4


def test_multi_turn_agent_episodes_carry_every_turns_routing(tmp_path, tiny_moe_model):
    """An agent episode is one sample of several engine requests: its routing record covers every position
    (each turn's own record where it decoded, the next turn's prefill for the tokens between), and a
    replaying trainer recomputes the behaviour log-probs of every sampled token."""
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.recipes.agent.episodes import AgentEpisodes
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.run_config import load_run_config
    from tests.test_agent_episodes import EchoEnvironment, _prompts
    from tests.test_agent_recipe import RECIPE, _overrides

    model = load_pretrained(tiny_moe_model)
    with NativeEngine(model.arch, model.state, tokenizer=model.tokenizer,
                      config=NativeEngineConfig(max_batch_size=4, max_seq_len=512, record_routing=True)) as engine:
        producer = AgentEpisodes(engine, model.tokenizer, lambda: EchoEnvironment(3),
                                 sampling=SamplingParams(max_new_tokens=6, temperature=1.0), samples_per_prompt=1)
        (future,) = producer.start(_prompts()[0], "s0-p0", 5)
        episode = future.run.drive()
    sample = episode.sample()
    record = sample.completion.routed_experts
    positions = len(sample.completion.prompt_ids) + len(sample.completion.output_ids) - 1
    assert record.shape == (positions, model.arch.num_layers, model.arch.moe_top_k) and (record >= 0).all()
    for turn in episode.turns:  # each turn's decode positions hold that turn's own record
        c = turn.completion
        start, end = len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids) - 1
        assert torch.equal(record[start:end], c.routed_experts[start:end])

    run_dir = str(tmp_path / "agent")
    summary = train(load_run_config(RECIPE, _overrides(
        tiny_moe_model, run_dir, "steps=1", "trainer.moe_routing_replay=true", "eval.before_training=false",
        "eval.after_training=false", "agent.environment=tests.test_agent_recipe:echo_environments")))
    assert summary.steps == 1
    (metrics,) = [m for m in _step_metrics(run_dir)]
    assert metrics["agent/turns_per_episode"] == 3.0
    assert "moe/routing_mismatch" in metrics and metrics["train/logprob_mismatch"] < 1e-4
