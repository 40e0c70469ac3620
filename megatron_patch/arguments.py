"""``--moe-token-dispatcher-type uccl`` passes Megatron's argument parser.

Recent Megatron (0.19 for one) generates the flag from the TransformerConfig field (``ArgumentGroupFactory`` reads the ``Literal``
annotation, which :mod:`megatron_patch.config` extends). Older Megatron-LM lists the choices by hand in
``_add_moe_args``. Both are covered by one mechanism: after Megatron has added its arguments to a parser
(``add_megatron_arguments``, or ``_add_moe_args`` where that is the only hook), the action whose destination is
``moe_token_dispatcher_type`` gets ``uccl`` appended to its choices if it is not there yet. argparse keeps
rejecting anything else and keeps listing the choices in its error.

``megatron.training`` does not ship in every megatron-core wheel (0.16 lacks it; Megatron-LM provides it): then there is
no parser to patch and this part is skipped (the report says so).
"""
from __future__ import annotations

import argparse
import functools
import importlib

from megatron_patch import DISPATCHER_TYPE, is_patched, mark_patched, missing

MODULE = "megatron.training.arguments"
DEST = "moe_token_dispatcher_type"
# Functions that add the dispatcher flag to a parser, outermost first; the first one present is wrapped.
HOOKS = ("add_megatron_arguments", "_add_moe_args")


def extend_choices(parser: argparse.ArgumentParser) -> bool:
    """Add 'uccl' to the choices of every action with dest moe_token_dispatcher_type. True if one was found."""
    found = False
    for action in parser._actions:  # argparse has no public way to reach an added action
        if action.dest != DEST:
            continue
        found = True
        if action.choices is not None and DISPATCHER_TYPE not in action.choices:
            action.choices = list(action.choices) + [DISPATCHER_TYPE]
        if action.help and DISPATCHER_TYPE not in action.help:
            action.help = action.help.rstrip() + " ('uccl': uccl-ep-train's dispatcher, see docs/megatron.md)"
    return found


class _Plan:
    def __init__(self, module, hook):
        self.module, self.hook = module, hook

    def apply(self, report) -> None:
        if self.module is None:
            report.skipped.append(f"--moe-token-dispatcher-type argparse choices: {self.hook}")
            return
        original = getattr(self.module, self.hook)
        if not is_patched(original):
            setattr(self.module, self.hook, _extending(original))
        report.applied.append(f"{MODULE}.{self.hook}: --moe-token-dispatcher-type accepts '{DISPATCHER_TYPE}'")


def _extending(original):
    @functools.wraps(original)
    def hook(parser, *args, **kwargs):
        result = original(parser, *args, **kwargs)
        target = result if isinstance(result, argparse.ArgumentParser) else parser
        if not extend_choices(target):
            raise missing("the --moe-token-dispatcher-type argument", f"the parser built by {original.__qualname__}")
        return result

    return mark_patched(hook, original)


def plan() -> _Plan:
    try:
        module = importlib.import_module(MODULE)
    except ImportError as exc:
        # Not shipped (e.g. the megatron-core 0.16 wheel) or not importable here: no parser exists to patch, and
        # any later import would fail the same way.
        return _Plan(None, f"{MODULE} is not importable ({exc}); nothing to patch")
    for name in HOOKS:
        if callable(getattr(module, name, None)):
            return _Plan(module, name)
    raise missing(f"any of {', '.join(HOOKS)}", MODULE)
