"""`megatron-rl train CONFIG.yaml [overrides] [--resume]`."""
from __future__ import annotations

import argparse
import json
import os

from megatron_rl.controller.loop import train
from megatron_rl.run_config import load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML recipe, e.g. examples/configs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 run_dir=runs/x")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.overrides)
    summary = train(config, resume=args.resume)  # every rank of a torchrun / srun launch runs it
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"accuracy_before": summary.accuracy_before, "accuracy_after": summary.accuracy_after,
                          "wall_time_s": round(summary.wall_time_s, 1), "run_dir": config.run_dir}))
    return 0
