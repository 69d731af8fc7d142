"""The native engine's per-slot KV cache.

Two tensors [layers, slots, kv_heads, max_len, head_dim], allocated on first use with torch.empty so
that only the pages sequences touch get committed, and freed whole when the engine goes idle for a
colocated trainer (`NativeEngine.release_memory_occupation`, `flush_cache`). A running sequence owns
one slot; the scheduler keeps slots in use dense at [0, n_running) by moving the last sequence into
a freed slot (`copy_prefix`), so the decode rows' cache is a strided view, not a gather.

Decode attention reads positions [0, t_max) of every decode slot, so none of them may hold
uninitialised memory: `written[slot]` counts the leading positions known to be finite (K/V computed,
copied or zero-filled), and `cover_decode` zero-fills past it before a decode step reads there.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_rl.models.arch import ModelArch


class KVCache:
    """K and V of every slot (`k`, `v`: None until `ensure`), with the per-slot `written` lengths.
    Not thread-safe: the engine touches it only under its model lock."""

    def __init__(self, arch: ModelArch, slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        self.slots = slots
        self.max_len = max_len
        self.shape = (arch.num_layers, slots, arch.num_query_groups, max_len, arch.head_dim)
        self.device, self.dtype = device, dtype
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.written: list[int] = [0] * slots

    @classmethod
    def scratch(cls, arch: ModelArch, length: int, device: torch.device, dtype: torch.dtype) -> "KVCache":
        """A zeroed one-slot cache of `length` positions, apart from the engine's (forward_logits)."""
        cache = cls(arch, 1, length, device, dtype)
        cache.k = torch.zeros(cache.shape, device=device, dtype=dtype)
        cache.v = torch.zeros_like(cache.k)
        return cache

    @property
    def allocated(self) -> bool:
        return self.k is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def ensure(self) -> None:
        if self.k is None:
            # torch.empty: untouched pages of this (mostly unused) buffer are never committed.
            self.k = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            self.v = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            self.written = [0] * self.slots

    def free(self) -> int:
        """Drop both tensors (re-allocated by the next `ensure`); returns the bytes given back."""
        freed = self.nbytes
        self.k = self.v = None
        self.written = [0] * self.slots
        return freed

    def copy_prefix(self, dst: int, src: int, length: int) -> None:
        """K/V positions [0, length) of slot `src` into slot `dst` (a shared prompt prefix, or a
        sequence moving into a freed slot)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.written[dst] = max(self.written[dst], length)

    def mark_written(self, slot: int, end: int) -> None:
        """The forward wrote K/V of positions up to `end` in `slot`."""
        self.written[slot] = max(self.written[slot], end)

    def cover_decode(self, decode: Sequence[Any], t_max: int) -> None:
        """Make positions [0, t_max) of each decode sequence's slot finite (stale values of earlier
        sequences are finite and masked out). `decode`: sequences with `slot`, `prompt` and
        `params.max_new_tokens`. Zero-fills in bulk up to the longest the sequence can get, so its
        pages are committed once here rather than faulted in one by one as decoding advances."""
        written = self.written
        for seq in decode:
            slot = seq.slot
            if written[slot] < t_max:
                horizon = max(t_max, min(self.max_len, len(seq.prompt) + seq.params.max_new_tokens))
                self.k[:, slot, :, written[slot]:horizon] = 0
                self.v[:, slot, :, written[slot]:horizon] = 0
                written[slot] = horizon
