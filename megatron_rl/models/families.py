"""The architecture registry: every supported model family declares here how its HF config maps to `ModelArch`.

A family names the HF `model_type` / `architectures` it accepts, the config fields whose numerics it honours
(everything else that changes numerics is refused with a ConfigError naming the file and field), and what an
export writes so that transformers loads it as the same class. The trainer (`trainer/model.py`), the
converter (`models/megatron_layout.py`) and the engines read the resulting `ModelArch` flags
(attention_bias, qk_norm, rope_scaling). docs/models.md lists the families and how to add one.
Torch-free.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ROPE_TYPES, ModelArch, RopeScaling


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported decoder family."""

    name: str
    model_types: tuple[str, ...]
    """HF `model_type` values it accepts; the first one is written on export."""
    architectures: tuple[str, ...]
    """HF `architectures` entries it accepts; the first one is written on export."""
    config_class: str
    """The transformers config class that describes it (tests build tiny models from it)."""
    qkv_bias: bool = False
    """q/k/v projections always carry biases (Qwen2: hard-wired, no config field)."""
    qk_norm: bool = False
    """Per-head q/k RMSNorm before RoPE (Qwen3: hard-wired)."""
    bias_field: str | None = None
    """HF field that would add biases to q/k/v *and* o_proj (Llama, Qwen3): refused when true."""
    window_flag: str | None = None
    """HF field that switches `sliding_window` on (Qwen); None means the window always applies (Mistral)."""
    has_window: bool = False
    """The family's HF config carries `sliding_window` at all."""
    window_layer_types: bool = False
    """The window applies only to the layers `layer_types` marks "sliding_attention" (Qwen2, Qwen3)."""
    moe_block: str | None = None
    """Mixture-of-experts family: the HF module name of each layer's sparse block in published checkpoints
    (qwen3_moe `mlp`, mixtral `block_sparse_moe`); None for a dense family."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The (gate, up, down) projection names of one expert in published checkpoints (mixtral: w1, w3, w2)."""
    experts_field: str = "num_experts"
    """HF field holding the number of experts (transformers 5 also accepts `num_local_experts` for both)."""
    expert_size_field: str = "moe_intermediate_size"
    """HF field holding each expert's intermediate size."""
    norm_topk_field: str | None = None
    """HF field switching the renormalisation of the top-k router weights; None: always renormalised."""
    shared_expert_field: str | None = None
    """HF field holding the intermediate size of each MoE layer's gated shared expert (Qwen2-MoE); None: the
    family has none (the field is refused where another family spells it)."""
    shared_expert_count_field: str | None = None
    """HF field counting each MoE layer's ungated shared experts, run as one SwiGLU of count x the expert width
    (GLM-4.5, DeepSeek `n_shared_experts`); None: see `shared_expert_field`."""
    shared_expert_module: str = "shared_expert"
    """The shared expert's module name under the MoE block (Qwen2-MoE `shared_expert`, GLM-4.5 `shared_experts`)."""
    sigmoid_router: bool = False
    """The router scores each expert with a sigmoid and chooses with a per-expert `e_score_correction_bias`,
    group-limited (`n_group`, `topk_group`) and scaled (`routed_scaling_factor`) as DeepSeek-V3 (GLM-4.5)."""
    qkv_bias_field: str | None = None
    """HF field that switches q/k/v biases on (never the output projection's): GLM-4.5's `attention_bias`."""
    qk_norm_field: str | None = None
    """HF field that switches the per-head q/k RMSNorm on (GLM-4.5's `use_qk_norm`)."""
    partial_rotary: bool = False
    """The family's transformers model rotates only the first `partial_rotary_factor` of each head (GLM-4.5)."""
    mtp_layers_field: str | None = None
    """HF field counting multi-token-prediction layers stored after the decoder's (GLM-4.5
    `num_nextn_predict_layers`): transformers builds none and ignores their tensors on load, and so do we."""
    mla: bool = False
    """Multi-latent attention (DeepSeek-V2/V3): `kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
    `v_head_dim` and `rope_interleave` are read."""
    gemma: bool = False
    """Gemma 2 / 3's layer numerics: (1 + w) RMSNorms everywhere, post-attention and post-feed-forward norms,
    embeddings scaled by sqrt(hidden_size), softmax scale `query_pre_attn_scalar` ** -0.5, a GeGLU MLP
    (`hidden_activation`), `final_logit_softcapping`."""
    layer_type_rope: bool = False
    """`rope_parameters` holds one entry per layer type, the sliding-window layers' with a base of their own
    (Gemma 3)."""
    attn_softcap: bool = False
    """The family's transformers attention applies `attn_logit_softcapping` (Gemma 2; Gemma 3's carries the field
    but never passes it to its attention: a value there is refused)."""
    gpt_oss: bool = False
    """GPT-OSS's numerics: learned attention sinks (`self_attn.sinks`), `attention_bias` switching biases on q/k/v
    and o_proj together, a router (`mlp.router`) with a logit bias, biased experts with the clamped SwiGLU
    (`swiglu_alpha`, `swiglu_limit`, up + 1), stored stacked: `mlp.experts.gate_up_proj` [E, H, 2I] with gate
    and up columns interleaved, `mlp.experts.down_proj` [E, I, H], and their biases (`canonical_hf_state` and
    `published_hf_state` in models/megatron_layout.py turn them into per-expert tensors and back)."""
    dense_layers_field: str | None = None
    """How the family's HF config names its dense layers among the MoE ones: "mlp_only_layers" (Qwen-MoE: that
    list, and every layer whose 1-based index `decoder_sparse_step` does not divide), "first_k_dense_replace"
    (DeepSeek, GLM-4.5: the leading k layers); None: every layer is MoE (Mixtral)."""


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Llama 1 to 3.3 and SmolLM2 (a Llama with tied embeddings).
    Family("llama", ("llama",), ("LlamaForCausalLM",), "LlamaConfig", bias_field="attention_bias"),
    Family("mistral", ("mistral",), ("MistralForCausalLM",), "MistralConfig", has_window=True),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "Qwen2Config", qkv_bias=True,
           window_flag="use_sliding_window", has_window=True, window_layer_types=True),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), "Qwen3Config", qk_norm=True, bias_field="attention_bias",
           window_flag="use_sliding_window", has_window=True, window_layer_types=True),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), "Qwen3MoeConfig", qk_norm=True,
           bias_field="attention_bias", window_flag="use_sliding_window", has_window=True, moe_block="mlp",
           norm_topk_field="norm_topk_prob", dense_layers_field="mlp_only_layers"),
    # Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (q/k/v biases), softmax top-k routing and a shared expert
    # behind a sigmoid gate in every MoE layer.
    Family("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",), "Qwen2MoeConfig", qkv_bias=True,
           window_flag="use_sliding_window", has_window=True, window_layer_types=True, moe_block="mlp",
           norm_topk_field="norm_topk_prob", shared_expert_field="shared_expert_intermediate_size",
           dense_layers_field="mlp_only_layers"),
    # GLM-4.5 / 4.6 (and GLM-4.5-Air): GQA with optional q/k/v biases and q/k norms, half-rotary RoPE, leading dense
    # layers, DeepSeek-V3's router (sigmoid, expert-score bias, groups, scaling) and an ungated shared expert.
    Family("glm4_moe", ("glm4_moe",), ("Glm4MoeForCausalLM",), "Glm4MoeConfig", moe_block="mlp",
           experts_field="n_routed_experts", norm_topk_field="norm_topk_prob",
           shared_expert_count_field="n_shared_experts", shared_expert_module="shared_experts", sigmoid_router=True,
           qkv_bias_field="attention_bias", qk_norm_field="use_qk_norm", partial_rotary=True,
           dense_layers_field="first_k_dense_replace", mtp_layers_field="num_nextn_predict_layers"),
    # DeepSeek-V3 / R1 / V3.1 (and Kimi-K2's layout): multi-latent attention, leading dense layers, the sigmoid router
    # with expert bias and groups, one ungated shared expert.
    Family("deepseek_v3", ("deepseek_v3",), ("DeepseekV3ForCausalLM",), "DeepseekV3Config", moe_block="mlp",
           experts_field="n_routed_experts", norm_topk_field="norm_topk_prob",
           shared_expert_count_field="n_shared_experts", shared_expert_module="shared_experts", sigmoid_router=True,
           mla=True, dense_layers_field="first_k_dense_replace", mtp_layers_field="num_nextn_predict_layers"),
    # Gemma 3 text (Gemma-3-270M / 1B, and the language model of the larger ones): interleaved sliding-window and
    # full layers (every sixth full by default), each type with its own RoPE base.
    Family("gemma3_text", ("gemma3_text",), ("Gemma3ForCausalLM",), "Gemma3TextConfig", qk_norm=True,
           bias_field="attention_bias", has_window=True, window_layer_types=True, gemma=True, layer_type_rope=True),
    # Gemma 2: alternating sliding-window and global layers (one RoPE), soft-capped attention and output logits.
    Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), "Gemma2Config", bias_field="attention_bias",
           has_window=True, window_layer_types=True, gemma=True, attn_softcap=True),
    # GPT-OSS 20B / 120B: alternating 128-token windows and full layers, attention sinks, biases everywhere, YaRN,
    # softmax top-4 routing over biased logits into clamped-SwiGLU experts.
    Family("gpt_oss", ("gpt_oss",), ("GptOssForCausalLM",), "GptOssConfig", has_window=True,
           window_layer_types=True, moe_block="mlp", experts_field="num_local_experts",
           expert_size_field="intermediate_size", gpt_oss=True),
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), "MixtralConfig", has_window=True,
           moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2"), experts_field="num_local_experts",
           expert_size_field="intermediate_size"),
)}

