"""Mixture-of-experts policies in the Megatron trainer against transformers (fp32, CPU, tiny random Qwen3-MoE and
Mixtral models): logits within 1e-4 at EP=1, EP=2 and TP=2 x EP=2 (gloo ranks on loopback), the same training
losses at EP=2 as at EP=1, and routing replay: with a record the trainer routes by it (logits equal transformers
forced to the same experts), positions without a record route themselves, and the mismatch metric counts
recorded tokens the router would have routed elsewhere."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.placement.launch import run_distributed
from megatron_rl.types import TrainBatch
from tests import moe_helpers

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def _trainer(arch, state, *, tp=1, ep=1, pp=1, replay=False, micro_batch_size=2, lr=0.0, pg_collection=None,
             stages=None, **extra):
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    first, last = stages or (None, None)
    parallel = ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, first_stage_layers=first,
                              last_stage_layers=last)
    config = TrainerConfig(parallel=parallel, lr=lr,
                           micro_batch_size=micro_batch_size, vocab_divisible_by=1, moe_routing_replay=replay, **extra)
    return MegatronTrainer(arch, config, hf_state=state, pg_collection=pg_collection)


@pytest.fixture(scope="module")
def built():
    return {name: moe_helpers.build(name) for name in moe_helpers.CASES}


@pytest.mark.parametrize("name", list(moe_helpers.CASES))
def test_trainer_ep1_matches_transformers(built, name):
    model, arch, state, tokens = built[name]
    expected = model(tokens[:, :-1]).logits.detach()
    logits = _trainer(arch, state).compute_logits(TrainBatch(tokens=tokens, loss_mask=torch.zeros(tokens.shape)))
    assert (logits - expected).abs().max().item() <= TOL


def _lm_loss(normalizer):
    return lambda logprobs, mb, entropy: (-(logprobs * mb.loss_mask).sum() / normalizer, {})


def _batch(tokens):
    mask = torch.zeros(tokens.shape)
    mask[:, 20:] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=mask)


def _parallel_worker(rank, world_size, jobs):
    """Each job: (arch, state, tokens, tp, ep, pp, stages, steps) -> (logits of this DP rank's rows, losses, moe
    metrics); `stages`: (first_stage_layers, last_stage_layers) or None."""
    torch.set_num_threads(1)
    out = []
    for arch, state, tokens, tp, ep, pp, stages, steps in jobs:
        trainer = _trainer(arch, state, tp=tp, ep=ep, pp=pp, micro_batch_size=1, lr=1e-2, stages=stages)
        if stages:
            assert trainer.layout.stage_layer_counts[0] == stages[0]
        rows = tokens.shape[0] // trainer.dp_size
        local = tokens[trainer.pg.dp.rank() * rows:(trainer.pg.dp.rank() + 1) * rows]
        logits = trainer.compute_logits(TrainBatch(tokens=local, loss_mask=torch.zeros(local.shape)))
        batch = _batch(local)
        normalizer = _batch(tokens).loss_mask.sum()
        metrics = [trainer.train_step(batch, _lm_loss(normalizer)) for _ in range(steps)]
        out.append((trainer.pg.dp.rank(), logits, [m["train/loss"] for m in metrics], metrics[-1] if metrics else {}))
    return out if rank == 0 else None


def _single_rank_losses(arch, state, tokens, steps):
    trainer = _trainer(arch, state, micro_batch_size=1, lr=1e-2)
    normalizer = _batch(tokens).loss_mask.sum()
    return [trainer.train_step(_batch(tokens), _lm_loss(normalizer))["train/loss"] for _ in range(steps)]


def _check_parallel(built, names, tp, ep, world, steps, pp=1, stages=None):
    jobs = [(built[n][1], built[n][2], built[n][3], tp, ep, pp, stages, steps) for n in names]
    results = run_distributed(_parallel_worker, world, jobs)[0]
    for name, (dp_rank, logits, losses, metrics) in zip(names, results):
        model, arch, state, tokens = built[name]
        rows = logits.shape[0]
        expected = model(tokens[dp_rank * rows:(dp_rank + 1) * rows, :-1]).logits.detach()
        assert (logits - expected).abs().max().item() <= TOL, f"{name} TP={tp} EP={ep}"
        if steps:
            reference = _single_rank_losses(arch, state, tokens, steps)
            assert reference[-1] < reference[0]  # it learns, so equal losses mean equal updates
            # Losses after Adam steps: first-order blind to the noise-gradient elements Adam moves by ~lr
            # (their gradient is the noise), so what is left is the forward's rounding, a few FP32_EPS * log V.
            assert torch.allclose(torch.tensor(losses), torch.tensor(reference), atol=1e-5, rtol=0), \
                f"{name} TP={tp} EP={ep}: {losses} vs {reference}"
            assert metrics["moe/aux_loss"] > 0 and metrics["moe/router_entropy"] > 0


def test_ep2_matches_transformers_and_single_rank_training(built):
    # EP=2 over 2 data-parallel ranks: each rank holds 2 of the 4 experts of every layer.
    _check_parallel(built, ["mixtral"], tp=1, ep=2, world=2, steps=3)


@pytest.mark.slow  # four gloo processes (TP=2 x EP=2, sequence parallel): ~2 min on 2 shared cores
def test_tp2_ep2_matches_transformers_and_single_rank_training(built):
    _check_parallel(built, list(moe_helpers.FAMILY_CASES), tp=2, ep=2, world=4, steps=3)


@pytest.mark.slow
def test_ep2_qwen3_moe(built):
    _check_parallel(built, ["qwen3_moe"], tp=1, ep=2, world=2, steps=3)


@pytest.mark.slow
def test_pp2_moe(built):
    _check_parallel(built, ["qwen3_moe", moe_helpers.DENSE_LAYERS.name, "gpt_oss"], tp=1, ep=1, pp=2, world=2, steps=3)


def test_uneven_pp2_moe(built):
    """Megatron's uneven pipeline split (first_stage_layers 3 of the 4 layers, the dense one among them; what
    DeepSeek-V3's 61 layers over PP 16 need): logits equal transformers, training equals one process."""
    _check_parallel(built, [moe_helpers.DENSE_LAYERS.name], tp=1, ep=1, pp=2, world=2, steps=3, stages=(3, None))


