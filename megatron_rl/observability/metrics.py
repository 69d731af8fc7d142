"""Metrics out of a run: JSONL in the run directory, W&B (offline automatically without credentials),
a one-line console summary per step, and PNG plots at the end.

Metric names follow the peers' style: `rollout/reward_mean`, `train/pg_loss`, `perf/step_time`,
`eval/accuracy`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import time
from typing import Any, Literal

from megatron_rl.config import require

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go."""

    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    """W&B mode: auto is online with WANDB_API_KEY set (or a netrc login), offline otherwise; the
    WANDB_MODE environment variable overrides it."""
    wandb_project: str = "megatron-rl"
    """W&B project."""
    wandb_run_name: str | None = None
    """W&B run name (default: the run directory's name)."""
    plots: bool = True
    """Write PNG plots (reward/accuracy, step-time breakdown) into the run directory at the end."""
    console_every: int = 1
    """Print a one-line summary every N steps (0: never)."""

    def __post_init__(self) -> None:
        require(self.console_every >= 0, "console_every", "must be >= 0")


def _wandb_mode(requested: str) -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    has_key = bool(os.environ.get("WANDB_API_KEY")) or os.path.isfile(os.path.expanduser("~/.netrc"))
    return "online" if has_key else "offline"


class MetricsLogger:
    def __init__(self, run_dir: str, config: LoggingConfig, run_config: dict[str, Any], *, resume: bool = False):
        self.run_dir = run_dir
        self.config = config
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a" if resume else "w", encoding="utf-8")
        self._wandb = None
        self.progress: Progress | None = None
        mode = _wandb_mode(config.wandb)
        if mode != "disabled":
            try:
                import wandb  # optional: only for runs that log to W&B

                self._wandb = wandb.init(project=config.wandb_project, dir=run_dir, mode=mode,
                                         id=wandb_run_id(run_dir, resume),
                                         name=config.wandb_run_name or os.path.basename(os.path.abspath(run_dir)),
                                         config=run_config, resume="allow",
                                         # "wrap" copies the console into the run's Logs tab without
                                         # redirecting file descriptors the engines' processes share
                                         settings=wandb.Settings(silent=True, console="wrap"))
            except Exception as exc:  # a broken W&B set-up must not stop training; the JSONL has everything
                log.warning("W&B disabled (%s: %s); metrics still go to %s", type(exc).__name__, exc, self.path)

    @property
    def wandb_dir(self) -> str | None:
        return None if self._wandb is None else os.path.dirname(self._wandb.dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self.progress is not None:
            self.progress.update(step)
        every = self.config.console_every
        if every and step % every == 0:
            log.info(console_line(step, metrics, self.progress, stamp=False))

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: str, resume: bool) -> str:
    """The W&B run id of this training run, kept in the run directory so that every resume continues
    the same W&B run (one dashboard line across restarts); a fresh run gets a new id."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resume and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    run_id = secrets.token_hex(6)  # W&B ids: up to 64 characters of [a-z0-9_-]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    os.replace(path + ".tmp", path)
    return run_id


def status(message: str) -> None:
    """A progress line of the run (loading, evaluating, checkpointing, where outputs are); the CLI's
    logging stamps it with the UTC time like the step lines (observability/logs.py)."""
    log.info(message)


class Progress:
    """Steps done out of the run's total and the time left at the pace of this process's steps (the
    steps a resumed run inherited do not count toward the pace)."""

    def __init__(self, total_steps: int, start_step: int):
        self.total = total_steps
        self.start_step = start_step
        self.started = time.monotonic()
        self.done = start_step

    def update(self, step: int) -> None:
        self.done = max(self.done, step)

    def eta_s(self) -> float | None:
        ran = self.done - self.start_step
        if ran <= 0:
            return None
        return (time.monotonic() - self.started) / ran * (self.total - self.done)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def console_line(step: int, m: dict[str, float], progress: Progress | None = None, *, stamp: bool = True) -> str:
    """One step's line: UTC time (unless `stamp=False`, for a logger that stamps it), step N/total, ETA,
    then the headline metrics."""
    head = f"{time.strftime('%H:%M:%S', time.gmtime())} step {step}" if stamp else f"step {step}"
    if progress is None:
        parts = [head]
    else:
        eta = progress.eta_s()
        parts = [f"{head}/{progress.total}" + ("" if eta is None else f" (ETA {_duration(eta)})")]
    for key, label, fmt in [("rollout/reward_mean", "reward", "{:.3f}"), ("rollout/accuracy", "acc", "{:.2f}"),
                            ("eval/accuracy", "eval", "{:.2f}"), ("train/pg_loss", "pg", "{:+.4f}"),
                            ("train/logprob_mismatch", "mismatch", "{:.1e}"), ("rollout/staleness_mean", "stale", "{:.1f}"),
                            ("rollout/response_length_mean", "len", "{:.0f}"), ("perf/step_time", "time", "{:.1f}s"),
                            ("reward_model/loss", "rm loss", "{:.4f}"), ("reward_model/accuracy", "pairs right", "{:.2f}"),
                            ("reward_model/step_time", "time", "{:.1f}s")]:
        if key in m and m[key] is not None:
            parts.append(f"{label} " + fmt.format(m[key]))
    return " | ".join(parts)


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_plots(run_dir: str) -> list[str]:
    """reward_accuracy.png and step_time.png from metrics.jsonl."""
    import matplotlib  # heavy, and only for the plots at the end of a run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend (no display)

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in records if "rollout/reward_mean" in r]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    written = []
    if train:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in train], [r["rollout/reward_mean"] for r in train], label="train reward")
        ax.plot([r["step"] for r in train], [r.get("rollout/accuracy", 0) for r in train], label="train accuracy", alpha=0.6)
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)")
        ax.set_ylim(-0.02, 1.02)
        written.append(_save(fig, ax, "reward and accuracy", os.path.join(run_dir, "reward_accuracy.png")))
        phases = [k for k in ("perf/generate_time", "perf/reward_time", "perf/train_time", "perf/weight_sync_time",
                              "perf/checkpoint_time") if any(k in r for r in train)]
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(train)
        for key in phases:
            values = [r.get(key) or 0.0 for r in train]
            ax.bar([r["step"] for r in train], values, bottom=bottom, label=key.split("/")[1])
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("seconds")
        written.append(_save(fig, ax, "step time breakdown", os.path.join(run_dir, "step_time.png")))
    return written


def _save(fig, ax, title: str, path: str) -> str:
    import matplotlib.pyplot as plt  # after write_plots chose the Agg backend

    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def truncate_jsonl(path: str, last_step: int) -> None:
    """Keep only the records of steps <= `last_step` (a resumed run rewrites the steps after its
    checkpoint); a torn last line from a killed process is dropped too. Atomic: temp file + rename."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= last_step:
                kept.append(json.dumps(record) + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
