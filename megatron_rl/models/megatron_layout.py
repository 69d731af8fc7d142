"""HF decoder tensors <-> Megatron-core GPTModel shards at any tensor (TP) and pipeline (PP) size.

Megatron's layout, as its `GPTModel` state dict names it (local or Transformer Engine layer spec):
- `linear_qkv` fuses q, k and v per query group: for group g the rows are
  [q heads of g (num_heads/num_groups * head_dim); k_g (head_dim); v_g (head_dim)], and a TP rank
  owns whole query groups (so TP must divide num_query_groups). Its bias (Qwen2's q/k/v biases,
  `linear_qkv.bias`) is fused and split exactly like the weight's rows.
- Qwen3's per-head q/k RMSNorm weights (`self_attention.{q,k}_layernorm.weight`, [head_dim]) are
  replicated on every TP rank.
- `linear_fc1` on TP rank r is cat(gate_r, up_r): each of gate and up is split by rows first.
- `linear_proj` and `linear_fc2` are split along their input (column) dimension.
- The embedding and output layer are split along a vocabulary padded to a multiple of
  `vocab_divisible_by * TP` (padding rows are zero; exports drop them).
- Layers are numbered from 0 on every pipeline stage; stage s holds global layers
  [s * L/PP, (s + 1) * L/PP), or, with Megatron's uneven split (`first_stage_layers` / `last_stage_layers`,
  its num_layers_in_first/last_pipeline_stage), the first and last stages hold those counts and the stages
  between share the rest evenly (`pipeline_stage_layers`). With tied embeddings and PP > 1 the last stage keeps its own copy of
  the embedding as `output_layer.weight` (Megatron all-reduces the two copies' gradients).
- With the TE spec the two RMSNorm weights are fused into the following linear
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
- Mixture of experts (docs/moe.md): `mlp.router.weight` [E, H] is replicated over TP, as is a sigmoid router's
  expert bias `mlp.router.expert_bias` [E] (fp32; HF `mlp.gate.e_score_correction_bias`); expert e's weights are
  `mlp.experts.local_experts.{j}.linear_fc1/linear_fc2.weight`, split over TP like the dense fc1/fc2 (Megatron's
  expert tensor parallel size = TP), and held by expert-parallel rank e // (E / EP) as its local expert
  j = e % (E / EP). The MLP norm stays `pre_mlp_layernorm.weight` with both specs. A stage's shards are
  listed per (EP rank, TP rank): index ep_rank * TP + tp_rank (`MegatronLayout.shard_index`). Dense layers
  among the MoE ones (`ModelArch.moe_layers`) keep the dense `mlp.linear_fc1/linear_fc2` names. A shared expert
  (Qwen2-MoE) is `mlp.shared_experts.linear_fc1/linear_fc2.weight`, split over TP like a dense MLP and held by
  every EP rank, with its sigmoid gate `mlp.shared_experts.gate_weight` [1, H] replicated.
- GPT-OSS (models/families.py `gpt_oss`): the output projection's bias `self_attention.linear_proj.bias` and
  each expert's `linear_fc2.bias` whole on every TP rank (the latter added on TP rank 0 only,
  trainer/moe.py), `linear_fc1.bias` split like fc1's rows, the router's logit bias `mlp.router.bias`
  replicated, the sinks `self_attention.core_attention.softmax_offset` [heads / TP] split by heads.
- HF side: published per-expert names (models/families.py `hf_expert_names`); transformers 5's fused
  in-memory form (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) is accepted on
  input (`canonical_hf_state`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.families import (
    Family,
    get_family,
    hf_expert_bias_names,
    hf_expert_names,
    hf_router_bias_name,
    hf_router_logit_bias_name,
    hf_router_name,
    hf_shared_expert_names,
)

logger = logging.getLogger(__name__)

LayerSpec = Literal["local", "te"]


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """How one model is split over Megatron ranks."""

    arch: ModelArch
    tp: int = 1
    pp: int = 1
    layer_spec: LayerSpec = "local"
    vocab_divisible_by: int = 128
    ep: int = 1
    """Expert-parallel size (MoE only): EP ranks each hold num_experts / EP experts of every layer."""
    first_stage_layers: int | None = None
    """Layers of the first pipeline stage (None: an even share)."""
    last_stage_layers: int | None = None
    """Layers of the last pipeline stage (None: an even share)."""

    def __post_init__(self) -> None:
        check_parallel_layout(self.arch, self.tp, self.pp, self.ep, first_stage_layers=self.first_stage_layers,
                              last_stage_layers=self.last_stage_layers)
        if self.arch.is_mla and self.layer_spec == "te":
            raise ConfigError("multi-latent attention is mapped onto Megatron's local layer spec only (Transformer "
                              "Engine's fuses its latent norms into the up projections): trainer.layer_spec local",
                              field="trainer.layer_spec")
        if (self.arch.attention_sinks or self.arch.expert_biases) and self.layer_spec == "te":
            raise ConfigError("GPT-OSS's attention sinks and biased experts (its down bias added once over TP) are built "
                              "on Megatron's local layer spec only: trainer.layer_spec local", field="trainer.layer_spec")
        if self.arch.sandwich_norms and self.layer_spec == "te":
            raise ConfigError("Gemma's sandwich and (1 + w) norms are built on Megatron's local layer spec only: "
                              "trainer.layer_spec local", field="trainer.layer_spec")

    @property
    def shards_per_stage(self) -> int:
        return self.tp * self.ep

    def shard_index(self, tp_rank: int, ep_rank: int = 0) -> int:
        """Where (tp_rank, ep_rank)'s shard sits in a stage's list of shards."""
        return ep_rank * self.tp + tp_rank

    @property
    def local_experts(self) -> int:
        return self.arch.num_experts // self.ep

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.vocab_divisible_by * self.tp
        return -(-self.arch.vocab_size // multiple) * multiple

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        return pipeline_stage_layers(self.arch.num_layers, self.pp, self.first_stage_layers, self.last_stage_layers)

    def stage_layers(self, pp_rank: int) -> range:
        """The global layers pipeline stage `pp_rank` holds."""
        return stage_layer_range(self.stage_layer_counts, pp_rank)

    def stage_of(self, layer: int) -> tuple[int, int]:
        """(pipeline stage, local index there) of global layer `layer`."""
        for stage, count in enumerate(self.stage_layer_counts):
            if layer < count:
                return stage, layer
            layer -= count
        raise IndexError(f"layer {layer} is beyond the model's {self.arch.num_layers} layers")


    def has_output_layer(self, pp_rank: int) -> bool:
        last = pp_rank == self.pp - 1
        return last and (not self.arch.tie_word_embeddings or self.pp > 1)

    def layer_norms(self, layer: int) -> list[tuple[str, str]]:
        """(HF name, Megatron name) within global layer `layer` of each of its hidden-size norm weights: the
        attention's and the MLP's input norms, then a sandwich model's output norms (`post_norm` of the
        attention's and the MLP's output projections, trainer/model.py)."""
        if self.layer_spec == "te":
            # An MoE layer's MLP norm is its own module (TE cannot fuse it into the router and experts).
            mlp = "pre_mlp_layernorm.weight" if self.arch.layer_is_moe(layer) else "mlp.linear_fc1.layer_norm_weight"
            attention = "self_attention.linear_qkv.layer_norm_weight"
        else:
            attention, mlp = "input_layernorm.weight", "pre_mlp_layernorm.weight"
        megatron = [attention, mlp]
        if self.arch.sandwich_norms:
            megatron += ["self_attention.linear_proj.post_norm.weight", "mlp.linear_fc2.post_norm.weight"]
        return list(zip(hf_layer_norm_names(self.arch), megatron))


def pipeline_stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None
                          ) -> tuple[int, ...]:
    """Layers per pipeline stage as Megatron splits them: `first` / `last` on the first / last stage where
    set, the rest evenly over the other stages (which must divide it). Raises a ConfigError naming the field."""
    fields = {"first_stage_layers": first, "last_stage_layers": last}
    for name, value in fields.items():
        if value is not None and value < 1:
            raise ConfigError(f"trainer.parallel.{name}={value} must be >= 1 (unset: an even share)",
                              field=f"trainer.parallel.{name}")
    uneven = [name for name, value in fields.items() if value is not None]
    if uneven and pp == 1:
        raise ConfigError(f"trainer.parallel.{uneven[0]} needs pipeline_parallel > 1", field=f"trainer.parallel.{uneven[0]}")
    if first is not None and last is not None and pp == 2 and first + last != num_layers:
        raise ConfigError(f"first_stage_layers {first} + last_stage_layers {last} != the model's {num_layers} layers "
                          "(pipeline_parallel 2 has no other stage)", field="trainer.parallel.last_stage_layers")
    middle_stages = pp - len(uneven)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        return (first, last)
    if middle_layers < middle_stages or middle_layers % middle_stages:
        what = (f"first_stage_layers / last_stage_layers leave {max(middle_layers, 0)} of the model's {num_layers} "
                f"layers for the other {middle_stages} stages, which need an even share of at least one each"
                if uneven else
                f"pipeline_parallel={pp} does not divide the model's {num_layers} layers")
        hint = "" if uneven else " (or set first_stage_layers / last_stage_layers, Megatron's uneven split)"
        raise ConfigError(what + hint, field=f"trainer.parallel.{uneven[-1] if uneven else 'pipeline_parallel'}")
    per = middle_layers // middle_stages
    return tuple(first if stage == 0 and first is not None else last if stage == pp - 1 and last is not None
                 else per for stage in range(pp))


def stage_layer_range(counts: tuple[int, ...], stage: int) -> range:
    """The global layers of pipeline stage `stage`, given every stage's layer count (`pipeline_stage_layers`)."""
    first = sum(counts[:stage])
    return range(first, first + counts[stage])


