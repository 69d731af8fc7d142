"""Run megatron-core on a CPU-only torch build. Applied only when CUDA is absent; a no-op on GPUs.

megatron-core 0.16 assumes CUDA in a handful of places that have nothing to do with the maths. This
module changes exactly these, and nothing else (tests/test_cpu_compat.py checks each one):

1. `torch.cuda.current_device()` returns the CPU device: Megatron allocates its grad buffers and
   p2p/pipeline tensors on `current_device()`.
2. `torch.cuda.synchronize()` does nothing (CPU ops are synchronous).
3. `Tensor.cuda()` returns the tensor itself.
4. `Tensor.type()` with no argument reports `torch.cuda.<T>Tensor` for CPU tensors: Megatron's mixed
   precision optimizer checks parameter types against the CUDA names.
5. `megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32` is replaced by the same
   scaling without its `torch.cuda.FloatTensor` assertion and the Apex multi-tensor kernel.
6. `torch.cuda.Event` times with `time.perf_counter` (Megatron's timers record CUDA events).
7. Inside `redirect_cuda_to_cpu()` (a `TorchFunctionMode`), `device='cuda'` / `'cuda:N'` in torch
   factory calls and `Tensor.to('cuda')` become the CPU: the optimizer, grad scaler and pipeline
   schedules hard-code `device='cuda'` for small bookkeeping tensors. The trainer enters this mode
   only around its own Megatron calls, so other code in the process (the rollout engine) pays no
   per-op dispatch cost.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import megatron.core.optimizer.clip_grads as clip_grads
import megatron.core.optimizer.optimizer as optimizer
import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def needed() -> bool:
    return not torch.cuda.is_available()


def _is_cuda(device: object) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _WallClockEvent:
    def __init__(self, *args, **kwargs):
        self.t: float | None = None

    def record(self, *args, **kwargs) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *args, **kwargs) -> None:
        pass

    def elapsed_time(self, other: "_WallClockEvent") -> float:
        return (other.t - self.t) * 1000.0


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


_original_type = torch.Tensor.type


def _cuda_named_type(self, *args, **kwargs):
    if not args and not kwargs:
        name = _original_type(self)
        if name.startswith("torch.") and ".cuda." not in name:
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    return _original_type(self, *args, **kwargs)


def apply() -> bool:
    """Install patches 1-6 once per process when CUDA is absent. Returns whether they are active."""
    global _APPLIED
    if _APPLIED or not needed():
        return _APPLIED
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cuda_named_type
    torch.cuda.Event = _WallClockEvent
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _APPLIED = True
    return True


@contextlib.contextmanager
def redirect_cuda_to_cpu() -> Iterator[None]:
    """Patch 7, scoped: entered by the trainer around Megatron calls (a no-op when CUDA exists)."""
    if not needed():
        yield
        return
    apply()
    with _CudaToCpu():
        yield
