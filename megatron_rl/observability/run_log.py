"""The run directory's records, written by the driver: config.json, metrics.jsonl (and W&B), the prompt
ledger prompts.jsonl, and the episode records of multi-agent runs.

A resumed run continues them from its checkpoint's step: every JSONL is first cut back to that step
(the interrupted run may have written further steps before it died), so after any number of crashes
and resumes the ledger lists every consumed prompt exactly once and the metrics have one line a step.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from typing import Any

from megatron_rl.config import ConfigError, path_kind, to_dict
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
        check_run_dir_path(run_dir)
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


def check_run_dir_path(run_dir: str) -> None:
    """Refuse a run_dir that is there but is not a directory, saying what it is."""
    kind = path_kind(run_dir)
    if kind == "a regular file":
        raise ConfigError(f"run_dir {run_dir} is a file, not a directory")
    if kind not in ("missing", "a directory"):
        raise ConfigError(f"run_dir {run_dir} is {kind}, not a directory")


def run_dir_entries(run_dir: str) -> set[str] | None:
    """The names in the run directory before a run starts (None: there is no directory yet)."""
    return set(os.listdir(run_dir)) if os.path.isdir(run_dir) else None


def undo_refused_start(run_dir: str, found: set[str] | None) -> None:
    """After a run refused before it wrote any record (a bad model config, a bad data file): remove the lock,
    config.json and manifest it added, and the directory if it made it, so the refusal leaves nothing behind.
    Files that were there before, and any run that got as far as writing more, are left as they are."""
    if not os.path.isdir(run_dir):
        return
    added = set(os.listdir(run_dir)) - (found or set())
    if not added <= {LOCK_FILE, "config.json", RUN_MANIFEST}:
        return
    for name in added:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(run_dir, name))
    if found is None:
        with contextlib.suppress(OSError):
            os.rmdir(run_dir)


# The run directory's record of what was in it before its first run started: the user's files, which no
# run overwrites, moves or prunes (everything else in the directory is the run's own).
RUN_MANIFEST = ".megatron-rl-run.json"
# Fields a run may change and still continue its checkpoints: how long it runs, where it logs, how often it
# checkpoints, and where and how it is laid out (checkpoints reshard on load). Any other difference is
# another experiment.
RESUMABLE_CHANGES = ("steps", "run_dir", "recipe", "logging", "checkpoint.every_steps", "checkpoint.keep_last",
                     "checkpoint.save_at_end", "cluster", "trainer.parallel")


def users_entries(run_dir: str) -> set[str]:
    """The entries of `run_dir` that are not the run's: those its manifest lists as there before the first
    run. Without a manifest (no run yet, or one of an earlier version): none if its config.json is a run's,
    else every entry but a run's records (which are refused as a previous run's)."""
    try:
        with open(os.path.join(run_dir, RUN_MANIFEST), encoding="utf-8") as f:
            found = json.load(f).get("found_before_first_run", [])
        return {str(name) for name in found}
    except FileNotFoundError:
        if _is_run_config(_read_json(os.path.join(run_dir, "config.json"))):
            return set()
        return _entries(run_dir) - {*RESULTS, "config.json", PREVIOUS_RUNS}
    except (OSError, ValueError, AttributeError):
        raise ConfigError(f"{os.path.join(run_dir, RUN_MANIFEST)}: unreadable; it lists the files of {run_dir} "
                          "that are not the run's (restore it, or choose another run_dir)") from None


def config_difference(previous: dict[str, Any], config: dict[str, Any], prefix: str = "") -> str | None:
    """The first field (dotted, with both values) where two run configs differ, leaving out the fields a
    resumed run may change (RESUMABLE_CHANGES); None when they are the same experiment."""
    for key in sorted(set(previous) | set(config)):
        name = f"{prefix}{key}"
        if name in RESUMABLE_CHANGES:
            continue
        old, new = previous.get(key, "<absent>"), config.get(key, "<absent>")
        if isinstance(old, dict) and isinstance(new, dict):
            found = config_difference(old, new, name + ".")
            if found:
                return found
        elif old != new:
            return f"{name} ({json.dumps(old)} there, {json.dumps(new)} now)"
    return None


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
                    config: dict[str, Any] | None = None, move: bool = True, requested: bool | None = None,
                    keep: tuple[str, ...] = ()) -> None:
    """Decide from what is on disk whether this run may start in `run_dir`; refuse (one line, nothing
    changed) what would lose or take over another run's files, or the user's. `resume`: the run will
    continue `checkpoint` (if any); `requested`: the user asked for that (--resume; default: `resume`).

    - The run owns only what it wrote: entries there before its first run (RUN_MANIFEST) are never
      overwritten or moved, and a config.json no run wrote is refused.
    - Another experiment (its config.json differs beyond RESUMABLE_CHANGES) is refused naming the first
      differing field, unless --resume (continue its checkpoints under this config) or --fresh.
    - The same experiment without a checkpoint (an attempt that died before its first one): its records
      are moved aside and the run starts over, with or without --resume.
    - `resume` without a checkpoint where the step records have steps to cut: refused.
    - `fresh`: the run's own entries go to RUN_DIR/previous_runs/<UTC time>/; the user's, and the data
      files `keep` names (paths), stay.
    `move=False` (train --check) decides without changing anything."""
    requested = resume if requested is None else requested
    check_run_dir_path(run_dir)
    if resume and fresh:
        raise ConfigError("--resume and --fresh exclude each other: continue the run in run_dir, or move it "
                          "aside and start over")
    users = users_entries(run_dir) if os.path.isdir(run_dir) else set()
    previous = _read_json(os.path.join(run_dir, "config.json"))
    has_manifest = os.path.isfile(os.path.join(run_dir, RUN_MANIFEST))
    if os.path.lexists(os.path.join(run_dir, "config.json")) and (
            "config.json" in users or not (has_manifest or _is_run_config(previous))):
        raise ConfigError(f"run_dir {run_dir} holds a config.json that no run wrote (e.g. a model directory); "
                          "a run would overwrite it: choose another run_dir")
    if fresh:
        if move:
            _move_aside(run_dir, users, keep)
            _write_manifest(run_dir, users)
        return
    changed = config_difference(previous, json.loads(json.dumps(config))) if previous and config else None
    if changed and not requested:
        raise ConfigError(f"run_dir {run_dir} holds another run: its config differs at {changed}; add --resume "
                          f"to continue its checkpoints under this config, or --fresh to move it into "
                          f"{os.path.join(run_dir, PREVIOUS_RUNS)}/ and start over")
    found = [name for name in previous_results(run_dir) if name not in users]
    if found and checkpoint is None and previous and not changed:
        if move:
            log.warning("%s: an earlier attempt of this run stopped before its first checkpoint; starting over",
                        run_dir)
            _move_aside(run_dir, users, keep)
            _write_manifest(run_dir, users)
        return
    if resume:
        cut = [name for name in steps_after(run_dir, 0) if name not in users] if checkpoint is None else []
        if cut:
            raise ConfigError(f"--resume: no checkpoint in {os.path.join(run_dir, 'checkpoints')}, and resuming "
                              f"from step 0 would cut the history of {', '.join(cut)} in {run_dir}; add --fresh "
                              "instead to move that run aside and start over")
    elif found:
        raise ConfigError(f"run_dir {run_dir} holds a previous run ({', '.join(found)}); add --resume to continue "
                          f"it, or --fresh to move it into {os.path.join(run_dir, PREVIOUS_RUNS)}/ and start over")
    if changed:
        log.warning("%s: --resume continues this run's checkpoints under a changed config: %s", run_dir, changed)
    if move:
        _write_manifest(run_dir, users)


def _is_run_config(value: Any) -> bool:
    return isinstance(value, dict) and {"run_dir", "steps", "model"} <= set(value)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _entries(run_dir: str) -> set[str]:
    return set(os.listdir(run_dir)) - {LOCK_FILE, RUN_MANIFEST} if os.path.isdir(run_dir) else set()


def _write_manifest(run_dir: str, users: set[str]) -> None:
    """Record the user's entries once, at the first run in the directory."""
    path = os.path.join(run_dir, RUN_MANIFEST)
    if os.path.exists(path):
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"found_before_first_run": sorted(users)}, f, indent=1)


def _move_aside(run_dir: str, users: set[str], keep: tuple[str, ...]) -> None:
    root = os.path.realpath(run_dir)
    kept = {os.path.relpath(os.path.realpath(p), root).split(os.sep)[0] for p in keep
            if os.path.realpath(p).startswith(root + os.sep)}
    entries = sorted(_entries(run_dir) - {PREVIOUS_RUNS} - users - kept)
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
    log.warning("moved the previous run's %d entries of %s to %s", len(entries), run_dir, target)


def write_config(config) -> None:
    """config.json, replaced whole (a kill mid-write leaves the previous one or none, never half of one)."""
    path = os.path.join(config.run_dir, "config.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(to_dict(config), f, indent=2)
    os.replace(path + ".tmp", path)


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
