#!/usr/bin/env bash
# Qwen3-30B-A3B (mixture of experts) RL on a Slurm cluster (recipe: examples/configs/qwen3_30b_a3b.yaml).
#   sbatch examples/run_qwen3_30b_a3b.sh [key=value overrides]   the run (set MODEL_DIR, DATA_FILE, RUN_DIR)
#   bash examples/run_qwen3_30b_a3b.sh --dry-run [overrides]     layout check, memory per GPU (experts included),
#                                                                step time, expert-parallel search; no GPU
#   bash examples/run_qwen3_30b_a3b.sh --chain 4 [overrides]     four jobs in a row, each resuming the last
#SBATCH --job-name=megatron-rl-qwen3-30b-a3b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=4:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
RECIPE=examples/configs/qwen3_30b_a3b.yaml
source "${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/examples/slurm_common.sh" "$@"
