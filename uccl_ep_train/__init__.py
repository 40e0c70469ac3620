"""uccl-ep-train: portable expert-parallel dispatch/combine for MoE training.

The public API mirrors DeepEP v1: ``Buffer``, ``Config``, ``EventOverlap``. Importing this package needs torch only
when you touch those names, so the command line and `doctor` run on machines without torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {"Buffer": "uccl_ep_train.buffer", "Config": "uccl_ep_train.buffer", "EventOverlap": "uccl_ep_train.buffer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'uccl_ep_train' has no attribute {name!r}")


__all__ = ["Buffer", "Config", "EventOverlap", "__version__"]
