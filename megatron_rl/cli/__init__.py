"""The one `megatron-rl` command. Every subcommand is a module of this package exposing
`add_arguments(parser)` and `run(args) -> int`; it drives code that lives in the package named for it."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_rl.config import ConfigError

# name -> (module, one-line help). Only the module of the command being run is imported.
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `megatron-rl` parser. Only `command`'s module is imported, for its arguments; the others are
    listed by name and help, so `megatron-rl --help` starts without importing torch."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except ConfigError as exc:
        # Bad input is the user's to fix: one clear line, no traceback (MEGATRON_RL_DEBUG=1 shows it).
        if os.environ.get("MEGATRON_RL_DEBUG"):
            raise
        print(f"megatron-rl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
