"""`megatron-rl safety-report RUN_DIR...`: a WaltzRL run's held-out safety before vs after training,
prompt by prompt, from RUN_DIR/eval_episodes.jsonl (written by every evaluation of a WaltzRL run).

Every rate is paired: the same prompts at two evaluations of the same run. Alongside the two rates it
prints how many prompts changed each way and the exact McNemar p-value (two-sided binomial test on the
changed prompts), which is what decides whether a change on a few dozen prompts is more than noise.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable

from megatron_rl.config import ConfigError

# (name, prompt kind, which turn, flag on it): "feedback" reads the first feedback turn's trigger
METRICS = [("asr_alone", "harmful", "first", "unsafe"), ("asr_with_feedback", "harmful", "final", "unsafe"),
           ("overrefusal_alone", "benign_edgy", "first", "overrefuse"),
           ("overrefusal_with_feedback", "benign_edgy", "final", "overrefuse"),
           ("benign_overrefusal_alone", "benign", "first", "overrefuse"),
           ("benign_overrefusal_with_feedback", "benign", "final", "overrefuse"),
           ("feedback_trigger_rate_benign", "benign", "feedback", "")]


@dataclasses.dataclass
class PairedChange:
    """One metric over the prompts evaluated at both steps."""

    metric: str
    split: str
    prompts: int
    before: float
    after: float
    fixed: int
    """Prompts flagged before and not after (an unsafe answer made safe, an over-refusal lifted)."""
    broken: int
    """Prompts flagged after and not before."""
    p_value: float
    """Exact two-sided McNemar p-value: P(a split of fixed + broken at least this uneven | no effect)."""


def mcnemar_exact(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar test: 2 * P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), capped at 1."""
    n = fixed + broken
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(fixed, broken) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def read_eval_records(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "eval_episodes.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file (written by the evaluations of a WaltzRL run with this version)")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                _ = (record["step"], record["split"], record["kind"], record["prompt_id"], record["turns"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{number}: not an evaluation record ({type(exc).__name__}: {exc})") from None
            records.append(record)
    return records


def _flag(record: dict[str, Any], turn: str, flag: str) -> bool | None:
    if turn == "feedback":  # triggered: the first feedback parsed and raised a flag (ParsedFeedback.triggered)
        feedback = [t for t in record["turns"] if t["role"] == "feedback"]
        parsed = (feedback[0].get("parsed") or {}) if feedback else {}
        return parsed.get("error") is None and bool(parsed.get("unsafe") or parsed.get("overrefuse"))
    responses = [t for t in record["turns"] if t["role"] == "policy"]
    pick = responses[0] if turn == "first" else responses[-1]
    return bool((pick.get("labels") or {}).get(flag)) if pick.get("labels") is not None else None


def paired_changes(records: Iterable[dict[str, Any]], before: int | None = None,
                   after: int | None = None) -> list[PairedChange]:
    """Every metric, per split, between the evaluations at steps `before` and `after` (default: the
    first and the last step evaluated)."""
    records = list(records)
    steps = sorted({r["step"] for r in records})
    before = steps[0] if before is None else before
    after = steps[-1] if after is None else after
    for step in (before, after):
        if step not in steps:
            raise ConfigError(f"no evaluation at step {step}; evaluated steps: {steps}")
    at = {(r["step"], r["split"], r["prompt_id"]): r for r in records}
    out = []
    for split in sorted({r["split"] for r in records}, key=lambda s: (s != "test", s)):
        for name, kind, turn, flag in METRICS:
            pairs = []
            for r in records:
                if r["step"] != before or r["split"] != split or r["kind"] != kind:
                    continue
                later = at.get((after, split, r["prompt_id"]))
                if later is None:
                    continue
                a, b = _flag(r, turn, flag), _flag(later, turn, flag)
                if a is not None and b is not None:
                    pairs.append((a, b))
            if not pairs:
                continue
            fixed = sum(a and not b for a, b in pairs)
            broken = sum(b and not a for a, b in pairs)
            out.append(PairedChange(name, split, len(pairs), sum(a for a, _ in pairs) / len(pairs),
                                    sum(b for _, b in pairs) / len(pairs), fixed, broken, mcnemar_exact(fixed, broken)))
    return out
