"""`megatron-rl config [CONFIG.yaml] [overrides...] [--describe]`: the resolved run config."""
from __future__ import annotations

import argparse

from megatron_rl.config import describe, dump_yaml
from megatron_rl.run_config import RunConfig, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML recipe (default: all defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    parser.add_argument("--describe", action="store_true", help="list every field with its type, default and doc")


def run(args: argparse.Namespace) -> int:
    if args.describe:
        print("\n".join(describe(RunConfig)))
        return 0
    print(dump_yaml(load_run_config(args.config, args.overrides)), end="")
    return 0
