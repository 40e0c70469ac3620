#!/usr/bin/env bash
# The README's main job: set everything up, then train the tiny DeepSeek-V3-shaped model on this host's GPUs
# with mock data and the uccl dispatcher. Extra arguments are Hydra overrides (e.g. dispatcher=alltoall).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
exec "$py" -m uccl_ep_train train model=tiny_1gpu dispatcher=uccl cluster=local "$@"
