"""Build a Megatron-core `GPTModel` for a `ModelArch` of any registered family (models/families.py).

Megatron's own `TransformerConfig` carries the architecture and the parallel layout (it is built here,
never mirrored by hand): q/k/v biases (Qwen2) are `add_qkv_bias`, per-head q/k RMSNorm (Qwen3) is
`qk_layernorm`, and RoPE frequencies, scaled or not, come from `models/rope.py`, the function the native
engine uses too (`ArchRotaryEmbedding` replaces Megatron's own, whose scaling knows only Llama 3 defaults).
The Transformer Engine layer spec is used when TE's torch extension imports with CUDA and passes a one-layer
self-test (`transformer_engine_problem`); otherwise the local spec
(torch RMSNorm, Megatron's own linear layers), which runs on CPU.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import MegatronLayout, check_parallel_layout
from megatron_rl.models.rope import rope_inv_freq
from megatron_rl.trainer import local_fusions
from megatron_rl.trainer.moe import ExpertDownProjection, sequence_parallel_block_spec
from megatron_rl.trainer.packing import causal_attention, varlen_causal_attention

logger = logging.getLogger(__name__)

if not isinstance(multi_latent_attention.TELinear, type):
    # megatron-core 0.16 binds a mock for TELinear when Transformer Engine is absent, yet sets HAVE_TE: MLA's
    # isinstance check on it raised TypeError. Without TE no linear is a TELinear.
    multi_latent_attention.HAVE_TE = False


def transformer_engine_available() -> bool:
    return transformer_engine_problem() is None


@functools.lru_cache(maxsize=1)
def transformer_engine_problem() -> str | None:
    """Why Transformer Engine's layers cannot be used here (None when they can): CUDA and TE's torch
    extension must import, and one TE linear layer must run forward and backward, in FP8 where the GPU
    has it (compute capability 8.9+). An installed but broken extension (built against another torch, a
    missing CUDA library) is then caught once, here, and `layer_spec: auto` takes the local layers."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import transformer_engine.pytorch as te  # optional: Transformer Engine needs CUDA and its torch extension
    except Exception as exc:  # noqa: BLE001 - any import failure (ImportError, OSError of a .so) means unusable
        return f"import transformer_engine.pytorch failed: {type(exc).__name__}: {exc}"
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    try:
        layer = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(enabled=fp8):
            out = layer(x)
        out.float().sum().backward()
        torch.cuda.synchronize()
        if not (torch.isfinite(out).all() and x.grad is not None and torch.isfinite(x.grad).all()):
            return "the FP8 self-test produced non-finite values"
    except Exception as exc:  # noqa: BLE001 - a failing self-test means unusable, whatever it raised
        return f"the {'FP8 ' if fp8 else ''}self-test of one TE linear layer failed: {type(exc).__name__}: {exc}"
    return None


def resolve_layer_spec(requested: Literal["auto", "local", "te"], arch: ModelArch | None = None, *,
                       lora: bool = False) -> Literal["local", "te"]:
    """The layer spec a run builds. LoRA's low-rank path, multi-latent attention, Gemma's sandwich norms and
    GPT-OSS's sinks and biased experts are built on the local layers only: `auto` takes those for them (LoRA even
    when `te` is asked for)."""
    if lora or (requested == "auto" and arch is not None and (arch.is_mla or arch.sandwich_norms
                                                              or arch.attention_sinks or arch.expert_biases)):
        return "local"
    if requested == "auto":
        problem = transformer_engine_problem()
        if problem and torch.cuda.is_available():
            logger.warning("layer_spec auto: Transformer Engine is not usable (%s); using the local layers", problem)
        return "local" if problem else "te"
    return requested


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation: transformers' `gelu_pytorch_tanh` (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


