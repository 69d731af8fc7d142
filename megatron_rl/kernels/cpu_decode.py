"""The native engine's fused CPU kernels (cpu_decode.c): residual add + RMSNorm, RoPE with the KV-cache write,
the gated MLP activation, decode attention over the cache and plain sampling, each one pass over memory where
eager torch takes several ops, and the fp32 GEMM of decode steps on packed panels (rollout/native/model.py and
weights.py use them; docs/performance.md says what they save).

`load()` builds the C source once per machine with the system's GCC (`$CC`, else gcc; -O3 -march=native,
OpenMP, GCC's vector extensions) into `$MEGATRON_RL_KERNEL_CACHE` (default ~/.cache/megatron_rl/kernels),
keyed by the sources, flags, compiler and CPU, and loads it with ctypes: about a second to build, no torch
headers, no build step at install. Where no compiler is found or the build fails, `load()` returns None and
says why once; the engine then runs the torch ops (`engine.cpu_kernels: auto`) or refuses (`required`).

Each wrapper takes contiguous CPU tensors of one activation dtype (fp32 or bf16) and checks what the C side
relies on; the torch expression each kernel stands for is in its docstring and the tests compare against it
(tests/test_cpu_decode_kernels.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ("cpu_decode.c", "cpu_decode_body.h")
# -ffp-contract=off: no fused multiply-adds, so every product the torch expression rounds is rounded here too.
# On x86, 512-bit vectors where the CPU has them (GCC otherwise stays at 256 on AVX-512 machines).
_FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
          "-fno-math-errno", "-fno-trapping-math")
if platform.machine() in ("x86_64", "AMD64"):
    _FLAGS += ("-mprefer-vector-width=512",)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
MAX_HEAD_DIM = 1024  # per-head scratch of mrl_rope_qkv
MAX_GROUP = 256      # query heads per KV head in mrl_decode_attention
PANEL_MAX_ROWS = 256  # rows up to which mrl_linear_panels_f32 beats MKL on the same machines (docs/performance.md)

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def cache_dir() -> str:
    return os.environ.get("MEGATRON_RL_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                      "megatron_rl", "kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> str:
    """The path of the shared library for this machine, compiled now unless cached."""
    digest = hashlib.sha256()
    for name in _SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            digest.update(f.read())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest.update(" ".join(_FLAGS).encode() + version.encode() + _cpu_flags().encode())
    directory = cache_dir()
    path = os.path.join(directory, f"cpu_decode-{digest.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_decode-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, "-o", tmp, os.path.join(_HERE, "cpu_decode.c"), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load() -> "CpuDecodeKernels | None":
    """The kernels, built and loaded once per process; None (with the reason logged once, and kept in
    `load_error()`) where they cannot be built here."""
    with _lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = None
            compiler = shutil.which(os.environ.get("CC", "gcc"))
            try:
                if compiler is None:
                    raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'gcc')!r} is not on PATH)")
                _loaded["kernels"] = CpuDecodeKernels(ctypes.CDLL(_build(compiler)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _loaded["error"] = str(exc)
                log.warning(f"fused CPU decode kernels unavailable, using torch ops: {exc}")
        return _loaded["kernels"]  # type: ignore[return-value]


def load_error() -> str | None:
    return _loaded.get("error")  # type: ignore[return-value]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(*tensors: torch.Tensor | None, dtype: torch.dtype) -> None:
    for t in tensors:
        if t is not None and (t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"cpu_decode: expected contiguous CPU {dtype} tensors, got {t.dtype} {t.device} "
                             f"contiguous={t.is_contiguous()} shape={tuple(t.shape)}")


_i64, _f32, _int, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


class CpuDecodeKernels:
    """ctypes bindings of cpu_decode.c."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._fns: dict[tuple[str, torch.dtype], object] = {}
        signatures = {
            "mrl_rms_norm": [_p, _p, _p, _p, _i64, _i64, _f32, _f32, _int, _int],
            "mrl_gated_act": [_p, _i64, _i64, _int, _p, _int],
            "mrl_rope_qkv": [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _f32, _f32, _int, _p, _p, _p, _p, _int],
            "mrl_decode_attention": [_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                                     _f32, _f32, _p, _p, _int],
            "mrl_sample_plain": [_p, _i64, _i64, _p, _i64, _p, _p, _int],
        }
        for name, argtypes in signatures.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[(name, dtype)] = fn
        lib.mrl_panel_width.argtypes, lib.mrl_panel_width.restype = [], ctypes.c_int64
        lib.mrl_pack_panels_f32.argtypes, lib.mrl_pack_panels_f32.restype = [_p, _i64, _i64, _p, _int], None
        lib.mrl_linear_panels_f32.argtypes = [_p, _i64, _i64, _p, _i64, _p, _p, _int]
        lib.mrl_linear_panels_f32.restype = None
        lib.mrl_vector_lanes.argtypes, lib.mrl_vector_lanes.restype = [], ctypes.c_int64
        self.panel_width = int(lib.mrl_panel_width())
        # The engine's fp32 GEMMs take the panels where they measured faster than MKL: 512-bit vectors (about
        # 20% at 32 rows). With 256-bit ones they ran level with MKL's AVX2 kernels on small matrices and 6 to
        # 15% behind on an 8B model's (docs/performance.md), so MKL keeps them there.
        self.fp32_gemm_panels = int(lib.mrl_vector_lanes()) == 16

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _SUFFIX

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, delta: torch.Tensor | None = None,
                 offset: float | None = None) -> torch.Tensor:
        """RMSNorm of x [rows, dim] as model.py's `_rms_norm` (offset None) or `_offset_rms_norm`; with
        `delta`, x += delta in place first (x's dtype), so `x = x + delta; h = norm(x)` is one pass."""
        _check(x, weight, delta, dtype=x.dtype)
        out = torch.empty_like(x)
        self._fns[("mrl_rms_norm", x.dtype)](x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(),
                                             x.shape[0], x.shape[-1], eps, offset or 0.0, offset is not None,
                                             torch.get_num_threads())
        return out

    def gated_act(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of gate_up [rows, 2 ffn] (transformers' act_fn(gate) * up, act 'silu' or
        'gelu_tanh', the activation cast to the dtype before the product)."""
        _check(gate_up, dtype=gate_up.dtype)
        rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, ffn, dtype=gate_up.dtype)
        self._fns[("mrl_gated_act", gate_up.dtype)](gate_up.data_ptr(), rows, ffn, _ACTIVATIONS[activation],
                                                    out.data_ptr(), torch.get_num_threads())
        return out

    def rope_qkv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_rows: torch.Tensor, *,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
                 norm_offset: float | None = None) -> torch.Tensor:
        """Rotated q [n, heads, d] of qkv [n, (heads + 2 kv_heads) d]; writes each token's rotated k and its v
        to rows `cache_rows` [n, kv_heads] (int64) of the caches seen as [rows, d]. cos / sin [n, rot] (the
        rotary dims, rot <= d, the rest passes through); q_norm / k_norm: Qwen3's per-head RMSNorm first."""
        dtype = qkv.dtype
        _check(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, dtype=dtype)
        _check(cache_rows, dtype=torch.int64)
        n, rot = qkv.shape[0], cos.shape[-1]
        if head_dim > MAX_HEAD_DIM or rot > head_dim or rot % 2:
            raise ValueError(f"cpu_decode.rope_qkv: head_dim {head_dim} (at most {MAX_HEAD_DIM}), rotary dims {rot}")
        q = torch.empty(n, heads, head_dim, dtype=dtype)
        self._fns[("mrl_rope_qkv", dtype)](
            qkv.data_ptr(), n, heads, kv_heads, head_dim, rot, cos.data_ptr(), sin.data_ptr(), _ptr(q_norm),
            _ptr(k_norm), eps, norm_offset or 0.0, norm_offset is not None, q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), cache_rows.data_ptr(), torch.get_num_threads())
        return q

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         lens: torch.Tensor, *, kv_heads: int, t_alloc: int, k_row: int, v_row: int, dv: int,
                         scale: float, window: int | None = None, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [n_dec, heads, dk] over the cached keys [lens - window, lens) of its slot
        (`slots`, `lens` int64 [n_dec]): out [n_dec, heads * dv]. Caches [slots, kv_heads, t_alloc, k_row /
        v_row] (keys the first dk, values the first dv of a row); sinks fp32 [heads] or None."""
        dtype = q.dtype
        _check(q, k_cache, v_cache, dtype=dtype)
        _check(slots, lens, dtype=torch.int64)
        _check(sinks, dtype=torch.float32)
        n_dec, heads, dk = q.shape
        if heads // kv_heads > MAX_GROUP:
            raise ValueError(f"cpu_decode.decode_attention: {heads // kv_heads} query heads per KV head "
                             f"(at most {MAX_GROUP})")
        out = torch.empty(n_dec, heads * dv, dtype=dtype)
        self._fns[("mrl_decode_attention", dtype)](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(), n_dec, heads,
            kv_heads, t_alloc, dk, dv, k_row, v_row, window or 0, scale, softcap or 0.0, _ptr(sinks), out.data_ptr(),
            torch.get_num_threads())
        return out

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """An fp32 weight [n, k] laid out for `linear_panels`: [ceil(n / panel_width), k, panel_width], each
        panel the transposed block of `panel_width` output rows (zero past n)."""
        _check(weight, dtype=torch.float32)
        n, k = weight.shape
        panels = torch.empty(-(-n // self.panel_width), k, self.panel_width)
        self.lib.mrl_pack_panels_f32(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
        return panels

    def linear_panels(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) in fp32 for x [m, k] (m up to PANEL_MAX_ROWS, where it is faster than
        MKL's GEMMs), weight given as `pack_panels(weight)`."""
        _check(x, panels, bias, dtype=torch.float32)
        m, k = x.shape
        if panels.shape[1:] != (k, self.panel_width) or panels.shape[0] * self.panel_width < out_features:
            raise ValueError(f"cpu_decode.linear_panels: panels {tuple(panels.shape)} do not fit x {tuple(x.shape)} "
                             f"and {out_features} outputs")
        out = torch.empty(m, out_features)
        self.lib.mrl_linear_panels_f32(x.data_ptr(), m, k, panels.data_ptr(), out_features, _ptr(bias),
                                       out.data_ptr(), torch.get_num_threads())
        return out

    def sample_plain(self, logits: torch.Tensor, uniforms: torch.Tensor,
                     block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """sampling.py `_sample_plain` of logits [R, V] (fp32, or bf16 read as its exact fp32 values) at
        float64 uniforms [R]: (tokens [R] int64, log-probs [R] fp32)."""
        _check(logits, dtype=logits.dtype)
        _check(uniforms, dtype=torch.float64)
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, dtype=torch.float32)
        self._fns[("mrl_sample_plain", logits.dtype)](logits.data_ptr(), rows, vocab, uniforms.data_ptr(), block,
                                                      tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
        return tokens, logprobs
