"""`python -m megatron_rl.cli.launch_env RECIPE [overrides]`: the planned layout as shell assignments,
for examples/slurm_common.sh (which node runs what, and the SGLang server flags that make each engine
what the planner priced; vLLM's when `cluster.generator.backend: vllm`). Validates through the planner first."""
from __future__ import annotations

import shlex
import sys

from megatron_rl.config import ConfigError
from megatron_rl.models.lora_layout import peft_target_modules
from megatron_rl.rollout.vllm_transfer import weight_transfer_config
from megatron_rl.run_config import load_run_config
from megatron_rl.sim.planner import make_plan


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load_run_config(argv[0], argv[1:])
        plan = make_plan(config)
        weight_transfer = cluster_weight_transfer(config.cluster.generator.vllm_weight_transfer)
    except ConfigError as exc:
        print(f"echo {shlex.quote(f'launch_env: {exc}')} >&2; exit 2")
        return 2
    per_node = plan.hardware.gpus_per_node
    gen = config.cluster.generator
    values = {
        "GPUS_PER_NODE": per_node,
        "TRAINER_NODES": plan.trainer_gpus // per_node,
        "GENERATOR_NODES": plan.generator_gpus // per_node,
        "ENGINES_PER_NODE": max(1, per_node // plan.engine_tp) if plan.placement == "disaggregated" else 0,
        "NODES_PER_ENGINE": max(1, plan.engine_tp // per_node),  # > 1: one SGLang server over several nodes
        "ENGINE_TP": plan.engine_tp,
        "ENGINE_PRECISION": plan.engine_precision,
        "PLACEMENT": plan.placement,
        "ENGINE_BACKEND": gen.backend if gen.backend == "vllm" else "sglang",
        "ENGINE_SERVER_ARGS": shlex.join(vllm_server_args(
            plan.engine_tp, plan.engine_precision, gen.max_running_requests, gen.cuda_graphs,
            gpu_memory_utilization=engine_memory_fraction(plan), seed=config.seed, extra=gen.vllm_args,
            weight_transfer=weight_transfer)
            if gen.backend == "vllm" else sglang_server_args(
            plan.engine_tp, plan.engine_precision, gen.max_running_requests, gen.cuda_graphs,
            mem_fraction_static=engine_memory_fraction(plan), deterministic=config.rollout.deterministic,
            record_routing=config.records_routing,
            lora=(config.trainer.lora.rank, config.trainer.lora.targets)
            if config.rollout.weight_sync == "adapters" else None)),
    }
    print("\n".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items()))
    return 0


def sglang_server_args(engine_tp: int, precision: str, max_running_requests: int, cuda_graphs: bool, *,
                       mem_fraction_static: float | None = None, deterministic: bool = False,
                       record_routing: bool = False, lora: tuple[int, list[str]] | None = None) -> list[str]:
    """`sglang.launch_server` flags (SGLang 0.5.23's names, checked by tests/test_sglang_contract.py) for
    one engine of the plan: its TP size, fp8 weights, the continuous batch and CUDA-graph setting the
    planner's generation time assumes, the memory share its memory check allowed, deterministic
    sampling when the run asks for reproducible rollouts (per-request sampling_seed is ignored without
    it), MoE routing records when the run records or replays routing, LoRA (`lora`: rank and trainer.lora.targets)
    when the run syncs adapters (`rollout.weight_sync: adapters`, loaded through /load_lora_adapter), and weight
    version 0 for the checkpoint it loads (SGLang's default label is "default")."""
    args = ["--tp-size", str(engine_tp), "--max-running-requests", str(max_running_requests)]
    if precision == "fp8":
        args += ["--quantization", "fp8"]
    if not cuda_graphs:
        args.append("--disable-cuda-graph")
    if mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{mem_fraction_static:g}"]
    if deterministic:
        args.append("--enable-deterministic-inference")
    if record_routing:
        args.append("--enable-return-routed-experts")
    if lora is not None:
        rank, targets = lora
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *peft_target_modules(targets)]
    args += ["--weight-version", "0"]
    return args


def cluster_weight_transfer(setting: str) -> str:
    """`cluster.generator.vllm_weight_transfer` for servers on generator nodes: auto is nccl (a GPU cluster);
    reload and ipc are refused by name (the trainer's tmpfs and GPU memory, which another node does not see)."""
    if setting in ("reload", "ipc"):
        why = "reads the weights from the trainer's tmpfs" if setting == "reload" else "maps the trainer's GPU memory"
        raise ConfigError(f"cluster.generator.vllm_weight_transfer: {setting} {why}, which vLLM servers on generator "
                          "nodes cannot see; use nccl (or auto) on a cluster", field="cluster.generator.vllm_weight_transfer")
    return "nccl" if setting == "auto" else setting


def vllm_server_args(engine_tp: int, precision: str, max_running_requests: int, cuda_graphs: bool, *,
                     gpu_memory_utilization: float | None = None, seed: int = 0, extra: list[str] = (),
                     weight_transfer: str = "nccl") -> list[str]:
    """`vllm.entrypoints.openai.api_server` flags (vLLM 0.32's names) for one engine of the plan: TP size, the
    continuous batch, online fp8 quantization, eager mode where CUDA graphs are off, the GPU share the memory
    check allowed, the run's seed, the token-in / token-out route the run generates through
    (rollout/vllm_engine.py), and the weight-transfer backend the trainer sends weights through
    (rollout/vllm_transfer.py); the launcher sets VLLM_SERVER_DEV_MODE=1 for the RL routes."""
    args = ["--tensor-parallel-size", str(engine_tp), "--max-num-seqs", str(max_running_requests),
            "--seed", str(seed), "--enable-scale-out", *weight_transfer_config(weight_transfer)]
    if precision == "fp8":
        args += ["--quantization", "fp8"]
    if not cuda_graphs:
        args.append("--enforce-eager")
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    return args + list(extra)


def engine_memory_fraction(plan) -> float:
    """SGLang's mem_fraction_static (weights + KV pool, as a share of the GPU) for a generator engine:
    the share the planner's memory check gave it (cluster.assumptions.memory_fraction), so the KV pool
    holds at least the planned max_running_requests sequences at full length."""
    return round(plan.usable_bytes / plan.hardware.hbm_bytes, 3)


if __name__ == "__main__":
    sys.exit(main())
