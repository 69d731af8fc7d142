"""`megatron-rl convert`: any supported model source -> an HF directory or a Megatron checkpoint at TP x PP.

Reading every format lives in `megatron_rl/models/pretrained.py` (what training, serving and conversion
share); this module holds the writers. Outputs are written into a temporary sibling directory and renamed
into place, so a reader never sees a partial model.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Literal

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.lora_layout import (
    base_checksum,
    megatron_to_peft,
    merge_adapters,
    peft_adapter_config,
    write_peft_files,
)
from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron, megatron_to_hf, published_hf_state
from megatron_rl.models.pretrained import (
    LORA_BASE_CHECKSUM,
    MEGATRON_META,
    SAFE_WEIGHTS_INDEX,
    load_megatron,
    load_pretrained,
    read_lora_meta,
    shard_file,
    write_megatron_shards,
)

log = logging.getLogger(__name__)


def _atomic_dir(final: str):
    """Write into a temporary sibling directory, then rename: readers never see a partial model. The
    temporary names carry this process's pid; those of a convert that died (SIGKILL) are removed here."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    _remove_dead_attempts(parent, os.path.basename(final))
    return tempfile.mkdtemp(prefix=_own_prefix(".tmp-", final), dir=parent)


def _own_prefix(kind: str, final: str) -> str:
    return f"{kind}{os.path.basename(final)}-{os.getpid()}-"


def _remove_dead_attempts(parent: str, name: str) -> None:
    """Remove `.tmp-NAME-PID-*` / `.old-NAME-PID-*` directories (exactly the names this module makes) whose
    convert process no longer exists."""
    pattern = re.compile(rf"\.(?:tmp|old)-{re.escape(name)}-(\d+)-[a-z0-9_]{{8}}")
    for entry in os.listdir(parent):
        match = pattern.fullmatch(entry)
        path = os.path.join(parent, entry)
        if match and not os.path.exists(f"/proc/{match.group(1)}") and os.path.isdir(path) \
                and not os.path.islink(path):
            log.warning("convert: removing %s, left by a convert (pid %s) that did not finish", path, match.group(1))
            shutil.rmtree(path, ignore_errors=True)


# Written into every output: the only kind of existing OUTPUT that convert replaces (with --overwrite). It
# lists the files convert wrote there, so that a file a user added later is never deleted with the rest.
CONVERT_MARK = ".megatron-rl-convert"


def written_by_convert(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, CONVERT_MARK))


def _written_files(path: str) -> set[str] | None:
    """The files convert recorded writing into `path` (None: no record, e.g. an older convert's output)."""
    try:
        with open(os.path.join(path, CONVERT_MARK), encoding="utf-8") as f:
            record = json.load(f)
        return set(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _all_files(path: str) -> set[str]:
    found = set()
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found.add(os.path.relpath(os.path.join(root, name), path))
    return found


def foreign_files(path: str) -> list[str]:
    """Files in a convert output that convert did not write there (sorted); all of them when it kept no
    record of what it wrote."""
    written = _written_files(path)
    present = _all_files(path) - {CONVERT_MARK}
    return sorted(present if written is None else present - written)


def check_replaceable(path: str) -> None:
    """Refuse (ConfigError, one line) to replace `path` unless convert wrote it and everything in it."""
    if not written_by_convert(path):  # never delete what we did not write
        raise ConfigError(f"OUTPUT {path} exists and is not a directory megatron-rl convert wrote; --overwrite "
                          "replaces only those (choose another OUTPUT)")
    foreign = foreign_files(path)
    if foreign:
        raise ConfigError(f"OUTPUT {path} holds files convert did not write there ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); --overwrite deletes nothing of yours: move "
                          "them out or choose another OUTPUT")


def _publish(tmp: str, final: str) -> None:
    files = sorted(_all_files(tmp))
    with open(os.path.join(tmp, CONVERT_MARK), "w", encoding="utf-8") as f:
        json.dump({"written_by": "megatron-rl convert; `convert --overwrite` may replace these files",
                   "files": files}, f, indent=1)
    if os.path.lexists(final):
        check_replaceable(final)
        parent = os.path.dirname(os.path.abspath(final))
        old = tempfile.mkdtemp(prefix=_own_prefix(".old-", final), dir=parent)  # a name of our own
        os.rename(final, old)  # replaces the empty directory just made
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


# What `save_pretrained` of transformers 5.x uses when no size is given (modeling_utils.py).
DEFAULT_MAX_SHARD_SIZE = "50GB"
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_shard_size(size: int | str) -> int:
    """Bytes from an int or a string such as '5GB' / '500MB' (decimal units, as huggingface_hub reads them)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)?\s*", size, flags=re.IGNORECASE)
        if match is None:
            raise ConfigError(f"--max-shard-size {size!r} is not a size such as 5GB, 500MB or a byte count")
        unit = _SIZE_UNITS[match.group(2).upper()] if match.group(2) else 1
        value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise ConfigError(f"--max-shard-size {size!r} must be positive")
    return value


def _state_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The model's dtype as transformers reports it: that of the first floating-point tensor."""
    return next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)


