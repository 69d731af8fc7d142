"""The RL loop on several trainer ranks (one torchrun-style world, gloo on loopback): the driver's
rollouts reach every rank, each trains on its data-parallel share, weights return to the engine, and
checkpoints hold every rank's files.

The data-parallel run is compared with a world of one on the same config: the trainer's loss hook is a
share of the global loss, so the two must end with the same weights (up to float summation order)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.placement.launch import run_distributed
from megatron_rl.trainer.parallel import free_port
from tests.helpers import assert_close_after_adam
from tests.test_loop import QUICKSTART, _config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(rank, world_size, model_path, run_dir, extra):
    from megatron_rl.controller.loop import train

    summary = train(_config(model_path, run_dir, *extra))
    return summary.final_metrics if summary is not None else None  # None: a generator rank


def _checkpoint(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    step = open(os.path.join(root, "latest")).read().strip()
    return os.path.join(root, step)


def _shard(checkpoint, tp_rank=0):
    return load_file(os.path.join(checkpoint, "model", f"mp_rank_{tp_rank:02d}_000", "model.safetensors"))


def test_data_parallel_run_matches_a_single_rank_run(tmp_path, tiny_chat_model):
    """Two DP ranks with the distributed optimizer (ZeRO-1), interrupted after step 1 and resumed from
    each rank's optimizer shard, end where one rank running straight through ends."""
    extra = ["rollout.deterministic=true", "steps=2", "checkpoint.every_steps=1"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    [alone] = run_distributed(_train, 1, tiny_chat_model, one, extra)
    sharded = [*extra, "trainer.use_distributed_optimizer=true"]
    run_distributed(_train, 2, tiny_chat_model, two, [*sharded, "steps=1"])
    metrics = run_distributed(_resume, 2, tiny_chat_model, two, sharded)
    # Adam would hide a mis-scaled gradient in the weights; the loss and gradient norm do not (and
    # step 2 only matches if each rank's Adam moments survived the resume).
    assert metrics[0]["train/loss"] == pytest.approx(alone["train/loss"], rel=1e-4, abs=1e-6)
    assert metrics[0]["train/grad_norm"] == pytest.approx(alone["train/grad_norm"], rel=1e-4)
    records = [json.loads(line) for line in open(os.path.join(two, "metrics.jsonl"))]
    assert [r["step"] for r in records if "rollout/reward_mean" in r] == [1, 2]  # the driver logs every step
    assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"])  # reduced over DP ranks
    assert "perf/reward_time" in metrics[0]  # the driver's rollout producer scored the groups
    assert {"timeline_rank0.json", "timeline_rank1.json"} <= set(os.listdir(two))

    single, parallel = _checkpoint(one), _checkpoint(two)
    assert sorted(os.listdir(os.path.join(parallel, "optimizer"))) == ["rank_00000.pt", "rank_00001.pt"]
    assert metrics[0]["train/grad_norm"] > 0  # the runs trained: not two untouched copies compared
    # Two Adam steps at trainer.lr=1e-3 (tests/test_loop.py): the DP split rounds the gradient sums
    # differently, which Adam turns into up to lr-sized updates on noise-gradient elements (tests/helpers.py).
    assert_close_after_adam(_shard(parallel), _shard(single), [1e-3] * 2)
    assert json.load(open(os.path.join(parallel, "state.json")))["step"] == 2


def test_tensor_parallel_async_run_syncs_the_engine_and_resumes(tmp_path, tiny_chat_model):
    """TP=2 trainer ranks write their shards into the generator process's arena (checksummed after
    every sync), generation runs one version ahead; a resumed multi-rank run continues the ledger."""
    run_dir = str(tmp_path / "tp2")
    extra = ["trainer.parallel.tensor_parallel=2", "rollout.placement=disaggregated", "rollout.max_staleness=1",
             "rollout.verify_weight_sync=true", "steps=2"]
    metrics = run_distributed(_train, 2, tiny_chat_model, run_dir, extra)
    assert metrics[0]["rollout/staleness_max"] <= 1
    checkpoint = _checkpoint(run_dir)
    assert {"mp_rank_00_000", "mp_rank_01_000"} <= set(os.listdir(os.path.join(checkpoint, "model")))

    resumed = run_distributed(_resume, 2, tiny_chat_model, run_dir, extra + ["steps=3"])
    assert resumed[0]["train/version"] == 3.0
    ledger = [json.loads(line) for line in open(os.path.join(run_dir, "prompts.jsonl"))]
    assert [r["step"] for r in ledger] == [1, 2, 3]
    consumed = [p for r in ledger for p in r["prompts"]]
    assert len(consumed) == len(set(consumed))  # no prompt trained twice across the resume

    # A new run from that Megatron checkpoint (TP=2, like the trainer): each trainer rank reads only its
    # own shard; the driver alone loads the whole model, for its engine.
    model = os.path.join(_checkpoint(run_dir), "model")
    loads = run_distributed(_train_counting_full_loads, 2, model, str(tmp_path / "from_megatron"),
                            ["trainer.parallel.tensor_parallel=2", "steps=1", "eval.before_training=false"])
    assert loads == [1, 0]


def _train_counting_full_loads(rank, world_size, model_path, run_dir, extra):
    """Train, counting how often this rank read a whole model (rather than its own shard)."""
    import megatron_rl.models.pretrained as pretrained

    loads = []
    real = pretrained.load_megatron
    pretrained.load_megatron = lambda path: loads.append(path) or real(path)
    _train(rank, world_size, model_path, run_dir, extra)
    return len(loads)


def _resume(rank, world_size, model_path, run_dir, extra):
    from megatron_rl.controller.loop import train

    return train(_config(model_path, run_dir, *extra), resume=True).final_metrics


def test_unsupported_multi_rank_features_fail_before_set_up(tiny_chat_model, tmp_path):
    from megatron_rl.config import ConfigError
    from megatron_rl.controller.loop import check_multi_rank_support

    config = _config(tiny_chat_model, str(tmp_path), "curriculum.kind=pcl")
    check_multi_rank_support(config, 1)
    with pytest.raises(ConfigError, match="curriculum.kind=pcl"):
        check_multi_rank_support(config, 4)


def _failing_generator_rank(rank, world_size, model_path, run_dir):
    from megatron_rl.placement.generator_ranks import (
        generator_rank_pool,
        join_launch,
        serve_generator_rank,
    )
    from megatron_rl.rollout.engine import GenerateRequest, SamplingParams

    config = _config(model_path, run_dir, "cluster.generator.launch_ranks=1")
    role = join_launch(config.trainer.parallel, 1)
    if role.role == "generator":
        serve_generator_rank(config, role)
        return "served"
    pool = generator_rank_pool(config)
    [rank_engine] = pool.engines
    futures = pool.submit([GenerateRequest(request_id="long", prompt_ids=[1, 2, 3],
                                           sampling=SamplingParams(max_new_tokens=400, temperature=1.0, seed=0))])
    try:  # a tensor the engine does not have makes the generator rank's weight handler fail
        rank_engine.update_weights({"model.no_such_weight": torch.zeros(2)}, version=1)
    except RuntimeError as exc:
        raised = str(exc)
    else:
        raised = ""
    return raised, repr(futures[0].exception(timeout=60))


def test_a_failing_generator_rank_fails_its_requests_instead_of_hanging(tmp_path, tiny_chat_model):
    driver, generator = run_distributed(_failing_generator_rank, 2, tiny_chat_model, str(tmp_path))
    raised, request_error = driver
    assert "generator failed" in raised and "model.no_such_weight" in raised
    assert "generator failed" in request_error
    assert generator == "served"  # the generator rank ended its service instead of hanging


def test_bad_generator_rank_layouts_are_named(tiny_chat_model, tmp_path, monkeypatch):
    from megatron_rl.config import ConfigError
    from megatron_rl.placement.generator_ranks import join_launch, trainer_world_size

    with pytest.raises(ConfigError, match="launch_ranks.*SGLang server urls"):
        _config(tiny_chat_model, str(tmp_path), "cluster.generator.launch_ranks=1",
                "cluster.generator.urls=[http://gen:30000]")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert trainer_world_size(1) == 1
    with pytest.raises(ConfigError, match="launch_ranks=2 leaves no trainer rank in a launch of 2 ranks"):
        trainer_world_size(2)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="needs a launch of several ranks"):
        join_launch(_config(tiny_chat_model, str(tmp_path)).trainer.parallel, 1)


