"""Pure-torch dispatch/combine over torch.distributed: the semantics every kernel must reproduce, and a fallback
backend.

Runs wherever torch.distributed runs (gloo on CPU, NCCL on GPU). Notation: R ranks, G ranks per node, N = R / G nodes,
rank r = node * G + local; E experts, L = E / R local experts (rank r owns experts [r*L, (r+1)*L)); T tokens on a rank,
K top-k slots, H hidden. ``topk_idx == -1`` means the slot is dropped. A row of ``topk_idx`` must not name an expert
twice (``Buffer`` checks it).

Received-token order (rank-major, DeepEP's): the rows of ``recv_x`` on rank r are every token (s, t) with
``is_token_in_rank[t, r]`` on its source rank s, sorted by source rank s ascending, then source token index t
ascending; each such token appears exactly once however many of r's experts it selected. With ``num_worst_tokens`` > 0
the output has exactly that many rows: the real rows first, then padding rows (x = 0, scales = 0, topk_idx = -1,
weights = 0).

Expert-major layout (``expert_major=True``; "fused expert-major receive", what grouped-GEMM experts consume): one row
per received (token, local expert) pair, i.e. per received top-k slot that names a local expert. Rows are grouped by
local expert e = 0..L-1; within an expert, rows follow the rank-major received order. Expert e's segment holds
``count_e`` real rows followed by zero rows up to ``align_up(count_e, expert_alignment)``; segments are contiguous, so
expert e starts at the sum of the aligned sizes of the experts before it. ``recv_topk_idx`` becomes a [rows] vector
(the local expert of each row, -1 on padding) and ``recv_topk_weights`` a [rows] vector (that slot's weight, 0 on
padding). With ``num_worst_tokens`` > 0 the output has exactly that many rows (zero rows after the last segment).

Combine: ``combined_x[t] = sum over the copies of token t`` (rank-major: one row per destination rank; expert-major:
one row per (destination rank, selected local expert)), accumulated in float32 and cast once to x's dtype. Summation
order (kernels must match within float32 rounding): on each destination rank the expert-major rows of a token are added
in top-k slot order; then per destination node the copies are added in ascending local rank; then the node partial
sums are added in ascending node order. A node partial sum crosses the network in x's dtype (DeepEP's wire format:
half the bytes of float32), so with several nodes it is rounded to x's dtype before the node sums are added; with one
node this changes nothing. Padding rows are ignored. ``combined_topk_weights[t, k]`` is the same sum over
the copies' weights (rank-major: over every slot; expert-major: each row's weight goes back to its slot); because
dispatch zeroes the weights of non-local slots, combine(dispatch(w)) returns w for the non-dropped slots.

Hierarchical routing (G < R). Dispatch: a token goes once per destination node n to the rail-aligned rank
(n, local of source) - over the network when n is not the source's node, a no-op for its own node - with the bitmask
of the ranks of n that need it; that forwarder copies it over NVLink to every rank of the mask other than itself.
Combine is the reverse: each destination sends its copy to the forwarder (NVLink), which adds the node's copies and
sends one partial sum to the source (network). The reference performs exactly these two hops (skipping the network
hop when N = 1 and the NVLink hop when G = 1), so user-visible results depend on G only through the rounding of the
node partial sums, and it reports the bytes of each hop in a ``TrafficReport``.

Byte counting (``TrafficReport``, per rank, for one call): ``nvlink_bytes`` and ``network_bytes`` are payload bytes
this rank *sent* over intra-node links and across nodes (copies to itself are free), ``logical_bytes`` are payload
bytes counted DeepEP's way: every row of the output this rank received (dispatch) or sent back (combine), its own
copies included. Payload = H * element size of x (plus H/128 float32 scales for FP8); top-k ids, weights and routing
metadata are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import math

import torch
import torch.distributed as dist

FP8_BLOCK = 128  # channels per float32 scale of an FP8 payload


# --------------------------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------------------------

def count_ids(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How often each value in [0, num_bins) occurs in ``ids`` (int64 [num_bins]); other values count nowhere.
    A fixed-size scatter: unlike ``bincount`` or a boolean-mask gather it never makes the host wait for the GPU
    (the internode backend's layout and notify run on the device between its network waits)."""
    ids = ids.reshape(-1).to(torch.int64)
    bins = torch.where((ids >= 0) & (ids < num_bins), ids, torch.full_like(ids, num_bins))
    counts = torch.zeros(num_bins + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins))[:num_bins]


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: Optional[int] = None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Counts and the token-to-rank map for ``topk_idx`` [T, K] int64 (-1 = dropped). Purely local.

    Returns (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None when N == 1,
    num_tokens_per_expert [E] int32 (one per non-dropped slot), is_token_in_rank [T, R] bool).
    """
    ranks_per_node = num_ranks if ranks_per_node is None else ranks_per_node
    num_tokens = topk_idx.size(0)
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    num_tokens_per_expert = count_ids(topk_idx, num_experts).to(torch.int32)
    dest_rank = torch.where(valid, topk_idx // experts_per_rank, torch.zeros_like(topk_idx))
    hits = torch.zeros(num_tokens, num_ranks, dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, dest_rank, valid.to(torch.int32))
    is_token_in_rank = hits > 0
    num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
    num_nodes = num_ranks // ranks_per_node
    num_tokens_per_rdma_rank = None
    if num_nodes > 1:
        in_node = is_token_in_rank.view(num_tokens, num_nodes, ranks_per_node).any(2)
        num_tokens_per_rdma_rank = in_node.sum(0).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


# --------------------------------------------------------------------------------------------------------------------
# Handle, results, traffic
# --------------------------------------------------------------------------------------------------------------------

@dataclass
class TrafficReport:
    """Payload bytes of one dispatch or combine on this rank (see the module docstring for what counts)."""

    nvlink_bytes: int = 0
    network_bytes: int = 0
    logical_bytes: int = 0

    def __add__(self, other: "TrafficReport") -> "TrafficReport":
        return TrafficReport(self.nvlink_bytes + other.nvlink_bytes, self.network_bytes + other.network_bytes,
                             self.logical_bytes + other.logical_bytes)


@dataclass
class _Plan:
    """The two hops of one routing, reusable in cached mode and reversed by combine (no count exchange needed).

    hop 1 (source -> forwarder of each destination node): rows ``hop1_token`` of the source, ``hop1_send`` rows per
    rank, ``hop1_recv`` rows received per rank. hop 2 (forwarder -> destinations in its node): rows ``hop2_row`` of
    the hop-1 receive buffer, ``hop2_send``/``hop2_recv`` per rank. ``order`` sorts hop-2 arrivals into the
    rank-major received order.
    """

    hop1_token: torch.Tensor
    hop1_send: List[int]
    hop1_recv: List[int]
    hop2_row: torch.Tensor
    hop2_send: List[int]
    hop2_recv: List[int]
    order: torch.Tensor


@dataclass
class Handle:
    """Everything cached dispatch and combine need; satisfies the handle contract of uccl_ep_train.backends."""

    group: Any
    rank: int
    num_ranks: int
    ranks_per_node: int
    num_experts: int
    num_tokens: int
    num_topk: int
    num_recv_tokens: int  # real rank-major rows
    num_recv_rows: int  # rows of the dispatch output (padding included); combine expects this many
    is_token_in_rank: torch.Tensor
    recv_src_rank: torch.Tensor  # [num_recv_tokens] int64
    recv_src_idx: torch.Tensor  # [num_recv_tokens] int64
    num_recv_tokens_per_expert: torch.Tensor  # [L] int32, aligned
    expert_alignment: int
    num_worst_tokens: int
    expert_major: bool
    plan: _Plan = field(repr=False)
    expert_major_token: Optional[torch.Tensor] = None  # [rows] int64, -1 padding
    expert_major_slot: Optional[torch.Tensor] = None  # [rows] int64, -1 padding
    expert_major_pos: Optional[torch.Tensor] = field(default=None, repr=False)  # [num_recv_tokens, K], -1 = none


@dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[List[int]]
    handle: Handle
    traffic: TrafficReport


@dataclass
class CombineResult:
    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]
    traffic: TrafficReport


# --------------------------------------------------------------------------------------------------------------------
# Transport helpers
# --------------------------------------------------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(t.size(0), math.prod(t.shape[1:])).view(torch.uint8)


def _pack(columns: List[torch.Tensor]) -> Tuple[torch.Tensor, List[Tuple[torch.dtype, Tuple[int, ...], int]]]:
    """Concatenate per-row tensors of any dtype into one uint8 row each, so one collective carries them all."""
    spec = [(c.dtype, tuple(c.shape[1:]), _as_bytes(c).size(1)) for c in columns]
    return torch.cat([_as_bytes(c) for c in columns], dim=1), spec


def _unpack(rows: torch.Tensor, spec) -> List[torch.Tensor]:
    out, offset = [], 0
    for dtype, shape, nbytes in spec:
        chunk = torch.empty((rows.size(0), nbytes), dtype=torch.uint8, device=rows.device)
        chunk.copy_(rows[:, offset:offset + nbytes])  # a fresh row-major copy: views need aligned row strides
        chunk = chunk.view(dtype)
        out.append(chunk.reshape((rows.size(0),) + shape))
        offset += nbytes
    return out


def _exchange_counts(send: torch.Tensor, group) -> List[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _exchange_rows(rows: torch.Tensor, send: List[int], recv: List[int], group, skip: bool) -> torch.Tensor:
    """All-to-all of rows (dim 0) with the given splits; ``skip`` when every row stays on this rank (local hop)."""
    if skip:
        return rows
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def _topology(group, ranks_per_node: Optional[int]) -> Tuple[int, int, int]:
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    ranks_per_node = num_ranks if not ranks_per_node else ranks_per_node
    if num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the group size {num_ranks}")
    return rank, num_ranks, ranks_per_node


# --------------------------------------------------------------------------------------------------------------------
# Routing plan
# --------------------------------------------------------------------------------------------------------------------

def _make_plan(is_token_in_rank: torch.Tensor, rank: int, num_ranks: int, ranks_per_node: int, group
               ) -> Tuple[_Plan, torch.Tensor, torch.Tensor]:
    """Build both hops from is_token_in_rank. Also returns the per-hop-1-row local masks and the arrival sources."""
    num_tokens = is_token_in_rank.size(0)
    num_nodes = num_ranks // ranks_per_node
    my_node, my_local = divmod(rank, ranks_per_node)
    device = is_token_in_rank.device
    mask = is_token_in_rank.view(num_tokens, num_nodes, ranks_per_node)
    node_hit = mask.any(2)
    hop1_node, hop1_token = node_hit.t().nonzero(as_tuple=True)  # by destination node, then token
    hop1_dest = hop1_node * ranks_per_node + my_local
    hop1_send_t = torch.bincount(hop1_dest, minlength=num_ranks)
    hop1_mask = mask[hop1_token, hop1_node]  # [S1, G]: which ranks of that node need the token
    hop1_send = hop1_send_t.tolist()
    if num_nodes == 1:
        hop1_recv = [0] * num_ranks
        hop1_recv[rank] = hop1_send[rank]
    else:
        hop1_recv = _exchange_counts(hop1_send_t, group)
    # The meta record the forwarder needs: which ranks of its node want the token, and the source token index.
    meta, spec = _pack([hop1_mask, hop1_token])
    fwd_mask, fwd_src_idx = _unpack(_exchange_rows(meta, hop1_send, hop1_recv, group, skip=num_nodes == 1), spec)
    fwd_mask = fwd_mask.bool()
    hop2_local, hop2_row = fwd_mask.t().nonzero(as_tuple=True)  # by destination local rank, then arrival row
    hop2_dest = my_node * ranks_per_node + hop2_local
    hop2_send_t = torch.bincount(hop2_dest, minlength=num_ranks)
    hop2_send = hop2_send_t.tolist()
    if ranks_per_node == 1:
        hop2_recv = [0] * num_ranks
        hop2_recv[rank] = hop2_send[rank]
    else:
        hop2_recv = _exchange_counts(hop2_send_t, group)
    # Source rank and token index of every arrival define the rank-major received order.
    fwd_src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                           torch.tensor(hop1_recv, device=device))
    meta, spec = _pack([fwd_src_rank[hop2_row], fwd_src_idx[hop2_row]])
    src_rank, src_idx = _unpack(_exchange_rows(meta, hop2_send, hop2_recv, group, skip=ranks_per_node == 1), spec)
    order = torch.argsort(src_rank * (1 << 40) + src_idx)
    plan = _Plan(hop1_token, hop1_send, hop1_recv, hop2_row, hop2_send, hop2_recv, order)
    return plan, src_rank[order], src_idx[order]


def _traffic_forward(plan: _Plan, rank: int, ranks_per_node: int, row_bytes: int) -> TrafficReport:
    network = sum(c for r, c in enumerate(plan.hop1_send) if r != rank)
    nvlink = sum(c for r, c in enumerate(plan.hop2_send) if r != rank)
    return TrafficReport(nvlink * row_bytes, network * row_bytes, sum(plan.hop2_recv) * row_bytes)


def _traffic_reverse(plan: _Plan, rank: int, ranks_per_node: int, row_bytes: int) -> TrafficReport:
    nvlink = sum(c for r, c in enumerate(plan.hop2_recv) if r != rank)
    network = sum(c for r, c in enumerate(plan.hop1_recv) if r != rank)
    return TrafficReport(nvlink * row_bytes, network * row_bytes, sum(plan.hop2_recv) * row_bytes)


def _route_forward(rows: torch.Tensor, plan: _Plan, num_ranks: int, ranks_per_node: int, group) -> torch.Tensor:
    """Move per-token rows [T, ...] along the plan; returns them in rank-major received order."""
    hop1 = _exchange_rows(rows[plan.hop1_token], plan.hop1_send, plan.hop1_recv, group,
                          skip=num_ranks == ranks_per_node)
    hop2 = _exchange_rows(hop1[plan.hop2_row], plan.hop2_send, plan.hop2_recv, group, skip=ranks_per_node == 1)
    return hop2[plan.order]


def _route_reverse(rows: torch.Tensor, plan: _Plan, num_tokens: int, num_ranks: int, ranks_per_node: int, group,
                   wire_columns: int = 0, wire_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum float32 rows [num_recv_tokens, C] back onto their source tokens: node-local sum at the forwarder (ascending
    local rank), then across nodes at the source (ascending node). Deterministic: each add touches distinct rows.
    The first ``wire_columns`` columns of each node partial are rounded to ``wire_dtype``: the partial crosses the
    network in the payload's dtype, as DeepEP's does (half the bytes of fp32; on one node it changes nothing, the
    final cast rounds the same sum)."""
    arrivals = torch.empty_like(rows)
    arrivals[plan.order] = rows
    at_forwarder = _exchange_rows(arrivals, plan.hop2_recv, plan.hop2_send, group, skip=ranks_per_node == 1)
    partial = rows.new_zeros((sum(plan.hop1_recv), rows.size(1)))
    start = 0
    for count in plan.hop2_send:  # one block per destination local rank, ascending
        partial.index_add_(0, plan.hop2_row[start:start + count], at_forwarder[start:start + count])
        start += count
    if wire_dtype is not None and wire_columns:
        partial[:, :wire_columns] = partial[:, :wire_columns].to(wire_dtype).float()
    at_source = _exchange_rows(partial, plan.hop1_recv, plan.hop1_send, group, skip=num_ranks == ranks_per_node)
    out = rows.new_zeros((num_tokens, rows.size(1)))
    start = 0
    for count in plan.hop1_send:  # one block per destination node, ascending
        out.index_add_(0, plan.hop1_token[start:start + count], at_source[start:start + count])
        start += count
    return out


