"""Read a llama.cpp GGUF file into HF-layout float32 tensors, its architecture and its tokenizer.

GGUF architectures `llama` (also Mistral and SmolLM2), `qwen2` (q/k/v biases), `qwen3` (q/k norms), `gemma2` and
`gemma3` (their norms stored as 1 + w, their SentencePiece vocabulary built by transformers' GGUF tokenizer
converter) map to the families of models/families.py. Quantized tensors are dequantized with the `gguf` package.
llama.cpp's converter permutes the rows of a `llama` model's q_proj and k_proj so that its interleaved RoPE
applies; `_unpermute_rope_rows` undoes that to recover the HF (rotate-half) layout that Megatron and our
engine use (Qwen models are stored unpermuted). RoPE scaling: `rope.scaling.type` linear / yarn is read
from the metadata; Llama 3.1's scaling is stored only as a `rope_freqs` tensor of per-dimension divisors,
which is matched against the llama3 formula at the published settings, or refused.

Mixture-of-experts architectures (`qwen2moe`, `qwen3moe`, `glm4moe`, and `deepseek2` with DeepSeek-V3's sigmoid
router) are read through an HF config built from the metadata as llama.cpp's converter writes it
(`families.from_hf_config`, so every family rule and refusal applies), with the experts' stacked tensors
(`ffn_{gate,up,down}_exps`, [E, out, in]) split per expert, the router bias `exp_probs_b`, shared experts
(`*_shexp`), and DeepSeek's multi-latent attention as llama.cpp stores it for weight absorption: MQA metadata (one KV
head of kv_lora_rank + rope dims) and `attn_kv_b` split into `attn_k_b` (transposed) and `attn_v_b`, joined back
here. GLM-4.5's multi-token-prediction blocks (after the decoder's, `nextn_predict_layers`) are skipped, as
transformers skips them. llama.cpp applies these models' RoPE to the rows as transformers stores them (no
permutation); `qwen2moe` / `qwen3moe` renormalise the top-k weights as llama.cpp's graphs do (never / always)
unless `expert_weights_norm` says otherwise.
"""
from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import TokenizerSpec
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch, RopeScaling
from megatron_rl.models.rope import rope_inv_freq

# GGUF general.architecture -> (our family, whether q/k rows are permuted for interleaved RoPE)
SUPPORTED_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
# Llama 3.x rope scaling as published (factor 8 for 3.1 / 3.3, 32 for 3.2), tried against `rope_freqs`.
_LLAMA3_SETTINGS = [dict(factor=f, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
                    for f in (8.0, 32.0, 16.0, 4.0, 2.0)]

# GGUF architecture -> our mixture-of-experts family (read through an HF config, `_moe_hf_config`)
MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3"}
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

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


_MOE_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "post_attention_norm": "post_attention_layernorm",  # glm4moe's name for the norm before the MLP
}
# Gemma 3's per-layer norms as llama.cpp names them (its `ffn_norm` precedes the MLP, `post_attention_norm` follows
# the attention), stored as 1 + w: llama.cpp's RMSNorm multiplies by the weight alone
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# GGUF architecture -> (our family, llama.cpp's period of global layers, the 27B shape's layer count), which its
# graphs fix in code (`_gemma_hf_config`)
GEMMA_ARCHITECTURES = {"gemma3": ("gemma3_text", 6, 62), "gemma2": ("gemma2", 2, 46)}
_EXPERT_PROJECTIONS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # index in hf_expert_names
_SHARED_PROJECTIONS = {"ffn_gate_shexp": 0, "ffn_up_shexp": 1, "ffn_down_shexp": 2}


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


def _rope_scaling(reader, arch: str, path: str, allow_log_multiplier: bool = False) -> RopeScaling | None:
    kind = str(_value(reader, f"{arch}.rope.scaling.type", path, "none"))
    if kind == "none":
        return None
    factor = float(_value(reader, f"{arch}.rope.scaling.factor", path))
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    if kind == "yarn":
        refused = ("rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor") + (
            () if allow_log_multiplier else ("rope.scaling.yarn_log_multiplier",))
        for key in refused:
            if f"{arch}.{key}" in reader.fields:
                raise ConfigError(f"{path}: GGUF metadata field '{arch}.{key}' is not supported for yarn")
        # DeepSeek's mscale_all_dim, stored by llama.cpp as 0.1 x it (the attention factor it implies is
        # mscale(factor, mscale) / mscale(factor, mscale_all_dim), 1 when the two are equal, as DeepSeek-V3 ships)
        multiplier = reader.fields.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        mscale = None if multiplier is None else round(float(multiplier.contents()) / 0.1, 6)
        beta_fast = reader.fields.get(f"{arch}.rope.scaling.yarn_beta_fast")
        beta_slow = reader.fields.get(f"{arch}.rope.scaling.yarn_beta_slow")
        return RopeScaling(rope_type="yarn", factor=factor,
                           original_max_position_embeddings=int(_value(reader, f"{arch}.rope.scaling.original_context_length", path)),
                           beta_fast=None if beta_fast is None else float(beta_fast.contents()),
                           beta_slow=None if beta_slow is None else float(beta_slow.contents()),
                           mscale=mscale, mscale_all_dim=mscale)
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


