#!/usr/bin/env bash
# One GPU, a few minutes: trainer step (bf16; FP8 where Transformer Engine is installed), engine decode,
# weight sync and the fused log-prob kernel, each against this device's measured peaks (copy bandwidth,
# bf16/fp8 matmul). Prints MFU, tokens/s and bandwidths; the last line is JSON (also saved to $OUT).
# Usage: bash scripts/gpu_check.sh [--smoke]       OUT=dir to choose where the JSON goes.
# Written without a GPU at hand: its steps are exercised on CPU by `--smoke` (tests/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
source scripts/check_python.sh "$PY"  # one line and exit 2 unless it can run megatron_rl
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 WANDB_MODE=disabled
exec "$PY" -m megatron_rl.cli.gpu_check --out "$OUT/gpu_check.json" "$@"
