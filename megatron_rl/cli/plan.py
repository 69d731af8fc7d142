"""`megatron-rl plan RECIPE [overrides] [--json]`: check a cluster layout against the world and the model,
print memory per GPU term by term and the predicted step time (sim/planner.py; no GPU needed)."""
from __future__ import annotations

import argparse
import json

from megatron_rl.run_config import load_run_config
from megatron_rl.sim.planner import format_plan, make_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="cluster recipe, e.g. examples/configs/llama3_405b.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.nodes=64")
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON line")


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.overrides)
    plan = make_plan(config)
    print(format_plan(plan))
    if args.json:
        print(json.dumps(plan.summary()))
    return 0