def _moe_hf_config(reader, arch: str, path: str) -> dict:
    """The HF config.json of a mixture-of-experts GGUF, as transformers would read the model llama.cpp converted."""
    def get(key: str, default=None):
        return _value(reader, f"{arch}.{key}", path, default)

    family = MOE_ARCHITECTURES[arch]
    tensors = {t.name for t in reader.tensors}
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    heads = int(get("attention.head_count"))
    config = {
        "model_type": family, "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "num_hidden_layers": layers, "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(np.float32(get("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_experts_per_tok": int(get("expert_used_count")), "moe_intermediate_size": int(get("expert_feed_forward_length")),
    }
    experts = int(get("expert_count"))
    norm = reader.fields.get(f"{arch}.expert_weights_norm")
    norm = None if norm is None else norm.contents()
    if family in ("qwen2_moe", "qwen3_moe"):
        config.update(num_experts=experts, norm_topk_prob=bool(norm) if norm is not None else family == "qwen3_moe")
        if family == "qwen3_moe":
            config["head_dim"] = int(get("attention.key_length", config["hidden_size"] // heads))
        else:
            config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    else:  # glm4moe / deepseek2: DeepSeek-V3's router
        gating = int(get("expert_gating_func", 0))
        if gating != _GATING_SIGMOID:
            raise ConfigError(f"{path}: GGUF metadata field '{arch}.expert_gating_func' = {gating}: only the sigmoid "
                              f"router ({_GATING_SIGMOID}, DeepSeek-V3's) is supported for {arch} (DeepSeek-V2's softmax "
                              "router is not)")
        config.update(n_routed_experts=experts, n_shared_experts=int(get("expert_shared_count", 0)),
                      first_k_dense_replace=int(get("leading_dense_block_count", 0)),
                      routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                      norm_topk_prob=bool(norm) if norm is not None else False,
                      n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)))
    if family == "glm4_moe":
        head_dim = int(get("attention.key_length", config["hidden_size"] // heads))
        config.update(head_dim=head_dim, partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
                      attention_bias="blk.0.attn_q.bias" in tensors, use_qk_norm="blk.0.attn_q_norm.weight" in tensors)
    if family == "deepseek_v3":  # llama.cpp writes MLA as MQA: one KV head of kv_lora_rank + rope dims
        rope = int(get("rope.dimension_count"))
        config.update(num_key_value_heads=heads, kv_lora_rank=int(get("attention.kv_lora_rank")),
                      q_lora_rank=int(get("attention.q_lora_rank", 0)) or None, qk_rope_head_dim=rope,
                      qk_nope_head_dim=int(get("attention.key_length_mla")) - rope,
                      v_head_dim=int(get("attention.value_length_mla")), rope_interleave=True)
    scaling = _rope_scaling(reader, arch, path, allow_log_multiplier=family == "deepseek_v3")
    if scaling is not None:
        config["rope_scaling"] = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return config


def _gemma_hf_config(reader, arch: str, path: str) -> dict:
    """The HF config.json of a Gemma 2 / 3 GGUF, with what llama.cpp's graphs fix in code rather than in the metadata:
    the layer pattern (Gemma 3: every sixth layer global, Gemma 2: every other; unless
    `attention.sliding_window_pattern` says), Gemma 3's sliding layers' RoPE base 10,000 (unless
    `rope.freq_base_swa` says), q . k scaled by 1/sqrt(head_dim) except for the 27B shapes (1/sqrt(hidden / heads)),
    which is `query_pre_attn_scalar` of each published size."""
    family, period, layers_27b = GEMMA_ARCHITECTURES[arch]

    def get(key: str, default=None):
        return _value(reader, f"{arch}.{key}", path, default)

    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{path}: GGUF metadata field '{arch}.attention.value_length' differs from key_length")
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1000000.0 if arch == "gemma3"
                                                                        else 10000.0))}
    scaling = _rope_scaling(reader, arch, path)
    if scaling is not None:
        rope.update({k: v for k, v in dataclasses.asdict(scaling).items() if v is not None})
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", period)  # a period, or one flag per layer
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ConfigError(f"{path}: GGUF metadata field '{arch}.attention.sliding_window_pattern' has "
                              f"{len(pattern)} entries for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    config = {
        "model_type": family, "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim, "rms_norm_eps": float(np.float32(get("attention.layer_norm_rms_epsilon"))),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "sliding_window": None if window is None else int(window.contents()),
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in sliding],
        "query_pre_attn_scalar": hidden // heads if layers == layers_27b else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if arch == "gemma3":
        config["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}}
    else:
        caps = {field: reader.fields.get(f"{arch}.{field}") for field in ("attn_logit_softcapping",
                                                                           "final_logit_softcapping")}
        config.update(rope_parameters=rope, **{field: None if value is None else float(value.contents())
                                              for field, value in caps.items()})
    return config


def read_gguf_arch(reader, path: str) -> ModelArch:
    arch = _value(reader, "general.architecture", path)
    if arch in MOE_ARCHITECTURES:
        return families.from_hf_config(_moe_hf_config(reader, arch, path), where=path)
    if arch in GEMMA_ARCHITECTURES:
        return families.from_hf_config(_gemma_hf_config(reader, arch, path), where=path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported architecture '{arch}' (supported: "
                          f"{', '.join([*SUPPORTED_ARCHITECTURES, *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES])})")
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
    template = reader.fields.get("tokenizer.chat_template")
    end_of_turn = [int(reader.fields[k].contents()) for k in ("tokenizer.ggml.eot_token_id",
                                                              "tokenizer.ggml.eom_token_id") if k in reader.fields]
    if model == "llama":  # SentencePiece (Gemma): transformers' GGUF tokenizer converter builds it from the file
        if _value(reader, "general.architecture", path) in GEMMA_ARCHITECTURES and not end_of_turn:
            # Gemma's published generation configs end responses at <eos> and <end_of_turn>
            tokens = reader.fields["tokenizer.ggml.tokens"]
            end_of_turn = [i for i, index in enumerate(tokens.data)
                           if bytes(tokens.parts[index]) == b"<end_of_turn>"][:1]
        return TokenizerSpec(tokens=[], merges=[], token_types=[], bos_token_id=None,
                             eos_token_id=int(_value(reader, "tokenizer.ggml.eos_token_id", path)), pad_token_id=None,
                             chat_template=template.contents() if template is not None else None, gguf_file=path,
                             end_of_turn_ids=end_of_turn)
    if model != "gpt2":
        raise ConfigError(f"{path}: tokenizer model '{model}' is not supported (byte-level BPE 'gpt2', SentencePiece "
                          "'llama')")
    return TokenizerSpec(
        tokens=list(_value(reader, "tokenizer.ggml.tokens", path)),
        merges=list(_value(reader, "tokenizer.ggml.merges", path)),
        token_types=[int(x) for x in _value(reader, "tokenizer.ggml.token_type", path)],
        bos_token_id=int(_value(reader, "tokenizer.ggml.bos_token_id", path, -1)),
        eos_token_id=int(_value(reader, "tokenizer.ggml.eos_token_id", path)),
        pad_token_id=int(_value(reader, "tokenizer.ggml.padding_token_id", path, -1)),
        chat_template=template.contents() if template is not None else None,
        pre_tokenizer=str(_value(reader, "tokenizer.ggml.pre", path, "default")),
        end_of_turn_ids=end_of_turn,
    )


def read_gguf(path: str | os.PathLike) -> tuple[ModelArch, dict[str, torch.Tensor], TokenizerSpec]:
    """(architecture, HF-named float32 state dict, tokenizer) of a Llama GGUF file."""
    path = os.fspath(path)
    reader = _open(path)
    arch = read_gguf_arch(reader, path)
    gguf_arch = _value(reader, "general.architecture", path)
    if gguf_arch in MOE_ARCHITECTURES:
        return arch, _read_moe_state(reader, arch, path), _read_tokenizer(reader, path)
    gemma = gguf_arch in GEMMA_ARCHITECTURES
    layer_names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    permuted = not gemma and SUPPORTED_ARCHITECTURES[gguf_arch][1]
    spec = _read_tokenizer(reader, path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = _dequantized(tensor, path)
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
            if kind not in layer_names or suffix not in ("weight", "bias"):
                raise ConfigError(f"{path}: tensor '{name}' is not supported for GGUF architecture "
                                  f"'{_value(reader, 'general.architecture', path)}'")
            if permuted and kind == "attn_q":
                values = _unpermute_rope_rows(values, arch.num_attention_heads)
            elif permuted and kind == "attn_k":
                values = _unpermute_rope_rows(values, arch.num_query_groups)
            hf_name = f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
        else:
            raise ConfigError(f"{path}: tensor '{name}' is not supported")
        if gemma and hf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return arch, state, spec


def _read_tokenizer(reader, path: str) -> TokenizerSpec:
    spec = read_gguf_tokenizer(reader, path)
    for attr in ("bos_token_id", "pad_token_id"):
        if getattr(spec, attr) is not None and getattr(spec, attr) < 0:
            setattr(spec, attr, None)
    return spec


def _dequantized(tensor, path: str) -> np.ndarray:
    try:
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    except Exception as exc:
        raise ConfigError(f"{path}: tensor '{tensor.name}' cannot be dequantized ({exc})") from None
    return values.reshape([int(x) for x in reversed(tensor.shape)])  # GGUF lists (in, out)


def _read_moe_state(reader, arch: ModelArch, path: str) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of a mixture-of-experts GGUF (the published per-expert names)."""
    family = families.get_family(arch.family)
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    state: dict[str, np.ndarray] = {}
    absorbed: dict[tuple[int, str], np.ndarray] = {}  # DeepSeek's attn_k_b / attn_v_b, joined per layer
    for tensor in reader.tensors:
        name = tensor.name
        if name in top:
            state[top[name]] = _dequantized(tensor, path)
            continue
        parts = name.split(".", 3)
        if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
            raise ConfigError(f"{path}: tensor '{name}' is not supported")
        _, index, kind, suffix = parts
        layer = int(index)
        if layer >= arch.num_layers:  # multi-token-prediction blocks after the decoder's: not built
            continue
        values = _dequantized(tensor, path)
        prefix = f"model.layers.{layer}."
        if kind in _EXPERT_PROJECTIONS and suffix == "weight":
            for expert in range(values.shape[0]):
                state[families.hf_expert_names(family, layer, expert)[_EXPERT_PROJECTIONS[kind]]] = values[expert]
        elif kind in _SHARED_PROJECTIONS and suffix == "weight":
            state[families.hf_shared_expert_names(family, layer)[_SHARED_PROJECTIONS[kind]]] = values
        elif kind == "ffn_gate_inp_shexp" and suffix == "weight":
            state[families.hf_shared_expert_names(family, layer)[3]] = values.reshape(1, -1)
        elif kind == "exp_probs_b":
            state[families.hf_router_bias_name(family, layer)] = values
        elif kind in ("attn_k_b", "attn_v_b") and suffix == "weight":
            absorbed[layer, kind] = values
        elif kind in _LAYER_NAMES and suffix in ("weight", "bias"):
            state[f"{prefix}{_LAYER_NAMES[kind]}.{suffix}"] = values
        elif kind in _MOE_LAYER_NAMES and suffix in ("weight", "bias"):
            state[f"{prefix}{_MOE_LAYER_NAMES[kind]}.{suffix}"] = values
        else:
            raise ConfigError(f"{path}: tensor '{name}' is not supported for GGUF architecture "
                              f"'{_value(reader, 'general.architecture', path)}'")
    for layer in sorted({layer for layer, _ in absorbed}):
        if (layer, "attn_k_b") not in absorbed or (layer, "attn_v_b") not in absorbed:
            raise ConfigError(f"{path}: block {layer} has one of attn_k_b / attn_v_b without the other")
        k_b = absorbed[layer, "attn_k_b"].swapaxes(1, 2)  # [heads, kv_lora, nope] -> [heads, nope, kv_lora]
        v_b = absorbed[layer, "attn_v_b"]  # [heads, v, kv_lora]
        state[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = np.concatenate([k_b, v_b], axis=1).reshape(
            -1, k_b.shape[-1])
    return {name: torch.from_numpy(np.ascontiguousarray(values)) for name, values in state.items()}

