"""LoRA adapters in the native engine: a low-rank path beside the frozen base weights (`rollout.weight_sync:
adapters`, docs/lora.md).

A weight sync then carries only the adapters (PEFT's names and layout, what `trainer.gather_peft_state` and
`convert --to peft` produce) and the engine keeps its base weights untouched: each adapted projection computes
y = x W^T + scaling * (x A^T) B^T, the order of operations the trainer's adapter uses, so the engine's policy is
the trainer's up to the rounding of two separate sums (no merged copy of the model, no per-sync rewrite of it).
The engine fuses q/k/v and gate/up into one matrix each; their PEFT adapters are fused the same way: one A when
the projections share it (adapters trained here do), else the A's stacked and the B's placed block-diagonally, so
every fused projection is still two small matmuls. A projection PEFT leaves out gets a zero block.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch

_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_SLOT_OF = {projection: slot for slot, projections in _FUSED.items() for projection in projections}


def _rows(arch: ModelArch, projection: str) -> tuple[int, int]:
    """(output rows, input columns) of an HF projection."""
    h, q, kv, f = arch.hidden_size, arch.q_size, arch.kv_size, arch.ffn_hidden_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[projection]


class EngineAdapters:
    """The adapters of every layer's fused projections: `get(layer, slot)` -> (A [r', in], B [out, r']) or None."""

    def __init__(self, arch: ModelArch, named: dict[str, torch.Tensor], *, scaling: float, device: torch.device,
                 dtype: torch.dtype):
        if not scaling > 0:
            raise ConfigError(f"LoRA scaling (alpha / rank) must be positive, got {scaling}")
        self.scaling = float(scaling)
        if arch.is_mla and named:
            raise ConfigError("adapter-only sync to a multi-latent attention model is not implemented (its attention "
                              "projections differ): use rollout.weight_sync full")
        parts: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}
        for name, tensor in named.items():
            match = _NAME.match(name)
            if match is None or match.group(3) not in _SLOT_OF:
                raise ConfigError(f"adapter tensor '{name}' is not a LoRA factor of a decoder projection "
                                  "(expected PEFT names like model.layers.0.self_attn.q_proj.lora_A.weight)")
            layer, projection, factor = int(match.group(1)), match.group(3), match.group(4)
            if layer >= arch.num_layers:
                raise ConfigError(f"adapter tensor '{name}': layer {layer} is beyond the model's {arch.num_layers}")
            if projection in ("gate_proj", "up_proj", "down_proj") and arch.layer_is_moe(layer):
                raise ConfigError(f"adapter tensor '{name}': layer {layer}'s MLP is a mixture of experts "
                                  "(adapters on experts are synced merged: rollout.weight_sync full)")
            parts.setdefault((layer, _SLOT_OF[projection]), {}).setdefault(projection, {})[factor] = tensor
        self._fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, slot), projections in parts.items():
            self._fused[(layer, slot)] = self._fuse(arch, layer, slot, projections, device, dtype)

    @staticmethod
    def _fuse(arch: ModelArch, layer: int, slot: str, projections: dict[str, dict[str, torch.Tensor]],
              device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        a_list, b_list = [], []
        for projection in _FUSED[slot]:
            out_rows, in_cols = _rows(arch, projection)
            factors = projections.get(projection)
            if factors is None:
                a_list.append(None)
                b_list.append(out_rows)
                continue
            where = f"adapter of model.layers.{layer}.{projection}"
            if set(factors) != {"A", "B"}:
                raise ConfigError(f"{where}: needs both lora_A and lora_B, got {sorted(factors)}")
            a, b = factors["A"], factors["B"]
            if a.dim() != 2 or a.shape[1] != in_cols or b.dim() != 2 or b.shape != (out_rows, a.shape[0]):
                raise ConfigError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                                  f"projection [{out_rows}, {in_cols}] (A [r, {in_cols}], B [{out_rows}, r])")
            a_list.append(a)
            b_list.append(b)
        present = [a for a in a_list if a is not None]
        if all(torch.equal(a, present[0]) for a in present):  # one A for the fused projection (trained here)
            lora_a = present[0]
            lora_b = torch.cat([b if isinstance(b, torch.Tensor) else present[0].new_zeros(b, present[0].shape[0])
                                for b in b_list])
        else:  # separate A's: stacked, each B in its own block of columns
            lora_a = torch.cat(present)
            rank_total = lora_a.shape[0]
            blocks, column = [], 0
            for a, b in zip(a_list, b_list):
                if a is None:
                    blocks.append(lora_a.new_zeros(b, rank_total))
                    continue
                block = lora_a.new_zeros(b.shape[0], rank_total)
                block[:, column:column + a.shape[0]] = b
                blocks.append(block)
                column += a.shape[0]
            lora_b = torch.cat(blocks)
        return lora_a.to(device=device, dtype=dtype).contiguous(), lora_b.to(device=device, dtype=dtype).contiguous()

    def get(self, layer: int, slot: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._fused.get((layer, slot))

    def apply(self, layer: int, slot: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus the adapter's low-rank path, if the projection has one."""
        factors = self._fused.get((layer, slot))
        if factors is None:
            return y
        lora_a, lora_b = factors
        return y + F.linear(F.linear(x, lora_a), lora_b) * self.scaling

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._fused.values() for t in pair)
