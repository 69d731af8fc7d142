"""`megatron-rl plan RECIPE [overrides] [--json] [--search-ep]`: check a cluster layout against the world and the
model, print memory per GPU term by term and the predicted step time (sim/planner.py; no GPU needed). For a
mixture-of-experts model it also plans every expert-parallel size that divides and marks the best;
--search-ep plans with that best EP instead of the configured one."""
from __future__ import annotations

import argparse
import json

from megatron_rl.run_config import load_run_config
from megatron_rl.sim.planner import (
    LayoutError,
    best_expert_parallel,
    expert_layout,
    format_expert_parallel,
    format_plan,
    make_plan,
    resolve_arch,
    search_expert_parallel,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="cluster recipe, e.g. examples/configs/llama3_405b.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.nodes=64")
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON line")
    parser.add_argument("--search-ep", action="store_true",
                        help="MoE: plan with the fastest expert-parallel size that fits, not the configured one")


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.overrides)
    arch = resolve_arch(config.cluster, config.model.path)
    if not arch.is_moe:
        plan = make_plan(config, arch)
        print(format_plan(plan))
    else:
        options = search_expert_parallel(config, arch)
        configured = expert_layout(config)[0]
        best = best_expert_parallel(options)
        if args.search_ep:
            if best is None:
                raise LayoutError("field 'trainer.parallel.expert_parallel': no expert-parallel size fits: "
                                  + "; ".join(f"EP {o.ep}: {o.error}" for o in options),
                                  field="trainer.parallel.expert_parallel")
            plan = best.plan
        else:
            plan = make_plan(config, arch)  # the configured EP: its own error if it cannot run
        print(format_plan(plan))
        print(format_expert_parallel(options, configured))
        if best is not None and best.ep != plan.ep:
            print(f"best: trainer.parallel.expert_parallel={best.ep}")
    if args.json:
        print(json.dumps(plan.summary()))
    return 0
