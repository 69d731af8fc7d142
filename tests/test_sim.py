"""Planner, cost model and simulator: layout rules, memory against a measured CPU trainer step, the
Slurm scripts' dry run, and the LlamaRL speed-up table."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.config import ConfigError, load_yaml
from megatron_rl.run_config import RunConfig
from megatron_rl.sim import cost
from megatron_rl.sim.config import CostAssumptions, load_hardware
from megatron_rl.sim.planner import LayoutError, make_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_405B = os.path.join(REPO, "examples", "configs", "llama3_405b.yaml")


def _script(name, *args):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("SLURM_JOB_ID", None), env.pop("SLURM_JOB_NUM_NODES", None)
    return subprocess.run(["bash", os.path.join(REPO, "examples", name), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_run_405b_dry_run_prints_layout_memory_and_step_time():
    result = _script("run_405b.sh", "--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "trainer: 448 GPUs = TP 8 x PP 14 x DP 4" in out
    assert "generator: 56 engines x TP 8 = 448 GPUs, fp8" in out
    assert "memory per GPU" in out and "optimizer" in out and "kv_cache" in out
    assert "predicted step:" in out


def test_impossible_layout_fails_dry_run_naming_the_overflowing_term():
    # Without the distributed optimizer every DP rank keeps full Adam states: 12 B per local parameter.
    result = _script("run_405b.sh", "--dry-run", "trainer.use_distributed_optimizer=false")
    assert result.returncode != 0
    assert "'optimizer' overflows" in result.stderr and "use_distributed_optimizer" in result.stderr
    result = _script("run_405b.sh", "--dry-run", "trainer.parallel.pipeline_parallel=16")
    assert result.returncode != 0
    assert "PP=16 does not divide the model's 126 layers" in result.stderr


@pytest.mark.parametrize("overrides, field, text", [
    (["cluster.generator.engine_tp=1", "cluster.generator.num_engines=448"], "cluster",
     "generator GPU needs"),                                     # 405 GB of fp8 weights on one GPU
    (["trainer.parallel.tensor_parallel=16"], "trainer.parallel.tensor_parallel", "exceeds the model's 8 KV heads"),
    (["cluster.generator.num_engines=112"], "cluster.generator.num_engines", "leave none"),
    (["cluster.generator.num_engines=3", "cluster.generator.engine_tp=4"], "cluster.generator.num_engines",
     "whole nodes"),
    (["rollout.prompts_per_step=1", "rollout.samples_per_prompt=6"], "trainer.micro_batch_size",
     "do not split into DP=4"),
    (["trainer.recompute_activations=false"], "cluster", "'activations' overflows"),
])
def test_layout_rules_name_the_field(overrides, field, text):
    with pytest.raises(LayoutError) as info:
        make_plan(load_yaml(RunConfig, RECIPE_405B, overrides))
    assert info.value.field == field and text in str(info.value)


def test_a_token_budget_plans_like_the_rows_that_fill_it():
    """trainer.max_tokens_per_micro_batch: the planner takes the worst case, every row at full length, so a
    budget of two full rows plans the memory and micro-batches of micro_batch_size 2 (seq_len 2,560 here)."""
    rows = make_plan(load_yaml(RunConfig, RECIPE_405B, ["trainer.micro_batch_size=2"]))
    budget = make_plan(load_yaml(RunConfig, RECIPE_405B, ["trainer.sequence_packing=true",
                                                          f"trainer.max_tokens_per_micro_batch={2 * rows.seq_len + 7}"]))
    assert budget.micro_batches == rows.micro_batches
    assert budget.trainer_memory == rows.trainer_memory


def test_recipes_model_shapes_match_presets():
    from megatron_rl.models import families
    from megatron_rl.models.arch import preset

    for size in ("8b", "70b", "405b"):
        path = os.path.join(REPO, "examples", "configs", "models", f"llama3-{size}.json")
        assert families.from_json(path) == preset(f"llama3-{size}")
    assert abs(preset("llama3-405b").num_parameters() / 1e9 - 405.9) < 0.5  # Llama 3.1 405B's published count
    assert abs(preset("llama3-70b").num_parameters() / 1e9 - 70.6) < 0.1
    assert abs(preset("llama3-8b").num_parameters() / 1e9 - 8.03) < 0.01


def test_decode_step_is_weight_streaming_plus_per_layer_costs():
    from megatron_rl.models.arch import preset

    hw, a = load_hardware("h100"), CostAssumptions()
    model = preset("llama3-70b")
    step = cost.decode_step_seconds(model, tp=8, precision="fp8", batch=1, context=0, hw=hw, assumptions=a,
                                    cuda_graphs=True)
    by_hand = (model.num_parameters() / 8 / (hw.hbm_tbps * 1e12 * a.hbm_efficiency)
               + model.num_layers * (a.kernel_overhead_us * 1e-6 + 2 * (hw.nvlink_latency_us * 1e-6
                                                                        + 2 * 7 / 8 * model.hidden_size * 2 / (hw.nvlink_gbps * 1e9))))
    assert step == pytest.approx(by_hand, rel=1e-9)
    # bf16 streams twice the bytes; a pipeline of 2 stages runs them one after another (no gain per token).
    bf16 = cost.decode_step_seconds(model, tp=8, precision="bf16", batch=1, context=0, hw=hw, assumptions=a,
                                    cuda_graphs=True)
    assert bf16 - step == pytest.approx(model.num_parameters() / 8 / (hw.hbm_tbps * 1e12 * a.hbm_efficiency))
    pp2 = cost.decode_step_seconds(model, tp=4, pp=2, precision="bf16", batch=1, context=0, hw=hw, assumptions=a,
                                   cuda_graphs=True)
    assert pp2 > bf16


def test_stage_parameters_match_megatron_model():
    """The planner's parameter count per rank equals the numel of a real Megatron GPTModel."""
    from megatron_rl.models.arch import preset
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    arch = preset("tiny")
    trainer = MegatronTrainer(arch, TrainerConfig(vocab_divisible_by=128))
    real = sum(p.numel() for p in trainer.gpt.parameters())
    assert cost.stage_parameters(arch, 1, 1, 0, 128) == real


