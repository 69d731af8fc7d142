"""Triton strided block copy used by `reshard.py`: many rectangular segments of one 2-D source tensor
into one 2-D destination tensor in a single launch.

A segment table row is (src_row, src_col, dst_row, dst_col, n_rows, n_cols) (int64); the grid is
(segments, row tiles of the tallest segment, column tiles of the widest); tiles past a segment's
extent return at once. Both tensors need unit column stride; dtype is preserved bit for bit
(load + store, no arithmetic). Triton is optional: `AVAILABLE` is False when it does not import.
"""
from __future__ import annotations

import torch

from megatron_rl.kernels._triton import AVAILABLE, check_device, tl, triton

BLOCK_R = 16
BLOCK_C = 256

if AVAILABLE:

    @triton.jit
    def _segment_copy_kernel(src_ptr, dst_ptr, seg_ptr, src_stride, dst_stride,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        seg = seg_ptr + tl.program_id(0).to(tl.int64) * 6
        n_rows = tl.load(seg + 4)
        n_cols = tl.load(seg + 5)
        r0 = tl.program_id(1).to(tl.int64) * BLOCK_R
        c0 = tl.program_id(2).to(tl.int64) * BLOCK_C
        if (r0 < n_rows) & (c0 < n_cols):
            rows = r0 + tl.arange(0, BLOCK_R)
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            src = src_ptr + (tl.load(seg) + rows)[:, None] * src_stride + (tl.load(seg + 1) + cols)[None, :]
            dst = dst_ptr + (tl.load(seg + 2) + rows)[:, None] * dst_stride + (tl.load(seg + 3) + cols)[None, :]
            tl.store(dst, tl.load(src, mask=mask), mask=mask)


def segment_copy(src: torch.Tensor, dst: torch.Tensor, segments: torch.Tensor, max_rows: int, max_cols: int) -> None:
    """Copy every segment of `segments` ([S, 6] int64 on src's device) from 2-D src into 2-D dst."""
    if src.dtype != dst.dtype:
        raise ValueError(f"segment_copy needs equal dtypes, got {src.dtype} -> {dst.dtype}")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("segment_copy needs unit column stride on both tensors")
    if segments.shape[0] == 0:
        return
    check_device(dst)
    grid = (segments.shape[0], triton.cdiv(max_rows, BLOCK_R), triton.cdiv(max_cols, BLOCK_C))
    _segment_copy_kernel[grid](src, dst, segments, src.stride(0), dst.stride(0), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
