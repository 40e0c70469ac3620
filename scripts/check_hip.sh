#!/usr/bin/env bash
# Compile-check the GPU kernels with hipcc for AMD (device code for CDNA2 gfx90a, plus the host launchers).
# Used by CI; see docs/intranode.md. Exits non-zero on the first compile error.
# HIP_ARCHS overrides the targets (space separated), e.g. HIP_ARCHS="gfx90a gfx942" with a ROCm that knows gfx942.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
hipcc="${HIPCC:-$(command -v hipcc || true)}"
if [[ -z "$hipcc" ]]; then
  echo "check_hip: hipcc not found (apt install hipcc, or set HIPCC)" >&2
  exit 2
fi
archs="${HIP_ARCHS:-gfx90a}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
offload=()
for a in $archs; do offload+=("--offload-arch=$a"); done
for src in "$root"/csrc/kernels/layout.cu "$root"/csrc/kernels/intranode.cu "$root"/csrc/kernels/expert_major.cu \
    "$root"/csrc/kernels/internode_plan.cu "$root"/csrc/kernels/expert_major_receive.cu \
    "$root"/csrc/kernels/clock_probe.cu; do
  echo "check_hip: $hipcc ${offload[*]} -x hip -c $(basename "$src")"
  HIP_PLATFORM=amd "$hipcc" "${offload[@]}" -std=c++17 -O2 -x hip -I"$root/csrc/include" -Werror=return-type \
    -I"$root/csrc" -c "$src" -o "$out/$(basename "$src").o"
done
echo "check_hip: OK (device code for: $archs)"
