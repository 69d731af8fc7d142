#!/usr/bin/env bash
# GLM-4.5 355B (mixture of experts) RL on a Slurm cluster (recipe: examples/configs/glm4_5_355b.yaml).
#   sbatch examples/run_glm4_5_355b.sh [key=value overrides]   the run (set MODEL_DIR, DATA_FILE, RUN_DIR)
#   bash examples/run_glm4_5_355b.sh --dry-run [overrides]     layout check, memory per GPU (experts included),
#                                                                step time, expert-parallel search; no GPU
#   bash examples/run_glm4_5_355b.sh --chain 4 [overrides]     four jobs in a row, each resuming the last
#SBATCH --job-name=megatron-rl-glm4-5-355b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=4:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
RECIPE=examples/configs/glm4_5_355b.yaml
source "${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/examples/slurm_common.sh" "$@"
