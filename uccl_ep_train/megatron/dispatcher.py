"""UCCLTokenDispatcher: Megatron's MoE token dispatcher contract on top of uccl_ep_train.Buffer.

Selected with ``--moe-token-dispatcher-type uccl`` once :func:`megatron_patch.apply` has run. The six hooks:

1. ``dispatch_preprocess(hidden [S, B, H], routing_map [T, E] bool, probs [T, E])``: flatten to [T, H], turn the
   multi-hot routing into top-k expert ids (``-1`` for a slot the router dropped) and gather the top-k probs (the
   gather carries the gradient back to ``probs``). No communication.
2. ``token_dispatch(hidden, topk_probs)``: layout + dispatch through the Buffer. Each token travels once per
   destination rank, with its top-k ids and probs. Backward of this step is a combine.
3. ``dispatch_postprocess(recv, recv_probs) -> (tokens, tokens_per_expert, probs)``: local expert-major order.
   When the Buffer received in expert-major order already, nothing is left to do; else a stable local permute.
   ``tokens_per_expert`` is a CPU int64 tensor (experts call ``.tolist()``), or a device tensor in sync-free mode.
4. ``combine_preprocess``: the inverse of 3 (sum of a token's rows over the local experts).
5. ``token_combine``: combine through the Buffer (sum of the copies of each token). Backward is a cached dispatch.
6. ``combine_postprocess``: adds the overlapped shared-expert output, restores the input shape.

Probs are applied inside the experts (as with every Megatron dispatcher), so combine sums without weights.

Tensor/expert parallelism: like Megatron's flex dispatcher, communication spans the TP x EP group
(``pg_collection.tp_ep``): a token routed to expert e goes to every expert-TP rank of e's EP rank, each TP rank
computes a partial result, and combine's sum over copies adds the partials. That is done by routing over
``num_experts * tp`` virtual experts; with TP = 1 it is plain EP.

Streams: with CUDA and ``async_comm``, layout/dispatch/combine run on the Buffer's communication stream and the
compute stream waits on their events, so the shared expert (own stream) overlaps them. On CPU (gloo) every call
completes before it returns.

Every knob and its source (TransformerConfig field or uccl setting) is listed in uccl_ep_train.megatron.options.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional

import torch

from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from uccl_ep_train.megatron.options import DispatcherOptions, buffer_supports_expert_major, load_options
from uccl_ep_train.reference import count_ids, worst_case_rows

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _pg_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def sync_free_rows(num_tokens: int, comm_size: int, topk: int, num_experts: int, num_local_experts: int,
                   expert_major: bool, capacity_factor: Optional[float] = None, asked: int = 0) -> int:
    """Rows a rank receives in sync-free mode (the dispatch's num_worst_tokens). ``asked``
    (UCCL_EP_NUM_WORST_TOKENS) wins. Else the worst case: every token of every rank, once per rank (rank-major) or
    once per selected local expert (expert-major: at most min(top-k, local experts) per token). Where Megatron's
    router drops tokens over capacity (``capacity_factor``, moe_expert_capacity_factor), an expert takes at most
    its capacity from each rank (the router's get_capacity of num_tokens x top-k over the experts), so a rank
    receives at most local experts x ranks x capacity (token, local expert) pairs, and so at most that many rows
    either way: the worst case shrinks to it (at DeepSeek-V3 shape on EP 2 with factor 1.0, expert-major, from
    65536 rows to 32768, each row past the received ones zeroed every call). With expert TP the local experts
    are virtual, one per TP rank of each, and each still takes at most the capacity from a rank."""
    if asked:
        return asked
    worst = worst_case_rows(num_tokens, comm_size, topk, num_local_experts, expert_major)
    if capacity_factor is None:
        return worst
    capacity = min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)
    return max(1, min(worst, num_local_experts * comm_size * capacity))


# --------------------------------------------------------------------------------------------------------------
# One Buffer per communication group, grown when a layer needs more room (as DeepEP users do).
# --------------------------------------------------------------------------------------------------------------
_BUFFERS: dict = {}
_BUFFERS_LOCK = threading.Lock()


def _buffer_sizes(buffer_cls, num_ranks: int, hidden_bytes: int, ranks_per_node: int) -> tuple[int, int]:
    """The sizes DeepEP's Config hints ask for (what Buffer checks a hidden size against)."""
    nvl, rdma = 0, 0
    for getter in ("get_dispatch_config", "get_combine_config"):
        get = getattr(buffer_cls, getter, None)
        if get is None:
            continue
        cfg = get(num_ranks)
        if hasattr(cfg, "get_nvl_buffer_size_hint"):
            nvl = max(nvl, int(cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node)))
        if hasattr(cfg, "get_rdma_buffer_size_hint"):
            rdma = max(rdma, int(cfg.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node)))
    return nvl, rdma


