"""The one `megatron-rl` command. Each subcommand lives next to the code it drives and registers
itself through a module exposing `add_arguments(parser)` and `run(args) -> int` (or, written as
"module:NAME", `add_NAME_arguments` and `run_NAME`)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_rl.config import ConfigError

# name -> (module, one-line help). Modules are imported lazily so `megatron-rl --help` stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("megatron_rl.cli.convert", "convert GGUF / HF safetensors <-> Megatron checkpoints (any TP/PP)"),
    "bench": ("megatron_rl.cli.bench", "time our code against its baseline in one run; last line is JSON"),
    "config": ("megatron_rl.cli.config", "print a recipe with overrides applied, or describe every field"),
    "generate": ("megatron_rl.cli.generate", "complete chat prompts with the native rollout engine"),
    "chat": ("megatron_rl.cli.chat", "chat with a model, optionally with a WaltzRL feedback agent in the loop"),
    "serve": ("megatron_rl.cli.serve", "serve the native engine over an SGLang-compatible HTTP API"),
    "train": ("megatron_rl.cli.train", "run RL training from a YAML recipe (add --resume to continue)"),
    "plan": ("megatron_rl.cli.plan", "validate a cluster layout; per-GPU memory and predicted step time (no GPU)"),
    "eval": ("megatron_rl.cli.eval", "held-out greedy accuracy (and mean@k) of a model or checkpoint"),
    "safety-report": ("megatron_rl.cli.safety_report",
                      "a WaltzRL run's held-out safety before vs after, prompt by prompt, with McNemar p-values"),
}


def _entry(spec: str, kind: str):
    module, _, name = spec.partition(":")
    attr = (f"add_{name}_arguments" if kind == "add" else f"run_{name}") if name else (
        "add_arguments" if kind == "add" else "run")
    return getattr(importlib.import_module(module), attr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module)
        _entry(module, "add")(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(_entry(args._module, "run")(args) or 0)
    except ConfigError as exc:
        # Bad input is the user's to fix: one clear line, no traceback (MEGATRON_RL_DEBUG=1 shows it).
        if os.environ.get("MEGATRON_RL_DEBUG"):
            raise
        print(f"megatron-rl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
