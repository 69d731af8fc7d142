"""Checkpoints resume at another parallel layout: a run trained and checkpointed at one TP x PP x DP
layout, resumed at another, takes the same training steps (loss per step, to 1e-5) as the same run
continued uninterrupted at its own layout. Adam's moments and step count must survive the reshard for
that to hold: the steps after the resume use a learning rate that makes them matter (a fresh optimizer
gives visibly different losses, checked below).

Multi-process worlds over gloo on loopback (`run_distributed`); a tiny Llama whose vocabulary is padded
differently at TP=1 and TP=2, so the padding rows are resharded as well."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.checkpoint.manager import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    _file_record,
)
from megatron_rl.placement.launch import run_distributed
from megatron_rl.types import TrainBatch
from tests.helpers import assert_close_after_adam, fraction_beyond_rounding_after_adam, near_uniform_state

BEFORE, AFTER = 2, 3  # steps before the checkpoint, steps compared after it
LR = 3e-3
# Losses (~5.7): the forward rounds at a few FP32_EPS * 5.7 ~ 1e-6; an element Adam turned from rounding
# noise into an lr-sized update moves the loss only by its gradient (itself noise, <~2e-7) times that
# update (<= adam_noise_bound ~ 2e-2), and only ~1e-5 of the elements are such. Measured: 4e-7.
TOLERANCE = 1e-5
# The weights: every update after the resume is at most LR (the schedule's peak), from Adam step BEFORE + 1.
AFTER_LRS = [LR] * AFTER


def _arch():
    from megatron_rl.models.arch import preset

    # 300 tokens pad to 320 at TP=1 and 384 at TP=2 (vocab_divisible_by 64 x TP).
    return dataclasses.replace(preset("tiny"), vocab_size=300)


def _batch(arch, step, rows=8, length=20):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, arch.vocab_size, (rows, length), generator=generator)
    mask = torch.zeros(rows, length)
    for r in range(rows):
        mask[r, 5:5 + 3 + (r + step) % 9] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=mask)


def _trainer(arch, tp, pp, distributed_optimizer, precision="fp32"):
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    torch.set_num_threads(1)
    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), micro_batch_size=2,
                           lr=LR, clip_grad=1.0, vocab_divisible_by=64, lr_warmup_steps=2, lr_decay_steps=8,
                           lr_decay_style="cosine", weight_decay=0.01, precision=precision,
                           use_distributed_optimizer=distributed_optimizer)
    return MegatronTrainer(arch, config, hf_state=near_uniform_state(arch))


def _step(trainer, arch, step) -> float:
    batch = _batch(arch, step)
    normalizer = batch.loss_mask.sum()
    rows = batch.batch_size // trainer.dp_size
    dp_rank = trainer.pg.dp.rank()
    local = batch.select(slice(dp_rank * rows, (dp_rank + 1) * rows))

    def loss(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask).sum() / normalizer, {}

    return trainer.train_step(local, loss)["train/loss"]


def _train_and_save(arch, tp, pp, distributed_optimizer, run_dir, precision="fp32"):
    """Train BEFORE steps, checkpoint, then go on AFTER steps: the uninterrupted run's losses."""
    trainer = _trainer(arch, tp, pp, distributed_optimizer, precision)
    for step in range(BEFORE):
        _step(trainer, arch, step)
    CheckpointManager(run_dir, CheckpointConfig()).save(BEFORE, trainer, {"version": BEFORE})
    return _go_on(trainer, arch, BEFORE)


def _go_on(trainer, arch, start):
    """The AFTER steps' losses, then the weights they end with (HF names, gathered on rank 0)."""
    losses = [_step(trainer, arch, step) for step in range(start, start + AFTER)]
    return losses, trainer.gather_hf_state(dst=0)


def _resume(arch, tp, pp, distributed_optimizer, run_dir, precision="fp32"):
    """Load the latest checkpoint of `run_dir` at this layout and take the AFTER steps (or return the
    refusal's message)."""
    trainer = _trainer(arch, tp, pp, distributed_optimizer, precision)
    manager = CheckpointManager(run_dir, CheckpointConfig())
    try:
        state = manager.load(manager.latest(), trainer)
    except CheckpointError as exc:
        return str(exc)
    assert state["version"] == trainer.step_count == int(os.path.basename(manager.latest())[5:])
    return _go_on(trainer, arch, trainer.step_count)


