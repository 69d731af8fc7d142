"""The CPU compatibility module changes exactly what its docstring lists, and only without CUDA."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the module is a no-op where CUDA exists")

PROBE = r"""
import json, torch
before_type = torch.randn(2).type()
from megatron_rl.trainer import cpu_compat
assert cpu_compat.apply()
import megatron.core.optimizer.clip_grads as clip_grads
result = {
    "before_type": before_type,
    "current_device": str(torch.cuda.current_device()),
    "synchronize": torch.cuda.synchronize() is None,
    "cuda_is_self": (lambda t: t.cuda() is t)(torch.ones(1)),
    "type": torch.randn(2).type(),
    "type_with_arg": torch.randn(2).type(torch.float64).dtype == torch.float64,
    "clip_patched": clip_grads.clip_grad_by_total_norm_fp32.__module__,
    "event_ms": (lambda a, b: (a.record(), b.record(), a.elapsed_time(b))[-1])(torch.cuda.Event(), torch.cuda.Event()) >= 0,
}
try:
    torch.zeros(1, device="cuda")
    result["outside_mode"] = "allocated"
except Exception as exc:
    result["outside_mode"] = type(exc).__name__
with cpu_compat.redirect_cuda_to_cpu():
    result["inside_mode"] = str(torch.zeros(1, device="cuda").device)
    result["to_cuda"] = str(torch.ones(1).to("cuda:0").device)
print(json.dumps(result))
"""


def test_patches_exactly_what_is_documented():
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before_type"] == "torch.FloatTensor"
    assert result["current_device"] == "cpu"
    assert result["synchronize"] and result["cuda_is_self"] and result["event_ms"]
    assert result["type"] == "torch.cuda.FloatTensor"
    assert result["type_with_arg"]  # conversions through .type(dtype) still work
    assert result["clip_patched"] == "megatron_rl.trainer.cpu_compat"
    # Device redirection is scoped: outside the context 'cuda' still fails as usual.
    assert result["outside_mode"] in ("RuntimeError", "AssertionError")
    assert result["inside_mode"] == "cpu" and result["to_cuda"] == "cpu"


def test_clip_grad_scales_like_megatron():
    from megatron_rl.trainer.cpu_compat import _clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    total = float(torch.sqrt(sum((p.grad ** 2).sum() for p in params)))
    _clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    clipped = float(torch.sqrt(sum((p.grad ** 2).sum() for p in params)))
    assert abs(clipped - 1.0) < 1e-5
    _clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=clipped)  # under the limit: untouched
    assert abs(float(torch.sqrt(sum((p.grad ** 2).sum() for p in params))) - clipped) < 1e-7