MLP_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def sigmoid_gated(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """x * sigmoid(alpha * x): GPT-OSS's gate activation (alpha 1.702, Megatron's quick_gelu), SiLU at alpha 1."""
    return x * torch.sigmoid(alpha * x)


def mlp_activation(arch: ModelArch):
    """The gated MLPs' activation function of `arch` (Megatron applies the clamp and the linear offset itself)."""
    if arch.swiglu_alpha != 1.0:
        return functools.partial(sigmoid_gated, alpha=arch.swiglu_alpha)
    return MLP_ACTIVATIONS[arch.mlp_activation]


def linear_biases(arch: ModelArch) -> bool:
    """Megatron's `add_bias_linear`: every linear layer (q/k/v, output projection, MLPs, experts, router) has a bias,
    or none does. A model whose biases are on some of them only is refused by name."""
    flags = {"attention_bias": arch.attention_bias, "attention_output_bias": arch.attention_output_bias,
             "expert_biases": arch.expert_biases, "moe_router_bias": arch.moe_router_bias}
    if not (arch.attention_output_bias or arch.expert_biases or arch.moe_router_bias):
        return False
    if not all(flags.values()) or arch.has_dense_mlp:
        raise ConfigError(f"Megatron's add_bias_linear puts biases on every linear layer or none; this model has "
                          f"{', '.join(f'{k}={v}' for k, v in flags.items())}, dense MLP layers {arch.has_dense_mlp} "
                          "(unbiased)", field="attention_output_bias")
    return True


def transformer_config(arch: ModelArch, *, tensor_parallel: int, pipeline_parallel: int,
                       params_dtype: torch.dtype = torch.float32, recompute: bool = False,
                       fp8: str | None = None, fp8_recipe: str | None = None, fp8_amax_history_len: int = 1024,
                       expert_parallel: int = 1, moe_aux_loss_coeff: float | None = None,
                       moe_token_dispatcher: str = "auto", moe_expert_bias_update_rate: float = 1e-3,
                       first_stage_layers: int | None = None, last_stage_layers: int | None = None):
    """Megatron's TransformerConfig for `arch` (RMSNorm, SwiGLU, RoPE, GQA, no dropout; q/k/v biases and
    q/k norms as the family has them).

    `fp8_recipe` ("delayed" or "tensorwise") turns on Transformer Engine FP8 GEMMs in the "hybrid" format
    (e4m3 forward, e5m2 gradients); Megatron's TransformerBlock then enters TE's fp8 autocast itself
    (around the whole block for delayed scaling, per layer otherwise). Needs the TE layer spec.
    `first_stage_layers` / `last_stage_layers`: Megatron's uneven pipeline split (None: an even share)."""
    check_parallel_layout(arch, tensor_parallel, pipeline_parallel, expert_parallel,
                          first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    on_gpu = torch.cuda.is_available()
    kwargs = moe_config_kwargs(arch, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                               aux_loss_coeff=moe_aux_loss_coeff, dispatcher=moe_token_dispatcher,
                               expert_bias_update_rate=moe_expert_bias_update_rate)
    activation = mlp_activation(arch)
    kwargs.update({name: value for name, value in (("num_layers_in_first_pipeline_stage", first_stage_layers),
                                                   ("num_layers_in_last_pipeline_stage", last_stage_layers))
                   if value is not None})
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8_recipe:
        kwargs.update(fp8=fp8 or "hybrid", fp8_recipe=fp8_recipe, fp8_amax_history_len=fp8_amax_history_len,
                      fp8_amax_compute_algo="max")
    elif fp8:
        kwargs.update(fp8=fp8)
    if arch.sliding_window is not None:
        # Megatron / Transformer Engine windows are (left, right) key offsets; 1 marks a windowed layer
        kwargs.update(window_size=(arch.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(arch.layer_window(i) is not None) for i in range(arch.num_layers)])
    config_class, kv_channels = TransformerConfig, arch.head_dim
    if arch.is_mla:
        config_class, kv_channels = MLATransformerConfig, arch.v_head_dim  # the attention output's per-head width
        kwargs.update(mla_config_kwargs(arch, tensor_parallel))
    _, rope_scale = rope_inv_freq(arch)
    if rope_scale != 1.0 or arch.attention_scale is not None:
        # HF multiplies both cos and sin by the RoPE attention scaling (YaRN), i.e. q.k by its square:
        # the same as a softmax scale of scaling^2 / sqrt(head_dim), which Megatron takes as is.
        scale = arch.attention_scale if arch.attention_scale is not None else 1 / math.sqrt(arch.head_dim)
        kwargs.update(softmax_scale=rope_scale ** 2 * scale)
    # Megatron's config refuses biased experts split over TP (its MLP adds bias x weight on every expert-TP rank before
    # the partial outputs are summed); ExpertDownProjection (trainer/moe.py) adds it on rank 0 only, so the experts
    # split over TP like the rest stay exact. The process groups, not this field, set the experts' split.
    biased_experts_over_tp = arch.expert_biases and tensor_parallel > 1
    if biased_experts_over_tp:
        kwargs.update(expert_tensor_parallel_size=1)
    config = config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=activation,
        activation_func_clamp_value=arch.swiglu_limit,
        glu_linear_offset=arch.glu_linear_offset,
        add_bias_linear=linear_biases(arch),
        softmax_type="learnable" if arch.attention_sinks else "vanilla",
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Fusions only where their kernels exist (megatron-core defaults them off): fused RoPE is Transformer
        # Engine's (TransformerConfig raises without it); the bias-SwiGLU and masked-softmax fusions have
        # torch / Megatron fallbacks on any CUDA build. persist_layer_norm needs Apex's persistent kernel,
        # which the torch RMSNorm of the local spec asserts against.
        apply_rope_fusion=transformer_engine_available() and not arch.is_mla,  # (MLA's fusion is YaRN-only)
        # (Megatron fuses erf-GELU, not tanh, and its fused clamped GLU only where probabilities scale the input)
        bias_activation_fusion=on_gpu and activation is F.silu and arch.swiglu_limit is None,
        masked_softmax_fusion=on_gpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **kwargs,
    )
    if biased_experts_over_tp:
        config.expert_tensor_parallel_size = tensor_parallel
    return config


def mla_config_kwargs(arch: ModelArch, tensor_parallel: int) -> dict:
    """MLATransformerConfig fields of multi-latent attention (DeepSeek-V3): Megatron's MLA with its own RoPE over
    the rotary dims (it de-interleaves DeepSeek's interleaved rotary rows itself; the converter interleaves those of a
    rotate-half model, `models/megatron_layout.py`), softmax scale 1/sqrt(nope + rope dims)."""
    scaling = arch.rope_scaling
    if scaling is not None and rope_inv_freq(arch)[1] != 1.0:
        raise ConfigError(f"rope_scaling: {scaling.rope_type} with an attention factor != 1 (mscale {scaling.mscale} "
                          f"!= mscale_all_dim {scaling.mscale_all_dim}) is not mapped onto multi-latent attention",
                          field="rope_scaling")
    # YaRN: the frequencies are models/rope.py's (set on each MLA layer's rotary module, `build_gpt_model`), and
    # the softmax scale takes mscale_all_dim as transformers' yarn_apply_mscale does (Megatron's own formula)
    factor = scaling.factor if scaling is not None and scaling.mscale_all_dim else 1.0
    mscale_all_dim = scaling.mscale_all_dim if scaling is not None and scaling.mscale_all_dim else 0.0
    return dict(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank,
                # the replicated down projections' gradients are summed over TP as sequence-parallel ones
                sequence_parallel=tensor_parallel > 1,
                qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
                v_head_dim=arch.v_head_dim, rope_type="rope", rotary_base=arch.rope_theta,
                rotary_scaling_factor=factor, mscale=1.0, mscale_all_dim=mscale_all_dim)


def moe_config_kwargs(arch: ModelArch, *, tensor_parallel: int, expert_parallel: int,
                      aux_loss_coeff: float | None, dispatcher: str, expert_bias_update_rate: float = 1e-3) -> dict:
    """TransformerConfig fields of a mixture-of-experts arch (docs/moe.md); {} for a dense one. A softmax router:
    with `moe_norm_topk_prob` the k weights are renormalised, which is Megatron's softmax over the top-k logits
    (moe_router_pre_softmax False); without, the softmax over all experts is kept as is. A sigmoid router
    (GLM-4.5, DeepSeek-V3) is Megatron's own, with its expert bias (updated by `expert_bias_update_rate` per
    step towards a uniform load), groups and scaling factor. A shared expert is Megatron's SharedExpertMLP, its
    sigmoid gate included where the family has one (Qwen2-MoE)."""
    if not arch.is_moe:
        return {}
    if dispatcher == "auto":
        dispatcher = "alltoall" if torch.cuda.is_available() else "allgather"
    coeff = arch.router_aux_loss_coef if aux_loss_coeff is None else aux_loss_coeff
    grouped = arch.moe_router_groups > 1
    return dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
                moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_router_pre_softmax=not arch.moe_norm_topk_prob,
                moe_router_score_function=arch.moe_router_score,
                moe_router_enable_expert_bias=arch.moe_router_expert_bias,
                moe_router_bias_update_rate=expert_bias_update_rate,
                moe_router_num_groups=arch.moe_router_groups if grouped else None,
                moe_router_group_topk=arch.moe_router_group_topk if grouped else None,
                moe_router_topk_scaling_factor=(arch.moe_routed_scaling_factor
                                                if arch.moe_routed_scaling_factor != 1.0 else None),
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=coeff, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
                moe_router_dtype="fp32", moe_enable_routing_replay=True, expert_model_parallel_size=expert_parallel,
                moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
                moe_shared_expert_gate=arch.shared_expert_gate,
                moe_layer_freq=[int(arch.layer_is_moe(i)) for i in range(arch.num_layers)],
                # Megatron trains MoE layers under TP only with sequence parallelism.
                sequence_parallel=tensor_parallel > 1)