def check_parallel_layout(arch: ModelArch, tp: int, pp: int, ep: int = 1, *, first_stage_layers: int | None = None,
                          last_stage_layers: int | None = None) -> None:
    """Raise a ConfigError naming the field when the model cannot be split this way."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (tensor_parallel={tp}, pipeline_parallel={pp}, "
                          f"expert_parallel={ep})")
    if ep > 1 and not arch.is_moe:
        raise ConfigError(f"expert_parallel={ep} needs a mixture-of-experts model (this {arch.family} model is dense)")
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ConfigError(f"expert_parallel={ep} does not divide the model's {arch.num_experts} experts "
                              "(num_experts)")
        if arch.moe_ffn_hidden_size % tp:
            raise ConfigError(f"tensor_parallel={tp} does not divide moe_ffn_hidden_size={arch.moe_ffn_hidden_size} "
                              "(experts are split over TP like the dense MLP)")
        if arch.shared_expert_ffn_hidden_size % tp:
            raise ConfigError(f"tensor_parallel={tp} does not divide shared_expert_ffn_hidden_size="
                              f"{arch.shared_expert_ffn_hidden_size} (the shared expert is split over TP like a dense "
                              "MLP)")
    if arch.num_query_groups % tp:
        raise ConfigError(
            f"tensor_parallel={tp} does not divide the model's {arch.num_query_groups} key/value heads "
            f"(num_query_groups; {arch.num_attention_heads} attention heads): choose a TP size that divides "
            f"{arch.num_query_groups}")
    if arch.has_dense_mlp and arch.ffn_hidden_size % tp:
        raise ConfigError(f"tensor_parallel={tp} does not divide ffn_hidden_size={arch.ffn_hidden_size}")
    pipeline_stage_layers(arch.num_layers, pp, first_stage_layers, last_stage_layers)


def _split_rows(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in torch.chunk(t, parts, dim=0)]


def _split_cols(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in torch.chunk(t, parts, dim=1)]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch, tp: int) -> list[torch.Tensor]:
    """Per-TP-rank fused QKV weights from HF q/k/v (rows grouped by query group, see module doc)."""
    groups, hd = arch.num_query_groups, arch.head_dim
    heads_per_group = arch.num_attention_heads // groups
    hidden = q.shape[1]
    fused = torch.cat([q.view(groups, heads_per_group * hd, hidden),
                       k.view(groups, hd, hidden), v.view(groups, hd, hidden)], dim=1)
    return [c.reshape(-1, hidden).contiguous() for c in torch.chunk(fused, tp, dim=0)]


def split_qkv(shards: list[torch.Tensor], arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: HF q, k, v from the fused weights of every TP rank (in rank order)."""
    groups, hd = arch.num_query_groups, arch.head_dim
    heads_per_group = arch.num_attention_heads // groups
    hidden = shards[0].shape[1]
    fused = torch.cat(shards, dim=0).view(groups, (heads_per_group + 2) * hd, hidden)
    q, k, v = torch.split(fused, [heads_per_group * hd, hd, hd], dim=1)
    return (q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(),
            v.reshape(-1, hidden).contiguous())