def worst_case_rows(num_tokens: int, num_ranks: int, num_topk: int, num_local_experts: int,
                    expert_major: bool) -> int:
    """The most rows one rank can receive from a dispatch of ``num_tokens`` tokens per rank: every token of every
    rank, once (rank-major) or once per selected local expert (expert-major: at most min(top-k, local experts) per
    token). A num_worst_tokens that is never too small."""
    return num_tokens * num_ranks * (min(num_topk, num_local_experts) if expert_major else 1)


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _pad_rows(t: torch.Tensor, rows: int, fill: float | int = 0) -> torch.Tensor:
    if t.size(0) == rows:
        return t
    out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[:t.size(0)] = t
    return out


# --------------------------------------------------------------------------------------------------------------------
# Dispatch / combine
# --------------------------------------------------------------------------------------------------------------------

def _payload_bytes(x: torch.Tensor, x_scales: Optional[torch.Tensor]) -> int:
    per_row = math.prod(x.shape[1:]) * x.element_size()
    if x_scales is not None:
        per_row += math.prod(x_scales.shape[1:]) * x_scales.element_size()
    return per_row


def _to_expert_major(handle: Handle, rows: List[torch.Tensor]) -> List[torch.Tensor]:
    """Rank-major rows -> expert-major rows (zero padding)."""
    token = handle.expert_major_token
    valid = token >= 0
    out = []
    for t in rows:
        em = t.new_zeros((token.numel(),) + tuple(t.shape[1:]))
        em[valid] = t[token[valid]]
        out.append(em)
    return out