def layer_spec(kind: Literal["local", "te"], *, qk_norm: bool = False, num_experts: int = 0, mla: bool = False,
               sandwich_norms: bool = False, attn_softcap: float | None = None, expert_biases: bool = False):
    """Megatron's layer spec; `qk_norm` adds per-head RMSNorms (over head_dim) on q and k before RoPE;
    `num_experts` > 0 makes every MLP a mixture of experts (SequentialMLP experts, no grouped GEMM); `mla`:
    multi-latent attention, with its RMSNorms on the q and kv latents; `sandwich_norms` (local only): the
    attention's and the MLP's output projections normalise what they return (Gemma's post-norms); `attn_softcap`
    (local only): soft-capped attention scores (Gemma 2)."""
    moe = dict(num_experts=num_experts, moe_grouped_gemm=False) if num_experts else {}
    if mla:
        moe.update(multi_latent_attention=True)
        qk_norm = True  # Megatron builds MLA's latent norms where a plain layer has its q/k norms
    if kind == "te":
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, **moe)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, **moe)
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class(attn_softcap)
    if num_experts and expert_biases:
        spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertDownProjection
    if sandwich_norms:
        spec.submodules.self_attention.submodules.linear_proj = PostNormRowParallelLinear
        spec.submodules.mlp.submodules.linear_fc2 = PostNormRowParallelLinear
    if mla:
        # The latent down projections replicated on every TP rank, each computing its sequence-parallel chunk (what
        # Transformer Engine's spec does with its duplicated linears). Megatron's local spec splits them over TP
        # instead and then hands every rank the whole rotary key, whose gradient from only that rank's heads never
        # gets summed over TP: a TP=2 run trained differently from TP=1.
        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = ReplicatedLinear
    return spec