def fuse_qkv_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch, tp: int) -> list[torch.Tensor]:
    """`fuse_qkv` for the 1-D q/k/v biases (a bias row follows its weight row)."""
    return [s.squeeze(1) for s in fuse_qkv(q[:, None], k[:, None], v[:, None], arch, tp)]


def split_qkv_bias(shards: list[torch.Tensor], arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv_bias`."""
    q, k, v = split_qkv([s[:, None] for s in shards], arch)
    return q.squeeze(1), k.squeeze(1), v.squeeze(1)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [torch.cat([g, u], dim=0) for g, u in zip(_split_rows(gate, tp), _split_rows(up, tp))]


def split_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves]).contiguous(), torch.cat([h[1] for h in halves]).contiguous()


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] == padded:
        return weight
    pad = weight.new_zeros(padded - weight.shape[0], weight.shape[1])
    return torch.cat([weight, pad], dim=0)


def _require(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ConfigError(f"checkpoint is missing tensor '{name}'")
    return state[name]


def canonical_hf_state(state: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """`state` with an MoE model's experts under their published per-expert names: transformers 5's fused
    in-memory form (`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] = gate rows then up rows,
    `...mlp.experts.down_proj` [E, H, I], router `...mlp.gate.weight`) is split (views, no copy), and so are
    GPT-OSS's stacked experts (their published form, MXFP4 ones dequantized first; `published_hf_state`). Dense
    models and states already in the published form are returned as they are. A family's multi-token-prediction
    layers (GLM-4.5's, stored as layers num_layers and on) are left out, as transformers leaves them."""
    if get_family(arch.family).mtp_layers_field:
        mtp = {k for k in state if k.startswith("model.layers.") and int(k.split(".")[2]) >= arch.num_layers}
        if mtp:
            logger.info("ignoring %d multi-token-prediction tensors (layers >= %d), as transformers does",
                        len(mtp), arch.num_layers)
            state = {k: v for k, v in state.items() if k not in mtp}
    if not arch.is_moe or not any(k.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_blocks"))
                                  for k in state):
        return state
    family = get_family(arch.family)
    if family.gpt_oss:
        return _unstacked_gpt_oss_experts(state, arch, family)
    out = dict(state)
    for layer in arch.moe_layer_indices:
        fused = f"model.layers.{layer}.mlp."
        gate_up, down = out.pop(fused + "experts.gate_up_proj", None), out.pop(fused + "experts.down_proj", None)
        if gate_up is None or down is None:
            raise ConfigError(f"checkpoint has fused experts for some layers but not for layer {layer} "
                              f"('{fused}experts.gate_up_proj' / 'down_proj')")
        if gate_up.dim() != 3 or gate_up.shape[1] % 2 or down.dim() != 3:
            raise ConfigError(f"checkpoint tensor '{fused}experts.gate_up_proj' has shape {tuple(gate_up.shape)}; "
                              "expected [num_experts, 2 * moe_intermediate_size, hidden_size]")
        if fused + "gate.weight" in out:
            out[hf_router_name(family, layer)] = out.pop(fused + "gate.weight")
        gates, ups = gate_up.chunk(2, dim=1)
        for expert in range(gate_up.shape[0]):
            g, u, d = hf_expert_names(family, layer, expert)
            out[g], out[u], out[d] = gates[expert], ups[expert], down[expert]
    return out


_GPT_OSS_STACKED = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 (e2m1) code."""


def dequantized_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """GPT-OSS's MXFP4 experts (OCP microscaling, as openai/gpt-oss-* publish them): `blocks` [E, rows, G, 16] uint8
    hold two FP4 (e2m1) codes per byte, low nibble first, and every 32 values of a row share the power of two
    `scales` [E, rows, G] - 127. Returns [E, G * 32, rows] (the stacked layout: rows are the output features) in
    `dtype`, exactly (every such value is a float32 and a bfloat16). One expert at a time, for the memory."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ConfigError(f"MXFP4 experts: blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                          f"{tuple(scales.shape)} {scales.dtype}; expected uint8 [E, rows, G, 16] and [E, rows, G]")
    table = torch.tensor(_FP4_E2M1, dtype=torch.float32)
    out = []
    for expert_blocks, expert_scales in zip(blocks, scales):
        codes = torch.stack([expert_blocks & 0x0F, expert_blocks >> 4], dim=-1).flatten(-2).long()  # [rows, G, 32]
        values = torch.ldexp(table[codes], (expert_scales.to(torch.float32) - 127.0).unsqueeze(-1))
        out.append(values.flatten(-2).t().to(dtype))
    return torch.stack(out)


