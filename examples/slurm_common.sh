#!/usr/bin/env bash
# Shared launcher of examples/run_{8b,70b,405b}.sh. The caller sets RECIPE (a YAML under
# examples/configs) and sources this file with its own arguments:
#   --dry-run          validate the layout and print per-GPU memory and predicted step time (no GPU,
#                      no Slurm needed): `megatron-rl plan RECIPE`; exits non-zero on an impossible layout
#   --resume           continue the run in RUN_DIR from its latest checkpoint (a requeued job does so itself)
#   --chain N          submit this script N times as a chain of singleton jobs (each starts when the one
#                      before it ends, and resumes it): runs longer than the partition's time limit
#   key=value ...      dotted config overrides, passed to plan and train alike
# Inside a Slurm allocation it splits the nodes into the trainer (first nodes) and the generator group
# (last nodes, one SGLang or vLLM server per engine), then starts one torchrun per trainer node with a
# c10d rendezvous on the first node. A liveness monitor names every step that dies and its log; an engine's
# death leaves the job to the trainer (whose engine pool re-routes around it), the last engine's or the
# trainer's ends the job. On SIGUSR1 (`#SBATCH --signal=B:USR1@600`: ten minutes before the
# time limit) the trainer is asked to checkpoint and stop, and the job requeues itself to resume.
# Environment (all optional):
#   MODEL_DIR   HF or Megatron checkpoint directory of the policy     RUN_DIR   metrics, checkpoints, logs
#   ENGINE_MODEL_DIR  block-fp8 copy for fp8 engines (default RUN_DIR/engine-model-fp8, written if missing)
#   VLLM_PYTHON  Python of the vLLM environment on the engine nodes (cluster.generator.backend=vllm)
#   DATA_FILE   training prompts (JSONL)                              WANDB_PROJECT / WANDB_MODE / WANDB_DIR
#   PYTHON      interpreter that runs megatron_rl (default: the repo's .venv, else python3; checked first)
#   CONTAINER_IMAGE / CONTAINER_MOUNTS   run every step in this container (pyxis/enroot flags on each srun)
#   SRUN_EXTRA_ARGS   more flags for every srun step (e.g. "--mpi=pmix --network=...")
#   CPUS_PER_GPU      CPU cores requested per GPU on each step (default 8)
set -euo pipefail

REPO=${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
# Never a silent fallback: one line and exit 2 unless this interpreter can run the package.
source "$REPO/scripts/check_python.sh" "$PYTHON"
SCRIPT=${LAUNCH_SCRIPT:-$0}

DRY_RUN=0
RESUME=0
CHAIN=0
OVERRIDES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --resume) RESUME=1 ;;
    --chain)
      CHAIN=${2:-}
      if ! [[ "$CHAIN" =~ ^[1-9][0-9]*$ ]]; then
        echo "--chain needs a positive number of jobs, got '${2:-}'" >&2; exit 2
      fi
      shift ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *=*) OVERRIDES+=("$1") ;;
    *) echo "unknown argument '$1' (expected --dry-run, --resume, --chain N or key=value overrides)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then
  OVERRIDES+=("cluster.nodes=$SLURM_JOB_NUM_NODES")  # plan what Slurm actually granted
fi

# Always plan first: a layout that cannot fit fails here, before any GPU is touched.
"$PYTHON" -m megatron_rl.cli plan "$RECIPE" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
if [ "$DRY_RUN" = 1 ]; then
  exit 0
fi

if [ "$CHAIN" -gt 0 ]; then
  # One job name, --dependency=singleton: Slurm runs the jobs one after another; every job after the
  # first resumes from the checkpoint its predecessor left. RUN_DIR must be fixed for the whole chain.
  if [ -z "${RUN_DIR:-}" ]; then
    echo "--chain needs RUN_DIR set: every job of the chain continues the same run directory" >&2; exit 2
  fi
  name=${CHAIN_JOB_NAME:-megatron-rl-$(basename "$RUN_DIR")}
  for ((i = 0; i < CHAIN; i++)); do
    resume_flag=()
    [ "$i" -gt 0 ] || [ "$RESUME" = 1 ] && resume_flag=(--resume)
    sbatch --job-name="$name" --dependency=singleton --export=ALL,RUN_DIR="$RUN_DIR" \
      "$SCRIPT" ${resume_flag[@]+"${resume_flag[@]}"} ${OVERRIDES[@]+"${OVERRIDES[@]}"}
  done
  exit 0
fi

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "not inside a Slurm allocation: submit with sbatch $SCRIPT, or pass --dry-run" >&2
  exit 2
fi

