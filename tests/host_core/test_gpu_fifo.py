"""Device-side push (fifo_device.cuh) against the host Fifo on a real GPU: no loss, no duplicates, per-producer
order, and the drain rate. Runs only where nvcc and a CUDA GPU exist (the lent GPU machines)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(NVCC is None or not _has_gpu(), reason="needs nvcc and a CUDA GPU")
def test_gpu_producers_push_every_command_exactly_once_in_order(tmp_path):
    exe = tmp_path / "gpu_fifo_check"
    subprocess.run([NVCC, "-std=c++17", "-O2", "-arch=sm_90", "-DUCCL_EP_WITH_CUDA=1",
                    f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc", os.path.join(os.path.dirname(__file__), "gpu_fifo_check.cu"),
                    f"{ROOT}/csrc/proxy/fifo.cpp", "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
