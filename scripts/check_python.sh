# Sourced by the launchers (examples/slurm_common.sh, scripts/gpu_check.sh) with the interpreter they chose:
#   source scripts/check_python.sh "$PYTHON"
# Returns when it can import megatron_rl (installed, or from this source tree) and the dependencies the
# launchers run it with; otherwise prints one line saying how to install and exits 2. Only looks modules
# up (no torch import): it costs one interpreter start.
if ! command -v "$1" >/dev/null 2>&1; then
  echo "$1 not found: install megatron_rl with 'bash scripts/setup_cpu.sh' (or 'pip install -e .' into your environment), or set PYTHON to an interpreter that has it" >&2
  exit 2
fi
if ! _megatron_rl_missing=$("$1" - 2>&1 <<'PYCHECK'
import importlib.util
import sys

try:
    import megatron_rl  # noqa: F401
except ImportError as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
missing = []
for name in ("torch", "megatron.core", "yaml", "numpy",
             "safetensors", "transformers"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        found = False
    if not found:
        missing.append(name)
if missing:
    sys.exit("no module " + ", ".join(missing))
PYCHECK
); then
  echo "$1 cannot run megatron_rl (${_megatron_rl_missing##*$'\n'}): install it with 'bash scripts/setup_cpu.sh' (or 'pip install -e .' into your environment), or set PYTHON to an interpreter that has it" >&2
  exit 2
fi
unset _megatron_rl_missing
