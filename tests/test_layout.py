"""The layering contract names an upward import anywhere in the package, kernels and conversion tools
included; anything run from the repository root imports transformers (no folder of ours shadows one of its
dependencies); docs/layout.md lists every import inside a function that crosses a layer; the launchers refuse,
in one line, an interpreter that cannot run the package."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# rich wraps the report at the terminal's width: one import per line, so that it can be matched
LINT_ENV = dict(os.environ, COLUMNS="240", NO_COLOR="1")


def _lint(cwd):
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return subprocess.run([lint_imports, "--no-cache"], cwd=cwd, env=LINT_ENV, capture_output=True, text=True,
                          timeout=120)


def test_the_layers_hold_on_the_tree():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "Contracts: 3 kept, 0 broken." in result.stdout


def test_an_upward_import_into_kernels_or_checkpoints_tools_is_named(tmp_path):
    tree = str(tmp_path / "tree")
    shutil.copytree(os.path.join(REPO, "megatron_rl"), os.path.join(tree, "megatron_rl"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO, ".importlinter"), tree)
    for path in ("megatron_rl/kernels/logprob.py", "megatron_rl/checkpoints_tools/convert.py"):
        with open(os.path.join(tree, path), "a", encoding="utf-8") as f:
            f.write("\nimport megatron_rl.cli  # deliberately upward\n")
    result = _lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "megatron_rl.kernels is not allowed to import megatron_rl.cli" in result.stdout
    assert "megatron_rl.kernels.logprob -> megatron_rl.cli" in result.stdout
    assert "megatron_rl.checkpoints_tools is not allowed to import megatron_rl.cli" in result.stdout
    assert "megatron_rl.checkpoints_tools.convert -> megatron_rl.cli" in result.stdout


def test_nothing_at_the_repository_root_shadows_an_installed_package():
    """The working directory comes first on sys.path for `python -m ...` and pytest: a top-level folder named
    like a dependency (`kernels/` once shadowed Hugging Face's `kernels`, and transformers failed to import)
    breaks every command run from the checkout."""
    import importlib.metadata

    installed = {name.lower().replace("-", "_") for dist in importlib.metadata.distributions()
                 for name in (dist.read_text("top_level.txt") or dist.metadata["Name"] or "").split()}
    ours = {entry for entry in os.listdir(REPO)
            if os.path.isfile(os.path.join(REPO, entry, "__init__.py")) or entry.endswith(".py")}
    # tests/ is the suite's own package (some wheels wrongly install a top-level `tests` too; it is theirs to fix)
    ours = {entry.removesuffix(".py") for entry in ours} - {"setup", "megatron_rl", "tests"}
    assert not ours & installed, f"top-level names of the repository shadow installed packages: {ours & installed}"
    code = "import transformers, megatron_rl.kernels, megatron_rl.checkpoints_tools; transformers.LlamaConfig"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- docs/layout.md: every import inside a function that crosses a layer ------------------------------

def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron_rl" and len(parts) > 1 else None


def _imports_inside_functions():
    """(file as docs/layout.md names it, imported module, reason given) for each import inside a
    function of another layer's module or of a third-party package; and every file with an import of the
    package or a third-party one inside a function (its own layer's included)."""
    found, anywhere = [], set()
    package = os.path.join(REPO, "megatron_rl")
    for root, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            shown = os.path.relpath(path, package)
            own_layer = shown.split(os.sep)[0].removesuffix(".py")
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
