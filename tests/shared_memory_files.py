"""Shared-memory files of the CPU stand-ins of the native modules (tests/*/fake_*_native.py): what a rank maps where
the GPU build maps IPC handles or registers memory, and the sweep of the files that killed ranks left behind."""
from __future__ import annotations

import os

import torch

SHM = "/dev/shm"


def sweep_leftovers(prefix: str) -> None:
    """Remove ``prefix-<pid>-...`` files whose process no longer exists (killed before it could destroy them)."""
    for f in os.listdir(SHM):
        if f.startswith(prefix + "-"):
            try:
                os.kill(int(f[len(prefix) + 1:].split("-")[0]), 0)
            except ProcessLookupError:
                try:
                    os.unlink(os.path.join(SHM, f))
                except OSError:
                    pass
            except (ValueError, PermissionError):
                pass


def map_file(name: str, nbytes: int, create: bool) -> torch.Tensor:
    """uint8 tensor over the shared file ``name`` (created, reading as zeros, when ``create``)."""
    path = os.path.join(SHM, name)
    if not create and not os.path.exists(path):
        raise RuntimeError(f"shared memory {path} is gone (its rank exited, or unlinked it before this rank mapped it)")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
