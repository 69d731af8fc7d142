"""CHAMP (Mao et al. 2024, "CHAMP: A Competition-level Dataset for Fine-Grained Analyses of LLMs'
Mathematical Reasoning Capabilities", MIT licence): 270 competition problems with worked step-by-step
solutions and short final answers, shipped in the `champ-dataset` PyPI package
(`pip install --no-deps champ-dataset==1.0.0`; the file is read directly, the package is not imported).

Each problem becomes a `Prompt` whose reference answer is the worked solution (its steps joined by
newlines: the long-form a* of JEPO) and whose metadata holds the short answer:
`{'short_answer': '239', 'verifiable': True, 'category': ..., 'source': file, 'row': identifier}`.
`verifiable` marks short answers a math verifier can check (a number or an arithmetic expression,
no words); the soft-match reward uses them and falls back to a judge for the others.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re

from megatron_rl.data.config import SourceConfig
from megatron_rl.data.prompts import (
    DataError,
    Prompt,
    PromptDataset,
    chat_messages,
    stable_id,
)

_VERIFIABLE = re.compile(r"^[-+*/^().\d\s,%]+$")


def champ_file(path: str | None = None) -> str:
    """The dataset JSON: `path` when given, else the file inside the installed champ-dataset package."""
    if path:
        return path
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the CHAMP data set needs the champ-dataset package: "
                        "pip install --no-deps champ-dataset==1.0.0 (scripts/setup_cpu.sh installs it)")
    return os.path.join(list(spec.submodule_search_locations)[0], "dataset_files", "v0.json")


def is_verifiable(short_answer: str) -> bool:
    return bool(_VERIFIABLE.match(short_answer.strip())) and any(ch.isdigit() for ch in short_answer)


def load_champ(cfg: SourceConfig) -> PromptDataset:
    """All CHAMP problems as prompts (reference = worked solution), in the file's order."""
    path = champ_file(cfg.path)
    if not os.path.isfile(path):
        raise DataError(f"CHAMP data file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            problems = json.load(f)["problems"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a CHAMP data file ({type(exc).__name__}: {exc})") from None
    prompts, bad, first_error = [], 0, None
    for identifier, problem in problems.items():
        where = f"{path}: problem {identifier}"
        try:
            steps = (problem.get("solution") or {}).get("steps") or []
            solution = "\n".join(step["_text"].strip() for step in steps if step.get("_text", "").strip())
            question = problem.get("_text")
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{where}: no problem text ('_text')")
            if not solution:
                raise DataError(f"{where}: no worked solution (solution.steps)")
            messages, question = chat_messages(question, cfg.system_prompt, cfg.prompt_template, where, "_text")
        except DataError as exc:
            if cfg.on_bad_row == "error":
                raise
            bad += 1
            first_error = first_error or exc
            continue
        short = str(problem.get("_answer") or "")
        prompts.append(Prompt(prompt_id=stable_id("champ", question, identifier), messages=messages,
                              question=question, answer=solution,
                              metadata={"source": path, "row": identifier, "short_answer": short or None,
                                        "verifiable": bool(short) and is_verifiable(short),
                                        "category": problem.get("category")}))
    if not prompts:
        raise DataError(f"{path}: no usable CHAMP problems ({bad} bad; first error: {first_error})")
    return PromptDataset(cfg.name, prompts, {"rows_read": len(problems), "bad_rows_skipped": bad})