def _generation_config(tokenizer: ChatTokenizer | None) -> dict[str, Any]:
    """generation_config.json as `save_pretrained` writes it (`GenerationConfig.from_model_config`): the
    special token ids (None left out, so transformers' defaults hold) and the model config's defaults of
    the generation fields."""
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id,
                                        "eos_token_id": tokenizer.eos_token_id,
                                        "pad_token_id": tokenizer.pad_token_id}
    return {"_from_model_config": True, "output_attentions": False, "output_hidden_states": False,
            "use_cache": True, **{k: v for k, v in ids.items() if v is not None}}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_safetensors_shards(directory: str, state: dict[str, torch.Tensor], max_shard_size: int) -> None:
    """`model.safetensors`, or above `max_shard_size` the shards `model-0000i-of-0000N.safetensors` and
    `model.safetensors.index.json`, split as `save_pretrained` splits them (huggingface_hub)."""
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name].contiguous() for name in names}, os.path.join(directory, filename),
                  metadata={"format": "pt"})
    if split.is_sharded:
        total_parameters = sum(t.numel() for t in state.values())
        _write_json(os.path.join(directory, SAFE_WEIGHTS_INDEX),
                    {"metadata": {"total_parameters": total_parameters, **split.metadata},
                     "weight_map": split.tensor_to_filename})


