"""`megatron-rl config [CONFIG.yaml] [overrides...] [--describe]`: the resolved run config."""
from __future__ import annotations

import argparse

from megatron_rl.config import describe, dump_yaml, load_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML recipe (default: all defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    parser.add_argument("--describe", action="store_true", help="list every field with its type, default and doc")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.run_config import RunConfig

    if args.describe:
        print("\n".join(describe(RunConfig)))
        return 0
    config_path, overrides = args.config, list(args.overrides)
    if config_path and "=" in config_path and not config_path.endswith((".yaml", ".yml")):
        config_path, overrides = None, [config_path, *overrides]
    print(dump_yaml(load_yaml(RunConfig, config_path, overrides)), end="")
    return 0