def block_spec(layout: MegatronLayout, pp_rank: int, *, sequence_parallel: bool):
    """The layer specs of pipeline stage `pp_rank`: an MoE layer's or a dense one's as `ModelArch.layer_is_moe`
    says (one spec for all when they agree)."""
    arch, kind = layout.arch, layout.layer_spec
    dense = layer_spec(kind, qk_norm=arch.qk_norm, mla=arch.is_mla, sandwich_norms=arch.sandwich_norms,
                       attn_softcap=arch.attn_logit_softcapping)
    moe = layer_spec(kind, qk_norm=arch.qk_norm, num_experts=arch.num_experts, mla=arch.is_mla,
                     expert_biases=arch.expert_biases) \
        if arch.is_moe else dense
    local_rope = None
    if arch.local_rope_theta is not None:  # the windowed layers rotate with a RoPE of their own
        local_rope = copy.deepcopy(dense)
        local_rope.submodules.self_attention.module = _local_rope_attention_class(
            local_rope.submodules.self_attention.module, arch.layer_rope(arch.windowed_layers[0]))
    layers = [moe if arch.layer_is_moe(i) else local_rope if arch.layer_rope(i) is not arch else dense
              for i in layout.stage_layers(pp_rank)]
    if sequence_parallel and kind == "local":
        return sequence_parallel_block_spec(layers)
    if all(spec is layers[0] for spec in layers):
        return layers[0]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)  # what Megatron gives one spec