def _forced_record(model, tokens, arch):
    """(transformers' own choice [B, S-1, L, k], a record [B, S, L, k] that differs from it at every recorded
    position: the k experts the router did not pick, no record on the last 5 input positions of row 0 nor on
    the last token, which is no input)."""
    own = moe_helpers.hf_own_routing(model, tokens[:, :-1])
    b, s, layers, k = own.shape
    chosen = torch.zeros(b, s, layers, arch.num_experts, dtype=torch.bool).scatter_(-1, own.clamp(min=0), True)
    record = (~chosen).float().argsort(dim=-1, descending=True, stable=True)[..., :k]
    record[0, -5:] = -1
    record[:, :, [i for i in range(layers) if not arch.layer_is_moe(i)]] = -1  # dense layers route nothing
    return own, torch.cat([record, record.new_full((b, 1, layers, k), -1)], dim=1)


@pytest.mark.parametrize("name", list(moe_helpers.FAMILY_CASES))
def test_routing_replay_uses_the_record(built, name):
    model, arch, state, tokens = built[name]
    own, record = _forced_record(model, tokens, arch)
    assert not torch.equal(record[:, :-1][record[:, :-1] >= 0], own[record[:, :-1] >= 0])
    with torch.no_grad(), moe_helpers.hf_forced_routing(model, record[:, :-1]):
        forced = model(tokens[:, :-1]).logits
    plain = model(tokens[:, :-1]).logits.detach()
    assert (forced - plain).abs().max() > 1e-2  # the record changes the output

    replaying = _trainer(arch, state, replay=True)
    batch = TrainBatch(tokens=tokens, loss_mask=torch.zeros(tokens.shape), routed_experts=record)
    assert (replaying.compute_logits(batch) - forced).abs().max().item() <= TOL
    # Replay off: the record is ignored for routing, but measured: every recorded token routes differently.
    measuring = _trainer(arch, state, replay=False)
    assert (measuring.compute_logits(batch) - plain).abs().max().item() <= TOL
    train = _batch(tokens)
    train.routed_experts = record
    metrics = measuring.train_step(train, _lm_loss(train.loss_mask.sum()))
    assert metrics["moe/routing_mismatch"] == 1.0
    # A record of the router's own choices: no mismatch, and replaying it changes nothing.
    agreeing = torch.cat([own, own.new_full((own.shape[0], 1, *own.shape[2:]), -1)], dim=1)
    train.routed_experts = agreeing
    metrics = _trainer(arch, state, replay=True).train_step(train, _lm_loss(train.loss_mask.sum()))
    assert metrics["moe/routing_mismatch"] == 0.0
    batch.routed_experts = agreeing
    assert (replaying.compute_logits(batch) - plain).abs().max().item() <= TOL