# HF fields of MoE variants that change numerics in ways we do not implement: refused when "active".
_MOE_REFUSED = {
    "shared_expert_intermediate_size": "shared experts are not implemented",
    "n_shared_experts": "shared experts are not implemented",
    "num_shared_experts": "shared experts are not implemented",
    "moe_shared_expert_intermediate_size": "shared experts are not implemented",
    "router_jitter_noise": "router jitter (multiplicative input noise in training) is not implemented",
    "router_z_loss_coef": "a router z-loss is not implemented",
    "first_k_dense_replace": "dense leading layers are not part of this family (every layer is MoE)",
    "moe_layer_freq": "interleaved dense/MoE layers at a stride are not implemented",
    "topk_method": "grouped or biased top-k routing is not implemented (softmax top-k only)",
    "scoring_func": "only a softmax router is implemented",
    "n_group": "grouped top-k routing is not implemented",
    "topk_group": "grouped top-k routing is not implemented",
    "routed_scaling_factor": "scaled routing weights are not implemented",
}
_MOE_NEUTRAL = {"scoring_func": "softmax", "topk_method": "greedy", "routed_scaling_factor": 1.0, "moe_layer_freq": 1}
_SIGMOID_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
"""What DeepSeek-V3's config.json says of the router a sigmoid family implements (absent: the same)."""


