"""The quickstart recipe end to end (slow): two runs with the same seed end identically."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_outcome(run_dir: str) -> tuple[dict, dict]:
    """(summary.json without its timings, the final checkpoint's model tensors) of a run directory."""
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    summary.pop("wall_time_s")
    summary["final_metrics"] = {k: v for k, v in summary["final_metrics"].items() if not k.startswith("perf/")}
    with open(os.path.join(run_dir, "checkpoints", "latest"), encoding="utf-8") as f:
        step = f.read().strip()
    model = os.path.join(run_dir, "checkpoints", step, "model")
    weights = {}
    for shard in sorted(os.listdir(model)):
        if shard.startswith("mp_rank_"):
            weights.update({f"{shard}/{k}": v for k, v in load_file(os.path.join(model, shard, "model.safetensors")).items()})
    return summary, weights


@pytest.mark.slow
def test_quickstart_recipe_is_reproducible(tmp_path):
    outcomes = []
    for name in ("a", "b"):
        run_dir = str(tmp_path / name)
        subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "examples/configs/quickstart.yaml",
                        "steps=3", "data.heldout_size=16", "checkpoint.every_steps=0", "logging.wandb=disabled",
                        "logging.plots=false", f"run_dir={run_dir}"], cwd=ROOT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
        outcomes.append(run_outcome(run_dir))
    (summary_a, weights_a), (summary_b, weights_b) = outcomes
    assert summary_a["steps"] == 3 and summary_a["accuracy_after"] is not None
    assert summary_a == summary_b
    assert weights_a.keys() == weights_b.keys() and weights_a
    assert all(weights_a[k].equal(weights_b[k]) for k in weights_a)