def dispatch(x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None, *,
             group=None, num_experts: Optional[int] = None, x_scales: Optional[torch.Tensor] = None,
             handle: Optional[Handle] = None, is_token_in_rank: Optional[torch.Tensor] = None,
             num_tokens_per_expert: Optional[torch.Tensor] = None, expert_alignment: int = 1,
             num_worst_tokens: int = 0, expert_major: bool = False, ranks_per_node: Optional[int] = None
             ) -> DispatchResult:
    """Send each token once to every rank holding one of its experts (see the module docstring for the layouts).

    Cached mode (``handle`` given): same routing and layout as the dispatch that made the handle, only the payload
    (``x``, ``x_scales``) moves; topk outputs and the count list are None. Collective: every rank of ``group`` calls.
    """
    if handle is not None:
        plan, group = handle.plan, handle.group
        rows = _route_forward(_pack([x] + ([x_scales] if x_scales is not None else []))[0], plan,
                              handle.num_ranks, handle.ranks_per_node, group)
        spec = _pack([x[:0]] + ([x_scales[:0]] if x_scales is not None else []))[1]
        parts = _unpack(rows, spec)
        parts = (_to_expert_major(handle, parts) if handle.expert_major
                 else [_pad_rows(p, handle.num_recv_rows) for p in parts])
        traffic = _traffic_forward(plan, handle.rank, handle.ranks_per_node, _payload_bytes(x, x_scales))
        return DispatchResult(parts[0], parts[1] if x_scales is not None else None, None, None, None, handle, traffic)

    group = dist.group.WORLD if group is None else group
    rank, num_ranks, ranks_per_node = _topology(group, ranks_per_node)
    if num_experts is None:
        if num_tokens_per_expert is None:
            raise ValueError("dispatch needs num_experts (or num_tokens_per_expert) when no handle is given")
        num_experts = num_tokens_per_expert.numel()
    experts_per_rank = num_experts // num_ranks
    if is_token_in_rank is None:
        if topk_idx is None:
            raise ValueError("dispatch needs topk_idx or is_token_in_rank when no handle is given")
        is_token_in_rank = get_dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node)[3]
    if expert_major and topk_idx is None:
        raise ValueError("expert_major=True needs topk_idx")
    num_tokens = x.size(0)
    device = x.device

    plan, src_rank, src_idx = _make_plan(is_token_in_rank, rank, num_ranks, ranks_per_node, group)
    columns = [x] + ([x_scales] if x_scales is not None else [])
    if topk_idx is not None:
        columns.append(topk_idx)
        columns.append(topk_weights if topk_weights is not None
                       else torch.zeros(topk_idx.shape, dtype=torch.float32, device=device))
    packed, spec = _pack(columns)
    parts = _unpack(_route_forward(packed, plan, num_ranks, ranks_per_node, group), spec)
    recv_x = parts.pop(0)
    recv_scales = parts.pop(0) if x_scales is not None else None
    num_recv = recv_x.size(0)

    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        global_idx, weights = parts
        lo = rank * experts_per_rank
        is_local = (global_idx >= lo) & (global_idx < lo + experts_per_rank)
        recv_topk_idx = torch.where(is_local, global_idx - lo, torch.full_like(global_idx, -1))
        recv_topk_weights = torch.where(is_local, weights, torch.zeros_like(weights))
        counts = torch.bincount(recv_topk_idx[is_local], minlength=experts_per_rank)
    else:
        per_rank = (num_tokens_per_expert.view(num_ranks, experts_per_rank).to(torch.int64) if
                    num_tokens_per_expert is not None else
                    torch.zeros(num_ranks, experts_per_rank, dtype=torch.int64, device=device))
        recv = torch.empty_like(per_rank)
        dist.all_to_all_single(recv, per_rank.contiguous(), group=group)
        counts = recv.sum(0)
    aligned = [_align_up(int(c), expert_alignment) for c in counts.tolist()]
    aligned_t = torch.tensor(aligned, dtype=torch.int32, device=device)

    em_token = em_slot = em_pos = None
    if expert_major:
        num_rows = sum(aligned)
        if num_worst_tokens:
            if num_rows > num_worst_tokens:
                raise RuntimeError(f"rank {rank}: expert-major receive needs {num_rows} rows but num_worst_tokens="
                                   f"{num_worst_tokens}; raise num_worst_tokens")
            num_rows = num_worst_tokens
        tok, slot = (recv_topk_idx >= 0).nonzero(as_tuple=True)  # by received row, then slot
        expert = recv_topk_idx[tok, slot]
        by_expert = torch.argsort(expert, stable=True)  # keeps received order within an expert
        tok, slot, expert = tok[by_expert], slot[by_expert], expert[by_expert]
        seg_start = torch.tensor([0] + aligned[:-1], dtype=torch.int64, device=device).cumsum(0)
        real_start = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), counts.cumsum(0)[:-1]])
        pos = seg_start[expert] + torch.arange(tok.numel(), device=device) - real_start[expert]
        em_token = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        em_slot = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        em_expert = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        em_token[pos], em_slot[pos], em_expert[pos] = tok, slot, expert
        em_pos = torch.full((num_recv, recv_topk_idx.size(1)), -1, dtype=torch.int64, device=device)
        em_pos[tok, slot] = pos
    else:
        num_rows = num_recv
        if num_worst_tokens:
            if num_recv > num_worst_tokens:
                raise RuntimeError(f"rank {rank}: received {num_recv} tokens but num_worst_tokens="
                                   f"{num_worst_tokens}; raise num_worst_tokens")
            num_rows = num_worst_tokens

    handle = Handle(group=group, rank=rank, num_ranks=num_ranks, ranks_per_node=ranks_per_node,
                    num_experts=num_experts, num_tokens=num_tokens,
                    num_topk=topk_idx.size(1) if topk_idx is not None else 0, num_recv_tokens=num_recv,
                    num_recv_rows=num_rows, is_token_in_rank=is_token_in_rank, recv_src_rank=src_rank,
                    recv_src_idx=src_idx, num_recv_tokens_per_expert=aligned_t, expert_alignment=expert_alignment,
                    num_worst_tokens=num_worst_tokens, expert_major=expert_major, plan=plan,
                    expert_major_token=em_token, expert_major_slot=em_slot, expert_major_pos=em_pos)
    if expert_major:
        recv_x, *rest = _to_expert_major(handle, [recv_x] + ([recv_scales] if recv_scales is not None else []))
        recv_scales = rest[0] if rest else None
        valid = em_token >= 0
        em_weights = torch.zeros(num_rows, dtype=torch.float32, device=device)
        em_weights[valid] = recv_topk_weights[em_token[valid], em_slot[valid]]
        recv_topk_idx, recv_topk_weights = em_expert, em_weights
    else:
        recv_x = _pad_rows(recv_x, num_rows)
        recv_scales = _pad_rows(recv_scales, num_rows) if recv_scales is not None else None
        if recv_topk_idx is not None:
            recv_topk_idx = _pad_rows(recv_topk_idx, num_rows, -1)
            recv_topk_weights = _pad_rows(recv_topk_weights, num_rows)
    if topk_weights is None:
        recv_topk_weights = None
    traffic = _traffic_forward(plan, rank, ranks_per_node, _payload_bytes(x, x_scales))
    count_list = [] if num_worst_tokens else aligned
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, count_list, handle, traffic)


