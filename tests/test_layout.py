"""The layering contract checks every layer by the names the code uses, and the source tree imports without
an install: scripts/lint_imports.py (lint-imports over the installed layout) passes on the tree and names an
upward import into megatron_rl.kernels or megatron_rl.checkpoints_tools; megatron_rl/__init__.py maps
exactly those two names to the top-level folders; docs/layout.md lists every import inside a function that
crosses a layer; the launchers refuse, in one line, an interpreter that cannot run the package."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = ["scripts/lint_imports.py"]
# rich wraps the report at the terminal's width: one import per line, so that it can be matched
LINT_ENV = dict(os.environ, COLUMNS="240", NO_COLOR="1")


def _copy_tree(dest):
    """What the lint and the imports read: the package, the two mapped folders, setup.py and the contracts."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("megatron_rl", "kernels", "checkpoints_tools"):
        shutil.copytree(os.path.join(REPO, folder), os.path.join(dest, folder), ignore=ignore)
    os.mkdir(os.path.join(dest, "scripts"))
    for name in ("setup.py", ".importlinter", "scripts/lint_imports.py"):
        shutil.copy(os.path.join(REPO, name), os.path.join(dest, name))
    return dest


def _lint(cwd):
    return subprocess.run([sys.executable, *LINT], cwd=cwd, env=LINT_ENV, capture_output=True, text=True,
                          timeout=120)


def test_the_layers_hold_on_the_tree():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    # the two mapped subpackages are in the graph under their import names
    assert "Analyzed" in result.stdout


def test_an_upward_import_into_kernels_or_checkpoints_tools_is_named(tmp_path):
    tree = _copy_tree(str(tmp_path / "tree"))
    for path in ("kernels/logprob.py", "checkpoints_tools/convert.py"):
        with open(os.path.join(tree, path), "a", encoding="utf-8") as f:
            f.write("\nimport megatron_rl.cli  # deliberately upward\n")
    result = _lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "megatron_rl.kernels is not allowed to import megatron_rl.cli" in result.stdout
    assert "megatron_rl.kernels.logprob -> megatron_rl.cli" in result.stdout
    assert "megatron_rl.checkpoints_tools is not allowed to import megatron_rl.cli" in result.stdout
    assert "megatron_rl.checkpoints_tools.convert -> megatron_rl.cli" in result.stdout


