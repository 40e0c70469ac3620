#!/usr/bin/env bash
# The README's test command: set everything up, then run the CPU test suite (GPU tests skip without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
exec "$py" -m pytest -q -ra tests "$@"
