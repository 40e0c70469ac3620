"""How UCCLTokenDispatcher behaves, and where each knob comes from.

From Megatron's TransformerConfig (the flags users already pass):

| TransformerConfig field | effect here |
| --- | --- |
| ``num_moe_experts``, ``moe_router_topk`` | expert count, top-k width of the routing |
| ``moe_router_dtype`` | ``fp64`` keeps permuted probs in float64 (as flex does); else float32 |
| ``moe_shared_expert_overlap`` | shared expert runs on its own stream, overlapping dispatch/combine |
| ``moe_expert_capacity_factor`` | the router drops tokens over capacity; dropped slots are sent as -1 |

``moe_flex_dispatcher_num_sms`` (flex's knob) is not read: the kernels' SMs come from UCCL_EP_NUM_SMS.

From uccl-ep-train's settings (environment, uccl_ep_train.settings; the ``dispatcher`` group there):

| field | environment | default | effect |
| --- | --- | --- | --- |
| ``async_comm`` | UCCL_EP_ASYNC_COMM | True | dispatch/combine on the Buffer's communication stream (CUDA) |
| ``fp8_dispatch`` | UCCL_EP_DISPATCH_FP8 | False | send tokens as FP8 e4m3 + per-128-channel scales |
| ``sync_free`` | UCCL_EP_SYNC_FREE | False | no host sync: fixed-size outputs, counts stay on the device |
| ``num_worst_tokens`` | UCCL_EP_NUM_WORST_TOKENS | 0 | sync-free rows received (0: the worst case, see below) |
| ``expert_major`` | UCCL_EP_EXPERT_MAJOR | True | receive in expert-major order when the Buffer can |

The worst case of ``num_worst_tokens`` = 0 is tokens x ranks, times min(top-k, local experts) with the
expert-major receive; with ``moe_expert_capacity_factor`` set it is at most local experts x ranks x the router's
capacity (dispatcher.sync_free_rows). The constructor's ``options=`` overrides them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class DispatcherOptions:
    async_comm: bool = True
    fp8_dispatch: bool = False
    sync_free: bool = False
    num_worst_tokens: int = 0
    expert_major: bool = True

    def __post_init__(self) -> None:
        if self.num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens={self.num_worst_tokens} must be >= 0 (0: the worst case)")
        if self.num_worst_tokens and not self.sync_free:
            raise ValueError("num_worst_tokens only applies in sync-free mode: set sync_free too "
                             "(UCCL_EP_SYNC_FREE=1), or leave num_worst_tokens at 0")


def load_options(settings: Any = None) -> DispatcherOptions:
    """Options from the ``dispatcher`` group of uccl_ep_train.settings (the defaults while it has none)."""
    if settings is None:
        from uccl_ep_train.settings import load_settings

        settings = load_settings()
    group = getattr(settings, "dispatcher", None)
    if group is None:
        return DispatcherOptions()
    values = {f.name: getattr(group, f.name) for f in dataclasses.fields(DispatcherOptions) if hasattr(group, f.name)}
    return DispatcherOptions(**values)


def buffer_supports_expert_major() -> bool:
    """True when uccl_ep_train.Buffer.dispatch can receive in expert-major order (``expert_major=`` argument)."""
    try:
        import inspect

        from uccl_ep_train.buffer import Buffer
    except ImportError:
        return False
    try:
        return "expert_major" in inspect.signature(Buffer.dispatch).parameters
    except (TypeError, ValueError):
        return False


def receives_expert_major(config: Any, options: Optional[DispatcherOptions] = None) -> bool:
    """Whether a uccl layer built from ``config`` hands received tokens to the experts without a local permute."""
    options = load_options() if options is None else options
    return options.expert_major and buffer_supports_expert_major()
