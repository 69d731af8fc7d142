#!/usr/bin/env bash
# GPU set-up from wheels only, in the order that resolves (docs/gpu.md): the requirements checked first,
# one line each when unmet (Python 3.11+, an NVIDIA driver new enough for CUDA 13); then torch alone; then
# the package with its gpu extra in one resolve against that torch. Nothing compiles: Transformer Engine's
# torch extension (a source archive) is left out; `--with-te-torch` builds it in the background under a
# time budget (TE_BUILD_BUDGET_S, default 600), logged to $VENV/te-torch-build.log, never waited for.
# Usage: bash scripts/setup_gpu.sh [--dry-run] [--with-te-torch] [VENV]   (default VENV: .venv-gpu)
# --dry-run: resolve every step (pip --dry-run, wheels only) without installing; runs without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
TE_TORCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --with-te-torch) TE_TORCH=1 ;;
    -*) echo "gpu set-up: unknown option $1 (known: --dry-run, --with-te-torch)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
VENV=${1:-.venv-gpu}
PYTHON=${PYTHON:-python3}
MIN_DRIVER=580  # CUDA 13.0: torch 2.14.1's wheels and sglang 0.5.23's kernels
TORCH_PIN="torch==2.14.1"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "gpu set-up: Python 3.11 or newer is needed (sglang 0.5.23 has wheels for 3.11+ only); $PYTHON is $("$PYTHON" -V 2>&1)" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null; then
  DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  if [ -z "$DRIVER" ] || [ "${DRIVER%%.*}" -lt "$MIN_DRIVER" ]; then
    echo "gpu set-up: NVIDIA driver ${DRIVER:-unknown} is older than $MIN_DRIVER, which the CUDA 13 wheels need" >&2
    exit 2
  fi
  echo "gpu set-up: Python $("$PYTHON" -c 'import platform; print(platform.python_version())'), NVIDIA driver $DRIVER"
elif [ "$DRY_RUN" = 0 ]; then
  echo "gpu set-up: no NVIDIA driver (nvidia-smi not found); --dry-run resolves the install without one" >&2
  exit 2
else
  echo "gpu set-up: no NVIDIA driver here: resolving only"
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
PIP=("$PY" -m pip install --only-binary=:all:)
TORCH_REPORT=()
PACKAGE_REPORT=()
if [ "$DRY_RUN" = 1 ]; then  # what would be installed, every package a wheel, written as pip's JSON reports
  PIP+=(--dry-run --ignore-installed)
  TORCH_REPORT=(--report "$VENV/gpu-torch-report.json")
  PACKAGE_REPORT=(--report "$VENV/gpu-install-report.json")
fi
echo "gpu set-up: 1/2 torch ($TORCH_PIN) alone"
"${PIP[@]}" "${TORCH_REPORT[@]}" "$TORCH_PIN"
echo "gpu set-up: 2/2 the package and its gpu extra, against that torch"
"${PIP[@]}" "${PACKAGE_REPORT[@]}" "$TORCH_PIN" -e ".[gpu]"
if [ "$TE_TORCH" = 1 ] && [ "$DRY_RUN" = 0 ]; then
  echo "gpu set-up: building Transformer Engine's torch extension in the background (log: $VENV/te-torch-build.log)"
  nohup timeout "${TE_BUILD_BUDGET_S:-600}" "$PY" -m pip install --no-build-isolation \
    "transformer-engine[pytorch]==2.20.2" > "$VENV/te-torch-build.log" 2>&1 &
fi
echo "gpu set-up done: $VENV"
