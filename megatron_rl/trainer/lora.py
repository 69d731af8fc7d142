"""LoRA adapters on Megatron-core's tensor-parallel linears (`trainer.lora`, docs/lora.md).

Each targeted linear W gets y = W x + (alpha / r) * B A dropout(x) (Hu et al. 2021, eq. 3; the order of
operations and the names `lora_A` [r, in], `lora_B` [out, r] are PEFT's). The base weights are frozen: only
A and B get gradients, gradient buffers and optimizer state.

Tensor parallelism: the factor that meets W's sharded dimension is sharded with it, the other is replicated.
- Column-parallel linears (linear_qkv, linear_fc1: W's rows split over TP): B [out/TP, r] is split exactly like
  W's rows, so B's rows follow the fused q/k/v groups and gate/up halves, and A [r, in] is replicated.
- Row-parallel linears (linear_proj, linear_fc2: W's columns split): A [r, in/TP] is split like W's columns and
  B [out, r] is replicated.
The replicated factor sees only this rank's share of the gradient; it enters the computation through
Megatron's copy-to-TP region (identity forward, all-reduce backward), so its gradient is the full sum and
equal on every TP rank. The row-parallel path all-reduces the r-wide A x, not the hidden-wide output.
Expert linears (explicit expert communication: the token dispatcher gathers inputs and sums outputs over TP)
keep that contract: their low-rank path leaves the same partial sums the dispatcher expects.

Initialisation as PEFT's default: B = 0 (the adapted model starts as the base) and A kaiming-uniform
(a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn for the whole unsharded A from a generator seeded by
(seed, global layer, linear, global expert): the same adapters at any TP / PP / EP layout.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_rl.models.lora_layout import merge_adapters
from megatron_rl.trainer.config import LoraConfig

ADAPTER = "adapter"
"""A targeted linear's adapter submodule: its tensors are `<linear>.adapter.lora_A` and `.lora_B`."""

_PARALLEL = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}


class LoraAdapter(torch.nn.Module):
    """The low-rank path beside one Megatron linear (its forward hook adds this module's output)."""

    def __init__(self, linear: torch.nn.Module, *, parallel: Literal["column", "row"], config: LoraConfig,
                 lora_A: torch.Tensor):
        super().__init__()
        self.parallel = parallel
        self.scaling = config.alpha / config.rank
        self.dropout = config.dropout
        self.tp_group = linear.tp_group
        self.tp_size = linear.tp_group.size() if linear.tp_group is not None else 1
        self.expert = bool(getattr(linear, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False)) and not self.expert
        self.enabled = True
        out_features, in_features = linear.weight.shape
        dtype, device = linear.weight.dtype, linear.weight.device
        self.lora_A = torch.nn.Parameter(lora_A.to(device=device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, config.rank, device=device, dtype=dtype))
        if self.tp_size > 1:  # the sharded factor counts once per TP rank in the gradient norm
            sharded, dim = (self.lora_B, 0) if parallel == "column" else (self.lora_A, 1)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        if not getattr(linear.weight, "allreduce", True):  # expert weights: reduced over expert-data-parallel ranks
            for param in (self.lora_A, self.lora_B):
                param.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A, self.lora_B
        split = self.tp_size > 1
        if self.parallel == "column":
            if split and self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            elif split and not self.expert:
                x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            if split:
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            x = F.dropout(x, self.dropout, self.training) if self.dropout else x
            return F.linear(F.linear(x, a), b) * self.scaling
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        low = F.linear(x, a)
        if split and self.expert:
            b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        elif split:
            low = reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        out = F.linear(low, b) * self.scaling
        if split and self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out


def _add_low_rank_path(module, args, output):
    adapter = module.adapter
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def _initial_A(seed: int, key: str, rank: int, in_features: int) -> torch.Tensor:
    """PEFT's default A distribution (kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) for the whole
    unsharded [rank, in_features], from a generator seeded by `seed` and the adapter's global name `key`."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _global_key(name: str, first_layer: int, first_expert: int) -> str:
    """`decoder.layers.{local}....local_experts.{j}.linear_x` with this stage's and EP rank's offsets: the
    adapter's name in the unsharded model (its initial A is drawn from it)."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part == "layers" and parts[index + 1].isdigit():
            parts[index + 1] = str(int(parts[index + 1]) + first_layer)
        if part == "local_experts" and parts[index + 1].isdigit():
            parts[index + 1] = str(int(parts[index + 1]) + first_expert)
    return ".".join(parts)


def add_adapters(gpt: torch.nn.Module, config: LoraConfig, *, seed: int, first_layer: int, first_expert: int) -> int:
    """Give every targeted linear of `gpt` (one pipeline stage, one TP / EP rank) an adapter and freeze
    everything else. Returns how many linears were adapted (0 is refused: nothing would train)."""
    adapted = 0
    for name, module in list(gpt.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in config.targets or not hasattr(module, "weight") or hasattr(module, ADAPTER):
            continue
        parallel = _PARALLEL[leaf]
        in_features = module.weight.shape[1]
        tp = module.tp_group.size() if module.tp_group is not None else 1
        full_in = in_features * tp if parallel == "row" else in_features
        a = _initial_A(seed, _global_key(name, first_layer, first_expert), config.rank, full_in)
        if parallel == "row" and tp > 1:
            a = a.chunk(tp, dim=1)[module.tp_group.rank()].contiguous()
        module.adapter = LoraAdapter(module, parallel=parallel, config=config, lora_A=a)
        if not getattr(module, "adds_adapter_itself", False):  # (Gemma's post-norm projections, trainer/model.py)
            module.register_forward_hook(_add_low_rank_path)
        adapted += 1
    for param_name, param in gpt.named_parameters():
        param.requires_grad_(f".{ADAPTER}." in param_name)
    return adapted


def adapters(gpt: torch.nn.Module) -> Iterator[tuple[str, LoraAdapter]]:
    """(the adapted linear's name, its adapter) for every adapter in `gpt`."""
    for name, module in gpt.named_modules():
        if isinstance(module, LoraAdapter):
            yield name.removesuffix(f".{ADAPTER}"), module


def is_adapter_tensor(name: str) -> bool:
    return f".{ADAPTER}." in name


def merged_weights(gpt: torch.nn.Module, base: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """`base` (this rank's Megatron-named base weights) with every adapted weight merged with its adapter
    (`lora_layout.merge_adapters`): the weights an engine or an HF export computes with."""
    tensors = {k: v for k, v in gpt.state_dict().items() if is_adapter_tensor(k)}
    return merge_adapters(base, tensors, config.alpha / config.rank)


@contextlib.contextmanager
def adapters_disabled(gpt: torch.nn.Module):
    """The base model (every adapter switched off) inside the block: the KL penalty's reference policy."""
    switched = [adapter for _, adapter in adapters(gpt)]
    for adapter in switched:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in switched:
            adapter.enabled = True
