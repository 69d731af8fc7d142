#!/usr/bin/env bash
# DeepSeek-V3 671B (mixture of experts, multi-latent attention) RL on a Slurm cluster (recipe:
# examples/configs/deepseek_v3_671b.yaml; engines of TP 32 span 4 nodes each).
#   sbatch examples/run_deepseek_v3.sh [key=value overrides]   the run (set MODEL_DIR, DATA_FILE, RUN_DIR)
#   bash examples/run_deepseek_v3.sh --dry-run [overrides]     layout check, memory per GPU (experts included),
#                                                                step time, expert-parallel search; no GPU
#   bash examples/run_deepseek_v3.sh --chain 4 [overrides]     four jobs in a row, each resuming the last
#SBATCH --job-name=megatron-rl-deepseek-v3-671b
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=4:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
RECIPE=examples/configs/deepseek_v3_671b.yaml
source "${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/examples/slurm_common.sh" "$@"
