"""The run directory's records, written by the driver: config.json, metrics.jsonl (and W&B), the prompt
ledger prompts.jsonl, and the episode records of multi-agent runs.

A resumed run continues them from its checkpoint's step: every JSONL is first cut back to that step
(the interrupted run may have written further steps before it died), so after any number of crashes
and resumes the ledger lists every consumed prompt exactly once and the metrics have one line a step.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megatron_rl.config import to_dict
from megatron_rl.observability.metrics import MetricsLogger, truncate_jsonl

# Records cut back to the resumed step: the ledger, the metrics, and the episode records of
# multi-agent runs (training and evaluation).
STEP_RECORDS = ("prompts.jsonl", "metrics.jsonl", "episodes.jsonl", "eval_episodes.jsonl")


def write_config(config) -> None:
    with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_dict(config), f, indent=2)


class RunLog:
    """The driver's metrics and prompt ledger, from `start_step` on."""

    def __init__(self, config, start_step: int, *, resume: bool, step_metrics: dict[str, float] | None = None):
        for name in STEP_RECORDS:
            truncate_jsonl(os.path.join(config.run_dir, name), start_step)
        self.metrics = MetricsLogger(config.run_dir, config.logging, to_dict(config), resume=resume and start_step > 0)
        if step_metrics and not _has_step(self.metrics.path, start_step):
            self.metrics.log(start_step, step_metrics)  # killed after the checkpoint, before its metrics line
        self._ledger = open(os.path.join(config.run_dir, "prompts.jsonl"), "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.log(step, metrics)

    def ledger(self, step: int, prompts: list[str], skipped: list[str]) -> None:
        """Which prompts step `step` trained on, and which overlong ones it skipped."""
        self._ledger.write(json.dumps({"step": step, "prompts": prompts, "skipped": skipped}) + "\n")
        self._ledger.flush()

    def close(self) -> None:
        self._ledger.close()
        self.metrics.close()


def _has_step(path: str, step: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return any(json.loads(line).get("step") == step for line in f if line.strip())
