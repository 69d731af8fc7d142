"""The native engine's model: a pre-norm decoder forward (every family of models/families.py: grouped-query
attention, or DeepSeek's multi-latent attention over a latent cache, `mla_qkv`; dense or mixture-of-experts MLPs,
moe.py) in plain PyTorch over a per-slot KV cache.

HF-layout weights (the names `models.pretrained.load_pretrained` returns) live in the flat arena of
weights.py, where per layer `qkv` = [q | k | v] (with its bias, Qwen2) and `gate_up` = [gate | up] are
fused, so a layer is four matmuls. The forward mirrors transformers' LlamaForCausalLM (and its Qwen2 /
Qwen3 / Mistral siblings) op for op: RMSNorm in the activation dtype, per-head q/k RMSNorm before RoPE
(Qwen3), rotate-half RoPE from fp32 tables built from `models.rope.rope_inv_freq` (the trainer's
function; cos/sin times its attention scaling), softmax scale 1/sqrt(head_dim), SiLU MLP; grouped-query
attention is computed per KV head on [q heads of the group] without repeating K/V. Logits are computed
only for the positions that sample a token, in fp32. A sliding-window layer (`ModelArch.layer_window`)
attends to the keys in (position - window, position], as transformers' sliding-window mask, and reads only
the cache span its rows' windows cover.

Dynamic (NTK) RoPE depends on the sequence length. transformers recomputes the frequencies per forward
from its longest position, so one `generate` rotates a prompt with those of
max(prompt length, max_position_embeddings) and the answer token at position p with those of
max(p + 1, max_position_embeddings); the engine does the same per sequence (`_Batch.rope_lens`), so a
sequence's result does not depend on what it is batched with (transformers' padded batches, where the
longest sequence sets the length of all, are not reproduced).

On CPU the engine hands `kernels` the fused kernels of kernels/cpu_decode.py: residual add + RMSNorm, RoPE with
the cache writes, the gated activation and decode attention then each take one pass instead of a run of torch
ops, with the same roundings where transformers fixes them (docs/performance.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from megatron_rl.kernels.cpu_decode import CpuDecodeKernels
from megatron_rl.kernels.logprob import soft_cap
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.attention import softmax_with_sinks
from megatron_rl.models.rope import rope_inv_freq
from megatron_rl.rollout.native.kv_cache import KVCache
from megatron_rl.rollout.native.lora import EngineAdapters
from megatron_rl.rollout.native.moe import gated_activation, moe_mlp
from megatron_rl.rollout.native.weights import LlamaWeights, PackedMatrix


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, computed in fp32 and cast back (torch's fused kernel computes the
    # same expression in fp32: bit-identical results, one kernel)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: the normalised x scaled by (offset + weight), both in fp32, then cast."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())
    return out.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]; cos/signed_sin [N, 1, r] (`_signed_sin`): x * cos + rotate_half(x) * sin over the first
    r dims, as transformers (r < d: partial rotary, the rest passes through); rotate_half's negation rides on
    the sine (exact), so this is three kernels, not five."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(r // 2, -1), signed_sin)
    rot = x[..., :r]
    return torch.cat((torch.addcmul(rot * cos, rot.roll(r // 2, -1), signed_sin), x[..., r:]), dim=-1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == roll(x, d/2) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb_interleave` (DeepSeek's layout): pairs (x0, x1), (x2, x3), ... each rotated
    by one frequency, the result laid out evens then odds; cos/sin [N, 1, r] as `_Rope` gives them (unsigned)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_qkv(w: dict[str, torch.Tensor], h: torch.Tensor, a: ModelArch, cos: torch.Tensor, sin: torch.Tensor,
            signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed multi-latent attention (DeepSeek-V2/V3) of normed hidden states h [N, H]: (q [N, heads, latent +
    rope], the cache row k [N, 1, latent + rope]). transformers expands each cached latent c into keys W_uk c and
    values W_uv c per head; here each head's no-RoPE query is taken into the latent space instead (q_nope W_uk), so
    q . k = q_nope . (W_uk c) + q_rope . k_rope with the cache holding c and k_rope only, and the values stay latent
    until `mla_values`."""
    n, heads = h.shape[0], a.num_attention_heads
    nope, rope, latent = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    if a.q_lora_rank:
        q = F.linear(_rms_norm(F.linear(h, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], a.norm_eps),
                     w["q_b_proj.weight"])
    else:
        q = F.linear(h, w["q_proj.weight"])
    q = q.view(n, heads, nope + rope)
    kv = F.linear(h, w["kv_a_proj_with_mqa.weight"])                     # [N, latent + rope]
    c = _rms_norm(kv[:, :latent], w["kv_a_layernorm.weight"], a.norm_eps)
    if a.rope_interleave:
        q_rope, k_rope = _rope_interleaved(q[..., nope:], cos, sin), _rope_interleaved(kv[:, None, latent:], cos, sin)
    else:
        q_rope, k_rope = _rope(q[..., nope:], cos, signed_sin), _rope(kv[:, None, latent:], cos, signed_sin)
    w_uk = w["kv_b_proj.weight"].view(heads, nope + a.v_head_dim, latent)[:, :nope]  # [heads, nope, latent]
    q_latent = torch.einsum("nhd,hdc->nhc", q[..., :nope], w_uk)
    return torch.cat([q_latent, q_rope], dim=-1), torch.cat([c[:, None], k_rope], dim=-1)