def _dequantized_gpt_oss_experts(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Replace the MXFP4 `{prefix}experts.{gate_up,down}_proj_blocks / _scales` of one layer by their stacked
    tensors, in the dtype of the experts' biases (in place)."""
    for projection in ("gate_up_proj", "down_proj"):
        name = f"{prefix}experts.{projection}"
        if name + "_blocks" not in state:
            continue
        if name + "_scales" not in state:
            raise ConfigError(f"checkpoint is missing tensor '{name}_scales' (MXFP4 experts: blocks and scales)")
        dtype = state[name + "_bias"].dtype if name + "_bias" in state else torch.float32
        state[name] = dequantized_mxfp4(state.pop(name + "_blocks"), state.pop(name + "_scales"), dtype)


def _unstacked_gpt_oss_experts(state: dict[str, torch.Tensor], arch: ModelArch,
                               family: Family) -> dict[str, torch.Tensor]:
    """GPT-OSS's stacked experts (`mlp.experts.gate_up_proj` [E, H, 2I], gate and up columns interleaved, its bias
    [E, 2I], `down_proj` [E, I, H] and its bias [E, H]) as per-expert [out, in] tensors (views, no copy)."""
    out = dict(state)
    for layer in arch.moe_layer_indices:
        prefix = f"model.layers.{layer}.mlp."
        _dequantized_gpt_oss_experts(out, prefix)
        missing = [prefix + n for n in _GPT_OSS_STACKED if prefix + n not in out]
        if missing:
            raise ConfigError(f"checkpoint is missing tensor '{missing[0]}' (GPT-OSS keeps its experts stacked)")
        gate_up, gate_up_bias, down, down_bias = (out.pop(prefix + n) for n in _GPT_OSS_STACKED)
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size
        for name, tensor, shape in ((prefix + _GPT_OSS_STACKED[0], gate_up, (e, h, 2 * i)),
                                    (prefix + _GPT_OSS_STACKED[1], gate_up_bias, (e, 2 * i)),
                                    (prefix + _GPT_OSS_STACKED[2], down, (e, i, h)),
                                    (prefix + _GPT_OSS_STACKED[3], down_bias, (e, h))):
            if tuple(tensor.shape) != shape:
                raise ConfigError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, but this GPT-OSS "
                                  f"config needs {shape}")
        for expert in range(e):
            g, u, d = hf_expert_names(family, layer, expert)
            gb, ub, db = hf_expert_bias_names(family, layer, expert)
            out[g], out[u] = gate_up[expert, :, 0::2].t(), gate_up[expert, :, 1::2].t()
            out[d] = down[expert].t()
            out[gb], out[ub], out[db] = gate_up_bias[expert, 0::2], gate_up_bias[expert, 1::2], down_bias[expert]
    return out


