"""Reward-model training (trainer/reward_model.py, `objective: reward_model`): scores and the exported model
against transformers' own *ForSequenceClassification, the Bradley-Terry loss against the same loss computed
on transformers' scores, and learning a preference that a held-out set can check."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from megatron_rl.algorithms.losses import bradley_terry_loss
from megatron_rl.models.families import to_hf_config
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.reward_model import SCORE, RewardModelTrainer
from tests.helpers import tiny_state


def _conversations(seed: int, count: int, vocab: int, marker: int | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(5, 14, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        if marker is not None:
            ids = ids.masked_fill(ids == marker, marker + 1)
        rows.append(ids.tolist())
    return rows


def _hf_classifier(arch, state: dict[str, torch.Tensor]):
    """transformers' own sequence classifier of the family, loaded with `state` (the independent reference)."""
    config = transformers.AutoConfig.for_model(**{k: v for k, v in to_hf_config(arch).items()
                                                  if k not in ("architectures", "torch_dtype")},
                                               num_labels=1, pad_token_id=0)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.float().eval()


def _hf_scores(model, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([ids])).logits[:, 0] for ids in rows]).float()


def test_bradley_terry_loss_is_the_mean_negative_log_sigmoid_of_the_margins():
    chosen = torch.tensor([2.0, -1.0, 0.5, 3.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0, 0.5, -2.0])
    loss, metrics = bradley_terry_loss(chosen, rejected, normalizer=4)
    want = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 4
    assert abs(float(loss) - float(want)) < 1e-6
    assert float(metrics["accuracy"]) == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    # shares of a split add up to the whole (the trainer's loss-hook contract)
    first, _ = bradley_terry_loss(chosen[:1], rejected[:1], normalizer=4)
    rest, _ = bradley_terry_loss(chosen[1:], rejected[1:], normalizer=4)
    assert abs(float(first + rest) - float(loss)) < 1e-6
    with pytest.raises(ValueError, match="differ in shape"):
        bradley_terry_loss(chosen, rejected[:2], normalizer=2)


def test_reward_model_scores_loss_and_export_equal_transformers(tiny_arch):
    """After two steps (the head and the backbone both moved) the exported state loads into transformers'
    sequence classifier, whose scores equal `predict`'s and whose Bradley-Terry loss equals the one the next
    step reports. fp32 on both sides with different kernels and summation orders: a few ulps of scores of
    size ~1, so 1e-5."""
    rm = RewardModelTrainer(tiny_arch, TrainerConfig(lr=1e-3, micro_batch_size=4, seed=0),
                            hf_state=tiny_state(tiny_arch, seed=3), head_lr=1e-2)
    chosen = _conversations(1, 6, tiny_arch.vocab_size)
    rejected = _conversations(2, 6, tiny_arch.vocab_size)
    assert torch.equal(rm.predict(chosen), torch.zeros(6))  # a zero head scores everything 0
    first = rm.update(chosen, rejected)
    assert first["reward_model/loss"] == pytest.approx(6 * 0.6931471805599453 / 6, abs=1e-6)  # log 2 at margin 0
    rm.update(chosen, rejected)
    state = rm.gather_reward_model_state()
    assert SCORE in state and state[SCORE].shape == (1, tiny_arch.hidden_size) and "lm_head.weight" not in state
    assert float(state[SCORE].abs().max()) > 0
    hf = _hf_classifier(tiny_arch, state)
    ours, theirs = rm.predict(chosen + rejected), _hf_scores(hf, chosen + rejected)
    assert float((ours - theirs).abs().max()) <= 1e-5, (ours, theirs)
    want = -torch.nn.functional.logsigmoid(theirs[:6] - theirs[6:]).mean()
    third = rm.update(chosen, rejected)
    assert abs(third["reward_model/loss"] - float(want)) <= 1e-5
    assert third["reward_model/accuracy"] == pytest.approx(float((theirs[:6] > theirs[6:]).float().mean()))


def test_a_reward_model_learns_a_preference_that_held_out_pairs_confirm(tiny_arch):
    """Chosen answers end with a marker token, rejected ones never hold it: a few steps rank held-out pairs
    (other random conversations) right."""
    marker = 7
    rm = RewardModelTrainer(tiny_arch, TrainerConfig(lr=1e-3, micro_batch_size=8, seed=0),
                            hf_state=tiny_state(tiny_arch, seed=4), head_lr=1e-2)

    def pairs(seed: int, count: int):
        base = _conversations(seed, count, tiny_arch.vocab_size, marker=marker)
        other = _conversations(seed + 100, count, tiny_arch.vocab_size, marker=marker)
        return [ids + [marker] for ids in base], [ids + [marker + 1] for ids in other]

    held_c, held_r = pairs(50, 32)
    before = rm.predict(held_c) > rm.predict(held_r)
    for step in range(12):
        chosen, rejected = pairs(step, 16)
        rm.update(chosen, rejected)
    after = (rm.predict(held_c) > rm.predict(held_r)).float().mean()
    assert float(before.float().mean()) == 0.0  # all ties at the zero head
    assert float(after) >= 0.9, float(after)


def test_an_odd_micro_batch_is_refused(tiny_arch):
    with pytest.raises(ValueError, match="micro_batch_size=3: a reward model's micro-batches hold whole pairs"):
        RewardModelTrainer(tiny_arch, TrainerConfig(micro_batch_size=3), hf_state=tiny_state(tiny_arch))