# --- layout from the recipe (the planner's numbers, as shell variables) ------------------------
eval "$("$PYTHON" -m megatron_rl.cli.launch_env "$RECIPE" ${OVERRIDES[@]+"${OVERRIDES[@]}"})"
# -> GPUS_PER_NODE TRAINER_NODES GENERATOR_NODES ENGINES_PER_NODE NODES_PER_ENGINE ENGINE_TP ENGINE_PRECISION
#    PLACEMENT ENGINE_BACKEND (sglang or vllm) ENGINE_SERVER_ARGS
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${NODES[0]}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_DIR=${RUN_DIR:-$REPO/runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}  # a requeued job keeps its id, so its RUN_DIR
mkdir -p "$RUN_DIR/logs"
CPUS_PER_GPU=${CPUS_PER_GPU:-8}

# Flags every srun step gets: the container (pyxis) and the site's extra flags.
STEP_ARGS=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
  STEP_ARGS+=("--container-image=$CONTAINER_IMAGE" "--container-workdir=$REPO")
  [ -n "${CONTAINER_MOUNTS:-}" ] && STEP_ARGS+=("--container-mounts=$CONTAINER_MOUNTS")
fi
if [ -n "${SRUN_EXTRA_ARGS:-}" ]; then
  read -r -a extra <<< "$SRUN_EXTRA_ARGS"
  STEP_ARGS+=("${extra[@]}")
fi

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
TRAIN_FLAGS=()
# A requeued job (SLURM_RESTART_COUNT > 0) resumes, once its first attempt has left a checkpoint.
if [ "$RESUME" = 1 ] || { [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -e "$RUN_DIR/checkpoints/latest" ]; }; then
  TRAIN_FLAGS+=(--resume)
fi

# --- generator group: one SGLang (or vLLM) server per engine on the last nodes ---------------------
# vLLM lives in its own environment (VLLM_PYTHON, default: the project's Python); it quantizes to fp8 itself.
VLLM_PYTHON=${VLLM_PYTHON:-$PYTHON}
declare -A STEP_NAME=()   # pid of each srun step -> what it runs, for the liveness monitor
declare -A STEP_ENGINE=() # pid of an engine's srun step -> its engine's URL (an engine may span several steps)
ENGINE_URLS=()
if [ "$PLACEMENT" = disaggregated ]; then
  MODEL_PATH=${MODEL_DIR:-$("$PYTHON" -c "from megatron_rl.config import load_yaml; from megatron_rl.run_config import RunConfig; import sys; print(load_yaml(RunConfig, sys.argv[1]).model.path)" "$RECIPE")}
  ENGINE_MODEL=$MODEL_PATH
  read -r -a SERVER_ARGS <<< "$ENGINE_SERVER_ARGS"
  if [ "$ENGINE_PRECISION" = fp8 ] && [ "$ENGINE_BACKEND" = sglang ]; then
    # fp8 engines start from a block-fp8 copy (128x128 scales, quantization_config in config.json), the
    # layout every later sync refreshes; written once, under the run directory (the model's own folder
    # is often read-only shared storage), streaming one safetensors file at a time.
    ENGINE_MODEL=${ENGINE_MODEL_DIR:-$RUN_DIR/engine-model-fp8}
    if [ ! -f "$ENGINE_MODEL/config.json" ]; then
      "$PYTHON" -m megatron_rl.weight_sync.fp8 "$MODEL_PATH" "$ENGINE_MODEL"
    fi
  fi
  # An engine wider than a node (engine_tp > GPUS_PER_NODE, e.g. DeepSeek-V3 at TP 32) is one SGLang server over
  # NODES_PER_ENGINE whole nodes: a process per node, joined at its first node, which alone serves HTTP.
  for ((n = TRAINER_NODES; NODES_PER_ENGINE > 1 && n < TRAINER_NODES + GENERATOR_NODES; n += NODES_PER_ENGINE)); do
    head=${NODES[$n]}
    ENGINE_URLS+=("http://$head:30000")
    for ((r = 0; r < NODES_PER_ENGINE; r++)); do
      node=${NODES[$((n + r))]}
      log="$RUN_DIR/logs/engine-$head-node$r.log"
      srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --gpus="$GPUS_PER_NODE" \
        --cpus-per-task=$((GPUS_PER_NODE * CPUS_PER_GPU)) --output="$log" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} \
        "$PYTHON" -m sglang.launch_server --model-path "$ENGINE_MODEL" "${SERVER_ARGS[@]}" \
        --nnodes "$NODES_PER_ENGINE" --node-rank "$r" --dist-init-addr "$head:31000" --host 0.0.0.0 --port 30000 &
      STEP_NAME[$!]="SGLang engine on $head (node $r of $NODES_PER_ENGINE: $node; log: $log)"
      STEP_ENGINE[$!]="http://$head:30000"
    done
  done
  for ((n = TRAINER_NODES; NODES_PER_ENGINE == 1 && n < TRAINER_NODES + GENERATOR_NODES; n++)); do
    node=${NODES[$n]}
    for ((e = 0; e < ENGINES_PER_NODE; e++)); do
      port=$((30000 + e))
      gpus=$(seq -s, $((e * ENGINE_TP)) $(((e + 1) * ENGINE_TP - 1)))
      ENGINE_URLS+=("http://$node:$port")
      log="$RUN_DIR/logs/engine-$node-$e.log"
      if [ "$ENGINE_BACKEND" = vllm ]; then
        server=(env CUDA_VISIBLE_DEVICES="$gpus" VLLM_SERVER_DEV_MODE=1 "$VLLM_PYTHON"
                -m vllm.entrypoints.openai.api_server --model "$ENGINE_MODEL")
      else
        server=(env CUDA_VISIBLE_DEVICES="$gpus" "$PYTHON" -m sglang.launch_server --model-path "$ENGINE_MODEL")
      fi
      srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --gpus="$ENGINE_TP" \
        --cpus-per-task=$((ENGINE_TP * CPUS_PER_GPU)) --output="$log" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} \
        "${server[@]}" "${SERVER_ARGS[@]}" --host 0.0.0.0 --port "$port" &
      STEP_NAME[$!]="$([ "$ENGINE_BACKEND" = vllm ] && echo vLLM || echo SGLang) engine $e on $node (log: $log)"
      STEP_ENGINE[$!]="http://$node:$port"
    done
  done
  URLS=$(IFS=,; echo "${ENGINE_URLS[*]}")
  RUN_OVERRIDES+=("cluster.generator.urls=[$URLS]")
