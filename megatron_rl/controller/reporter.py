"""What a run reports besides training: progress lines, the metrics and prompt ledger, plots, summary.json.

The driver (rank 0) alone writes the run directory's logs and tells the user how the run goes; every
other trainer rank gets a reporter that does nothing, so the loop (controller/loop.py) calls the same
methods on every rank and reads like the algorithm.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Iterable

from tqdm import tqdm

from megatron_rl import ranks
from megatron_rl.observability.metrics import Progress, status, write_plots
from megatron_rl.observability.run_log import RunLog, write_config

if TYPE_CHECKING:
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.controller.run_state import RunSummary
    from megatron_rl.controller.stop import StopRequest
    from megatron_rl.run_config import RunConfig


class RunReporter:
    """The reporter of a rank that is not the driver: every method does nothing."""

    def __init__(self, config: RunConfig, checkpoints: CheckpointManager):
        self.config = config
        self.checkpoints = checkpoints

    @staticmethod
    def of_this_rank(config: RunConfig, checkpoints: CheckpointManager) -> "RunReporter":
        return (DriverReporter if ranks.is_driver() else RunReporter)(config, checkpoints)

    def say(self, message: str) -> None:
        """A progress line of the run (loading, resuming, evaluating, ...)."""

    def write_config(self) -> None:
        pass

    def open(self, start_step: int, *, resume: bool, step_metrics: dict[str, float] | None) -> None:
        """Start the metrics and the prompt ledger at `start_step` (cut back to it on resume)."""

    def steps(self, start_step: int) -> Iterable[int]:
        """The training steps still to run, `start_step` to config.steps."""
        return range(start_step, self.config.steps)

    def evaluating(self, prompts: int) -> None:
        pass

    def evaluated_before(self, before: dict[str, float], prompts: int) -> None:
        pass

    def trained(self, step: int, prompt_ids: list[str], producer) -> None:
        """Step `step` trained on `prompt_ids`; `producer` (the driver's rollouts) knows what it skipped."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def checkpoint_written(self, step: int, seconds: float) -> None:
        pass

    def stopped(self, step: int, stop: StopRequest) -> None:
        """The run stops early at `step` on a stop request, its checkpoint written."""

    def evaluated_after(self, after: dict[str, float], accuracy_before: float | None) -> None:
        pass

    def close(self) -> None:
        """Close the metrics and the ledger (the run's finally: also after a failed step)."""

    def finish(self, summary: RunSummary) -> None:
        """The run's end: plots, summary.json, and where its outputs are."""


class DriverReporter(RunReporter):
    def __init__(self, config: RunConfig, checkpoints: CheckpointManager):
        super().__init__(config, checkpoints)
        self._log: RunLog | None = None
        self._wandb_dir: str | None = None

    def say(self, message: str) -> None:
        status(message)

    def write_config(self) -> None:
        write_config(self.config)

    def open(self, start_step: int, *, resume: bool, step_metrics: dict[str, float] | None) -> None:
        self._log = RunLog(self.config, start_step, resume=resume, step_metrics=step_metrics)
        self._log.metrics.progress = Progress(self.config.steps, start_step)

    def steps(self, start_step: int) -> Iterable[int]:
        # The step lines already say how far the run is; the bar is for runs that print none.
        return tqdm(range(start_step, self.config.steps), desc="train", initial=start_step,
                    total=self.config.steps, disable=self.config.logging.console_every > 0)

    def evaluating(self, prompts: int) -> None:
        status(f"evaluating on {prompts} held-out prompts")

    def evaluated_before(self, before: dict[str, float], prompts: int) -> None:
        self._log.log(0, before)
        status(f"held-out accuracy before training: {before['eval/accuracy']:.3f} ({prompts} prompts)")

    def trained(self, step: int, prompt_ids: list[str], producer) -> None:
        self._log.ledger(step, prompt_ids, producer.last_skipped)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._log.log(step, metrics)

    def checkpoint_written(self, step: int, seconds: float) -> None:
        status(f"checkpoint of step {step} written to {self.checkpoints.root} in {seconds:.1f}s")

    def stopped(self, step: int, stop: StopRequest) -> None:
        status(f"stopping at step {step} of {self.config.steps} ({stop.reason() or 'another rank was asked'}): "
               f"checkpoint written; launch the same command again to resume")
        with contextlib.suppress(FileNotFoundError):
            os.remove(stop.path)  # the request is served: the relaunch must not stop at once

    def evaluated_after(self, after: dict[str, float], accuracy_before: float | None) -> None:
        self._log.log(self.config.steps, after)
        status(f"held-out accuracy after training: {after['eval/accuracy']:.3f}"
               + (f" (before: {accuracy_before:.3f})" if accuracy_before is not None else ""))

    def close(self) -> None:
        if self._log is not None:
            self._wandb_dir = self._log.metrics.wandb_dir
            self._log.close()

    def finish(self, summary: RunSummary) -> None:
        plots = write_plots(self.config.run_dir) if self.config.logging.plots else []
        with open(os.path.join(self.config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)
        self._say_where_outputs_are(plots)

    def _say_where_outputs_are(self, plots: list[str]) -> None:
        run_dir = self.config.run_dir
        latest = self.checkpoints.complete_checkpoints()
        lines = [f"outputs in {run_dir}:",
                 f"  metrics      {os.path.join(run_dir, 'metrics.jsonl')} (and summary.json, prompts.jsonl)",
                 f"  checkpoints  {self.checkpoints.root}" + (f" (latest: {latest[-1]})" if latest else " (none written)"),
                 f"  timeline     {os.path.join(run_dir, 'timeline_rank0.json')} (ui.perfetto.dev)"]
        if plots:
            lines.append(f"  plots        {', '.join(plots)}")
        if self._wandb_dir:
            lines.append(f"  W&B          {self._wandb_dir}")
        status("\n".join(lines))
