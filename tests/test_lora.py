"""LoRA on the Megatron trainer (trainer/lora.py) against `peft` on transformers: after one Adam step on the
adapters, the trainer's logits equal peft's with the exported adapter on the same base, and the next step's
adapter gradients equal peft's autograd gradients, at TP=1 and TP=2 (gloo ranks); the base stays frozen.

Tolerances: both sides compute the same float32 maths in another order (fused vs separate projections, the
low-rank path's products): 1e-5 absolute on logits of magnitude ~1 (the issue's bound; float32 rounding over
two layers is ~1e-6). Gradients: the fused A's gradient is the sum of peft's q/k/v (or gate/up) gradients,
compared at 1e-5 of the largest entry of each tensor."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_rl.cli import parity
from megatron_rl.models.lora_layout import megatron_to_peft, peft_adapter_config, peft_to_megatron
from megatron_rl.models.megatron_layout import MegatronLayout
from megatron_rl.placement.launch import run_distributed
from megatron_rl.sim.cost import lora_layer_parameters
from megatron_rl.types import TrainBatch

peft = pytest.importorskip("peft")

CASE = next(c for c in parity.CASES if c.name == "qwen2")  # q/k/v biases: the fused QKV is not plain
RANK, ALPHA, LR = 4, 8.0, 1e-2
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 33), generator=g)
    mask = torch.zeros(tokens.shape)
    mask[:, 10:] = 1.0
    mask[3, 25:] = 0.0
    advantages = torch.randn(tokens.shape, generator=g) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages)


def _loss(batch):
    def loss_fn(logprobs, mb, entropy):
        return -(logprobs * mb.advantages * mb.loss_mask).sum() / batch.loss_mask.sum(), {}
    return loss_fn


def _trainer(arch, state, tp=1, **lora):
    from megatron_rl.trainer.config import LoraConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp), lr=LR, clip_grad=0.0, vocab_divisible_by=1,
                           micro_batch_size=2, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS, **lora))
    return MegatronTrainer(arch, config, hf_state=state)


def _steps(arch, state, batch, tp=1):
    """Step 1 moves the adapters (B starts at 0); then the logits, the adapters and step 2's gradients."""
    trainer = _trainer(arch, state, tp=tp)
    base_before = {k: v.clone() for k, v in trainer._base_state().items()}
    trainer.train_step(batch, _loss(batch))
    logits = trainer.compute_logits(batch)
    with trainer.adapters_disabled():
        base_logits = trainer.compute_logits(batch)
    adapters = {k: v.detach().clone() for k, v in trainer.checkpoint_state().items()}
    trainer.train_step(batch, _loss(batch))
    grads = {n: p.main_grad.clone() for n, p in trainer.gpt.named_parameters() if p.requires_grad}
    frozen = all(torch.equal(v, base_before[k]) for k, v in trainer._base_state().items())
    trained = sorted(n for n, p in trainer.gpt.named_parameters() if p.requires_grad)
    return logits, base_logits, adapters, grads, frozen, trained


def _tp2_worker(rank, world_size, arch, state, batch):
    torch.set_num_threads(1)
    return _steps(arch, state, batch, tp=2)


