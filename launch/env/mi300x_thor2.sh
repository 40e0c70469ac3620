# shellcheck shell=bash source-path=SCRIPTDIR
# Environment of AMD MI300X nodes with 8x Broadcom Thor-2 400G RoCE NICs (bnxt_re). Sourced by
# launch/mi300x_thor2.sbatch and embedded by `uccl-ep-train train cluster=mi300x_thor2`.
# Format (the Python launcher parses it): one `export NAME="${NAME:-value}"` per line, so a value already set in
# the caller's environment wins; `source "$(dirname "${BASH_SOURCE[0]}")/FILE.sh"` reads a file beside this one
# (the one form of source it follows). Comments and blank lines are ignored.

# What every AMD cluster shares: RCCL, UCCL-EP transport, ROCm.
# shellcheck source=amd_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/amd_common.sh"

# RoCE: Broadcom device names, RoCE v2 GID (check `show_gids` on your nodes), traffic class for the lossless queue.
export NCCL_IB_HCA="${NCCL_IB_HCA:-bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3,bnxt_re4,bnxt_re5,bnxt_re6,bnxt_re7}"
export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"
export NCCL_IB_TC="${NCCL_IB_TC:-104}"

# UCCL-EP on Thor-2: same NICs and GID as RCCL; 1.5 MiB in flight per proxy thread (one write: amd_common.sh),
# or the NIC reports transport retry errors under EP load.
export UCCL_IB_HCA="${UCCL_IB_HCA:-bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3,bnxt_re4,bnxt_re5,bnxt_re6,bnxt_re7}"
export UCCL_IB_GID_INDEX="${UCCL_IB_GID_INDEX:-3}"
export UCCL_IB_TC="${UCCL_IB_TC:-104}"
export UCCL_IB_MAX_INFLIGHT_BYTES="${UCCL_IB_MAX_INFLIGHT_BYTES:-1572864}"
