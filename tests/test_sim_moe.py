"""Planner and cost model for mixture-of-experts layouts: parameter split against transformers' Qwen3-MoE and
Megatron's MoE GPTModel, memory terms by hand, expert-parallel rules and search, all-to-all time, the MoE
recipe's dry run (docs/moe.md, "Planning MoE layouts")."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.config import ConfigError, load_yaml
from megatron_rl.models.arch import ModelArch
from megatron_rl.run_config import RunConfig
from megatron_rl.sim import cost
from megatron_rl.sim.config import CostAssumptions, load_hardware
from megatron_rl.sim.planner import (
    LayoutError,
    best_expert_parallel,
    make_plan,
    search_expert_parallel,
)
from tests.test_sim import _measure_step_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "examples", "configs", "qwen3_30b_a3b.yaml")
GiB = 2**30

# vocab a multiple of 128 so Megatron's padding adds nothing; 8 experts, top-2
SMALL = {"vocab_size": 512, "num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
         "num_query_groups": 2, "head_dim": 16, "max_position_embeddings": 256, "num_experts": 8, "moe_top_k": 2,
         "moe_ffn_hidden_size": 32}


def _small_arch(**changes) -> ModelArch:
    return ModelArch(**SMALL, family="qwen3_moe", qk_norm=True, **changes)


def _hf_counts(mlp_only_layers: tuple[int, ...] = ()) -> tuple[int, int]:
    """(non-expert, expert) parameters of transformers' Qwen3-MoE of the SMALL shape, built on the meta device."""
    from transformers import (  # heavy: only this test needs it
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config = Qwen3MoeConfig(vocab_size=SMALL["vocab_size"], hidden_size=SMALL["hidden_size"],
                            intermediate_size=SMALL["ffn_hidden_size"], num_hidden_layers=SMALL["num_layers"],
                            num_attention_heads=SMALL["num_attention_heads"],
                            num_key_value_heads=SMALL["num_query_groups"], head_dim=SMALL["head_dim"],
                            num_experts=SMALL["num_experts"], num_experts_per_tok=SMALL["moe_top_k"],
                            moe_intermediate_size=SMALL["moe_ffn_hidden_size"], tie_word_embeddings=False,
                            mlp_only_layers=list(mlp_only_layers))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()) - experts, experts


def test_parameter_split_matches_transformers_qwen3_moe():
    arch = _small_arch()
    dense_hf, experts_hf = _hf_counts()
    assert cost.expert_parameters(arch) == experts_hf
    assert cost.stage_parameter_split(arch, 1, 1, 0, 128) == (dense_hf, experts_hf)
    assert arch.num_parameters() == dense_hf + experts_hf
    # one token multiplies by every dense weight and k of E experts per layer
    assert cost.active_parameters(arch) == pytest.approx(dense_hf + experts_hf * 2 / 8)
    # EP 4 x ETP 2: each GPU holds 2 of 8 experts, each split in two
    assert cost.stage_parameter_split(arch, 2, 1, 0, 128, ep=4)[1] == pytest.approx(experts_hf / 8)


def test_parameter_split_with_dense_layers_matches_transformers():
    """Qwen3-MoE with layers 0 and 2 dense (mlp_only_layers): only layer 1 holds experts."""
    arch = _small_arch(moe_layers=(1,))
    dense_hf, experts_hf = _hf_counts(mlp_only_layers=(0, 2))
    assert cost.expert_parameters(arch) == experts_hf == 8 * 3 * 64 * 32
    assert cost.stage_parameter_split(arch, 1, 1, 0, 128) == (dense_hf, experts_hf)
    assert arch.num_parameters() == dense_hf + experts_hf
    assert cost.active_parameters(arch) == pytest.approx(dense_hf + experts_hf * 2 / 8)