def hf_router_name(family: Family, layer: int) -> str:
    """The published HF name of layer `layer`'s router weight [E, H]."""
    return f"model.layers.{layer}.{family.moe_block}.{'router' if family.gpt_oss else 'gate'}.weight"


def hf_router_logit_bias_name(family: Family, layer: int) -> str:
    """The HF name of layer `layer`'s router logit bias [E] (GPT-OSS)."""
    return f"model.layers.{layer}.{family.moe_block}.router.bias"


def hf_router_bias_name(family: Family, layer: int) -> str:
    """The published HF name of layer `layer`'s expert-score correction bias [E] (sigmoid routers)."""
    return f"model.layers.{layer}.{family.moe_block}.gate.e_score_correction_bias"


def hf_shared_expert_names(family: Family, layer: int) -> tuple[str, str, str, str]:
    """The published HF names of layer `layer`'s shared expert (gate [S, H], up [S, H], down [H, S]) and its
    gate [1, H] (Qwen2-MoE)."""
    prefix = f"model.layers.{layer}.{family.moe_block}."
    module = prefix + family.shared_expert_module
    return (module + ".gate_proj.weight", module + ".up_proj.weight", module + ".down_proj.weight",
            prefix + "shared_expert_gate.weight")


def hf_expert_names(family: Family, layer: int, expert: int) -> tuple[str, str, str]:
    """The published HF names of one expert's (gate [I, H], up [I, H], down [H, I]) weights."""
    prefix = f"model.layers.{layer}.{family.moe_block}.experts.{expert}."
    return tuple(prefix + n + ".weight" for n in family.expert_names)  # type: ignore[return-value]


