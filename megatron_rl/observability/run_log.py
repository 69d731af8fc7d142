"""The run directory's records, written by the driver: config.json, metrics.jsonl (and W&B), the prompt
ledger prompts.jsonl, and the episode records of multi-agent runs.

A resumed run continues them from its checkpoint's step: every JSONL is first cut back to that step
(the interrupted run may have written further steps before it died), so after any number of crashes
and resumes the ledger lists every consumed prompt exactly once and the metrics have one line a step.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from typing import Any

from megatron_rl.config import ConfigError, to_dict
from megatron_rl.observability.metrics import MetricsLogger, truncate_jsonl

log = logging.getLogger(__name__)

# Records cut back to the resumed step: the ledger, the metrics, and the episode records of
# multi-agent runs (training and evaluation).
STEP_RECORDS = ("prompts.jsonl", "metrics.jsonl", "episodes.jsonl", "eval_episodes.jsonl")


# Held (fcntl) by the driver for the whole run: a second run in the same directory would interleave
# its ledger and metrics with this one's and prune its checkpoints.
LOCK_FILE = ".lock"
# `--fresh` moves a previous run's files here (RUN_DIR/previous_runs/<UTC time>/) instead of deleting them.
PREVIOUS_RUNS = "previous_runs"
# What a finished or interrupted run leaves that a fresh start would overwrite or prune.
RESULTS = ("checkpoints", "summary.json", *STEP_RECORDS)


class RunDirLock:
    """An exclusive lock on a run directory for this process's run (released on close or process exit,
    SIGKILL included: the kernel drops fcntl locks with the process)."""

    def __init__(self, run_dir: str):
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise ConfigError(f"run_dir {run_dir} is a file, not a directory")
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise ConfigError(f"run_dir {run_dir} is in use by another run (pid {holder}, lock {self.path}); "
                              "wait for it to finish or choose another run_dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def previous_results(run_dir: str) -> list[str]:
    """The records of an earlier run in `run_dir` that a fresh start would overwrite or prune."""
    found = []
    for name in RESULTS:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path) and os.path.getsize(path) > 0:
            found.append(name)
    return found


def steps_after(run_dir: str, step: int) -> list[str]:
    """The step records (metrics, ledger, episodes) holding lines of steps after `step`: what resuming
    at `step` would cut."""
    found = []
    for name in STEP_RECORDS:
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
                    found.append(name)
                    break
    return found


def prepare_run_dir(run_dir: str, *, resume: bool, fresh: bool, checkpoint: str | None,
                    config: dict[str, Any] | None = None, move: bool = True) -> None:
    """Refuse what would lose a previous run's files; `fresh` moves them aside first.

    - a fresh start (neither flag) in a directory holding a previous run's results: refused, unless they
      are this very run's (its config.json equals `config`) from an attempt that died before its first
      checkpoint: a relaunch (a requeued job) then moves them aside and starts over;
    - `resume` without a checkpoint while the step records have steps to cut: refused;
    - `fresh`: everything but the lock and earlier moved runs goes to RUN_DIR/previous_runs/<UTC time>/."""
    if resume and fresh:
        raise ConfigError("--resume and --fresh exclude each other: continue the run in run_dir, or move it "
                          "aside and start over")
    if fresh:
        _move_aside(run_dir)
        return
    if resume:
        cut = steps_after(run_dir, 0) if checkpoint is None else []
        if cut:
            raise ConfigError(f"--resume: no checkpoint in {os.path.join(run_dir, 'checkpoints')}, and resuming "
                              f"from step 0 would cut the history of {', '.join(cut)} in {run_dir}; add --fresh "
                              "instead to move that run aside and start over")
        return
    found = previous_results(run_dir)
    if found and checkpoint is None and config is not None and _same_config(run_dir, config):
        if move:
            log.warning("%s: an earlier attempt of this run stopped before its first checkpoint; starting over",
                        run_dir)
            _move_aside(run_dir)
        return
    if found:
        raise ConfigError(f"run_dir {run_dir} holds a previous run ({', '.join(found)}); add --resume to continue "
                          f"it, or --fresh to move it into {os.path.join(run_dir, PREVIOUS_RUNS)}/ and start over")


def _same_config(run_dir: str, config: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f) == json.loads(json.dumps(config))
    except (OSError, ValueError):
        return False


def _move_aside(run_dir: str) -> None:
    entries = [n for n in os.listdir(run_dir) if n not in (LOCK_FILE, PREVIOUS_RUNS)]
    if not entries:
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(run_dir, PREVIOUS_RUNS, stamp)
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = os.path.join(run_dir, PREVIOUS_RUNS, f"{stamp}-{suffix}")
    os.makedirs(target)
    for name in entries:
        os.rename(os.path.join(run_dir, name), os.path.join(target, name))
    log.warning("--fresh: moved the previous run's %d entries of %s to %s", len(entries), run_dir, target)


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
