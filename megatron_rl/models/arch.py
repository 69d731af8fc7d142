"""Decoder architecture description shared by the trainer, the rollout engines and the converters.

One `ModelArch` describes the network's shapes and numerics; it is read from a GGUF header, an HF
`config.json` (through the family registry in `models/families.py`), or named presets, and turned into
Megatron's `TransformerConfig` by `trainer/model.py`. docs/models.md lists the families and what each
honours or refuses.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from megatron_rl.config import ConfigError, require

ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with the semantics of transformers' `modeling_rope_utils` for the same
    `rope_type` (the HF `rope_parameters` / `rope_scaling` dict, with defaults already filled in)."""

    rope_type: str
    """'linear', 'dynamic' (NTK, depends on the sequence length), 'llama3' or 'yarn'."""
    factor: float
    original_max_position_embeddings: int | None = None
    """Pretraining context (llama3, yarn)."""
    low_freq_factor: float | None = None
    """llama3 only."""
    high_freq_factor: float | None = None
    """llama3 only."""
    beta_fast: float | None = None
    """yarn only (HF default 32)."""
    beta_slow: float | None = None
    """yarn only (HF default 1)."""
    mscale: float | None = None
    """yarn only."""
    mscale_all_dim: float | None = None
    """yarn only."""
    attention_factor: float | None = None
    """yarn only: cos/sin multiplier; derived from factor / mscale when None."""
    truncate: bool | None = None
    """yarn only: round the correction range to whole dimensions (HF default True)."""

    def __post_init__(self) -> None:
        require(self.rope_type in ROPE_TYPES, "rope_scaling.rope_type",
                f"{self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        require(self.factor > 0, "rope_scaling.factor", f"must be positive, got {self.factor}")
        if self.rope_type in ("llama3", "yarn"):
            require(self.original_max_position_embeddings is not None and self.original_max_position_embeddings > 0,
                    "rope_scaling.original_max_position_embeddings", f"required (positive) for {self.rope_type}")
        if self.rope_type == "llama3":
            require(self.low_freq_factor is not None and self.high_freq_factor is not None,
                    "rope_scaling.low_freq_factor", "llama3 needs low_freq_factor and high_freq_factor")
            require(self.high_freq_factor != self.low_freq_factor, "rope_scaling.high_freq_factor",
                    "must differ from low_freq_factor")


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelArch:
    """Shapes and numerics of a pre-norm decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention)."""

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
    family: str = "llama"
    """Registry key in models/families.py: 'llama' (Llama 1-3.3, SmolLM2), 'mistral', 'qwen2', 'qwen3'."""
    attention_bias: bool = False
    """q/k/v projections carry biases (Qwen2/2.5); the output projection never has one."""
    qk_norm: bool = False
    """Per-head RMSNorm (weight [head_dim], eps=norm_eps) on q and k before RoPE (Qwen3)."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling; None is plain RoPE."""
    sliding_window: int | None = None
    """Sliding-window attention, as transformers applies it: a query at position i attends to the keys at
    positions (i - sliding_window, i], the last `sliding_window` tokens including itself. None: full
    causal attention."""
    sliding_window_layers: tuple[int, ...] | None = None
    """The 0-based layers the window applies to (Qwen2 / Qwen3 `layer_types`); None: every layer (Mistral,
    Mixtral, Qwen3-MoE). Only meaningful with a `sliding_window`."""
    num_experts: int = 0
    """0 = dense MLP; > 0 = the MLP of every layer `moe_layers` names is a mixture of this many SwiGLU experts."""
    moe_layers: tuple[int, ...] | None = None
    """The 0-based layers whose MLP is the mixture of experts (MoE models only); None: every layer. The others
    run the dense SwiGLU MLP of `ffn_hidden_size` (DeepSeek's and GLM-4.5's `first_k_dense_replace` leading
    layers, Qwen-MoE's `mlp_only_layers`)."""
    moe_top_k: int = 0
    """Experts each token is routed to (MoE only)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate size (qwen3_moe `moe_intermediate_size`, mixtral `intermediate_size`)."""
    moe_norm_topk_prob: bool = True
    """Router: softmax over all experts' logits, take the top k, and (if True) renormalize those k weights to
    sum to 1 (Mixtral always; Qwen3-MoE per its `norm_topk_prob`)."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient from the HF config (the trainer's default; trainer config overrides)."""
    shared_expert_ffn_hidden_size: int = 0
    """0: none; > 0: every MoE layer also runs one shared SwiGLU expert of this intermediate size on every token
    (Qwen2-MoE `shared_expert_intermediate_size`), its output added to the routed experts'."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(h w_g) per token, w_g [1, H] (Qwen2-MoE); False: added as is
    (GLM-4.5, DeepSeek)."""
    moe_router_score: str = "softmax"
    """'softmax' over all experts' logits (Mixtral, Qwen-MoE) or 'sigmoid' of each logit (GLM-4.5, DeepSeek-V3):
    the k chosen experts' scores are then the weights, renormalised to sum to 1 with `moe_norm_topk_prob`."""
    moe_router_expert_bias: bool = False
    """Every MoE layer's router carries a per-expert bias [E] (HF `e_score_correction_bias`), added to the sigmoid
    scores to choose the experts (the weights stay the unbiased scores): aux-loss-free load balancing, which
    training updates towards a uniform load (Megatron's `moe_router_bias_update_rate`)."""
    moe_router_groups: int = 1
    """Group-limited routing (HF `n_group`): the experts form this many equal groups; each token keeps the
    `moe_router_group_topk` groups whose two best (biased) scores sum highest and picks its k experts there."""
    moe_router_group_topk: int = 1
    """Groups each token may route to (HF `topk_group`)."""
    moe_routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (HF `routed_scaling_factor`) after renormalising."""
    kv_lora_rank: int = 0
    """> 0: multi-latent attention (DeepSeek-V2/V3): each token's keys and values come from one latent of this width
    (kv_a_proj -> RMSNorm -> kv_b_proj) plus a `qk_rope_head_dim` rotary key shared by every head; a cache holds the
    latent and the rotary key alone. 0: grouped-query attention."""
    q_lora_rank: int = 0
    """Multi-latent attention: queries through a latent of this width (q_a_proj -> RMSNorm -> q_b_proj); 0: one
    projection (q_proj)."""
    qk_nope_head_dim: int = 0
    """Multi-latent attention: each head's query/key dims without RoPE."""
    qk_rope_head_dim: int = 0
    """Multi-latent attention: each head's query/key dims with RoPE (`head_dim` is this, as transformers sets it)."""
    v_head_dim: int = 0
    """Multi-latent attention: each head's value dims."""
    rope_interleave: bool = False
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves (DeepSeek's layout)."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first int(head_dim * factor) dims of each head (rotate-half within them) and passes the
    rest through (GLM-4.5: 0.5)."""
    norm_offset: float = 0.0
    """Every RMSNorm (layers, q/k norms, final norm) scales by (norm_offset + weight), computed in fp32 before the
    cast back (Gemma 2 / 3: 1.0, whose norm weights are stored zero-centred); 0.0: weight alone, applied in the
    activation dtype (Llama's order)."""
    sandwich_norms: bool = False
    """Each layer also normalises its attention output and its MLP output before adding them to the residual
    (Gemma 2 / 3's post-attention and post-feed-forward RMSNorms)."""
    embedding_multiplier: float = 1.0
    """Input embeddings are multiplied by this, cast to the weights' dtype (Gemma: sqrt(hidden_size)); the tied
    output projection uses the unscaled table."""
    attention_scale: float | None = None
    """Softmax scale of q . k (Gemma: query_pre_attn_scalar ** -0.5); None: 1 / sqrt(head_dim)."""
    mlp_activation: str = "silu"
    """The gated MLP's activation: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU with the tanh approximation, HF
    `gelu_pytorch_tanh`)."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers, without scaling (Gemma 3's `sliding_attention` rope parameters);
    None: every layer rotates with `rope_theta` and `rope_scaling`."""
    attn_logit_softcapping: float | None = None
    """Attention scores (after the softmax scale) pass through cap * tanh(score / cap) before the mask and the
    softmax (Gemma 2: 50); None: no cap."""
    final_logit_softcapping: float | None = None
    """Output logits pass through cap * tanh(logit / cap) (Gemma 2: 30); None: no cap."""
    attention_output_bias: bool = False
    """The attention's output projection (o_proj) carries a bias (GPT-OSS)."""
    attention_sinks: bool = False
    """Every query head has a learned sink logit s_h (GPT-OSS `self_attn.sinks`): the softmax over a row's
    scores gets one more column, s_h, whose probability is dropped, so a row's weights sum to less than 1."""
    moe_router_bias: bool = False
    """The router's linear carries a bias [E] added to its logits before the top-k and the softmax (GPT-OSS
    `mlp.router.bias`); unlike `moe_router_expert_bias` it changes the weights too."""
    expert_biases: bool = False
    """Every expert's gate, up and down projections carry biases (GPT-OSS); the down bias is part of the expert's
    output, weighted by its routing weight."""
    swiglu_alpha: float = 1.0
    """The gated MLPs' activation is g * sigmoid(alpha * g) (1.0: SiLU; GPT-OSS: 1.702, Megatron's quick_gelu)."""
    swiglu_limit: float | None = None
    """Clamp of the gated MLPs' inputs before the activation: the gate at most the limit, the up projection within
    +-limit (GPT-OSS: 7.0); None: no clamp."""
    glu_linear_offset: float = 0.0
    """Added to the up projection before the product with the activated gate (GPT-OSS: 1.0)."""

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
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.sliding_window is not None:
            require(self.sliding_window >= 1, "sliding_window", f"must be >= 1, got {self.sliding_window}")
        if self.sliding_window_layers is not None:
            layers = tuple(sorted(set(int(i) for i in self.sliding_window_layers)))
            object.__setattr__(self, "sliding_window_layers", layers)
            require(self.sliding_window is not None, "sliding_window_layers", "set without a sliding_window")
            require(all(0 <= i < self.num_layers for i in layers), "sliding_window_layers",
                    f"{list(layers)}: layers must be in 0..{self.num_layers - 1}")
            require(bool(layers), "sliding_window_layers", "empty: no layer would use the sliding_window")
            if len(layers) == self.num_layers:  # one spelling of "every layer", so equal archs compare equal
                object.__setattr__(self, "sliding_window_layers", None)
        require(self.num_experts >= 0, "num_experts", f"must be >= 0, got {self.num_experts}")
        if self.moe_layers is not None:
            layers = tuple(sorted(set(int(i) for i in self.moe_layers)))
            object.__setattr__(self, "moe_layers", layers)
            require(self.num_experts > 0, "moe_layers", "set on a dense model (num_experts is 0)")
            require(all(0 <= i < self.num_layers for i in layers), "moe_layers",
                    f"{list(layers)}: layers must be in 0..{self.num_layers - 1}")
            require(bool(layers), "moe_layers", "empty: no layer would be a mixture of experts (set num_experts 0)")
            if len(layers) == self.num_layers:  # one spelling of "every layer", so equal archs compare equal
                object.__setattr__(self, "moe_layers", None)
        if self.num_experts > 0:
            require(0 < self.moe_top_k <= self.num_experts, "moe_top_k",
                    f"must be in 1..num_experts={self.num_experts}, got {self.moe_top_k}")
            require(self.moe_ffn_hidden_size > 0, "moe_ffn_hidden_size", "must be positive for an MoE model")
            require(self.router_aux_loss_coef >= 0, "router_aux_loss_coef", "must be >= 0")
        else:
            require(self.moe_top_k == 0 and self.moe_ffn_hidden_size == 0, "num_experts",
                    "moe_top_k / moe_ffn_hidden_size are set but num_experts is 0")
        self._check_router()
        if self.kv_lora_rank:
            require(min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) > 0, "qk_nope_head_dim",
                    "multi-latent attention needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim > 0")
            require(self.head_dim == self.qk_rope_head_dim, "head_dim",
                    f"multi-latent attention: head_dim is the rotary width qk_rope_head_dim={self.qk_rope_head_dim}")
            require(self.num_query_groups == self.num_attention_heads, "num_query_groups",
                    "multi-latent attention gives every head its own key and value (num_query_groups = heads)")
            require(not (self.qk_norm or self.attention_bias or self.sliding_window), "kv_lora_rank",
                    "multi-latent attention with q/k norms, attention biases or a sliding window is not implemented")
        else:
            require(not (self.q_lora_rank or self.qk_nope_head_dim or self.v_head_dim), "kv_lora_rank",
                    "q_lora_rank / qk_nope_head_dim / v_head_dim are multi-latent attention fields (kv_lora_rank is 0)")
        require(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor",
                f"must be in (0, 1], got {self.partial_rotary_factor}")
        require(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "partial_rotary_factor",
                f"{self.partial_rotary_factor} x head_dim {self.head_dim} leaves {self.rotary_dim} rotary dims "
                "(must be even and positive)")
        require(self.mlp_activation in MLP_ACTIVATIONS, "mlp_activation",
                f"{self.mlp_activation!r} is not supported (supported: {', '.join(MLP_ACTIVATIONS)})")
        require(self.norm_offset in (0.0, 1.0), "norm_offset", f"must be 0.0 or 1.0, got {self.norm_offset}")
        require(self.embedding_multiplier > 0, "embedding_multiplier", "must be positive")
        require(self.attention_scale is None or self.attention_scale > 0, "attention_scale", "must be positive")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            require(getattr(self, name) is None or getattr(self, name) > 0, name, "must be positive")
        require(self.attn_logit_softcapping is None or not self.is_mla, "attn_logit_softcapping",
                "soft-capped multi-latent attention is not implemented")
        if self.local_rope_theta is not None:
            require(self.local_rope_theta > 0, "local_rope_theta", "must be positive")
            require(bool(self.windowed_layers) and not self.is_mla, "local_rope_theta",
                    "a RoPE base for the sliding-window layers needs windowed layers (and no multi-latent attention)")
        if self.sandwich_norms or self.norm_offset or self.mlp_activation != "silu":
            require(not self.is_moe and not self.is_mla, "sandwich_norms",
                    "Gemma's layer numerics (sandwich or (1 + w) norms, GeGLU) are implemented for dense "
                    "grouped-query-attention models")
        if self.swiglu_alpha != 1.0 or self.swiglu_limit is not None or self.glu_linear_offset:
            require(self.mlp_activation == "silu", "swiglu_alpha",
                    "the clamped, offset SwiGLU (GPT-OSS) is a SiLU-family activation (mlp_activation silu)")
        require(self.swiglu_alpha > 0, "swiglu_alpha", f"must be positive, got {self.swiglu_alpha}")
        require(self.swiglu_limit is None or self.swiglu_limit > 0, "swiglu_limit", "must be positive")
        require(not (self.moe_router_bias or self.expert_biases) or self.is_moe, "expert_biases",
                "router and expert biases need a mixture-of-experts model (num_experts > 0)")
        require(not (self.moe_router_bias and self.moe_router_score != "softmax"), "moe_router_bias",
                "a router logit bias is implemented for the softmax router")
        require(not ((self.attention_sinks or self.attention_output_bias) and self.is_mla), "attention_sinks",
                "attention sinks and an output-projection bias are implemented for grouped-query attention")
        require(not (self.attention_sinks and self.attn_logit_softcapping), "attention_sinks",
                "attention sinks with soft-capped scores are not implemented")
        require(self.shared_expert_ffn_hidden_size >= 0, "shared_expert_ffn_hidden_size", "must be >= 0")
        require(self.shared_expert_ffn_hidden_size == 0 or self.num_experts > 0, "shared_expert_ffn_hidden_size",
                "a shared expert needs a mixture-of-experts model (num_experts > 0)")
        require(not self.shared_expert_gate or self.shared_expert_ffn_hidden_size > 0, "shared_expert_gate",
                "set without a shared expert (shared_expert_ffn_hidden_size is 0)")

    def _check_router(self) -> None:
        """The routers transformers and Megatron compute alike."""
        require(self.moe_router_score in ("softmax", "sigmoid"), "moe_router_score",
                f"{self.moe_router_score!r} is not supported (softmax, sigmoid)")
        sigmoid = self.moe_router_score == "sigmoid"
        require(sigmoid or not self.moe_router_expert_bias, "moe_router_expert_bias",
                "an expert bias needs the sigmoid router")
        require(sigmoid or self.moe_router_groups == 1, "moe_router_groups",
                "group-limited routing is implemented for the sigmoid router only")
        require(self.moe_routed_scaling_factor > 0, "moe_routed_scaling_factor", "must be positive")
        if not self.is_moe:
            require(not sigmoid and self.moe_router_groups == 1 and self.moe_routed_scaling_factor == 1.0,
                    "moe_router_score", "router settings on a dense model (num_experts is 0)")
            return
        if sigmoid:  # Megatron renormalises the sigmoid top-k exactly when k > 1
            require(self.moe_norm_topk_prob == (self.moe_top_k > 1), "moe_norm_topk_prob",
                    f"{self.moe_norm_topk_prob} with top-{self.moe_top_k} of a sigmoid router: Megatron renormalises "
                    "the sigmoid weights exactly when k > 1")
        groups, topk_groups = self.moe_router_groups, self.moe_router_group_topk
        require(groups >= 1 and self.num_experts % groups == 0 and self.num_experts // groups >= 2,
                "moe_router_groups", f"{groups} must divide num_experts={self.num_experts} into groups of >= 2")
        require(topk_groups >= 1, "moe_router_group_topk", f"must be >= 1, got {topk_groups}")
        require(topk_groups <= groups, "moe_router_groups",
                f"{groups} group(s) cannot give each token the {topk_groups} groups moe_router_group_topk asks for")
        if topk_groups < groups:  # transformers scores a group by its best two; Megatron by its best k / topk_groups
            require(self.moe_top_k // topk_groups == 2, "moe_top_k",
                    f"top-{self.moe_top_k} within {topk_groups} of {groups} groups (moe_router_group_topk): a group's "
                    f"score is its best two experts' sum in transformers but its best {self.moe_top_k // topk_groups} "
                    "in Megatron (k / group top-k must be 2)")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (all of them unless `partial_rotary_factor` < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_parameters(self) -> int:
        """Parameters of one layer's attention (projections, their biases and norms)."""
        h = self.hidden_size
        if self.is_mla:
            heads, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank \
                else h * heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        if self.attention_output_bias:
            params += h
        if self.attention_sinks:
            params += self.num_attention_heads
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    @property
    def kv_cache_width(self) -> int:
        """Numbers a KV cache holds per token and layer: the latent and the rotary key (multi-latent attention),
        else K and V of every KV head."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.kv_size

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether 0-based `layer`'s MLP is the mixture of experts."""
        return self.is_moe and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """The 0-based layers whose MLP is the mixture of experts (empty for a dense model)."""
        return tuple(i for i in range(self.num_layers) if self.layer_is_moe(i))

    @property
    def has_dense_mlp(self) -> bool:
        """Some layer runs the dense MLP of `ffn_hidden_size` (every layer of a dense model)."""
        return len(self.moe_layer_indices) < self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """The attention window of 0-based `layer` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> ModelArch:
        """The arch whose `rope_theta` / `rope_scaling` rotate 0-based `layer` (`models/rope.py` reads them): a
        sliding-window layer of a model with a `local_rope_theta` rotates with that base, unscaled."""
        if self.local_rope_theta is None or self.layer_window(layer) is None:
            return self
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=None, local_rope_theta=None)

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The 0-based layers that attend through the sliding window."""
        return tuple(i for i in range(self.num_layers) if self.layer_window(i) is not None)

    def mlp_parameters(self, layer: int | None = None) -> int:
        """Parameters of one layer's MLP (every expert, the router and any shared expert for an MoE layer);
        `layer` None: an MoE layer of an MoE model."""
        h = self.hidden_size
        if self.is_moe and (layer is None or self.layer_is_moe(layer)):
            shared = 3 * h * self.shared_expert_ffn_hidden_size + (h if self.shared_expert_gate else 0)
            biases = self.num_experts * (2 * self.moe_ffn_hidden_size + h) if self.expert_biases else 0
            router = self.num_experts * (h + int(self.moe_router_bias))
            return self.num_experts * 3 * h * self.moe_ffn_hidden_size + router + shared + biases
        return 3 * h * self.ffn_hidden_size

    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        per_layer = self.attention_parameters() + (4 if self.sandwich_norms else 2) * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        mlps = sum(self.mlp_parameters(i) for i in range(self.num_layers))
        return self.num_layers * per_layer + mlps + embed + h

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "arch") -> ModelArch:
        """Inverse of `dataclasses.asdict(arch)` (checkpoint metadata); unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown architecture field(s) {unknown}")
        fields = dict(data)
        if isinstance(fields.get("rope_scaling"), dict):
            rope_known = {f.name for f in dataclasses.fields(RopeScaling)}
            rope_unknown = sorted(set(fields["rope_scaling"]) - rope_known)
            if rope_unknown:
                raise ConfigError(f"{where}: unknown rope_scaling field(s) {rope_unknown}")
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)


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
