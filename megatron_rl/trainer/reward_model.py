"""A Bradley-Terry reward model r(x, y) on Megatron: the policy's network with a scalar head read after the
conversation's last token, trained on preference pairs (loss: `algorithms.losses.bradley_terry_loss`).

    rm = RewardModelTrainer(arch, TrainerConfig(lr=1e-5, micro_batch_size=8), hf_state=pretrained.state)
    scores = rm.predict([conversation_ids, ...])               # [N] r of each tokenized conversation
    metrics = rm.update(chosen_ids, rejected_ids)              # one optimizer step on a batch of pairs
    state = rm.gather_reward_model_state()                     # transformers' *ForSequenceClassification names

It is the value model's trainer (trainer/value.py: same backbone, schedules, TP/PP, checkpoint shards) with
the head transformers' sequence classifiers have: linear, one output, no bias (`score`), read at the last
token, so `gather_reward_model_state` loads into `AutoModelForSequenceClassification` as it is. The head
starts at zero (every conversation scores 0) and has its own learning rate (`head_lr`): the backbone's
gradient is zero until the head moves.

A batch of pairs is laid out as rows [chosen_0, rejected_0, chosen_1, rejected_1, ...], so with an even
micro-batch size every micro-batch holds whole pairs and its loss is its pairs' share of the batch's mean.
"""
from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.losses import bradley_terry_loss
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import megatron_to_hf
from megatron_rl.trainer.config import TrainerConfig, ValueModelConfig
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.trainer.value import ValueNetwork, ValueTrainer

SCORE = "score.weight"
"""The head's name in transformers' *ForSequenceClassification models."""


class RewardModelTrainer(ValueTrainer):
    """r(x, y) on one model replica: `predict` conversations, `update` on preference pairs, export for
    transformers."""

    def __init__(self, arch: ModelArch, config: TrainerConfig, *, hf_state: dict[str, torch.Tensor],
                 head_lr: float = 1e-3, pg_collection=None):
        if config.micro_batch_size % 2:
            raise ValueError(f"trainer.micro_batch_size={config.micro_batch_size}: a reward model's micro-batches "
                             "hold whole pairs (chosen and rejected rows), so it must be even")
        if config.lora.enabled:
            raise ValueError("trainer.lora: the reward model trains all its weights (no adapters)")
        super().__init__(arch, ValueModelConfig(head="linear", head_lr=head_lr, standardize_features=False,
                                                mean_reward_prior=False, trainer=config),
                         hf_state=hf_state, pg_collection=pg_collection)

    def _network(self, gpt):
        self.network = ValueNetwork(gpt, self.arch.hidden_size, with_head=self.is_last_stage, bias=False)
        return self.network

    def update(self, chosen: list[list[int]], rejected: list[list[int]],  # type: ignore[override]
               pad_token_id: int = 0, normalizer: int | None = None) -> dict[str, float]:
        """One optimizer step of the mean Bradley-Terry loss over a batch of pairs: these are this
        data-parallel rank's, `normalizer` the pair count of the whole batch over all ranks (default: these
        alone). Metrics (averaged over ranks): reward_model/loss, /accuracy (pairs ranked right, before the
        step), /margin, /grad_norm, /step_time."""
        if len(chosen) != len(rejected) or not chosen:
            raise ValueError(f"{len(chosen)} chosen and {len(rejected)} rejected answers: pairs need one of each")
        rows = [ids for pair in zip(chosen, rejected) for ids in pair]
        batch = self.prompt_batch(rows, pad_token_id=pad_token_id)
        pairs = normalizer or len(chosen)
        local_pairs = len(chosen)

        def head_loss(hidden, tokens, mb):
            real = (mb.loss_mask.sum(-1) > 0).to(hidden.device)  # rows filling the last micro-batch carry no pair
            scores = self._values(self._states(hidden, mb.loss_mask)[real]).view(-1, 2)
            loss, metrics = bradley_terry_loss(scores[:, 0], scores[:, 1], normalizer=pairs)
            # micro-batch metrics are averaged over micro-batches: weigh each by its share of the pairs
            share = scores.shape[0] * math.ceil(batch.batch_size / self.config.micro_batch_size) / local_pairs
            return loss, {k: v * share for k, v in metrics.items()}

        metrics = self.train_step_on_hidden(batch, head_loss, trim=True)
        return {"reward_model/loss": metrics["train/loss"], "reward_model/accuracy": metrics["train/accuracy"],
                "reward_model/margin": metrics["train/margin"], "reward_model/grad_norm": metrics["train/grad_norm"],
                "reward_model/update_skipped": metrics["train/update_skipped"],
                "reward_model/step_time": metrics["perf/train_step_time"]}

    def gather_reward_model_state(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model under transformers' *ForSequenceClassification names on global rank `dst` (None
        elsewhere): the backbone's `model.*` and the head as `score.weight` [1, hidden], without `lm_head`."""
        head = self.network.value_head
        weight = self._broadcast_from_last_stage(
            head.weight.detach().float() if head is not None else None, (1, self.arch.hidden_size), torch.float32)
        shards = self._gather_shards(MegatronTrainer.shard_state(self), dst)  # the backbone's, without the head
        if shards is None:
            return None
        state = {k: v for k, v in megatron_to_hf(shards, self.layout).items() if k != "lm_head.weight"}
        dtype = next(iter(state.values())).dtype
        state[SCORE] = weight.to(dtype)
        return state
