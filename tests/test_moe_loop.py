"""A mixture-of-experts policy through the whole RL loop (tiny upcycled model, SmolLM2's tokenizer): the engine
records its routing, the records reach the trainer's batch, the trainer replays them, and the moe/* metrics
say how often its own router would have chosen differently; synchronous and asynchronous runs."""
from __future__ import annotations

import json
import os

import pytest

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