def _sdpa_attention_class(softcap: float | None = None):
    """Megatron's local DotProductAttention with its causal, unmasked case computed by torch's
    scaled_dot_product_attention. The local class materialises the [b, heads, s, s] scores and keeps
    the probabilities of every layer for backward: ~17 GB for SmolLM2's 30 layers at 8 x 1000 tokens,
    which ran WaltzRL's 24 GB CPU recipe out of memory. SDPA's fused kernels (flash attention on CPU
    and GPU) keep O(s) per layer. Packed rows (THD, `PackedSeqParams`) run one SDPA call per document
    (trainer/packing.py). A sliding window (`config.window_size` on the layers `window_attn_skip_freq`
    marks) is a banded causal mask here; the local class builds its window mask on CUDA only. Soft-capped scores
    (`softcap`, Gemma 2) and learned sinks (`softmax_type` learnable, GPT-OSS: Megatron's `softmax_offset`, one per
    query head) are materialised (`causal_attention`). Other masks, attention offsets and biases keep the local
    path."""
    class SDPADotProductAttention(DotProductAttention):
        def __init__(self, config, layer_number, *args, k_channels=None, v_channels=None, **kwargs):
            # multi-latent attention passes its q/k and v widths (Transformer Engine's attention takes them); SDPA
            # reads them off the tensors, and the output width is kv_channels (v_head_dim) per head
            learnable = config.softmax_type == "learnable"
            if learnable:  # (Megatron allocates the sinks on the current CUDA device: built here, on CPU too)
                vanilla = copy.copy(config)
                vanilla.softmax_type = "vanilla"
            super().__init__(vanilla if learnable else config, layer_number, *args, **kwargs)
            if learnable:
                self.config = config
                self.softmax_offset = torch.nn.Parameter(torch.zeros(
                    self.num_attention_heads_per_partition, dtype=config.params_dtype,
                    device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu"))
                if config.perform_initialization:
                    config.init_method(self.softmax_offset)
                # one sink per query head: TP rank r holds its heads' (not a duplicate in the gradient norm)
                set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            # Megatron's window_size is (left, right): keys in [i - left, i + right]
            self.window = (config.window_size[0] + 1 if is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, max(1, layer_number)) else None)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            sinks = self.softmax_offset if self.config.softmax_type == "learnable" else None
            plain = (attention_mask is None and mask_type == AttnMaskType.causal and attention_bias is None
                     and (self.softmax_offset is None or sinks is not None))
            dropout_p = self.attention_dropout.p if self.training else 0.0
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                if not plain:
                    raise ValueError("sequence packing on the local layers supports causal attention without a mask, "
                                     "bias or softmax offset")
                return varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                               scale=self.softmax_scale, window=self.window, dropout_p=dropout_p,
                                               softcap=softcap, sinks=sinks)
            if not plain or packed_seq_params is not None:
                if self.window is not None or softcap is not None:
                    raise ValueError("a sliding window or soft-capped scores on the local layers need causal "
                                     "attention without a mask, bias or softmax offset")
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            sq, b = query.shape[0], query.shape[1]
            # [s, b, heads, d] -> [b, heads, s, d]; key / value keep their query groups (GQA in the kernel)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            context = causal_attention(q, k, v, scale=self.softmax_scale, window=self.window, dropout_p=dropout_p,
                                       softcap=softcap, sinks=sinks)
            return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    return SDPADotProductAttention