def combine(x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None) -> CombineResult:
    """Sum the copies of every token back on its source rank (see the module docstring). Collective.

    ``x``: [handle.num_recv_rows, H] bf16/fp32 in the layout the handle's dispatch produced; ``topk_weights``:
    rank-major [rows, K] or expert-major [rows] float32. Returns combined_x [num_tokens, H] in x's dtype and
    combined_topk_weights [num_tokens, K] float32 (or None).
    """
    num_recv, hidden = handle.num_recv_tokens, x.size(1)
    if handle.expert_major:
        token, slot = handle.expert_major_token, handle.expert_major_slot
        rows = x.new_zeros((num_recv, hidden), dtype=torch.float32)
        for k in range(handle.num_topk):  # slot order; each token has at most one row per slot
            sel = (slot == k).nonzero(as_tuple=True)[0]
            rows.index_add_(0, token[sel], x[sel].float())
        # One partial sum per (token, rank) in x's dtype, as when Megatron unpermutes before DeepEP's combine: the
        # copies that cross the link are half the bytes of fp32 partials.
        rows = rows.to(x.dtype).float()
        if topk_weights is not None:
            pos = handle.expert_major_pos
            weights = torch.where(pos >= 0, topk_weights[pos.clamp(min=0)].float(), torch.zeros_like(pos,
                                                                                                     dtype=torch.float32))
    else:
        rows = x[:num_recv].float()
        weights = topk_weights[:num_recv].float() if topk_weights is not None else None
    if topk_weights is not None:
        rows = torch.cat([rows, weights], dim=1)
    out = _route_reverse(rows, handle.plan, handle.num_tokens, handle.num_ranks, handle.ranks_per_node, handle.group,
                         wire_columns=hidden, wire_dtype=x.dtype)
    combined_x = out[:, :hidden].to(x.dtype)
    combined_w = out[:, hidden:].contiguous() if topk_weights is not None else None
    traffic = _traffic_reverse(handle.plan, handle.rank, handle.ranks_per_node, hidden * x.element_size())
    return CombineResult(combined_x, combined_w, traffic)