def published_hf_state(state: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Inverse of `canonical_hf_state` where a family's published checkpoints differ from the per-expert form
    (GPT-OSS: experts stacked and interleaved, as transformers and vLLM load them); `state` itself otherwise."""
    family = get_family(arch.family)
    if not family.gpt_oss:
        return state
    out = dict(state)
    for layer in arch.moe_layer_indices:
        names = [hf_expert_names(family, layer, e) for e in range(arch.num_experts)]
        biases = [hf_expert_bias_names(family, layer, e) for e in range(arch.num_experts)]
        gate_up = torch.stack([torch.stack([out.pop(g).t(), out.pop(u).t()], dim=-1).flatten(-2)
                               for g, u, _ in names])
        gate_up_bias = torch.stack([torch.stack([out.pop(g), out.pop(u)], dim=-1).flatten() for g, u, _ in biases])
        down = torch.stack([out.pop(d).t() for _, _, d in names])
        down_bias = torch.stack([out.pop(d) for _, _, d in biases])
        prefix = f"model.layers.{layer}.mlp."
        for name, tensor in zip(_GPT_OSS_STACKED, (gate_up, gate_up_bias, down, down_bias)):
            out[prefix + name] = tensor.contiguous()
    return out


def _expert_range(layout: MegatronLayout, ep_rank: int) -> range:
    return range(ep_rank * layout.local_experts, (ep_rank + 1) * layout.local_experts)


def hf_to_megatron(state: dict[str, torch.Tensor], layout: MegatronLayout) -> list[list[dict[str, torch.Tensor]]]:
    """HF-named tensors -> shards[pp_rank][layout.shard_index(tp_rank, ep_rank)], each a Megatron GPTModel
    state dict (for a dense model or EP = 1: shards[pp_rank][tp_rank])."""
    arch, tp, pp, ep = layout.arch, layout.tp, layout.pp, layout.ep
    state = canonical_hf_state(state, arch)
    check_hf_state(state, arch)
    family = get_family(arch.family)
    shards: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(tp * ep)] for _ in range(pp)]

    def each(stage: int):  # (tp_rank, ep_rank, shard) of a stage
        return [(t, e, shards[stage][layout.shard_index(t, e)]) for e in range(ep) for t in range(tp)]

    embed = _pad_vocab(_require(state, "model.embed_tokens.weight"), layout.padded_vocab_size)
    head = embed if arch.tie_word_embeddings else _pad_vocab(_require(state, "lm_head.weight"),
                                                            layout.padded_vocab_size)
    embed_chunks = _split_rows(embed, tp)
    for t, _, shard in each(0):
        shard["embedding.word_embeddings.weight"] = embed_chunks[t]
    if layout.has_output_layer(pp - 1):
        head_chunks = _split_rows(head, tp)
        for t, _, shard in each(pp - 1):
            shard["output_layer.weight"] = head_chunks[t]
    for _, _, shard in each(pp - 1):
        shard["decoder.final_layernorm.weight"] = _require(state, "model.norm.weight").clone()
    for layer in range(arch.num_layers):
        stage, local = layout.stage_of(layer)
        hf = f"model.layers.{layer}."
        meg = f"decoder.layers.{local}."
        moe = arch.layer_is_moe(layer)
        if arch.is_mla:  # Megatron name -> its TP shards
            attention = {m: _tp_split(_rope_rows(_require(state, hf + h), h, arch), split, tp)
                         for h, m, split in mla_tensors(arch)}
        else:
            qkv = fuse_qkv(_require(state, hf + "self_attn.q_proj.weight"),
                           _require(state, hf + "self_attn.k_proj.weight"),
                           _require(state, hf + "self_attn.v_proj.weight"), arch, tp)
            attention = {"self_attention.linear_qkv.weight": qkv,
                         "self_attention.linear_proj.weight": _split_cols(_require(state, hf + "self_attn.o_proj.weight"),
                                                                          tp)}
        if arch.attention_output_bias:  # a row-parallel bias: added once, after the reduction
            attention["self_attention.linear_proj.bias"] = _tp_split(_require(state, hf + "self_attn.o_proj.bias"),
                                                                     None, tp)
        if arch.attention_sinks:  # one per query head: TP rank r holds its heads'
            attention["self_attention.core_attention.softmax_offset"] = _split_rows(
                _require(state, hf + "self_attn.sinks"), tp)
        if moe:
            router = _require(state, hf_router_name(family, layer))
            router_bias = _require(state, hf_router_bias_name(family, layer)) if arch.moe_router_expert_bias else None
            experts, expert_biases = {}, {}
            for expert in range(arch.num_experts):
                g, u, d = (_require(state, n) for n in hf_expert_names(family, layer, expert))
                experts[expert] = (fuse_gate_up(g, u, tp), _split_cols(d, tp))
                if arch.expert_biases:  # fc1's split like its rows; fc2's whole on every rank (trainer/moe.py)
                    gb, ub, db = (_require(state, n) for n in hf_expert_bias_names(family, layer, expert))
                    expert_biases[expert] = (fuse_gate_up(gb, ub, tp), _tp_split(db, None, tp))
            if arch.shared_expert_ffn_hidden_size:  # split over TP like a dense MLP, replicated over EP
                g, u, d, shared_gate = hf_shared_expert_names(family, layer)
                shared_fc1 = fuse_gate_up(_require(state, g), _require(state, u), tp)
                shared_fc2 = _split_cols(_require(state, d), tp)
        else:
            fc1 = fuse_gate_up(_require(state, hf + "mlp.gate_proj.weight"), _require(state, hf + "mlp.up_proj.weight"), tp)
            fc2 = _split_cols(_require(state, hf + "mlp.down_proj.weight"), tp)
        if arch.attention_bias:
            qkv_bias = fuse_qkv_bias(*(_require(state, hf + f"self_attn.{p}_proj.bias") for p in "qkv"), arch, tp)
        for t, e, shard in each(stage):
            for name, parts in attention.items():
                shard[meg + name] = parts[t]
            if moe:
                shard[meg + "mlp.router.weight"] = router.clone()
                if arch.moe_router_bias:
                    shard[meg + "mlp.router.bias"] = _require(state, hf_router_logit_bias_name(family, layer)).clone()
                if router_bias is not None:  # Megatron keeps it as an fp32 buffer
                    shard[meg + "mlp.router.expert_bias"] = router_bias.float().clone()
                for j, expert in enumerate(_expert_range(layout, e)):
                    fc1_e, fc2_e = experts[expert]
                    shard[meg + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1_e[t]
                    shard[meg + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = fc2_e[t]
                    if arch.expert_biases:
                        fc1_b, fc2_b = expert_biases[expert]
                        shard[meg + f"mlp.experts.local_experts.{j}.linear_fc1.bias"] = fc1_b[t]
                        shard[meg + f"mlp.experts.local_experts.{j}.linear_fc2.bias"] = fc2_b[t]
                if arch.shared_expert_ffn_hidden_size:
                    shard[meg + "mlp.shared_experts.linear_fc1.weight"] = shared_fc1[t]
                    shard[meg + "mlp.shared_experts.linear_fc2.weight"] = shared_fc2[t]
                    if arch.shared_expert_gate:
                        shard[meg + "mlp.shared_experts.gate_weight"] = _require(state, shared_gate).clone()
            else:
                shard[meg + "mlp.linear_fc1.weight"] = fc1[t]
                shard[meg + "mlp.linear_fc2.weight"] = fc2[t]
            for hf_norm, meg_norm in layout.layer_norms(layer):
                shard[meg + meg_norm] = _require(state, hf + hf_norm).clone()
            if arch.attention_bias:
                shard[meg + "self_attention.linear_qkv.bias"] = qkv_bias[t]
            if arch.qk_norm:
                for p in "qk":
                    shard[meg + f"self_attention.{p}_layernorm.weight"] = \
                        _require(state, hf + f"self_attn.{p}_norm.weight").clone()
    return shards


def mla_tensors(arch: ModelArch) -> list[tuple[str, str, str | None]]:
    """Multi-latent attention's tensors: (HF name in the layer, Megatron name in the layer, how TP splits it: "rows",
    "cols" or None for replicated). The latent down projections and norms are replicated (trainer/model.py
    `layer_spec`); q_b / kv_b split by heads, o_proj by its input columns."""
    query = [("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight", "rows")] if not arch.q_lora_rank else [
        ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight", None),
        ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight", None),
        ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight", "rows")]
    return query + [("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight", None),
                    ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight", None),
                    ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight", "rows"),
                    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", "cols")]


def mla_tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF shapes of one layer's multi-latent attention tensors (names within the layer)."""
    h, heads, qk = arch.hidden_size, arch.num_attention_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    shapes = {"self_attn.q_proj.weight": (heads * qk, h)} if not arch.q_lora_rank else {
        "self_attn.q_a_proj.weight": (arch.q_lora_rank, h), "self_attn.q_a_layernorm.weight": (arch.q_lora_rank,),
        "self_attn.q_b_proj.weight": (heads * qk, arch.q_lora_rank)}
    shapes.update({"self_attn.kv_a_proj_with_mqa.weight": (arch.kv_lora_rank + arch.qk_rope_head_dim, h),
                   "self_attn.kv_a_layernorm.weight": (arch.kv_lora_rank,),
                   "self_attn.kv_b_proj.weight": (heads * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank),
                   "self_attn.o_proj.weight": (h, heads * arch.v_head_dim)})
    return shapes


