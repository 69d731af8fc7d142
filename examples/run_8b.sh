#!/usr/bin/env bash
# Llama-3.1-8B RL on a Slurm cluster (recipe: examples/configs/llama3_8b.yaml).
#   sbatch examples/run_8b.sh [key=value overrides]     the run (set MODEL_DIR, DATA_FILE, RUN_DIR)
#   bash examples/run_8b.sh --dry-run [overrides]       layout check, memory per GPU, step time; no GPU
#SBATCH --job-name=megatron-rl-8b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=1:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
RECIPE=examples/configs/llama3_8b.yaml
source "${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/examples/slurm_common.sh" "$@"