def _peft_reference(model, peft_state, batch):
    """peft's LoRA model with `peft_state` on `model`: (logits of tokens[:, :-1], adapter gradients of the loss)."""
    config = peft.LoraConfig(**{k: v for k, v in peft_adapter_config(
        rank=RANK, alpha=ALPHA, dropout=0.0, targets=TARGETS, base_model=None).items()
        if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora")})
    lora_model = peft.get_peft_model(copy.deepcopy(model), config)  # (peft edits the model it is given)
    missing = peft.set_peft_model_state_dict(lora_model, {k.replace(".lora_A.weight", ".lora_A.default.weight")
                                                          .replace(".lora_B.weight", ".lora_B.default.weight"): v
                                                          for k, v in peft_state.items()})
    assert not missing.unexpected_keys
    logits = lora_model(batch.tokens[:, :-1]).logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    mask, adv = batch.loss_mask[:, 1:], batch.advantages[:, 1:]
    (-(logprobs * adv * mask).sum() / batch.loss_mask.sum()).backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in lora_model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def _check(arch, result, layout, hf_model, batch):
    logits_meg, base_logits_meg, adapter_shards, grad_shards, frozen, trained = result
    assert frozen, "a base weight moved"
    # the planner's adapter count (sim/cost.py) is what one rank holds
    held = sum(v.numel() for v in adapter_shards[0].values())
    assert held == lora_layer_parameters(arch, RANK, tuple(TARGETS), layout.tp)[0] * arch.num_layers
    assert trained and all(".adapter.lora_" in n for n in trained), trained
    peft_state = megatron_to_peft([adapter_shards], layout, TARGETS)
    reference = parity.reference_logits(hf_model, batch.tokens)
    logits_ref, grads_ref = _peft_reference(hf_model, peft_state, batch)
    assert (base_logits_meg - reference).abs().max() <= 1e-5  # adapters off: the base itself
    assert (logits_ref - reference).abs().max() > 1e-3  # the step moved the adapted model
    worst = (logits_meg - logits_ref).abs().max().item()
    assert worst <= 1e-5, f"TP={layout.tp}: max |logit difference| against peft {worst:.3g}"
    grads = megatron_to_peft([grad_shards], layout, TARGETS)
    for name, want in grads_ref.items():
        if ".lora_A." in name and any(p in name for p in ("k_proj", "v_proj", "up_proj")):
            continue  # a fused linear's A: compared once, below, against the sum over its projections
        if ".lora_A." in name and ("q_proj" in name or "gate_proj" in name):
            siblings = ("q_proj", "k_proj", "v_proj") if "q_proj" in name else ("gate_proj", "up_proj")
            first = siblings[0]
            want = sum(grads_ref[name.replace(first, s)] for s in siblings)
        got = grads[name]
        tol = 1e-5 * want.abs().max().item() + 1e-9
        assert (got - want).abs().max().item() <= tol, f"TP={layout.tp}: gradient of {name}"
    return worst


@pytest.fixture(scope="module")
def qwen2():
    model, arch, state = parity.case_model(CASE)
    return model, arch, state, _batch(arch.vocab_size)


def test_lora_equals_peft_at_tp1(qwen2):
    model, arch, state, batch = qwen2
    result = _steps(arch, state, batch)
    _check(arch, (result[0], result[1], [result[2]], [result[3]], *result[4:]), MegatronLayout(arch), model, batch)


def test_lora_on_gemma3_joins_the_projection_before_its_post_norm():
    """Gemma's o_proj / down_proj outputs are normalised before the residual add: PEFT's adapter adds to the
    projection, so ours must too (not to the normalised output)."""
    case = next(c for c in parity.CASES if c.config_class == "Gemma3TextConfig")
    model, arch, state = parity.case_model(case)
    batch = _batch(arch.vocab_size)
    result = _steps(arch, state, batch)
    _check(arch, (result[0], result[1], [result[2]], [result[3]], *result[4:]), MegatronLayout(arch), model, batch)


def test_lora_equals_peft_at_tp2_and_tp1(qwen2):
    model, arch, state, batch = qwen2
    ranks = run_distributed(_tp2_worker, 2, arch, state, batch)
    result = (ranks[0][0], ranks[0][1], [r[2] for r in ranks], [r[3] for r in ranks], ranks[0][4], ranks[0][5])
    _check(arch, result, MegatronLayout(arch, tp=2), model, batch)


def test_peft_round_trip_at_tp2_is_exact(qwen2):
    _, arch, state, _ = qwen2
    trainer = _trainer(arch, state)
    with torch.no_grad():
        for p in trainer.gpt.parameters():
            if p.requires_grad:
                p.normal_()
    shards = [[trainer.checkpoint_state()]]
    peft_state = megatron_to_peft(shards, MegatronLayout(arch), TARGETS)
    layout = MegatronLayout(arch, tp=2)
    back = megatron_to_peft(peft_to_megatron(peft_state, layout, TARGETS), layout, TARGETS)
    assert set(back) == set(peft_state) and all(torch.equal(back[k], v) for k, v in peft_state.items())


# --- checkpoints and exports ----------------------------------------------------------------------------

@pytest.fixture
def lora_checkpoint(tmp_path, qwen2):
    """A LoRA trainer on a base saved as an HF directory, one step taken and checkpointed."""
    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.trainer.config import LoraConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    model, arch, state, batch = qwen2
    base = str(tmp_path / "base")
    save_hf(base, arch, state, None)
    config = TrainerConfig(lr=LR, vocab_divisible_by=1, micro_batch_size=2,
                           lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    trainer = load_policy(base, config)
    trainer.train_step(batch, _loss(batch))
    path = CheckpointManager(str(tmp_path / "run"), CheckpointConfig()).save(1, trainer, {"version": 1})
    return trainer, path, base, config


def test_checkpoint_holds_adapters_only_and_resumes_exactly(lora_checkpoint, qwen2, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointError, CheckpointManager
    from megatron_rl.trainer.config import LoraConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    trainer, path, base, config = lora_checkpoint
    _, arch, _, batch = qwen2
    saved = load_file(f"{path}/model/mp_rank_00_000/model.safetensors")
    assert saved and all(".adapter.lora_" in name for name in saved)  # no base weight copied
    manager = CheckpointManager(str(tmp_path / "run"), CheckpointConfig())
    resumed = load_policy(base, config)
    manager.load(manager.latest(), resumed)
    after = [t.train_step(batch, _loss(batch)) and t.checkpoint_state() for t in (trainer, resumed)]
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])  # the next step is bit-identical
    other = load_policy(base, TrainerConfig(lr=LR, vocab_divisible_by=1, micro_batch_size=2,
                                            lora=LoraConfig(rank=2 * RANK, alpha=ALPHA, targets=TARGETS)))
    with pytest.raises(CheckpointError, match="trainer.lora.rank"):
        manager.load(manager.latest(), other)
    full = load_policy(base, TrainerConfig(vocab_divisible_by=1, micro_batch_size=2))
    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        manager.load(manager.latest(), full)


def test_peft_export_and_merged_export_give_the_trained_model(lora_checkpoint, qwen2, tmp_path):
    import transformers

    from megatron_rl.checkpoints_tools.convert import convert
    from megatron_rl.config import ConfigError
    from megatron_rl.models.pretrained import load_pretrained

    trainer, path, base, _ = lora_checkpoint
    model, arch, state, batch = qwen2
    expected = trainer.compute_logits(batch)
    adapter = convert(path, str(tmp_path / "adapter"), to="peft")
    with torch.no_grad():
        tuned = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter)
        worst = (tuned(batch.tokens[:, :-1]).logits.float() - expected).abs().max().item()
    assert worst <= 1e-5, f"peft-loaded adapter: max |logit difference| {worst:.3g}"
    merged = convert(path, str(tmp_path / "merged"), to="hf", merge_lora=True)
    merged_state = load_pretrained(merged).state
    trained = trainer.export_hf_state()
    assert all(torch.equal(merged_state[k], trained[k]) for k in trained)  # the weights the engine gets
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(merged)
        assert (hf(batch.tokens[:, :-1]).logits.float() - expected).abs().max().item() <= 1e-5
    with pytest.raises(ConfigError, match="holds LoRA adapters"):
        load_pretrained(f"{path}/model")
    other = str(tmp_path / "other_base")
    from megatron_rl.checkpoints_tools.convert import save_hf
    save_hf(other, arch, {k: v + 1e-3 for k, v in state.items()}, None)
    with pytest.raises(ConfigError, match="not the model the adapters"):
        convert(path, str(tmp_path / "wrong"), to="hf", merge_lora=True, base=other)


def test_training_continues_from_an_exported_peft_adapter(lora_checkpoint, qwen2, tmp_path):
    """`trainer.lora.init_from` starts the adapters from a PEFT adapter (here the export of a run, at TP=1),
    whatever the layout: the same model; a config that does not match is refused by field."""
    from megatron_rl.checkpoints_tools.convert import convert
    from megatron_rl.config import ConfigError
    from megatron_rl.trainer.config import LoraConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    trainer, path, base, _ = lora_checkpoint
    _, _, _, batch = qwen2
    adapter = convert(path, str(tmp_path / "adapter"), to="peft")
    config = TrainerConfig(lr=LR, vocab_divisible_by=1, micro_batch_size=2,
                           lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS, init_from=adapter))
    continued = load_policy(base, config)
    assert all(torch.equal(v, trainer.checkpoint_state()[k]) for k, v in continued.checkpoint_state().items())
    assert torch.equal(continued.compute_logits(batch), trainer.compute_logits(batch))
    with pytest.raises(ConfigError, match="field 'r'"):
        load_policy(base, TrainerConfig(vocab_divisible_by=1, lora=LoraConfig(rank=2, alpha=ALPHA, init_from=adapter)))