def _rope_rows(tensor: torch.Tensor, hf_name: str, arch: ModelArch, inverse: bool = False) -> torch.Tensor:
    """The rotary rows of the query (per head) and of the shared rotary key as Megatron's MLA wants them. Megatron
    takes them as DeepSeek lays them out, interleaved pairs (x0, x1), (x2, x3), ..., and de-interleaves them itself
    before its rotate-half RoPE, which is what transformers computes for `rope_interleave` (nothing to reorder). A
    model with rotate-half rows (`rope_interleave` false) gets them interleaved here, first half with second, so that
    Megatron's de-interleaving restores them. `inverse` puts them back."""
    if arch.rope_interleave or hf_name not in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                                               "self_attn.kv_a_proj_with_mqa.weight"):
        return tensor
    half = arch.qk_rope_head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).reshape(-1)
    if inverse:
        order = torch.argsort(order)
    if hf_name == "self_attn.kv_a_proj_with_mqa.weight":  # rows [latent | rotary key]
        return torch.cat([tensor[:arch.kv_lora_rank], tensor[arch.kv_lora_rank:][order]])
    heads = tensor.view(arch.num_attention_heads, arch.qk_nope_head_dim + 2 * half, -1)  # rows per head [nope | rope]
    return torch.cat([heads[:, :arch.qk_nope_head_dim], heads[:, arch.qk_nope_head_dim:][:, order]], 1).reshape(
        tensor.shape)


