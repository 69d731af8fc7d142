"""`megatron-rl bench NAME`: time our code and its baseline in the same run.

Every benchmark prints what it measures as it goes and, as its very last line, one JSON object
`{"bench": NAME, "ratio": ..., ...}`. A benchmark is a function `run(options: dict) -> dict` named in
BENCHMARKS; `key=value` options after the name are passed to it (values read as YAML).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys

import yaml

from megatron_rl.config import ConfigError

# name -> "module:function", each returning the result dict (without the "bench" key).
BENCHMARKS: dict[str, str] = {
    "trainer": "megatron_rl.trainer.bench_train_step:bench_trainer",
    "rollout": "megatron_rl.rollout.bench_generate:bench_rollout",
    "serve": "megatron_rl.rollout.bench_serve:bench_serve",
    "logprob": "megatron_rl.kernels.bench_logprob:bench_logprob",
    "async": "megatron_rl.controller.bench_async:bench_async",
    "sync": "megatron_rl.placement.bench_weight_sync:bench_sync",
    "pcl": "megatron_rl.recipes.pcl.bench_selection:bench_pcl",
    "sim": "megatron_rl.sim.simulate:bench_sim",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="one of: " + ", ".join(BENCHMARKS))
    parser.add_argument("options", nargs="*", help="key=value options for the benchmark (e.g. steps=5)")


def parse_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"benchmark option {item!r} must look like key=value")
        options[key] = yaml.safe_load(value)
    return options


def run(args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        close = difflib.get_close_matches(args.name, list(BENCHMARKS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown benchmark '{args.name}'{hint} (known: {', '.join(BENCHMARKS)})")
    module, function = BENCHMARKS[args.name].split(":")
    result = getattr(importlib.import_module(module), function)(parse_options(args.options))
    sys.stdout.flush()
    print(json.dumps({"bench": args.name, **result}))
    return 0
