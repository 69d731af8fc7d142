"""The native engine's weights: one flat buffer (the "arena") holding every tensor of the model.

`weight_arena_layout` places each HF-named tensor in the arena so that the tensors the model fuses
(q/k/v projections; gate/up projections) are adjacent, and `LlamaWeights` exposes the arena as
per-layer views (fused `qkv` and `gate_up` included), copies weight updates into it in place and, on
CPU, optionally keeps copies of the matrices packed for the GEMM kernels (`PackedMatrix`) for the
forward of model.py.
"""
from __future__ import annotations

import difflib
import math
from typing import Iterable

import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.kernels.cpu_decode import PANEL_MAX_ROWS, CpuDecodeKernels
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import hf_layer_norm_names, mla_tensor_shapes
from megatron_rl.rollout.native.moe import arena_blocks, layer_views, unknown_name_hint
from megatron_rl.weight_sync.delta import WeightDelta
from megatron_rl.weight_sync.reshard import Bucket, BucketEntry, BucketLayout


class PackedMatrix:
    """One weight matrix [out, in] in the layout of the CPU GEMM kernel that is fastest for it (measured
    with `bench rollout` on 2-core AVX-512/AMX machines), built once per weight update instead of inside
    every call. `packed(x, bias)` == F.linear(x, weight, bias) up to float rounding.

    - fp32 with the fused CPU kernels (`kernels`) built for 512-bit vectors: their panels (kernels/cpu_decode.c
      `mrl_linear_panels_f32`, which overlaps the weight stream with the arithmetic) for steps of up to
      `PANEL_MAX_ROWS` rows, F.linear for longer ones (prompt chunks). One copy of the weight.
    - fp32 with MKL otherwise: MKL's packed GEMM, whose packing fixes the row count, serves the steps of
      `rows` / 2 < n <= `rows` rows (zero-padded to `rows`); other steps (a batch's long tail, prefill) take
      x @ W on an [in, out] copy, up to 2x faster than F.linear on [out, in] at a few rows, or F.linear where
      `transposed_copy` is False (the lm_head: a vocabulary-sized copy costs more memory than it saves).
    - bf16 (or fp32 without MKL): oneDNN's blocked layout, chosen for `rows`-row steps and valid for any
      row count. bf16 gains most: an unpacked bf16 F.linear re-lays out the weight on every call."""

    def __init__(self, weight: torch.Tensor, rows: int, transposed_copy: bool = True,
                 kernels: CpuDecodeKernels | None = None):
        self.weight, self.rows = weight, rows
        self.shape = weight.shape
        self.mkl = self.transposed = self.onednn = self.panels = None
        self.kernels = kernels
        if weight.dtype == torch.float32 and kernels is not None and kernels.fp32_gemm_panels:
            self.panels = kernels.pack_panels(weight.contiguous())
        elif weight.dtype == torch.float32 and torch.backends.mkl.is_available():
            self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self.transposed = weight.t().contiguous() if transposed_copy else None
        else:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        if self.panels is not None:
            if n <= PANEL_MAX_ROWS:
                return self.kernels.linear_panels(x.contiguous(), self.panels, self.shape[0], bias)
            return F.linear(x, self.weight, bias)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        if self.rows // 2 < n <= self.rows:
            pad = self.rows - n
            out = torch.ops.mkl._mkl_linear(F.pad(x, (0, 0, 0, pad)) if pad else x, self.mkl, self.weight, bias,
                                            self.rows)
            return out[:n] if pad else out
        if self.transposed is None:
            return F.linear(x, self.weight, bias)
        return torch.mm(x, self.transposed) if bias is None else torch.addmm(bias, x, self.transposed)


class _Layer:
    __slots__ = ("qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "sinks", "gate_up", "down", "ln1", "ln2",
                 "post_attn_norm", "post_mlp_norm", "moe", "mla")

    def matrices(self) -> tuple[torch.Tensor, ...]:
        """The layer's dense GEMM weights in forward order (qkv, o, then gate_up, down unless MoE)."""
        return (self.qkv, self.o) + ((self.gate_up, self.down) if self.moe is None else ())


