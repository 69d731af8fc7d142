"""FP8 weights for inference engines: block-wise quantization on the weight-sync path.

LlamaRL runs its generators in fp8 while the trainer keeps bf16 weights (docs/algorithms.md section 3);
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

import argparse
import glob
import json
import os
import shutil
import sys
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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
    return dict(iter_quantized(named, block))


def iter_quantized(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], block: int = 128
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`quantize_state` one tensor at a time, for weights streamed bucket by bucket (never all held)."""
    items = named.items() if isinstance(named, Mapping) else named
    for name, tensor in items:
        if is_quantized_weight(name, tensor):
            q, scale_inv = quantize_blockwise(tensor, block)
            yield name, q
            yield name + "_scale_inv", scale_inv
        else:
            yield name, tensor


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


def generator_weights(state, generator):
    """The trainer's HF-named weights as the generator group (`cluster.generator`) runs them: rounded
    through block-wise fp8 when its precision is fp8 (LlamaRL's fp8 generators), else unchanged. SGLang
    engines run real fp8 GEMMs and quantize themselves."""
    if generator.precision != "fp8" or generator.backend != "native":
        return state
    return fake_quantize_state(state, generator.fp8_block_size)


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


def write_fp8_checkpoint(src: str, out: str, block: int = 128) -> str:
    """Copy an HF directory with its layer projections in block fp8 (+ `weight_scale_inv`) and
    `quantization_config` {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size":
    [block, block]} in config.json: the block-quantized layout SGLang loads natively, whose parameters
    `quantize_state` then refreshes on every sync. Streams one safetensors file at a time (a 405B model
    never sits in memory whole); other files (tokenizer, generation config) are copied as they are."""

    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    if not os.path.isfile(os.path.join(src, "config.json")) or not files:
        raise FileNotFoundError(f"{src}: expected an HF directory with config.json and *.safetensors")
    os.makedirs(out, exist_ok=True)
    weight_map = {}
    for path in files:
        name = os.path.basename(path)
        with safe_open(path, framework="pt") as f:
            tensors = quantize_state(((key, f.get_tensor(key)) for key in f.keys()), block)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [block, block]}
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    for path in glob.glob(os.path.join(src, "*")):
        base = os.path.basename(path)
        if os.path.isfile(path) and not base.endswith(".safetensors") and base not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, os.path.join(out, base))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_rl.weight_sync.fp8 SRC_HF_DIR OUT_DIR [--block 128]`: the fp8 engines' checkpoint."""
    parser = argparse.ArgumentParser(description="write a block-fp8 copy of an HF checkpoint for fp8 engines")
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--block", type=int, default=128)
    args = parser.parse_args(argv)
    # This module's command-line output (a script's stdout, not a log line): the directory written
    sys.stdout.write(write_fp8_checkpoint(args.src, args.out, args.block) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
