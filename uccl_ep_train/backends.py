"""The seam between ``Buffer`` (API, argument checks, streams, autograd) and whatever moves the tokens.

A backend receives arguments that ``Buffer`` has already validated, runs on the *current* CUDA stream (the Buffer makes
its communication stream current before calling), and returns plain tensors. Two exist:

* ``ReferenceBackend`` (uccl_ep_train.reference): pure torch over torch.distributed; any device, any topology.
* ``NativeIntranodeBackend`` (uccl_ep_train.intranode, built on the ``_C`` kernels): single node, CUDA/HIP.
  Multi-node runs look for ``NativeInternodeBackend`` in uccl_ep_train.internode.

Selection (``select_backend``): ``UCCL_EP_BACKEND`` (or ``Buffer(..., backend=...)``) = ``reference`` forces the
reference; ``native`` forces the kernels and raises if they are unavailable; ``auto`` takes the kernels when the module
was built with them and the group's device is CUDA, else the reference.

Handle contract. A dispatch handle is opaque to users but ``Buffer`` and the autograd wrappers read these attributes
(any backend's handle class must provide them):

* ``num_tokens`` (int): rows of the dispatched ``x`` on this rank (the rows ``combine`` returns).
* ``num_recv_rows`` (int): rows of the dispatch output (padding included), i.e. the rows ``combine`` expects.
* ``num_topk`` (int), ``num_ranks`` (int), ``expert_major`` (bool).
* ``is_token_in_rank`` ([num_tokens, num_ranks] bool).
* ``num_recv_tokens_per_expert`` ([num_local_experts] int32 tensor on the device, aligned): the counts that sync-free
  callers use instead of the host list.
* expert-major handles also: ``expert_major_token`` ([num_recv_rows] int64: the rank-major received row each
  expert-major row copies, -1 for padding) and ``expert_major_slot`` ([num_recv_rows] int64: the top-k slot of that
  row, -1 for padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Tuple

import torch

from uccl_ep_train import native


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built from: the group, its topology and the Buffer's sizes."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    num_ranks: int
    ranks_per_node: int
    device: torch.device
    num_nvl_bytes: int
    num_rdma_bytes: int
    settings: Any  # uccl_ep_train.settings.Settings

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node


@dataclass
class DispatchArgs:
    """Validated dispatch arguments. ``handle`` set means cached mode (``topk_idx``/``topk_weights`` are None)."""

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    handle: Optional[Any]
    num_tokens_per_rank: Optional[torch.Tensor]
    num_tokens_per_rdma_rank: Optional[torch.Tensor]
    is_token_in_rank: Optional[torch.Tensor]
    num_tokens_per_expert: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    expert_major: bool = False
    config: Any = None


@dataclass
class DispatchResult:
    """What a backend's dispatch returns (``Buffer`` turns it into DeepEP's tuple).

    Rank-major: recv_x [rows, H], recv_topk_idx/weights [rows, K]. Expert-major: recv_x [rows, H],
    recv_topk_idx [rows] (local expert of the row, -1 padding), recv_topk_weights [rows]. Cached mode: the
    topk outputs and the list are None.
    """

    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[List[int]]
    handle: Any
    traffic: Any = None  # reference: TrafficReport of this call; native: None or its own counters


class Backend(Protocol):
    """What ``Buffer`` needs from a backend. Every method runs on the current stream and may assume valid input."""

    name: str

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool)."""

    def dispatch(self, args: DispatchArgs) -> DispatchResult: ...

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor], config: Any
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(combined_x [num_tokens, H] in x's dtype, combined_topk_weights [num_tokens, K] float32 or None)."""

    def destroy(self) -> None: ...


def check_combine_element_size(size: int) -> None:
    """The buffer hints' ``combine_element_size``: a combine's rows cross in x's dtype, bfloat16 or float32."""
    if size not in (2, 4):
        raise ValueError(f"combine_element_size must be 2 (bfloat16 combine) or 4 (float32), not {size}")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why and what to change."""


def _native_class(ctx: BackendContext):
    """The native backend class for this topology, or raise BackendUnavailable saying why not."""
    if not native.has_kernels():
        why = "uccl_ep_train._C has no GPU kernels" if native.available() else native._load()[1]
        raise BackendUnavailable(f"native backend unavailable: {why}. Build with a GPU toolchain "
                                 "(UCCL_EP_WITH_GPU=CUDA or HIP) or set UCCL_EP_BACKEND=reference")
    if ctx.device.type != "cuda":
        raise BackendUnavailable(f"native backend needs the group's device to be a GPU, got {ctx.device} "
                                 "(use an NCCL group, or set UCCL_EP_BACKEND=reference)")
    module_name, class_name = (("uccl_ep_train.intranode", "NativeIntranodeBackend") if ctx.num_nodes == 1
                               else ("uccl_ep_train.internode", "NativeInternodeBackend"))
    import importlib

    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"native backend unavailable for {ctx.num_nodes} node(s): {module_name}."
                                 f"{class_name} cannot be loaded ({exc}); set UCCL_EP_BACKEND=reference") from None


def select_backend(ctx: BackendContext, choice: Optional[str] = None) -> Backend:
    """Build the backend named by ``choice`` (default: ``ctx.settings.kernel.backend``): auto | native | reference."""
    choice = (choice or ctx.settings.kernel.backend).strip().lower()
    if choice not in ("auto", "native", "reference"):
        raise ValueError(f"backend={choice!r}: must be one of auto, native, reference")
    if choice in ("auto", "native"):
        try:
            cls = _native_class(ctx)
        except BackendUnavailable:
            if choice == "native":
                raise
        else:
            return cls(ctx)
    from uccl_ep_train.reference import ReferenceBackend

    return ReferenceBackend(ctx)
