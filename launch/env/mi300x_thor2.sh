# shellcheck shell=bash
# Environment of AMD MI300X nodes with 8x Broadcom Thor-2 400G RoCE NICs (bnxt_re). Sourced by
# launch/mi300x_thor2.sbatch and embedded by `uccl-ep-train train cluster=mi300x_thor2`.
# Format (the Python launcher parses it): one `export NAME="${NAME:-value}"` per line, so a value already set in
# the caller's environment wins. Comments and blank lines are ignored.

# RoCE: Broadcom device names, RoCE v2 GID (check `show_gids` on your nodes), traffic class for the lossless queue.
export NCCL_IB_HCA="${NCCL_IB_HCA:-bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3,bnxt_re4,bnxt_re5,bnxt_re6,bnxt_re7}"
export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"
export NCCL_IB_TC="${NCCL_IB_TC:-104}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-23}"
export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-2}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_CHECKS_DISABLE="${NCCL_CHECKS_DISABLE:-1}"
export RCCL_MSCCL_ENABLE="${RCCL_MSCCL_ENABLE:-0}"

# UCCL-EP on Thor-2: same NICs and GID as RCCL; one write and 1.5 MiB in flight per proxy thread, or the NIC
# reports transport retry errors under EP load.
export UCCL_IB_HCA="${UCCL_IB_HCA:-bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3,bnxt_re4,bnxt_re5,bnxt_re6,bnxt_re7}"
export UCCL_IB_GID_INDEX="${UCCL_IB_GID_INDEX:-3}"
export UCCL_IB_TC="${UCCL_IB_TC:-104}"
export UCCL_IB_MAX_INFLIGHT_NORMAL="${UCCL_IB_MAX_INFLIGHT_NORMAL:-1}"
export UCCL_IB_MAX_INFLIGHT_BYTES="${UCCL_IB_MAX_INFLIGHT_BYTES:-1572864}"
export UCCL_EP_TRANSPORT="${UCCL_EP_TRANSPORT:-verbs}"

# ROCm: keep scratch memory (reclaiming it stalls long runs), stream priorities as Megatron expects.
export HSA_NO_SCRATCH_RECLAIM="${HSA_NO_SCRATCH_RECLAIM:-1}"
export HSA_ENABLE_SDMA="${HSA_ENABLE_SDMA:-1}"
export GPU_MAX_HW_QUEUES="${GPU_MAX_HW_QUEUES:-2}"
export TORCH_NCCL_HIGH_PRIORITY="${TORCH_NCCL_HIGH_PRIORITY:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
