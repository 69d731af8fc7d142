#!/usr/bin/env bash
# Shared launcher of examples/run_{8b,70b,405b}.sh. The caller sets RECIPE (a YAML under
# examples/configs) and sources this file with its own arguments:
#   --dry-run          validate the layout and print per-GPU memory and predicted step time (no GPU,
#                      no Slurm needed): `megatron-rl plan RECIPE`; exits non-zero on an impossible layout
#   key=value ...      dotted config overrides, passed to plan and train alike
# Inside a Slurm allocation it splits the nodes into the trainer (first nodes) and the generator group
# (last nodes, one SGLang server per engine), then starts one torchrun per trainer node with a c10d
# rendezvous on the first node. Environment (all optional):
#   MODEL_DIR   HF or Megatron checkpoint directory of the policy     RUN_DIR   metrics, checkpoints, logs
#   ENGINE_MODEL_DIR  block-fp8 copy for fp8 engines (default MODEL_DIR-fp8-block128, written if missing)
#   DATA_FILE   training prompts (JSONL)                              WANDB_PROJECT / WANDB_MODE / WANDB_DIR
#   PYTHON      interpreter with megatron_rl installed (default: the repo's .venv, else python3)
set -euo pipefail

REPO=${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

DRY_RUN=0
OVERRIDES=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *=*) OVERRIDES+=("$arg") ;;
    *) echo "unknown argument '$arg' (expected --dry-run or key=value overrides)" >&2; exit 2 ;;
  esac
done
if [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then
  OVERRIDES+=("cluster.nodes=$SLURM_JOB_NUM_NODES")  # plan what Slurm actually granted
fi

# Always plan first: a layout that cannot fit fails here, before any GPU is touched.
"$PYTHON" -m megatron_rl.cli plan "$RECIPE" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
if [ "$DRY_RUN" = 1 ]; then
  exit 0
fi
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "not inside a Slurm allocation: submit with sbatch $0, or pass --dry-run" >&2
  exit 2
fi

# --- layout from the recipe (the planner's numbers, as shell variables) ------------------------
eval "$("$PYTHON" -m megatron_rl.cli.launch_env "$RECIPE" ${OVERRIDES[@]+"${OVERRIDES[@]}"})"
# -> GPUS_PER_NODE TRAINER_NODES GENERATOR_NODES ENGINES_PER_NODE ENGINE_TP ENGINE_PRECISION PLACEMENT
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${NODES[0]}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_DIR=${RUN_DIR:-$REPO/runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
mkdir -p "$RUN_DIR/logs"

# --- environment: NCCL, checkpoints, W&B ----------------------------------------------------------
export MASTER_ADDR MASTER_PORT
export CUDA_DEVICE_MAX_CONNECTIONS=1          # Megatron's TP communication overlap needs in-order kernels
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # a failed collective aborts the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export WANDB_DIR=${WANDB_DIR:-$RUN_DIR/wandb} WANDB_PROJECT=${WANDB_PROJECT:-megatron-rl}
export SGLANG_RETURN_ORIGINAL_LOGPROB=1       # engines report log-probs of the raw policy (AIPO's mu)
RUN_OVERRIDES=("run_dir=$RUN_DIR")
[ -n "${MODEL_DIR:-}" ] && RUN_OVERRIDES+=("model.path=$MODEL_DIR")
[ -n "${DATA_FILE:-}" ] && RUN_OVERRIDES+=("data.train.path=$DATA_FILE")

# --- generator group: one SGLang server per engine on the last nodes ------------------------------
ENGINE_URLS=()
if [ "$PLACEMENT" = disaggregated ]; then
  MODEL_PATH=${MODEL_DIR:-$("$PYTHON" -c "from megatron_rl.config import load_yaml; from megatron_rl.run_config import RunConfig; import sys; print(load_yaml(RunConfig, sys.argv[1]).model.path)" "$RECIPE")}
  ENGINE_MODEL=$MODEL_PATH
  if [ "$ENGINE_PRECISION" = fp8 ]; then
    # fp8 engines start from a block-fp8 copy (128x128 scales, quantization_config in config.json), the
    # layout every later sync refreshes; written once, streaming one safetensors file at a time.
    ENGINE_MODEL=${ENGINE_MODEL_DIR:-$MODEL_PATH-fp8-block128}
    if [ ! -f "$ENGINE_MODEL/config.json" ]; then
      "$PYTHON" -m megatron_rl.weight_sync.fp8 "$MODEL_PATH" "$ENGINE_MODEL"
    fi
  fi
  for ((n = TRAINER_NODES; n < TRAINER_NODES + GENERATOR_NODES; n++)); do
    node=${NODES[$n]}
    for ((e = 0; e < ENGINES_PER_NODE; e++)); do
      port=$((30000 + e))
      gpus=$(seq -s, $((e * ENGINE_TP)) $(((e + 1) * ENGINE_TP - 1)))
      ENGINE_URLS+=("http://$node:$port")
      srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --output="$RUN_DIR/logs/engine-$node-$e.log" \
        env CUDA_VISIBLE_DEVICES="$gpus" "$PYTHON" -m sglang.launch_server --model-path "$ENGINE_MODEL" \
        --tp-size "$ENGINE_TP" --host 0.0.0.0 --port "$port" &
    done
  done
  URLS=$(IFS=,; echo "${ENGINE_URLS[*]}")
  RUN_OVERRIDES+=("cluster.generator.urls=[$URLS]")
fi

# --- trainer: one torchrun per trainer node, c10d rendezvous on the first node ---------------------
TRAINER_NODELIST=$(IFS=,; echo "${NODES[*]:0:$TRAINER_NODES}")
status=0
srun --nodes="$TRAINER_NODES" --ntasks-per-node=1 --nodelist="$TRAINER_NODELIST" --kill-on-bad-exit=1 \
  --output="$RUN_DIR/logs/trainer-%N.log" \
  "$PYTHON" -m torch.distributed.run --nnodes="$TRAINER_NODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
    -m megatron_rl.cli train "$RECIPE" ${OVERRIDES[@]+"${OVERRIDES[@]}"} "${RUN_OVERRIDES[@]}" || status=$?
kill $(jobs -p) 2>/dev/null || true   # stop the engine servers started above
exit $status
