"""scripts/gpu_check.sh's steps at tiny shapes (--smoke): every section runs and reports numbers, so the
GPU session only has to supply the device."""
from __future__ import annotations

import json


def test_gpu_check_smoke_runs_every_section(tmp_path):
    from megatron_rl.cli.gpu_check import main

    out = tmp_path / "gpu_check.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["failed_sections"] == []
    assert result["copy_GBps"] > 0 and result["matmul_bf16_TFLOPs"] > 0
    train = result["train_bf16"]
    assert train["tokens_per_s"] > 0 and 0 < train["mfu"] < 1.5
    assert result["decode"]["tokens_per_s"] > 0 and result["decode"]["weight_bytes"] > 0
    assert result["weight_sync"]["bytes"] == result["decode"]["weight_bytes"]