_MEMORY_ARCH = dict(vocab_size=4096, num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                    num_query_groups=4, max_position_embeddings=512)


def _measure_step_worker(rank, world_size, rows, seq, micro, arch_fields=None):
    """In a fresh process, so that only this trainer's tensors are alive (not other tests' fixtures); the
    arch is `_MEMORY_ARCH` or `arch_fields` (tests/test_sim_moe.py measures an MoE one)."""
    from megatron_rl.models.arch import ModelArch
    from megatron_rl.sim.measure import measure_peak
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch

    torch.manual_seed(0)
    arch = ModelArch(**(arch_fields or _MEMORY_ARCH))
    trainer = MegatronTrainer(arch, TrainerConfig(micro_batch_size=micro, lr=1e-4, precision="fp32"))
    batch = TrainBatch(tokens=torch.randint(0, arch.vocab_size, (rows, seq + 1)), loss_mask=torch.ones(rows, seq + 1))

    def loss_fn(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask).sum() / batch.loss_mask.sum(), {}

    trainer.train_step(batch, loss_fn)  # the first step creates Adam's states; measure a steady-state step
    return measure_peak(lambda: trainer.train_step(batch, loss_fn))


def test_planner_memory_within_15_percent_of_measured_cpu_step():
    """Peak bytes of live tensors during a real Megatron train step on CPU (sim/measure.py: storages alive
    before the step + the running maximum of new storages during it) vs the planner's estimate."""
    from megatron_rl.models.arch import ModelArch
    from megatron_rl.placement.launch import run_distributed

    arch = ModelArch(**_MEMORY_ARCH)
    rows, seq, micro = 8, 256, 4
    measured = run_distributed(_measure_step_worker, 1, rows, seq, micro)[0]
    layout = cost.TrainerLayout(tp=1, pp=1, dp=1, micro_batch_size=micro, micro_batches=rows // micro, seq_len=seq,
                                params_bytes=4, distributed_optimizer=False)
    estimate = cost.trainer_memory(arch, layout, CostAssumptions(attention="flash"), on_gpu=False)  # CPU: SDPA
    total = sum(estimate.values())
    assert abs(total - measured["peak"]) / measured["peak"] < 0.15, (estimate, measured)
    # what stays allocated between steps: weights + fp32 grads + Adam m, v, plus small tables (RoPE, masks)
    static = estimate["weights"] + estimate["gradients"] + estimate["optimizer"]
    assert static <= measured["static"] < (static + estimate["activation_buffers"]) * 1.02
    # and activations are a real share of the peak, so the check is not just of the static terms
    assert measured["peak_delta"] > 0.4 * measured["peak"]


def test_live_tensor_bytes_tracks_allocations_and_frees():
    from megatron_rl.sim.measure import LiveTensorBytes

    keep = torch.zeros(10)
    with LiveTensorBytes({keep.untyped_storage().data_ptr(): 40}) as tracker:
        a = torch.empty(1000, dtype=torch.float32)      # 4000 B
        b = a[:10] * 2                                   # 40 B
        del a
        c = torch.empty(500, dtype=torch.float64)       # 4000 B, after a was freed
        keep.add_(1)                                     # in place on a pre-existing tensor: no new bytes
        assert tracker.current == 4040
    assert tracker.peak == 4040 and b.numel() == 10 and c.numel() == 500


def test_bench_sim_speedups_within_20_percent_of_paper():
    from megatron_rl.sim.simulate import bench_sim

    result = bench_sim({})
    for size, paper in (("8b", 2.52), ("70b", 3.98), ("405b", 10.7)):
        assert result[size]["paper"] == paper
        assert abs(result[size]["speedup"] - paper) / paper < 0.20, result[size]
    # the gain grows with model size, as the paper reports
    assert result["8b"]["speedup"] < result["70b"]["speedup"] < result["405b"]["speedup"]


def test_colocated_async_order_on_every_recipe():
    """Generation overlapping training can never be slower than the same work in sequence."""
    from megatron_rl.sim.simulate import simulate_recipe

    sim = simulate_recipe(RECIPE_405B, ["rollout.max_staleness=0"])
    t = sim["async"].times
    assert t["step"] == pytest.approx(t["generate"] + t["train"] + t["weight_sync"])
    overlapped = simulate_recipe(RECIPE_405B)["async"].times
    assert overlapped["step"] == pytest.approx(max(t["generate"], t["train"]) + t["weight_sync"])


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(ConfigError, match="no accelerator named 'h1000'"):
        make_plan(load_yaml(RunConfig, RECIPE_405B, ["cluster.hardware=h1000"]))


def test_train_refuses_on_several_ranks_what_the_multi_rank_loop_cannot_drive(monkeypatch, capsys):
    from megatron_rl.cli import main

    monkeypatch.setenv("WORLD_SIZE", "16")
    assert main(["train", os.path.join(REPO, "examples", "configs", "pcl_arith.yaml")]) == 2
    err = capsys.readouterr().err
    assert "this run has 16 trainer ranks" in err and "curriculum.kind=pcl" in err