def test_replayed_training_loss_is_the_forced_models_loss(built):
    """train_step (trimmed micro-batches, log-probs at loss positions only) replays too: its loss is the
    loss of transformers forced to the record."""
    model, arch, state, tokens = built["qwen3_moe"]
    _, record = _forced_record(model, tokens, arch)
    train = _batch(tokens)
    train.routed_experts = record
    with torch.no_grad(), moe_helpers.hf_forced_routing(model, record[:, :-1]):
        logprobs = torch.log_softmax(model(tokens[:, :-1]).logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    expected = -(logprobs * train.loss_mask[:, 1:]).sum() / train.loss_mask.sum()
    metrics = _trainer(arch, state, replay=True).train_step(train, _lm_loss(train.loss_mask.sum()))
    assert abs(metrics["train/loss"] - expected.item()) <= 1e-5


@pytest.mark.parametrize("replay", [True, False])
def test_replay_diagnostics_score_both_routings_against_the_engine(built, replay):
    """trainer.moe_replay_diagnostics: an engine that sampled with experts the trainer's router would not
    pick (its log-probs: transformers forced to the record; a few positions unrecorded, where both route
    themselves). Replayed, the trainer's log-probs are the
    engine's; with its own routing they are far off. Either way the step trains as configured."""
    model, arch, state, tokens = built["mixtral"]
    _, record = _forced_record(model, tokens, arch)
    with torch.no_grad(), moe_helpers.hf_forced_routing(model, record[:, :-1]):
        forced = torch.log_softmax(model(tokens[:, :-1]).logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    train = _batch(tokens)
    train.routed_experts = record
    train.behaviour_logprobs = torch.cat([torch.zeros(tokens.shape[0], 1), forced], dim=1) * train.loss_mask
    trainer = _trainer(arch, state, replay=replay, moe_replay_diagnostics=True)
    metrics = trainer.train_step(train, _lm_loss(train.loss_mask.sum()))
    assert metrics["moe/logprob_mismatch_replay_max"] <= TOL
    assert metrics["moe/logprob_mismatch_own_routing"] > 1e-2
    assert metrics["moe/logprob_mismatch_own_routing_max"] >= metrics["moe/logprob_mismatch_own_routing"]
    # (replayed, later layers see other hidden states, so a few of their own choices meet the record)
    assert trainer.routing.replay is replay and metrics["moe/routing_mismatch"] > 0.9
    # every route differs, so nearly every token's log-prob depends on which routing is used; on those the
    # replayed log-probs are the engine's and the trainer's own are off by the full difference
    assert metrics["moe/routing_sensitive_tokens"] > 0.9
    assert metrics["moe/logprob_mismatch_replay_sensitive"] <= TOL
    assert metrics["moe/logprob_mismatch_own_routing_sensitive"] >= metrics["moe/logprob_mismatch_own_routing"]
    if replay:  # the training pass itself replayed (the diagnostics left the switch as it was)
        expected = -(forced * train.loss_mask[:, 1:]).sum() / train.loss_mask.sum()
        assert abs(metrics["train/loss"] - expected.item()) <= 1e-5


def test_step_batch_carries_the_routing_records():
    """build_step_batch puts Completion.routed_experts [P + R - 1, L, k] at the tokens' positions of their rows
    (rows sorted longest first, padding rows and unrecorded positions -1)."""
    from megatron_rl.algorithms.config import AdvantageConfig
    from megatron_rl.controller.batching import build_step_batch
    from megatron_rl.controller.episodes import Group, Sample
    from megatron_rl.data.prompts import Prompt
    from megatron_rl.rewards.registry import RewardResult
    from megatron_rl.types import Completion

    def completion(i, prompt_len, response_len, recorded=True):
        positions = prompt_len + response_len - 1
        record = torch.arange(positions * 2 * 2).reshape(positions, 2, 2).to(torch.int16) + 100 * i
        return Completion(request_id=f"r{i}", prompt_ids=[1] * prompt_len, output_ids=[2] * response_len,
                          output_logprobs=[-1.0] * response_len, weight_versions=[0] * response_len,
                          finish_reason="stop", routed_experts=record if recorded else None)

    completions = [completion(0, 3, 2), completion(1, 3, 5), completion(2, 2, 2, recorded=False)]
    samples = [Sample(completion=c, text="", reward=RewardResult(reward=float(i))) for i, c in enumerate(completions)]
    group = Group(prompt=Prompt(prompt_id="p", messages=[], question="q"), samples=samples, requested_at_version=0)
    step = build_step_batch([group], advantage=AdvantageConfig(), trainer_version=0, micro_batch_size=2,
                            pad_token_id=0, drop_uninformative=False)
    routed = step.batch.routed_experts
    assert routed.shape == (4, 8, 2, 2) and routed.dtype == torch.int64
    assert torch.equal(routed[0, :7], completions[1].routed_experts.long()) and (routed[0, 7:] == -1).all()
    assert torch.equal(routed[1, :4], completions[0].routed_experts.long()) and (routed[1, 4:] == -1).all()
    assert (routed[2] == -1).all() and (routed[3] == -1).all()  # no record; a padding row
    assert step.batch.micro_batches(2).__next__().routed_experts.shape[0] == 2


def test_moe_only_settings_are_refused_elsewhere(built, tiny_arch):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="expert_parallel=2 needs a mixture-of-experts"):
        _trainer(tiny_arch, None, ep=2)
    _, arch, state, _ = built["mixtral"]
    with pytest.raises(ConfigError, match="moe_routing_replay"):
        _trainer(arch, state, replay=True, recompute_activations=True)


def test_expert_bias_moves_towards_uniform_load_and_is_exported(built):
    """Aux-loss-free balancing (GLM-4.5's sigmoid router): after every step each MoE layer's expert bias moves by
    exactly +-rate (towards experts that got fewer tokens than the mean), the routing evens out over 20 steps on a
    fixed batch, the metric reports it, and the export carries the moved bias; rate 0 keeps it fixed."""
    model, arch, state, tokens = built["glm4_moe"]
    rate = 0.02
    trainer = _trainer(arch, state, lr=0.0, moe_expert_bias_update_rate=rate, moe_aux_loss_coeff=0.0)
    router = next(m for n, m in trainer.gpt.named_modules() if n.endswith("mlp.router"))
    train = _batch(tokens)
    first = None
    for step in range(20):
        before = router.expert_bias.clone()
        metrics = trainer.train_step(train, _lm_loss(train.loss_mask.sum()))
        moved = (router.expert_bias - before).abs()
        # fp32 steps of rate (1 ulp of the bias ~ 1e-8); 0 only for an expert with exactly the mean load
        assert ((moved - rate).abs() < 1e-6).logical_or(moved == 0).all(), moved
        if step == 0:
            first = metrics
    assert metrics["moe/expert_load_max"] < first["moe/expert_load_max"]
    assert metrics["moe/expert_bias_mean_abs"] != pytest.approx(first["moe/expert_bias_mean_abs"])
    exported = trainer.gather_hf_state()
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(exported[bias_name], router.expert_bias.cpu())
    assert not torch.equal(exported[bias_name], state[bias_name])
    fixed = _trainer(arch, state, lr=0.0, moe_expert_bias_update_rate=0.0)
    fixed.train_step(train, _lm_loss(train.loss_mask.sum()))
    fixed_router = next(m for n, m in fixed.gpt.named_modules() if n.endswith("mlp.router"))
    assert torch.equal(fixed_router.expert_bias.cpu(), state[bias_name])
