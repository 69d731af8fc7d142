"""Sequence packing and token-budget micro-batches (trainer/packing.py) against the padded computation: log-probs,
entropies, losses and gradients of a length-skewed batch, dense and mixture-of-experts with routing replay, at TP=1
and TP=2 (sequence parallel MoE, gloo ranks); micro-batches filled by tokens, data-parallel shares of equal tokens,
and the configurations packing cannot honour refused by name.

Tolerance: packed attention runs over each document's own length, the padded one over the micro-batch's width, so
the softmax sums in another order (a few float32 ulps per layer, amplified through the layers): at most
16 ulps per layer of (1 + |value|) for log-probs and entropies, of the largest gradient entry per tensor."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.placement.launch import run_distributed
from megatron_rl.trainer.packing import balanced_rows, pack_micro_batch, row_extents, token_budget_micro_batches
from megatron_rl.types import TrainBatch
from tests import moe_helpers
from tests.helpers import FP32_EPS, tiny_state

ARCH = ModelArch(vocab_size=256, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512)
LENGTHS = [40, 7, 100, 23, 64, 5, 31, 90]  # rows of very different lengths, as agent episodes have


def _batch(lengths=LENGTHS, vocab=256, seed=0, routed=None) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + 3  # right padding after the longest row too
    tokens = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, n // 2:n] = 1.0
    advantages = torch.randn(len(lengths), width, generator=g) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages, routed_experts=routed)


def _loss(normalizer):
    def loss_fn(logprobs, mb, entropy):
        m = mb.loss_mask
        loss = (-(logprobs * mb.advantages * m).sum() - 0.01 * (entropy * m).sum()) / normalizer
        return loss, {"entropy": (entropy * m).sum() / m.sum().clamp(min=1)}
    return loss_fn


def _trainer(arch, state, pg_collection=None, **config):
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    parallel = ParallelConfig(tensor_parallel=config.pop("tp", 1), expert_parallel=config.pop("ep", 1))
    return MegatronTrainer(arch, TrainerConfig(parallel=parallel, lr=0.0, vocab_divisible_by=1, **config),
                           hf_state=state, pg_collection=pg_collection)


def _run(arch, state, batch, **config):
    """Log-probs and entropies at loss positions, the step's loss and every gradient (a zero learning rate)."""
    trainer = _trainer(arch, state, **config)
    logprobs = trainer.compute_logprobs(batch)
    entropies = []

    def loss_fn(lp, mb, entropy):
        entropies.append((mb, entropy.detach()))
        return _loss(batch.loss_mask.sum())(lp, mb, entropy)

    metrics = trainer.train_step(batch, loss_fn)
    grads = {n: p.main_grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    # each row's entropies, found back by its tokens (micro-batches may hold rows in any order)
    entropy = torch.zeros(batch.tokens.shape)
    for mb, e in entropies:
        for r in range(mb.batch_size):
            row = next(i for i in range(batch.batch_size)
                       if torch.equal(batch.tokens[i, :mb.seq_length], mb.tokens[r]) and mb.loss_mask[r].any())
            entropy[row, :mb.seq_length] = e[r]
    return logprobs, entropy, metrics["train/loss"], grads


def _assert_same(got, want, mask, layers, what):
    tol = 16 * layers * FP32_EPS * (1 + want.abs())
    diff = (got - want).abs()
    assert bool((diff <= tol)[mask != 0].all()), f"{what}: max |difference| {diff[mask != 0].max().item():.3g}"


def _assert_same_grads(got, want, layers):
    for name, g in want.items():
        worst = (got[name] - g).abs().max().item()
        assert worst <= 16 * layers * FP32_EPS * max(g.abs().max().item(), 1e-30), f"gradient of {name}: {worst:.3g}"


# a 24-token window on the second layer only: rows longer and shorter than it
WINDOWED = dataclasses.replace(ARCH, sliding_window=24, sliding_window_layers=(1,))
# Gemma 2: the window on layer 0, soft-capped attention scores (materialised per document) and logits, post-norms
GEMMA2 = dataclasses.replace(WINDOWED, family="gemma2", sliding_window_layers=(0,), tie_word_embeddings=True,
                             norm_offset=1.0, sandwich_norms=True, embedding_multiplier=8.0, attention_scale=0.25,
                             mlp_activation="gelu_tanh", attn_logit_softcapping=2.0, final_logit_softcapping=4.0)

# GPT-OSS: the window on layer 0, learned sinks (materialised per document), biases everywhere, clamped-SwiGLU experts
GPT_OSS = dataclasses.replace(WINDOWED, family="gpt_oss", sliding_window_layers=(0,), num_experts=4, moe_top_k=2,
                              moe_ffn_hidden_size=32, attention_bias=True, attention_output_bias=True,
                              attention_sinks=True, moe_router_bias=True, expert_biases=True, swiglu_alpha=1.702,
                              swiglu_limit=2.0, glu_linear_offset=1.0)


def _state(arch):
    if not (arch.sandwich_norms or arch.attention_sinks):
        return tiny_state(arch)
    from megatron_rl.models.megatron_layout import hf_tensor_shapes

    g = torch.Generator().manual_seed(0)
    return {name: 0.2 * torch.randn(shape, generator=g) if len(shape) == 1
            else torch.randn(shape, generator=g) / shape[-1] ** 0.5 for name, shape in hf_tensor_shapes(arch).items()}


@pytest.mark.parametrize("config,arch", [(dict(sequence_packing=True), ARCH),
                                         (dict(sequence_packing=True, max_tokens_per_micro_batch=128), ARCH),
                                         (dict(sequence_packing=True), WINDOWED),
                                         (dict(sequence_packing=True), GEMMA2),
                                         (dict(sequence_packing=True), GPT_OSS)],
                         ids=["packed", "token_budget", "packed_sliding_window", "packed_gemma2_softcaps",
                              "packed_gpt_oss_sinks"])
def test_packed_equals_padded(config, arch):
    state, batch = _state(arch), _batch()
    lp0, ent0, loss0, grads0 = _run(arch, state, batch, micro_batch_size=2)
    lp, ent, loss, grads = _run(arch, state, batch, micro_batch_size=2, **config)
    _assert_same(lp, lp0, batch.loss_mask, arch.num_layers, "log-probs")
    _assert_same(ent, ent0, batch.loss_mask, arch.num_layers, "entropies")
    assert abs(loss - loss0) <= 16 * arch.num_layers * FP32_EPS * (1 + abs(loss0))
    _assert_same_grads(grads, grads0, arch.num_layers)


def test_packing_a_bug_would_show():
    """The comparison is sharp: attention that leaked across documents (one causal mask over the packed row)
    changes log-probs far beyond the tolerance."""
    from megatron_rl.trainer import packing

    state, batch = tiny_state(ARCH), _batch()
    lp0 = _trainer(ARCH, state, micro_batch_size=2).compute_logprobs(batch)
    original = packing.pack_micro_batch

    def one_document(mb, **kwargs):
        rows = original(mb, **kwargs)
        whole = torch.tensor([0, rows.length], dtype=torch.int32)
        rows.params.cu_seqlens_q = rows.params.cu_seqlens_kv = whole
        rows.params.max_seqlen_q = rows.params.max_seqlen_kv = rows.length
        return rows

    from megatron_rl.trainer import trainer as trainer_module
    trainer_module.pack_micro_batch = one_document
    try:
        lp = _trainer(ARCH, state, micro_batch_size=2, sequence_packing=True).compute_logprobs(batch)
    finally:
        trainer_module.pack_micro_batch = original
    assert (lp - lp0)[batch.loss_mask != 0].abs().max() > 1e-2


def test_moe_routing_replay_packed_equals_padded():
    model, arch, state, tokens = moe_helpers.build("qwen3_moe")
    lengths = [tokens.shape[1] - 1, 17, 30, 9]
    rows = torch.cat([tokens, tokens.flip(1)])[:, :max(lengths) + 1]
    record = moe_helpers.hf_own_routing(model, rows)
    record[1::2] = record[1::2].roll(1, dims=-1)  # an engine that routed differently: replay must follow it
    record[2, 20:] = -1  # positions without a record route themselves
    batch = _batch(lengths, vocab=arch.vocab_size, routed=record)
    batch.tokens[:, :rows.shape[1]] = rows
    common = dict(micro_batch_size=2, moe_routing_replay=True, moe_aux_loss_coeff=0.0)
    lp0, ent0, loss0, grads0 = _run(arch, state, batch, **common)
    lp, ent, loss, grads = _run(arch, state, batch, sequence_packing=True, max_tokens_per_micro_batch=64, **common)
    _assert_same(lp, lp0, batch.loss_mask, arch.num_layers, "MoE log-probs")
    _assert_same(ent, ent0, batch.loss_mask, arch.num_layers, "MoE entropies")
    _assert_same_grads(grads, grads0, arch.num_layers)


def _tp2_worker(rank, world_size, jobs):
    torch.set_num_threads(1)
    out = []
    for arch, state, batch, config in jobs:
        trainer = _trainer(arch, state, tp=2, micro_batch_size=2, **config)
        logprobs = trainer.compute_logprobs(batch)
        metrics = trainer.train_step(batch, _loss(batch.loss_mask.sum()))
        grads = {n: p.main_grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        out.append((logprobs, metrics["train/loss"], grads))
    return out if rank == 0 else None


def test_tensor_parallel_packing_dense_and_sequence_parallel_moe():
    _, moe_arch, moe_state, tokens = moe_helpers.build("qwen3_moe")
    dense = (ARCH, tiny_state(ARCH), _batch())
    moe = (moe_arch, moe_state, _batch([30, 11, 25, 6], vocab=moe_arch.vocab_size))  # odd lengths: SP pads
    packed = dict(sequence_packing=True, max_tokens_per_micro_batch=48)
    # The load-balancing loss is a statistic of the tokens a micro-batch routes (the padded path routes its
    # padding too), so it is off here: the policy's own log-probs and gradients are compared.
    jobs = [(*case, {**config, **({"moe_aux_loss_coeff": 0.0} if case is moe else {})})
            for case in (dense, moe) for config in ({}, packed)]
    results = run_distributed(_tp2_worker, 2, jobs)[0]
    for index, (arch, _, batch) in enumerate((dense, moe)):
        (lp0, loss0, grads0), (lp, loss, grads) = results[2 * index], results[2 * index + 1]
        _assert_same(lp, lp0, batch.loss_mask, arch.num_layers, f"TP=2 log-probs of {arch.family}")
        assert abs(loss - loss0) <= 16 * arch.num_layers * FP32_EPS * (1 + abs(loss0))
        _assert_same_grads(grads, grads0, arch.num_layers)


def test_pack_layout_restarts_positions_and_pads_to_a_multiple():
    batch = _batch([9, 4, 6])
    rows = pack_micro_batch(batch, multiple=8)
    extents = row_extents(batch).tolist()
    assert extents == [8, 3, 5]
    assert rows.length == 16 and rows.params.cu_seqlens_q.tolist() == [0, 8, 11, 16]
    assert rows.positions[0].tolist() == list(range(8)) + list(range(3)) + list(range(5))
    assert torch.equal(rows.inputs[0, 8:11], batch.tokens[1, :3])
    hidden = torch.arange(16.0).view(1, 16, 1)
    unpacked = rows.unpack(hidden)[..., 0]
    assert unpacked[1, :3].tolist() == [8.0, 9.0, 10.0] and unpacked[1, 3:].abs().sum() == 0
    assert pack_micro_batch(batch, multiple=5).length == 20  # 16 tokens padded to a multiple of 5 (a padding doc)


def test_token_budget_micro_batches_and_balanced_shares():
    lengths = [300, 12, 45, 7, 130, 64, 33, 200, 9, 18]
    batch = _batch(lengths)
    extents = row_extents(batch)
    micro, order = token_budget_micro_batches(batch, 256)
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every row exactly once
    sizes = [int(row_extents(mb).sum()) for mb in micro]
    assert sizes[0] == int(extents.max()) > 256  # a row over the budget: a micro-batch of its own
    assert all(size <= 256 for size in sizes[1:])
    assert len(micro) == -(-int(extents[extents <= 256].sum()) // 256) + 1  # first-fit decreasing packs tightly here
    shares = balanced_rows(batch, 3)
    assert sorted(torch.cat(shares).tolist()) == list(range(len(lengths)))
    loads = [int(extents[s].sum()) for s in shares]
    assert max(loads) - min(loads) <= int(extents.max())


def test_configurations_packing_cannot_honour_are_refused():
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig

    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        TrainerConfig(max_tokens_per_micro_batch=512)
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        TrainerConfig(sequence_packing=True, parallel=ParallelConfig(pipeline_parallel=2))
    TrainerConfig(sequence_packing=True, max_tokens_per_micro_batch=4096, parallel=ParallelConfig(pipeline_parallel=2))


def test_the_loop_trains_on_packed_token_budget_micro_batches(tmp_path, tiny_chat_model):
    """The RL loop with packing and a token budget: the trainer's packed log-probs equal the engine's (same
    weights, on-policy), and the packed reference model's KL is 0 at the first step."""
    import json
    import os

    from megatron_rl.controller.loop import train
    from tests.test_loop import _config

    run_dir = str(tmp_path / "run")
    train(_config(tiny_chat_model, run_dir, "trainer.sequence_packing=true", "trainer.max_tokens_per_micro_batch=64",
                  "algorithm.loss.kl_coef=0.1", "steps=2", "checkpoint.every_steps=0"))
    steps = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "train/loss" in r]
    assert len(steps) == 2
    assert all(r["train/logprob_mismatch"] < 1e-4 for r in steps)
    assert steps[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6) and steps[1]["train/kl_ref"] > 1e-7
