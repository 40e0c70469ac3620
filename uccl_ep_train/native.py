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
