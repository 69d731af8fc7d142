"""FP8 weights for inference engines: block-wise quantization on the weight-sync path.

LlamaRL runs its generators in fp8 while the trainer keeps bf16 weights (ALGORITHMS.md section 1);
every weight sync therefore quantizes. The format is the one SGLang (and DeepSeek-V3 checkpoints) use
for block-quantized linear layers: `W ~= q.float() * scale_inv` with `q` in float8_e4m3fn and one fp32
`weight_scale_inv` per `block x block` tile (scale_inv = amax(|tile|) / 448, the largest e4m3 value),
so an outlier only coarsens its own tile. Edge tiles of shapes that are not multiples of the block are
partial. Only the projection matrices of the transformer layers are quantized; embeddings, the output
layer and norms stay in their training precision (as fp8 inference engines keep them).

The behaviour log-probs an fp8 engine returns then differ from the trainer's: that gap is part of what
AIPO's importance weight corrects, and `train/logprob_mismatch` reports it every step. On engines that
cannot run fp8 GEMMs (the native CPU engine) `fake_quantize_state` hands them the dequantized weights,
which reproduces the fp8 model's numbers up to the GEMM's accumulation order.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
QUANTIZED_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                      "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """Layer projection matrices are quantized; embeddings, lm_head and norms are not."""
    return tensor.dim() == 2 and name.endswith(QUANTIZED_SUFFIXES)


def _tiles(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """[out, in] -> [out_blocks, block, in_blocks, block] (zero-padded at the edges)."""
    rows, cols = weight.shape
    out_blocks, in_blocks = -(-rows // block), -(-cols // block)
    padded = weight.new_zeros(out_blocks * block, in_blocks * block)
    padded[:rows, :cols] = weight
    return padded.view(out_blocks, block, in_blocks, block), rows, cols


def quantize_blockwise(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weights [out, in] and fp32 scale_inv [ceil(out/block), ceil(in/block)] of a 2-D weight."""
    if weight.dim() != 2:
        raise ValueError(f"block-wise fp8 quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    tiles, rows, cols = _tiles(weight.detach().float(), block)
    amax = tiles.abs().amax(dim=(1, 3))  # [out_blocks, in_blocks]
    # An all-zero tile gets scale 1 (any scale represents it exactly) instead of 0 (division by zero).
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = tiles / scale_inv[:, None, :, None]
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(tiles.shape[0] * block, tiles.shape[2] * block)[:rows, :cols].contiguous()
    return q, scale_inv


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights an fp8 engine computes with: q * scale_inv, tile by tile."""
    rows, cols = q.shape
    tiles, _, _ = _tiles(q.float(), block)
    return (tiles * scale_inv.float()[:, None, :, None]).view(tiles.shape[0] * block, -1)[:rows, :cols].to(dtype)


def quantize_state(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], block: int = 128
                   ) -> dict[str, torch.Tensor]:
    """HF-named weights for an fp8 engine: `X.weight` (float8_e4m3fn) + `X.weight_scale_inv` (fp32) for
    each layer projection; other tensors unchanged (SGLang's block-quantized checkpoint naming)."""
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if is_quantized_weight(name, tensor):
            q, scale_inv = quantize_blockwise(tensor, block)
            out[name] = q
            out[name + "_scale_inv"] = scale_inv
        else:
            out[name] = tensor
    return out


def fake_quantize_state(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], block: int = 128
                        ) -> dict[str, torch.Tensor]:
    """Same names and dtypes as the input, values rounded through block fp8 (for engines without fp8 GEMMs)."""
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if is_quantized_weight(name, tensor):
            q, scale_inv = quantize_blockwise(tensor, block)
            out[name] = dequantize_blockwise(q, scale_inv, block, dtype=tensor.dtype)
        else:
            out[name] = tensor
    return out


def quantization_error(named: Mapping[str, torch.Tensor], block: int = 128) -> dict[str, float]:
    """Relative Frobenius error ||W - deq(q(W))|| / ||W|| over the quantized tensors (for reports)."""
    num = den = 0.0
    for name, tensor in named.items():
        if is_quantized_weight(name, tensor):
            w = tensor.detach().float()
            err = w - dequantize_blockwise(*quantize_blockwise(w, block), block)
            num += float(err.pow(2).sum())
            den += float(w.pow(2).sum())
    return {"weight_sync/fp8_rel_error": (num / den) ** 0.5 if den else 0.0}
