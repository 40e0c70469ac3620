"""Loading the compiled module `uccl_ep_train._C`, and saying why when it cannot be used."""
from __future__ import annotations

import functools
from types import ModuleType


class NativeUnavailable(RuntimeError):
    """The native module is missing or was built without what the caller needs."""


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    try:
        from uccl_ep_train import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # not built: a pure-Python checkout
        return None, f"uccl_ep_train._C is not built ({exc}); run `pip install -e .`"
    return _C, ""


def module() -> ModuleType:
    """The native module; raises NativeUnavailable with the reason when it is absent."""
    mod, why = _load()
    if mod is None:
        raise NativeUnavailable(why)
    return mod


def available() -> bool:
    return _load()[0] is not None


def has_kernels() -> bool:
    """True when the module carries GPU kernels (CUDA or HIP) — not whether a GPU is present."""
    mod, _ = _load()
    return mod is not None and getattr(mod, "gpu_backend", "NONE") != "NONE" and hasattr(mod, "kernels")


def stream_handle(device=None) -> int:
    """The caller's current CUDA (or HIP) stream as the integer the native launchers take; 0 on a CPU device (the
    CPU stand-ins of the native module have no streams).

    Asked several times per dispatch or combine: ``torch.cuda.current_stream()`` builds a Stream object each time
    (~4 us on an idle host, ~10 us beside the loopback's busy proxy threads on 2x H200: 45-75 us per internode call,
    session 12), while torch's raw getter returns the handle alone."""
    import torch

    if device is not None and device.type != "cuda":
        return 0
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
