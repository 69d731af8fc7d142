"""Layout-independent optimizer state, and resharding a checkpoint's tensors to another TP x PP layout.

A checkpoint (format 2, docs/checkpoints.md) stores, per tensor- and pipeline-parallel shard, the model's
Megatron-named weights and, beside them, the optimizer's per-parameter state in the same shapes and
names: `exp_avg/<name>`, `exp_avg_sq/<name>` (Adam's moments) and, when the model trains in bf16,
`fp32_param/<name>` (the optimizer's fp32 master weights). Megatron's distributed optimizer (ZeRO-1)
holds a flat slice of each parameter's state on each data-parallel rank; those slices are gathered over
the data-parallel group when saving, so what is stored does not depend on the data-parallel size or on
the optimizer being distributed. Scalar per-parameter state (Adam's step count) is one number.

Loading at another TP x PP layout converts every kind of tensor as the weights are converted: the saved
shards are joined into HF-logical tensors (`megatron_to_hf`) and split for the new layout
(`hf_to_megatron`), so fused QKV rows, the gate/up halves of fc1, vocabulary padding and pipeline
stages follow the same rules for Adam's moments as for the weights. Each data-parallel rank then takes
its slice again.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_rl.config import ConfigError
from megatron_rl.models.lora_layout import megatron_to_peft, peft_to_megatron
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    hf_tensor_shapes,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.models.pretrained import shard_dir_name

OPTIMIZER_STATE = "optimizer_state"
"""Checkpoint folder of the per-shard optimizer state (`optimizer_state/mp_rank_TT_PPP/optimizer.safetensors`)."""
OPTIMIZER_FILE = "optimizer.safetensors"
MAIN_PARAM = "fp32_param"
"""Kind name of the optimizer's fp32 master weights (stored only when the model's weights are not fp32)."""


def optimizer_state_file(path: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(path, OPTIMIZER_STATE, shard_dir_name(tp_rank, pp_rank), OPTIMIZER_FILE)


def _wrappers(trainer) -> list:
    return getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])


def _param_names(trainer) -> dict[torch.nn.Parameter, str]:
    """Each trained parameter's name in `trainer.shard_state()` (GPTModel names; a subclass's added
    parameters, e.g. the value head, by their name in the trained network)."""
    names = {p: n for n, p in trainer.gpt.named_parameters()}
    for name, param in getattr(trainer.model, "module", trainer.model).named_parameters():
        names.setdefault(param, name.removeprefix("module."))  # (Float16Module's prefix)
    return names


def _entries(trainer) -> list[tuple[Any, torch.nn.Parameter, torch.Tensor, tuple[int, int] | None]]:
    """(optimizer wrapper, model parameter, main parameter, flat range of the parameter this
    data-parallel rank owns or None for all of it) for every parameter the optimizer updates here."""
    entries = []
    for wrapper in _wrappers(trainer):
        inner = wrapper.optimizer
        if hasattr(wrapper, "model_param_group_index_map"):  # the distributed optimizer: flat slices
            for model_param, (group, order) in wrapper.model_param_group_index_map.items():
                span = wrapper._get_model_param_range_map(model_param)["param"]
                entries.append((wrapper, model_param, inner.param_groups[group]["params"][order], (span.start, span.end)))
        elif hasattr(wrapper, "float16_groups"):  # bf16 weights with fp32 master copies
            for model_group, main_group in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
                entries.extend((wrapper, m, main, None) for m, main in zip(model_group, main_group))
            for group in wrapper.fp32_from_fp32_groups:
                entries.extend((wrapper, p, p, None) for p in group)
        else:  # fp32 weights: the optimizer updates the model's own parameters
            entries.extend((wrapper, p, p, None) for g in inner.param_groups for p in g["params"])
    return entries


def _tensor_kinds(state: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)


def _scalar_state(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in state.items() if (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (int, float))}


def gather_optimizer_state(trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """This TP x PP shard's optimizer state as full parameter-shaped tensors named `kind/<name>`, and
    its metadata (kinds, scalars such as Adam's step). A collective over the data-parallel group when
    the optimizer is distributed; the result is returned on data-parallel rank 0 (None elsewhere)."""
    entries = _entries(trainer)
    names = _param_names(trainer)
    distributed = any(span is not None for *_, span in entries)
    dp_group = getattr(_wrappers(trainer)[0], "data_parallel_group", None) if distributed else None
    dp_rank = dp_group.rank() if dp_group is not None else trainer.pg.dp.rank()
    initialized = [bool(w.optimizer.state) for w in _wrappers(trainer)]
    if distributed and dp_group.size() > 1:  # one rank may own no slice of a wrapper's parameters
        flags = torch.tensor(initialized, dtype=torch.float32, device=trainer._device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=dp_group)
        initialized = [bool(f) for f in flags.tolist()]
    if not any(initialized):  # no step taken yet: the optimizer starts fresh on load as well
        return ({}, {"initialized": False}) if dp_rank == 0 else None
    sample = next(w.optimizer.state[main] for w, _, main, _ in entries if main in w.optimizer.state)
    kinds = _tensor_kinds(sample)
    scalars = _scalar_state(sample)
    params = sorted(((names[m], m) for _, m, _, _ in entries), key=lambda item: item[0])
    if distributed:  # every data-parallel rank lists every parameter of the shard, owned slice or not
        params = sorted(((n, p) for p, n in names.items() if p.requires_grad), key=lambda item: item[0])
    by_param = {m: (w, main, span) for w, m, main, span in entries}
    keep_main = any(m.dtype != torch.float32 for _, m in params)
    all_kinds = kinds + ([MAIN_PARAM] if keep_main else [])
    group_step = [g["step"] for w in _wrappers(trainer) for g in w.optimizer.param_groups if "step" in g]
    meta = {"initialized": True, "kinds": kinds, "main_params": keep_main, "scalars": scalars,
            "group_step": float(group_step[0]) if group_step else None}
    if not (distributed and dp_group.size() > 1):
        if dp_rank != 0:
            return None
        # One rank holds every element: each state is copied once, straight into its own tensor (a flat
        # buffer cut into copies would hold the state twice, which a large model on one host cannot afford).
        tensors = {}
        with torch.no_grad():
            for name, param in params:
                wrapper, main, _ = by_param.get(param, (None, None, None))
                state = wrapper.optimizer.state.get(main, {}) if wrapper is not None else {}
                for kind in all_kinds:
                    source = main if kind == MAIN_PARAM else state.get(kind)
                    dtype = sample[kind].dtype if kind in sample else torch.float32
                    out = torch.zeros(param.shape, dtype=dtype)
                    if source is not None:
                        out.copy_(source.detach().reshape(param.shape))
                    tensors[f"{kind}/{name}"] = out
        return tensors, meta
    offsets, total = {}, 0
    for name, param in params:
        for kind in all_kinds:
            offsets[(kind, name)] = total
            total += param.numel()
    flat = torch.zeros(total, dtype=torch.float32, device=trainer._device())
    with torch.no_grad():
        for name, param in params:
            if param not in by_param:
                continue
            wrapper, main, span = by_param[param]
            state = wrapper.optimizer.state.get(main, {})
            start, end = span if span is not None else (0, param.numel())
            for kind in all_kinds:
                source = main if kind == MAIN_PARAM else state.get(kind)
                if source is None:
                    continue
                at = offsets[(kind, name)]
                flat[at + start:at + end].copy_(source.detach().reshape(-1))
    if distributed and dp_group.size() > 1:  # every element is owned by exactly one rank: a sum is a gather
        dist.reduce(flat, dst=dist.get_global_rank(dp_group, 0), group=dp_group)
    if dp_rank != 0:
        return None
    flat = flat.cpu()
    tensors = {}
    for name, param in params:
        for kind in all_kinds:
            at = offsets[(kind, name)]
            dtype = sample[kind].dtype if kind in sample else torch.float32
            tensors[f"{kind}/{name}"] = flat[at:at + param.numel()].view(param.shape).to(dtype).clone()
    return tensors, meta


def _initialize_state(wrapper) -> None:
    """Create the optimizer's lazily built per-parameter state (a step on zero gradients), so that
    loading can copy into it. The weights this may move are loaded afterwards."""
    if hasattr(wrapper, "_init_optimizer_states_with_dummy_values"):
        wrapper._init_optimizer_states_with_dummy_values()
        return
    inner = wrapper.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def prepare_optimizer_state(trainer, meta: dict[str, Any]) -> None:
    """Before the weights are loaded: give every parameter its optimizer state to load into, or, when
    the checkpoint was written before the first step, leave the optimizer as fresh as it was then (Adam
    with state of step 0 would not be: its first update's bias correction differs)."""
    for wrapper in _wrappers(trainer):
        if not meta.get("initialized", True):
            wrapper.optimizer.state.clear()
        elif wrapper.optimizer.param_groups and not wrapper.optimizer.state:
            _initialize_state(wrapper)


def apply_optimizer_state(trainer, tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: str) -> None:
    """After the weights are loaded: copy this rank's part of the full parameter-shaped optimizer state
    (`gather_optimizer_state`'s tensors, resharded to this rank's TP x PP shard when needed) into the
    optimizer; refuse, naming the problem, state that does not fit."""
    if not meta.get("initialized", True):
        return
    names = _param_names(trainer)
    with torch.no_grad():
        for wrapper, model_param, main, span in _entries(trainer):
            name = names[model_param]
            state = wrapper.optimizer.state[main]
            current = _tensor_kinds(state)
            if current != meta["kinds"]:
                raise ConfigError(f"{where}: the checkpoint holds optimizer state {meta['kinds']}, this run's "
                                  f"optimizer keeps {current} (another optimizer?)")
            kinds = current + ([MAIN_PARAM] if meta.get("main_params") else [])
            for kind in kinds:
                full = tensors.get(f"{kind}/{name}")
                if full is None:
                    raise ConfigError(f"{where}: no optimizer state {kind!r} for parameter {name!r}")
                if full.numel() != model_param.numel():
                    raise ConfigError(f"{where}: optimizer state {kind}/{name} has {list(full.shape)}, the "
                                      f"parameter is {list(model_param.shape)}")
                part = full.reshape(-1)[span[0]:span[1]] if span is not None else full.reshape(model_param.shape)
                target = main if kind == MAIN_PARAM else state[kind]
                target.copy_(part.reshape(target.shape))
            for key, value in meta.get("scalars", {}).items():
                if torch.is_tensor(state.get(key)):
                    state[key].fill_(value)
                else:
                    state[key] = type(state.get(key, value))(value)
        if meta.get("group_step") is not None:
            for wrapper in _wrappers(trainer):
                for group in wrapper.optimizer.param_groups:
                    if "step" in group:
                        group["step"] = type(group["step"])(meta["group_step"])


# --- resharding -------------------------------------------------------------------------------------

LAST_STAGE_REPLICATED = ("value_head.",)
"""Name prefixes of tensors a trainer adds beside the GPT model on its last pipeline stage, the same on
every tensor-parallel rank (trainer/value.py's scalar head and its statistics): resharding moves them to
the new layout's last stage as they are."""

def reshard_file_kinds(files: list[list[str]], saved: MegatronLayout, layout: MegatronLayout,
                       tp_rank: int, pp_rank: int, where: str,
                       lora_targets: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one rank's shard at `layout` from the saved shard files (files[pp][tp]) written at
    `saved`. A file's tensors named `kind/<megatron name>` are converted per kind; plain Megatron names
    are the weights. One kind at a time is held whole in memory. `lora_targets`: the files hold LoRA
    adapters on these linears (through PEFT's unfused layout, `models/lora_layout.py`)."""
    shards = [[load_file(f) for f in row] for row in files]
    kinds: dict[str, list[list[dict[str, torch.Tensor]]]] = {}
    for p, row in enumerate(shards):
        for t, shard in enumerate(row):
            for key, tensor in shard.items():
                kind, _, name = key.rpartition("/")
                kinds.setdefault(kind, [[{} for _ in range(saved.tp)] for _ in range(saved.pp)])[p][t][name] = tensor
    result: dict[str, torch.Tensor] = {}
    if lora_targets is not None:
        for kind, kind_shards in kinds.items():
            unfused = megatron_to_peft(kind_shards, saved, lora_targets)
            mine = peft_to_megatron(unfused, layout, lora_targets)[pp_rank][tp_rank]
            result.update({(f"{kind}/" if kind else "") + name: tensor for name, tensor in mine.items()})
        return result
    known = _megatron_names(saved)
    for kind, kind_shards in kinds.items():
        prefix = f"{kind}/" if kind else ""
        last = kind_shards[saved.pp - 1]
        # a head beside the GPT model (the value head): whole on the last stage's every TP rank, moved as is
        replicated = {name: tensor for name, tensor in last[0].items()
                      if name.startswith(LAST_STAGE_REPLICATED) and name not in known[-1][0]}
        for t, shard in enumerate(last):
            missing = sorted(set(replicated) - set(shard))
            if missing:
                raise ConfigError(f"{where}: tensor {missing[0]!r} is missing from the last stage's shard tp={t}")
            for name in replicated:
                del shard[name]
        if pp_rank == layout.pp - 1:
            result.update({prefix + name: tensor for name, tensor in replicated.items()})
        for p, row in enumerate(kind_shards):
            for t, shard in enumerate(row):
                unknown = sorted(set(shard) - known[p][t])
                if unknown:
                    raise ConfigError(f"{where}: tensor {unknown[0]!r} has no rule to reshard it to another "
                                      f"layout; resume at the checkpoint's own layout (tensor_parallel={saved.tp}, "
                                      f"pipeline_parallel={saved.pp})")
        full = megatron_to_hf(kind_shards, saved)
        mine = hf_to_megatron(full, layout)[pp_rank][tp_rank]
        del full
        result.update({prefix + name: tensor for name, tensor in mine.items()})
    return result


def _megatron_names(layout: MegatronLayout) -> list[list[set[str]]]:
    """The Megatron tensor names of every shard of `layout` (from shape-only tensors: no memory)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_tensor_shapes(layout.arch).items()}
    return [[set(shard) for shard in row] for row in hf_to_megatron(meta, layout)]