def test_bench_lora_reports_adapter_state_and_sync_bytes(tiny_chat_model):
    """`megatron-rl bench lora` on a tiny model: the LoRA side trains the planner's adapter count, holds
    gradients and Adam state for those alone, and its adapters are that many float32 numbers."""
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.trainer.bench_lora import bench_lora

    arch = load_pretrained(tiny_chat_model, lazy=True).arch
    result = bench_lora({"model": tiny_chat_model, "batch": 2, "seq": 16, "steps": 1, "threads": 1, "rank": 4})
    adapters = lora_layer_parameters(arch, 4, tuple(TARGETS))[0] * arch.num_layers
    assert result["lora_trainable_params"] == adapters
    assert result["sync_adapter_bytes"] == 4 * adapters
    assert result["lora_optimizer_bytes"] == 2 * 4 * adapters  # Adam's m and v, float32
    assert result["full_optimizer_bytes"] == 2 * 4 * result["full_trainable_params"]
    assert result["sync_merged_bytes"] >= 4 * result["full_trainable_params"] - 4 * arch.vocab_size * arch.hidden_size
    assert result["ratio"] > 0


def _save_at_tp2_worker(rank, world_size, base, run_dir, batch):
    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.trainer.config import LoraConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    torch.set_num_threads(1)
    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=2), lr=LR, vocab_divisible_by=1,
                           micro_batch_size=2, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    trainer = load_policy(base, config)
    trainer.train_step(batch, _loss(batch))
    CheckpointManager(run_dir, CheckpointConfig()).save(1, trainer, {"version": 1})
    return trainer.gather_peft_state()