def test_data_parallel_shares_partition_the_padded_batch():
    from megatron_rl.types import TrainBatch

    rows, width, micro, dp = 10, 6, 2, 2
    batch = TrainBatch(tokens=torch.arange(rows * width).view(rows, width) + 1, loss_mask=torch.ones(rows, width),
                       advantages=torch.randn(rows, width))
    padded = batch.padded_rows(micro * dp)
    assert padded.batch_size == 12 and not padded.loss_mask[rows:].any() and not padded.tokens[rows:].any()
    shares = [padded.data_parallel_share(r, dp, micro) for r in range(dp)]
    # micro-batch i -> rank i mod dp: rank 0 gets rows 0,1, 4,5, 8,9; rank 1 rows 2,3, 6,7, 10,11
    assert shares[0].tokens[:, 0].tolist() == [padded.tokens[r, 0].item() for r in (0, 1, 4, 5, 8, 9)]
    assert sorted(torch.cat([s.tokens[:, 0] for s in shares]).tolist()) == sorted(padded.tokens[:, 0].tolist())
    torch.testing.assert_close(shares[1].advantages[:2], batch.advantages[2:4])
    with pytest.raises(ValueError, match="does not split into micro-batches of 2 rows over 2"):
        batch.data_parallel_share(0, dp, micro)


