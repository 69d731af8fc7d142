"""Optional Triton import shared by the kernel modules.

`AVAILABLE` is False when triton does not import (it is an optional dependency: the torch paths never
need it). Kernels are plain `@triton.jit` functions; on CPU tensors they run only through Triton's
interpreter, which must be switched on for the whole process (`TRITON_INTERPRET=1` in the environment
before triton is first imported: Triton's own library functions such as `tl.sum` are bound at import).
`check_device(t)` raises a clear error instead of Triton's obscure one when that is not the case.
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # ImportError, or a broken install
    triton = tl = None
    AVAILABLE = False


def interpreting() -> bool:
    if not AVAILABLE:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(t) -> None:
    if not t.is_cuda and not interpreting():
        raise RuntimeError("Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported (or use backend='torch')")
