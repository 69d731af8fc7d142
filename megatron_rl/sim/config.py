"""Config of the cluster layout, the hardware, and the cost model's stated assumptions.

A cluster recipe (`examples/configs/llama3_*.yaml`) fills the `cluster:` section of the run config:
how many nodes, which accelerator, how the generator group is laid out (engine count, engine TP,
precision, backend), and every number the planner and the simulator assume (efficiencies, lengths,
latencies). Nothing here is fitted per model size: the same assumptions serve 8B, 70B and 405B.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

import yaml

from megatron_rl.config import RECIPE_PATH_FIELD, ConfigError, from_dict, require
from megatron_rl.rollout.config import GeneratorGroupConfig

HARDWARE_FILE = os.path.join(os.path.dirname(__file__), "hardware.yaml")


@dataclasses.dataclass(kw_only=True, frozen=True)
class HardwareSpec:
    """One accelerator's datasheet numbers (dense peaks; see sim/hardware.yaml)."""

    description: str = ""
    """Human-readable name."""
    bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float
    """Dense FP8 tensor-core peak, TFLOP/s."""
    hbm_gib: float
    """Device memory, GiB."""
    hbm_tbps: float
    """Device memory bandwidth, TB/s."""
    nvlink_gbps: float
    """Intra-node GPU-to-GPU bandwidth per GPU per direction, GB/s."""
    ib_gbps: float
    """Inter-node bandwidth per GPU per direction, GB/s."""
    gpus_per_node: int = 8
    """GPUs in one NVLink domain (node)."""
    nvlink_latency_us: float = 8.0
    """Latency of one small all-reduce inside a node, microseconds."""
    ib_latency_us: float = 25.0
    """Latency of one small all-reduce or point-to-point send across nodes, microseconds."""

    def __post_init__(self) -> None:
        for name in ("bf16_tflops", "fp8_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps", "ib_gbps"):
            require(getattr(self, name) > 0, name, "must be positive")

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30


def load_hardware(name: str, path: str | None = None) -> HardwareSpec:
    """The named accelerator from `path` (default: the hardware.yaml shipped with megatron_rl.sim)."""
    path = path or HARDWARE_FILE
    if not os.path.isfile(path):
        raise ConfigError(f"hardware file not found: {path}")
    with open(path, encoding="utf-8") as f:
        table = yaml.safe_load(f) or {}
    if name not in table:
        raise ConfigError(f"{path}: no accelerator named '{name}' (known: {', '.join(sorted(table))})")
    return from_dict(HardwareSpec, table[name])