# --------------------------------------------------------------------------------------------------------------------
# Autograd: dispatch's backward is combine, combine's backward is a cached dispatch
# --------------------------------------------------------------------------------------------------------------------

class Communicator:
    """The two operations the autograd wrappers need, implemented by any backend (reference or Buffer)."""

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:  # rows in the handle's layout
        raise NotImplementedError

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Communicator, run: Callable, box: dict, x: torch.Tensor,
                topk_weights: Optional[torch.Tensor]):
        result = run(x, topk_weights)
        box["result"] = result
        ctx.comm, ctx.handle = comm, result.handle
        ctx.x_shape, ctx.x_dtype, ctx.x_is_float = x.shape, x.dtype, x.is_floating_point() and x.element_size() > 1
        ctx.has_weights = topk_weights is not None
        ctx.recv_topk_idx = result.recv_topk_idx
        ctx.recv_x_rows = result.recv_x.size(0)
        recv_w = result.recv_topk_weights
        return result.recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        handle = ctx.handle
        grad_w_in = None
        if ctx.has_weights and grad_recv_w is not None:
            grad_w_in = grad_recv_w.float()
            if not handle.expert_major:  # non-local slots were constants (zero) in the forward
                grad_w_in = grad_w_in * (ctx.recv_topk_idx >= 0)
        if grad_recv_x is None or not ctx.x_is_float:
            grad_recv_x = torch.zeros(ctx.recv_x_rows, 1, dtype=torch.float32,
                                      device=grad_w_in.device if grad_w_in is not None else "cpu")
        grad_x, grad_w = ctx.comm.combine(grad_recv_x.contiguous(), handle, grad_w_in)
        return None, None, None, (grad_x if ctx.x_is_float else None), (grad_w if ctx.has_weights else None)


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Communicator, run: Callable, box: dict, x: torch.Tensor,
                topk_weights: Optional[torch.Tensor]):
        combined_x, combined_w = run(x, topk_weights)
        ctx.comm, ctx.handle = comm, box["handle"]
        ctx.has_weights = topk_weights is not None
        return combined_x, combined_w

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        handle = ctx.handle
        grad_in = ctx.comm.dispatch_cached(grad_x.contiguous(), handle) if grad_x is not None else None
        grad_in_w = None
        if ctx.has_weights and grad_w is not None:
            spread = ctx.comm.dispatch_cached(grad_w.float().contiguous(), handle)  # [rows, K]
            if handle.expert_major:
                slot = handle.expert_major_slot
                grad_in_w = torch.where(slot >= 0, spread.gather(1, slot.clamp(min=0)[:, None]).squeeze(1),
                                        torch.zeros_like(slot, dtype=torch.float32))
            else:
                grad_in_w = spread
        return None, None, None, grad_in, grad_in_w


