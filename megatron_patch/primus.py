"""``moe_token_dispatcher_type: uccl`` in Primus.

Primus reads its YAML configs itself and hands the values to Megatron without going through argparse choices, so
the value arrives at TransformerConfig and MoELayer unchanged: those must accept it, which is what
:func:`megatron_patch.apply` does. This module registers that as a Primus patch (backend ``megatron``, phase
``setup``: before Primus builds the Megatron arguments and the model), so it runs at the right moment of Primus's
lifecycle on every rank.

Primus has no plugin discovery for patches: the registration must happen in each training process before the
runtime starts. Start the workers through this module instead of Primus's CLI entry point, same arguments::

    torchrun ... -m megatron_patch.primus train pretrain --config exp.yaml      # instead of primus/cli/main.py

and in the experiment YAML::

    modules:
      pre_trainer:
        overrides:
          moe_token_dispatcher_type: uccl

Importing this module when Primus is importable registers the patch (idempotent); :func:`register` does it
explicitly and says why when it cannot.
"""
from __future__ import annotations

import sys

from megatron_patch import DISPATCHER_TYPE

PATCH_ID = "uccl_ep_train.megatron.uccl_token_dispatcher"
PHASE = "setup"
# Primus runs lower numbers first; the dispatcher type must be understood before any patch that reads it.
PRIORITY = 10


class PrimusUnavailable(RuntimeError):
    """Primus (or its patch registry) is not importable here."""


def _register_patch():
    try:
        from primus.core.patches import register_patch
    except ImportError as exc:
        raise PrimusUnavailable(f"Primus's patch registry (primus.core.patches.register_patch) is not importable "
                                f"({exc}); install Primus (https://github.com/AMD-AGI/Primus) or run Megatron "
                                "directly through megatron_patch.pretrain_gpt") from exc
    return register_patch


def wants_uccl(ctx) -> bool:
    """Patch condition: the module config asks for uccl. Unknown context shapes apply the patch anyway: it only
    adds an accepted value and leaves every other dispatcher type untouched."""
    module_config = getattr(ctx, "extra", {}).get("module_config")
    params = getattr(module_config, "params", None)
    if params is None:
        return True
    value = getattr(params, "moe_token_dispatcher_type", None)
    if value is None and isinstance(params, dict):
        value = params.get("moe_token_dispatcher_type")
    return value is None or value == DISPATCHER_TYPE


def apply_for_primus(ctx) -> None:
    """The registered handler."""
    import megatron_patch

    report = megatron_patch.apply()
    print(f"[{PATCH_ID}] {report}", flush=True)


def register() -> None:
    """Register the patch with Primus's registry (re-registering replaces the entry: idempotent)."""
    register_patch = _register_patch()
    register_patch(PATCH_ID, backend="megatron", phase=PHASE, priority=PRIORITY, condition=wants_uccl,
                   description="accept and build moe_token_dispatcher_type='uccl' (uccl-ep-train)")(apply_for_primus)


def main(argv: list[str] | None = None) -> None:
    """Register, then hand over to Primus's command line with the same arguments."""
    register()
    from primus.cli import main as primus_main

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    primus_main.main()


try:
    register()
except PrimusUnavailable:
    pass

if __name__ == "__main__":
    main()
