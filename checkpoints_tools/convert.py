"""`megatron-rl convert`: any supported model source -> an HF directory or a Megatron checkpoint at TP x PP.

Reading every format lives in `megatron_rl/models/pretrained.py` (what training, serving and conversion
share); this module holds the writers. Outputs are written into a temporary sibling directory and renamed
into place, so a reader never sees a partial model.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
from megatron_rl.models.pretrained import (
    load_pretrained,
    shard_dir_name,
    shard_file,
    write_megatron_meta,
)


def _atomic_dir(final: str):
    """Write into a temporary sibling directory, then rename: readers never see a partial model."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final) + "-", dir=parent)


def _publish(tmp: str, final: str) -> None:
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def save_hf(path: str, arch: ModelArch, state: dict[str, torch.Tensor], tokenizer: ChatTokenizer | None) -> None:
    """An HF directory that transformers (and SGLang) load: config.json, model.safetensors, tokenizer."""
    tmp = _atomic_dir(path)
    try:
        dtype = next(iter(state.values())).dtype
        config = arch.to_hf_config(torch_dtype=str(dtype).removeprefix("torch."))
        if tokenizer is not None:
            config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
            tokenizer.save_hf(tmp)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_megatron(path: str, layout: MegatronLayout, shards: list[list[dict[str, torch.Tensor]]],
                  tokenizer: ChatTokenizer | None) -> None:
    tmp = _atomic_dir(path)
    try:
        for pp_rank, row in enumerate(shards):
            for tp_rank, shard in enumerate(row):
                os.makedirs(os.path.join(tmp, shard_dir_name(tp_rank, pp_rank)))
                save_file({k: v.contiguous() for k, v in shard.items()}, shard_file(tmp, tp_rank, pp_rank))
        write_megatron_meta(tmp, layout, tokenizer)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def convert(source: str, output: str, *, to: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
            layer_spec: str = "local") -> str:
    """`megatron-rl convert`: any supported source -> an HF directory or a Megatron checkpoint at TP x PP."""
    model = load_pretrained(source)
    torch_dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, "bad")
    if torch_dtype == "bad":
        raise ConfigError(f"--dtype {dtype!r} is not one of fp32, bf16, fp16")
    state = cast_state(model.state, torch_dtype)
    if to == "hf":
        save_hf(output, model.arch, state, model.tokenizer)
    elif to == "megatron":
        layout = MegatronLayout(model.arch, tp=tp, pp=pp, layer_spec=layer_spec)
        save_megatron(output, layout, hf_to_megatron(state, layout), model.tokenizer)
    else:
        raise ConfigError(f"--to {to!r} is not one of hf, megatron")
    return output