def _world_of_two(rank, world, arch, root):
    """Every two-process part, in one world (each new trainer re-forms Megatron's groups), so that the
    processes start once: rank 0's results by name."""
    results = {"tp2": _train_and_save(arch, 2, 1, False, f"{root}/tp2")}
    results["tp2_again"] = _resume(arch, 2, 1, False, f"{root}/tp2")
    results["pp2"] = _resume(arch, 1, 2, False, f"{root}/tp2")
    results["zero1_dp2"] = _train_and_save(arch, 1, 1, True, f"{root}/zero1")
    results["zero1_to_tp2"] = _resume(arch, 2, 1, False, f"{root}/zero1")
    results["bf16_tp2"] = _train_and_save(arch, 2, 1, False, f"{root}/bf16", "bf16")
    results["bf16_again"] = _resume(arch, 2, 1, False, f"{root}/bf16", "bf16")
    results["legacy_at_tp2"] = _resume(arch, 2, 1, False, f"{root}/legacy")
    results["extra_at_tp2"] = _resume(arch, 2, 1, False, f"{root}/extra")
    return results


def _rewrite_manifest(checkpoint):
    manifest = {}
    for folder, _, files in os.walk(checkpoint):
        for file in files:
            if file not in (MANIFEST, "COMPLETE"):
                path = os.path.join(folder, file)
                manifest[os.path.relpath(path, checkpoint)] = _file_record(path)
    with open(os.path.join(checkpoint, MANIFEST), "w") as f:
        json.dump(manifest, f)


