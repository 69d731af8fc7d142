"""Build a Megatron-core `GPTModel` for a Llama-family `ModelArch`.

Megatron's own `TransformerConfig` carries the architecture and the parallel layout (it is built here,
never mirrored by hand). The Transformer Engine layer spec is used when TE is importable with CUDA;
otherwise the local spec (torch RMSNorm, Megatron's own linear layers), which runs on CPU.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from megatron_rl.checkpoints_tools.megatron_layout import MegatronLayout, check_parallel_layout
from megatron_rl.models import ModelArch


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_layer_spec(requested: Literal["auto", "local", "te"]) -> Literal["local", "te"]:
    if requested == "auto":
        return "te" if transformer_engine_available() else "local"
    return requested


def transformer_config(arch: ModelArch, *, tensor_parallel: int, pipeline_parallel: int,
                       params_dtype: torch.dtype = torch.float32, recompute: bool = False,
                       fp8: str | None = None, fp8_recipe: str | None = None, fp8_amax_history_len: int = 1024):
    """Megatron's TransformerConfig for a Llama model (RMSNorm, SwiGLU, RoPE, GQA, no biases, no dropout).

    `fp8_recipe` ("delayed" or "tensorwise") turns on Transformer Engine FP8 GEMMs in the "hybrid" format
    (e4m3 forward, e5m2 gradients); Megatron's TransformerBlock then enters TE's fp8 autocast itself
    (around the whole block for delayed scaling, per layer otherwise). Needs the TE layer spec."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel_layout(arch, tensor_parallel, pipeline_parallel)
    on_gpu = torch.cuda.is_available()
    kwargs = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8_recipe:
        kwargs.update(fp8=fp8 or "hybrid", fp8_recipe=fp8_recipe, fp8_amax_history_len=fp8_amax_history_len,
                      fp8_amax_compute_algo="max")
    elif fp8:
        kwargs.update(fp8=fp8)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # These fusions need CUDA kernels; on GPU Megatron picks them up from its defaults.
        apply_rope_fusion=on_gpu,
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        persist_layer_norm=on_gpu,
        gradient_accumulation_fusion=False,
        **kwargs,
    )


def layer_spec(kind: Literal["local", "te"]):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    if kind == "te":
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(layout: MegatronLayout, config, pg_collection, *, pre_process: bool, post_process: bool):
    """The GPTModel stage this rank holds. Its vocabulary is padded as `layout` says."""
    from megatron.core.models.gpt import GPTModel

    arch = layout.arch
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(layout.layer_spec),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rotary_percent=1.0,
        pg_collection=pg_collection,
    )
