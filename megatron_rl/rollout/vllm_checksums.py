"""Read-back of the weights a vLLM server holds: vLLM's `/weight_checker` (`checksum`: SHA-256 of every
parameter's bytes as each worker holds it, keyed `dp{i}:pp{j}:pcp{k}:tp{l}:<name>`) against the digests of the
tensors this process sent, laid out as vLLM holds them (`ParameterDigests`).

The layout of a worker at TP 1 (vLLM 0.32's Llama-style models): q / k / v rows fused into `qkv_proj`, gate / up
rows into `gate_up_proj` (weights and biases), embedding and output rows padded to a multiple of 64 with zeros
(VocabParallelEmbedding), every other tensor under its HF name, in the server's dtype. Parameters whose
layout differs (experts, TP shards) are not compared, and neither are those a build keeps outside the
parameter: vLLM's CPU build hands each linear weight to a oneDNN kernel and leaves an empty tensor behind, so
there only embeddings and norms can be read back.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator

import torch

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # a parameter whose bytes the worker no longer holds
_FUSED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
          "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}
_PADDED = ("model.embed_tokens.weight", "lm_head.weight")


def digest(tensor: torch.Tensor) -> str:
    """vLLM's digest of one parameter (model_loader/weight_checksum.py): SHA-256 of its contiguous bytes."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class ParameterDigests:
    """The digests of HF-named tensors as a TP-1 vLLM worker holds them, gathered while they stream past
    (`observe`); parts of a fused parameter wait until all of them have passed."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype  # the server's weight dtype (None: as sent)
        self.digests: dict[str, str] = {}
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def observe(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            self._add(name, tensor)
            yield name, tensor

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu", self.dtype or tensor.dtype)
        prefix, _, leaf = name.rpartition(".")  # leaf: weight / bias
        module_path, _, module = prefix.rpartition(".")
        if module in _FUSED:
            fused, index, parts = _FUSED[module]
            key = f"{module_path}.{fused}.{leaf}"
            held = self._parts.setdefault(key, {})
            held[index] = tensor.clone()
            if len(held) == parts:
                self.digests[key] = digest(torch.cat([held[i] for i in range(parts)]))
                del self._parts[key]
            return
        if name in _PADDED and tensor.shape[0] % VOCAB_PADDING:
            rows = -tensor.shape[0] % VOCAB_PADDING
            tensor = torch.cat([tensor, tensor.new_zeros(rows, *tensor.shape[1:])])
        self.digests[name] = digest(tensor)

    def compare(self, checksums: dict[str, str]) -> dict[str, Any]:
        """Against `/weight_checker`'s checksums of a TP-1 server: the parameters it holds that were compared,
        those that differ, and those it cannot show (empty) or whose layout is not modelled here."""
        held = {key.rpartition(":")[2]: value for key, value in checksums.items()}
        if len({key.rpartition(":")[0] for key in checksums}) > 1:  # several workers: each holds its shards
            return {"compared": 0, "mismatched": [], "not_compared": sorted(held)}
        compared = [n for n in held if n in self.digests and held[n] != EMPTY_DIGEST]
        return {"compared": len(compared), "mismatched": sorted(n for n in compared if held[n] != self.digests[n]),
                "not_compared": sorted(n for n in held if n not in compared)}
