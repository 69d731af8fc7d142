"""The native rollout engine: a Llama-family decoder in plain PyTorch with a per-slot KV cache,
continuous batching, exact seeded sampling and in-place weight updates. Runs on CPU or one GPU.

Model. HF-layout weights (the names `checkpoints_tools.load_pretrained` returns) are copied at load /
update time into fused, transposed matrices: per layer `qkv` = [q | k | v] and `gate_up` = [gate | up]
columns, so a layer is four matmuls `x @ W`. The forward mirrors transformers' LlamaForCausalLM op for op (RMSNorm in the
activation dtype, rotate-half RoPE from the same fp32 tables, softmax scale 1/sqrt(head_dim), SiLU
MLP); grouped-query attention is computed per KV head on [q heads of the group] without repeating K/V.
Logits are computed only for the positions that sample a token, in fp32.

KV cache. Two tensors [layers, slots, kv_heads, max_seq_len, head_dim] (allocated on first use with
torch.empty: pages are committed only as sequences touch them). A running sequence owns one slot;
slots in use are kept dense at [0, n_running) by moving the last sequence into a freed slot, so the
decode rows' cache is a strided view, not a gather.

Scheduling (one step = one forward pass): every running sequence that has finished its prompt feeds
its last sampled token (decode), and sequences still in their prompt contribute the next chunk of it
(chunked prefill) up to `max_prefill_tokens` per step, all packed into one [N, hidden] batch. Waiting
requests take slots as soon as finished ones free them (continuous batching), so a caller that keeps
submitting keeps the batch full. A new request whose prompt shares a prefix with a running one
(n samples of a prompt, a common system prompt) copies that prefix's K/V instead of recomputing it.

Threads. One thread at a time runs steps (the "driver"). A blocking `generate()` drives in the
calling thread; `run_forever()` makes the calling thread the permanent driver (a dedicated engine
process); otherwise a background thread drives whatever `submit()` queued. Keeping the compute on the
thread that already uses torch matters on small CPUs: a second thread running torch ops creates a
second OpenMP pool, libgomp then throttles its spin-waits, and every parallel op pays a futex wake-up
(~25% slower decoding measured here). All public methods are thread-safe.

Sampling and log-probs: see `sample_tokens` and the module docstring of rollout/engine.py. Each sample
owns a torch.Generator seeded from its request's seed, drawing exactly `vocab_size` exponentials per
token, so its tokens do not depend on which other requests share its batch.

Weight updates happen between two steps under the model lock (`update_weights`), whether paused or
not; tokens sampled after an update carry the new version. Sequences in flight keep the KV entries
computed under the old weights (the usual partial-rollout semantics of asynchronous RL: their
`weight_versions` show the switch).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F

from megatron_rl.config import require
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.weight_sync.reshard import Bucket, BucketEntry, BucketLayout
from megatron_rl.models.arch import ModelArch
from megatron_rl.rollout.engine import (GenerateRequest, NamedTensors, RequestError, RequestLike, SamplingParams,
                                        as_request, iter_named_tensors, validate_request)
from megatron_rl.types import Completion

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------
class _Layer:
    __slots__ = ("qkv", "o", "gate_up", "down", "ln1", "ln2")


def weight_arena_layout(arch: ModelArch, dtype: torch.dtype) -> BucketLayout:
    """Where every HF-named tensor lives in the engine's flat weight buffer (its "arena").

    Matrices keep HF's [out, in] orientation, and the tensors the engine fuses are adjacent in HF's
    row order (q_proj, k_proj, v_proj; gate_proj, up_proj), so the fused `qkv` and `gate_up` matrices
    are plain views of the arena, and every HF-named tensor is one contiguous region of it. A weight
    producer (a trainer rank, another process through shared memory) can therefore write HF tensors
    straight into the buffer the engine computes from: no per-update copy or transpose in the engine.
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
        block((p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
              (p + "self_attn.v_proj.weight", (kv, h)))
        block((p + "self_attn.o_proj.weight", (h, q)))
        block((p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)))
        block((p + "mlp.down_proj.weight", (h, f)))
        block((p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)))
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
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.qkv = fused(p + "self_attn.q_proj.weight", q + 2 * kv)      # [q + 2kv, h]
            layer.o = t[p + "self_attn.o_proj.weight"]                      # [h, q]
            layer.gate_up = fused(p + "mlp.gate_proj.weight", 2 * f)         # [2f, h]
            layer.down = t[p + "mlp.down_proj.weight"]                      # [h, f]
            layer.ln1, layer.ln2 = t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"]
            self.layers.append(layer)
        self._layer_of = {name: int(name.split(".")[2]) if name.startswith("model.layers.") else -1
                          for name in self._targets}
        self.packed: list[tuple[torch.Tensor, ...] | None] | None = None
        self.transposed: list[tuple[torch.Tensor, ...] | None] | None = None
        self.packed_lm_head: torch.Tensor | None = None
        self.pack_rows = 0
        self._pending_pack: set[int] = set()

    def enable_packing(self, rows: int, *, lazily: bool = False) -> bool:
        """Keep MKL-packed copies for `rows`-row matmuls (CPU, fp32). False when unsupported. `lazily`:
        pack nothing now; `pack_pending` packs a few layers at a time (unpacked ones compute with the
        plain path meanwhile), so adopting new weights does not wait for the repack."""
        if self.embed.device.type != "cpu" or self.embed.dtype != torch.float32:
            return False
        try:
            probe = torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(8, 8), rows)
            torch.ops.mkl._mkl_linear(torch.zeros(rows, 8), probe, torch.zeros(8, 8), None, rows)
        except (AttributeError, RuntimeError):
            return False
        self.pack_rows = rows
        self.packed = [None] * len(self.layers)  # type: ignore[list-item]
        self.transposed = [None] * len(self.layers)
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
        pack = lambda w_out_in: torch.ops.mkl._mkl_reorder_linear_weight(w_out_in, self.pack_rows)  # noqa: E731
        for i in sorted(layers):
            if i < 0:
                self.packed_lm_head = pack(self.lm_head)
            else:
                layer = self.layers[i]
                matrices = (layer.qkv, layer.o, layer.gate_up, layer.down)
                self.packed[i] = tuple(pack(m) for m in matrices)
                # [in, out] copies for the steps that are not nearly full (a batch's long tail): x @ W
                # on them is up to 2x faster than F.linear on [out, in] at a few rows
                self.transposed[i] = tuple(m.t().contiguous() for m in matrices)

    def required_names(self) -> set[str]:
        return {e.name for e in self.layout.entries}

    def check(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("rotary_emb.inv_freq"):
            return None  # some checkpoints carry RoPE buffers; we compute them
        target = self._targets.get(name)
        if target is None:
            import difflib
            close = difflib.get_close_matches(name, list(self._targets), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"update_weights: unknown tensor name {name!r}{hint}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        if not (tensor.is_floating_point()):
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}, expected a float tensor")
        return target

    @torch.inference_mode()
    def load(self, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
        seen = set()
        dirty: set[int] = set()
        try:
            for name, tensor in named:
                target = self.check(name, tensor)
                if target is None:
                    continue
                target.copy_(tensor)
                seen.add(name)
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    dirty.add(-1)
                elif self._layer_of[name] >= 0 and not name.endswith("layernorm.weight"):
                    dirty.add(self._layer_of[name])
        finally:
            self.repack(dirty)
        if strict:
            missing = sorted(self.required_names() - seen)
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise ValueError(f"weights are missing {', '.join(missing[:3])}{more}")
        return len(seen)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, computed in fp32 and cast back (torch's fused kernel computes the
    # same expression in fp32: bit-identical results, one kernel)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]; cos/sin [N, 1, d]: x * cos + rotate_half(x) * sin, as transformers."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclasses.dataclass
class _Batch:
    """One packed forward pass: B decode rows first, then prefill chunks."""

    tokens: torch.Tensor            # [N] long
    positions: torch.Tensor         # [N] long
    dec_slots: torch.Tensor         # [B] long
    dec_lens: torch.Tensor          # [B] long: cache length after this step (position + 1)
    dec_first_slot: int             # first slot when dec_slots is a contiguous range, else -1
    chunks: list[tuple[int, int, int, int]]  # (offset in packed rows, slot, start position, length)
    logit_rows: torch.Tensor        # [R] rows of the packed batch whose next token is sampled


class LlamaModel:
    """Forward passes over a KV cache for `LlamaWeights`."""

    def __init__(self, weights: LlamaWeights, max_seq_len: int):
        self.w = weights
        a = weights.arch
        self.arch = a
        device = weights.embed.device
        # transformers' LlamaRotaryEmbedding (default rope): fp32 inv_freq times fp32 positions
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.int64)
                                          .to(device=device, dtype=torch.float) / a.head_dim))
        pos = torch.arange(max_seq_len, device=device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = weights.embed.dtype
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.scale = 1.0 / math.sqrt(a.head_dim)

    def forward(self, batch: _Batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Run one packed step, writing K/V of every input token into the cache. Returns fp32 logits
        [R, vocab] for `batch.logit_rows`."""
        a, w = self.arch, self.w
        n_heads, n_kv, d = a.num_attention_heads, a.num_query_groups, a.head_dim
        group = n_heads // n_kv
        q_size, kv_size, ffn = a.q_size, a.kv_size, a.ffn_hidden_size
        tokens = batch.tokens
        n = tokens.numel()
        n_dec = batch.dec_slots.numel()
        # MKL-packed weights serve steps of exactly pack_rows rows; pad steps that are nearly full
        pad = w.pack_rows - n if w.pack_rows and w.pack_rows // 2 < n <= w.pack_rows else -1
        mkl_linear = torch.ops.mkl._mkl_linear if pad >= 0 else None

        def matmul(h: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                   transposed: torch.Tensor | None) -> torch.Tensor:
            if packed is None:  # not a nearly full step, or this layer is not packed (yet)
                return torch.mm(h, transposed) if transposed is not None else F.linear(h, weight)
            if pad:
                h = F.pad(h, (0, 0, 0, pad))
            out = mkl_linear(h, packed, weight, None, w.pack_rows)
            return out[:n] if pad else out

        x = F.embedding(tokens, w.embed)
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        if n_dec:
            t_max = int(batch.dec_lens.max())
            steps = torch.arange(t_max, device=tokens.device)
            dec_mask = (steps[None, :] >= batch.dec_lens[:, None]).view(n_dec, 1, 1, t_max)
            # rows of the flattened [slots * kv_heads * T, d] cache that the new K/V go to
            t_alloc = k_cache.shape[3]
            heads = torch.arange(n_kv, device=tokens.device)
            dec_rows = ((batch.dec_slots[:, None] * n_kv + heads[None, :]) * t_alloc
                        + batch.positions[:n_dec, None]).reshape(-1)
        causal = {}
        for offset, slot, start, length in batch.chunks:
            key = (start, length)
            if key not in causal:
                rows = torch.arange(length, device=tokens.device)[:, None] + start
                causal[key] = torch.arange(start + length, device=tokens.device)[None, :] > rows
        for li, layer in enumerate(w.layers):
            packed = (w.packed[li] if w.packed is not None and mkl_linear is not None else None) or (None,) * 4
            transposed = (w.transposed[li] if w.transposed is not None else None) or (None,) * 4
            h = _rms_norm(x, layer.ln1, a.norm_eps)
            qkv = matmul(h, layer.qkv, packed[0], transposed[0])
            qk = _rope(qkv[:, :q_size + kv_size].view(n, n_heads + n_kv, d), cos, sin)
            q, k = qk[:, :n_heads], qk[:, n_heads:]
            v = qkv[:, q_size + kv_size:].view(n, n_kv, d)
            kc, vc = k_cache[li], v_cache[li]           # [slots, kv_heads, T, d]
            out = torch.empty(n, n_heads * d, device=x.device, dtype=x.dtype)
            if n_dec:
                kc.view(-1, d).index_copy_(0, dec_rows, k[:n_dec].reshape(-1, d))
                vc.view(-1, d).index_copy_(0, dec_rows, v[:n_dec].reshape(-1, d))
                if batch.dec_first_slot >= 0:
                    s0 = batch.dec_first_slot
                    keys, values = kc[s0:s0 + n_dec, :, :t_max], vc[s0:s0 + n_dec, :, :t_max]
                else:
                    keys = kc[:, :, :t_max].index_select(0, batch.dec_slots)
                    values = vc[:, :, :t_max].index_select(0, batch.dec_slots)
                qd = q[:n_dec].reshape(n_dec, n_kv, group, d)
                scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(self.scale)   # [B, kv, g, T]
                scores.masked_fill_(dec_mask, float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                out[:n_dec] = torch.matmul(probs, values).view(n_dec, n_heads * d)
            for offset, slot, start, length in batch.chunks:
                end = start + length
                kc[slot, :, start:end] = k[offset:offset + length].transpose(0, 1)
                vc[slot, :, start:end] = v[offset:offset + length].transpose(0, 1)
                qc = q[offset:offset + length].view(length, n_kv, group, d).permute(1, 2, 0, 3)
                qc = qc.reshape(n_kv, group * length, d)
                scores = torch.matmul(qc, kc[slot, :, :end].transpose(-1, -2)).mul_(self.scale)
                scores = scores.view(n_kv, group, length, end).masked_fill_(causal[(start, length)], float("-inf"))
                probs = torch.softmax(scores, dim=-1).view(n_kv, group * length, end)
                oc = torch.matmul(probs, vc[slot, :, :end])                     # [kv, g*len, d]
                out[offset:offset + length] = oc.view(n_kv, group, length, d).permute(2, 0, 1, 3).reshape(
                    length, n_heads * d)
            x = x + matmul(out, layer.o, packed[1], transposed[1])
            h = _rms_norm(x, layer.ln2, a.norm_eps)
            gate_up = matmul(h, layer.gate_up, packed[2], transposed[2])
            x = x + matmul(F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], layer.down, packed[3], transposed[3])
        rows = batch.logit_rows.numel()
        if rows != n:
            x = x.index_select(0, batch.logit_rows)
        h = _rms_norm(x, w.norm, a.norm_eps)
        if w.packed_lm_head is not None and w.pack_rows // 2 < rows <= w.pack_rows:
            h = F.pad(h, (0, 0, 0, w.pack_rows - rows))
            return torch.ops.mkl._mkl_linear(h, w.packed_lm_head, w.lm_head, None, w.pack_rows)[:rows].float()
        return F.linear(h, w.lm_head).float()


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------
def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits each row samples from: z / T, then top-k, then top-p (on the top-k-renormalised
    distribution: the smallest set of most likely tokens whose mass reaches top_p), then min-p;
    removed tokens get -inf. Rows must not be greedy (temperature > 0)."""
    z = logits
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        z = z / torch.tensor(temps, device=z.device, dtype=z.dtype)[:, None]
    else:
        z = z.clone()
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        rows = [i for i, k in enumerate(top_k) if 0 < k < z.shape[-1]]
        if rows:
            k_max = max(top_k[i] for i in rows)
            sub = z[rows]
            values = sub.topk(k_max, dim=-1).values
            kth = values.gather(1, torch.tensor([top_k[i] - 1 for i in rows], device=z.device)[:, None])
            z[rows] = sub.masked_fill(sub < kth, float("-inf"))
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        sub = z[rows]
        sorted_z, order = sub.sort(dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        before = sorted_p.cumsum(dim=-1) - sorted_p   # mass of strictly more likely tokens
        top_p = torch.tensor([params[i].top_p for i in rows], device=z.device, dtype=z.dtype)[:, None]
        sorted_z.masked_fill_(before >= top_p, float("-inf"))
        z[rows] = torch.empty_like(sub).scatter_(-1, order, sorted_z)
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if rows:
        sub = z[rows]
        probs = torch.softmax(sub, dim=-1)
        min_p = torch.tensor([params[i].min_p for i in rows], device=z.device, dtype=z.dtype)[:, None]
        z[rows] = sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return z


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 `logits` [R, V]; returns (tokens [R] long, logprobs [R] fp32).

    Greedy rows (temperature 0 or top_k 1) take argmax(logits). Other rows draw exactly from
    p = softmax(filtered_logits) by inverting its CDF at one float64 uniform from the row's own
    generator (one draw per token, so a sample's tokens do not depend on its batch neighbours).
    The returned log-prob is always log_softmax(logits)[token] of the raw logits: the engine's
    policy at temperature 1 without truncation.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        tokens[index] = logits.index_select(0, index).argmax(dim=-1)
    if sampled:
        every = len(sampled) == logits.shape[0]
        index = torch.tensor(sampled, device=logits.device)
        sub_params = [params[i] for i in sampled]
        plain = all(p.temperature == 1.0 and p.top_k < 0 and p.top_p >= 1.0 and p.min_p == 0.0 for p in sub_params)
        if plain:
            probs = (logprobs if every else logprobs.index_select(0, index)).exp()
        else:
            probs = torch.softmax(filtered_logits(logits if every else logits.index_select(0, index), sub_params), dim=-1)
        uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[i], device=generators[i].device)
                              for i in sampled]).to(logits.device)
        tokens[index] = inverse_cdf(probs, uniforms)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The token t of each row with CDF(t-1) <= u * total < CDF(t), for probs [R, V] (unnormalised,
    >= 0) and uniforms [R] in [0, 1). Two levels (blocks of `block` tokens, then tokens within the
    chosen block), each a float64 cumulative sum, so even 1e-9-probability tokens get their share
    without a float64 pass over the whole vocabulary. Zero-probability tokens are never chosen."""
    rows, vocab = probs.shape
    n_blocks = -(-vocab // block)
    if n_blocks * block != vocab:
        probs = F.pad(probs, (0, n_blocks * block - vocab))
    blocks = probs.view(rows, n_blocks, block)
    cdf = blocks.sum(-1).double().cumsum(-1)                        # [R, n_blocks]
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cdf, target, right=True).clamp_(max=n_blocks - 1)          # [R, 1]
    lower = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    mass = cdf.gather(1, b) - lower
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, block)).squeeze(1).double().cumsum(-1)   # [R, block]
    # position inside the block, rescaled to the block's own float64 total
    within = ((target - lower) / mass).clamp_(0.0, 1.0) * inner[:, -1:]
    within = torch.minimum(within, torch.nextafter(inner[:, -1:], torch.zeros_like(within)))
    j = torch.searchsorted(inner, within, right=True).clamp_(max=block - 1)
    return (b * block + j).squeeze(1)


# ---------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------
_SEED_MIX = 0x9E3779B97F4A7C15


def _sample_seed(seed: int, k: int, n: int) -> int:
    """Seed of sample k of an n-sample request (the request's seed itself when n == 1)."""
    if n == 1:
        return seed
    return ((seed % 2**64) * _SEED_MIX + k + 1) % 2**64


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit` (list slices compare in C)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass
class _Plan:
    """What one step computes: decode rows, prompt chunks (seq, start, length), prefix copies
    (seq, donor, length) done first, and the weights epoch it was planned under."""

    decode: list["_Seq"]
    chunks: list[tuple["_Seq", int, int]]
    copies: list[tuple["_Seq", "_Seq", int]]
    epoch: int


class _Seq:
    """One sample in flight (owned by the step thread once admitted)."""

    def __init__(self, sample_id: str, parent_id: str, group_id: str, prompt: list[int],
                 params: SamplingParams, seed: int, stop_ids: frozenset[int], future: Future):
        self.sample_id, self.parent_id, self.group_id = sample_id, parent_id, group_id
        self.prompt, self.params, self.seed, self.stop_ids, self.future = prompt, params, seed, stop_ids, future
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.prefilled = 0
        self.slot = -1
        self.generator: torch.Generator | None = None
        self.aborted = False
        self.finish: str | BaseException | None = None
        self.donor: _Seq | None = None      # running sequence whose prompt-prefix K/V we will copy
        self.share_len = 0
        self.kv_epoch: int | None = None     # weights epoch of our prompt K/V (-1: mixed)

    def completion(self) -> Completion:
        return Completion(request_id=self.sample_id, prompt_ids=list(self.prompt), output_ids=self.output,
                          output_logprobs=self.logprobs, weight_versions=self.versions,
                          finish_reason=self.finish or "abort", group_id=self.group_id)


class NativeEngine:
    """The native rollout engine (see the module docstring). Thread-safe; implements RolloutEngine."""

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor] | NamedTensors | None, *,
                 tokenizer: Any = None, config: NativeEngineConfig | None = None, version: int = 0,
                 eos_token_ids: Sequence[int] | None = None, weight_arena: torch.Tensor | None = None,
                 core_share: Any = None):
        """`state`: HF-named weights to copy in. Or `weight_arena`: a flat buffer laid out by
        `weight_arena_layout` that already holds the weights, used in place (e.g. shared memory).
        `core_share`: the generator's side of a core share with a trainer process on the same host
        (placement/core_share.py: `set_busy(bool)`, `apply()`): each step runs on the cores the
        trainer is not using, and an idle engine says so."""
        self.config = config = config or NativeEngineConfig()
        self.core_share = core_share
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = config.dtype
        if dtype == "auto":
            dtype = "bf16" if self.device.type == "cuda" else "fp32"
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.arch = arch
        self.tokenizer = tokenizer
        self.max_seq_len = min(config.max_seq_len or arch.max_position_embeddings, arch.max_position_embeddings)
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer is not None else []
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        if (state is None) == (weight_arena is None):
            raise ValueError("NativeEngine needs exactly one of `state` (weights to copy) and `weight_arena`")
        self._slots = config.max_batch_size
        self.weights = LlamaWeights(arch, self.device, self.dtype, weight_arena)
        if state is not None:
            self.weights.load(iter_named_tensors(state), strict=True)
        if config.prepack_weights:
            self.weights.enable_packing(self._slots)
        self.model = LlamaModel(self.weights, self.max_seq_len)
        self._version = int(version)
        self._epoch = 0                                  # bumped by every weight load
        self._k_cache: torch.Tensor | None = None
        self._v_cache: torch.Tensor | None = None
        self._written: list[int] = [0] * self._slots     # per slot: positions [0, w) hold finite values
        # shared state (guarded by _cv)
        self._cv = threading.Condition(threading.Lock())
        self._model_lock = threading.Lock()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []                   # index == slot
        self._abort_pending = False
        self._paused = False
        self._hold = 0
        self._closing = False
        self._callers = 0                                # threads driving steps inside generate()
        self._driver = threading.Lock()                  # held by whichever thread runs steps
        self._last_error: str | None = None
        self._stats = collections.Counter()
        self._seed_rng = random.Random()
        self._thread = threading.Thread(target=self._loop, name="native-rollout-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, source: Any, config: NativeEngineConfig | None = None, **kwargs: Any) -> "NativeEngine":
        """Build from a path / alias understood by `load_pretrained` (e.g. 'smollm2-135m') or a Pretrained."""
        from megatron_rl.models.pretrained import load_pretrained

        pretrained = load_pretrained(source) if isinstance(source, str) else source
        return cls(pretrained.arch, pretrained.state, tokenizer=pretrained.tokenizer, config=config, **kwargs)

    # --- public API -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def prepare(self, requests: Sequence[RequestLike]) -> list[GenerateRequest]:
        """Normalise and validate requests (raises RequestError naming the request and field)."""
        out = []
        for i, item in enumerate(requests):
            request = as_request(item, i)
            validate_request(request, vocab_size=self.arch.vocab_size, max_seq_len=self.max_seq_len,
                             has_tokenizer=self.tokenizer is not None)
            out.append(request)
        return out

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        if isinstance(requests, GenerateRequest):
            requests = [requests]
        prepared = self.prepare(requests)
        seqs = []
        for request in prepared:
            params = request.sampling
            base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            for k, sample_id in enumerate(request.sample_ids()):
                seqs.append(_Seq(sample_id, request.request_id, request.group_id, list(map(int, request.prompt_ids)),
                                 params, _sample_seed(base_seed, k, params.n), stop_ids, Future()))
        with self._cv:
            if self._closing:
                raise RuntimeError(f"engine is closed{': ' + self._last_error if self._last_error else ''}")
            self._waiting.extend(seqs)
            self._stats["submitted"] += len(seqs)
            self._cv.notify_all()
        return [s.future for s in seqs]

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest, timeout: float | None = None) -> list[Completion]:
        """Blocking: the calling thread runs the steps itself (other submitted requests share them)."""
        futures = self.submit(requests)
        self._drive(futures, timeout)
        return [f.result() for f in futures]

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        """Results of submitted futures; the calling thread runs the steps meanwhile (like generate)."""
        futures = list(futures)
        self._drive(futures, timeout)
        return [f.result() for f in futures]

    def run_forever(self) -> None:
        """Drive steps in the calling thread until close(): for a process dedicated to the engine,
        whose main thread runs this while other threads (HTTP handlers, IPC) only submit. Requests
        then never wait for the background thread, and torch keeps a single OpenMP pool."""
        with self._cv:
            self._callers += 1
        try:
            while not self._closing:
                if self._driver.acquire(timeout=0.05):
                    try:
                        self._steps_while(lambda: not self._closing)
                    finally:
                        self._driver.release()
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._abort_pending or self._can_step(), timeout=0.05)
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def caller_driven(self) -> Iterator[None]:
        """Keep the background thread idle while open: steps run only in threads inside `wait` /
        `generate` (see rollout.engine.caller_driven)."""
        with self._cv:
            self._callers += 1
        try:
            yield
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()

    def _steps_while(self, keep_going) -> None:
        """Run engine steps on this thread (the caller holds the driver lock) while there is work and
        `keep_going()`; a failing step kills the engine (every waiter gets the error) and re-raises."""
        try:
            with torch.inference_mode():
                while keep_going() and self._step_once():
                    pass
        except BaseException as exc:
            self._die(exc)
            raise

    def pause(self) -> None:
        """Stop stepping; returns once no step is running. Running requests keep their KV state."""
        with self._cv:
            self._paused = True
        with self._model_lock:
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        ids = None if request_ids is None else ({request_ids} if isinstance(request_ids, str) else set(request_ids))
        with self._cv:
            for seq in itertools.chain(self._waiting, self._running):
                if ids is None or seq.sample_id in ids or seq.parent_id in ids:
                    seq.aborted = True
                    self._abort_pending = True
            self._cv.notify_all()

    def begin_weight_update(self) -> None:
        """Hold generation until end_weight_update (several update_weights calls then apply as one)."""
        with self._cv:
            self._hold += 1
        with self._model_lock:
            pass

    def end_weight_update(self, version: int | None = None) -> None:
        with self._cv:
            if self._hold <= 0:
                raise RuntimeError("end_weight_update without begin_weight_update")
            if version is not None:
                self._version = int(version)
            self._hold -= 1
            self._cv.notify_all()

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Copy HF-named tensors into the engine (a dict, (name, tensor) pairs or dict buckets) and set
        the version. Returns the number of tensors loaded. Names and shapes are checked per tensor;
        an error leaves the tensors before it applied and the version unchanged."""
        return self._apply_weights(lambda: self.weights.load(iter_named_tensors(named_tensors)), version)

    def adopt_weight_arena(self, arena: torch.Tensor, version: int | None = None) -> None:
        """Switch to weights that already sit in `arena` (laid out by `weight_arena_layout`): no copy,
        only MKL re-packing where enabled. The caller must not write `arena` while the engine uses it
        (double-buffer: write the other arena, then adopt it)."""
        weights = LlamaWeights(self.arch, self.device, self.dtype, arena)
        if self.config.prepack_weights:
            weights.enable_packing(self._slots, lazily=True)  # packed between the next steps

        def switch() -> None:
            self.weights = self.model.w = weights

        self._apply_weights(switch, version)

    def _apply_weights(self, change, version: int | None):
        """Run `change()` between two steps as a new weights epoch, then set `version`; an error
        leaves the version unchanged."""
        self.begin_weight_update()
        try:
            with self._model_lock:
                with self._cv:
                    self._epoch += 1
                result = change()
        except BaseException:
            self.end_weight_update(None)
            raise
        with self._cv:
            self._stats["weight_updates"] += 1
        self.end_weight_update(version)
        return result

    def release_memory_occupation(self) -> dict[str, int]:
        """Give up what an idle engine holds so a colocated trainer can use it (SGLang's
        release_memory_occupation): the KV cache is freed, and on a GPU the weights move to host
        memory. Generation holds until `resume_memory_occupation`. Returns the bytes released per kind."""
        with self._cv:
            if self._running or self._waiting:
                raise RuntimeError("release_memory_occupation: requests are still running or waiting")
            self._hold += 1
        with self._model_lock:
            kv_bytes = 0 if self._k_cache is None else 2 * self._k_cache.numel() * self._k_cache.element_size()
            self._k_cache = self._v_cache = None
            self._written = [0] * self._slots
            weight_bytes = self.weights.arena.numel() * self.weights.arena.element_size()
            if self.device.type == "cuda":
                self._host_arena = self.weights.arena.to("cpu")
                self.weights = self.model.w = None  # drops the device arena
                torch.cuda.empty_cache()
        return {"kv_cache_bytes": kv_bytes, "weight_bytes": weight_bytes if self.device.type == "cuda" else 0}

    def resume_memory_occupation(self) -> None:
        """Undo `release_memory_occupation` (weights back on the device, the KV cache re-allocated on use)."""
        host = getattr(self, "_host_arena", None)
        if host is not None:
            self._host_arena = None
            arena = host.to(self.device)
            with self._model_lock:
                self.weights = self.model.w = LlamaWeights(self.arch, self.device, self.dtype, arena)
        self.end_weight_update(None)

    def flush_cache(self) -> bool:
        """Free the KV cache memory; refused (False) while requests are running or waiting."""
        with self._cv:
            if self._running or self._waiting:
                return False
            with self._model_lock:
                self._k_cache = self._v_cache = None
                self._written = [0] * self._slots
            return True

    def named_weights(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """HF-named views of the engine's current weights (all, or those in `names`), for checksums."""
        table = self.weights._targets
        return {n: table[n] for n in (table if names is None else names) if n in table}

    def health(self) -> dict[str, Any]:
        with self._cv:
            return {"ok": self._thread.is_alive() and not self._closing, "version": self._version,
                    "running": len(self._running), "waiting": len(self._waiting), "paused": self._paused,
                    "last_error": self._last_error, "engine": "native", "device": str(self.device),
                    "max_batch_size": self._slots, "max_seq_len": self.max_seq_len,
                    **{k: v for k, v in self._stats.items()}}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            for seq in itertools.chain(self._waiting, self._running):
                seq.aborted = True
            self._abort_pending = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @torch.inference_mode()
    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Raw fp32 logits [P, vocab] of every position of one sequence, through the engine's own
        forward (a private one-slot cache). For tests and debugging."""
        ids = list(map(int, token_ids))
        if not 0 < len(ids) <= self.max_seq_len:
            raise RequestError(f"token_ids has {len(ids)} tokens; need 1..{self.max_seq_len}", field="token_ids")
        a = self.arch
        shape = (a.num_layers, 1, a.num_query_groups, len(ids), a.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros_like(k)
        dev = self.device
        batch = _Batch(tokens=torch.tensor(ids, device=dev), positions=torch.arange(len(ids), device=dev),
                       dec_slots=torch.empty(0, dtype=torch.long, device=dev),
                       dec_lens=torch.empty(0, dtype=torch.long, device=dev), dec_first_slot=-1,
                       chunks=[(0, 0, 0, len(ids))], logit_rows=torch.arange(len(ids), device=dev))
        with self._model_lock:
            return self.model.forward(batch, k, v)

    # --- the step thread --------------------------------------------------------------------------
    def _can_step(self) -> bool:
        return not self._paused and not self._hold and bool(self._waiting or self._running)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as exc:  # the step thread must never die silently: fail everything queued
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.exception("native engine stopped")
        with self._cv:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._closing = True
            seqs = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._cv.notify_all()
        for seq in seqs:
            seq.finish = RuntimeError(f"native engine stopped: {self._last_error}")
        self._resolve(seqs)

    def _serve(self) -> None:
        """The background driver: steps whenever there is work and no blocking caller drives."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or (
                    (self._abort_pending or self._can_step()) and self._callers == 0))
                closing = self._closing
            if closing:
                with self._driver:
                    with self._cv:
                        finished = self._reap_aborted()
                    self._resolve(finished)
                return
            if not self._driver.acquire(timeout=0.05):
                continue
            try:
                while self._callers == 0 and self._step_once():
                    pass
            finally:
                self._driver.release()

    def _drive(self, futures: list[Future], timeout: float | None) -> None:
        """Run steps in the calling thread until `futures` are done. Keeping the compute on the
        caller's thread (usually the only thread using torch) avoids a second OpenMP thread pool,
        which makes libgomp throttle its spin-waits and every parallel op ~10x slower to start."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._callers += 1
        try:
            while not all(f.done() for f in futures):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"generate did not finish within {timeout} s")
                if self._driver.acquire(timeout=0.02):
                    try:
                        self._steps_while(lambda: not all(f.done() for f in futures))
                    finally:
                        self._driver.release()
                    if not all(f.done() for f in futures):
                        with self._cv:  # paused or holding for an update: wait for a change
                            self._cv.wait(timeout=0.02)
        finally:
            with self._cv:
                self._callers -= 1
                self._cv.notify_all()

    def _step_once(self) -> bool:
        """One scheduling step (the caller holds the driver lock). False when nothing could be done."""
        weights = self.weights
        if weights is not None and weights.packing_pending:
            # Adopted weights are re-packed before any step (a step on a partly re-packed model would round
            # differently, so numerics would depend on timing), a few layers at a time, so that a weight
            # update waits for one chunk, not for the whole model (`bench sync`: engine load 0.47 -> 0.05 s).
            with self._cv:
                update_waiting = bool(self._hold)
            if not update_waiting:
                with self._model_lock:
                    if self.core_share is not None:
                        with self.core_share.working():  # on this side's share while the trainer trains
                            weights.pack_pending(limit=4)
                    else:
                        weights.pack_pending(limit=4)
                return True
        finished: list[_Seq] = []
        with self._cv:
            finished += self._reap_aborted()
            plan = None
            if self._can_step() and not self._closing:
                self._admit()
                plan = self._plan()
        self._resolve(finished)
        if self.core_share is not None:
            self.core_share.set_busy(plan is not None)
        if plan is None:
            return bool(finished)
        with self._model_lock:
            with self._cv:
                # an update, pause or close since planning: re-plan (planning has no side effects)
                runnable = not (self._paused or self._hold or self._closing) and self._epoch == plan.epoch
                version = self._version
            if not runnable or self.weights.packing_pending:  # weights adopted since the check above
                return True
            try:
                if self.core_share is not None:
                    self._stats[f"steps_on_{self.core_share.apply()}_threads"] += 1
                tokens, logprobs = self._execute(plan)
                error = None
            except Exception as exc:  # a bug or out-of-memory: fail this step's requests, keep serving
                log.exception("native engine step failed")
                error = exc
        with self._cv:
            if error is not None:
                self._last_error = f"{type(error).__name__}: {error}"
                finished = self._fail(plan.decode + [c[0] for c in plan.chunks], error)
            else:
                finished = self._apply(plan, tokens, logprobs, version)
        self._resolve(finished)
        return True

    def _resolve(self, seqs: list[_Seq]) -> None:
        for seq in seqs:
            if isinstance(seq.finish, BaseException):
                if not seq.future.done():
                    seq.future.set_exception(seq.finish)
            elif not seq.future.done():
                seq.future.set_result(seq.completion())

    def _reap_aborted(self) -> list[_Seq]:
        if not self._abort_pending:
            return []
        self._abort_pending = False
        done = [s for s in self._waiting if s.aborted]
        if done:
            self._waiting = collections.deque(s for s in self._waiting if not s.aborted)
        running = [s for s in self._running if s.aborted]
        self._release(running)
        for seq in done + running:
            seq.finish = "abort"
        self._stats["aborted"] += len(done) + len(running)
        return done + running

    def _admit(self) -> None:
        min_share = self.config.prefix_sharing_min_tokens
        while self._waiting and len(self._running) < self._slots:
            seq = self._waiting.popleft()
            if not seq.future.set_running_or_notify_cancel():
                continue  # the caller cancelled the future while it waited
            seq.slot = len(self._running)
            seq.generator = None
            if not seq.params.greedy:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(seq.seed)
            if min_share:
                # the running sequence sharing the longest prompt prefix (the last prompt token is
                # always computed by the sequence itself: its logits give the first sample)
                best, best_len = None, min_share - 1
                limit = len(seq.prompt) - 1
                for other in self._running:
                    if other.donor is not None or (other.kv_epoch is not None and other.kv_epoch != self._epoch):
                        continue  # no chains of waiting sequences; no prefixes of older weights
                    length = _common_prefix(seq.prompt, other.prompt, limit)
                    if length > best_len:
                        best, best_len = other, length
                if best is not None:
                    seq.donor, seq.share_len = best, best_len
            self._running.append(seq)

    def _plan(self) -> "_Plan | None":
        decode = [s for s in self._running if s.prefilled == len(s.prompt)]
        budget = self.config.max_prefill_tokens
        chunks, copies = [], []
        for seq in self._running:
            if budget <= 0:
                break
            if seq.prefilled >= len(seq.prompt):
                continue
            start = seq.prefilled
            donor = seq.donor
            if donor is not None:
                if donor.slot < 0 or donor.kv_epoch == -1 or (donor.kv_epoch is not None and donor.kv_epoch != self._epoch):
                    seq.donor = None  # the donor left or its prefix is stale: compute it ourselves
                elif donor.prefilled >= seq.share_len and donor.kv_epoch == self._epoch:
                    copies.append((seq, donor, seq.share_len))
                    start = seq.share_len
                else:
                    continue  # wait a step for the donor to compute the shared prefix
            length = min(len(seq.prompt) - start, budget)
            chunks.append((seq, start, length))
            budget -= length
        if not decode and not chunks:
            return None
        return _Plan(decode, chunks, copies, self._epoch)

    def _ensure_cache(self) -> None:
        if self._k_cache is None:
            a = self.arch
            shape = (a.num_layers, self._slots, a.num_query_groups, self.max_seq_len, a.head_dim)
            # torch.empty: untouched pages of this (mostly unused) buffer are never committed.
            self._k_cache = torch.empty(shape, device=self.device, dtype=self.dtype)
            self._v_cache = torch.empty(shape, device=self.device, dtype=self.dtype)
            self._written = [0] * self._slots

    def _execute(self, plan: "_Plan") -> tuple[list[int], list[float]]:
        decode, chunks = plan.decode, plan.chunks
        self._ensure_cache()
        for seq, donor, length in plan.copies:
            self._k_cache[:, seq.slot, :, :length] = self._k_cache[:, donor.slot, :, :length]
            self._v_cache[:, seq.slot, :, :length] = self._v_cache[:, donor.slot, :, :length]
            self._written[seq.slot] = max(self._written[seq.slot], length)
        self._stats["shared_prefix_tokens"] += sum(length for _, _, length in plan.copies)
        dev = self.device
        tokens: list[int] = [s.output[-1] for s in decode]
        positions: list[int] = [len(s.prompt) + len(s.output) - 1 for s in decode]
        slots = [s.slot for s in decode]
        lens = [p + 1 for p in positions]
        logit_rows = list(range(len(decode)))
        packed_chunks = []
        offset = len(decode)
        for seq, start, length in chunks:
            tokens.extend(seq.prompt[start:start + length])
            positions.extend(range(start, start + length))
            packed_chunks.append((offset, seq.slot, start, length))
            if start + length == len(seq.prompt):
                logit_rows.append(offset + length - 1)
            offset += length
        if decode:
            # Attention reads cache positions [0, t_max) of every decode slot: none may be
            # uninitialised memory (stale values of earlier sequences are finite and masked out).
            # Zero-fill in bulk up to the longest the sequence can get, so its pages are committed
            # once here rather than faulted in one by one as decoding advances.
            t_max = max(lens)
            for seq in decode:
                slot = seq.slot
                if self._written[slot] < t_max:
                    horizon = max(t_max, min(self.max_seq_len, len(seq.prompt) + seq.params.max_new_tokens))
                    self._k_cache[:, slot, :, self._written[slot]:horizon] = 0
                    self._v_cache[:, slot, :, self._written[slot]:horizon] = 0
                    self._written[slot] = horizon
        for seq, start, length in chunks:
            self._written[seq.slot] = max(self._written[seq.slot], start + length)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots))) if slots else False
        batch = _Batch(tokens=torch.tensor(tokens, device=dev), positions=torch.tensor(positions, device=dev),
                       dec_slots=torch.tensor(slots, dtype=torch.long, device=dev),
                       dec_lens=torch.tensor(lens, dtype=torch.long, device=dev),
                       dec_first_slot=slots[0] if contiguous else -1, chunks=packed_chunks,
                       logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev))
        logits = self.model.forward(batch, self._k_cache, self._v_cache)
        sampling = decode + [seq for seq, start, length in chunks if start + length == len(seq.prompt)]
        self._stats["steps"] += 1
        if not sampling:
            return [], []
        toks, lps = sample_tokens(logits, [s.params for s in sampling], [s.generator for s in sampling])
        return toks.tolist(), lps.tolist()

    def _apply(self, plan: "_Plan", tokens: list[int], logprobs: list[float], version: int) -> list[_Seq]:
        for seq, donor, length in plan.copies:
            seq.donor = None
            seq.kv_epoch = plan.epoch
        for seq, start, length in plan.chunks:
            seq.prefilled = start + length
            if seq.kv_epoch is None:
                seq.kv_epoch = plan.epoch
            elif seq.kv_epoch != plan.epoch:
                seq.kv_epoch = -1  # prompt K/V from two weight versions: never share it
        sampling = plan.decode + [seq for seq, start, length in plan.chunks if start + length == len(seq.prompt)]
        finished = []
        for seq, token, logprob in zip(sampling, tokens, logprobs):
            if seq.aborted:
                continue  # reaped below with the tokens it had
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = self._finish_reason(seq, token)
            if reason:
                seq.finish = reason
                finished.append(seq)
        self._stats["generated_tokens"] += len(tokens)
        self._release(finished)
        self._stats["completed"] += len(finished)
        return finished + self._reap_aborted()

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop and self.tokenizer is not None:
            longest = max(len(s) for s in seq.params.stop)
            tail = self.tokenizer.decode(seq.output[-(4 * longest + 4):])
            if any(s in tail for s in seq.params.stop):
                return "stop"
        if len(seq.output) >= seq.params.max_new_tokens or len(seq.prompt) + len(seq.output) >= self.max_seq_len:
            return "length"
        return None

    def _release(self, seqs: list[_Seq]) -> None:
        """Free the slots of `seqs`, moving the last running sequence into each hole (dense slots)."""
        for seq in sorted(seqs, key=lambda s: s.slot, reverse=True):
            hole = seq.slot
            last = self._running.pop()
            if last is not seq:
                # cache positions holding K/V: the prompt so far, plus every output token but the last
                used = last.prefilled + max(len(last.output) - 1, 0)
                if self._k_cache is not None and used:
                    self._k_cache[:, hole, :, :used] = self._k_cache[:, last.slot, :, :used]
                    self._v_cache[:, hole, :, :used] = self._v_cache[:, last.slot, :, :used]
                    self._written[hole] = max(self._written[hole], used)
                self._running[hole] = last
                last.slot = hole
            seq.slot = -1

    def _fail(self, seqs: list[_Seq], error: BaseException) -> list[_Seq]:
        seqs = [s for s in dict.fromkeys(seqs) if s.slot >= 0]
        self._release(seqs)
        for seq in seqs:
            seq.finish = RuntimeError(f"native engine step failed: {type(error).__name__}: {error}")
        return seqs
