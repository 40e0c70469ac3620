"""EP communication overlap (``--overlap-moe-expert-parallel-comm``) with ``uccl``.

The overlap schedule cuts a MoE layer into nodes (pre-dispatch, dispatch, mlp, combine) and frees a node's input
after its forward when backward will not need it (``should_free_input``). Which inputs are needed depends on the
dispatcher, and Megatron decides by comparing the type string against 'alltoall' and 'flex'+backend; an unknown
type would fall into the alltoall answer, which is wrong for uccl:

- dispatch node: uccl's dispatch_preprocess only reshapes, so the dispatch input shares storage with the pre-MLP
  layernorm output that the router's backward still needs. Like flex over DeepEP, it must not be freed.
- mlp node: when uccl permutes locally (dispatch_postprocess copies), the received tokens can be freed, as with
  DeepEP. When the Buffer receives in expert-major order there is no copy: the received tokens go straight to the
  grouped GEMM, which saves them for backward, exactly as with HybridEP.

So the wrapper answers for uccl by asking Megatron's own function about the flex backend uccl behaves like
('deepep' or 'hybridep'), through a read-only view of the config. The other callables of the schedule
(``build_transformer_layer_callables``) need nothing: their flex-only branches reach into the flex dispatcher's
``_comm_manager``, while UCCLTokenDispatcher takes its tensors from its arguments like alltoall does.

Megatron moved ``should_free_input`` between versions (megatron.core.models.gpt.fine_grained_callables in 0.16,
megatron.core.models.common.utils later) and changed its arguments; every module holding it is patched, and extra
arguments are passed through. If a version has the overlap schedule but no ``should_free_input`` we recognise,
``uccl`` refuses EP overlap with a clear error (megatron_patch.config) instead of freeing tensors blindly.
"""
from __future__ import annotations

import functools
import importlib

from megatron_patch import DISPATCHER_TYPE, is_patched, mark_patched

MODULES = ("megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables")
FUNCTION = "should_free_input"
_state = {"supported": False, "why": "megatron_patch.apply() has not run"}


def supported() -> bool:
    return bool(_state["supported"])


def why_unsupported() -> str:
    return str(_state["why"])


class FlexView:
    """The config as Megatron's flex branches should see it for a uccl layer; every other attribute passes
    through unchanged. Read-only: nothing written here could reach the real config."""

    def __init__(self, config, backend: str):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_backend", backend)

    def __getattr__(self, name):
        if name == "moe_token_dispatcher_type":
            return "flex"
        if name == "moe_flex_dispatcher_backend":
            return self._backend
        if name == "moe_enable_deepep":
            return self._backend == "deepep"
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"FlexView is read-only (tried to set {name})")


def flex_backend_like_uccl(config) -> str:
    """'hybridep' when uccl hands the received tokens to the experts without a copy, else 'deepep'."""
    from uccl_ep_train.megatron.options import receives_expert_major

    return "hybridep" if receives_expert_major(config) else "deepep"


def _answering_for_uccl(original):
    @functools.wraps(original)
    def should_free_input(name, is_moe, config, *args, **kwargs):
        if getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE:
            config = FlexView(config, flex_backend_like_uccl(config))
        return original(name, is_moe, config, *args, **kwargs)

    return mark_patched(should_free_input, original)


class _Plan:
    def __init__(self, targets, why):
        self.targets, self.why = targets, why

    def apply(self, report) -> None:
        for module in self.targets:
            fn = getattr(module, FUNCTION)
            if not is_patched(fn):
                setattr(module, FUNCTION, _answering_for_uccl(fn))
            report.applied.append(f"{module.__name__}.{FUNCTION}: answers for '{DISPATCHER_TYPE}' like flex")
        _state["supported"] = bool(self.targets)
        _state["why"] = self.why
        if not self.targets:
            report.skipped.append(f"EP overlap: {self.why}; --overlap-moe-expert-parallel-comm is refused with uccl")


def plan() -> _Plan:
    targets, notes = [], []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            notes.append(f"{name} not importable ({exc})")
            continue
        if callable(getattr(module, FUNCTION, None)):
            targets.append(module)
    return _Plan(targets, "; ".join(notes) or f"no {FUNCTION} in {', '.join(MODULES)}")