def test_lora_checkpoint_written_at_tp2_resumes_at_tp1(qwen2, tmp_path):
    """Adapters and their Adam moments are resharded through PEFT's unfused layout: the TP=1 run holds exactly
    the TP=2 run's adapters."""
    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.trainer.config import LoraConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    _, arch, state, batch = qwen2
    base = str(tmp_path / "base")
    save_hf(base, arch, state, None)
    run_dir = str(tmp_path / "run")
    written = run_distributed(_save_at_tp2_worker, 2, base, run_dir, batch)[0]
    trainer = load_policy(base, TrainerConfig(lr=LR, vocab_divisible_by=1, micro_batch_size=2,
                                              lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS)))
    manager = CheckpointManager(run_dir, CheckpointConfig())
    manager.load(manager.latest(), trainer)
    resumed = trainer.gather_peft_state()
    assert set(resumed) == set(written) and all(torch.equal(resumed[k], written[k]) for k in written)
    assert trainer.step_count == 1 and trainer.optimizer.state  # Adam's moments came along


def _moe_worker(rank, world_size, arch, state, batch, tp):
    torch.set_num_threads(1)
    from megatron_rl.trainer.config import LoraConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp), lr=LR, clip_grad=0.0, vocab_divisible_by=1,
                           micro_batch_size=2, moe_aux_loss_coeff=0.0,
                           lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    trainer = MegatronTrainer(arch, config, hf_state=state)
    trainer.train_step(batch, _loss(batch))
    return trainer.compute_logprobs(batch), trainer.gather_hf_state()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_lora_at_tp2_with_sequence_parallelism_equals_tp1(family):
    """Mixture of experts at TP=2 runs sequence-parallel attention and expert linears whose token dispatcher
    gathers inputs and sums outputs: with adapters on both (every expert's fc1 / fc2 included, and Qwen2-MoE's
    shared expert), one Adam step gives the same policy as at TP=1. (Adam's first step moves each B entry by lr
    times its gradient's sign, so the gradients must agree; float32 rounding of the two layouts leaves ~1e-6 in
    the log-probs.)"""
    from tests import moe_helpers

    _, arch, state, _ = moe_helpers.build(family)
    batch = _batch(arch.vocab_size)
    lp1, weights1 = _moe_worker(0, 1, arch, state, batch, 1)
    lp2, weights2 = run_distributed(_moe_worker, 2, arch, state, batch, 2)[0]
    worst = (lp2 - lp1)[batch.loss_mask != 0].abs().max().item()
    assert worst <= 1e-4, f"log-probs after one step differ by {worst:.3g}"
    from megatron_rl.models.megatron_layout import canonical_hf_state

    base = canonical_hf_state(state, arch)
    for weights in (weights1, weights2):
        moved = [k for k in weights if not torch.equal(weights[k], base[k])]
        assert any(".experts." in k for k in moved) and any("self_attn" in k for k in moved)
        assert any(".shared_expert." in k for k in moved) == (family == "qwen2_moe")
