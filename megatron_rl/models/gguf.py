"""Read a llama.cpp GGUF file into HF-layout float32 tensors, its architecture and its tokenizer.

Quantized tensors are dequantized with the `gguf` package. llama.cpp's converter permutes the rows of
q_proj and k_proj so that its interleaved RoPE applies; `_unpermute_rope_rows` undoes that to recover
the HF (rotate-half) layout that Megatron and our engine use.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import TokenizerSpec
from megatron_rl.models.arch import ModelArch

SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
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


def read_gguf_arch(reader, path: str) -> ModelArch:
    arch = _value(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    heads = int(_value(reader, f"{arch}.attention.head_count", path))
    return ModelArch(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        num_layers=int(_value(reader, f"{arch}.block_count", path)),
        hidden_size=int(_value(reader, f"{arch}.embedding_length", path)),
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
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: derived from rope_theta
            if kind == "attn_q":
                values = _unpermute_rope_rows(values, arch.num_attention_heads)
            elif kind == "attn_k":
                values = _unpermute_rope_rows(values, arch.num_query_groups)
            hf_name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
        else:
            continue
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return arch, state, spec
