#!/usr/bin/env bash
# PrimeIntellect's `verifiers` (0.4.0) in its own virtual environment, for `agent.environment:
# verifiers:<env>` (docs/environments.md): verifiers pins openai<3 and mcp==2.0.0, which the project's
# environment (OpenEnv's fastmcp needs mcp<2) does not use. About 35 s and 600 MB, no torch: the run
# drives it as a separate process (recipes/agent/verifiers_worker.py, standard library and verifiers
# only) found through agent.verifiers.python, MEGATRON_RL_VERIFIERS_PYTHON or, by default,
# .venv-verifiers/bin/python.
# Idempotent: a finished set-up is recorded in the venv and not repeated.
# Usage: bash scripts/setup_verifiers.sh [VENV_DIR]     (`--check [VENV_DIR]`: exit 0 when it is set up)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK_ONLY=0
if [ "${1:-}" = "--check" ]; then
  CHECK_ONLY=1
  shift
fi
VENV=${1:-.venv-verifiers}
MARKER="$VENV/.megatron_rl_verifiers_setup"
FINGERPRINT=$(sha256sum scripts/setup_verifiers.sh | cut -d' ' -f1)
if [ "$CHECK_ONLY" = 1 ]; then
  [ -x "$VENV/bin/python" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$FINGERPRINT" ]
  exit
fi
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$FINGERPRINT" ]; then
  echo "verifiers environment already set up: $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "verifiers==0.4.0"
"$PY" -c "import verifiers.v1, verifiers; print('verifiers', verifiers.__version__)"
echo "$FINGERPRINT" > "$MARKER"
echo "verifiers set-up done: $VENV"