def differentiable_dispatch(comm: Communicator, run: Callable[[torch.Tensor, Optional[torch.Tensor]], Any],
                            x: torch.Tensor, topk_weights: Optional[torch.Tensor]):
    """Run ``run(x, topk_weights)`` (a dispatch returning an object with recv_x, recv_topk_weights, recv_topk_idx,
    handle) so that gradients of recv_x / recv_topk_weights flow back to x / topk_weights through ``comm.combine``."""
    box: dict = {}
    recv_x, recv_w = _DispatchFunction.apply(comm, run, box, x, topk_weights)
    result = box["result"]
    result.recv_x, result.recv_topk_weights = recv_x, recv_w
    return result


def differentiable_combine(comm: Communicator, run: Callable, handle: Any, x: torch.Tensor,
                           topk_weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``run(x, topk_weights) -> (combined_x, combined_w)`` with gradients through ``comm.dispatch_cached``."""
    return _CombineFunction.apply(comm, run, {"handle": handle}, x, topk_weights)


class _ReferenceCommunicator(Communicator):
    def dispatch_cached(self, x, handle):
        return dispatch(x, handle=handle).recv_x

    def combine(self, x, handle, topk_weights):
        result = combine(x, handle, topk_weights)
        return result.combined_x, result.combined_topk_weights


def dispatch_with_grad(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor] = None,
                       **kwargs) -> DispatchResult:
    """``dispatch`` whose recv_x and recv_topk_weights are differentiable (backward = combine)."""
    def run(x_, w_):
        return dispatch(x_, topk_idx, w_, **kwargs)
    return differentiable_dispatch(_ReferenceCommunicator(), run, x, topk_weights)


def combine_with_grad(x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``combine`` differentiable in x and topk_weights (backward = cached dispatch)."""
    def run(x_, w_):
        result = combine(x_, handle, w_)
        return result.combined_x, result.combined_topk_weights
    return differentiable_combine(_ReferenceCommunicator(), run, handle, x, topk_weights)


# --------------------------------------------------------------------------------------------------------------------
# Backend adapter for Buffer
# --------------------------------------------------------------------------------------------------------------------

class ReferenceBackend:
    """The reference as a ``uccl_ep_train.backends.Backend``; ``last_traffic`` holds the latest call's bytes."""

    name = "reference"

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.last_traffic: Optional[TrafficReport] = None

    def get_dispatch_layout(self, topk_idx, num_experts):
        return get_dispatch_layout(topk_idx, num_experts, self.ctx.num_ranks, self.ctx.ranks_per_node)

    def dispatch(self, args):
        from uccl_ep_train.backends import DispatchResult as BackendResult

        if args.handle is not None:
            result = dispatch(args.x, x_scales=args.x_scales, handle=args.handle)
        else:
            result = dispatch(args.x, args.topk_idx, args.topk_weights, group=self.ctx.group,
                              num_experts=args.num_tokens_per_expert.numel(), x_scales=args.x_scales,
                              is_token_in_rank=args.is_token_in_rank,
                              num_tokens_per_expert=args.num_tokens_per_expert,
                              expert_alignment=args.expert_alignment, num_worst_tokens=args.num_worst_tokens,
                              expert_major=args.expert_major, ranks_per_node=self.ctx.ranks_per_node)
        self.last_traffic = result.traffic
        return BackendResult(result.recv_x, result.recv_x_scales, result.recv_topk_idx, result.recv_topk_weights,
                             result.num_recv_tokens_per_expert_list, result.handle, result.traffic)

    def combine(self, x, handle, topk_weights, config):
        result = combine(x, handle, topk_weights)
        self.last_traffic = result.traffic
        return result.combined_x, result.combined_topk_weights

    def destroy(self) -> None:
        pass