def mla_megatron_rows(arch: ModelArch, hf_name: str) -> torch.Tensor:
    """For each row of the HF tensor `hf_name` (within a layer), its row in Megatron's (whole, unsplit) layout."""
    rows = mla_tensor_shapes(arch)[hf_name][0]
    moved = _rope_rows(torch.arange(rows)[:, None], hf_name, arch)[:, 0]  # Megatron row j holds HF row moved[j]
    return torch.argsort(moved)


def _tp_split(tensor: torch.Tensor, split: str | None, tp: int) -> list[torch.Tensor]:
    if split == "rows":
        return _split_rows(tensor, tp)
    if split == "cols":
        return _split_cols(tensor, tp)
    return [tensor.clone() for _ in range(tp)]


def hf_layer_norm_names(arch: ModelArch) -> tuple[str, ...]:
    """The published names (within a layer) of its hidden-size norms: attention input, MLP input, then a sandwich
    model's attention output and MLP output (Gemma's `post_attention_layernorm` follows the attention, where
    Llama's of that name precedes the MLP)."""
    if arch.sandwich_norms:
        return ("input_layernorm.weight", "pre_feedforward_layernorm.weight", "post_attention_layernorm.weight",
                "post_feedforward_layernorm.weight")
    return "input_layernorm.weight", "post_attention_layernorm.weight"