class PostNormRowParallelLinear(RowParallelLinear):
    """Megatron's row-parallel linear whose output goes through an RMSNorm of its own (`post_norm`), before the
    residual add: Gemma's post-attention and post-feed-forward norms as parts of the attention's and the MLP's
    output projections, whose outputs are whole hidden vectors per token (all-reduced, or each rank's sequence
    chunk under sequence parallelism, whose norm-weight gradient finalize_model_grads sums over TP)."""

    adds_adapter_itself = True
    """A LoRA adapter (trainer/lora.py) joins the projection's output before the norm, as PEFT's adapter on the
    HF o_proj / down_proj does, rather than through a forward hook after it."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = torch.nn.RMSNorm(output_size, eps=config.layernorm_epsilon)
        self.post_norm.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:
            raise ValueError("a post-norm projection with a bias is not implemented (the norm follows the bias)")
        adapter = getattr(self, "adapter", None)
        if adapter is not None and adapter.enabled:
            output = output + adapter(input_).to(output.dtype)
        return self.post_norm(output), None


def _local_rope_attention_class(base: type, rope_arch: ModelArch) -> type:
    """`base` (Megatron's SelfAttention) rotating q and k with `rope_arch`'s RoPE instead of the model's (Gemma 3's
    sliding-window layers: their own base, unscaled). The model hands every layer one table for positions
    0 .. S-1; this layer builds its own of the same length."""
    class LocalRopeSelfAttention(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.local_rotary = ArchRotaryEmbedding(rope_arch, use_cpu_initialization=config.use_cpu_initialization)

        def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
            if rotary_pos_emb is not None:
                length = (rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb).shape[0]
                rotary_pos_emb = self.local_rotary(length)
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    return LocalRopeSelfAttention


class ArchRotaryEmbedding(RotaryEmbedding):
    """Megatron's rotary embedding with the inverse frequencies of `models/rope.py` (every HF rope_type).
    'dynamic' scaling recomputes them from the forward's sequence length (the padded micro-batch length),
    as HF does from the longest position in its batch."""

    def __init__(self, arch: ModelArch, *, use_cpu_initialization: bool, cp_group=None):
        super().__init__(kv_channels=arch.head_dim, rotary_percent=arch.partial_rotary_factor, rotary_interleaved=False,
                         use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        self.arch = arch
        self.dynamic = arch.rope_scaling is not None and arch.rope_scaling.rope_type == "dynamic"
        self.inv_freq = rope_inv_freq(arch, device=self.inv_freq.device)[0]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.dynamic:
            # The parent's forward caches by sequence length, which is all the dynamic frequencies depend on.
            self.inv_freq = rope_inv_freq(self.arch, seq_len=max_seq_len + offset, device=self.inv_freq.device)[0]
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


def build_gpt_model(layout: MegatronLayout, config, pg_collection, *, pre_process: bool, post_process: bool):
    """The GPTModel stage this rank holds. Its vocabulary is padded as `layout` says."""
    arch = layout.arch
    spec = block_spec(layout, pg_collection.pp.rank(), sequence_parallel=config.sequence_parallel)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rotary_percent=arch.partial_rotary_factor,
        pg_collection=pg_collection,
    )
    if not arch.is_mla:
        model.rotary_pos_emb = ArchRotaryEmbedding(arch, use_cpu_initialization=config.use_cpu_initialization,
                                                   cp_group=pg_collection.cp)
    else:  # each MLA layer rotates its rotary dims with a RotaryEmbedding of its own: give it models/rope.py's
        for module in model.modules():
            if isinstance(module, multi_latent_attention.MultiLatentAttention):
                rotary = module.rotary_pos_emb
                rotary.inv_freq = rope_inv_freq(arch, device=rotary.inv_freq.device)[0]
    if layout.layer_spec == "local":  # (Transformer Engine fuses these itself)
        local_fusions.fuse_model(model)
    if arch.norm_offset:  # zero-centred norms (Gemma): every norm scales by 1 + weight, initially 1
        for module in model.modules():
            if isinstance(module, local_fusions.FusedRMSNorm):
                module.offset = arch.norm_offset
                with torch.no_grad():
                    module.weight.zero_()
    if arch.embedding_multiplier != 1.0 and pre_process:
        multiplier = torch.tensor(arch.embedding_multiplier, dtype=torch.float32)
        model.embedding.register_forward_hook(lambda _module, _inputs, out: out * multiplier.to(out.dtype))
    return model
