"""The native engine's per-slot KV cache.

Two tensors [layers, slots, kv_heads, max_len, head_dim], allocated on first use with torch.empty so
that only the pages sequences touch get committed (in base pages, a block of positions ahead at a time),
given back slot by slot when a slot frees and no request waits for it (`return_pages`), and freed whole
when the engine goes idle for a colocated trainer (`NativeEngine.release_memory_occupation`,
`flush_cache`). A running sequence owns one slot; the scheduler keeps slots in use dense at
[0, n_running) by moving the last sequence into a freed slot (`copy_prefix`), so the decode rows' cache
is a strided view, not a gather.

Decode attention reads positions [0, t_max) of every decode slot, so none of them may hold
uninitialised memory: `written[slot]` counts the leading positions known to be finite (K/V computed,
copied or zero-filled), and `cover_decode` zero-fills past it before a decode step reads there.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Sequence

import torch

from megatron_rl.models.arch import ModelArch


MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
ZERO_FILL_POSITIONS = 256  # decode positions made finite ahead of need: pages are committed as a sequence grows


@functools.cache
def _libc_and_page() -> tuple[ctypes.CDLL, int]:
    return ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")


def _advise(start: int, end: int, advice: int) -> None:
    """madvise over the whole pages within [start, end) (bytes of this process); called per (layer, slot)
    block when slots free, so libc and the page size are looked up once."""
    libc, page = _libc_and_page()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), ctypes.c_int(advice))


def _on_linux_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and sys.platform.startswith("linux") and tensor.numel() > 0


def without_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Ask the kernel to back a CPU tensor's untouched memory with base pages only (madvise
    MADV_NOHUGEPAGE over its page-aligned span), so that its pages are committed as they are first
    written. Elsewhere (other devices, other systems) the tensor is returned as it is."""
    if _on_linux_cpu(tensor):
        start = tensor.data_ptr()
        _advise(start, start + tensor.numel() * tensor.element_size(), MADV_NOHUGEPAGE)
    return tensor


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
            # torch.empty: untouched pages of this (mostly unused) buffer are never committed; and in base
            # pages, also where torch's allocator asks for transparent huge pages (THP_MEM_ALLOC_ENABLE, good
            # for the weights): a 2 MiB page would commit a whole (layer, slot, head) block on its first token.
            self.k = without_huge_pages(torch.empty(self.shape, device=self.device, dtype=self.dtype))
            self.v = without_huge_pages(torch.empty(self.shape, device=self.device, dtype=self.dtype))
            self.written = [0] * self.slots

    def free(self) -> int:
        """Drop both tensors (re-allocated by the next `ensure`); returns the bytes given back."""
        freed = self.nbytes
        self.k = self.v = None
        self.written = [0] * self.slots
        return freed

    def return_pages(self, slots: Sequence[int]) -> None:
        """Give the memory of these free slots back to the system (madvise MADV_DONTNEED: their pages read
        as zeros until written again), so that a load spike does not leave the cache committed. On other
        devices and systems nothing is returned."""
        if self.k is None or not _on_linux_cpu(self.k):
            return
        per_slot = self.k[0, 0].numel() * self.k.element_size()  # one (layer, slot) block: contiguous
        for slot in slots:
            if self.written[slot] == 0:
                continue
            for tensor in (self.k, self.v):
                for layer in range(self.shape[0]):
                    start = tensor[layer, slot].data_ptr()
                    _advise(start, start + per_slot, MADV_DONTNEED)
            self.written[slot] = 0

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
        `params.max_new_tokens`. Zero-fills ZERO_FILL_POSITIONS ahead at a time (never past the longest
        the sequence can get), so that pages are committed as sequences grow, not whole slots at once
        for requests that may use the whole context, nor one position at a time."""
        written = self.written
        for seq in decode:
            slot = seq.slot
            if written[slot] < t_max:
                longest = min(self.max_len, len(seq.prompt) + seq.params.max_new_tokens)
                horizon = max(t_max, min(longest, t_max + ZERO_FILL_POSITIONS))
                self.k[:, slot, :, written[slot]:horizon] = 0
                self.v[:, slot, :, written[slot]:horizon] = 0
                written[slot] = horizon
