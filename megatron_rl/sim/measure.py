"""Measured peak memory of a CPU trainer step, to check the planner's estimate against.

Method: every tensor alive before the step is found through the garbage collector (parameters, the
DDP gradient buffer, optimizer states, Megatron's buffers) and counted once per storage. During the
step a TorchDispatchMode sees every op's outputs; each new storage adds its bytes and a weak-reference
finalizer subtracts them when it is freed, so the running total is the bytes of live tensors and its
maximum is the step's peak. Allocations that are not tensors (oneDNN/MKL scratch, the Python heap) are
not counted: the figure is what torch's CPU allocator hands out for tensors, which is what the planner
models. (RSS deltas include glibc's caching and thread arenas; tracemalloc does not see torch.)
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def live_tensor_storages() -> dict[int, int]:
    """data_ptr -> bytes of every CPU tensor storage reachable from Python now."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - tensor subclasses / fake tensors without storage
            continue
    return storages


class LiveTensorBytes(TorchDispatchMode):
    """Running total and peak of bytes in tensor storages created while the mode is active."""

    def __init__(self, existing: dict[int, int] | None = None):
        super().__init__()
        self._existing = set(existing or ())
        self._seen: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._seen or storage.data_ptr() in self._existing or storage.nbytes() == 0:
                continue
            nbytes = storage.nbytes()
            self._seen[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def measure_peak(step) -> dict[str, float]:
    """Run `step()` and return {"static": bytes alive before, "peak_delta": most bytes added during,
    "peak": their sum}."""
    existing = live_tensor_storages()
    static = float(sum(existing.values()))
    with LiveTensorBytes(existing) as tracker:
        step()
    return {"static": static, "peak_delta": float(tracker.peak), "peak": static + tracker.peak}