def hf_tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `arch` holds (published names), with its shape (lm_head left out
    when tied)."""
    h, f, v, hd = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    per_layer = mla_tensor_shapes(arch) if arch.is_mla else {
        "self_attn.q_proj.weight": (arch.q_size, h), "self_attn.k_proj.weight": (arch.kv_size, h),
        "self_attn.v_proj.weight": (arch.kv_size, h), "self_attn.o_proj.weight": (h, arch.q_size)}
    per_layer.update({name: (h,) for name in hf_layer_norm_names(arch)})
    if arch.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (arch.q_size,), "self_attn.k_proj.bias": (arch.kv_size,),
                          "self_attn.v_proj.bias": (arch.kv_size,)})
    if arch.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if arch.attention_output_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if arch.attention_sinks:
        per_layer["self_attn.sinks"] = (arch.num_attention_heads,)
    for layer in range(arch.num_layers):
        shapes.update({f"model.layers.{layer}.{n}": s for n, s in per_layer.items()})
        if not arch.layer_is_moe(layer):
            shapes.update({f"model.layers.{layer}.mlp.{n}.weight": s
                           for n, s in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f)))})
        else:
            family, i = get_family(arch.family), arch.moe_ffn_hidden_size
            shapes[hf_router_name(family, layer)] = (arch.num_experts, h)
            if arch.moe_router_expert_bias:
                shapes[hf_router_bias_name(family, layer)] = (arch.num_experts,)
            if arch.moe_router_bias:
                shapes[hf_router_logit_bias_name(family, layer)] = (arch.num_experts,)
            for expert in range(arch.num_experts):
                g, u, d = hf_expert_names(family, layer, expert)
                shapes.update({g: (i, h), u: (i, h), d: (h, i)})
                if arch.expert_biases:
                    g, u, d = hf_expert_bias_names(family, layer, expert)
                    shapes.update({g: (i,), u: (i,), d: (h,)})
            if arch.shared_expert_ffn_hidden_size:
                g, u, d, gate = hf_shared_expert_names(family, layer)
                sh = arch.shared_expert_ffn_hidden_size
                shapes.update({g: (sh, h), u: (sh, h), d: (h, sh)})
                if arch.shared_expert_gate:
                    shapes[gate] = (1, h)
    return shapes


def check_hf_state(state: dict[str, torch.Tensor], arch: ModelArch) -> None:
    """Refuse, naming the tensor, a checkpoint that does not match its config: a tensor the architecture
    has no place for (an o_proj bias, an extra layer or expert: the conversion would drop it silently), a
    missing tensor, or a wrong shape."""
    shapes = hf_tensor_shapes(arch)
    moe = f", num_experts={arch.num_experts}" if arch.is_moe else ""
    where = (f"a {arch.family} model of this config (attention_bias={arch.attention_bias}, qk_norm={arch.qk_norm}, "
             f"num_layers={arch.num_layers}{moe})")
    extra = sorted(n for n in set(state) - set(shapes) - {"lm_head.weight"} if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(f"checkpoint tensor '{extra[0]}' does not belong to {where} "
                          f"({len(extra)} unexpected tensor(s))")
    for name, shape in shapes.items():
        tensor = _require(state, name)
        if tuple(tensor.shape) != shape:
            raise ConfigError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, but {where} "
                              f"needs {shape}")


def megatron_to_hf(shards: list[list[dict[str, torch.Tensor]]], layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`: shards[pp_rank][shard_index(tp_rank, ep_rank)] -> HF-named tensors
    (published names; vocab padding dropped)."""
    arch, tp, pp, ep = layout.arch, layout.tp, layout.pp, layout.ep
    if len(shards) != pp or any(len(row) != tp * ep for row in shards):
        sizes = f"{pp} x {tp}" + (f" x {ep} (PP x TP x EP)" if ep > 1 else " (PP x TP)")
        raise ConfigError(f"expected {sizes} shards, got {[len(r) for r in shards]}")
    vocab = arch.vocab_size
    family = get_family(arch.family)
    state: dict[str, torch.Tensor] = {}

    def gather(stage: int, name: str, ep_rank: int = 0) -> list[torch.Tensor]:
        return [_require(shards[stage][layout.shard_index(t, ep_rank)], name) for t in range(tp)]

    state["model.embed_tokens.weight"] = torch.cat(gather(0, "embedding.word_embeddings.weight"))[:vocab].contiguous()
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = torch.cat(gather(pp - 1, "output_layer.weight"))[:vocab].contiguous()
    state["model.norm.weight"] = _require(shards[pp - 1][0], "decoder.final_layernorm.weight").clone()
    for layer in range(arch.num_layers):
        stage, local = layout.stage_of(layer)
        hf = f"model.layers.{layer}."
        meg = f"decoder.layers.{local}."
        if arch.is_mla:
            for hf_name, meg_name, split in mla_tensors(arch):
                parts = gather(stage, meg + meg_name)
                whole = torch.cat(parts, 0 if split == "rows" else 1) if split else parts[0].clone()
                state[hf + hf_name] = _rope_rows(whole, hf_name, arch, inverse=True)
        else:
            q, k, v = split_qkv(gather(stage, meg + "self_attention.linear_qkv.weight"), arch)
            state[hf + "self_attn.q_proj.weight"] = q
            state[hf + "self_attn.k_proj.weight"] = k
            state[hf + "self_attn.v_proj.weight"] = v
            state[hf + "self_attn.o_proj.weight"] = torch.cat(gather(stage, meg + "self_attention.linear_proj.weight"), 1)
            if arch.attention_output_bias:
                state[hf + "self_attn.o_proj.bias"] = _require(shards[stage][0],
                                                               meg + "self_attention.linear_proj.bias").clone()
            if arch.attention_sinks:
                state[hf + "self_attn.sinks"] = torch.cat(gather(stage, meg + "self_attention.core_attention."
                                                                 "softmax_offset"))
        if arch.layer_is_moe(layer):
            state[hf_router_name(family, layer)] = _require(shards[stage][0], meg + "mlp.router.weight").clone()
            if arch.moe_router_bias:
                state[hf_router_logit_bias_name(family, layer)] = _require(shards[stage][0],
                                                                           meg + "mlp.router.bias").clone()
            if arch.moe_router_expert_bias:
                state[hf_router_bias_name(family, layer)] = _require(shards[stage][0],
                                                                     meg + "mlp.router.expert_bias").clone()
            for e in range(ep):
                for j, expert in enumerate(_expert_range(layout, e)):
                    name = meg + f"mlp.experts.local_experts.{j}."
                    gate, up = split_gate_up(gather(stage, name + "linear_fc1.weight", e))
                    g, u, d = hf_expert_names(family, layer, expert)
                    state[g], state[u] = gate, up
                    state[d] = torch.cat(gather(stage, name + "linear_fc2.weight", e), 1)
                    if arch.expert_biases:
                        gb, ub, db = hf_expert_bias_names(family, layer, expert)
                        state[gb], state[ub] = split_gate_up(gather(stage, name + "linear_fc1.bias", e))
                        state[db] = _require(shards[stage][layout.shard_index(0, e)], name + "linear_fc2.bias").clone()
            if arch.shared_expert_ffn_hidden_size:
                g, u, d, shared_gate = hf_shared_expert_names(family, layer)
                state[g], state[u] = split_gate_up(gather(stage, meg + "mlp.shared_experts.linear_fc1.weight"))
                state[d] = torch.cat(gather(stage, meg + "mlp.shared_experts.linear_fc2.weight"), 1)
                if arch.shared_expert_gate:
                    state[shared_gate] = _require(shards[stage][0], meg + "mlp.shared_experts.gate_weight").clone()
        else:
            gate, up = split_gate_up(gather(stage, meg + "mlp.linear_fc1.weight"))
            state[hf + "mlp.gate_proj.weight"] = gate
            state[hf + "mlp.up_proj.weight"] = up
            state[hf + "mlp.down_proj.weight"] = torch.cat(gather(stage, meg + "mlp.linear_fc2.weight"), 1)
        for hf_norm, meg_norm in layout.layer_norms(layer):
            state[hf + hf_norm] = _require(shards[stage][0], meg + meg_norm).clone()
        if arch.attention_bias:
            qb, kb, vb = split_qkv_bias(gather(stage, meg + "self_attention.linear_qkv.bias"), arch)
            state[hf + "self_attn.q_proj.bias"] = qb
            state[hf + "self_attn.k_proj.bias"] = kb
            state[hf + "self_attn.v_proj.bias"] = vb
        if arch.qk_norm:
            for p in "qk":
                state[hf + f"self_attn.{p}_norm.weight"] = \
                    _require(shards[stage][0], meg + f"self_attention.{p}_layernorm.weight").clone()
    return state
