"""The native engine's per-slot KV cache.

Two tensors [layers, slots, kv_heads, max_len, head_dim] (multi-latent attention: `k` [layers, slots, 1, max_len,
kv_lora_rank + qk_rope_head_dim] holds each token's latent and rotary key, `v` is empty), allocated on first use
with torch.empty so that only the pages sequences touch get committed (in base pages, a block of positions ahead
at a time),
given back slot by slot when a slot frees and no request waits for it (`return_pages`), and freed whole
when the engine goes idle for a colocated trainer (`NativeEngine.release_memory_occupation`,
`flush_cache`). A running sequence owns one slot; the scheduler keeps slots in use dense at
[0, n_running) by moving the last sequence into a freed slot (`copy_prefix`), so the decode rows' cache
is a strided view, not a gather.

Decode attention reads positions [0, t_max) of every decode slot, so none of them may hold
uninitialised memory: `written[slot]` counts the leading positions known to be finite (K/V computed,
copied or zero-filled), and `cover_decode` zero-fills past it before a decode step reads there.

Sliding-window layers (`ModelArch.layer_window`) never read a key older than the window again, so on a
Linux CPU `drop_behind` gives those positions' pages back as a sequence moves on (`dropped[slot]`: the
positions before it hold zeros in the windowed layers): a windowed layer's committed cache is about one
window per sequence, whatever its length, while full-attention layers keep every position. A windowed
prefix is copied only from the window before its end (`copy_prefix`), and only from a slot that still
holds it (`holds_window_before`).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
from typing import Any, Sequence

import torch

from megatron_rl.models.arch import ModelArch


MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
ZERO_FILL_POSITIONS = 256  # decode positions made finite ahead of need: pages are committed as a sequence grows
DROP_POSITIONS = 64  # out-of-window positions released at a time (fewer madvise calls)


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
        self.windowed = arch.windowed_layers
        self.full_layers = tuple(i for i in range(arch.num_layers) if i not in self.windowed)
        self.window = arch.sliding_window if self.windowed else None
        self.drops = self.window is not None and device.type == "cpu" and sys.platform.startswith("linux")
        """Windowed layers give pages back as sequences move on (a Linux CPU cache)."""
        self.unit = 1
        """Positions per release unit: every (layer, slot, head) block starts on a page and a unit of positions
        fills whole pages (with `drops`), so releases and zero-fills never share a page with kept positions."""
        if self.drops:
            row = arch.head_dim * torch.empty((), dtype=dtype).element_size()
            page = _libc_and_page()[1]
            self.unit = math.lcm(row, page) // row
            max_len = -(-max_len // self.unit) * self.unit
        self.max_len = max_len
        if arch.is_mla:  # one latent + rotary key per token and layer in `k`; the values are its first kv_lora_rank
            self.shape = (arch.num_layers, slots, 1, max_len, arch.kv_lora_rank + arch.qk_rope_head_dim)
            self.v_shape = (arch.num_layers, slots, 1, max_len, 0)
        else:
            self.shape = self.v_shape = (arch.num_layers, slots, arch.num_query_groups, max_len, arch.head_dim)
        self.device, self.dtype = device, dtype
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.written: list[int] = [0] * slots
        self.dropped: list[int] = [0] * slots
        """Positions [0, dropped) of the slot's windowed layers are released (read as zeros); a multiple of
        `unit`."""

    @classmethod
    def scratch(cls, arch: ModelArch, length: int, device: torch.device, dtype: torch.dtype) -> "KVCache":
        """A zeroed one-slot cache of `length` positions, apart from the engine's (forward_logits)."""
        cache = cls(arch, 1, length, device, dtype)
        cache.k = torch.zeros(cache.shape, device=device, dtype=dtype)
        cache.v = torch.zeros(cache.v_shape, device=device, dtype=dtype)
        return cache

    @property
    def allocated(self) -> bool:
        return self.k is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else (self.k.numel() + self.v.numel()) * self.k.element_size()

    def ensure(self) -> None:
        if self.k is None:
            # torch.empty: untouched pages of this (mostly unused) buffer are never committed; and in base
            # pages, also where torch's allocator asks for transparent huge pages (THP_MEM_ALLOC_ENABLE, good
            # for the weights): a 2 MiB page would commit a whole (layer, slot, head) block on its first token.
            self.k, self.v = self._empty(self.shape), self._empty(self.v_shape)
            self.written = [0] * self.slots
            self.dropped = [0] * self.slots

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.drops:
            return without_huge_pages(torch.empty(shape, device=self.device, dtype=self.dtype))
        # page-aligned start, so that each block's pages hold its positions only
        numel = math.prod(shape)
        per_page = _libc_and_page()[1] // torch.empty((), dtype=self.dtype).element_size()
        flat = without_huge_pages(torch.empty(numel + per_page, device=self.device, dtype=self.dtype))
        skip = (-flat.data_ptr() // flat.element_size()) % per_page
        return flat[skip:skip + numel].view(shape)

    def free(self) -> int:
        """Drop both tensors (re-allocated by the next `ensure`); returns the bytes given back."""
        freed = self.nbytes
        self.k = self.v = None
        self.written = [0] * self.slots
        self.dropped = [0] * self.slots
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
            self.dropped[slot] = 0

    def copy_prefix(self, dst: int, src: int, length: int) -> None:
        """K/V positions [0, length) of slot `src` into slot `dst` (a shared prompt prefix, or a
        sequence moving into a freed slot), so that `dst` can go on at position `length`. Windowed layers
        (when their pages are given back) copy only the window before `length`, which `src` must still hold
        (`holds_window_before`); their earlier positions in `dst` are released."""
        if not self.drops:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
            self.written[dst] = max(self.written[dst], length)
            return
        first = self._kept_from(length)
        if self.dropped[src] > first:
            raise RuntimeError(f"KV cache slot {src} no longer holds positions [{first}, {length}) of its windowed "
                               f"layers (released before {self.dropped[src]})")
        for tensor in (self.k, self.v):
            if self.full_layers:
                rows = torch.tensor(self.full_layers, device=tensor.device)
                tensor[:, dst, :, :length].index_copy_(0, rows, tensor[:, src, :, :length].index_select(0, rows))
            for layer in self.windowed:
                tensor[layer, dst, :, first:length] = tensor[layer, src, :, first:length]
        self.written[dst] = max(self.written[dst], length)
        self._release_windowed(dst, 0, first)
        self.dropped[dst] = first

    def _kept_from(self, position: int) -> int:
        """The first position (a whole unit) that a query at `position` may read in a windowed layer."""
        return max(0, position - self.window + 1) // self.unit * self.unit

    def holds_window_before(self, slot: int, length: int) -> bool:
        """`slot` still holds what `copy_prefix(..., slot, length)` reads."""
        return not self.drops or self.dropped[slot] <= self._kept_from(length)

    def drop_behind(self, slot: int, next_position: int) -> None:
        """The sequence in `slot` goes on at `next_position`: give back the pages of windowed-layer positions
        no query from there on reads, DROP_POSITIONS or more at a time (whole units)."""
        if not self.drops:
            return
        first = self._kept_from(next_position)
        if first - self.dropped[slot] >= max(DROP_POSITIONS, self.unit):
            self._release_windowed(slot, self.dropped[slot], first)
            self.dropped[slot] = first

    def _release_windowed(self, slot: int, start: int, end: int) -> None:
        """Positions [start, end) (whole units) of the windowed layers in `slot` read as zeros from now on:
        their pages given back (MADV_DONTNEED)."""
        if end <= start:
            return
        for tensor in (self.k, self.v):
            for layer in self.windowed:
                for head in range(self.shape[2]):
                    block = tensor[layer, slot, head]
                    _advise(block[start].data_ptr(), block[end - 1].data_ptr() + block.stride(0) * block.element_size(),
                            MADV_DONTNEED)

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
                if self.drops:  # windowed layers: released, not zeroed (a shorter sequence in the batch
                    # then holds no pages up to the longest one's length); zeroed up to the next whole unit
                    horizon = min(self.max_len, -(-horizon // self.unit) * self.unit)
                    aligned = min(horizon, -(-written[slot] // self.unit) * self.unit)
                    for tensor in (self.k, self.v):
                        for layer in self.full_layers:
                            tensor[layer, slot, :, written[slot]:horizon] = 0
                        for layer in self.windowed:
                            tensor[layer, slot, :, written[slot]:aligned] = 0
                    self._release_windowed(slot, aligned, horizon)
                else:
                    self.k[:, slot, :, written[slot]:horizon] = 0
                    self.v[:, slot, :, written[slot]:horizon] = 0
                written[slot] = horizon
