"""Llama-family architecture description shared by the trainer, the rollout engines and the converters.

One `ModelArch` describes the network's shapes; it is read from a GGUF header, an HF `config.json`,
or named presets, and turned into Megatron's `TransformerConfig` by `trainer/model.py`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

from megatron_rl.config import ConfigError, require


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelArch:
    """Shapes of a Llama-family decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention)."""

    vocab_size: int
    """Tokenizer vocabulary size (unpadded; trainers pad it for tensor parallelism)."""
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width d_model."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP (size of each of gate and up)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (grouped-query attention); equal to num_attention_heads for plain MHA."""
    head_dim: int | None = None
    """Per-head width; defaults to hidden_size // num_attention_heads."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + response) the model supports."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "ffn_hidden_size",
                     "num_attention_heads", "num_query_groups", "max_position_embeddings"):
            require(getattr(self, name) > 0, name, "must be positive")
        require(self.num_attention_heads % self.num_query_groups == 0, "num_query_groups",
                f"{self.num_query_groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None:
            require(self.hidden_size % self.num_attention_heads == 0, "head_dim",
                    f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        require(self.head_dim % 2 == 0, "head_dim", "must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * f + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    # --- HF config.json -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict[str, Any], where: str = "config.json") -> "ModelArch":
        archs = config.get("architectures") or [config.get("model_type", "?")]
        if config.get("model_type") not in (None, "llama", "mistral", "qwen2") and "LlamaForCausalLM" not in archs:
            raise ConfigError(f"{where}: unsupported architecture {archs} (model_type="
                              f"{config.get('model_type')!r}); megatron_rl supports Llama-family models")
        try:
            return cls(
                vocab_size=int(config["vocab_size"]),
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=int(config["hidden_size"]),
                ffn_hidden_size=int(config["intermediate_size"]),
                num_attention_heads=int(config["num_attention_heads"]),
                num_query_groups=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                head_dim=config.get("head_dim"),
                rope_theta=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            )
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from None

    def to_hf_config(self, **extra: Any) -> dict[str, Any]:
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        config.update(extra)
        return config

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelArch":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        return cls.from_hf_config(data, where=os.fspath(path))


PRESETS: dict[str, ModelArch] = {
    # Fast tests: 4 heads in 2 query groups divide by TP=2; 4 layers divide by PP=2.
    "tiny": ModelArch(vocab_size=256, num_layers=4, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=2, rope_theta=10000.0,
                      tie_word_embeddings=False, max_position_embeddings=256),
    "smollm2-135m": ModelArch(vocab_size=49152, num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                              num_attention_heads=9, num_query_groups=3, rope_theta=100000.0,
                              tie_word_embeddings=True, max_position_embeddings=8192),
    "llama3-8b": ModelArch(vocab_size=128256, num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                           num_attention_heads=32, num_query_groups=8, rope_theta=500000.0,
                           max_position_embeddings=8192),
    "llama3-70b": ModelArch(vocab_size=128256, num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                            num_attention_heads=64, num_query_groups=8, rope_theta=500000.0,
                            max_position_embeddings=8192),
    "llama3-405b": ModelArch(vocab_size=128256, num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                             num_attention_heads=128, num_query_groups=8, rope_theta=500000.0,
                             max_position_embeddings=8192),
}


def preset(name: str) -> ModelArch:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model preset '{name}'{hint} (known: {', '.join(PRESETS)})")
    return PRESETS[name]