def test_parameter_split_matches_megatron_moe_model():
    """The planner's per-rank dense / expert split equals the numel of Megatron's MoE GPTModel."""
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    arch = _small_arch()
    gpt = MegatronTrainer(arch, TrainerConfig(vocab_divisible_by=128)).gpt
    experts = sum(p.numel() for n, p in gpt.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in gpt.parameters()) - experts
    assert cost.stage_parameter_split(arch, 1, 1, 0, 128) == (dense, experts)


def test_shared_expert_parameters_match_transformers_and_megatron_qwen2_moe():
    """Qwen2-MoE's gated shared expert is dense (split over TP, on every EP rank): the planner's split equals
    transformers' model and Megatron's, and the published Qwen1.5-MoE-A2.7B shape has its card's counts."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    arch = ModelArch(**SMALL, family="qwen2_moe", attention_bias=True, shared_expert_ffn_hidden_size=48,
                     shared_expert_gate=True)
    config = Qwen2MoeConfig(vocab_size=SMALL["vocab_size"], hidden_size=SMALL["hidden_size"],
                            intermediate_size=SMALL["ffn_hidden_size"], num_hidden_layers=SMALL["num_layers"],
                            num_attention_heads=SMALL["num_attention_heads"],
                            num_key_value_heads=SMALL["num_query_groups"], num_experts=SMALL["num_experts"],
                            num_experts_per_tok=SMALL["moe_top_k"], moe_intermediate_size=SMALL["moe_ffn_hidden_size"],
                            shared_expert_intermediate_size=48, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    experts_hf = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense_hf = sum(p.numel() for p in model.parameters()) - experts_hf
    assert cost.stage_parameter_split(arch, 1, 1, 0, 128) == (dense_hf, experts_hf)
    assert arch.num_parameters() == dense_hf + experts_hf
    gpt = MegatronTrainer(arch, TrainerConfig(vocab_divisible_by=128)).gpt
    experts = sum(p.numel() for n, p in gpt.named_parameters() if ".experts." in n)
    assert cost.stage_parameter_split(arch, 1, 1, 0, 128) == (sum(p.numel() for p in gpt.parameters()) - experts,
                                                              experts)
    published = ModelArch(vocab_size=151936, num_layers=24, hidden_size=2048, ffn_hidden_size=5632,
                          num_attention_heads=16, num_query_groups=16, max_position_embeddings=8192, num_experts=60,
                          moe_top_k=4, moe_ffn_hidden_size=1408, shared_expert_ffn_hidden_size=5632,
                          shared_expert_gate=True, family="qwen2_moe", attention_bias=True)
    # Qwen's model card: 14.3B parameters in total, 2.7B activated
    assert abs(published.num_parameters() / 1e9 - 14.3) < 0.05
    assert abs(cost.active_parameters(published) / 1e9 - 2.7) < 0.05


def test_qwen3_30b_a3b_shape_has_the_published_counts():
    from megatron_rl.models import families

    arch = families.from_json(os.path.join(REPO, "examples", "configs", "models", "qwen3-30b-a3b.json"))
    assert (arch.num_layers, arch.hidden_size, arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == \
        (48, 2048, 128, 8, 768)
    # Qwen's model card: 30.5B parameters in total, 3.3B activated
    assert abs(arch.num_parameters() / 1e9 - 30.5) < 0.05
    assert abs(cost.active_parameters(arch) / 1e9 - 3.3) < 0.06


def test_trainer_memory_terms_by_hand():
    arch = _small_arch()
    a = CostAssumptions(moe_imbalance=1.5)
    layout = cost.TrainerLayout(tp=2, pp=1, dp=8, micro_batch_size=2, micro_batches=4, seq_len=128, params_bytes=2,
                                recompute=False, ep=4)
    h, f, k, layers, tokens = 64, 32, 2, 3, 2 * 128
    experts_per_gpu = layers * (8 / 4) * 3 * h * f / 2          # 2 local experts per layer, split over ETP = TP = 2
    expert_dp = 2 * 8 // (2 * 4)                                 # trainer GPUs 16 / (ETP x EP x PP)
    terms = cost.trainer_memory(arch, layout, a)
    assert terms["expert_weights"] == pytest.approx(experts_per_gpu * 2)
    assert terms["expert_gradients"] == pytest.approx(experts_per_gpu * 4)
    assert terms["expert_optimizer"] == pytest.approx(experts_per_gpu * 12 / expert_dp)
    # routed copies on the busiest rank: 1.5 x k per token (split over TP by sequence parallelism), each
    # keeping its permuted input [h] and the expert MLP's 6 expert-width tensors over ETP, for every layer
    routed = 1.5 * k * (h + 6 * f / 2) / 2 * tokens * 2 * layers
    assert terms["routed_tokens"] == pytest.approx(routed)
    dense = cost.stage_parameter_split(arch, 2, 1, 0, 128)[0]
    assert terms["weights"] == pytest.approx(dense * 2) and terms["optimizer"] == pytest.approx(dense * 12 / 8)
    # doubling EP halves every expert term
    halved = cost.trainer_memory(arch, dataclasses.replace(layout, ep=8), a)
    for name in ("expert_weights", "expert_gradients"):
        assert halved[name] == pytest.approx(terms[name] / 2)
    # a dense model's terms are unchanged by the MoE machinery
    dense_arch = ModelArch(**{k: v for k, v in SMALL.items() if not k.startswith(("num_experts", "moe_"))})
    assert "expert_weights" not in cost.trainer_memory(dense_arch, dataclasses.replace(layout, ep=1), a)


def test_engine_holds_every_expert_and_decode_reads_only_routed_ones():
    arch = _small_arch()
    hw, a = load_hardware("h100"), CostAssumptions()
    memory = cost.engine_memory(arch, 2, "bf16", 4, 100, a)
    assert memory["expert_weights"] == pytest.approx(cost.expert_parameters(arch) * 2 / 2)
    assert memory["weights"] + memory["expert_weights"] == pytest.approx(arch.num_parameters() * 2 / 2)
    # one sequence routes to k=2 experts per layer: the step streams the dense weights and 2 of 8 experts
    one = cost.decode_step_seconds(arch, tp=1, precision="bf16", batch=1, context=0, hw=hw, assumptions=a,
                                   cuda_graphs=True)
    read = (arch.num_parameters() - cost.expert_parameters(arch) * 6 / 8) * 2
    fixed = arch.num_layers * a.kernel_overhead_us * 1e-6
    assert one == pytest.approx(read / (hw.hbm_tbps * 1e12 * a.hbm_efficiency) + fixed)
    # a large batch touches every expert: E (1 - (1 - k/E)^B)
    assert cost.experts_touched(arch, 1) == pytest.approx(2)
    assert cost.experts_touched(arch, 1000) == pytest.approx(8)


def test_alltoall_time_by_link_and_scaling():
    hw, a = load_hardware("h100"), CostAssumptions(alltoall_efficiency=0.5)
    nbytes = 64e6
    assert cost.alltoall_seconds(nbytes, 1, hw, a) == 0.0
    # EP 8 inside a node: 7 of 8 shares over NVLink
    intra = cost.alltoall_seconds(nbytes, 8, hw, a)
    assert intra == pytest.approx(hw.nvlink_latency_us * 1e-6 + 7 * nbytes / 8 / (hw.nvlink_gbps * 1e9) / 0.5)
    # EP 16: 8 peers on other nodes over InfiniBand bound the time
    inter = cost.alltoall_seconds(nbytes, 16, hw, a)
    assert inter == pytest.approx(hw.ib_latency_us * 1e-6 + 8 * nbytes / 16 / (hw.ib_gbps * 1e9) / 0.5)
    # ETP 2 spreads an EP group of 8 over two nodes
    assert cost.alltoall_seconds(nbytes, 8, hw, a, etp=2) == pytest.approx(
        hw.ib_latency_us * 1e-6 + 4 * nbytes / 8 / (hw.ib_gbps * 1e9) / 0.5)
    # bandwidth term is linear in the bytes
    twice = cost.alltoall_seconds(2 * nbytes, 8, hw, a)
    assert twice - hw.nvlink_latency_us * 1e-6 == pytest.approx(2 * (intra - hw.nvlink_latency_us * 1e-6))
    # a step's all-to-all: dispatch + combine, forward + backward (+ recompute), per micro-batch and layer
    arch = _small_arch()
    step = cost.train_alltoall_seconds(arch, pp=1, micro_batches=4, recompute=True, hw=hw, assumptions=a, ep=8,
                                       micro_batch_tokens=1000)
    per = cost.alltoall_seconds(1000 * 2 * 64 * 2 * a.moe_imbalance, 8, hw, a)
    assert step == pytest.approx(4 * 3 * 6 * per)


@pytest.mark.parametrize("overrides, field, text", [
    (["trainer.parallel.expert_parallel=3"], "trainer.parallel.expert_parallel", "does not divide the model's 128"),
    (["trainer.parallel.expert_parallel=32"], "trainer.parallel.expert_parallel", "ETP x EP x PP = 1 x 32 x 1"),
    (["trainer.parallel.expert_parallel=4"], "cluster", "With trainer.parallel.expert_parallel=8 the trainer fits"),
    # SGLang's block-fp8 MoE weights need whole 128-wide blocks of each expert's 768 columns per GPU
    (["cluster.generator.engine_tp=4", "cluster.generator.num_engines=4"], "cluster.generator.engine_tp",
     "leaves 192 of each expert's 768 columns per GPU"),
])
def test_expert_parallel_rules_name_the_field(overrides, field, text):
    with pytest.raises(LayoutError) as info:
        make_plan(load_yaml(RunConfig, RECIPE, overrides))
    assert info.value.field == field and text in str(info.value)


def test_expert_parallel_refused_for_dense_models():
    with pytest.raises(LayoutError, match="EP=2 needs a mixture-of-experts model"):
        make_plan(load_yaml(RunConfig, os.path.join(REPO, "examples", "configs", "llama3_8b.yaml"),
                            ["trainer.parallel.expert_parallel=2"]))


def test_search_picks_the_smallest_expert_parallel_that_fits():
    options = {o.ep: o for o in search_expert_parallel(load_yaml(RunConfig, RECIPE))}
    assert sorted(options) == [1, 2, 4, 8, 16]  # divisors of 128 that divide the 16 trainer GPUs
    for ep in (1, 2, 4):  # 29B expert parameters: their fp32 gradients alone overflow below EP 8
        assert options[ep].plan is None and "expert_" in options[ep].error
    best = best_expert_parallel(list(options.values()))
    assert best.ep == 8
    # EP 16 crosses nodes: less memory, slower all-to-all over InfiniBand
    assert sum(options[16].plan.trainer_memory.values()) < sum(best.plan.trainer_memory.values())
    assert options[16].plan.times["train_alltoall"] > best.plan.times["train_alltoall"]
    # with more memory per GPU (H200) a smaller EP fits and wins
    roomy = best_expert_parallel(search_expert_parallel(load_yaml(RunConfig, RECIPE, ["cluster.hardware=h200"])))
    assert 1 < roomy.ep < 8


def _dry_run(script: str) -> str:
    """`bash examples/SCRIPT --dry-run` outside Slurm: its output (the plan and the expert-parallel search)."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("SLURM_JOB_ID", None), env.pop("SLURM_JOB_NUM_NODES", None)
    result = subprocess.run(["bash", os.path.join(REPO, "examples", script), "--dry-run"],
                            check=False, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_recipe_dry_run_prints_expert_memory_and_step_time():
    out = _dry_run("run_qwen3_30b_a3b.sh")
    assert "experts: EP 8 x ETP 1 x expert-DP 2 (16 of 128 experts per GPU)" in out
    trainer_line = next(line for line in out.splitlines() if line.strip().startswith("trainer ") and "GiB" in line)
    for term in ("expert_weights", "expert_gradients", "expert_optimizer", "routed_tokens"):
        assert term in trainer_line
    generator_line = next(line for line in out.splitlines() if line.strip().startswith("generator ") and "GiB" in line)
    assert "expert_weights" in generator_line and "kv_cache" in generator_line
    assert "predicted step:" in out and "expert all-to-all" in out
    assert "EP   8: trainer" in out and "configured, best" in out


_MEMORY_ARCH = {"vocab_size": 4096, "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 704,
                "num_attention_heads": 8, "num_query_groups": 4, "max_position_embeddings": 512, "num_experts": 8,
                "moe_top_k": 2, "moe_ffn_hidden_size": 256, "family": "qwen3_moe", "qk_norm": True}


@pytest.mark.slow
def test_moe_memory_within_10_percent_of_measured_cpu_step():
    """Peak bytes of live tensors during a real Megatron MoE train step on CPU (sim/measure.py) vs the planner.
    Within 10%; leaving out the routed_tokens term would fall short by more than that."""
    from megatron_rl.placement.launch import run_distributed

    arch = ModelArch(**_MEMORY_ARCH)
    rows, seq, micro = 8, 256, 4
    measured = run_distributed(_measure_step_worker, 1, rows, seq, micro, _MEMORY_ARCH)[0]
    layout = cost.TrainerLayout(tp=1, pp=1, dp=1, micro_batch_size=micro, micro_batches=rows // micro, seq_len=seq,
                                params_bytes=4, distributed_optimizer=False)
    estimate = cost.trainer_memory(arch, layout, CostAssumptions(attention="flash"), on_gpu=False)  # CPU: SDPA
    assert abs(sum(estimate.values()) - measured["peak"]) / measured["peak"] < 0.10, (estimate, measured)
    assert (sum(estimate.values()) - estimate["routed_tokens"]) < 0.9 * measured["peak"]
    static = sum(v for k, v in estimate.items() if k in ("weights", "gradients", "optimizer", "expert_weights",
                                                         "expert_gradients", "expert_optimizer"))
    assert static <= measured["static"] < (static + estimate["activation_buffers"]) * 1.02


def test_glm4_5_recipe_dry_run_counts_its_dense_layers_and_shared_experts():
    """GLM-4.5 355B: 3 dense layers and 89 MoE layers of 160 experts (+ a shared one), priced per stage; the
    published total (355B with its multi-token-prediction layer, which is not kept: one MoE layer less)."""
    from megatron_rl.models.families import from_json

    arch = from_json(os.path.join(REPO, "examples", "configs", "models", "glm4.5-355b.json"))
    assert arch.moe_layer_indices == tuple(range(3, 92)) and arch.shared_expert_ffn_hidden_size == 1536
    assert cost.expert_parameters(arch) == 89 * 160 * 3 * 5120 * 1536
    assert 350e9 < arch.num_parameters() < 355e9 and 32e9 < cost.active_parameters(arch) < 35e9
    # stage 0 holds the 3 dense layers, so fewer expert parameters than the last stage
    first, last = (cost.stage_parameter_split(arch, 2, 4, s, ep=8)[1] for s in (0, 3))
    assert first == pytest.approx(last * 20 / 23)
    out = _dry_run("run_glm4_5_355b.sh")
    assert "experts: EP 8 x ETP 2 x expert-DP 1 (20 of 160 experts per GPU)" in out
    assert "configured, best" in out


def test_deepseek_v3_671b_counts_and_latent_cache():
    """DeepSeek-V3's published config: 671.0B parameters, 37.6B active (the published 671B / 37B), and a KV cache of
    kv_lora_rank + qk_rope_head_dim = 576 numbers per token and layer, against 2 x 128 heads x 192 = 49,152 for the
    same attention without the latent (85x)."""
    from megatron_rl.models.families import from_json

    arch = from_json(os.path.join(REPO, "examples", "configs", "models", "deepseek-v3.json"))
    assert arch.is_mla and arch.moe_layer_indices == tuple(range(3, 61))
    assert round(arch.num_parameters() / 1e9, 1) == 671.0 and round(cost.active_parameters(arch) / 1e9, 1) == 37.6
    assert cost.kv_bytes_per_sequence(arch, 1536, 2) == 1536 * 61 * 576 * 2


DEEPSEEK = os.path.join(REPO, "examples", "configs", "deepseek_v3_671b.yaml")


def test_pipeline_balance_by_hand():
    """The busiest stage paces 1F1B: an even split of a dense model puts the output layer on the last stage on top
    of its layers; DeepSeek-V3's 3 + 14 x 4 + 2 evens out what 61 layers over 16 stages allow."""
    from megatron_rl.models.families import from_json

    llama = from_json(os.path.join(REPO, "examples", "configs", "models", "llama3-8b.json"))
    layer, head = cost.dense_layer_parameters(llama, 1, 0), llama.vocab_size * llama.hidden_size
    assert cost.pipeline_balance(llama, 4) == pytest.approx((8 * layer + head) * 4 / (32 * layer + head))
    assert cost.pipeline_balance(llama, 1) == 1.0
    v3 = from_json(os.path.join(REPO, "examples", "configs", "models", "deepseek-v3.json"))
    assert [len(cost.stage_layers(v3, 16, s, (3, 2))) for s in range(16)] == [3] + [4] * 14 + [2]
    moe = cost.dense_layer_parameters(v3, 1, 3) + cost.expert_layer_parameters(v3, 1, 1, 3) * 8 / 256
    dense = cost.dense_layer_parameters(v3, 1, 0) + 0.0
    work = [3 * dense] + [4 * moe] * 14 + [2 * moe + v3.vocab_size * v3.hidden_size]
    assert cost.pipeline_balance(v3, 16, (3, 2)) == pytest.approx(max(work) * 16 / sum(work))
    with pytest.raises(ConfigError, match="pipeline_parallel=16 does not divide the model's 61 layers"):
        cost.stage_layers(v3, 16, 0)


def test_deepseek_v3_recipe_on_nemo_rl_layout_dry_run():
    """The 512-GPU one-step off-policy layout NeMo-RL publishes: the trainer's uneven 16 stages, 8 engines of TP 32
    (4 nodes each), and the predicted step with its terms."""
    out = _dry_run("run_deepseek_v3.sh")
    assert "TP 1 x PP 16 (layers per stage: 3, 14 x 4, 2) x DP 16" in out
    assert "experts: EP 16 x ETP 1 x expert-DP 1 (16 of 256 experts per GPU)" in out
    assert "generator: 8 engines x TP 32 = 256 GPUs, bf16, up to 64 sequences per engine" in out
    plan = make_plan(load_yaml(RunConfig, DEEPSEEK))
    assert plan.stage_layers == (3,) + (4,) * 14 + (2,)
    t = plan.times
    assert t["step"] == pytest.approx(max(t["generate"], t["train"]) + t["weight_sync"])  # one step off-policy
    on_policy = make_plan(load_yaml(RunConfig, DEEPSEEK, ["rollout.max_staleness=0"])).times
    assert on_policy["step"] == pytest.approx(t["generate"] + t["train"] + t["weight_sync"])


@pytest.mark.parametrize("overrides, field, text", [
    (["trainer.parallel.first_stage_layers=4"], "trainer.parallel.last_stage_layers",
     "leave 55 of the model's 61 layers for the other 14 stages"),
    (["trainer.parallel.first_stage_layers=null", "trainer.parallel.last_stage_layers=null"],
     "trainer.parallel.pipeline_parallel", "PP=16 does not divide the model's 61 layers"),
    (["cluster.generator.precision=fp8"], "cluster.generator.engine_tp",
     "leaves 64 of each expert's 2048 columns per GPU, not whole 128-wide fp8 blocks"),
    (["cluster.generator.backend=vllm"], "cluster.generator.engine_tp", "not vLLM"),
])
def test_deepseek_v3_layout_rules_name_the_field(overrides, field, text):
    with pytest.raises(LayoutError) as info:
        make_plan(load_yaml(RunConfig, DEEPSEEK, overrides))
    assert info.value.field == field and text in str(info.value)
