"""`megatron-rl bench async`: the quickstart workload trained synchronously (colocated, both cores
taking turns) and asynchronously (generator and trainer processes, max_staleness 1), same steps, same
run. A third run at the fixed async split (generator and trainer on one core each, no core lending)
with max_staleness 0 measures generation alone and training alone on one core each:

    ratio              = sync step time / async step time
    overlap_efficiency = max(generation alone, training alone) / async step time

The async run lends cores (rollout.lend_idle_cores, placement/core_share.py): whichever side is idle
gives its core to the other. The JSON also gives what the run's own measurements bound:
`fixed_split_bound` = sync step / max(generation, training alone on one core) is the best a fixed
1 + 1 split could do with perfect overlap (~1.16x with HF transformers' 1.55x / 1.69x two-core
speed-ups measured on 2 cores); `work_conserving_bound` = sync step / ((generation + training alone on one
core) / 2) is the best any split of the same work over two cores could do. Gains beyond them come
from work that does not scale with cores and from keeping the engine's batch full across steps.

Every group is trained (rollout.drop_uninformative_groups=false), so the runs do equal work per step.
Options: steps, warmup, generator_threads, trainer_threads (1 and 1 by default), fixed_split=1 (a
fourth run: async on the fixed split, no lending), keep=DIR (keep the run directories, with their
metrics and Perfetto timelines, under DIR), and any dotted config override.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile

from megatron_rl.config import load_yaml
from megatron_rl.controller.loop import train
from megatron_rl.run_config import RunConfig

log = logging.getLogger(__name__)

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "quickstart.yaml")


def _run(name: str, overrides: list[str], root: str) -> list[dict]:
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
    # Every group trains (no drop of all-equal-reward groups), so the runs do the same work per step
    # although their samples differ.
    common = [f"steps={steps}", "rollout.drop_uninformative_groups=false",
              *[f"{k}={v}" for k, v in options.items() if "." in k]]
    keep = options.get("keep")
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory()) as root:
        sync = _run("sync", [*common, "rollout.placement=colocated", "rollout.max_staleness=0",
                             "engine.num_threads=2"], root)[warmup:]
        split = ["rollout.placement=disaggregated", f"rollout.generator_threads={generator_threads}",
                 f"rollout.trainer_threads={trainer_threads}"]
        alone = _run("split_sync", [*common, *split, "rollout.max_staleness=0", "rollout.lend_idle_cores=false"],
                     root)[warmup:]
        overlapped = _run("async", [*common, *split, "rollout.max_staleness=1"], root)[warmup:]
        fixed = (_run("async_fixed_split", [*common, *split, "rollout.max_staleness=1", "rollout.lend_idle_cores=false"],
                      root)[warmup:] if options.get("fixed_split") else [])

    mean = lambda rows, key: statistics.fmean(r.get(key) or 0.0 for r in rows)  # noqa: E731
    sync_step, async_step = mean(sync, "perf/step_time"), mean(overlapped, "perf/step_time")
    gen_alone, train_alone = mean(alone, "perf/generate_time"), mean(alone, "perf/train_time")
    sync_gen, sync_train = mean(sync, "perf/generate_time"), mean(sync, "perf/train_time")
    result = {
        "ratio": round(sync_step / async_step, 3),
        "overlap_efficiency": round(max(gen_alone, train_alone) / async_step, 3),
        "sync_step_s": round(sync_step, 2), "async_step_s": round(async_step, 2),
        "generation_alone_1core_s": round(gen_alone, 2), "training_alone_1core_s": round(train_alone, 2),
        "sync_generate_s": round(sync_gen, 2), "sync_train_s": round(sync_train, 2),
        "generation_two_core_speedup": round(gen_alone / sync_gen, 3),
        "training_two_core_speedup": round(train_alone / sync_train, 3),
        "fixed_split_bound": round(sync_step / max(gen_alone, train_alone), 3),
        "work_conserving_bound": round(sync_step / ((gen_alone + train_alone) / 2), 3),
        "async_staleness_mean": round(mean(overlapped, "rollout/staleness_mean"), 3),
        "async_trained_rows": round(mean(overlapped, "rollout/trained_samples"), 1),
        "sync_trained_rows": round(mean(sync, "rollout/trained_samples"), 1),
        # The runs' samples differ (an async step trains on the previous version's samples, which
        # shorten later as the policy learns), and so does the work behind each step time.
        "sync_response_tokens": round(mean(sync, "rollout/response_tokens"), 1),
        "alone_response_tokens": round(mean(alone, "rollout/response_tokens"), 1),
        "async_response_tokens": round(mean(overlapped, "rollout/response_tokens"), 1),
        "steps_measured": len(overlapped), "generator_threads": generator_threads, "trainer_threads": trainer_threads,
    }
    if fixed:
        result["async_fixed_split_step_s"] = round(mean(fixed, "perf/step_time"), 2)
        result["ratio_fixed_split"] = round(sync_step / result["async_fixed_split_step_s"], 3)
    log.info(f"sync {sync_step:.1f} s/step (generate {result['sync_generate_s']} + train {result['sync_train_s']}), "
             f"async {async_step:.1f} s/step; alone at 1 core each: generate {gen_alone:.1f} s, train {train_alone:.1f} s")
    return result