def mla_values(w: dict[str, torch.Tensor], out: torch.Tensor, a: ModelArch) -> torch.Tensor:
    """Each head's attention-weighted latent [N, heads * latent] through its value projection W_uv: [N, heads * v]."""
    heads, latent = a.num_attention_heads, a.kv_lora_rank
    w_uv = w["kv_b_proj.weight"].view(heads, a.qk_nope_head_dim + a.v_head_dim, latent)[:, a.qk_nope_head_dim:]
    return torch.einsum("nhc,hvc->nhv", out.view(-1, heads, latent), w_uv).reshape(out.shape[0], -1)


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
    rope_lens: torch.Tensor | None = None  # [N] long: the sequence length that sets each row's dynamic RoPE
    routing: torch.Tensor | None = None    # [N, layers, top_k] int16 to fill with the chosen experts (MoE)


def dynamic_rope_base(arch: ModelArch) -> int | None:
    """For dynamic RoPE, the length up to which the plain frequencies apply (transformers:
    max_position_embeddings); None for every other rope type."""
    scaling = arch.rope_scaling
    return arch.max_position_embeddings if scaling is not None and scaling.rope_type == "dynamic" else None


class _Rope:
    """cos/sin of every row of a batch, as transformers' rotary embedding computes them."""

    def __init__(self, arch: ModelArch, max_seq_len: int, device: torch.device, dtype: torch.dtype):
        self.arch, self.dtype = arch, dtype
        inv_freq, self.scaling = rope_inv_freq(arch, device=device)
        self.inv_freq = inv_freq.float()
        self.cos, self.sin = self._tables(torch.arange(max_seq_len, device=device), self.inv_freq[None, :])
        self.dynamic_base = dynamic_rope_base(arch)

    def _tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers: fp32 positions times fp32 inv_freq, cos/sin times attention_scaling, then the cast
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def __call__(self, positions: torch.Tensor, rope_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, head_dim] cos and sin for `positions`."""
        base = self.dynamic_base
        if base is None or rope_lens is None or int(rope_lens.max()) <= base:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        inv = self.inv_freq.expand(positions.numel(), -1).clone()
        for length in torch.unique(rope_lens[rope_lens > base]).tolist():
            rows = rope_lens == length
            inv[rows] = rope_inv_freq(self.arch, seq_len=int(length), device=positions.device)[0].float()
        cos, sin = self._tables(positions, inv)
        return cos.unsqueeze(1), sin.unsqueeze(1)


class LlamaModel:
    """Forward passes over a KV cache for `LlamaWeights`."""

    def __init__(self, weights: LlamaWeights, max_seq_len: int):
        self.w = weights
        a = weights.arch

        self.arch = a
        self.rope = _Rope(a, max_seq_len, weights.embed.device, weights.embed.dtype)
        # transformers' scale: 1/sqrt(q/k width), the nope + rotary dims under multi-latent attention (absorbing
        # the key projection into the query leaves q . k as it is)
        self.scale = 1.0 / math.sqrt(a.qk_nope_head_dim + a.qk_rope_head_dim if a.is_mla else a.head_dim)
        scaling = a.rope_scaling
        if a.is_mla and scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
            # transformers' yarn_apply_mscale: MLA models scale q . k by mscale^2 beyond the rotary attention factor
            self.scale *= (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2
        if a.attention_scale is not None:  # (Gemma: query_pre_attn_scalar ** -0.5)
            self.scale = a.attention_scale
        # each layer's RoPE (Gemma 3's sliding-window layers rotate with a base of their own)
        self.layer_rope = [0 if a.layer_rope(i) is a else 1 for i in range(a.num_layers)]
        self.ropes = [self.rope] + ([_Rope(a.layer_rope(a.windowed_layers[0]), max_seq_len, weights.embed.device,
                                           weights.embed.dtype)] if a.local_rope_theta is not None else [])
        self.embedding_multiplier = torch.tensor(a.embedding_multiplier, dtype=torch.float32).to(weights.embed.dtype)
        offset = a.norm_offset
        self.rms_norm = _rms_norm if not offset else functools.partial(_offset_rms_norm, offset=offset)
        self.windows = [a.layer_window(i) for i in range(a.num_layers)]
        self.adapters: EngineAdapters | None = None  # LoRA beside the base weights (lora.py)
        self.kernels: CpuDecodeKernels | None = None
        """The fused CPU kernels (kernels/cpu_decode.py) in place of the torch ops they stand for; set by the engine
        (`engine.cpu_kernels`)."""
        plain_glu = a.swiglu_limit is None and a.swiglu_alpha == 1.0 and not a.glu_linear_offset
        self.fused_activation = a.mlp_activation if plain_glu and a.mlp_activation in ("silu", "gelu_tanh") else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The family's RMSNorm of x [rows, H]; with `delta`, of x + delta, which is added to x in place first
        (the residual stream's pending update: one pass with the fused kernel)."""
        a, kernels = self.arch, self.kernels
        if kernels is not None and x.is_contiguous() and weight.dtype == x.dtype:
            return kernels.rms_norm(x, weight, a.norm_eps, delta=delta, offset=a.norm_offset or None)
        if delta is not None:
            x.add_(delta)
        return self.rms_norm(x, weight, a.norm_eps)

    def forward(self, batch: _Batch, cache: KVCache, float_logits: bool = True) -> torch.Tensor:
        """Run one packed step, writing K/V of every input token into `cache` (allocated). Returns the
        logits [R, vocab] for `batch.logit_rows`: fp32, or with `float_logits` False in the activation dtype
        (for a sampler that widens them itself: a [R, vocab] fp32 copy costs as much as a layer's norms)."""
        a, w = self.arch, self.w
        k_cache, v_cache = cache.k, cache.v
        n_heads, n_kv, d = a.num_attention_heads, a.num_query_groups, a.head_dim
        dk = dv = d  # key and value widths in the cache
        if a.is_mla:  # absorbed multi-latent attention: one "KV head" per token, the latent + rotary key (mla_qkv)
            n_kv, dk, dv = 1, a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank
        group = n_heads // n_kv
        q_size, kv_size, ffn = a.q_size, a.kv_size, a.ffn_hidden_size
        tokens = batch.tokens
        n = tokens.numel()
        n_dec = batch.dec_slots.numel()
        t_alloc = cache.max_len
        kv_heads = torch.arange(n_kv, device=tokens.device)

        def matmul(h: torch.Tensor, weight: torch.Tensor, packed: PackedMatrix | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            # packed: the same matrix laid out for the CPU's GEMM kernel; None while it waits to be re-packed
            return F.linear(h, weight, bias) if packed is None else packed(h, bias)

        kernels = self.kernels
        # the fused kernel rotates q and k and writes k and v to the cache (every row: decode and prompt chunks)
        fused_rope = kernels is not None and not a.is_mla
        x = F.embedding(tokens, w.embed)
        if a.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        rotations = []  # (cos, unsigned sin, signed sin) of each RoPE the layers use; [N, rotary dims] for the kernel
        for rope in self.ropes:
            cos, raw_sin = rope(batch.positions, batch.rope_lens)
            rotations.append((cos.reshape(n, -1).contiguous(), raw_sin.reshape(n, -1).contiguous(), None) if fused_rope
                             else (cos, raw_sin, _signed_sin(raw_sin)))
        norm = self.rms_norm
        softcap = a.attn_logit_softcapping
        dec_masks: dict[int | None, tuple[int, torch.Tensor]] = {}
        if n_dec and kernels is None:
            t_max = int(batch.dec_lens.max())
            # per window: (first cache position read, additive mask over [first, t_max)), built once per step;
            # one fused SDPA call per layer reads it
            for window in set(self.windows):
                first = 0 if window is None else max(0, int(batch.dec_lens.min()) - window)
                steps = torch.arange(first, t_max, device=tokens.device)[None, :]
                hidden = steps >= batch.dec_lens[:, None]
                if window is not None:
                    hidden |= steps < batch.dec_lens[:, None] - window
                dec_masks[window] = first, torch.zeros(n_dec, 1, 1, t_max - first, device=tokens.device,
                                                       dtype=x.dtype).masked_fill_(
                    hidden.view(n_dec, 1, 1, t_max - first), float("-inf"))

        def cache_rows_of(slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # [rows, kv_heads]: where each row's K/V go in the flattened [slots * kv_heads * T, d] cache
            return (slots[:, None] * n_kv + kv_heads[None, :]) * t_alloc + positions[:, None]

        if n_dec and not fused_rope:  # (the fused kernel writes every row's K/V itself)
            dec_rows = cache_rows_of(batch.dec_slots, batch.positions[:n_dec]).reshape(-1)
        # (start, length, window) -> (first key position, mask of the hidden keys, of the visible ones or None
        # where SDPA's own causal mask is the same: a whole prompt from position 0 without a window)
        causal: dict[tuple[int, int, int | None], tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        for offset, slot, start, length in batch.chunks:
            for window in set(self.windows):
                key = (start, length, window)
                if key not in causal:
                    first = 0 if window is None else max(0, start - window + 1)
                    rows = torch.arange(length, device=tokens.device)[:, None] + start
                    keys = torch.arange(first, start + length, device=tokens.device)[None, :]
                    hidden = keys > rows
                    if window is not None:
                        hidden |= keys <= rows - window
                    causal[key] = first, hidden, None if window is None and start == 0 else ~hidden
        if fused_rope:
            row_slots = torch.empty(n, dtype=torch.long, device=tokens.device)
            row_slots[:n_dec] = batch.dec_slots
            for offset, slot, start, length in batch.chunks:
                row_slots[offset:offset + length] = slot
            cache_rows = cache_rows_of(row_slots, batch.positions).contiguous()
        if kernels is not None:
            dec_slots, dec_lens = batch.dec_slots.contiguous(), batch.dec_lens.contiguous()
        adapters = self.adapters
        delta = None  # the residual stream's pending addition: the last MLP's output, added inside the next norm
        for li, layer in enumerate(w.layers):
            packed = (w.packed[li] if w.packed is not None else None) or (None,) * 4
            cos, raw_sin, sin = rotations[self.layer_rope[li]]
            h = self.norm(x, layer.ln1, delta)
            if layer.mla is not None:
                q, k = mla_qkv(layer.mla, h, a, cos, raw_sin, sin)
                kc = k_cache[li]                            # [slots, 1, T, latent + rotary key]
                vc = kc[..., :dv]                           # the values are the latents
            else:
                qkv = matmul(h, layer.qkv, packed[0], layer.qkv_bias)
                if adapters is not None:
                    qkv = adapters.apply(li, "qkv", h, qkv)
                kc, vc = k_cache[li], v_cache[li]           # [slots, kv_heads, T, d]
                if fused_rope:  # (q / k norms, RoPE, and the K / V cache writes of every row)
                    q = kernels.rope_qkv(qkv.contiguous(), n_heads, n_kv, d, cos, raw_sin, kc, vc, cache_rows,
                                         q_norm=layer.q_norm, k_norm=layer.k_norm, eps=a.norm_eps,
                                         norm_offset=a.norm_offset or None)
                else:
                    qk = qkv[:, :q_size + kv_size].view(n, n_heads + n_kv, d)
                    if layer.q_norm is not None:  # Qwen3: RMSNorm over each head's q and k, before RoPE
                        q = _rope(norm(qk[:, :n_heads], layer.q_norm, a.norm_eps), cos, sin)
                        k = _rope(norm(qk[:, n_heads:], layer.k_norm, a.norm_eps), cos, sin)
                    else:
                        qk = _rope(qk, cos, sin)
                        q, k = qk[:, :n_heads], qk[:, n_heads:]
                    v = qkv[:, q_size + kv_size:].view(n, n_kv, d)
            out = torch.empty(n, n_heads * dv, device=x.device, dtype=x.dtype) if batch.chunks else None
            window = self.windows[li]
            if n_dec and kernels is not None:
                if layer.mla is not None:
                    kc.view(-1, dk).index_copy_(0, dec_rows, k[:n_dec].reshape(-1, dk))
                sinks = None if layer.sinks is None else layer.sinks.float().contiguous()
                attended = kernels.decode_attention(
                    q[:n_dec].contiguous(), kc, kc if layer.mla is not None else vc, dec_slots, dec_lens, kv_heads=n_kv,
                    t_alloc=t_alloc, k_row=dk, v_row=dk if layer.mla is not None else d, dv=dv, scale=self.scale,
                    window=window, softcap=softcap, sinks=sinks)
                if out is None:
                    out = attended
                else:
                    out[:n_dec] = attended
            elif n_dec:
                kc.view(-1, dk).index_copy_(0, dec_rows, k[:n_dec].reshape(-1, dk))
                if layer.mla is None:
                    vc.view(-1, d).index_copy_(0, dec_rows, v[:n_dec].reshape(-1, d))
                first, dec_mask = dec_masks[window]
                if batch.dec_first_slot >= 0:
                    s0 = batch.dec_first_slot
                    keys, values = kc[s0:s0 + n_dec, :, first:t_max], vc[s0:s0 + n_dec, :, first:t_max]
                else:
                    keys = kc[:, :, first:t_max].index_select(0, batch.dec_slots)
                    values = vc[:, :, first:t_max].index_select(0, batch.dec_slots)
                # each KV head's group of q heads attends as `group` queries: GQA without repeating K/V
                qd = q[:n_dec].reshape(n_dec, n_kv, group, dk)
                if layer.sinks is not None:  # (no fused kernel takes the sink column)
                    scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(self.scale).add_(dec_mask)
                    attended = torch.matmul(softmax_with_sinks(scores, layer.sinks.view(1, n_kv, group, 1)), values)
                elif softcap is None:
                    attended = F.scaled_dot_product_attention(qd, keys, values, attn_mask=dec_mask, scale=self.scale)
                else:  # (no fused kernel caps the scores)
                    scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(self.scale)
                    scores = torch.tanh(scores.div_(softcap)).mul_(softcap).add_(dec_mask)
                    attended = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(qd.dtype), values)
                if out is None:  # a pure decode step: the attention output is the whole step's
                    out = attended.reshape(n_dec, n_heads * dv)
                else:
                    out[:n_dec] = attended.reshape(n_dec, n_heads * dv)
            for offset, slot, start, length in batch.chunks:
                end = start + length
                if not fused_rope:
                    kc[slot, :, start:end] = k[offset:offset + length].transpose(0, 1)
                    if layer.mla is None:
                        vc[slot, :, start:end] = v[offset:offset + length].transpose(0, 1)
                first, hidden, visible = causal[(start, length, window)]
                if layer.sinks is None and softcap is None:  # torch's fused attention (flash on CPU), GQA in place
                    oc = F.scaled_dot_product_attention(
                        q[offset:offset + length].transpose(0, 1)[None], kc[slot, :, first:end][None],
                        vc[slot, :, first:end][None], attn_mask=visible, is_causal=visible is None, scale=self.scale,
                        enable_gqa=True)                                         # [1, heads, len, dv]
                    out[offset:offset + length] = oc[0].transpose(0, 1).reshape(length, n_heads * dv)
                    continue
                # (no fused kernel takes the sink column or caps the scores)
                qc = q[offset:offset + length].view(length, n_kv, group, dk).permute(1, 2, 0, 3)
                qc = qc.reshape(n_kv, group * length, dk)
                scores = torch.matmul(qc, kc[slot, :, first:end].transpose(-1, -2)).mul_(self.scale)
                if softcap is not None:
                    scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
                scores = scores.view(n_kv, group, length, end - first).masked_fill_(hidden, float("-inf"))
                probs = (torch.softmax(scores, dim=-1) if layer.sinks is None else softmax_with_sinks(
                    scores, layer.sinks.view(n_kv, group, 1, 1))).view(n_kv, group * length, end - first)
                oc = torch.matmul(probs, vc[slot, :, first:end])                 # [kv, g*len, dv]
                out[offset:offset + length] = oc.view(n_kv, group, length, dv).permute(2, 0, 1, 3).reshape(
                    length, n_heads * dv)
            if layer.mla is not None:  # each head's latent output through its value projection
                out = mla_values(layer.mla, out, a)
            attn = matmul(out, layer.o, packed[1], layer.o_bias)
            if adapters is not None:
                attn = adapters.apply(li, "o", out, attn)
            h = self.norm(x, layer.ln2, attn if layer.post_attn_norm is None else self.norm(attn, layer.post_attn_norm))
            if layer.moe is not None:  # mixture of experts (moe.py)
                delta = moe_mlp(h, layer.moe, a, None if batch.routing is None else batch.routing[:, li])
                continue
            gate_up = matmul(h, layer.gate_up, packed[2])
            if adapters is not None:
                gate_up = adapters.apply(li, "gate_up", h, gate_up)
            if kernels is not None and self.fused_activation is not None:
                act = kernels.gated_act(gate_up.contiguous(), self.fused_activation)
            else:
                act = gated_activation(gate_up[:, :ffn], gate_up[:, ffn:], a)
            down = matmul(act, layer.down, packed[3])
            if adapters is not None:
                down = adapters.apply(li, "down", act, down)
            delta = down if layer.post_mlp_norm is None else self.norm(down, layer.post_mlp_norm)
        if delta is not None:
            x.add_(delta)
        rows = batch.logit_rows.numel()
        if rows != n:
            x = x.index_select(0, batch.logit_rows)
        h = self.norm(x, w.norm)
        # (capped in the activation dtype, as transformers)
        logits = soft_cap(matmul(h, w.lm_head, w.packed_lm_head), a.final_logit_softcapping)
        return logits.float() if float_logits else logits
