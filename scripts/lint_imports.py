"""The layering check of the test command: `lint-imports` (import-linter; contracts in .importlinter,
layers in docs/layout.md) over the package as setup.py installs it.

    python scripts/lint_imports.py [lint-imports options]      e.g. --verbose, --contract layers

setup.py installs the top-level folders kernels/ and checkpoints_tools/ as `megatron_rl.kernels` and
`megatron_rl.checkpoints_tools` (its package_dir), and the code imports them by those names. grimp,
import-linter's graph builder, finds the modules of a root package by walking that package's one folder
(megatron_rl/), so run on the source tree it never sees those two subpackages: their layers would check
nothing. This script lays out the installed package as a view of symlinks in a temporary directory,
megatron_rl/ holding a link to each entry of the real megatron_rl/ and one per package_dir entry of
setup.py, and runs lint-imports there (grimp follows symlinks; lint-imports puts its working directory
first on sys.path). Module names, line numbers and import lines in its report are those of the real files.
Plain `lint-imports` in the repository root fails instead of passing unchecked: the layers contract names
`megatron_rl.kernels`, which it cannot find.
"""
from __future__ import annotations

import ast
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_rl"


def package_dir_mapping(setup_py: str = os.path.join(REPO, "setup.py")) -> dict[str, str]:
    """setup.py's `package_dir` literal: {"megatron_rl.kernels": "kernels", ...}."""
    with open(setup_py, encoding="utf-8") as f:
        tree = ast.parse(f.read(), setup_py)
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_dir":
            return ast.literal_eval(node.value)
    return {}


def build_view(root: str) -> str:
    """The installed layout of the package under `root`, as symlinks into the repository; returns `root`."""
    view = os.path.join(root, PACKAGE)
    os.mkdir(view)
    source = os.path.join(REPO, PACKAGE)
    for entry in os.listdir(source):
        os.symlink(os.path.join(source, entry), os.path.join(view, entry))
    for name, folder in package_dir_mapping().items():
        parent, _, child = name.rpartition(".")
        if parent != PACKAGE or not child.isidentifier():
            raise SystemExit(f"setup.py package_dir maps {name!r}: only direct subpackages of {PACKAGE} are supported")
        link = os.path.join(view, child)
        if os.path.lexists(link):
            raise SystemExit(f"setup.py maps {name} to {folder}/, but {PACKAGE}/{child} exists as well")
        os.symlink(os.path.join(REPO, folder), link)
    os.symlink(os.path.join(REPO, ".importlinter"), os.path.join(root, ".importlinter"))
    return root


def _absolute_paths(args: list[str]) -> list[str]:
    """lint-imports' arguments with its paths (config files, --config, --cache-dir) made absolute: it runs
    in the view, not in the caller's directory."""
    out, value_of = [], None
    for arg in args:
        if value_of is not None:  # the value of the option before
            arg, value_of = (arg if value_of == "--contract" else os.path.abspath(arg)), None
        elif arg in ("--config", "--cache-dir", "--contract"):
            value_of = arg
        elif arg.startswith(("--config=", "--cache-dir=")):
            option, _, value = arg.partition("=")
            arg = f"{option}={os.path.abspath(value)}"
        elif not arg.startswith("-"):
            arg = os.path.abspath(arg)  # a config file
        out.append(arg)
    if not any(a == "--no-cache" or a.startswith("--cache-dir") for a in out):
        out.append("--no-cache")  # the view's paths change every run: a cache there would never hit
    return out


def main(argv: list[str]) -> int:
    from importlinter.cli import lint_imports_command

    args = _absolute_paths(argv)
    caller_cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="megatron_rl-lint-") as root:
        os.chdir(build_view(root))
        try:
            return lint_imports_command.main(args=args, prog_name="lint-imports")
        finally:
            os.chdir(caller_cwd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
