"""The run's counters (`RunState`, saved in every checkpoint and summed over resumed segments) and what
`summary.json` holds at the end (`RunSummary`)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunState:
    """Counters of a run, carried across resumes (a checkpoint's "controller" record)."""

    accuracy_before: float | None = None
    """Held-out greedy accuracy of the starting policy (fraction), once measured."""
    eval_before: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric of the starting policy."""
    reward_errors: int = 0
    """Samples whose reward function failed (skipped, counted)."""
    wall_time_s: float = 0.0
    """Wall time of the segments before this one (this segment's is added when saving)."""
    nonfinite_steps: int = 0
    """Steps skipped because the loss or a gradient was NaN/Inf (weights untouched)."""
    nonfinite_in_a_row: int = 0
    """The current run of such steps (trainer.max_nonfinite_steps_in_a_row stops the run)."""
    skipped_prompts: int = 0
    """Prompts skipped because they did not fit the engine's context (rollout.on_overlong_prompt=skip)."""
    checkpoint_failures: int = 0
    """Checkpoint writes that failed during the run (the previous checkpoint stayed the latest)."""

    @classmethod
    def from_checkpoint(cls, record: dict[str, Any]) -> "RunState":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})

    def record_step(self, metrics: dict[str, float]) -> None:
        """Count a finished step's reward errors, skipped prompts and non-finite update."""
        self.reward_errors += int(metrics.get("rollout/reward_errors", 0))
        self.skipped_prompts += int(metrics.get("rollout/skipped_prompts", 0))
        nonfinite = bool(metrics.get("train/nonfinite", 0.0))  # agreed by every trainer rank
        self.nonfinite_steps += int(nonfinite)
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0


@dataclasses.dataclass
class RunSummary:
    """What `summary.json` holds at the end of a run."""

    accuracy_before: float | None
    """Held-out greedy accuracy of the starting policy (fraction)."""
    accuracy_after: float | None
    """Held-out greedy accuracy after training (fraction)."""
    wall_time_s: float
    """Wall time of the whole run, set-up and evaluations included (summed over resumed segments)."""
    steps: int
    """Optimizer steps completed."""
    heldout_size: int
    """Held-out prompts evaluated."""
    reward_errors: int
    """Samples whose reward function failed (skipped, counted)."""
    nonfinite_steps: int
    """Steps skipped because the loss or a gradient was NaN/Inf (weights untouched)."""
    skipped_prompts: int
    """Prompts skipped because they did not fit the engine's context (rollout.on_overlong_prompt=skip)."""
    checkpoint_failures: int
    """Checkpoint writes that failed during the run (the previous checkpoint stayed the latest)."""
    final_metrics: dict[str, Any]
    """The last step's metrics."""
    eval_before: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric of the starting policy (accuracy, and e.g. the likelihood bound)."""
    eval_after: dict[str, float] = dataclasses.field(default_factory=dict)
    """Every held-out metric after training."""

    @classmethod
    def of_run(cls, state: RunState, *, wall_time_s: float, steps: int, heldout_size: int,
               final_metrics: dict[str, Any], after: dict[str, float | None]) -> "RunSummary":
        return cls(accuracy_before=state.accuracy_before, accuracy_after=after.get("eval/accuracy"),
                   wall_time_s=wall_time_s, steps=steps, heldout_size=heldout_size,
                   reward_errors=state.reward_errors, nonfinite_steps=state.nonfinite_steps,
                   skipped_prompts=state.skipped_prompts, checkpoint_failures=state.checkpoint_failures,
                   final_metrics=final_metrics, eval_before=state.eval_before,
                   eval_after={k: v for k, v in after.items() if v is not None})
