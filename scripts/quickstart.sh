#!/usr/bin/env bash
# The main job on a fresh machine: set up (if needed), then a short real run on CPU.
# Extra arguments are dotted config overrides, e.g. `bash scripts/quickstart.sh run_dir=runs/try2`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIRTUAL_ENV:-.venv}
if ! bash scripts/setup_cpu.sh --check "$VENV"; then
  bash scripts/setup_cpu.sh "$VENV"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$VENV/bin/megatron-rl" train examples/configs/quickstart.yaml "$@"