def weight_arena_layout(arch: ModelArch, dtype: torch.dtype) -> BucketLayout:
    """Where every HF-named tensor lives in the engine's flat weight buffer (its "arena").

    Matrices keep HF's [out, in] orientation, and the tensors the engine fuses are adjacent in HF's
    row order (q_proj, k_proj, v_proj; gate_proj, up_proj), so the fused `qkv` and `gate_up` matrices
    are plain views of the arena, and every HF-named tensor is one contiguous region of it. q/k/v biases
    (Qwen2) are adjacent too (one fused `qkv_bias` vector); per-head q/k RMSNorm weights (Qwen3) get a
    block of their own. A weight producer (a trainer rank, another process through shared memory) can
    therefore write HF tensors straight into the buffer the engine computes from: no per-update copy or
    transpose in the engine.
    """
    h = arch.hidden_size
    align = max(1, 256 // torch.empty((), dtype=dtype).element_size())
    entries: list[BucketEntry] = []
    numel = 0

    def block(*tensors: tuple[str, tuple[int, ...]]) -> None:
        nonlocal numel
        numel = -(-numel // align) * align  # each block starts aligned; a block's tensors stay adjacent
        for name, shape in tensors:
            entries.append(BucketEntry(name, numel, shape))
            numel += math.prod(shape)

    block(("model.embed_tokens.weight", (arch.vocab_size, h)))
    if not arch.tie_word_embeddings:
        block(("lm_head.weight", (arch.vocab_size, h)))
    block(("model.norm.weight", (h,)))
    q, kv, f = arch.q_size, arch.kv_size, arch.ffn_hidden_size
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        if arch.is_mla:  # multi-latent attention: each tensor a block of its own (model.py reads them apart)
            for name, shape in mla_tensor_shapes(arch).items():
                block((p + name, shape))
        else:
            block((p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                  (p + "self_attn.v_proj.weight", (kv, h)))
        if arch.attention_bias:
            block((p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                  (p + "self_attn.v_proj.bias", (kv,)))
        if arch.qk_norm:
            block((p + "self_attn.q_norm.weight", (arch.head_dim,)), (p + "self_attn.k_norm.weight", (arch.head_dim,)))
        if not arch.is_mla:
            block((p + "self_attn.o_proj.weight", (h, q)))
        if arch.attention_output_bias:
            block((p + "self_attn.o_proj.bias", (h,)))
        if arch.attention_sinks:
            block((p + "self_attn.sinks", (arch.num_attention_heads,)))
        if arch.layer_is_moe(i):  # router, experts' gate/up, experts' down (rollout/native/moe.py)
            for tensors in arena_blocks(arch, i):
                block(*tensors)
        else:
            block((p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)))
            block((p + "mlp.down_proj.weight", (h, f)))
        block(*((p + name, (h,)) for name in hf_layer_norm_names(arch)))
    return BucketLayout(dtype, numel, tuple(entries))


class LlamaWeights:
    """The engine's weights: views into one flat arena laid out by `weight_arena_layout` (allocated
    here, or a buffer the caller owns, e.g. shared memory a trainer writes into). `load` copies
    HF-named tensors in place; an engine switches to a whole new arena by building a new LlamaWeights."""

    def __init__(self, arch: ModelArch, device: torch.device, dtype: torch.dtype,
                 arena: torch.Tensor | None = None):
        self.arch = arch
        self.layout = weight_arena_layout(arch, dtype)
        if arena is None:
            arena = torch.empty(self.layout.numel, device=device, dtype=dtype)
        elif arena.dtype != dtype or arena.numel() != self.layout.numel or arena.dim() != 1:
            raise ValueError(f"weight arena must be a flat {dtype} tensor of {self.layout.numel} elements, "
                             f"got {arena.dtype} {tuple(arena.shape)}")
        self.arena = arena
        self._targets = t = Bucket(self.layout, arena).unpack()
        if arch.tie_word_embeddings:
            t["lm_head.weight"] = t["model.embed_tokens.weight"]  # checkpoints may carry the tied copy
        offsets = {e.name: e.offset for e in self.layout.entries}

        def fused(first: str, rows: int) -> torch.Tensor:
            """rows of consecutive tensors starting at `first` (adjacent in the arena) as one matrix."""
            start, cols = offsets[first], t[first].shape[1]
            return arena[start:start + rows * cols].view(rows, cols)

        q, kv, f = arch.q_size, arch.kv_size, arch.ffn_hidden_size
        self.embed = t["model.embed_tokens.weight"]
        self.lm_head = self.embed if arch.tie_word_embeddings else t["lm_head.weight"]
        self.norm = t["model.norm.weight"]
        self.layers: list[_Layer] = []
        self._covers: dict[str, tuple[str, ...]] = {}  # fused alias -> the arena names it fills
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.mla = {n.removeprefix("self_attn."): t[p + n] for n in mla_tensor_shapes(arch)} \
                if arch.is_mla else None
            layer.qkv = None if arch.is_mla else fused(p + "self_attn.q_proj.weight", q + 2 * kv)  # [q + 2kv, h]
            layer.qkv_bias = layer.q_norm = layer.k_norm = None
            if arch.attention_bias:
                start = offsets[p + "self_attn.q_proj.bias"]
                layer.qkv_bias = arena[start:start + q + 2 * kv]              # [q + 2kv]
            if arch.qk_norm:
                layer.q_norm, layer.k_norm = t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"]
            layer.o = t[p + "self_attn.o_proj.weight"]                      # [h, q]
            layer.o_bias = t[p + "self_attn.o_proj.bias"] if arch.attention_output_bias else None
            layer.sinks = t[p + "self_attn.sinks"] if arch.attention_sinks else None  # [heads]
            if arch.layer_is_moe(i):
                layer.gate_up = layer.down = None
                layer.moe, aliases, covers = layer_views(arch, i, arena, offsets)
                t.update(aliases)  # transformers 5's fused in-memory names: the same memory
                self._covers.update(covers)
            else:
                layer.moe = None
                layer.gate_up = fused(p + "mlp.gate_proj.weight", 2 * f)     # [2f, h]
                layer.down = t[p + "mlp.down_proj.weight"]                  # [h, f]
            # attention input, MLP input (and a sandwich model's attention and MLP output) norms
            norms = [t[p + name] for name in hf_layer_norm_names(arch)] + [None, None]
            layer.ln1, layer.ln2, layer.post_attn_norm, layer.post_mlp_norm = norms[:4]
            self.layers.append(layer)
        self._layer_of = {name: int(name.split(".")[2]) if name.startswith("model.layers.") else -1
                          for name in self._targets}
        self.packed: list[tuple[PackedMatrix, ...] | None] | None = None
        self.packed_lm_head: PackedMatrix | None = None
        self.pack_rows = 0
        self.pack_kernels: CpuDecodeKernels | None = None
        self._pending_pack: set[int] = set()

    def enable_packing(self, rows: int, *, kernels: CpuDecodeKernels | None = None, lazily: bool = False) -> bool:
        """Keep a `PackedMatrix` of every weight matrix for steps of about `rows` rows (CPU, fp32 or bf16),
        in the fused CPU kernels' layout where `kernels` are given (fp32). False where unsupported. `lazily`:
        pack nothing now; `pack_pending` packs a few layers at a time (unpacked ones compute with F.linear
        meanwhile), so adopting new weights does not wait for the repack."""
        if self.embed.device.type != "cpu" or self.embed.dtype not in (torch.float32, torch.bfloat16) \
                or self.arch.is_mla:  # (multi-latent attention's matrices are not packed yet)
            return False
        try:
            PackedMatrix(torch.zeros(8, 8, dtype=self.embed.dtype), rows, kernels=kernels)(
                torch.zeros(rows, 8, dtype=self.embed.dtype))
        except (AttributeError, RuntimeError):  # a torch build without MKL or oneDNN (or its bf16 GEMMs)
            return False
        self.pack_rows, self.pack_kernels = rows, kernels
        self.packed = [None] * len(self.layers)  # type: ignore[list-item]
        self.packed_lm_head = None
        self._pending_pack = set(range(-1, len(self.layers)))
        if not lazily:
            self.pack_pending()
        return True

    @property
    def packing_pending(self) -> bool:
        return bool(self.pack_rows and self._pending_pack)

    def pack_pending(self, limit: int | None = None) -> bool:
        """Pack up to `limit` (default: all) of the layers still waiting; True if any are left."""
        if self.pack_rows:
            todo = sorted(self._pending_pack)[:limit]
            self._pending_pack.difference_update(todo)
            self.repack(set(todo))
        return bool(self._pending_pack)

    def repack(self, layers: set[int]) -> None:
        if not self.pack_rows:
            return
        for i in sorted(layers):
            if i < 0:
                self.packed_lm_head = PackedMatrix(self.lm_head, self.pack_rows, transposed_copy=False,
                                                   kernels=self.pack_kernels)
            else:
                self.packed[i] = tuple(PackedMatrix(m, self.pack_rows, kernels=self.pack_kernels)
                                       for m in self.layers[i].matrices())

    def required_names(self) -> set[str]:
        return {e.name for e in self.layout.entries}

    def check(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("rotary_emb.inv_freq"):
            return None  # some checkpoints carry RoPE buffers; we compute them
        target = self._targets.get(name)
        if target is None:
            raise ConfigError(f"update_weights: unknown tensor name {name!r}{self._unknown_hint(name)}", field=name)
        if not isinstance(tensor, (torch.Tensor, WeightDelta)):
            raise ConfigError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor", field=name)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected "
                              f"{tuple(target.shape)} for this model config (family {self.arch.family})", field=name)
        if not tensor.dtype.is_floating_point:
            raise ConfigError(f"update_weights: {name!r} has dtype {tensor.dtype}, expected a float tensor", field=name)
        return target

    def _unknown_hint(self, name: str) -> str:
        """Why a tensor has no place here: a config flag that would give it one, or a close name."""
        a = self.arch
        if name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")) \
                and not a.attention_bias:
            return f" (a q/k/v bias, but the model config (family {a.family}) has attention_bias=False)"
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) and not a.qk_norm:
            return f" (a q/k norm, but the model config (family {a.family}) has qk_norm=False)"
        if name.endswith(".bias"):
            return f" (the model config (family {a.family}) has no bias for this layer)"
        moe_hint = unknown_name_hint(a, name)
        if moe_hint is not None:
            return moe_hint
        close = difflib.get_close_matches(name, list(self._targets), n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    @torch.inference_mode()
    def load(self, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
        seen = set()
        dirty: set[int] = set()
        try:
            for name, tensor in named:
                target = self.check(name, tensor)
                if target is None:
                    continue
                if isinstance(tensor, WeightDelta):
                    tensor.apply_to(target)
                else:
                    target.copy_(tensor)
                seen.update(self._covers.get(name, (name,)))
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    dirty.add(-1)
                elif self._layer_of[name] >= 0 and target.dim() == 2:  # packed copies exist of matrices only
                    dirty.add(self._layer_of[name])
        finally:
            self.repack(dirty)
        if strict:
            missing = sorted(self.required_names() - seen)
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise ConfigError(f"weights are missing {', '.join(missing[:3])}{more} (model config: family "
                                  f"{self.arch.family}, attention_bias={self.arch.attention_bias}, "
                                  f"qk_norm={self.arch.qk_norm})")
        return len(seen)