def hf_expert_bias_names(family: Family, layer: int, expert: int) -> tuple[str, str, str]:
    """The per-expert names of one expert's (gate [I], up [I], down [H]) biases (GPT-OSS, whose published
    checkpoints stack them: `canonical_hf_state`)."""
    return tuple(n[:-len("weight")] + "bias" for n in hf_expert_names(family, layer, expert))  # type: ignore


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r} (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of_hf_config(config: dict[str, Any], where: str = "config.json") -> Family:
    """The family whose model_type (or, without one, architectures entry) the HF config names."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    for family in FAMILIES.values():
        if model_type in family.model_types or (model_type is None and any(a in family.architectures for a in archs)):
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())
    raise ConfigError(f"{where}: unsupported architecture {archs or [model_type]} (model_type={model_type!r}); "
                      f"supported families: {supported}")


def _refuse(where: str, field: str, why: str) -> ConfigError:
    return ConfigError(f"{where}: field '{field}': {why}")


def _partial_rotary(family: Family, config: dict[str, Any], where: str) -> float:
    """The share of each head RoPE rotates (1.0 unless the family's transformers model honours less)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None or float(partial) == 1.0:
        return 1.0
    if not family.partial_rotary:
        raise _refuse(where, "partial_rotary_factor", f"{partial}: {family.name}'s transformers model rotates every "
                      "dim of a head (partial rotary embeddings are honoured for glm4_moe)")
    return float(partial)


def _rope_scaling(config: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the transformers 5 `rope_parameters` or the older `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise _refuse(where, f"{field}.rope_type", f"{rope_type!r} is not supported "
                      f"(supported: default, {', '.join(ROPE_TYPES)})")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise _refuse(where, f"{field}.{unknown[0]}", f"not understood for rope_type {rope_type!r}")
    max_positions = int(config.get("max_position_embeddings", 4096))
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if original is None and rope_type in ("llama3", "yarn"):
        original = max_positions  # transformers' default for these two types
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:
        factor = max_positions / original  # transformers derives it this way (DeepSeek-style configs)
    if factor is None:
        raise _refuse(where, f"{field}.factor", f"required for rope_type {rope_type!r}")

    def opt_float(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    try:
        scaling = RopeScaling(
            rope_type=rope_type, factor=float(factor),
            original_max_position_embeddings=None if original is None else int(original),
            low_freq_factor=opt_float("low_freq_factor"), high_freq_factor=opt_float("high_freq_factor"),
            beta_fast=opt_float("beta_fast"), beta_slow=opt_float("beta_slow"), mscale=opt_float("mscale"),
            mscale_all_dim=opt_float("mscale_all_dim"), attention_factor=opt_float("attention_factor"),
            truncate=None if params.get("truncate") is None else bool(params["truncate"]))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return theta, scaling


def _sliding_window(family: Family, config: dict[str, Any], where: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to or None for every layer), as the family's transformers model
    applies them: Mistral and Mixtral window every layer whenever `sliding_window` is set, the Qwen families
    only with `use_sliding_window`, Qwen2 / Qwen3 only on the layers `layer_types` marks
    "sliding_attention" (their config class derives it from `max_window_layers`)."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or []
    if not family.has_window:
        if window is not None or "sliding_attention" in layer_types:
            raise _refuse(where, "sliding_window", f"the {family.name} family has no sliding-window attention")
        return None, None
    active = bool(config.get(family.window_flag, False)) if family.window_flag else True
    if window is None or not active:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse(where, "sliding_window", f"{window!r}: must be a positive number of tokens")
    if not family.window_layer_types:
        return window, None
    if len(layer_types) != int(config["num_hidden_layers"]):
        raise _refuse(where, "layer_types", f"{len(layer_types)} entries for {config['num_hidden_layers']} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise _refuse(where, "layer_types", f"{unknown} not supported (sliding_attention or full_attention)")
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    return (window, layers) if layers else (None, None)


# The shape of every weight: never defaulted (transformers would take its class's 7B defaults and then fail
# on the first tensor); a config without one is refused by name.
REQUIRED_FIELDS = ("vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")


def with_family_defaults(family: Family, config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """`config` with every field it leaves out (or sets to null) read as transformers' own config
    class for the family fills it (`rms_norm_eps` 1e-5 and `rope_theta` 1e6 for Mixtral, `sliding_window`
    4096 for Mistral, `head_dim` 128 for Qwen3, `max_position_embeddings` 2048 for Llama): read from the
    class, which computes the ones that depend on other fields, never restated here."""
    for field in REQUIRED_FIELDS:
        if config.get(field) is None:
            raise _refuse(where, field, "missing: it sets the shape of the weights, so no default can stand in")
    import transformers  # the family's own config class is the reference for its defaults

    config_class = getattr(transformers, family.config_class)
    try:
        resolved = config_class.from_dict(dict(config)).to_dict()
    except Exception as exc:  # noqa: BLE001 - any refusal of the class (huggingface_hub's strict-field errors
        # derive from Exception alone) is a bad config, reported in one line
        raise ConfigError(f"{where}: transformers' {family.config_class} cannot read it: {exc}") from None
    # what the class made of each absent or null field (a null it keeps, e.g. sliding_window, stays null)
    filled = {**config, **{k: v for k, v in resolved.items() if config.get(k) is None}}
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in config and "rope_theta" not in params:  # transformers 5 keeps it in rope_parameters
        theta = (resolved.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            filled["rope_theta"] = theta
    return filled


def from_hf_config(config: dict[str, Any], where: str = "config.json") -> ModelArch:
    """The `ModelArch` an HF config.json describes, refusing any numerics field the family does not honour;
    fields it leaves out take the values transformers gives that family (`with_family_defaults`)."""
    family = family_of_hf_config(config, where)
    config = with_family_defaults(family, config, where)
    if not family.gemma:
        act = config.get("hidden_act", config.get("hidden_activation", "silu"))
        if act != "silu":
            raise _refuse(where, "hidden_act", f"{act!r} is not supported (only 'silu', the SwiGLU MLP)")
    if config.get("mlp_bias"):
        raise _refuse(where, "mlp_bias", "MLP biases are not implemented")
    if config.get("attention_bias") and not family.qkv_bias and family.qkv_bias_field != "attention_bias" \
            and not family.gpt_oss:
        raise _refuse(where, "attention_bias", f"true adds biases to q/k/v and o_proj in {family.name}; "
                      "an output-projection bias is not implemented")
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        raise _refuse(where, "attention_dropout", "attention dropout is not implemented (must be 0)")
    if int(config.get("pretraining_tp") or 1) != 1:
        raise _refuse(where, "pretraining_tp", "sliced-projection emulation (pretraining_tp > 1) is not implemented")
    try:
        max_positions = int(config.get("max_position_embeddings", 4096))
        gemma_fields = _gemma_fields(family, config, where) if family.gemma else {}
        if family.layer_type_rope:  # the full-attention layers' parameters are the model's; the local base a field
            config = {**config, "rope_parameters": config["rope_parameters"]["full_attention"]}
            config.pop("rope_scaling", None)
        theta, scaling = _rope_scaling(config, where)
        arch_fields = dict(
            vocab_size=int(config["vocab_size"]),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            ffn_hidden_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_query_groups=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            head_dim=None if config.get("head_dim") is None else int(config["head_dim"]),
            rope_theta=theta,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from None
    window, window_layers = _sliding_window(family, config, where)
    if family.moe_block:
        arch_fields.update(_moe_fields(family, config, where))
    if family.mla:
        arch_fields.update(_mla_fields(config, where))
    qkv_bias = bool(config.get(family.qkv_bias_field)) if family.qkv_bias_field else family.qkv_bias
    qk_norm = bool(config.get(family.qk_norm_field)) if family.qk_norm_field else family.qk_norm
    gpt_oss_fields = _gpt_oss_fields(config, where) if family.gpt_oss else {}
    if family.gpt_oss:
        qkv_bias = gpt_oss_fields["attention_output_bias"]
    if family.layer_type_rope and window is None:
        gemma_fields.pop("local_rope_theta")  # no sliding layer left to rotate with it
    try:
        return ModelArch(**arch_fields, **gemma_fields, **gpt_oss_fields, family=family.name, attention_bias=qkv_bias,
                         qk_norm=qk_norm, rope_scaling=scaling, sliding_window=window, sliding_window_layers=window_layers,
                         partial_rotary_factor=_partial_rotary(family, config, where))
    except ConfigError as exc:
        hf_name = _HF_NAMES.get(exc.field or "")
        if hf_name:  # name the field as the file spells it
            raise _refuse(where, hf_name, f"{config.get(hf_name)!r} (the file's value, or transformers' default "
                          f"for {family.name} where the file has none) is not usable: {exc.reason or exc}") from None
        raise ConfigError(f"{where}: {exc}") from None


# ModelArch's field names -> the HF config's
_HF_NAMES = {"num_query_groups": "num_key_value_heads", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim", "norm_eps": "rms_norm_eps", "num_layers": "num_hidden_layers",
             "ffn_hidden_size": "intermediate_size", "head_dim": "head_dim", "moe_top_k": "num_experts_per_tok",
             "moe_norm_topk_prob": "norm_topk_prob", "moe_router_groups": "n_group", "moe_router_group_topk": "topk_group",
             "moe_routed_scaling_factor": "routed_scaling_factor", "partial_rotary_factor": "partial_rotary_factor"}


def _gpt_oss_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelArch fields of GPT-OSS's numerics (its config class has filled every absent field)."""
    fields: dict[str, Any] = {}
    for field, default in (("swiglu_alpha", 1.702), ("swiglu_limit", None)):  # (transformers 4.x: alpha fixed)
        value = config.get(field, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise _refuse(where, field, f"{value!r}: must be a positive number")
        fields[field] = None if value is None else float(value)
    bias = config.get("attention_bias", True)
    if not isinstance(bias, bool):
        raise _refuse(where, "attention_bias", f"{bias!r}: must be true or false")
    return dict(fields, attention_sinks=True, attention_output_bias=bias, moe_router_bias=True, expert_biases=True,
                glu_linear_offset=1.0)


_GPT_OSS_EXPECTED = dict(attention_sinks=True, moe_router_bias=True, expert_biases=True, glu_linear_offset=1.0)


def _gpt_oss_config(family: Family, arch: ModelArch) -> dict[str, Any]:
    """The GPT-OSS HF fields of `arch` (refusing, for every family, numerics its config cannot spell)."""
    if not family.gpt_oss:
        if arch.attention_sinks or arch.attention_output_bias or arch.moe_router_bias or arch.expert_biases \
                or arch.swiglu_alpha != 1.0 or arch.swiglu_limit is not None or arch.glu_linear_offset:
            raise ConfigError(f"model family {family.name!r} cannot express GPT-OSS's attention sinks, biases or "
                              "clamped SwiGLU in an HF config")
        return {}
    if any(getattr(arch, k) != v for k, v in _GPT_OSS_EXPECTED.items()) \
            or arch.attention_output_bias != arch.attention_bias:
        raise ConfigError(f"model family {family.name!r} has sinks, router and expert biases, the +1 SwiGLU offset, "
                          "and o_proj biases exactly when q/k/v ones: "
                          + ", ".join(f"{k}={getattr(arch, k)}" for k in (*_GPT_OSS_EXPECTED, "attention_bias",
                                                                          "attention_output_bias")))
    return {"attention_bias": arch.attention_bias, "swiglu_alpha": arch.swiglu_alpha,
            "swiglu_limit": arch.swiglu_limit}


_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}


def _gemma_fields(family: Family, config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelArch fields of Gemma 2 / 3's layer numerics (their config classes have filled every absent field)."""
    act = config.get("hidden_activation")
    if act not in _GEMMA_ACTIVATIONS:
        raise _refuse(where, "hidden_activation", f"{act!r} is not supported (supported: "
                      f"{', '.join(_GEMMA_ACTIVATIONS)})")
    caps = {}
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise _refuse(where, field, f"{value!r}: must be a positive number or null")
        caps[field] = None if value is None else float(value)
    if not family.attn_softcap and caps["attn_logit_softcapping"] is not None:
        raise _refuse(where, "attn_logit_softcapping", f"{caps['attn_logit_softcapping']!r}: {family.name}'s "
                      "transformers attention never applies it, so the checkpoint was not trained with it (null)")
    if config.get("use_bidirectional_attention"):
        raise _refuse(where, "use_bidirectional_attention", "bidirectional attention (embedding models) is not "
                      "implemented")
    scalar = config.get("query_pre_attn_scalar")
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise _refuse(where, "query_pre_attn_scalar", f"{scalar!r}: must be a positive number")
    fields = dict(norm_offset=1.0, sandwich_norms=True, embedding_multiplier=int(config["hidden_size"]) ** 0.5,
                  attention_scale=scalar ** -0.5, mlp_activation=_GEMMA_ACTIVATIONS[act], **caps)
    if not family.layer_type_rope:
        return fields
    params = config.get("rope_parameters") or {}
    if set(params) != {"sliding_attention", "full_attention"}:
        raise _refuse(where, "rope_parameters", f"expected one entry per layer type (sliding_attention, "
                      f"full_attention), got {sorted(params)}")
    local = params["sliding_attention"] or {}
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise _refuse(where, "rope_parameters.sliding_attention", f"{local}: only plain RoPE (a rope_theta) is "
                      "implemented for the sliding-window layers")
    return {**fields, "local_rope_theta": float(local.get("rope_theta", 10000.0))}


def _gemma_config(family: Family, arch: ModelArch) -> dict[str, Any]:
    """The Gemma 2 / 3 HF fields of `arch` (refusing numerics the family's config cannot spell)."""
    expected = dict(norm_offset=1.0, sandwich_norms=True, embedding_multiplier=arch.hidden_size ** 0.5)
    if any(getattr(arch, k) != v for k, v in expected.items()) or arch.attention_scale is None \
            or (arch.attn_logit_softcapping is not None and not family.attn_softcap) \
            or (arch.local_rope_theta is not None and not family.layer_type_rope):
        raise ConfigError(f"model family {arch.family!r} cannot express norm_offset={arch.norm_offset}, sandwich_norms="
                          f"{arch.sandwich_norms}, embedding_multiplier={arch.embedding_multiplier}, attention_scale="
                          f"{arch.attention_scale}, attn_logit_softcapping={arch.attn_logit_softcapping}, "
                          f"local_rope_theta={arch.local_rope_theta} in an HF config")
    scalar = arch.attention_scale ** -2
    act = {v: k for k, v in _GEMMA_ACTIVATIONS.items()}[arch.mlp_activation]
    config = {"hidden_activation": act, "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6
              else scalar, "final_logit_softcapping": arch.final_logit_softcapping,
              "attn_logit_softcapping": arch.attn_logit_softcapping, "use_bidirectional_attention": False}
    if family.layer_type_rope:
        local = arch.local_rope_theta if arch.local_rope_theta is not None else arch.rope_theta
        config["rope_parameters"] = {"full_attention": rope_parameters(arch),
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return config


def _moe_fields(family: Family, config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelArch MoE fields of an MoE family's config; refuses the MoE variants we do not implement."""
    honoured = {family.shared_expert_field, family.shared_expert_count_field, family.dense_layers_field}
    if family.sigmoid_router:
        honoured |= {"n_group", "topk_group", "routed_scaling_factor", *_SIGMOID_ROUTER}
        for field, value in _SIGMOID_ROUTER.items():
            if config.get(field, value) != value:
                raise _refuse(where, field, f"{config[field]!r}: {family.name}'s router is {field}={value!r}")
    for field, why in _MOE_REFUSED.items():
        value = config.get(field)
        if field not in honoured and value not in (None, 0, 0.0, False) and _MOE_NEUTRAL.get(field) != value:
            raise _refuse(where, field, f"{value!r}: {why}")
    if "qkv_bias" in config and bool(config["qkv_bias"]) != family.qkv_bias:
        raise _refuse(where, "qkv_bias", f"{config['qkv_bias']!r}: {family.name} without q/k/v biases is not "
                      "implemented")
    experts = config.get(family.experts_field, config.get("num_local_experts", config.get("num_experts")))
    if experts is None:
        raise ConfigError(f"{where}: missing field {family.experts_field!r}")
    if int(experts) < 1:
        raise _refuse(where, family.experts_field, f"{experts}: an MoE model needs at least one expert")
    norm_topk = bool(config.get(family.norm_topk_field, False)) if family.norm_topk_field else True
    try:
        shared = int(config[family.shared_expert_field]) if family.shared_expert_field else 0
        if family.shared_expert_field and shared < 1:
            raise _refuse(where, family.shared_expert_field, f"{shared}: {family.name}'s shared expert needs a "
                          "positive intermediate size")
        if family.shared_expert_count_field:  # n ungated shared experts run as one MLP of n x the expert width
            count = config.get(family.shared_expert_count_field) or 0
            if not isinstance(count, int) or count < 0:
                raise _refuse(where, family.shared_expert_count_field, f"{count!r}: must be a count >= 0")
            shared = count * int(config[family.expert_size_field])
        fields = dict(num_experts=int(experts), moe_top_k=int(config["num_experts_per_tok"]),
                      moe_layers=_moe_layers(family, config, where),
                      moe_ffn_hidden_size=int(config[family.expert_size_field]), moe_norm_topk_prob=norm_topk,
                      router_aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0),
                      shared_expert_ffn_hidden_size=shared,
                      shared_expert_gate=shared > 0 and family.shared_expert_field is not None)
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from None
    if family.sigmoid_router:
        k, groups, kept = fields["moe_top_k"], int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if kept > groups:
            raise ConfigError(f"{where}: field 'topk_group' {kept} exceeds field 'n_group' {groups}: a token cannot "
                              "keep more groups than there are")
        if kept < groups and k // max(kept, 1) != 2:  # the three fields together decide: name them all
            raise ConfigError(f"{where}: field 'num_experts_per_tok' {k} with field 'topk_group' {kept} of field "
                              f"'n_group' {groups}: transformers scores a group by its best two experts, Megatron by "
                              f"its best k / topk_group = {k // max(kept, 1)}; supported when that is 2 (DeepSeek-V3: "
                              "8 / 4) or when every group is kept")
        fields.update(moe_router_score="sigmoid", moe_router_expert_bias=True,
                      moe_router_groups=int(config.get("n_group") or 1),
                      moe_router_group_topk=int(config.get("topk_group") or 1),
                      moe_routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
    return fields


def _mla_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelArch fields of multi-latent attention (DeepSeek-V3's config.json)."""
    if config.get("q_lora_rank") == 0:
        raise ConfigError(f"{where}: field 'q_lora_rank' 0: transformers builds a zero-width query latent; null means "
                          "one q_proj")
    head_dim, rope = config.get("head_dim"), config.get("qk_rope_head_dim")
    if head_dim is not None and rope is not None and head_dim != rope:
        raise ConfigError(f"{where}: field 'head_dim' {head_dim} differs from field 'qk_rope_head_dim' {rope}: "
                          "transformers' rotary embedding is head_dim wide and rotates the qk_rope_head_dim dims")
    try:
        # transformers sets head_dim to the rotary width (its rotary embedding's size)
        return dict(head_dim=int(config["qk_rope_head_dim"]), kv_lora_rank=int(config["kv_lora_rank"]),
                    q_lora_rank=int(config.get("q_lora_rank") or 0),
                    qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                    v_head_dim=int(config["v_head_dim"]), rope_interleave=bool(config.get("rope_interleave", True)))
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from None


def _moe_layers(family: Family, config: dict[str, Any], where: str) -> tuple[int, ...]:
    """The 0-based MoE layers, as transformers' decoder layer of the family chooses them."""
    layers = int(config["num_hidden_layers"])
    step_field, step = "decoder_sparse_step", config.get("decoder_sparse_step", 1)
    if family.dense_layers_field != "mlp_only_layers":
        if config.get("mlp_only_layers"):
            raise _refuse(where, "mlp_only_layers", f"{config['mlp_only_layers']}: not a field of {family.name}")
        if step not in (None, 1):
            raise _refuse(where, step_field, f"{step!r}: not a field of {family.name} (only 1 is neutral)")
    if family.dense_layers_field == "first_k_dense_replace":
        first = config.get("first_k_dense_replace") or 0
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < layers:
            raise _refuse(where, "first_k_dense_replace", f"{first!r}: must be an integer in 0..{layers - 1} "
                          "(at least one MoE layer)")
        return tuple(range(first, layers))
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise _refuse(where, "mlp_only_layers", f"{dense!r}: must be a list of layer indices in 0..{layers - 1}")
    step = 1 if step is None else step
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise _refuse(where, step_field, f"{step!r}: must be a positive integer")
    moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not moe:
        raise _refuse(where, "mlp_only_layers", f"{dense} with {step_field} {step}: no layer would be a mixture of "
                      "experts")
    return moe


def _dense_layers_config(family: Family, arch: ModelArch) -> dict[str, Any]:
    """The HF fields that place `arch`'s dense layers (refusing a placement the family cannot spell)."""
    dense = [i for i in range(arch.num_layers) if not arch.layer_is_moe(i)]
    if family.dense_layers_field == "mlp_only_layers":
        return {"decoder_sparse_step": 1, "mlp_only_layers": dense}
    if family.dense_layers_field == "first_k_dense_replace" and dense == list(range(len(dense))):
        return {"first_k_dense_replace": len(dense)}
    if dense:
        raise ConfigError(f"model family {family.name!r} cannot express dense layers {dense} among its MoE layers "
                          "in an HF config")
    return {}


def _shared_expert_config(family: Family, arch: ModelArch) -> dict[str, Any]:
    """The HF fields of `arch`'s shared expert (refusing one the family cannot spell)."""
    size, gated = arch.shared_expert_ffn_hidden_size, arch.shared_expert_gate
    if family.shared_expert_field and size > 0 and gated:
        return {family.shared_expert_field: size}
    if family.shared_expert_count_field and not gated and size % arch.moe_ffn_hidden_size == 0:
        return {family.shared_expert_count_field: size // arch.moe_ffn_hidden_size}
    if size == 0 and not family.shared_expert_field:
        return {}
    raise ConfigError(f"model family {family.name!r} cannot express shared_expert_ffn_hidden_size={size}, "
                      f"shared_expert_gate={gated} in an HF config")


def _router_config(family: Family, arch: ModelArch) -> dict[str, Any]:
    """The HF fields of `arch`'s router beyond top-k (refusing one the family cannot spell)."""
    if family.sigmoid_router and arch.moe_router_score == "sigmoid" and arch.moe_router_expert_bias:
        return {"n_group": arch.moe_router_groups, "topk_group": arch.moe_router_group_topk,
                "routed_scaling_factor": arch.moe_routed_scaling_factor}
    if not family.sigmoid_router and arch.moe_router_score == "softmax" and arch.moe_routed_scaling_factor == 1.0:
        return {}
    raise ConfigError(f"model family {family.name!r} cannot express a {arch.moe_router_score} router (expert bias "
                      f"{arch.moe_router_expert_bias}, scaling {arch.moe_routed_scaling_factor}) in an HF config")


def rope_parameters(arch: ModelArch) -> dict[str, Any]:
    """The transformers 5 `rope_parameters` dict for `arch` (None fields left out, as HF would default them)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling is not None:
        params.update({k: v for k, v in dataclasses.asdict(arch.rope_scaling).items() if v is not None})
    return params


def to_hf_config(arch: ModelArch, **extra: Any) -> dict[str, Any]:
    """An HF config.json for `arch` that transformers loads as the family's own class with the same numerics."""
    family = get_family(arch.family)
    if (arch.attention_bias != family.qkv_bias and not family.qkv_bias_field and not family.gpt_oss) \
            or (arch.qk_norm != family.qk_norm and not family.qk_norm_field):
        raise ConfigError(f"model family {family.name!r} cannot express attention_bias={arch.attention_bias}, "
                          f"qk_norm={arch.qk_norm} in an HF config")
    params = rope_parameters(arch)
    if arch.partial_rotary_factor != 1.0:
        if not family.partial_rotary:
            raise ConfigError(f"model family {family.name!r} cannot express partial_rotary_factor="
                              f"{arch.partial_rotary_factor} in an HF config")
        params["partial_rotary_factor"] = arch.partial_rotary_factor
    config: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": family.model_types[0],
        "vocab_size": arch.vocab_size,
        "num_hidden_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.head_dim,
        "rope_theta": arch.rope_theta,
        "rope_parameters": params,
        "rms_norm_eps": arch.norm_eps,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    if family.bias_field:
        config[family.bias_field] = False
    if family.qkv_bias_field:
        config[family.qkv_bias_field] = arch.attention_bias
    if family.qk_norm_field:
        config[family.qk_norm_field] = arch.qk_norm
    if family.name == "llama":
        config["mlp_bias"] = False
    if bool(family.moe_block) != arch.is_moe:
        raise ConfigError(f"model family {family.name!r} cannot express num_experts={arch.num_experts} "
                          "in an HF config")
    if family.moe_block:
        config.update({
            family.experts_field: arch.num_experts,
            "num_experts_per_tok": arch.moe_top_k,
            family.expert_size_field: arch.moe_ffn_hidden_size,
            "router_aux_loss_coef": arch.router_aux_loss_coef,
            "output_router_logits": False,
        })
        if family.norm_topk_field:
            config[family.norm_topk_field] = arch.moe_norm_topk_prob
        elif not arch.moe_norm_topk_prob:
            raise ConfigError(f"model family {family.name!r} always renormalises its top-k router weights "
                              "(moe_norm_topk_prob=False cannot be exported)")
        config.update(_shared_expert_config(family, arch))
        config.update(_router_config(family, arch))
        config.update(_dense_layers_config(family, arch))
        if family.name == "mixtral":
            config["router_jitter_noise"] = 0.0
    if arch.sliding_window is not None and not family.has_window:
        raise ConfigError(f"model family {family.name!r} has no sliding-window attention (sliding_window="
                          f"{arch.sliding_window} cannot be exported)")
    if family.has_window:
        config["sliding_window"] = arch.sliding_window
        if family.window_flag:
            config[family.window_flag] = arch.sliding_window is not None
        if family.window_layer_types:
            if family.window_flag:  # (Qwen's)
                config["max_window_layers"] = 0
            config["layer_types"] = ["sliding_attention" if arch.layer_window(i) else "full_attention"
                                     for i in range(arch.num_layers)]
        elif arch.sliding_window_layers is not None:
            raise ConfigError(f"model family {family.name!r} windows every layer or none (sliding_window_layers="
                              f"{list(arch.sliding_window_layers)} cannot be exported)")
    if family.mla != arch.is_mla:
        raise ConfigError(f"model family {family.name!r} cannot express kv_lora_rank={arch.kv_lora_rank} in an HF config")
    if family.mla:
        config.update(kv_lora_rank=arch.kv_lora_rank, q_lora_rank=arch.q_lora_rank or None,
                      qk_nope_head_dim=arch.qk_nope_head_dim, qk_rope_head_dim=arch.qk_rope_head_dim,
                      v_head_dim=arch.v_head_dim, rope_interleave=arch.rope_interleave, attention_bias=False)
    if family.mtp_layers_field:
        config[family.mtp_layers_field] = 0  # multi-token-prediction layers are not kept
    if family.gemma:
        del config["hidden_act"]
        if family.layer_type_rope:
            del config["rope_theta"]
        config.update(_gemma_config(family, arch))
    elif arch.mlp_activation != "silu" or arch.norm_offset or arch.sandwich_norms or arch.local_rope_theta \
            or arch.embedding_multiplier != 1.0 or arch.attention_scale is not None \
            or arch.attn_logit_softcapping or arch.final_logit_softcapping:
        raise ConfigError(f"model family {family.name!r} cannot express Gemma's layer numerics in an HF config")
    config.update(_gpt_oss_config(family, arch))
    config.update(extra)
    return config


def from_json(path: str | os.PathLike) -> ModelArch:
    """`from_hf_config` of a config.json file, errors naming the file."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object (an HF model config), got a {type(data).__name__}")
    return from_hf_config(data, where=os.fspath(path))
