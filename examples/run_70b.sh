#!/usr/bin/env bash
# Llama-3.1-70B RL on a Slurm cluster (recipe: examples/configs/llama3_70b.yaml).
#   sbatch examples/run_70b.sh [key=value overrides]     the run (set MODEL_DIR, DATA_FILE, RUN_DIR)
#   bash examples/run_70b.sh --dry-run [overrides]       layout check, memory per GPU, step time; no GPU
#   bash examples/run_70b.sh --chain 4 [overrides]       four jobs in a row, each resuming the last (RUN_DIR set)
#SBATCH --job-name=megatron-rl-70b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
RECIPE=examples/configs/llama3_70b.yaml
source "${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/examples/slurm_common.sh" "$@"