def save_hf(path: str, arch: ModelArch, state: dict[str, torch.Tensor], tokenizer: ChatTokenizer | None, *,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
            task: Literal["causal_lm", "sequence_classification"] = "causal_lm") -> None:
    """An HF directory as transformers' `save_pretrained` writes one (transformers and SGLang load it):
    config.json (dtype of the tensors), generation_config.json, safetensors sharded above
    `max_shard_size` with their index, and the tokenizer. `sequence_classification`: a reward model (the
    family's *ForSequenceClassification with one output, `score.weight` in `state`, no generation config)."""
    shard_bytes = parse_shard_size(max_shard_size)
    if task == "sequence_classification" and "score.weight" not in state:
        raise ValueError("save_hf(task='sequence_classification'): the state has no score.weight head")
    if arch.tie_word_embeddings:
        # save_pretrained leaves out the tied head: it is the embedding
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = published_hf_state(state, arch)
    tmp = _atomic_dir(path)
    try:
        dtype_name = str(_state_dtype(state)).removeprefix("torch.")
        # transformers >= 4.56 reads `dtype`; older 4.x releases read `torch_dtype`: write both.
        config = families.to_hf_config(arch, dtype=dtype_name, torch_dtype=dtype_name)
        if task == "sequence_classification":
            config.update(architectures=[config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                          num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        if tokenizer is not None:
            config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
            tokenizer.save_hf(tmp)
        _write_json(os.path.join(tmp, "config.json"), config)
        if task == "causal_lm":
            _write_json(os.path.join(tmp, "generation_config.json"), _generation_config(tokenizer))
        _save_safetensors_shards(tmp, state, shard_bytes)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_megatron(path: str, layout: MegatronLayout, shards: list[list[dict[str, torch.Tensor]]],
                  tokenizer: ChatTokenizer | None) -> None:
    tmp = _atomic_dir(path)
    try:
        write_megatron_shards(tmp, layout, shards, tokenizer)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def adapter_dir(source: str) -> str | None:
    """The LoRA adapter directory `source` names (itself, or a LoRA run's checkpoint step holding it in
    `model/`), None when it holds none."""
    for candidate in (source, os.path.join(source, "model")):
        if os.path.isfile(os.path.join(candidate, MEGATRON_META)) and read_lora_meta(candidate) is not None:
            return candidate
    return None


def save_peft(source: str, output: str, *, base: str | None = None) -> str:
    """`convert --to peft`: a LoRA run's adapters as PEFT's `adapter_config.json` + `adapter_model.safetensors`
    (`peft.PeftModel.from_pretrained(hf_model, output)` loads them onto the HF base)."""
    path = _require_adapter_dir(source)
    meta = read_lora_meta(path)
    layout, shards = load_megatron(path)
    state = megatron_to_peft(shards, layout, meta["targets"])
    config = peft_adapter_config(rank=meta["rank"], alpha=meta["alpha"], dropout=meta.get("dropout", 0.0),
                                 targets=meta["targets"], base_model=base or meta.get("base_model"))
    tmp = _atomic_dir(output)
    try:
        write_peft_files(tmp, state, config)
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def merged_lora_model(source: str, base: str | None = None):
    """(arch, HF-named merged weights, tokenizer) of a LoRA run's adapters on their base: each adapted weight
    W + (alpha / r) B A exactly as the trainer merges it for its engines. The base (`base`, else the path the
    run recorded) must be the one the adapters were trained on: its checksum is compared shard by shard."""
    path = _require_adapter_dir(source)
    meta = read_lora_meta(path)
    base = base or meta.get("base_model")
    if not base:
        raise ConfigError(f"{path}/lora.json names no base model: give it with --base MODEL")
    layout, adapter_shards = load_megatron(path)
    model = load_pretrained(base)
    dtype = getattr(torch, meta.get("base_dtype", "float32"))
    base_shards = hf_to_megatron(cast_state(model.state, dtype), layout)
    merged = [[None] * layout.shards_per_stage for _ in range(layout.pp)]
    for p in range(layout.pp):
        for t in range(layout.tp):
            with safe_open(shard_file(path, t, p), framework="pt") as f:
                saved = (f.metadata() or {}).get(LORA_BASE_CHECKSUM)
            if saved is not None and saved != base_checksum(base_shards[p][t]):
                raise ConfigError(f"--base {base} is not the model the adapters in {path} were trained on "
                                  f"(shard tp={t} pp={p}: base checksum differs)")
            merged[p][t] = merge_adapters(base_shards[p][t], adapter_shards[p][t], meta["alpha"] / meta["rank"])
    return layout.arch, megatron_to_hf(merged, layout), model.tokenizer


def _require_adapter_dir(source: str) -> str:
    path = adapter_dir(source)
    if path is None:
        raise ConfigError(f"{source} holds no LoRA adapters (no lora.json beside {MEGATRON_META}; a LoRA run's "
                          "checkpoint keeps them in <run_dir>/checkpoints/step_N/model)")
    return path


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def convert(source: str, output: str, *, to: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
            layer_spec: str = "local", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, ep: int = 1,
            merge_lora: bool = False, base: str | None = None, first_stage_layers: int | None = None,
            last_stage_layers: int | None = None) -> str:
    """`megatron-rl convert`: any supported source -> an HF directory or a Megatron checkpoint at TP x PP
    (x EP: a mixture-of-experts model's experts split over `ep` expert-parallel ranks; `first_stage_layers` /
    `last_stage_layers`: Megatron's uneven pipeline split); a LoRA run's adapters
    -> PEFT's adapter format (`to="peft"`) or, with `merge_lora`, merged into their base (`base`, else the
    model path the run recorded)."""
    parse_shard_size(max_shard_size)  # a bad size fails before the model is read
    torch_dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, "bad")
    if torch_dtype == "bad":
        raise ConfigError(f"--dtype {dtype!r} is not one of fp32, bf16, fp16")
    if to == "peft":
        return save_peft(source, output, base=base)
    if merge_lora:
        arch, state, tokenizer = merged_lora_model(source, base)
    else:
        model = load_pretrained(source)
        arch, state, tokenizer = model.arch, model.state, model.tokenizer
    state = cast_state(state, torch_dtype)
    if to == "hf":
        save_hf(output, arch, state, tokenizer, max_shard_size=max_shard_size)
    elif to == "megatron":
        layout = MegatronLayout(arch, tp=tp, pp=pp, layer_spec=layer_spec, ep=ep, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers)
        save_megatron(output, layout, hf_to_megatron(state, layout), tokenizer)
    else:
        raise ConfigError(f"--to {to!r} is not one of hf, megatron, peft")
    return output


