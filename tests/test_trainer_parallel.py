"""Training steps at TP=2, PP=2 and DP=2 give the same losses as TP=1 on the same data (tiny model), and a
frozen forward-only copy on the same process groups gives the same log-probs as at TP=1."""
from __future__ import annotations

import torch

from megatron_rl.placement.launch import run_distributed
from megatron_rl.types import TrainBatch
from tests.helpers import adam_noise_bound, near_uniform_state

STEPS = 3
LR = 1e-2


def _data(arch, rows=8, length=24):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, arch.vocab_size, (rows, length), generator=generator)
    mask = torch.zeros(rows, length)
    for r in range(rows):  # a "response" of varying length after a 6-token "prompt"
        mask[r, 6:6 + 4 + 2 * r] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=mask)


def _train_worker(rank, world_size, arch, tp, pp, state, batch):
    import torch.distributed as dist

    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    torch.set_num_threads(1)
    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp),
                           micro_batch_size=2, lr=LR, clip_grad=1.0, vocab_divisible_by=1)
    trainer = MegatronTrainer(arch, config, hf_state=state)
    dp, dp_rank = trainer.dp_size, trainer.pg.dp.rank()
    normalizer = batch.loss_mask.sum()  # token-mean over the GLOBAL batch
    rows = batch.batch_size // dp
    local = batch.select(slice(dp_rank * rows, (dp_rank + 1) * rows))

    def lm_loss(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask).sum() / normalizer, {}

    losses = [trainer.train_step(local, lm_loss)["train/loss"] for _ in range(STEPS)]
    final = trainer.compute_logprobs(local)
    # A frozen copy of the starting weights on the same process groups (a KL penalty's reference).
    start = MegatronTrainer(arch, config, pg_collection=trainer.pg, hf_state=state, frozen=True).compute_logprobs(local)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, (final, start)))
    by_dp = dict(gathered)
    return losses, *(torch.cat([by_dp[d][k] for d in range(dp)]) for k in (0, 1))


def _run(arch, tp, pp, world):
    state = near_uniform_state(arch)
    return run_distributed(_train_worker, world, arch, tp, pp, state, _data(arch))[0]


def test_tp2_pp2_dp2_match_single_rank(tiny_arch):
    reference_losses, reference_logprobs, reference_start = _run(tiny_arch, 1, 1, 1)
    assert reference_losses[-1] < reference_losses[0]  # it is learning, so the comparison means something
    # three Adam steps at lr 1e-2 move the log-probs by up to ~2.7: a lost or doubled gradient term would
    # leave a difference of that order
    assert (reference_logprobs - reference_start).abs().max() > 0.5
    mask = _data(tiny_arch).loss_mask
    final_loss = lambda lp: float(-(lp * mask).sum() / mask.sum())  # noqa: E731  (what a 4th step reports)
    for tp, pp, world in [(2, 1, 2), (1, 2, 2), (1, 1, 2)]:
        losses, logprobs, start = _run(tiny_arch, tp, pp, world)
        # Float rounding that differs with the split (and with the CPU's kernels) goes through Adam, which
        # turns a noise-sized gradient into an update of up to lr * R_t on that element (tests/helpers.py).
        # A loss is first-order blind to those elements (their gradient IS the noise, <~1e-7, times a drift
        # <= adam_noise_bound ~6e-2, on ~1e-5 of the elements); what is left is the forward's rounding,
        # a few FP32_EPS * log V (5.5) ~ 1e-6. So losses, including the one at the final weights, to 1e-5.
        assert torch.allclose(torch.tensor(losses), torch.tensor(reference_losses), atol=1e-5, rtol=0), \
            f"TP={tp} PP={pp} world={world}: {losses} vs {reference_losses}"
        assert abs(final_loss(logprobs) - final_loss(reference_logprobs)) < 1e-5, f"TP={tp} PP={pp} world={world}"
        # A single token's log-prob is not blind to them: a noise element with per-token derivative d moves
        # it by d * drift. d ~ (batch gradient ~2e-3) * sqrt(tokens ~90) ~ 2e-2 and drift <= 6e-2: ~1e-3
        # (5.4e-5 was seen on an AVX-512 Xeon, <1e-5 on an AVX2 EPYC); the control above is > 0.5.
        bound = 2e-2 * adam_noise_bound([LR] * STEPS)
        gap = (logprobs - reference_logprobs).abs().max().item()
        assert gap <= bound, f"TP={tp} PP={pp} world={world}: {gap:.3g} > {bound:.3g}"
        # The frozen copy: forward only, no Adam; fp32 rounding of a few FP32_EPS * |log-prob| (<~6).
        assert torch.allclose(start, reference_start, atol=1e-5), f"frozen copy at TP={tp} PP={pp} world={world}"


def test_train_step_loss_equals_a_full_forward_of_the_padded_batch(tiny_arch):
    """train_step computes log-probs only at loss positions and trims each micro-batch after its last
    loss column; its loss must equal the same loss on compute_logprobs' untrimmed, full forward."""
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    batch = _data(tiny_arch)
    wide = TrainBatch(tokens=torch.cat([batch.tokens, batch.tokens[:, :9]], dim=1),  # 9 columns of padding
                      loss_mask=torch.cat([batch.loss_mask, torch.zeros(batch.batch_size, 9)], dim=1))
    assert wide.micro_batches(2).__next__().trimmed().seq_length == 12  # rows 0-1: last loss column 11
    trainer = MegatronTrainer(tiny_arch, TrainerConfig(micro_batch_size=2, lr=1e-2, vocab_divisible_by=1),
                              hf_state=near_uniform_state(tiny_arch))
    normalizer = wide.loss_mask.sum()
    full = -(trainer.compute_logprobs(wide) * wide.loss_mask).sum() / normalizer
    reported = trainer.train_step(wide, lambda lp, mb, ent: (-(lp * mb.loss_mask).sum() / normalizer, {}))
    assert abs(reported["train/loss"] - float(full)) < 1e-5
