"""Sequence packing: the rows of a micro-batch concatenated into one row without padding, each row its own
document (positions restart, attention stays inside it), and micro-batches filled by tokens.

The trainer runs the packed row through Megatron's THD path (`PackedSeqParams` with `cu_seqlens`: Transformer
Engine's variable-length attention on GPU, `varlen_causal_attention` on the local layers) and scatters the final
hidden states back to the micro-batch's [rows, columns] layout, so loss functions see exactly the unpacked
micro-batch. A row is packed up to its last loss position (`TrainBatch.loss_positions()`): the columns a causal
model needs for every log-prob a loss reads, as the unpacked path's trimming keeps per micro-batch.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.kernels.logprob import soft_cap
from megatron_rl.models.attention import softmax_with_sinks
from megatron_rl.types import TrainBatch

logger = logging.getLogger(__name__)


def row_extents(batch: TrainBatch) -> torch.Tensor:
    """[B] int64: the input tokens each row needs, its last loss position (the log-prob of token p is read
    from the hidden state of token p - 1); 0 for a row without loss positions."""
    loss = batch.loss_positions()
    width = loss.shape[1]
    last = width - 1 - loss.flip(1).float().argmax(dim=1)
    return torch.where(loss.any(dim=1), last, torch.zeros_like(last)).long()


@dataclasses.dataclass
class PackedMicroBatch:
    """One micro-batch's rows as a single packed row of T tokens (a padding document at the end, if any)."""

    inputs: torch.Tensor
    """[1, T] int64 input token ids."""
    positions: torch.Tensor
    """[1, T] int64 positions, restarting at 0 at each document."""
    source: torch.Tensor
    """[T] int64: the flat index (row * columns + column) of each packed token in the unpacked [rows, columns]
    inputs, -1 for the padding document."""
    params: PackedSeqParams
    """Megatron's THD parameters: cu_seqlens over the documents (the padding document included)."""
    rows: int
    columns: int
    """The unpacked micro-batch's shape ([rows, columns] inputs: its tokens minus the last column)."""

    @property
    def length(self) -> int:
        return self.inputs.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """[1, T] bool: tokens of real rows (not the padding document)."""
        return (self.source >= 0).unsqueeze(0)

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, T, H] packed final hidden states -> [rows, columns, H], zero at columns no row needed
        (differentiable: the gradient of the zeros goes nowhere)."""
        flat = torch.cat([hidden[0], hidden.new_zeros(1, hidden.shape[-1])])
        where = torch.full((self.rows * self.columns,), flat.shape[0] - 1, dtype=torch.long, device=hidden.device)
        real = self.source >= 0
        where[self.source[real]] = torch.arange(self.length, device=hidden.device)[real]
        return flat[where].view(self.rows, self.columns, hidden.shape[-1])

    def pack(self, per_position: torch.Tensor, fill) -> torch.Tensor:
        """[rows, >= columns, ...] per-input-position values (e.g. a routing record) -> [1, T, ...], `fill`
        on the padding document."""
        flat = per_position[:, :self.columns].reshape(self.rows * self.columns, *per_position.shape[2:])
        out = flat.new_full((self.length, *per_position.shape[2:]), fill)
        source = self.source.to(flat.device)
        real = source >= 0
        out[real] = flat[source[real]]
        return out.unsqueeze(0)


def pack_micro_batch(mb: TrainBatch, *, multiple: int = 1, length: int | None = None,
                     device: torch.device | str = "cpu") -> PackedMicroBatch:
    """Pack `mb`'s rows, each up to its `row_extents`, in row order. The packed row is padded with one
    padding document to a multiple of `multiple` tokens (sequence parallelism splits it over TP; FP8 GEMMs
    need aligned token counts), or to exactly `length` tokens (pipeline stages exchange one fixed shape)."""
    extents = row_extents(mb).tolist()
    columns = mb.seq_length - 1
    total = sum(extents)
    if length is None:
        length = max(-(-total // multiple) * multiple, multiple)
    elif total > length:
        raise ValueError(f"a micro-batch of {total} tokens does not fit the fixed packed length {length} (with "
                         f"pipeline parallelism every row must fit trainer.max_tokens_per_micro_batch)")
    inputs = mb.tokens[:, :-1]
    pieces, positions, sources, bounds = [], [], [], [0]
    for row, extent in enumerate(extents):
        if extent:
            pieces.append(inputs[row, :extent])
            positions.append(torch.arange(extent))
            sources.append(row * columns + torch.arange(extent))
            bounds.append(bounds[-1] + extent)
    if length > total:  # the padding document: token 0, attending only to itself
        pieces.append(inputs.new_zeros(length - total))
        positions.append(torch.arange(length - total))
        sources.append(torch.full((length - total,), -1, dtype=torch.long))
        bounds.append(length)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return PackedMicroBatch(inputs=torch.cat(pieces).unsqueeze(0).to(device),
                            positions=torch.cat(positions).unsqueeze(0).to(device),
                            source=torch.cat(sources).to(device), params=params, rows=mb.batch_size, columns=columns)


def causal_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool, True where query i may attend key j: j in (i - window, i], transformers'
    sliding-window causal mask (the last `window` positions, the query's own included)."""
    offset = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return (offset >= 0) & (offset < window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                     window: int | None = None, dropout_p: float = 0.0, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA over [b, heads, s, d] q and [b, groups, s, d] k / v (GQA in the kernel), within a
    sliding `window` when one is given and the sequence is longer than it (a banded mask; no mask otherwise).
    `softcap` (Gemma 2): the scaled scores pass through softcap * tanh(score / softcap) before the mask; `sinks`
    [heads] (GPT-OSS): each head's softmax gets one more column, its sink logit, whose share is dropped. No fused
    kernel takes either: the scores are materialised, the softmax in fp32 (transformers' eager attention)."""
    length = q.shape[2]
    if softcap is not None or sinks is not None:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        allowed = causal_window_mask(length, window or length, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = (torch.softmax(scores, dim=-1, dtype=torch.float32) if sinks is None
                 else softmax_with_sinks(scores, sinks.view(-1, 1, 1), dtype=torch.float32)).to(q.dtype)
        return torch.matmul(F.dropout(probs, p=dropout_p), v)
    mask = None if window is None or length <= window else causal_window_mask(length, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1])


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            *, scale: float | None, window: int | None = None, dropout_p: float = 0.0,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (within a sliding `window` if given) inside each document of packed [T, heads, d] q
    and [T, groups, d] k / v (GQA), one fused SDPA call per document: the cost of each document's own
    length, no [T, T] mask. Returns [T, heads * d]."""
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = causal_attention(q, k, v, scale=scale, window=window, dropout_p=dropout_p, softcap=softcap,
                               sinks=sinks)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs).reshape(query.shape[0], -1)


def token_budget_micro_batches(batch: TrainBatch, max_tokens: int) -> tuple[list[TrainBatch], torch.Tensor]:
    """`batch`'s rows in micro-batches of at most `max_tokens` packed input tokens (first-fit decreasing
    over `row_extents`); a row longer than the budget gets a micro-batch of its own. Each micro-batch is
    trimmed after its last loss column. At least one micro-batch (a batch of empty rows gives one). Returns
    the micro-batches and the batch's row index of each of their rows, in order."""
    extents = row_extents(batch).tolist()
    order = sorted(range(len(extents)), key=lambda r: -extents[r])
    bins: list[list[int]] = []
    loads: list[int] = []
    oversized = 0
    for row in order:
        extent = extents[row]
        oversized += extent > max_tokens
        for i, load in enumerate(loads):
            if load + extent <= max_tokens:
                bins[i].append(row)
                loads[i] += extent
                break
        else:
            bins.append([row])
            loads.append(extent)
    if oversized:
        logger.warning("%d row(s) longer than trainer.max_tokens_per_micro_batch=%d (longest %d tokens) "
                       "each took a micro-batch of their own", oversized, max_tokens, max(extents))
    bins = [sorted(rows) for rows in bins] or [list(range(batch.batch_size))]
    order = torch.tensor([row for rows in bins for row in rows], dtype=torch.long)
    return [batch.select(torch.tensor(rows, dtype=torch.long)).trimmed() for rows in bins], order


def balanced_rows(batch: TrainBatch, parts: int) -> list[torch.Tensor]:
    """Row indices of `batch` split into `parts` shares of near-equal token counts (`row_extents`; longest
    row first to the share with the fewest tokens so far), each in the batch's row order. For data-parallel
    ranks that fill micro-batches by tokens: equal tokens, not equal rows."""
    extents = row_extents(batch).tolist()
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    counts = [0] * parts
    for row in sorted(range(len(extents)), key=lambda r: -extents[r]):
        # fewest tokens first; among equals the fewest rows, so empty rows spread too
        target = min(range(parts), key=lambda i: (loads[i], counts[i]))
        shares[target].append(row)
        loads[target] += extents[row]
        counts[target] += 1
    return [torch.tensor(sorted(share), dtype=torch.long) for share in shares]
