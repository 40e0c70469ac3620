# shellcheck shell=bash
# The part of launch/*.sbatch that every cluster shares: run directory, Megatron flags, torchrun per node.
# Expects: LAUNCH_DIR, CONTAINER_ARGS (array, may be empty), GPUS_PER_NODE; reads the knobs documented in the
# sbatch scripts. Sourced, not executed.
# shellcheck source-path=SCRIPTDIR
source "${LAUNCH_DIR}/deepseek_v3_args.sh"

DISPATCHER="${DISPATCHER:-uccl}"            # uccl | alltoall
RUN_ROOT="${RUN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/runs}"
RUN_DIR="${RUN_DIR:-${RUN_ROOT}/deepseek_v3-${DISPATCHER}-${SLURM_NNODES}x${GPUS_PER_NODE}-${SLURM_JOB_ID}}"
RESUME="${RESUME:-0}"                       # 1: continue RUN_DIR from its last checkpoint
PP="${PP:-16}"
EP="${EP:-16}"
LAYOUT="${LAYOUT:-Et|(tt|)*30,mL}"
GBS="${GBS:-4096}"
TRAIN_ITERS="${TRAIN_ITERS:-500}"
PYTHON="${PYTHON:-python}"

CKPT_ARGS=(--save "${RUN_DIR}/checkpoints" --save-interval 250 --ckpt-format torch_dist)
if [[ "${RESUME}" == 1 ]]; then
  if [[ ! -f "${RUN_DIR}/checkpoints/latest_checkpointed_iteration.txt" ]]; then
    echo "RESUME=1 but ${RUN_DIR}/checkpoints holds no complete checkpoint" >&2
    exit 1
  fi
  CKPT_ARGS+=(--load "${RUN_DIR}/checkpoints" --exit-on-missing-checkpoint)
elif [[ -n "$(ls -A "${RUN_DIR}" 2>/dev/null)" ]]; then
  echo "run directory ${RUN_DIR} exists and is not empty: set RUN_DIR to a new path, or RESUME=1 to continue it" >&2
  exit 1
fi
mkdir -p "${RUN_DIR}/checkpoints"
git -C "${LAUNCH_DIR}" rev-parse HEAD > "${RUN_DIR}/provenance.txt" 2>/dev/null || echo unknown > "${RUN_DIR}/provenance.txt"
env | grep -E '^(UCCL_|NCCL_|RCCL_|FI_|HSA_)' | sort > "${RUN_DIR}/env.txt" || true

DISPATCHER_ARGS=(--moe-token-dispatcher-type "${DISPATCHER}")
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size "${PP}"
  --pipeline-model-parallel-layout "${LAYOUT}"
  --context-parallel-size 1
  --expert-model-parallel-size "${EP}"
  --expert-tensor-parallel-size 1
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
)
TRAIN_ARGS=(
  --seed 1234 --bf16 --transformer-impl transformer_engine --attention-backend auto
  --seq-length 4096 --micro-batch-size 1 --global-batch-size "${GBS}" --train-iters "${TRAIN_ITERS}"
  --distributed-timeout-minutes 30
  --optimizer adam --lr 0.00022 --min-lr 2.2e-05 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --adam-eps 1e-08 --clip-grad 1.0 --lr-decay-style cosine --lr-warmup-iters 100 --lr-decay-iters "${TRAIN_ITERS}"
  --log-interval 1 --log-throughput --timing-log-level 0
  --tensorboard-dir "${RUN_DIR}/tensorboard" --log-timers-to-tensorboard
  --eval-interval 1000000 --eval-iters 0
  --mock-data --tokenizer-type NullTokenizer --vocab-size 129280 --num-workers 2
)

# awk reads all of scontrol's output: `head` would kill it with SIGPIPE, which pipefail turns into a failure.
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')"
MASTER_PORT="${MASTER_PORT:-29500}"
export MASTER_ADDR MASTER_PORT

srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=cores "${CONTAINER_ARGS[@]}" \
  "${PYTHON}" -m torch.distributed.run --nnodes "${SLURM_NNODES}" --nproc-per-node "${GPUS_PER_NODE}" \
  --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "${SLURM_JOB_ID}" \
  -m megatron_patch.pretrain_gpt \
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DISPATCHER_ARGS[@]}" "${TRAIN_ARGS[@]}" "${CKPT_ARGS[@]}" \
  2>&1 | tee -a "${RUN_DIR}/train.log"