def get_buffer(group, hidden_bytes: int, num_tokens: int = 0, num_topk: int = 0, num_worst_tokens: int = 0):
    """The shared Buffer of ``group`` with room for ``num_tokens`` tokens of ``hidden_bytes`` each, top-k width
    ``num_topk`` and, in sync-free mode, ``num_worst_tokens`` received rows (created, or grown, on demand)."""
    from uccl_ep_train.buffer import Buffer

    from uccl_ep_train.buffer import _resolve_ranks_per_node
    from uccl_ep_train.settings import load_settings

    num_ranks = torch.distributed.get_world_size(group)
    per_node = _resolve_ranks_per_node(None, load_settings(), num_ranks)  # as the Buffer will resolve it
    nvl, rdma = _buffer_sizes(Buffer, num_ranks, hidden_bytes, per_node)
    # The hints take the hidden size in BF16 units of a row's bytes, so float32 rows are sized right as twice as wide.
    if num_tokens and per_node < num_ranks and hasattr(Buffer, "get_internode_bytes_hint"):
        # Across nodes (real or emulated) the internode backend runs, alone: its staged areas must hold a whole call
        # (without this the RDMA hint was asked for one node, 0 bytes, and the backend refused large layers), and
        # nothing of it grows with num_worst_tokens, whose outputs are torch tensors. The intranode hint does grow
        # with it: asked here too until session 49, it made a sync-free expert-major DeepSeek-V3 layer on 2 x 8
        # GPUs allocate 15.0 GB of NVL buffer per GPU where 1.9 GB hold every call.
        inter_nvl, inter_rdma = Buffer.get_internode_bytes_hint(num_tokens, hidden_bytes // 2, num_topk, num_ranks,
                                                                per_node)
        nvl, rdma = max(nvl, inter_nvl), max(rdma, inter_rdma)
    elif num_tokens and hasattr(Buffer, "get_nvl_bytes_hint"):
        nvl = max(nvl, Buffer.get_nvl_bytes_hint(num_tokens, hidden_bytes // 2, num_topk, num_ranks,
                                                 num_worst_tokens=num_worst_tokens))
    with _BUFFERS_LOCK:
        buf = _BUFFERS.get(group)
        if buf is None or getattr(buf, "num_nvl_bytes", nvl) < nvl or getattr(buf, "num_rdma_bytes", rdma) < rdma:
            # A smaller Buffer is dropped, not destroyed: autograd graphs still in flight may hold its handles.
            buf = Buffer(group, nvl, rdma)
            _BUFFERS[group] = buf
        return buf


def release_buffers() -> None:
    """Drop the cached Buffers (tests, and processes that rebuild their groups)."""
    with _BUFFERS_LOCK:
        _BUFFERS.clear()