@dataclasses.dataclass(kw_only=True)
class CostAssumptions:
    """Every number the cost model assumes beyond the datasheet and the layout. The same values serve
    all model sizes; change them per recipe only when the system really differs."""

    train_mfu: float = 0.40
    """Fraction of the BF16 peak a Megatron training step sustains (Llama 3 pre-training on H100
    reported 38-43%); FP8 training multiplies the peak by `fp8_train_speedup`."""
    fp8_train_speedup: float = 1.3
    """Step-time gain of TE FP8 training over BF16 at equal MFU accounting (GEMMs only get faster)."""
    hbm_efficiency: float = 0.80
    """Fraction of peak HBM bandwidth a decode step reaches when it streams weights and KV cache."""
    decode_flop_efficiency: float = 0.50
    """Fraction of the tensor-core peak a decode GEMM reaches once large batches make it compute-bound."""
    kernel_overhead_us: float = 4.0
    """Per transformer layer and decode step, the launch/scheduling cost with CUDA graphs (SGLang);
    engines without CUDA graphs pay `kernels_per_layer` launches of `launch_us` each instead."""
    kernels_per_layer: int = 12
    """Kernels one layer launches per decode step without CUDA graphs (norms, GEMMs, RoPE, attention)."""
    launch_us: float = 6.0
    """Host cost of one eager kernel launch, microseconds."""
    prompt_tokens: int = 512
    """Mean prompt length in tokens."""
    mean_response_fraction: float = 0.5
    """Mean response length as a fraction of rollout.max_new_tokens (the longest one runs to the max)."""
    memory_fraction: float = 0.90
    """Share of device memory the planner lets a rank use (the rest: CUDA context, NCCL, fragmentation)."""
    kv_cache_dtype_bytes: int = 2
    """Bytes per KV-cache element (2: BF16 KV cache even for FP8 weights)."""
    attention: Literal["flash", "unfused"] = "flash"
    """Attention kernel of the trainer: flash (TE / FlashAttention, and torch's SDPA that our local layer spec
    uses on CPU: no [s, s] scores kept) or unfused (Megatron's DotProductAttention: softmax probabilities
    [heads, s, s] kept for backward)."""
    pipeline_bubble: bool = True
    """Charge 1F1B's (PP - 1) / (micro-batches + PP - 1) pipeline bubble to training time."""
    sync_efficiency: float = 0.7
    """Fraction of link bandwidth a bucketed weight broadcast reaches."""
    moe_imbalance: float = 1.25
    """MoE: tokens the busiest expert rank receives over the mean (dropless routing with a load-balancing
    loss is never exactly even); scales routed-token memory, expert flops and all-to-all bytes."""
    alltoall_efficiency: float = 0.7
    """MoE: fraction of link bandwidth an expert-parallel all-to-all (dispatch / combine) reaches."""

    def __post_init__(self) -> None:
        for name in ("train_mfu", "hbm_efficiency", "decode_flop_efficiency", "memory_fraction", "sync_efficiency",
                     "alltoall_efficiency"):
            require(0 < getattr(self, name) <= 1, name, "must be in (0, 1]")
        require(self.moe_imbalance >= 1, "moe_imbalance", "must be >= 1 (the busiest rank gets at least the mean)")
        require(0 < self.mean_response_fraction <= 1, "mean_response_fraction", "must be in (0, 1]")
        require(self.prompt_tokens >= 1, "prompt_tokens", "must be >= 1")
        require(self.kv_cache_dtype_bytes in (1, 2, 4), "kv_cache_dtype_bytes", "must be 1, 2 or 4")


@dataclasses.dataclass(kw_only=True)
class ColocatedBaselineConfig:
    """The synchronous colocated system the simulator compares against (DeepSpeed-Chat-like): the
    trainer's own model generates in inference mode on the same GPUs, then trains."""

    generation_batch_per_engine: int = 64
    """Sequences one inference replica (one trainer model-parallel group, TP x PP GPUs) decodes at once:
    DeepSpeed-Chat's hybrid engine generates one experience batch per data-parallel rank at a time."""
    static_batching: bool = True
    """Each generation wave runs until its longest response ends (no continuous batching)."""
    cuda_graphs: bool = False
    """The hybrid engine decodes eagerly (every kernel launched from Python)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Generation runs on the trainer's bf16 weights."""

    def __post_init__(self) -> None:
        require(self.generation_batch_per_engine >= 1, "generation_batch_per_engine", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    """Where a run's ranks live on a cluster and what the planner assumes about them."""

    nodes: int = 1
    """Nodes in the job (Slurm --nodes)."""
    hardware: str = "h100"
    """Accelerator name in the hardware file (h100, h200)."""
    hardware_file: str = ""
    """YAML table of accelerators (empty: megatron_rl/sim/hardware.yaml)."""
    arch: str = dataclasses.field(default="", metadata={RECIPE_PATH_FIELD: True})
    """Model shape for planning: a preset name (llama3-8b, llama3-70b, llama3-405b, ...) or an HF
    config.json path. Empty: read model.path's config.json."""
    generator: GeneratorGroupConfig = dataclasses.field(default_factory=GeneratorGroupConfig)
    """Layout and precision of the generator group."""
    assumptions: CostAssumptions = dataclasses.field(default_factory=CostAssumptions)
    """Efficiencies, lengths and latencies the cost model assumes."""
    baseline: ColocatedBaselineConfig = dataclasses.field(default_factory=ColocatedBaselineConfig)
    """The colocated synchronous system `bench sim` compares against."""

    def __post_init__(self) -> None:
        require(self.nodes >= 1, "nodes", "must be >= 1")

    def hardware_spec(self) -> HardwareSpec:
        return load_hardware(self.hardware, self.hardware_file or None)
