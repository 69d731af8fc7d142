"""LoRA adapters: Megatron shards (trainer/lora.py) <-> PEFT's adapter format (`adapter_config.json` +
`adapter_model.safetensors`, the names `peft` gives a transformers causal LM).

Megatron adapts the fused linears; PEFT adapts HF's separate projections. Because the low-rank update of a
fused weight is B A with B's rows in the fused layout, splitting B's rows as the weight's rows split (q / k / v per
query group, gate / up halves) gives each HF projection the update B_part A: the same A for q, k and v (and for
gate and up), exactly. A PEFT adapter imported for training must therefore share A across the projections one
fused linear holds (adapters this project exported do).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import ConfigError
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    fuse_gate_up,
    fuse_qkv,
    split_gate_up,
    split_qkv,
)

PEFT_PREFIX = "base_model.model."
"""What `peft.PeftModel` puts before a transformers causal LM's own module names."""

HF_PROJECTIONS = {"linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "linear_proj": ("self_attn.o_proj",),
                  "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
                  "linear_fc2": ("mlp.down_proj",)}
_MEGATRON_MODULE = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                    "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}


def _check_dense(layout: MegatronLayout, targets: list[str]) -> None:
    if layout.arch.is_moe and any(t in ("linear_fc1", "linear_fc2") for t in targets):
        raise ConfigError("PEFT's adapter format has no place for adapters on fused mixture-of-experts experts "
                          "(transformers keeps them as 3-D parameters, not linears): export the merged model "
                          "(convert --merge-lora) instead")


def peft_target_modules(targets: list[str]) -> list[str]:
    """PEFT's `target_modules` for Megatron adapter targets."""
    return sorted(p.rsplit(".", 1)[-1] for t in targets for p in HF_PROJECTIONS[t])


def megatron_to_peft(shards: list[list[dict[str, torch.Tensor]]], layout: MegatronLayout,
                     targets: list[str]) -> dict[str, torch.Tensor]:
    """Adapter shards[pp_rank][tp_rank] (`MegatronTrainer.checkpoint_state()` names) -> PEFT-named tensors."""
    _check_dense(layout, targets)
    arch, tp = layout.arch, layout.tp
    state: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        stage, local = layout.stage_of(layer)
        for target in targets:
            name = f"decoder.layers.{local}.{_MEGATRON_MODULE[target]}.adapter."
            a = [shards[stage][t][name + "lora_A"] for t in range(tp)]
            b = [shards[stage][t][name + "lora_B"] for t in range(tp)]
            if target in ("linear_qkv", "linear_fc1"):  # column-parallel: B split by rows, A replicated
                parts = split_qkv(b, arch) if target == "linear_qkv" else split_gate_up(b)
                pairs = [(a[0], part) for part in parts]
            else:  # row-parallel: A split by columns, B replicated
                pairs = [(torch.cat(a, dim=1), b[0])]
            for projection, (lora_a, lora_b) in zip(HF_PROJECTIONS[target], pairs):
                hf = f"{PEFT_PREFIX}model.layers.{layer}.{projection}."
                state[hf + "lora_A.weight"] = lora_a.contiguous().clone()
                state[hf + "lora_B.weight"] = lora_b.contiguous().clone()
    return state


