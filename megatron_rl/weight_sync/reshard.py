"""Megatron TP/PP shards -> HF-named tensors sharded the way the rollout engine (SGLang / vLLM) loads them.

A `ReshardPlan` is built once from a `MegatronLayout` (trainer: TP x PP, fused QKV per query group,
fc1 = cat(gate_r, up_r), vocab padded for TP; see `models/megatron_layout.py`) and an
`EngineLayout` (engine TP degree). For every engine rank it lists, per destination tensor, which
Megatron shard (pp_rank, tp_rank, name) feeds it and the rectangular segments to copy. Executing the
plan is pure data movement (bit-exact): a torch reference (`Tensor.copy_` per segment) and a Triton
strided-copy kernel (`triton_reshard.py`, one launch per (source, destination) pair).

Engine sharding (vLLM/SGLang `QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`,
`VocabParallelEmbedding`), engine TP degree E, engine rank e:
- q_proj: rows of query heads [e * heads/E, (e + 1) * heads/E).
- k_proj / v_proj: rows of kv heads [e * kv/E, (e + 1) * kv/E) when E <= kv; when E > kv each kv head is
  replicated on E/kv consecutive ranks (rank e holds kv head e // (E/kv)).
- gate_proj / up_proj: rows [e * F/E, (e + 1) * F/E); o_proj / down_proj: the same ranges of columns.
- embed_tokens / lm_head: the vocabulary padded to a multiple of `vocab_divisible_by` (64 in vLLM/SGLang)
  is split in E equal row ranges; rank e gets the real rows of its range, [e * per, min((e + 1) * per, V)),
  and its loader zero-fills the padding rows (the shard of the last ranks may be short or empty).
- q_proj / k_proj / v_proj biases (Qwen2; Megatron's fused `linear_qkv.bias`): split like their rows.
- norms, Qwen3's per-head q_norm / k_norm (Megatron `q_layernorm` / `k_layernorm`) included: replicated.
- MoE (Mixtral, Qwen3-MoE): the router is replicated; every engine rank holds every expert (SGLang's fused
  MoE without expert parallelism), rows [e * I/E, (e + 1) * I/E) of its gate/up and those columns of its
  down. On the Megatron side an expert-parallel run's shards of a stage are indexed
  `MegatronLayout.shard_index(tp_rank, ep_rank)` (the "tp_rank" of a source key is that index); dense
  tensors are read from EP rank 0, each expert from the EP rank that holds it, so a trainer rank with
  ep_rank > 0 feeds only expert copies (`copies_from(pp, layout.shard_index(tp, ep))`).

Buckets: `plan_buckets` / `allocate_buckets` / `pack_tensors` / `Bucket.unpack` pack many tensors into
flat per-dtype buffers of bounded bytes (offsets aligned) and give them back as views (no copies);
`reshard_to_buckets` writes the resharded tensors straight into bucket views.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.families import (
    get_family,
    hf_expert_bias_names,
    hf_expert_names,
    hf_router_bias_name,
    hf_router_logit_bias_name,
    hf_router_name,
    hf_shared_expert_names,
)
from megatron_rl.models.megatron_layout import MegatronLayout, mla_megatron_rows, mla_tensor_shapes, mla_tensors

SourceKey = tuple[int, int]  # (pp_rank, tp_rank)


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How the rollout engine shards the HF tensors over its tensor-parallel ranks."""

    arch: ModelArch
    tp: int = 1
    vocab_divisible_by: int = 64

    def __post_init__(self) -> None:
        a, tp = self.arch, self.tp
        if tp < 1:
            raise ConfigError(f"engine tensor_parallel must be >= 1, got {tp}")
        if a.num_attention_heads % tp:
            raise ConfigError(f"engine tensor_parallel={tp} does not divide num_attention_heads={a.num_attention_heads}")
        if (a.num_query_groups % tp) if tp <= a.num_query_groups else (tp % a.num_query_groups):
            raise ConfigError(f"engine tensor_parallel={tp} and num_query_groups={a.num_query_groups}: one must "
                              "divide the other")
        if a.is_mla and tp > 1:
            raise ConfigError(f"engine tensor_parallel={tp}: multi-latent attention models are resharded for one-rank "
                              "engines (the native engine; SGLang loads them from HF checkpoints)")
        if a.is_moe and a.moe_ffn_hidden_size % tp:
            raise ConfigError(f"engine tensor_parallel={tp} does not divide moe_ffn_hidden_size={a.moe_ffn_hidden_size}")
        if a.has_dense_mlp and a.ffn_hidden_size % tp:
            raise ConfigError(f"engine tensor_parallel={tp} does not divide ffn_hidden_size={a.ffn_hidden_size}")
        if a.shared_expert_ffn_hidden_size % tp:
            raise ConfigError(f"engine tensor_parallel={tp} does not divide shared_expert_ffn_hidden_size="
                              f"{a.shared_expert_ffn_hidden_size}")

    @property
    def vocab_per_rank(self) -> int:
        padded = -(-self.arch.vocab_size // self.vocab_divisible_by) * self.vocab_divisible_by
        return -(-padded // self.tp)

    def vocab_rows(self, rank: int) -> tuple[int, int]:
        per, v = self.vocab_per_rank, self.arch.vocab_size
        return min(rank * per, v), min((rank + 1) * per, v)

    def kv_heads(self, rank: int) -> tuple[int, int]:
        kv = self.arch.num_query_groups
        if self.tp <= kv:
            per = kv // self.tp
            return rank * per, (rank + 1) * per
        head = rank // (self.tp // kv)
        return head, head + 1


@dataclasses.dataclass
class TensorCopy:
    """Copy rectangular segments of one Megatron shard tensor into one engine tensor."""

    src: tuple[int, int, str]
    """(pp_rank, tp_rank, Megatron parameter name)."""
    dst: str
    """HF parameter name on the engine rank."""
    segments: list[tuple[int, int, int, int, int, int]]
    """(src_row, src_col, dst_row, dst_col, n_rows, n_cols) on the tensors viewed as 2-D ([rows, -1])."""
    _table: dict = dataclasses.field(default_factory=dict, repr=False)

    def table(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._table:
            self._table[key] = torch.tensor(self.segments, dtype=torch.int64, device=device).reshape(-1, 6)
        return self._table[key]


@dataclasses.dataclass
class ReshardPlan:
    megatron: MegatronLayout
    engine: EngineLayout
    shapes: list[dict[str, tuple[int, ...]]]
    """Per engine rank: HF name -> shard shape."""
    copies: list[list[TensorCopy]]
    """Per engine rank: the copies that fill its tensors."""

    def sources(self, engine_rank: int) -> list[SourceKey]:
        """The Megatron (pp_rank, tp_rank) shards an engine rank reads."""
        return sorted({c.src[:2] for c in self.copies[engine_rank]})

    def copies_from(self, pp_rank: int, tp_rank: int) -> dict[int, list[TensorCopy]]:
        """Per engine rank, the copies that read Megatron shard (pp_rank, tp_rank) (for a sender)."""
        out: dict[int, list[TensorCopy]] = {}
        for e, copies in enumerate(self.copies):
            mine = [c for c in copies if c.src[:2] == (pp_rank, tp_rank)]
            if mine:
                out[e] = mine
        return out


# ------------------------------------------------------------------------------------------------ plan
def _runs(dst_index: torch.Tensor, src_rank: torch.Tensor, src_local: torch.Tensor):
    """Split a destination range into maximal runs with one source rank and consecutive source indices.

    dst_index[i] is the i-th destination position (consecutive), src_* where it comes from.
    Yields (src_rank, src_start, dst_start, length)."""
    n = dst_index.numel()
    if n == 0:
        return []
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (src_rank[1:] != src_rank[:-1]) | (src_local[1:] != src_local[:-1] + 1)
    starts = brk.nonzero().squeeze(1).tolist() + [n]
    return [(int(src_rank[s]), int(src_local[s]), int(dst_index[s]), e - s) for s, e in zip(starts[:-1], starts[1:])]


class _PlanBuilder:
    def __init__(self, megatron: MegatronLayout, engine: EngineLayout):
        if megatron.arch != engine.arch:
            raise ConfigError("Megatron and engine layouts describe different models")
        self.m, self.e, self.a = megatron, engine, megatron.arch
        self.shapes = [dict() for _ in range(engine.tp)]
        self.copies = [list() for _ in range(engine.tp)]

    def add(self, rank, hf_name, shape, axis, global_lo, global_hi, pp, meg_name, mapping, other_extent):
        """Engine tensor `hf_name` on `rank` holds global indices [lo, hi) along `axis` of the HF tensor;
        `mapping(global_idx) -> (megatron tp rank, local index)` says where each lives in the shards."""
        self.shapes[rank][hf_name] = shape
        idx = torch.arange(global_lo, global_hi, dtype=torch.int64)
        src_rank, src_local = mapping(idx)
        by_src: dict[int, list] = {}
        for r, s0, d, n in _runs(idx - global_lo, src_rank, src_local):
            seg = (s0, 0, d, 0, n, other_extent) if axis == 0 else (0, s0, 0, d, other_extent, n)
            by_src.setdefault(r, []).append(seg)
        for r, segs in sorted(by_src.items()):
            self.copies[rank].append(TensorCopy((pp, r, meg_name), hf_name, segs))

    def build(self) -> ReshardPlan:
        a, m, e = self.a, self.m, self.e
        tpm, hd, h = m.tp, a.head_dim, a.hidden_size
        groups, hpg, f = a.num_query_groups, a.num_attention_heads // a.num_query_groups, a.ffn_hidden_size
        gpr = groups // tpm  # query groups per Megatron rank
        rows_per_group = (hpg + 2) * hd

        def fused(offset_in_group, per_group):
            def mapping(i):
                g, j = i // per_group, i % per_group
                row = g * rows_per_group + offset_in_group + j
                return g // gpr, row - (g // gpr) * gpr * rows_per_group
            return mapping

        q_map, k_map, v_map = fused(0, hpg * hd), fused(hpg * hd, hd), fused((hpg + 1) * hd, hd)
        fm = f // tpm
        gate_map = lambda i: (i // fm, i % fm)  # noqa: E731
        up_map = lambda i: (i // fm, fm + i % fm)  # noqa: E731
        proj_map = proj_map_f(a.q_size // tpm)
        vm = m.padded_vocab_size // tpm
        vocab_map = lambda i: (i // vm, i % vm)  # noqa: E731
        qe, fe = a.q_size // e.tp, f // e.tp
        for r in range(e.tp):
            lo, hi = e.vocab_rows(r)
            self.add(r, "model.embed_tokens.weight", (hi - lo, h), 0, lo, hi, 0,
                     "embedding.word_embeddings.weight", vocab_map, h)
            if not a.tie_word_embeddings:
                self.add(r, "lm_head.weight", (hi - lo, h), 0, lo, hi, m.pp - 1, "output_layer.weight", vocab_map, h)
            # replicated tensors come from the Megatron rank aligned with this engine rank (one it reads anyway)
            aligned = (r * tpm) // e.tp
            replicated = lambda i, src=aligned: (torch.full_like(i, src), i)  # noqa: E731
            self.add(r, "model.norm.weight", (h,), 0, 0, h, m.pp - 1, "decoder.final_layernorm.weight", replicated, 1)
            k0, k1 = e.kv_heads(r)
            for layer in range(a.num_layers):
                pp, local = m.stage_of(layer)
                hf, meg = f"model.layers.{layer}.", f"decoder.layers.{local}."
                if a.is_mla:
                    self._add_mla(r, hf, meg, pp, replicated)
                else:
                    self._add_attention(r, hf, meg, pp, replicated, (q_map, k_map, v_map, proj_map), (qe, k0, k1))
                if a.layer_is_moe(layer):
                    self._add_experts(r, layer, pp, meg, replicated)
                else:
                    fc1 = meg + "mlp.linear_fc1.weight"
                    self.add(r, hf + "mlp.gate_proj.weight", (fe, h), 0, r * fe, (r + 1) * fe, pp, fc1, gate_map, h)
                    self.add(r, hf + "mlp.up_proj.weight", (fe, h), 0, r * fe, (r + 1) * fe, pp, fc1, up_map, h)
                    self.add(r, hf + "mlp.down_proj.weight", (h, fe), 1, r * fe, (r + 1) * fe, pp,
                             meg + "mlp.linear_fc2.weight", proj_map_f(fm), h)
                for hf_norm, meg_norm in m.layer_norms(layer):
                    self.add(r, hf + hf_norm, (h,), 0, 0, h, pp, meg + meg_norm, replicated, 1)
        return ReshardPlan(m, e, self.shapes, self.copies)

    def _add_attention(self, r: int, hf: str, meg: str, pp: int, replicated, maps, rows) -> None:
        """One layer's grouped-query attention for engine rank r: q/k/v rows from the fused linear_qkv (and its
        bias), q/k norms replicated, o_proj's columns."""
        a, h, hd = self.a, self.a.hidden_size, self.a.head_dim
        q_map, k_map, v_map, proj_map = maps
        qe, k0, k1 = rows
        qkv = meg + "self_attention.linear_qkv.weight"
        self.add(r, hf + "self_attn.q_proj.weight", (qe, h), 0, r * qe, (r + 1) * qe, pp, qkv, q_map, h)
        for name, mp in (("k_proj", k_map), ("v_proj", v_map)):
            self.add(r, hf + f"self_attn.{name}.weight", ((k1 - k0) * hd, h), 0, k0 * hd, k1 * hd, pp, qkv, mp, h)
        if a.attention_bias:  # fused like the weight's rows: the same row maps, one column
            bias = meg + "self_attention.linear_qkv.bias"
            self.add(r, hf + "self_attn.q_proj.bias", (qe,), 0, r * qe, (r + 1) * qe, pp, bias, q_map, 1)
            for name, mp in (("k_proj", k_map), ("v_proj", v_map)):
                self.add(r, hf + f"self_attn.{name}.bias", ((k1 - k0) * hd,), 0, k0 * hd, k1 * hd, pp, bias, mp, 1)
        if a.qk_norm:
            for p in "qk":
                self.add(r, hf + f"self_attn.{p}_norm.weight", (hd,), 0, 0, hd, pp,
                         meg + f"self_attention.{p}_layernorm.weight", replicated, 1)
        self.add(r, hf + "self_attn.o_proj.weight", (h, qe), 1, r * qe, (r + 1) * qe, pp,
                 meg + "self_attention.linear_proj.weight", proj_map, h)
        if a.attention_output_bias:
            self.add(r, hf + "self_attn.o_proj.bias", (h,), 0, 0, h, pp, meg + "self_attention.linear_proj.bias",
                     replicated, 1)
        if a.attention_sinks:  # one per query head, split by heads on both sides
            he = a.num_attention_heads // self.e.tp
            self.add(r, hf + "self_attn.sinks", (he,), 0, r * he, (r + 1) * he, pp,
                     meg + "self_attention.core_attention.softmax_offset",
                     proj_map_f(a.num_attention_heads // self.m.tp), 1)

    def _add_mla(self, r: int, hf: str, meg: str, pp: int, replicated) -> None:
        """One layer's multi-latent attention, whole on the (single) engine rank: each tensor's rows or columns
        from the Megatron TP ranks that hold them (`megatron_layout.mla_tensors`), rotary rows in HF's order."""
        m, shapes = self.m, mla_tensor_shapes(self.a)
        for hf_name, meg_name, split in mla_tensors(self.a):
            shape = shapes[hf_name]
            if split == "cols":
                self.add(r, hf + hf_name, shape, 1, 0, shape[1], pp, meg + meg_name, proj_map_f(shape[1] // m.tp),
                         shape[0])
                continue
            position = mla_megatron_rows(self.a, hf_name)  # HF row -> its row in Megatron's (whole) layout
            if split == "rows":
                per = shape[0] // m.tp
                mapping = lambda i, pos=position, per=per: (pos[i] // per, pos[i] % per)  # noqa: E731
            else:  # replicated: the latent down projections and norms
                mapping = lambda i, pos=position: replicated(pos[i])  # noqa: E731
            self.add(r, hf + hf_name, shape, 0, 0, shape[0], pp, meg + meg_name, mapping,
                     shape[1] if len(shape) > 1 else 1)

    def _add_experts(self, r: int, layer: int, pp: int, meg: str, replicated) -> None:
        """Router (replicated) and experts of one layer for engine rank r. Megatron: expert x lives on EP rank
        x // (E / EP) as local expert x % (E / EP), in the stage's shard `m.shard_index(tp, ep)`, its fc1 =
        cat(gate rows, up rows) and fc2 split over TP like the dense MLP. Engine (SGLang's fused MoE without
        EP): every rank holds every expert, rows [r * I/T, (r + 1) * I/T) of gate/up, those columns of down."""
        a, m, e = self.a, self.m, self.e
        h, experts, family = a.hidden_size, a.num_experts, get_family(a.family)
        im, ie = a.moe_ffn_hidden_size // m.tp, a.moe_ffn_hidden_size // e.tp
        self.add(r, hf_router_name(family, layer), (experts, h), 0, 0, experts, pp, meg + "mlp.router.weight",
                 replicated, h)
        if a.moe_router_bias:
            self.add(r, hf_router_logit_bias_name(family, layer), (experts,), 0, 0, experts, pp,
                     meg + "mlp.router.bias", replicated, 1)
        if a.moe_router_expert_bias:  # training moves it (aux-loss-free balancing): synced like a weight
            self.add(r, hf_router_bias_name(family, layer), (experts,), 0, 0, experts, pp,
                     meg + "mlp.router.expert_bias", replicated, 1)
        for x in range(experts):
            ep_rank, j = divmod(x, m.local_experts)
            base = m.shard_index(0, ep_rank)  # the shard of (tp 0, this ep rank); its tp ranks follow it
            gate, up, down = hf_expert_names(family, layer, x)
            expert = f"{meg}mlp.experts.local_experts.{j}."
            rows = lambda i, b=base: (b + i // im, i % im)  # noqa: E731
            up_rows = lambda i, b=base: (b + i // im, im + i % im)  # noqa: E731
            lo, hi = r * ie, (r + 1) * ie
            self.add(r, gate, (ie, h), 0, lo, hi, pp, expert + "linear_fc1.weight", rows, h)
            self.add(r, up, (ie, h), 0, lo, hi, pp, expert + "linear_fc1.weight", up_rows, h)
            self.add(r, down, (h, ie), 1, lo, hi, pp, expert + "linear_fc2.weight", rows, h)
            if a.expert_biases:  # fc1's like its rows; fc2's whole on every TP rank (read from TP rank 0's)
                gate_bias, up_bias, down_bias = hf_expert_bias_names(family, layer, x)
                self.add(r, gate_bias, (ie,), 0, lo, hi, pp, expert + "linear_fc1.bias", rows, 1)
                self.add(r, up_bias, (ie,), 0, lo, hi, pp, expert + "linear_fc1.bias", up_rows, 1)
                self.add(r, down_bias, (h,), 0, 0, h, pp, expert + "linear_fc2.bias",
                         lambda i, b=base: (torch.full_like(i, b), i), 1)
        if a.shared_expert_ffn_hidden_size:  # a dense SwiGLU MLP read from EP rank 0's shards; its gate replicated
            gate, up, down, shared_gate = hf_shared_expert_names(family, layer)
            sm, se = a.shared_expert_ffn_hidden_size // m.tp, a.shared_expert_ffn_hidden_size // e.tp
            fc1 = meg + "mlp.shared_experts.linear_fc1.weight"
            lo, hi = r * se, (r + 1) * se
            self.add(r, gate, (se, h), 0, lo, hi, pp, fc1, lambda i: (i // sm, i % sm), h)
            self.add(r, up, (se, h), 0, lo, hi, pp, fc1, lambda i: (i // sm, sm + i % sm), h)
            self.add(r, down, (h, se), 1, lo, hi, pp, meg + "mlp.shared_experts.linear_fc2.weight", proj_map_f(sm), h)
            if a.shared_expert_gate:
                self.add(r, shared_gate, (1, h), 0, 0, 1, pp, meg + "mlp.shared_experts.gate_weight", replicated, h)


def proj_map_f(per_rank: int):
    return lambda i: (i // per_rank, i % per_rank)


def build_reshard_plan(megatron: MegatronLayout, engine: EngineLayout) -> ReshardPlan:
    """The copies that turn Megatron shards [pp][tp] into every engine rank's HF-named shards."""
    return _PlanBuilder(megatron, engine).build()


# ------------------------------------------------------------------------------------------------ execute
def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1) if t.dim() != 1 else t.view(-1, 1)


def _resolve_backend(backend: str, device: torch.device) -> str:
    from megatron_rl.kernels import triton_reshard  # optional Triton: only when a backend is chosen

    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_reshard.AVAILABLE else "torch"
    if backend == "triton" and not triton_reshard.AVAILABLE:
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    return backend


def _lookup(sources, key: tuple[int, int, str]) -> torch.Tensor:
    pp, tp, name = key
    try:
        shard = sources[(pp, tp)] if isinstance(sources, Mapping) else sources[pp][tp]
    except (KeyError, IndexError):
        raise ConfigError(f"reshard needs Megatron shard pp={pp} tp={tp}, which was not given") from None
    if name not in shard:
        raise ConfigError(f"Megatron shard pp={pp} tp={tp} is missing tensor '{name}'")
    return shard[name]


def execute_plan(plan: ReshardPlan, engine_rank: int, sources, *, out: Mapping[str, torch.Tensor] | None = None,
                 backend: str = "auto") -> dict[str, torch.Tensor]:
    """Engine rank `engine_rank`'s HF-named shards from Megatron shards.

    sources: shards[pp_rank][tp_rank] (the converter's nested list) or {(pp_rank, tp_rank): state dict},
        holding at least `plan.sources(engine_rank)`.
    out: preallocated destinations (e.g. bucket views from `reshard_to_buckets`); allocated when None
        (dtype and device of the source tensor).
    """
    copies = plan.copies[engine_rank]
    result: dict[str, torch.Tensor] = dict(out) if out is not None else {}
    be = None
    for c in copies:
        src = _lookup(sources, c.src)
        if c.dst not in result:
            result[c.dst] = torch.empty(plan.shapes[engine_rank][c.dst], dtype=src.dtype, device=src.device)
        dst = result[c.dst]
        if tuple(dst.shape) != plan.shapes[engine_rank][c.dst]:
            raise ValueError(f"out['{c.dst}'] has shape {tuple(dst.shape)}, plan says {plan.shapes[engine_rank][c.dst]}")
        s2, d2 = _as_2d(src), _as_2d(dst)
        be = be or _resolve_backend(backend, dst.device)
        if be == "triton":
            from megatron_rl.kernels import triton_reshard  # optional Triton, on the GPU path only

            segs = c.segments
            triton_reshard.segment_copy(s2, d2, c.table(s2.device), max(s[4] for s in segs), max(s[5] for s in segs))
        else:
            for sr, sc, dr, dc, nr, nc in c.segments:
                d2[dr:dr + nr, dc:dc + nc].copy_(s2[sr:sr + nr, sc:sc + nc])
    if copies:  # tensors with nothing to copy (an empty vocabulary shard) still exist, empty
        like = _lookup(sources, copies[0].src)
        for name, shape in plan.shapes[engine_rank].items():
            if name not in result:
                result[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return result


# ------------------------------------------------------------------------------------------------ buckets
@dataclasses.dataclass(frozen=True)
class BucketEntry:
    name: str
    offset: int
    """Element offset in the bucket's flat buffer."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each tensor lives in one flat buffer (metadata only: what a receiver needs to unpack)."""

    dtype: torch.dtype
    numel: int
    entries: tuple[BucketEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass
class Bucket:
    layout: BucketLayout
    buffer: torch.Tensor
    """Flat [layout.numel] tensor of layout.dtype."""

    def unpack(self) -> dict[str, torch.Tensor]:
        """Name -> view into the buffer (no copy)."""
        return {e.name: self.buffer[e.offset:e.offset + e.numel].view(e.shape) for e in self.layout.entries}


def plan_buckets(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int,
                 *, align_bytes: int = 256) -> list[BucketLayout]:
    """Greedy per-dtype bucketing in the given order: a bucket closes before it would exceed bucket_bytes
    (a single larger tensor gets a bucket of its own); every offset is aligned to align_bytes."""
    if bucket_bytes <= 0 or align_bytes <= 0:
        raise ValueError("bucket_bytes and align_bytes must be positive")
    open_: dict[torch.dtype, list] = {}
    done: list[BucketLayout] = []

    def close(dtype):
        entries, numel = open_.pop(dtype)
        done.append(BucketLayout(dtype, numel, tuple(entries)))

    for name, shape, dtype in specs:
        item = torch.empty((), dtype=dtype).element_size()
        align = max(1, align_bytes // item)
        entry_numel = BucketEntry(name, 0, tuple(shape)).numel
        if dtype in open_:
            entries, numel = open_[dtype]
            offset = -(-numel // align) * align
            if (offset + entry_numel) * item > bucket_bytes:
                close(dtype)
        if dtype not in open_:
            open_[dtype] = ([], 0)
        entries, numel = open_[dtype]
        offset = -(-numel // align) * align
        entries.append(BucketEntry(name, offset, tuple(shape)))
        open_[dtype] = (entries, offset + entry_numel)
    for dtype in list(open_):
        close(dtype)
    return done


def allocate_buckets(layouts: Iterable[BucketLayout], device: torch.device | str = "cpu") -> list[Bucket]:
    return [Bucket(lay, torch.empty(lay.numel, dtype=lay.dtype, device=device)) for lay in layouts]


def pack_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 *, align_bytes: int = 256, device: torch.device | str | None = None) -> list[Bucket]:
    """Copy many tensors into flat per-dtype buckets of at most bucket_bytes (one copy per tensor)."""
    items = list(named.items() if isinstance(named, Mapping) else named)
    if not items:
        return []
    device = device if device is not None else items[0][1].device
    buckets = allocate_buckets(plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in items], bucket_bytes,
                                            align_bytes=align_bytes), device)
    by_name = dict(items)
    dsts, srcs = [], []
    for b in buckets:
        for name, view in b.unpack().items():
            dsts.append(view)
            srcs.append(by_name[name])
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)  # one multi-tensor launch per dtype/device group on CUDA
    else:  # pragma: no cover
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return buckets


def unpack_buckets(buckets: Iterable[Bucket]) -> dict[str, torch.Tensor]:
    """All tensors of all buckets as views (no copies)."""
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        out.update(b.unpack())
    return out


def reshard_to_buckets(plan: ReshardPlan, engine_rank: int, sources, bucket_bytes: int, *,
                       align_bytes: int = 256, backend: str = "auto") -> list[Bucket]:
    """Reshard for one engine rank, writing straight into bucket buffers (no intermediate tensors)."""
    dtypes: dict[str, torch.dtype] = {}
    device = None
    for c in plan.copies[engine_rank]:
        src = _lookup(sources, c.src)
        dtypes.setdefault(c.dst, src.dtype)
        device = device or src.device
    default = next(iter(dtypes.values()), torch.float32)
    specs = [(name, shape, dtypes.get(name, default)) for name, shape in plan.shapes[engine_rank].items()]
    buckets = allocate_buckets(plan_buckets(specs, bucket_bytes, align_bytes=align_bytes), device or "cpu")
    execute_plan(plan, engine_rank, sources, out=unpack_buckets(buckets), backend=backend)
    return buckets