def test_plain_lint_imports_cannot_pass_unchecked():
    """Run directly, lint-imports cannot see the mapped subpackages: it stops on the missing layer."""
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(lint_imports):
        pytest.skip("lint-imports is not installed next to this interpreter")
    result = subprocess.run([lint_imports, "--no-cache"], cwd=REPO, env=LINT_ENV, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "megatron_rl.checkpoints_tools" in result.stdout + result.stderr


def _package_dir():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lint_imports", os.path.join(REPO, "scripts", "lint_imports.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.package_dir_mapping(os.path.join(REPO, "setup.py"))


def test_setup_py_installs_what_the_source_tree_maps():
    import megatron_rl

    assert _package_dir() == {f"megatron_rl.{name}": name for name in megatron_rl.SOURCE_TREE_SUBPACKAGES}


def test_the_source_tree_imports_both_subpackages_without_an_install(tmp_path):
    """-S: no site-packages, so neither the editable install nor any dependency; the repository root is the
    working directory. Only the two mapped names resolve, to the folders beside the package."""
    code = ("import importlib.util, megatron_rl.kernels as k, megatron_rl.checkpoints_tools as c; "
            "print(k.__file__); print(c.__file__); "
            "print([n for n in ('megatron_rl.tests', 'megatron_rl.scripts', 'megatron_rl.examples', 'megatron_rl.docs') "
            "if importlib.util.find_spec(n) is not None])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [os.path.join(REPO, "kernels", "__init__.py"),
                                          os.path.join(REPO, "checkpoints_tools", "__init__.py"), "[]"]
    # a copy of the tree imports its own folders, even where an editable install maps the names elsewhere
    tree = _copy_tree(str(tmp_path / "tree"))
    result = subprocess.run([sys.executable, "-c", "import megatron_rl.kernels as k; print(k.__file__)"],
                            cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == os.path.join(tree, "kernels", "__init__.py")


# --- docs/layout.md: every import inside a function that crosses a layer ------------------------------

def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron_rl" and len(parts) > 1 else None


def _imports_inside_functions():
    """(file as docs/layout.md names it, imported module, reason given) for each import inside a
    function of another layer's module or of a third-party package; and every file with an import of the
    package or a third-party one inside a function (its own layer's included)."""
    found, anywhere = [], set()
    for top in ("megatron_rl", "kernels", "checkpoints_tools"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)
                shown = rel if top != "megatron_rl" else os.path.relpath(path, os.path.join(REPO, top))
                own_layer = top if top != "megatron_rl" else shown.split(os.sep)[0].removesuffix(".py")
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                lines = source.splitlines()
                if not any(line[:1].isspace() and line.lstrip().startswith(("import ", "from ")) for line in lines):
                    continue  # no indented import: nothing inside a function (skips parsing most files)
                for function in ast.walk(ast.parse(source, path)):
                    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    explained = set()  # what this function imports with a reason given: its later imports
                    for node in sorted((n for n in ast.walk(function) if isinstance(n, (ast.Import, ast.ImportFrom))),
                                       key=lambda n: n.lineno):
                        if isinstance(node, ast.Import):
                            modules = [alias.name for alias in node.names]
                        elif isinstance(node, ast.ImportFrom) and node.level == 0:
                            modules = [node.module]
                        else:
                            continue
                        for module in modules:
                            layer = _layer(module)
                            top_name = module.split(".")[0]
                            if layer is None and (top_name in sys.stdlib_module_names or top_name == "megatron_rl"):
                                continue
                            anywhere.add(shown)
                            if layer is not None and layer == own_layer:
                                continue
                            line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                            key = layer or top_name  # of the same layer or package need not repeat it
                            if "#" in line or above.startswith("#"):
                                explained.add(key)
                            found.append((shown, module, key in explained))
    return found, anywhere


def test_docs_list_every_import_inside_a_function_across_layers():
    with open(os.path.join(REPO, "docs", "layout.md"), encoding="utf-8") as f:
        docs = f.read()
    section = docs[docs.index("## Imports inside functions"):]
    section = section[:section.index("\n## ", 1)]
    found, anywhere = _imports_inside_functions()
    assert found  # the scan sees the known ones (Triton, SGLang, ...)
    unlisted = sorted({f"{path} ({module})" for path, module, _ in found if f"`{path}`" not in section})
    assert not unlisted, f"imports inside functions missing from docs/layout.md: {unlisted}"
    no_reason = sorted({f"{path} ({module})" for path, module, reason in found if not reason})
    assert not no_reason, f"imports inside functions without their reason on the line: {no_reason}"
    # and its list names no file that no longer imports inside a function (the registries' paragraph
    # after it names files that import by string)
    for token in section[section.index("\n- "):section.index("Registries")].split("`"):
        if token.endswith(".py") and "/" in token:
            assert token in anywhere, f"docs/layout.md lists {token}, which imports nothing inside a function"


# --- the launchers: never a silent fallback to an interpreter without the package ----------------------

def _python_wrapper(tmp_path, name, site_packages=None):
    """An interpreter as a user may have one: this python without site-packages (-S: no dependencies, no
    install), or with the dependencies' folder on PYTHONPATH but not the editable install's .pth."""
    script = tmp_path / name
    pythonpath = f'PYTHONPATH="{site_packages}" ' if site_packages else ""
    script.write_text(f'#!/bin/sh\n{pythonpath}exec "{sys.executable}" -S "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("launcher", ["examples/run_8b.sh", "scripts/gpu_check.sh"])
def test_a_launcher_refuses_an_interpreter_without_the_dependencies_in_one_line(tmp_path, launcher):
    env = dict(os.environ, PYTHON=_python_wrapper(tmp_path, "bare-python"), OUT=str(tmp_path / "out"))
    args = ["--dry-run"] if launcher.startswith("examples") else ["--smoke"]
    result = subprocess.run(["bash", launcher, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "scripts/setup_cpu.sh" in lines[0] and "pip install -e ." in lines[0], lines
    assert "no module torch" in lines[0]


def test_a_launcher_runs_from_the_source_tree_with_the_dependencies_but_no_install(tmp_path):
    import torch

    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    env = dict(os.environ, PYTHON=_python_wrapper(tmp_path, "deps-python", site_packages))
    result = subprocess.run(["bash", "examples/run_8b.sh", "--resume", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "predicted step" in result.stdout
