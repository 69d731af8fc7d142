#!/usr/bin/env bash
# One GPU, one command of at most 10 minutes (docs/gpu.md): the set-up from wheels (scripts/setup_gpu.sh,
# skipped when .venv-gpu is already set up or PYTHON is given), then gpu_check's sections, each under its
# own budget, within what GPU_CHECK_BUDGET_S (570 s) leaves after the set-up. The JSON is rewritten after
# every section (a lease cut short still returns what ran); the last line printed is the same JSON.
# Usage: bash scripts/gpu_check.sh [--smoke]   OUT=dir for gpu_check.json and the logs (default runs/gpu_check)
# --smoke: tiny shapes with the CPU environment (.venv), so every section's plumbing runs without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-570}
SECTIONS_MIN_S=240  # the set-up may use what the first sections (env, decode, train, logprob) do not need
OUT=${OUT:-runs/gpu_check}
SMOKE=()
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=(--smoke) ;;
    *) echo "gpu_check: unknown option $arg (known: --smoke)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ ${#SMOKE[@]} -gt 0 ]; then
  PY=${PYTHON:-.venv/bin/python}
else
  PY=${PYTHON:-.venv-gpu/bin/python}
  if [ -z "${PYTHON:-}" ] && [ ! -f .venv-gpu/.gpu-setup-done ]; then
    set +e
    timeout $((BUDGET - SECTIONS_MIN_S)) bash scripts/setup_gpu.sh .venv-gpu 2>&1 | tee "$OUT/setup.log"
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" != 0 ]; then
      why=$(grep -v '^\s*$' "$OUT/setup.log" | tail -1 | tr -d '"\\')
      [ "$status" = 124 ] && why="timed out after $((BUDGET - SECTIONS_MIN_S)) s"
      echo "{\"gpu_check\": true, \"setup\": {\"error\": \"exit $status: $why\"}, \"failed_sections\": [\"setup\"]}" \
        | tee "$OUT/gpu_check.json"
      exit 1
    fi
    touch .venv-gpu/.gpu-setup-done
  fi
fi
source scripts/check_python.sh "$PY"  # one line and exit 2 unless it can run megatron_rl
LEFT=$((BUDGET - ($(date +%s) - START)))
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 WANDB_MODE=disabled
"$PY" -m megatron_rl.cli.gpu_check --out "$OUT/gpu_check.json" --deadline-s "$LEFT" "${SMOKE[@]}" 2>&1 \
  | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
