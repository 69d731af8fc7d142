"""WaltzRL rewards as pure functions (Zhang, Wang, Smith et al., 2025, "The Alignment Waltz: Jointly
Training Agents to Collaborate for Safety", arXiv 2510.08240, sec. 3).

One episode: the conversation agent answers prompt p with c_0; the feedback agent reads (p, c_0) and
writes JSON {"reasoning", "unsafe", "overrefuse", "feedback"}; if either flag is true the feedback goes
back to the conversation agent, which writes c_1; and so on until both flags are false, the feedback is
not parseable JSON, or T_max revisions were made. A judge labels every response (unsafe?, overrefusing?).

    R_c(c)      = 1{ not unsafe(c) and not overrefuse(c) }                      conversation reward
    DIR_t       = R_c(c_{t+1}) - R_c(c_t)   (0 when no revision followed)        Dynamic Improvement Reward
    R_label_t   = 1{ feedback flags of f_t == judge labels of c_t }
    R_format_t  = 1{ f_t parses as the JSON schema }
    R_f         = alpha * DIR_t * R_label_t + lambda * R_label_t + gamma * R_format_t

DIR is gated by R_label (the paper's ablation: ungated DIR collapses label accuracy). Training runs in
two stages: stage 1 trains the feedback agent alone (conversation agent frozen) with all three terms;
stage 2 trains both with lambda = 0.

With lambda = 0 a wrong flag costs nothing in stage 2: on a good answer, flagging it (R_label = 0, so
the gated DIR is 0) earns gamma, exactly what the correct "no flag" earns (no revision, DIR = 0). Only
a feedback agent whose stage 1 already taught it its labels keeps them; a weak one that is rewarded for
flagging bad answers (DIR > 0) drifts to flagging everything. `stage2_label_weight` > 0 keeps a label
term in stage 2 (a departure from the paper, off by default).

Departures from the paper, stated: flags must be JSON booleans (the strings "true"/"false" are
malformed), and malformed feedback ends the episode with R_format = R_label = 0, so its R_f is 0.
"""
from __future__ import annotations

import dataclasses
import json

from megatron_rl.algorithms.config import WaltzRewardConfig
from megatron_rl.config import require

FEEDBACK_KEYS = ("reasoning", "unsafe", "overrefuse", "feedback")


@dataclasses.dataclass(frozen=True)
class SafetyLabels:
    """A judge's verdict on one response (or the flags a feedback agent claims for it)."""

    unsafe: bool
    """The response helps with a harmful request."""
    overrefuse: bool
    """The response refuses a request it should have answered."""


@dataclasses.dataclass(frozen=True)
class ParsedFeedback:
    """The feedback agent's JSON, parsed; `error` set (and the other fields empty) when malformed."""

    reasoning: str = ""
    """The agent's reasoning."""
    unsafe: bool = False
    """Flag: the conversation response is unsafe."""
    overrefuse: bool = False
    """Flag: the conversation response over-refuses."""
    feedback: str = ""
    """Advice for the conversation agent's revision."""
    error: str | None = None
    """Why the text is not a valid feedback object (None when it is)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def flags(self) -> SafetyLabels:
        return SafetyLabels(unsafe=self.unsafe, overrefuse=self.overrefuse)

    @property
    def triggered(self) -> bool:
        """Feedback is sent to the conversation agent only when a flag is raised (and it parsed)."""
        return self.ok and (self.unsafe or self.overrefuse)


def parse_feedback(text: str) -> ParsedFeedback:
    """Parse the feedback agent's output: the first JSON object in it (text before it and after its
    closing brace is ignored) must have the four keys, string reasoning/feedback and boolean flags.
    Never raises."""
    start = text.find("{")
    if start < 0 or "}" not in text[start:]:
        return ParsedFeedback(error="no JSON object in the feedback")
    try:
        value, _ = json.JSONDecoder().raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ParsedFeedback(error=f"invalid JSON: {exc.msg if hasattr(exc, 'msg') else exc}")
    if not isinstance(value, dict):
        return ParsedFeedback(error=f"expected a JSON object, got {type(value).__name__}")
    missing = [k for k in FEEDBACK_KEYS if k not in value]
    if missing:
        return ParsedFeedback(error=f"missing key(s) {missing}")
    for key in ("unsafe", "overrefuse"):
        if not isinstance(value[key], bool):
            return ParsedFeedback(error=f"{key!r} must be a JSON boolean, got {value[key]!r}")
    for key in ("reasoning", "feedback"):
        if not isinstance(value[key], str):
            return ParsedFeedback(error=f"{key!r} must be a string, got {type(value[key]).__name__}")
    return ParsedFeedback(reasoning=value["reasoning"], unsafe=value["unsafe"], overrefuse=value["overrefuse"],
                          feedback=value["feedback"])


def conversation_reward(labels: SafetyLabels) -> float:
    """R_c = 1{not unsafe and not overrefuse} (paper eq. 1)."""
    return float(not labels.unsafe and not labels.overrefuse)


def dynamic_improvement_reward(before: SafetyLabels, after: SafetyLabels | None) -> float:
    """DIR_t = R_c(c_{t+1}) - R_c(c_t); 0 when no revision c_{t+1} was written (paper eq. 3)."""
    if after is None:
        return 0.0
    return conversation_reward(after) - conversation_reward(before)


def label_reward(feedback: ParsedFeedback, judged: SafetyLabels) -> float:
    """R_label = 1{the feedback's flags equal the judge's labels of the response}; 0 when malformed."""
    return float(feedback.ok and feedback.flags == judged)


def format_reward(feedback: ParsedFeedback) -> float:
    """R_format = 1{the feedback parses as the JSON schema}."""
    return float(feedback.ok)


def feedback_reward(feedback: ParsedFeedback, judged: SafetyLabels, revised: SafetyLabels | None,
                    config: WaltzRewardConfig, *, stage: int) -> dict[str, float]:
    """R_f and its terms for one feedback turn f_t on response c_t (judged) with revision c_{t+1}.

    Stage 1 uses lambda = config.label_weight; stage 2 lambda = config.stage2_label_weight (0 in the
    paper, sec. 3.3)."""
    require(stage in (1, 2), "stage", f"must be 1 or 2, got {stage}")
    r_label = label_reward(feedback, judged)
    r_format = format_reward(feedback)
    dir_t = dynamic_improvement_reward(judged, revised) if feedback.ok else 0.0
    gate = r_label if config.gate_dir_by_label else 1.0
    lam = config.label_weight if stage == 1 else config.stage2_label_weight
    total = config.alpha * dir_t * gate + lam * r_label + config.format_weight * r_format
    return {"reward": total, "dir": dir_t, "label": r_label, "format": r_format}


def training_stage(step: int, stage1_steps: int) -> int:
    """1 for the first `stage1_steps` optimizer steps (feedback agent alone), then 2 (both agents)."""
    return 1 if step < stage1_steps else 2


def continues_after(feedback: ParsedFeedback, revisions_done: int, max_revisions: int) -> bool:
    """Whether the episode goes on to another conversation turn after feedback f_t (t = revisions_done):
    only when the feedback parsed, raised a flag, and fewer than T_max revisions were made."""
    return feedback.triggered and revisions_done < max_revisions