def peft_to_megatron(state: dict[str, torch.Tensor], layout: MegatronLayout,
                     targets: list[str]) -> list[list[dict[str, torch.Tensor]]]:
    """Inverse of `megatron_to_peft` (shards[pp_rank][tp_rank]); refuses, naming the tensor, an adapter whose
    projections of one fused linear have different A (see the module docstring) or that lacks a target."""
    _check_dense(layout, targets)
    arch, tp = layout.arch, layout.tp
    shards: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(tp)] for _ in range(layout.pp)]
    known = set()
    for layer in range(arch.num_layers):
        stage, local = layout.stage_of(layer)
        for target in targets:
            pairs = []
            for projection in HF_PROJECTIONS[target]:
                hf = f"{PEFT_PREFIX}model.layers.{layer}.{projection}."
                for part in ("lora_A.weight", "lora_B.weight"):
                    if hf + part not in state:
                        raise ConfigError(f"PEFT adapter is missing tensor '{hf + part}'")
                    known.add(hf + part)
                pairs.append((state[hf + "lora_A.weight"], state[hf + "lora_B.weight"]))
            name = f"decoder.layers.{local}.{_MEGATRON_MODULE[target]}.adapter."
            if target in ("linear_qkv", "linear_fc1"):
                first = pairs[0][0]
                for projection, (lora_a, _) in zip(HF_PROJECTIONS[target][1:], pairs[1:]):
                    if not torch.equal(lora_a, first):
                        raise ConfigError(
                            f"PEFT adapter tensor '{PEFT_PREFIX}model.layers.{layer}.{projection}.lora_A.weight' "
                            f"differs from {HF_PROJECTIONS[target][0]}'s: Megatron's fused {target} takes one A "
                            f"for {', '.join(HF_PROJECTIONS[target])}")
                bs = [b for _, b in pairs]
                b_shards = fuse_qkv(*bs, arch, tp) if target == "linear_qkv" else fuse_gate_up(*bs, tp)
                a_shards = [first.clone() for _ in range(tp)]
            else:
                lora_a, lora_b = pairs[0]
                a_shards = [c.contiguous() for c in torch.chunk(lora_a, tp, dim=1)]
                b_shards = [lora_b.clone() for _ in range(tp)]
            for t in range(tp):
                shards[stage][t][name + "lora_A"] = a_shards[t]
                shards[stage][t][name + "lora_B"] = b_shards[t]
    extra = sorted(set(state) - known)
    if extra:
        raise ConfigError(f"PEFT adapter tensor '{extra[0]}' is not on trainer.lora.targets {targets} "
                          f"({len(extra)} such tensor(s))")
    return shards


def read_peft_adapter(path: str, *, rank: int, alpha: float, targets: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the PEFT adapter directory `path` (PEFT's names, `PEFT_PREFIX` included), after checking that
    its config is these adapters': LoRA of rank `rank`, scale `alpha`, on `targets`' projections."""
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ConfigError(f"{path}: not a PEFT adapter directory (no {os.path.basename(file)})")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{config_file}: unreadable ({type(exc).__name__}: {exc})") from None
    checks = [("peft_type", config.get("peft_type"), "LORA"), ("r", config.get("r"), rank),
              ("lora_alpha", config.get("lora_alpha"), alpha), ("use_rslora", bool(config.get("use_rslora")), False),
              ("use_dora", bool(config.get("use_dora")), False),
              ("target_modules", sorted(config.get("target_modules") or []), peft_target_modules(targets))]
    for field, found, wanted in checks:
        if found != wanted:
            raise ConfigError(f"{config_file}: field '{field}' is {found!r}, but trainer.lora needs {wanted!r}")
    try:
        state = load_file(weights_file)
    except Exception as exc:  # noqa: BLE001 - safetensors reports a damaged file in several error types
        raise ConfigError(f"{weights_file}: unreadable ({type(exc).__name__}: {exc})") from None
    return {(k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k): v for k, v in state.items()}


def peft_adapter_config(*, rank: int, alpha: float, dropout: float, targets: list[str],
                        base_model: str | None) -> dict:
    """PEFT's `adapter_config.json` for these adapters (LoRA, no biases, plain alpha / r scaling)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": peft_target_modules(targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "inference_mode": True, "base_model_name_or_path": base_model}


def write_peft_files(directory: str, state: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's two files in `directory` (which exists): `adapter_config.json` (`config`, e.g. `peft_adapter_config`)
    and `adapter_model.safetensors` (`state` under PEFT's names)."""
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                   scaling: float) -> dict[str, torch.Tensor]:
    """One rank's Megatron-named `base` weights with each adapted weight W replaced by W + scaling * B A (computed
    in float32, rounded once to W's dtype): what the trained policy computes with. `adapters` holds that rank's
    `<linear>.adapter.lora_A` / `.lora_B`."""
    merged = dict(base)
    for name, lora_a in adapters.items():
        if not name.endswith(".adapter.lora_A"):
            continue
        linear = name.removesuffix(".adapter.lora_A")
        lora_b = adapters[f"{linear}.adapter.lora_B"]
        weight = base[f"{linear}.weight"]
        delta = (lora_b.detach().float() @ lora_a.detach().float()) * scaling
        merged[f"{linear}.weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged


def base_checksum(base: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the base weights' names, shapes, dtypes and bytes (in name order): which base a
    checkpoint's adapters were trained on."""
    digest = hashlib.sha256()
    for name in sorted(base):
        tensor = base[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
    return digest.hexdigest()
