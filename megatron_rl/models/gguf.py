"""Read a llama.cpp GGUF file into HF-layout float32 tensors, its architecture and its tokenizer.

GGUF architectures `llama` (also Mistral and SmolLM2), `qwen2` (q/k/v biases) and `qwen3` (q/k norms) map
to the families of models/families.py. Quantized tensors are dequantized with the `gguf` package.
llama.cpp's converter permutes the rows of a `llama` model's q_proj and k_proj so that its interleaved RoPE
applies; `_unpermute_rope_rows` undoes that to recover the HF (rotate-half) layout that Megatron and our
engine use (Qwen models are stored unpermuted). RoPE scaling: `rope.scaling.type` linear / yarn is read
from the metadata; Llama 3.1's scaling is stored only as a `rope_freqs` tensor of per-dimension divisors,
which is matched against the llama3 formula at the published settings, or refused.
"""
from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import TokenizerSpec
from megatron_rl.models.arch import ModelArch, RopeScaling
from megatron_rl.models.rope import rope_inv_freq

# GGUF general.architecture -> (our family, whether q/k rows are permuted for interleaved RoPE)
SUPPORTED_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
# Llama 3.x rope scaling as published (factor 8 for 3.1 / 3.3, 32 for 3.2), tried against `rope_freqs`.
_LLAMA3_SETTINGS = [dict(factor=f, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
                    for f in (8.0, 32.0, 16.0, 4.0, 2.0)]

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _open(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors/IndexError on bad bytes
        raise ConfigError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _value(reader, key: str, path: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ConfigError(f"{path}: GGUF metadata field '{key}' is missing")
    return field.contents()


def _rope_scaling(reader, arch: str, path: str) -> RopeScaling | None:
    kind = str(_value(reader, f"{arch}.rope.scaling.type", path, "none"))
    if kind == "none":
        return None
    factor = float(_value(reader, f"{arch}.rope.scaling.factor", path))
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    if kind == "yarn":
        for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier"):
            if f"{arch}.{key}" in reader.fields:
                raise ConfigError(f"{path}: GGUF metadata field '{arch}.{key}' is not supported for yarn")
        beta_fast = reader.fields.get(f"{arch}.rope.scaling.yarn_beta_fast")
        beta_slow = reader.fields.get(f"{arch}.rope.scaling.yarn_beta_slow")
        return RopeScaling(rope_type="yarn", factor=factor,
                           original_max_position_embeddings=int(_value(reader, f"{arch}.rope.scaling.original_context_length", path)),
                           beta_fast=None if beta_fast is None else float(beta_fast.contents()),
                           beta_slow=None if beta_slow is None else float(beta_slow.contents()))
    raise ConfigError(f"{path}: GGUF metadata field '{arch}.rope.scaling.type' = {kind!r} is not supported "
                      "(supported: none, linear, yarn)")


def _llama3_from_rope_freqs(arch: ModelArch, divisors: np.ndarray, path: str) -> ModelArch:
    """The arch whose llama3 scaling reproduces llama.cpp's `rope_freqs` divisors, or a ConfigError."""
    plain, _ = rope_inv_freq(arch)
    for setting in _LLAMA3_SETTINGS:
        candidate = dataclasses.replace(arch, rope_scaling=RopeScaling(rope_type="llama3", **setting))
        scaled, _ = rope_inv_freq(candidate)
        if np.allclose((plain / scaled).numpy(), divisors.reshape(-1), rtol=1e-5, atol=0):
            return candidate
    raise ConfigError(f"{path}: tensor 'rope_freqs.weight' does not match Llama 3 rope scaling at the published "
                      f"settings ({_LLAMA3_SETTINGS}); this RoPE scaling is not supported")


def read_gguf_arch(reader, path: str) -> ModelArch:
    arch = _value(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    family = SUPPORTED_ARCHITECTURES[arch][0]
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    heads = int(_value(reader, f"{arch}.attention.head_count", path))
    hidden = int(_value(reader, f"{arch}.embedding_length", path))
    head_dim = int(_value(reader, f"{arch}.attention.key_length", path, hidden // heads))
    rotary = int(_value(reader, f"{arch}.rope.dimension_count", path, head_dim))
    if rotary != head_dim:
        raise ConfigError(f"{path}: GGUF metadata field '{arch}.rope.dimension_count' = {rotary} != head_dim "
                          f"{head_dim}: partial rotary embeddings are not supported")
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    if window is not None:
        raise ConfigError(f"{path}: GGUF metadata field '{arch}.attention.sliding_window' is not supported")
    return ModelArch(
        family=family,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        head_dim=head_dim,
        rope_scaling=_rope_scaling(reader, arch, path),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        num_layers=int(_value(reader, f"{arch}.block_count", path)),
        hidden_size=hidden,
        ffn_hidden_size=int(_value(reader, f"{arch}.feed_forward_length", path)),
        num_attention_heads=heads,
        num_query_groups=int(_value(reader, f"{arch}.attention.head_count_kv", path, heads)),
        rope_theta=float(_value(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        norm_eps=float(np.float32(_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", path))),
        tie_word_embeddings=not has_output,
        max_position_embeddings=int(_value(reader, f"{arch}.context_length", path)),
    )


def read_gguf_tokenizer(reader, path: str) -> TokenizerSpec:
    model = _value(reader, "tokenizer.ggml.model", path)
    if model != "gpt2":
        raise ConfigError(f"{path}: tokenizer model '{model}' is not supported (byte-level BPE 'gpt2' only)")
    template = reader.fields.get("tokenizer.chat_template")
    return TokenizerSpec(
        tokens=list(_value(reader, "tokenizer.ggml.tokens", path)),
        merges=list(_value(reader, "tokenizer.ggml.merges", path)),
        token_types=[int(x) for x in _value(reader, "tokenizer.ggml.token_type", path)],
        bos_token_id=int(_value(reader, "tokenizer.ggml.bos_token_id", path, -1)),
        eos_token_id=int(_value(reader, "tokenizer.ggml.eos_token_id", path)),
        pad_token_id=int(_value(reader, "tokenizer.ggml.padding_token_id", path, -1)),
        chat_template=template.contents() if template is not None else None,
        pre_tokenizer=str(_value(reader, "tokenizer.ggml.pre", path, "default")),
    )


def read_gguf(path: str | os.PathLike) -> tuple[ModelArch, dict[str, torch.Tensor], TokenizerSpec]:
    """(architecture, HF-named float32 state dict, tokenizer) of a Llama GGUF file."""
    path = os.fspath(path)
    reader = _open(path)
    arch = read_gguf_arch(reader, path)
    permuted = SUPPORTED_ARCHITECTURES[_value(reader, "general.architecture", path)][1]
    spec = read_gguf_tokenizer(reader, path)
    for attr in ("bos_token_id", "pad_token_id"):
        if getattr(spec, attr) < 0:
            setattr(spec, attr, None)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        try:
            values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        except Exception as exc:
            raise ConfigError(f"{path}: tensor '{tensor.name}' cannot be dequantized ({exc})") from None
        values = values.reshape([int(x) for x in reversed(tensor.shape)])  # GGUF lists (in, out)
        name = tensor.name
        if name == "token_embd.weight":
            hf_name = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf_name = "model.norm.weight"
        elif name == "output.weight":
            hf_name = "lm_head.weight"
        elif name == "rope_freqs.weight":
            if arch.rope_scaling is None:
                arch = _llama3_from_rope_freqs(arch, values, path)
            continue
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _LAYER_NAMES or suffix not in ("weight", "bias"):
                raise ConfigError(f"{path}: tensor '{name}' is not supported for GGUF architecture "
                                  f"'{_value(reader, 'general.architecture', path)}'")
            if permuted and kind == "attn_q":
                values = _unpermute_rope_rows(values, arch.num_attention_heads)
            elif permuted and kind == "attn_k":
                values = _unpermute_rope_rows(values, arch.num_query_groups)
            hf_name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        else:
            raise ConfigError(f"{path}: tensor '{name}' is not supported")
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return arch, state, spec