# --------------------------------------------------------------------------------------------------------------
# FP8 payload (per-token, per-128-channel scales), DeepEP's format.
# --------------------------------------------------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    if h % FP8_BLOCK:
        raise ValueError(f"FP8 dispatch needs the hidden size to be a multiple of {FP8_BLOCK}, got {h}; "
                         "turn fp8 dispatch off (UCCL_EP_DISPATCH_FP8=0)")
    blocks = x.float().view(t, h // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX
    payload = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(t, h)
    return payload, scales


def dequantize_fp8(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t, h = payload.shape
    blocks = payload.float().view(t, h // FP8_BLOCK, FP8_BLOCK) * scales.float().unsqueeze(-1)
    return blocks.view(t, h).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# Autograd around the Buffer: dispatch <-> combine.
# --------------------------------------------------------------------------------------------------------------
class _Route:
    """Everything one forward pass's dispatch learns and its combine and both backwards reuse.

    A fresh object per forward, referenced from the autograd contexts: micro-batches in flight (pipeline
    schedules, EP overlap) never share a handle.
    """

    def __init__(self, buffer, topk_idx: torch.Tensor, num_experts: int, options: DispatcherOptions,
                 expert_major: bool, num_worst_tokens: int, async_comm: bool):
        self.buffer = buffer
        self.topk_idx = topk_idx
        self.num_experts = num_experts
        self.options = options
        self.expert_major = expert_major
        self.num_worst_tokens = num_worst_tokens
        self.async_comm = async_comm
        self.handle: Any = None
        self.recv_topk_idx: Optional[torch.Tensor] = None
        self.num_recv_tokens_per_expert_list: Optional[List[int]] = None

    def previous_event(self):
        if not self.async_comm:
            return None
        from uccl_ep_train.event import EventOverlap

        return EventOverlap.capture()

    def comm_kwargs(self) -> dict:
        return {"async_finish": self.async_comm, "allocate_on_comm_stream": self.async_comm}

    def wait(self, event) -> None:
        if self.async_comm and event is not None:
            event.current_stream_wait()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor, route: _Route):
        buffer = route.buffer
        num_per_rank, num_per_rdma, num_per_expert, in_rank, event = buffer.get_dispatch_layout(
            route.topk_idx, route.num_experts, previous_event=route.previous_event(), **route.comm_kwargs())
        payload = quantize_fp8(x) if route.options.fp8_dispatch else x
        extra = {"expert_major": True} if route.expert_major else {}
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            payload, topk_idx=route.topk_idx, topk_weights=topk_weights.detach().float().contiguous(),
            num_tokens_per_rank=num_per_rank, num_tokens_per_rdma_rank=num_per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=num_per_expert, num_worst_tokens=route.num_worst_tokens, previous_event=event,
            **route.comm_kwargs(), **extra)
        route.wait(event)
        if isinstance(recv_x, tuple):
            recv_x = dequantize_fp8(recv_x[0], recv_x[1], x.dtype)
        route.handle = handle
        route.recv_topk_idx = recv_idx
        route.num_recv_tokens_per_expert_list = counts
        ctx.route = route
        ctx.weights_dtype = topk_weights.dtype
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        route = ctx.route
        buffer = route.buffer
        if grad_recv_w is not None:
            grad_recv_w = grad_recv_w.float().contiguous()
        grad_x, grad_w, event = buffer.combine(grad_recv_x.contiguous(), route.handle, topk_weights=grad_recv_w,
                                               previous_event=route.previous_event(), **route.comm_kwargs())
        route.wait(event)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weights_dtype)
        return grad_x, grad_w, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, route: _Route):
        combined, _, event = route.buffer.combine(x.contiguous(), route.handle,
                                                  previous_event=route.previous_event(), **route.comm_kwargs())
        route.wait(event)
        ctx.route = route
        return combined

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        grad_x, _, _, _, _, event = route.buffer.dispatch(grad.contiguous(), handle=route.handle,
                                                          previous_event=route.previous_event(),
                                                          **route.comm_kwargs())
        route.wait(event)
        return grad_x, None


