"""MoELayer builds UCCLTokenDispatcher when ``config.moe_token_dispatcher_type == 'uccl'``.

MoELayer.__init__ chooses its dispatcher with an if/elif over the type string and raises on anything else, then
goes on to build experts and shared experts (and hands the shared experts to the dispatcher for overlap). To keep
all of that Megatron's own code, the wrapper runs the original __init__ with the type reading ``'alltoall'`` and
with the name ``MoEAlltoAllTokenDispatcher`` in the moe_layer module resolving to UCCLTokenDispatcher, for the
duration of that one call. Both dispatchers take the same constructor arguments in every supported version
``(num_local_experts, local_expert_indices, config=, pg_collection=)``.

Construction is single-threaded in Megatron; a lock keeps two concurrent constructions from seeing each other's
substitution anyway.
"""
from __future__ import annotations

import functools
import threading

from megatron_patch import DISPATCHER_TYPE, is_patched, mark_patched, missing

MODULE = "megatron.core.transformer.moe.moe_layer"
STAND_IN_TYPE = "alltoall"
STAND_IN_CLASS = "MoEAlltoAllTokenDispatcher"
_BUILD_LOCK = threading.RLock()


def dispatcher_class():
    from uccl_ep_train.megatron.dispatcher import UCCLTokenDispatcher

    return UCCLTokenDispatcher


class _Plan:
    def __init__(self, module, moe_layer_cls):
        self.module, self.cls = module, moe_layer_cls

    def apply(self, report) -> None:
        original = self.cls.__init__
        if not is_patched(original):
            self.cls.__init__ = _building_uccl(original, self.module)
        report.applied.append(f"MoELayer.__init__: builds UCCLTokenDispatcher for '{DISPATCHER_TYPE}'")


def _building_uccl(original, module):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return original(self, config, *args, **kwargs)
        uccl_cls = dispatcher_class()
        with _BUILD_LOCK:
            stand_in = getattr(module, STAND_IN_CLASS)
            setattr(module, STAND_IN_CLASS, uccl_cls)
            object.__setattr__(config, "moe_token_dispatcher_type", STAND_IN_TYPE)
            try:
                original(self, config, *args, **kwargs)
            finally:
                object.__setattr__(config, "moe_token_dispatcher_type", DISPATCHER_TYPE)
                setattr(module, STAND_IN_CLASS, stand_in)
        if not isinstance(self.token_dispatcher, uccl_cls):
            raise missing(f"the '{STAND_IN_TYPE}' branch building {STAND_IN_CLASS}", f"{MODULE}.MoELayer.__init__")

    return mark_patched(__init__, original)


def plan() -> _Plan:
    import importlib

    try:
        module = importlib.import_module(MODULE)
    except ImportError as exc:
        raise missing("the MoE layer module", f"{MODULE} ({exc})") from exc
    cls = getattr(module, "MoELayer", None)
    if cls is None:
        raise missing("class MoELayer", MODULE)
    if not hasattr(module, STAND_IN_CLASS):
        raise missing(f"the name {STAND_IN_CLASS}", MODULE)
    try:
        import inspect

        source = inspect.getsource(getattr(cls.__init__, "__uccl_original__", cls.__init__))
    except (OSError, TypeError):
        source = None
    if source is not None and (STAND_IN_CLASS not in source or f'"{STAND_IN_TYPE}"' not in source
                               and f"'{STAND_IN_TYPE}'" not in source):
        raise missing(f"the '{STAND_IN_TYPE}' dispatcher branch", f"{MODULE}.MoELayer.__init__")
    return _Plan(module, cls)
