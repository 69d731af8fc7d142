"""`megatron-rl safety-report RUN_DIR...`: a WaltzRL run's held-out rates before vs after, paired prompt by
prompt, with exact McNemar p-values (recipes/waltz/report.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json

from megatron_rl.recipes.waltz.report import paired_changes, read_eval_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="WaltzRL run directories")
    parser.add_argument("--before", type=int, default=None, help="step of the first evaluation (default: the first)")
    parser.add_argument("--after", type=int, default=None, help="step of the second evaluation (default: the last)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")


def run(args: argparse.Namespace) -> int:
    for run_dir in args.run_dirs:
        changes = paired_changes(read_eval_records(run_dir), args.before, args.after)
        if args.json:
            print(json.dumps({"run_dir": run_dir, "changes": [dataclasses.asdict(c) for c in changes]}))
            continue
        print(f"{run_dir}")
        print(f"  {'split':<10} {'metric':<34} {'n':>4} {'before':>7} {'after':>7} {'fixed':>6} {'broken':>6} {'p':>7}")
        for c in changes:
            print(f"  {c.split:<10} {c.metric:<34} {c.prompts:>4} {c.before:>7.3f} {c.after:>7.3f} {c.fixed:>6} "
                  f"{c.broken:>6} {c.p_value:>7.3f}")
    return 0
