"""Reward-model training (`megatron-rl train` with `objective: reward_model`): a Bradley-Terry reward model
trained on preference pairs, then exported for `reward.name: reward_model` to score with.

    pairs = load_pairs(data.train)                         # prompt, chosen, rejected
    rm = RewardModelTrainer(arch, trainer, hf_state=...)   # the backbone plus a zero scalar head
    for each epoch, each batch of pairs_per_step pairs:    # shuffled per epoch
        rm.update(chosen, rejected)                        # one step of -log sigmoid(r_chosen - r_rejected)
    export(run_dir/reward_model)                           # the family's *ForSequenceClassification

Pairwise accuracy on the held-out pairs is measured before and after (a tie counts half). The run writes
metrics.jsonl (one line per step), checkpoints every `checkpoint.every_steps` (weights, Adam's moments,
scheduler; the pair order is a function of the seed and the epoch, so a resumed run takes the batches the
uninterrupted one would and ends with its bits), summary.json and the export.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from typing import Callable

from megatron_rl import ranks
from megatron_rl.algorithms.losses import bradley_terry_loss
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.config import ConfigError, to_dict
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.observability.metrics import LoggingConfig, MetricsLogger, Progress, truncate_jsonl
from megatron_rl.recipes.reward_model.config import RewardModelRunConfig
from megatron_rl.recipes.reward_model.data import load_pairs, split_heldout, tokenize_pairs
from megatron_rl.trainer.reward_model import RewardModelTrainer

log = logging.getLogger(__name__)

EXPORT_DIR = "reward_model"


@dataclasses.dataclass
class RewardModelSummary:
    accuracy_before: float
    accuracy_after: float
    margin_after: float
    train_pairs: int
    heldout_pairs: int
    dropped_pairs: int
    steps: int
    wall_time_s: float
    export: str


def pairwise_accuracy(rm: RewardModelTrainer, chosen: list[list[int]], rejected: list[list[int]], pad: int,
                      ) -> tuple[float, float]:
    """(share of pairs whose chosen answer scores higher, a tie counting half; mean margin)."""
    scores = rm.predict(chosen + rejected, pad_token_id=pad)
    _, metrics = bradley_terry_loss(scores[:len(chosen)], scores[len(chosen):], normalizer=len(chosen))
    return float(metrics["accuracy"]), float(metrics["margin"])


def refuse_used_run_dir(run_dir: str) -> None:
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"run_dir: {run_dir} already holds files; a new reward-model run writes into a new or "
                          "empty directory (nothing of another run is overwritten); --resume continues the run "
                          "there", field="run_dir")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"run_dir: {run_dir} is a file, not a directory", field="run_dir")


def latest_checkpoint(config: RewardModelRunConfig) -> str:
    """The checkpoint `--resume` continues (refused by name when the run directory has none)."""
    latest = CheckpointManager(config.run_dir, config.checkpoint).latest()
    if latest is None:
        raise ConfigError(f"--resume: {config.run_dir} holds no complete reward-model checkpoint to continue",
                          field="run_dir")
    return latest


def train_reward_model(config: RewardModelRunConfig, *, export: Callable[..., None],
                       resume: bool = False) -> RewardModelSummary:
    """Train and export (module docstring). `export(path, arch, state, tokenizer, task=...)` writes the HF
    directory (the CLI passes checkpoints_tools' `save_hf`: the export layer sits above the recipes).
    `resume`: continue the run directory's latest checkpoint."""
    started = time.perf_counter()
    latest = latest_checkpoint(config) if resume else None
    if not resume:
        refuse_used_run_dir(config.run_dir)
    data = config.data
    train_pairs = load_pairs(data.train)
    if data.heldout:
        heldout_pairs = load_pairs(data.heldout, "data.heldout")
    else:
        train_pairs, heldout_pairs = split_heldout(train_pairs, data.heldout_fraction, data.seed)
    pretrained = load_pretrained(config.model.path)
    if pretrained.tokenizer is None:
        raise ConfigError(f"model.path: {config.model.path} has no tokenizer to render conversations with",
                          field="model.path")
    tokenizer = pretrained.tokenizer.hf_tokenizer
    if not tokenizer.chat_template:
        raise ConfigError(f"model.path: {config.model.path}'s tokenizer has no chat template; a reward model reads "
                          "conversations rendered with one (as reward.name: reward_model scores)", field="model.path")
    pad = pretrained.tokenizer.pad_token_id
    chosen, rejected, dropped = tokenize_pairs(tokenizer, train_pairs, data.max_length)
    held_chosen, held_rejected, held_dropped = tokenize_pairs(tokenizer, heldout_pairs, data.max_length)
    if not chosen or not held_chosen:
        raise ConfigError(f"data.max_length={data.max_length}: no {'training' if not chosen else 'held-out'} pair "
                          "fits (raise it)", field="data.max_length")
    if dropped or held_dropped:
        log.info("reward model: %d training and %d held-out pairs longer than data.max_length=%d left out",
                 dropped, held_dropped, data.max_length)
    # Under torchrun / srun every rank runs this function: the checks above read the same files on every rank,
    # and the trainer's construction is the first collective, so no rank writes before all have checked.
    rm = RewardModelTrainer(pretrained.arch, config.trainer, hf_state=pretrained.state, head_lr=config.head_lr)
    dp_size, dp_rank = rm.dp_size, rm.pg.dp.rank()
    if config.pairs_per_step % dp_size:
        raise ConfigError(f"pairs_per_step={config.pairs_per_step} is not a multiple of the {dp_size} data-parallel "
                          "ranks that share each step's pairs", field="pairs_per_step")
    driver = ranks.is_driver()
    checkpoints = CheckpointManager(config.run_dir, config.checkpoint)
    steps_per_epoch = len(chosen) // config.pairs_per_step if dp_size > 1 else -(-len(chosen) // config.pairs_per_step)
    total_steps = config.epochs * steps_per_epoch
    done = 0
    if latest is not None:
        saved = checkpoints.load(latest, rm)
        done, before = int(saved["step"]), float(saved["accuracy_before"])
        if driver:
            truncate_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), done)
        log.info("reward model: resuming %s after step %d of %d", latest, done, total_steps)
    metrics_log = (MetricsLogger(config.run_dir, LoggingConfig(plots=False), to_dict(config), resume=resume)
                   if driver else None)
    if metrics_log is not None:
        metrics_log.progress = Progress(total_steps, done)
    try:
        if latest is None:
            before, _ = pairwise_accuracy(rm, held_chosen, held_rejected, pad)
        log.info("reward model: held-out pairwise accuracy before %.3f (%d pairs); training on %d pairs, %d epoch(s)",
                 before, len(held_chosen), len(chosen), config.epochs)
        step = 0
        for epoch in range(config.epochs):
            order = list(range(len(chosen)))
            random.Random(data.seed * 1000 + epoch).shuffle(order)
            # with several data-parallel ranks every step takes a whole batch (each rank an equal share): the
            # epoch's last pairs short of one are not trained in that epoch (each epoch shuffles anew)
            for start in range(0, steps_per_epoch * config.pairs_per_step, config.pairs_per_step):
                step += 1
                if step <= done:  # trained before the checkpoint this run resumed
                    continue
                batch = order[start:start + config.pairs_per_step]
                mine = batch[dp_rank::dp_size]
                metrics = rm.update([chosen[i] for i in mine], [rejected[i] for i in mine], pad_token_id=pad,
                                    normalizer=len(batch))
                if metrics_log is not None:
                    metrics_log.log(step, {"epoch": float(epoch), **metrics})
                if checkpoints.due(step, total_steps):
                    checkpoints.save(step, rm, {"step": step, "accuracy_before": before},
                                     tokenizer=pretrained.tokenizer)
        after, margin = pairwise_accuracy(rm, held_chosen, held_rejected, pad)
        if metrics_log is not None:
            metrics_log.log(step, {"heldout/pairwise_accuracy_before": before, "heldout/pairwise_accuracy": after,
                                   "heldout/margin": margin})
    finally:
        if metrics_log is not None:
            metrics_log.close()
    path = os.path.join(config.run_dir, EXPORT_DIR)
    state = rm.gather_reward_model_state()  # a collective: the whole model on the driver
    summary = RewardModelSummary(accuracy_before=before, accuracy_after=after, margin_after=margin,
                                 train_pairs=len(chosen), heldout_pairs=len(held_chosen),
                                 dropped_pairs=dropped + held_dropped, steps=step,
                                 wall_time_s=time.perf_counter() - started, export=path)
    if not driver:
        return summary
    export(path, pretrained.arch, state, pretrained.tokenizer, task="sequence_classification")
    with open(os.path.join(config.run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(summary), f, indent=1)
    log.info("reward model: held-out pairwise accuracy %.3f -> %.3f; exported to %s", before, after, path)
    return summary