fi

# --- trainer: one torchrun per trainer node, c10d rendezvous on the first node ---------------------
TRAINER_NODELIST=$(IFS=,; echo "${NODES[*]:0:$TRAINER_NODES}")
srun --nodes="$TRAINER_NODES" --ntasks-per-node=1 --nodelist="$TRAINER_NODELIST" --kill-on-bad-exit=1 \
  --gpus-per-node="$GPUS_PER_NODE" --cpus-per-task=$((GPUS_PER_NODE * CPUS_PER_GPU)) \
  --output="$RUN_DIR/logs/trainer-%N.log" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} \
  "$PYTHON" -m torch.distributed.run --nnodes="$TRAINER_NODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
    -m megatron_rl.cli train "$RECIPE" ${TRAIN_FLAGS[@]+"${TRAIN_FLAGS[@]}"} \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"} "${RUN_OVERRIDES[@]}" &
TRAINER_PID=$!
STEP_NAME[$TRAINER_PID]="trainer (logs: $RUN_DIR/logs/trainer-*.log)"

stop_steps() {
  local pid
  for pid in "${!STEP_NAME[@]}"; do kill "$pid" 2>/dev/null || true; done
}

# Near the time limit: ask the trainer to checkpoint and stop (the file is read by every trainer rank
# at the next step boundary, megatron_rl/controller/loop.py), then requeue to resume from it.
REQUEUE=0
on_time_limit() {
  REQUEUE=1
  echo "$(date -u +%FT%TZ) time limit near: asking the trainer to checkpoint and stop; the job requeues" >&2
  touch "$RUN_DIR/STOP"
}
trap on_time_limit USR1
trap 'stop_steps; exit 143' TERM INT

# Liveness: the trainer ending ends the job with its status; the last engine ending fails it at once
# (not after the trainer's dead_engine_timeout_s).
ENGINES_LEFT=${#ENGINE_URLS[@]}
declare -A ENGINE_DEAD=()
status=0
while :; do
  finished=""
  wait -n -p finished ${!STEP_NAME[@]} && step_status=0 || step_status=$?
  if [ -z "${finished:-}" ]; then
    continue  # interrupted by a signal (USR1): keep waiting for the trainer's checkpoint
  fi
  if [ "$finished" = "$TRAINER_PID" ]; then
    status=$step_status
    break
  fi
  # An engine ending: the trainer's engine pool takes it out and sends its groups to the others
  # (rollout/pool.py); the job stops when no engine is left.
  echo "$(date -u +%FT%TZ) ${STEP_NAME[$finished]} exited with status $step_status" >&2
  unset "STEP_NAME[$finished]"
  engine=${STEP_ENGINE[$finished]}
  [ -n "${ENGINE_DEAD[$engine]:-}" ] && continue  # another node of an engine already counted dead
  ENGINE_DEAD[$engine]=1
  for pid in "${!STEP_ENGINE[@]}"; do  # the engine's other nodes cannot serve without this one
    [ "${STEP_ENGINE[$pid]}" = "$engine" ] && [ -n "${STEP_NAME[$pid]:-}" ] && { kill -TERM "$pid" 2>/dev/null || true; }
  done
  ENGINES_LEFT=$((ENGINES_LEFT - 1))
  if [ "$ENGINES_LEFT" -le 0 ]; then
    echo "$(date -u +%FT%TZ) no engine left: stopping the job" >&2
    status=1
    break
  fi
done
stop_steps
wait 2>/dev/null || true
rm -f "$RUN_DIR/STOP"
if [ "$REQUEUE" = 1 ] && [ "$status" = 0 ]; then
  echo "$(date -u +%FT%TZ) checkpoint written: requeueing job $SLURM_JOB_ID to resume" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $status
