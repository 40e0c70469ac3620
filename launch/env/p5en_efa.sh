# shellcheck shell=bash
# Environment of AWS p5en.48xlarge nodes (8x H200, 16x 200 Gb/s EFA). Sourced by launch/p5en_efa.sbatch and
# embedded by `uccl-ep-train train cluster=p5en_efa`: the one source of this cluster's settings.
# Format (the Python launcher parses it): one `export NAME="${NAME:-value}"` per line, so a value already set in
# the caller's environment wins. Comments and blank lines are ignored.

# libfabric / EFA
export FI_PROVIDER="${FI_PROVIDER:-efa}"
export FI_EFA_USE_DEVICE_RDMA="${FI_EFA_USE_DEVICE_RDMA:-1}"
export FI_EFA_FORK_SAFE="${FI_EFA_FORK_SAFE:-1}"
export FI_EFA_SET_CUDA_SYNC_MEMOPS="${FI_EFA_SET_CUDA_SYNC_MEMOPS:-0}"
export FI_EFA_ENABLE_SHM_TRANSFER="${FI_EFA_ENABLE_SHM_TRANSFER:-0}"

# NCCL over aws-ofi-nccl. Megatron's own collectives must leave EFA bandwidth to the EP traffic: cap the channels.
export NCCL_MAX_NCHANNELS="${NCCL_MAX_NCHANNELS:-16}"
export NCCL_BUFFSIZE="${NCCL_BUFFSIZE:-8388608}"
export NCCL_P2P_NET_CHUNKSIZE="${NCCL_P2P_NET_CHUNKSIZE:-524288}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^docker,lo,veth}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# UCCL-EP on EFA: bootstrap over the same interfaces as NCCL; SRD is unordered, the proxies restore order.
export UCCL_SOCKET_IFNAME="${UCCL_SOCKET_IFNAME:-^docker,lo,veth}"
export UCCL_EP_TRANSPORT="${UCCL_EP_TRANSPORT:-verbs}"

# Megatron: one hardware queue keeps TP/SP communication kernels ordered with compute.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
