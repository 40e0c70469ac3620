#!/usr/bin/env bash
# Prepare a Python environment with uccl-ep-train installed, and print the interpreter to use.
#   default: a Python 3.12 virtual environment in .venv with torch, megatron-core, hydra and the project (editable).
#   UCCL_EP_PYTHON=/path/to/python: use that interpreter as it is (e.g. a GPU image with torch and no network);
#     the native module is built in place with CMake and nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
log=${UCCL_EP_SETUP_LOG:-/dev/stderr}

if [[ -n "${UCCL_EP_PYTHON:-}" ]]; then
  py=$UCCL_EP_PYTHON
  gpu=${UCCL_EP_WITH_GPU:-AUTO}
  cmake -S . -B build/inplace -G Ninja -DPython_EXECUTABLE="$py" -DUCCL_EP_INPLACE=ON -DUCCL_EP_WITH_GPU="$gpu" \
    -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >>"$log"
  cmake --build build/inplace -j"$(nproc)" >>"$log"
  echo "$py"
  exit 0
fi

find_python312() {
  for cand in "${PYTHON312:-}" "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12.1/bin/python")" \
              "$(command -v python3.12 || true)"; do
    if [[ -n "$cand" && -x "$cand" ]]; then echo "$cand"; return 0; fi
  done
  echo "setup.sh: no Python 3.12 found (megatron-core >= 0.17 needs it): install python3.12 or set PYTHON312" >&2
  return 1
}

if [[ ! -x .venv/bin/python ]]; then
  "$(find_python312)" -m venv .venv
fi
# No pip cache: torch's CUDA build and its libraries are several GB, and a cached copy would double what the
# install needs on disk (a CI run once failed with "No space left on device" in this step).
export PIP_NO_CACHE_DIR=1
{
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned here: the project itself does not pin torch (users bring their CUDA/ROCm build).
  .venv/bin/python -m pip install -q "torch==${UCCL_EP_TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e '.[test,recipes,plot]' "megatron-core==${UCCL_EP_MCORE_VERSION:-0.19.2}"
} >>"$log" 2>&1
echo "$PWD/.venv/bin/python"
