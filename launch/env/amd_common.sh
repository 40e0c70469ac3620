# shellcheck shell=bash
# Environment every AMD cluster here shares (RCCL, UCCL-EP, ROCm), whatever its NICs. Sourced by
# launch/env/mi300x_thor2.sh and launch/env/mi355x_pollara.sh, which set the NICs, GID, traffic class and in-flight
# cap of their fabric.
# Format (the Python launcher parses it): one `export NAME="${NAME:-value}"` per line, so a value already set in
# the caller's environment wins. Comments and blank lines are ignored.

# RCCL over RoCE: retry timeout, queue pairs per connection, quiet logs, no MSCCL algorithms.
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-23}"
export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-2}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_CHECKS_DISABLE="${NCCL_CHECKS_DISABLE:-1}"
export RCCL_MSCCL_ENABLE="${RCCL_MSCCL_ENABLE:-0}"

# UCCL-EP over verbs, one write in flight per proxy thread (the cluster file caps the bytes for its NICs).
export UCCL_IB_MAX_INFLIGHT_NORMAL="${UCCL_IB_MAX_INFLIGHT_NORMAL:-1}"
export UCCL_EP_TRANSPORT="${UCCL_EP_TRANSPORT:-verbs}"

# ROCm: keep scratch memory (reclaiming it stalls long runs), stream priorities as Megatron expects.
export HSA_NO_SCRATCH_RECLAIM="${HSA_NO_SCRATCH_RECLAIM:-1}"
export HSA_ENABLE_SDMA="${HSA_ENABLE_SDMA:-1}"
export GPU_MAX_HW_QUEUES="${GPU_MAX_HW_QUEUES:-2}"
export TORCH_NCCL_HIGH_PRIORITY="${TORCH_NCCL_HIGH_PRIORITY:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