def _legacy_checkpoint(arch, run_dir):
    """A checkpoint as the writer before format 2 left it (per-rank optimizer state dicts, no
    optimizer_state/), and the losses of the run going on from it."""
    trainer = _trainer(arch, 1, 1, False)
    _step(trainer, arch, 0)
    path = CheckpointManager(run_dir, CheckpointConfig()).save(1, trainer, {"version": 1})
    shutil.rmtree(os.path.join(path, "optimizer_state"))
    torch.save({"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                "step_count": trainer.step_count}, os.path.join(path, "optimizer", "rank_00000.pt"))
    _rewrite_manifest(path)
    return _go_on(trainer, arch, 1)


def _checkpoint_with_an_extra_tensor(arch, run_dir):
    """A TP=1 checkpoint whose shard holds a tensor the HF <-> Megatron conversion does not know."""
    trainer = _trainer(arch, 1, 1, False)
    _step(trainer, arch, 0)
    path = CheckpointManager(run_dir, CheckpointConfig()).save(1, trainer, {"version": 1})
    shard = os.path.join(path, "model", "mp_rank_00_000", "model.safetensors")
    weights = load_file(shard)
    weights["mystery_head.weight"] = torch.zeros(1, arch.hidden_size)
    save_file(weights, shard)
    _rewrite_manifest(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The checkpoints and the uninterrupted runs' losses; world-of-one parts run in this process."""
    root = str(tmp_path_factory.mktemp("reshard"))
    arch = _arch()
    legacy = _legacy_checkpoint(arch, f"{root}/legacy")
    _checkpoint_with_an_extra_tensor(arch, f"{root}/extra")
    results = run_distributed(_world_of_two, 2, arch, root)[0]
    return arch, root, {**results, "legacy": legacy}


def _diff(resumed, reference):
    """The largest difference of a loss after the resume; the weights the steps end with must agree as
    well (more sensitive to each Adam moment than the loss: an update is about lr per weight), up to
    Adam's amplified rounding on noise-gradient elements (tests/helpers.py)."""
    assert isinstance(resumed, tuple), resumed  # not a refusal
    (losses, weights), (reference_losses, reference_weights) = resumed, reference
    assert_close_after_adam(weights, reference_weights, AFTER_LRS, first_step=BEFORE + 1)
    return max(abs(a - b) for a, b in zip(losses, reference_losses))


def test_tp2_checkpoint_resumes_at_tp1_with_the_same_losses(runs):
    arch, root, results = runs
    resumed = _resume(arch, 1, 1, False, f"{root}/tp2")
    assert _diff(resumed, results["tp2"]) < TOLERANCE, f"{resumed[0]} vs {results['tp2'][0]}"


def test_tp2_checkpoint_resumes_at_pp2_with_the_same_losses(runs):
    _, _, results = runs
    assert _diff(results["pp2"], results["tp2"]) < TOLERANCE, f"{results['pp2'][0]} vs {results['tp2'][0]}"


def test_same_layout_resume_is_bit_exact(runs):
    _, _, results = runs
    (losses, weights), (reference_losses, reference_weights) = results["tp2_again"], results["tp2"]
    assert losses == reference_losses
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference_weights.items())


def test_the_optimizer_state_is_what_makes_the_losses_match(runs):
    """The checkpoint's weights with a fresh optimizer and schedule: the comparisons above can fail."""
    from megatron_rl.models.megatron_layout import megatron_to_hf
    from megatron_rl.models.pretrained import load_megatron

    arch, root, results = runs
    trainer = _trainer(arch, 1, 1, False)
    layout, shards = load_megatron(os.path.join(CheckpointManager(f"{root}/tp2", CheckpointConfig()).latest(), "model"))
    trainer.load_hf_state(megatron_to_hf(shards, layout))
    fresh, fresh_weights = _go_on(trainer, arch, BEFORE)
    reference, reference_weights = results["tp2"]
    assert fresh[0] == pytest.approx(reference[0], abs=TOLERANCE)  # the same weights...
    assert max(abs(a - b) for a, b in zip(fresh, reference)) > 100 * TOLERANCE  # ...but not the same steps
    # ...and not the same weights: the fresh moments move far more than the noise-gradient fraction
    beyond = fraction_beyond_rounding_after_adam(fresh_weights, reference_weights, AFTER_LRS, first_step=BEFORE + 1)
    assert beyond > 0.1, beyond


def test_distributed_optimizer_dp2_resumes_at_dp1_and_at_tp2(runs):
    """ZeRO-1 over two data-parallel ranks: each held a slice of Adam's state; the checkpoint holds it
    whole, so one rank resumes it, and so do two TP ranks without the distributed optimizer."""
    arch, root, results = runs
    state = os.path.join(root, "zero1", "checkpoints", "step_00000002", "optimizer_state", "mp_rank_00_000",
                         "optimizer.safetensors")
    assert {k.split("/")[0] for k in load_file(state)} == {"exp_avg", "exp_avg_sq"}
    alone = _resume(arch, 1, 1, False, f"{root}/zero1")
    assert _diff(alone, results["zero1_dp2"]) < TOLERANCE, f"DP=1: {alone[0]} vs {results['zero1_dp2'][0]}"
    assert _diff(results["zero1_to_tp2"], results["zero1_dp2"]) < TOLERANCE


def test_bf16_master_weights_are_resharded(runs):
    """A bf16 model: the optimizer's fp32 master weights are stored (the bf16 weights round them) and
    come back at another layout as they were saved; at the same layout the resume is bit-exact."""
    from megatron_rl.checkpoint.reshard import MAIN_PARAM, _entries, _param_names
    from megatron_rl.models.megatron_layout import megatron_to_hf
    from megatron_rl.models.pretrained import read_megatron_layout

    arch, root, results = runs
    (losses, weights), (reference_losses, reference_weights) = results["bf16_again"], results["bf16_tp2"]
    assert losses == reference_losses and all(torch.equal(weights[n], t) for n, t in reference_weights.items())

    checkpoint = CheckpointManager(f"{root}/bf16", CheckpointConfig()).latest()
    saved = read_megatron_layout(os.path.join(checkpoint, "model"))
    masters = [[{k.split("/", 1)[1]: v for k, v in load_file(os.path.join(
        checkpoint, "optimizer_state", f"mp_rank_{t:02d}_000", "optimizer.safetensors")).items()
        if k.startswith(MAIN_PARAM + "/")} for t in range(2)]]
    saved_masters = megatron_to_hf(masters, saved)
    bf16_weights = megatron_to_hf([[load_file(os.path.join(checkpoint, "model", f"mp_rank_{t:02d}_000",
                                                           "model.safetensors")) for t in range(2)]], saved)
    assert saved_masters["model.norm.weight"].dtype == torch.float32
    assert any(not torch.equal(saved_masters[n], bf16_weights[n].float()) for n in saved_masters)  # finer than bf16

    trainer = _trainer(arch, 1, 1, False, "bf16")
    manager = CheckpointManager(f"{root}/bf16", CheckpointConfig())
    manager.load(manager.latest(), trainer)
    names = _param_names(trainer)
    loaded = megatron_to_hf([[{names[m]: main.detach().view(m.shape) for _, m, main, _ in _entries(trainer)}]],
                            trainer.layout)
    for name, tensor in saved_masters.items():
        assert torch.equal(loaded[name], tensor), name
    # bf16 arithmetic at TP=1 and TP=2 rounds differently: the steps agree to bf16 precision only. A token's
    # log-prob rounds at about a bf16 ulp (7.8e-3) of the logits' spread (<~1); the loss averages ~50 tokens'
    # independent roundings (/ sqrt(50)): ~1e-3, and 1e-2 leaves 10x for it.
    resumed = [_step(trainer, arch, step) for step in range(BEFORE, BEFORE + AFTER)]
    assert max(abs(a - b) for a, b in zip(resumed, reference_losses)) < 1e-2


def test_a_checkpoint_before_the_first_step_resumes_with_a_fresh_optimizer():
    """Nothing to restore (e.g. WaltzRL's conversation agent, frozen in stage 1): the optimizer stays as
    fresh as it was, so the steps after the resume are bit-identical to an uninterrupted run's."""
    import tempfile

    arch = _arch()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = _trainer(arch, 1, 1, False)
        CheckpointManager(run_dir, CheckpointConfig()).save(1, trainer, {"version": 0})
        reference = [_step(trainer, arch, step) for step in range(2)]
        resumed = _trainer(arch, 1, 1, False)
        manager = CheckpointManager(run_dir, CheckpointConfig())
        manager.load(manager.latest(), resumed)
        assert [_step(resumed, arch, step) for step in range(2)] == reference


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [((2, 2, True, 4), (1, 1, False, 1)), ((1, 2, True, 4), (2, 1, True, 4)),
                                            ((1, 1, True, 4), (2, 2, False, 4))],
                         ids=["tp2pp2-zero1-to-one-rank", "pp2dp2-zero1-to-tp2dp2-zero1", "dp4-zero1-to-tp2pp2"])
def test_bigger_layout_changes(tmp_path, saved, resumed):
    """TP x PP x DP all at once, with and without the distributed optimizer (4 processes)."""
    arch = _arch()
    run_dir = str(tmp_path / "run")
    reference = run_distributed(_spawned, saved[3], _train_and_save, arch, *saved[:3], run_dir)[0]
    losses = run_distributed(_spawned, resumed[3], _resume, arch, *resumed[:3], run_dir)[0]
    assert _diff(losses, reference) < TOLERANCE, f"{saved} -> {resumed}: {losses[0]} vs {reference[0]}"


def _spawned(rank, world, function, *args):
    return function(*args)


# --- what is refused ---------------------------------------------------------------------------------

def test_a_checkpoint_of_the_previous_format_loads_at_its_layout_and_is_refused_at_another(runs):
    arch, root, results = runs
    losses, weights = _resume(arch, 1, 1, False, f"{root}/legacy")
    assert losses == results["legacy"][0]  # bit-exact, as before
    assert all(torch.equal(weights[name], tensor) for name, tensor in results["legacy"][1].items())
    refusal = results["legacy_at_tp2"]
    assert "written at tensor_parallel=1, pipeline_parallel=1 by a version before format 2, which resumes only " \
           "at its own layout (this run has tensor_parallel=2, pipeline_parallel=1)" in refusal
    assert "\n" not in refusal


def test_another_model_at_another_layout_is_refused_in_one_line(runs):
    arch, root, _ = runs
    message = _resume(dataclasses.replace(arch, ffn_hidden_size=256), 1, 1, False, f"{root}/tp2")
    assert "the checkpoint was written for another model than this run's model.path (tensor " in message
    assert re.search(r"is \[64, 128\] there, \[64, 256\] in this run's model\)", message) and "\n" not in message


def test_a_tensor_without_a_reshard_rule_is_named(runs):
    """An extra tensor in a shard (one no trainer of ours writes) is not silently dropped by a reshard."""
    _, _, results = runs
    assert "tensor 'mystery_head.weight' has no rule to reshard it to another layout; resume at the checkpoint's " \
           "own layout (tensor_parallel=1, pipeline_parallel=1)" in results["extra_at_tp2"]


# --- the RL loop ---------------------------------------------------------------------------------------

def _rl_train(rank, world, model_path, run_dir, extra, resume):
    from megatron_rl.controller.loop import train
    from tests.test_loop import _config

    summary = train(_config(model_path, run_dir, *extra), resume=resume)
    return summary.final_metrics if summary is not None else None


def tp2_run_resumed_on_one_rank(tmp_path, model_path, *extra) -> tuple[dict, dict, str]:
    """Step 3's final metrics of an RL run at TP=2 (two gloo ranks) and of the same run stopped after step 2
    and resumed at TP=1 on one rank; and the resumed run's directory."""
    common = ["rollout.deterministic=true", "checkpoint.every_steps=1", "eval.before_training=false",
              "eval.after_training=false", *extra]
    straight = run_distributed(_rl_train, 2, model_path, str(tmp_path / "straight"),
                               [*common, "steps=3", "trainer.parallel.tensor_parallel=2"], False)[0]
    run_dir = str(tmp_path / "resumed")
    run_distributed(_rl_train, 2, model_path, run_dir, [*common, "steps=2", "trainer.parallel.tensor_parallel=2"], False)
    resumed = run_distributed(_rl_train, 1, model_path, run_dir, [*common, "steps=3"], True)[0]
    return straight, resumed, run_dir


@pytest.mark.slow
def test_an_rl_run_checkpointed_at_tp2_resumes_on_one_rank(tmp_path, tiny_chat_model):
    """`megatron-rl train` at TP=2, stopped after step 2 and relaunched with tensor_parallel=1 on one
    rank: step 3 trains as it does in the uninterrupted TP=2 run (the controller's resume path: data
    cursor, rollout buffer and weights for the engine come back as well)."""
    straight, resumed, run_dir = tp2_run_resumed_on_one_rank(tmp_path, tiny_chat_model)
    assert resumed["train/grad_norm"] > 0
    assert resumed["train/loss"] == pytest.approx(straight["train/loss"], rel=1e-4, abs=1e-6)
    assert resumed["train/grad_norm"] == pytest.approx(straight["train/grad_norm"], rel=1e-4)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]


def test_optimizer_state_of_another_optimizer_is_refused(tmp_path):
    """State kinds this run's optimizer does not keep (here: Adam without its second moment) are named,
    not loaded into the wrong slots."""
    from safetensors import safe_open

    arch = _arch()
    trainer = _trainer(arch, 1, 1, False)
    _step(trainer, arch, 0)
    path = CheckpointManager(str(tmp_path), CheckpointConfig()).save(1, trainer, {"version": 1})
    state_file = os.path.join(path, "optimizer_state", "mp_rank_00_000", "optimizer.safetensors")
    with safe_open(state_file, framework="pt") as f:
        meta = json.loads(f.metadata()["json"])
    tensors = {k: v for k, v in load_file(state_file).items() if k.startswith("exp_avg/")}
    save_file(tensors, state_file, metadata={"json": json.dumps({**meta, "kinds": ["exp_avg"]})})
    _rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors: the checkpoint holds optimizer state "
                                              r"\['exp_avg'\], this run's optimizer keeps \['exp_avg', "
                                              r"'exp_avg_sq'\] \(another optimizer\?\)"):
        CheckpointManager(str(tmp_path), CheckpointConfig()).load(path, _trainer(arch, 1, 1, False))
