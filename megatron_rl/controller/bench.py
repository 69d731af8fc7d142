"""`megatron-rl bench async`: the quickstart workload trained synchronously (colocated, both cores
taking turns) and asynchronously (generator and trainer processes on one core each, max_staleness 1),
same steps, same run. A third run at the async split with max_staleness 0 measures generation alone
and training alone on one core each, which gives the overlap efficiency:

    ratio              = sync step time / async step time
    overlap_efficiency = max(generation alone, training alone) / async step time

Perfect overlap of equal-length batches would give at most ~1.16x here (FINDINGS.md: generation and
training speed up only 1.55x / 1.69x from one core to two). Options: steps, warmup, generator_threads,
trainer_threads (1 and 1 by default: the async split the overlap efficiency is defined at), and any
dotted config override.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile

from megatron_rl.config import load_yaml

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "quickstart.yaml")


def _run(name: str, overrides: list[str], root: str) -> list[dict]:
    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import RunConfig

    run_dir = os.path.join(root, name)
    config = load_yaml(RunConfig, QUICKSTART, [f"run_dir={run_dir}", "eval.before_training=false",
                                              "eval.after_training=false", "checkpoint.save_at_end=false",
                                              "checkpoint.every_steps=0", "logging.wandb=disabled",
                                              "logging.plots=false", *overrides])
    train(config)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "perf/step_time" in r]


def bench_async(options: dict) -> dict:
    steps = int(options.get("steps", 6))
    warmup = int(options.get("warmup", 1))
    generator_threads = int(options.get("generator_threads", 1))
    trainer_threads = int(options.get("trainer_threads", 1))
    common = [f"steps={steps}", *[f"{k}={v}" for k, v in options.items() if "." in k]]
    with tempfile.TemporaryDirectory() as root:
        sync = _run("sync", [*common, "rollout.placement=colocated", "rollout.max_staleness=0",
                             "engine.num_threads=2"], root)[warmup:]
        split = ["rollout.placement=disaggregated", f"rollout.generator_threads={generator_threads}",
                 f"rollout.trainer_threads={trainer_threads}"]
        alone = _run("split_sync", [*common, *split, "rollout.max_staleness=0"], root)[warmup:]
        overlapped = _run("async", [*common, *split, "rollout.max_staleness=1"], root)[warmup:]

    mean = lambda rows, key: statistics.fmean(r.get(key) or 0.0 for r in rows)  # noqa: E731
    sync_step, async_step = mean(sync, "perf/step_time"), mean(overlapped, "perf/step_time")
    gen_alone, train_alone = mean(alone, "perf/generate_time"), mean(alone, "perf/train_time")
    result = {
        "ratio": round(sync_step / async_step, 3),
        "overlap_efficiency": round(max(gen_alone, train_alone) / async_step, 3),
        "sync_step_s": round(sync_step, 2), "async_step_s": round(async_step, 2),
        "generation_alone_1core_s": round(gen_alone, 2), "training_alone_1core_s": round(train_alone, 2),
        "sync_generate_s": round(mean(sync, "perf/generate_time"), 2),
        "sync_train_s": round(mean(sync, "perf/train_time"), 2),
        "async_staleness_mean": round(mean(overlapped, "rollout/staleness_mean"), 3),
        "steps_measured": len(overlapped), "generator_threads": generator_threads, "trainer_threads": trainer_threads,
        "perfect_overlap_bound_equal_lengths": 1.16,
    }
    print(f"sync {sync_step:.1f} s/step (generate {result['sync_generate_s']} + train {result['sync_train_s']}), "
          f"async {async_step:.1f} s/step; alone at 1 core each: generate {gen_alone:.1f} s, train {train_alone:.1f} s")
    return result
