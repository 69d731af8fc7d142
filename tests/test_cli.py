"""The `megatron-rl` command: every subcommand and benchmark resolves to the code it names."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from megatron_rl.cli import COMMANDS, build_parser
from megatron_rl.cli.bench import BENCHMARKS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_builds_its_arguments(name):
    parser = build_parser(name)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert callable(importlib.import_module(COMMANDS[name][0]).run)


def test_every_benchmark_resolves_and_its_recipe_exists():
    for name, spec in BENCHMARKS.items():
        module, _, function = spec.partition(":")
        bench = importlib.import_module(module)
        assert callable(getattr(bench, function)), name
        for recipe in ("RECIPE", "QUICKSTART"):  # the example recipes benches read
            if hasattr(bench, recipe):
                assert os.path.isfile(getattr(bench, recipe)), (name, getattr(bench, recipe))


def test_help_lists_every_command_without_importing_torch():
    code = ("import sys, contextlib, io; from megatron_rl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main(['--help'])\n"
            "    except SystemExit: pass\n"
            "print('torch' in sys.modules, all(c in out.getvalue() for c in " + repr(sorted(COMMANDS)) + "))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]