def test_a_rank_whose_micro_batch_is_all_padding_trains_with_the_rest(tiny_arch):
    """Padding to micro-batches x DP ranks can leave a rank a micro-batch with no loss token."""
    from megatron_rl.algorithms.config import LossConfig
    from megatron_rl.algorithms.losses import make_loss_fn
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch

    trainer = MegatronTrainer(tiny_arch, TrainerConfig(micro_batch_size=2, lr=1e-3))
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 8))
    mask = torch.zeros(2, 8)
    mask[:, 4:] = 1
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=mask.clone(),
                       behaviour_logprobs=torch.zeros(2, 8)).padded_rows(4)
    config = LossConfig(name="aipo")
    metrics = trainer.train_step(batch, make_loss_fn(config, float(mask.sum())))
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert metrics["train/nonfinite"] == 0.0


def _train_jepo(rank, world_size, model_path, run_dir, data_path):
    from megatron_rl.controller.loop import train
    from tests.test_jepo import _loop_config

    summary = train(_loop_config(model_path, run_dir, data_path, "rollout.deterministic=true",
                                 "algorithm.loss.kl_coef=0.001", "checkpoint.save_at_end=true"))
    return summary.eval_before, summary.eval_after, summary.final_metrics


def test_jepo_with_likelihood_evaluation_on_two_data_parallel_ranks(tmp_path, tiny_chat_model):
    """JEPO keeps whole groups in a micro-batch, scores a* in the same forward, runs a frozen KL
    reference on the trainer ranks, and evaluates the held-out bound with every rank scoring: the
    data-parallel run ends where the single-rank run ends."""
    from tests.test_jepo import _references

    data = _references(tmp_path)
    [alone] = run_distributed(_train_jepo, 1, tiny_chat_model, str(tmp_path / "one"), data)
    both = run_distributed(_train_jepo, 2, tiny_chat_model, str(tmp_path / "two"), data)
    (before, after, metrics), (_, rank1_after, _) = both
    assert before["eval/nll_bound"] == pytest.approx(alone[0]["eval/nll_bound"], rel=1e-6)
    assert after["eval/nll_bound"] == pytest.approx(alone[1]["eval/nll_bound"], rel=1e-4)
    assert after["eval/nll_bound"] != pytest.approx(before["eval/nll_bound"], rel=1e-6)  # it trained
    assert rank1_after == {}  # only the driver reports
    assert metrics["train/grad_norm"] == pytest.approx(alone[2]["train/grad_norm"], rel=1e-4)
    # two Adam steps at trainer.lr=1e-3: see test_data_parallel_run_matches_a_single_rank_run
    assert_close_after_adam(_shard(_checkpoint(str(tmp_path / "two"))), _shard(_checkpoint(str(tmp_path / "one"))),
                            [1e-3] * 2)


