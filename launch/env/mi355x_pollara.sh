# shellcheck shell=bash source-path=SCRIPTDIR
# Environment of AMD MI355X nodes with 8x AMD Pollara 400G NICs (ionic). Sourced by
# launch/mi300x_thor2.sbatch (ENV_FILE=mi355x_pollara.sh) and by `uccl-ep-train train cluster=mi355x_pollara`.
# Format (the Python launcher parses it): one `export NAME="${NAME:-value}"` per line, so a value already set in
# the caller's environment wins; `source "$(dirname "${BASH_SOURCE[0]}")/FILE.sh"` reads a file beside this one
# (the one form of source it follows). Comments and blank lines are ignored.

# What every AMD cluster shares: RCCL, UCCL-EP transport, ROCm.
# shellcheck source=amd_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/amd_common.sh"

# RoCE: Pollara device names, RoCE v2 GID (check `show_gids` on your nodes), traffic class for the lossless queue.
export NCCL_IB_HCA="${NCCL_IB_HCA:-ionic_0,ionic_1,ionic_2,ionic_3,ionic_4,ionic_5,ionic_6,ionic_7}"
export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"
export NCCL_IB_TC="${NCCL_IB_TC:-104}"

# UCCL-EP on Pollara: same NICs and GID as RCCL; 4 MiB in flight per proxy thread (one write: amd_common.sh),
# or the NIC reports transport retry errors under EP load.
export UCCL_IB_HCA="${UCCL_IB_HCA:-ionic_0,ionic_1,ionic_2,ionic_3,ionic_4,ionic_5,ionic_6,ionic_7}"
export UCCL_IB_GID_INDEX="${UCCL_IB_GID_INDEX:-3}"
export UCCL_IB_TC="${UCCL_IB_TC:-104}"
export UCCL_IB_MAX_INFLIGHT_BYTES="${UCCL_IB_MAX_INFLIGHT_BYTES:-4194304}"
