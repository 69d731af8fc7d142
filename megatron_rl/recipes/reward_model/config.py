"""Reward-model training's configuration (`objective: reward_model`), importable without torch."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.config import RECIPE_PATH_FIELD, require
from megatron_rl.models.config import ModelConfig
from megatron_rl.trainer.config import TrainerConfig


@dataclasses.dataclass(kw_only=True)
class PreferenceDataConfig:
    """Preference pairs: JSON lines (or a JSON array, or Parquet) with `chosen` and `rejected` answers."""

    train: str = dataclasses.field(default="", metadata={RECIPE_PATH_FIELD: True})
    """The training pairs. A row is {"prompt": str | messages, "chosen": str | messages, "rejected": str |
    messages}; without `prompt`, `chosen` and `rejected` are whole conversations (TRL's implicit prompt)."""
    heldout: str = dataclasses.field(default="", metadata={RECIPE_PATH_FIELD: True})
    """Held-out pairs for the pairwise accuracy before and after; empty: `heldout_fraction` of `train`."""
    heldout_fraction: float = 0.1
    """Share of the training pairs held out when `heldout` is empty (chosen with `seed`)."""
    max_length: int = 1024
    """Tokens per rendered conversation; a pair with a longer side is left out and counted."""
    seed: int = 0
    """Order of the pairs (shuffled each epoch) and the held-out draw."""

    def __post_init__(self) -> None:
        require(bool(self.train.strip()), "train", "must name a file of preference pairs")
        require(0.0 < self.heldout_fraction < 1.0 or bool(self.heldout.strip()), "heldout_fraction",
                "must be in (0, 1) when no held-out file is given")
        require(self.max_length >= 2, "max_length", "must be >= 2")


@dataclasses.dataclass(kw_only=True)
class RewardModelRunConfig:
    """`megatron-rl train` with `objective: reward_model`: Bradley-Terry training of a reward model on
    preference pairs, exported as the family's transformers *ForSequenceClassification model, which
    `reward.name: reward_model` scores with."""

    objective: Literal["reward_model"] = "reward_model"
    run_dir: str = "runs/reward_model"
    """Written by the run: metrics.jsonl, checkpoints/, summary.json and the exported model in
    reward_model/. A fresh run refuses a directory that already holds files (nothing of another run is
    overwritten); `--resume` continues the one there."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The backbone the reward model starts from (any form `model.path` accepts) and its chat template."""
    data: PreferenceDataConfig = dataclasses.field(default_factory=PreferenceDataConfig)
    epochs: int = 1
    pairs_per_step: int = 16
    """Pairs in one optimizer step, over all data-parallel ranks (a multiple of the data-parallel size; a
    multiple of data-parallel size x micro_batch_size / 2 keeps micro-batches full)."""
    head_lr: float = 1e-3
    """Adam learning rate of the scalar head, which starts at zero (the backbone uses trainer.lr)."""
    trainer: TrainerConfig = dataclasses.field(
        default_factory=lambda: TrainerConfig(lr=1e-5, micro_batch_size=8, lr_warmup_steps=0))
    """Backbone optimizer, precision, micro-batching (an even micro_batch_size: pairs stay whole) and the
    tensor x pipeline x data layout of a torchrun / srun launch (`trainer.parallel`)."""
    checkpoint: CheckpointConfig = dataclasses.field(
        default_factory=lambda: CheckpointConfig(every_steps=50, keep_last=1, save_at_end=False))
    """Mid-run checkpoints (`--resume` continues the latest, bit for bit); the finished model is the export."""

    def __post_init__(self) -> None:
        require(bool(self.run_dir.strip()), "run_dir", "must name a directory")
        require(self.model.chat_template is None and not self.model.chat_template_kwargs, "model.chat_template",
                "a reward model renders conversations with its default chat template and no extra variables, as "
                "reward.name: reward_model scores them")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.pairs_per_step >= 1, "pairs_per_step", "must be >= 1")
        require(0 <= self.head_lr <= 1, "head_lr", f"must be a number in [0, 1], got {self.head_lr!r}")
        require(self.trainer.micro_batch_size % 2 == 0, "trainer.micro_batch_size",
                "must be even: a micro-batch holds whole pairs (a chosen and a rejected row)")
        require(not self.trainer.lora.enabled, "trainer.lora", "the reward model trains all its weights (no adapters)")