def _save_with_failing_rank(rank, world_size, arch, root):
    import megatron_rl.checkpoint.manager as manager_module
    from megatron_rl.checkpoint.config import CheckpointConfig
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    trainer = MegatronTrainer(arch, TrainerConfig())
    manager = CheckpointManager(root, CheckpointConfig(keep_last=3))
    manager.save(1, trainer, {"version": 1})
    real_save = manager_module.torch.save

    def failing_save(obj, path, *args, **kwargs):  # rank 1 only: its optimizer file hits a full disk
        if rank == 1 and "step_00000002" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    manager_module.torch.save = failing_save
    try:
        manager.save(2, trainer, {"version": 2})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_rank_failing_its_checkpoint_files_fails_the_save_on_every_rank(tmp_path, tiny_arch):
    root = str(tmp_path / "run")
    outcomes = run_distributed(_save_with_failing_rank, 2, tiny_arch, root)
    assert outcomes[1] == "OSError: [Errno 28] No space left on device"
    assert outcomes[0].startswith("CheckpointError") and "another rank failed" in outcomes[0]
    checkpoints = os.path.join(root, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == ["latest", "step_00000001"]  # no step 2, no .tmp left
    assert open(os.path.join(checkpoints, "latest")).read().strip() == "step_00000001"


def test_generator_ranks_of_a_torchrun_launch_serve_the_trainer_ranks(tmp_path, tiny_chat_model):
    """`torchrun` of four ranks: two TP trainer ranks, two generator ranks fed over torch.distributed.
    On-policy (max_staleness 0), so the trainer's log-probs equal the generators' behaviour log-probs
    only if every broadcast weight sync reached both generators (lr 1e-3 moves the weights far). Real
    torchrun, not the test launcher: its agent store changes how every rendezvous inside it behaves."""
    run_dir = str(tmp_path / "ranks")
    test_config = [f"model.path={tiny_chat_model}", f"run_dir={run_dir}", "steps=3", "rollout.prompts_per_step=4",
                   "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4",
                   "trainer.lr=1e-3", "data.train.size=64", "data.heldout_size=4", "eval.max_new_tokens=8",
                   "engine.max_batch_size=8", "checkpoint.every_steps=1", "logging.wandb=disabled",
                   "logging.plots=false", "rollout.drop_uninformative_groups=false",
                   "reward.name=tests.test_loop:vowel_fraction"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
              "-m", "megatron_rl.cli", "train", QUICKSTART, *test_config, "cluster.generator.launch_ranks=2",
              "trainer.parallel.tensor_parallel=2", f"cluster.generator.weight_update_group_port={free_port()}"]
    done = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = [r for r in steps if "train/logprob_mismatch" in r][-1]
    assert last["step"] == 3 and last["train/grad_norm"] > 0
    assert last["train/logprob_mismatch"] < 1e-4
    checkpoint = _checkpoint(run_dir)
    assert {"mp_rank_00_000", "mp_rank_01_000"} <= set(os.listdir(os.path.join(checkpoint, "model")))
    # Two trainer ranks write timelines; the generator ranks run no training loop.
    assert {f for f in os.listdir(run_dir) if f.startswith("timeline")} == {"timeline_rank0.json", "timeline_rank1.json"}