# --------------------------------------------------------------------------------------------------------------
# Local permutation between the Buffer's rank-major rows and the experts' expert-major rows.
# --------------------------------------------------------------------------------------------------------------
class _LocalPermutation:
    """Which received row (token) and top-k slot each expert-major row comes from.

    ``static`` (sync-free mode) keeps every (row, slot) pair, invalid ones last and masked out, so no size depends
    on the data; otherwise only the valid pairs, whose number the host already knows from the dispatch.
    """

    def __init__(self, recv_topk_idx: torch.Tensor, num_local_experts: int, num_valid: Optional[int]):
        rows, k = recv_topk_idx.shape
        self.num_rows = rows
        valid = recv_topk_idx >= 0
        key = torch.where(valid, recv_topk_idx, torch.full_like(recv_topk_idx, num_local_experts)).flatten()
        order = torch.argsort(key, stable=True)  # expert-major, received order inside an expert (as Megatron)
        if num_valid is not None:
            order = order[:num_valid]
            self.mask = None
        else:
            self.mask = valid.flatten()[order]
        self.pairs = order
        self.token = torch.div(order, k, rounding_mode="floor")
        self.device_counts = count_ids(key, num_local_experts)  # the invalid key (num_local_experts) counts nowhere

    def permute(self, recv_x: torch.Tensor, recv_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = recv_x.index_select(0, self.token)
        probs = recv_w.flatten().index_select(0, self.pairs)
        if self.mask is not None:
            tokens = tokens * self.mask.unsqueeze(-1).to(tokens.dtype)
            probs = probs * self.mask.to(probs.dtype)
        return tokens, probs

    def unpermute(self, expert_out: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            expert_out = expert_out * self.mask.unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros(self.num_rows, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device)
        return out.index_add(0, self.token, expert_out)


def _counts_covering_every_row(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Sync-free tokens per expert as Megatron's experts take them: they split their rows by these counts
    (SequentialMLP and TEGroupedMLP's unfused path call torch.split, which needs the counts to sum to the rows), so
    the padding rows after the last segment are counted in the last local expert, on the device (no host sync). They
    hold zeros with zero probs and no combine reads them, so no output or gradient changes; they cost that expert's
    compute, which is why num_worst_tokens should sit near the real receive rather than at the worst case."""
    out = counts.to(torch.int64).clone()
    if out.numel():
        out[-1] += rows - out.sum()
    return out


# --------------------------------------------------------------------------------------------------------------
# The dispatcher.
# --------------------------------------------------------------------------------------------------------------
class UCCLTokenDispatcher(MoETokenDispatcher):
    """Megatron token dispatcher over uccl_ep_train.Buffer (DeepEP-v1-style dispatch/combine)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None,
                 options: Optional[DispatcherOptions] = None) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        if config.num_moe_experts is None:
            raise ValueError("UCCLTokenDispatcher needs num_moe_experts in the TransformerConfig")
        if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts:
            raise ValueError(f"num_local_experts={num_local_experts} must be > 0 and match the "
                             f"{len(local_expert_indices)} local_expert_indices")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.router_topk = config.moe_router_topk
        # the router drops tokens over each expert's capacity where this is set: it bounds the sync-free rows
        self.capacity_factor = getattr(config, "moe_expert_capacity_factor", None)
        self.options = load_options() if options is None else options
        self.comm_group = self.tp_ep_group if self.tp_ep_group is not None else self.ep_group
        self.comm_size = _pg_size(self.comm_group)
        if self.comm_size != self.tp_size * self.ep_size:
            raise ValueError(f"the tp_ep group has {self.comm_size} ranks, expected expert TP ({self.tp_size}) x "
                             f"EP ({self.ep_size})")
        self.expert_major = self.options.expert_major and buffer_supports_expert_major()
        self.probs_dtype = torch.float64 if getattr(config, "moe_router_dtype", None) == "fp64" else torch.float32
        self.hidden_shape = None
        self._route: Optional[_Route] = None
        self._perm: Optional[_LocalPermutation] = None
        self.cudagraph_attrs = []

    # -- routing helpers ----------------------------------------------------------------------------------------
    def _topk_from_routing_map(self, routing_map: torch.Tensor, probs: torch.Tensor):
        t = routing_map.shape[0]
        routing_map = routing_map.reshape(t, self.num_experts)
        probs = probs.reshape(t, self.num_experts)
        k = min(self.router_topk, self.num_experts)
        # Slot j of a token holds its j-th selected expert in ascending id order (-1 past its last one). A prefix sum
        # over the row gives each selected expert its slot; this costs a few passes over [T, E] where torch.topk over
        # the same map took ~95 us at DeepSeek-V3 shape (4096 x 256). Experts beyond the k-th (a malformed map)
        # land in the dropped column k and are not routed.
        selected = routing_map.to(torch.int32)
        slot = torch.where(routing_map, selected.cumsum(dim=1) - 1, k).clamp_(max=k).to(torch.int64)
        experts = torch.arange(self.num_experts, device=routing_map.device).expand(t, -1)
        topk_idx = torch.full((t, k + 1), -1, dtype=torch.int64, device=routing_map.device)
        topk_idx.scatter_(1, slot, experts)
        topk_idx = topk_idx[:, :k]
        valid = topk_idx >= 0
        topk_probs = probs.gather(1, topk_idx.clamp(min=0)) * valid.to(probs.dtype)
        return topk_idx.contiguous(), topk_probs

    def _expand_over_tp(self, topk_idx: torch.Tensor, topk_probs: torch.Tensor):
        """Expert ids over the TP x EP group: expert e -> the tp virtual experts of its EP rank's TP ranks."""
        if self.tp_size == 1:
            return topk_idx, topk_probs
        t, k = topk_idx.shape
        nle, tp = self.num_local_experts, self.tp_size
        ep_rank, local = torch.div(topk_idx, nle, rounding_mode="floor"), topk_idx.remainder(nle)
        dest = ep_rank.unsqueeze(-1) * tp + torch.arange(tp, device=topk_idx.device)
        virtual = dest * nle + local.unsqueeze(-1)
        virtual = torch.where(topk_idx.unsqueeze(-1) >= 0, virtual, torch.full_like(virtual, -1))
        probs = topk_probs.unsqueeze(-1).expand(t, k, tp)
        return virtual.reshape(t, k * tp), probs.reshape(t, k * tp)

    # -- Megatron's six hooks -------------------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        topk_idx, topk_probs = self._topk_from_routing_map(routing_map, probs)
        topk_idx, topk_probs = self._expand_over_tp(topk_idx, topk_probs)
        num_tokens = hidden_states.shape[0]
        num_worst = 0
        if self.options.sync_free:
            num_worst = sync_free_rows(num_tokens, self.comm_size, self.router_topk, self.num_experts,
                                       self.num_local_experts, self.expert_major, self.capacity_factor,
                                       self.options.num_worst_tokens)
        async_comm = self.options.async_comm and hidden_states.is_cuda
        buffer = get_buffer(self.comm_group, hidden_states.shape[-1] * max(hidden_states.element_size(), 2),
                            num_tokens, self.router_topk, num_worst)
        self._route = _Route(buffer, topk_idx.to(torch.int64).contiguous(), self.num_experts * self.tp_size,
                             self.options, self.expert_major, num_worst, async_comm)
        return hidden_states, topk_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, *args, **kwargs):
        if self._route is None:
            raise RuntimeError("token_dispatch called before dispatch_preprocess")
        if self.shared_experts is not None and hasattr(self.shared_experts, "wait_current_stream"):
            self.shared_experts.wait_current_stream()
        recv_x, recv_probs = _Dispatch.apply(hidden_states.contiguous(), probs, self._route)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        route = self._route
        if route is None or route.recv_topk_idx is None:
            raise RuntimeError("dispatch_postprocess called before token_dispatch")
        sync_free = route.num_worst_tokens > 0
        if route.expert_major:
            self._perm = None
            if sync_free:
                tokens_per_expert = _counts_covering_every_row(route.handle.num_recv_tokens_per_expert,
                                                               hidden_states.size(0))
            else:
                tokens_per_expert = torch.tensor(route.num_recv_tokens_per_expert_list, dtype=torch.int64)
            return hidden_states, tokens_per_expert, probs.to(self.probs_dtype)
        num_valid = None if sync_free else int(sum(route.num_recv_tokens_per_expert_list))
        self._perm = _LocalPermutation(route.recv_topk_idx, self.num_local_experts, num_valid)
        tokens, permuted_probs = self._perm.permute(hidden_states, probs)
        if sync_free:
            tokens_per_expert = _counts_covering_every_row(self._perm.device_counts, tokens.size(0))
        else:
            tokens_per_expert = torch.tensor(route.num_recv_tokens_per_expert_list, dtype=torch.int64)
        return tokens, tokens_per_expert, permuted_probs.to(self.probs_dtype)

    def combine_preprocess(self, hidden_states: torch.Tensor):
        if self._perm is None:
            return hidden_states
        out = self._perm.unpermute(hidden_states)
        self._perm = None
        return out

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
        route = self._route
        if route is None or route.handle is None:
            raise RuntimeError("token_combine called before token_dispatch")
        if self.shared_experts is not None and hasattr(self.shared_experts, "wait_current_stream"):
            self.shared_experts.wait_current_stream()
        combined = _Combine.apply(hidden_states, route)
        # The route lives on in the autograd graph; the dispatcher lets go so the next micro-batch starts clean.
        self._route = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(combined)
            self.shared_experts.post_forward_comm()
        return combined

    def combine_postprocess(self, hidden_states: torch.Tensor):
        if self.shared_experts is not None:
            hidden_states = hidden_states + self.shared_experts.get_output()
        return hidden_states.view(self.hidden_shape)
