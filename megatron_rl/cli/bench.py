"""`megatron-rl bench NAME`: time our code and its baseline in the same run.

Every benchmark logs what it measures as it goes (INFO lines on stdout, observability/logs.py) and
returns its result; this command prints that result, as the very last line, as one JSON object
`{"bench": NAME, "ratio": ..., ...}` (the only stdout writer of a bench: nothing is logged after it). A
benchmark is a function `run(options: dict) -> dict` named in BENCHMARKS; `key=value` options after the
name are passed to it (values read as YAML).

`--repeat N` runs the benchmark N times in one process, prints each run's result as it ends, and makes the
last line the median run's result with `ratio` = the median ratio, `ratio_min`, `ratio_max` and `runs` (every
run's result), so one noisy measurement on a shared machine is visible as such.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import statistics
import sys

import yaml

from megatron_rl.config import ConfigError

# name -> "module:function", each returning the result dict (without the "bench" key).
BENCHMARKS: dict[str, str] = {
    "trainer": "megatron_rl.trainer.bench_train_step:bench_trainer",
    "packing": "megatron_rl.trainer.bench_packing:bench_packing",
    "lora": "megatron_rl.trainer.bench_lora:bench_lora",
    "rollout": "megatron_rl.rollout.bench_generate:bench_rollout",
    "serve": "megatron_rl.rollout.bench_serve:bench_serve",
    "vllm-sync": "megatron_rl.rollout.bench_vllm_sync:bench_vllm_sync",
    "serve-memory": "megatron_rl.rollout.bench_serve_memory:bench_serve_memory",
    "logprob": "megatron_rl.kernels.bench_logprob:bench_logprob",
    "async": "megatron_rl.controller.bench_async:bench_async",
    "sync": "megatron_rl.placement.bench_weight_sync:bench_sync",
    "delta-sync": "megatron_rl.placement.bench_delta_sync:bench_delta_sync",
    "pcl": "megatron_rl.recipes.pcl.bench_selection:bench_pcl",
    "sim": "megatron_rl.sim.simulate:bench_sim",
    "sandbox": "megatron_rl.recipes.agent.bench_sandbox:bench_sandbox",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="one of: " + ", ".join(BENCHMARKS))
    parser.add_argument("options", nargs="*", help="key=value options for the benchmark (e.g. steps=5)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="measure N times in this process; the last line reports the median ratio and the spread")


def parse_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"benchmark option {item!r} must look like key=value")
        options[key] = yaml.safe_load(value)
    return options


def summarize_runs(results: list[dict]) -> dict:
    """One result for repeated runs: the median run's fields, `ratio` = the median ratio (the mean of the
    middle two for an even count), its spread, and every run under `runs`."""
    ratios = [result["ratio"] for result in results]
    middle = sorted(results, key=lambda result: result["ratio"])[(len(results) - 1) // 2]
    return {**middle, "ratio": round(statistics.median(ratios), 4), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "runs": results}


def run(args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        close = difflib.get_close_matches(args.name, list(BENCHMARKS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown benchmark '{args.name}'{hint} (known: {', '.join(BENCHMARKS)})")
    if args.repeat < 1:
        raise ConfigError(f"bench --repeat must be at least 1, got {args.repeat}")
    module, function = BENCHMARKS[args.name].split(":")
    bench = getattr(importlib.import_module(module), function)
    options = parse_options(args.options)
    results = []
    for index in range(args.repeat):
        results.append(bench(dict(options)))
        if args.repeat > 1:
            print(f"run {index + 1}/{args.repeat}: {json.dumps(results[-1])}", flush=True)
    result = results[0] if args.repeat == 1 else summarize_runs(results)
    sys.stdout.flush()
    print(json.dumps({"bench": args.name, **result}))
    return 0
