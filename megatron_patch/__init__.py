"""Make Megatron-LM (and Primus, which runs Megatron) accept and build ``--moe-token-dispatcher-type uccl``.

Call :func:`apply` once, before Megatron parses its arguments or builds the model::

    import megatron_patch
    megatron_patch.apply()

or start training through ``torchrun -m megatron_patch.pretrain_gpt <Megatron arguments>``, which does it for you.
For Primus, import :mod:`megatron_patch.primus` (or start through ``python -m megatron_patch.primus``), which registers
the same patch with Primus's patch registry.

What :func:`apply` changes, each in its own module, each without copying Megatron code:

- :mod:`megatron_patch.config`: ``'uccl'`` joins the ``Literal`` annotation of
  ``TransformerConfig.moe_token_dispatcher_type`` (the source of the generated ``--moe-token-dispatcher-type``
  choices), and ``TransformerConfig.__post_init__`` accepts ``uccl`` wherever it accepts ``alltoall``
  (shared-expert overlap, EP communication overlap);
- :mod:`megatron_patch.arguments`: the argparse choices, for Megatron versions that list them by hand;
- :mod:`megatron_patch.moe_layer`: ``MoELayer`` builds ``UCCLTokenDispatcher`` for ``uccl``;
- :mod:`megatron_patch.ep_overlap`: the EP-overlap schedule (``should_free_input``) keeps the tensors ``uccl``
  still needs in backward.

The patch is idempotent and checks what it touches: on a Megatron it does not understand it raises
:class:`UnsupportedMegatronVersion` naming the version and the missing piece, rather than training with a
half-applied patch.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

DISPATCHER_TYPE = "uccl"

__all__ = ["DISPATCHER_TYPE", "UnsupportedMegatronVersion", "apply", "is_applied", "megatron_version", "report"]


class UnsupportedMegatronVersion(RuntimeError):
    """The installed Megatron lacks something the patch relies on. The message names the version and the piece."""


@dataclass
class PatchReport:
    """What :func:`apply` did, for logs and for `uccl-ep-train doctor`."""

    megatron_version: str = "unknown"
    applied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"megatron-core {self.megatron_version}: uccl dispatcher patch"]
        lines += [f"  applied: {item}" for item in self.applied]
        lines += [f"  skipped: {item}" for item in self.skipped]
        return "\n".join(lines)


_LOCK = threading.Lock()
_REPORT: PatchReport | None = None


def megatron_version() -> str:
    """The installed megatron-core version string (``'unknown'`` if megatron.core has no version record)."""
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise UnsupportedMegatronVersion(
            f"megatron-core is not importable ({exc}); install megatron-core>=0.16 or put Megatron-LM on PYTHONPATH"
        ) from exc
    return str(getattr(package_info, "__version__", "unknown"))


_PATCHED = "__uccl_patched__"


def is_patched(fn) -> bool:
    """True when ``fn`` is one of our wrappers (so apply() never wraps a wrapper)."""
    return bool(getattr(fn, _PATCHED, False))


def mark_patched(wrapper, original):
    """Mark ``wrapper`` as ours and keep the Megatron function it replaces in ``wrapper.__uccl_original__``."""
    setattr(wrapper, _PATCHED, True)
    wrapper.__uccl_original__ = original
    return wrapper


def missing(what: str, where: str) -> UnsupportedMegatronVersion:
    """The error every patch module raises when a piece of Megatron it needs is not where it expects it."""
    return UnsupportedMegatronVersion(
        f"megatron_patch does not understand megatron-core {megatron_version()}: {what} not found in {where}. "
        "Supported: megatron-core 0.16 - 0.19 and Megatron-LM main; please report this version."
    )


def apply() -> PatchReport:
    """Patch the imported Megatron so that ``moe_token_dispatcher_type='uccl'`` is accepted and built.

    Safe to call any number of times, from any thread: the second call returns the first call's report.
    Raises UnsupportedMegatronVersion (changing nothing that later calls would trip over) when a required piece
    of Megatron is missing.
    """
    global _REPORT
    with _LOCK:
        if _REPORT is not None:
            return _REPORT
        report = PatchReport(megatron_version=megatron_version())
        # Locate everything first, then change: an unsupported version must not be left half patched.
        from megatron_patch import arguments, config, ep_overlap, moe_layer

        plans = [config.plan(), moe_layer.plan(), arguments.plan(), ep_overlap.plan()]
        for plan in plans:
            plan.apply(report)
        _REPORT = report
        return report


def is_applied() -> bool:
    return _REPORT is not None


def report() -> PatchReport | None:
    """The report of the applied patch, or None before :func:`apply`."""
    return _REPORT
