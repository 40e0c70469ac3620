"""What a dispatch hands back (InternodeHandle) and what its later calls reuse from it: the network hops' plans
(HopPlan), the shapes a dispatch and a combine derive from the counts alone (DispatchShape, CombineShape), and
what a call plans for the handle's next calls during its own hop (PlannedAhead)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from uccl_ep_train.internode.plan import Counts, SendPlan, CombineAreas
from uccl_ep_train.internode.columns import _upload_values


@dataclass
class InternodeHandle:
    """A dispatch's layout, returned with its outputs: what its combine sends back where, and what a cached
    dispatch with the same routing reuses (counts, send plan, shapes, hop plans) instead of notify."""

    num_tokens: int
    num_recv_rows: int
    num_topk: int
    num_ranks: int
    expert_major: bool
    is_token_in_rank: torch.Tensor
    # the aligned tokens per local expert (set before dispatch returns the handle); num_recv_tokens_per_expert is
    # their int32 device copy, uploaded when first asked for (sync-free callers): the upload cost ~20-40 us of host
    # time between an uncached dispatch's push and its reader, where most callers never read it
    recv_tokens_per_expert: Optional[List[int]]
    counts: Counts = field(repr=False)
    plan: SendPlan = field(repr=False)
    num_recv_tokens: int = 0
    recv_src_idx: Optional[torch.Tensor] = None
    recv_arrival: Optional[torch.Tensor] = None  # [num_recv] int64: row at the forwarder
    fwd_dest_rows: Optional[torch.Tensor] = None  # [A, G] int64 at this rank as forwarder
    # expert-major (made by the expert-major plan kernel, csrc/kernels/expert_major.hpp): per expert-major row the
    # received row it copies and its top-k slot (-1: padding); per (received row, slot) its expert-major row (int32,
    # -1: not local); and the plan's int32 [received rows, 0, raw count per local expert] on the device
    expert_major_token: Optional[torch.Tensor] = None
    expert_major_slot: Optional[torch.Tensor] = None
    slot_of: Optional[torch.Tensor] = None
    expert_major_info: Optional[torch.Tensor] = None
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    # combine at this rank as forwarder (G > 1): (rows per gather block, int32 [G, A] row of arrival a's copy from
    # local GPU j counted from the first block, -1 where GPU j sent none), made at the first combine
    forward_sum_rows: Optional[Tuple[int, torch.Tensor]] = None
    # the network hops this handle's calls make, by (kind, record bytes): what to push (already on the device), what
    # to wait for, and where the arrivals sit. A cached dispatch or a combine reuses them instead of rebuilding and
    # uploading them (~30-40 us of host time per call on 2x H200, with the GPU idle behind it)
    hop_plans: dict = field(default_factory=dict, repr=False)
    # a dispatch's rows over NVLink and over the network (its traffic report), from the counts: made once
    dispatch_rows: Optional[Tuple[int, int]] = None
    # combine's host-side shape of this handle, by wire row bytes (CombineShape): made and checked once
    combine_shapes: dict = field(default_factory=dict, repr=False)
    # a cached dispatch's, by record layout (DispatchShape)
    dispatch_shapes: dict = field(default_factory=dict, repr=False)
    # the last entry-barrier decision of a cached dispatch right after a combine: (that combine's counts and areas,
    # record stride, whether it may skip) -- a backward pass asks the same question of every layer's pair
    skip_decision: Optional[tuple] = field(default=None, repr=False)
    # combine (G > 1): int64 [received rows, G], each row's arrival row at its forwarder (the local GPU of its
    # source) in that GPU's column, -1 in the others: the index table of the gather's forward_rows launches
    gather_index: Optional[torch.Tensor] = None
    # combine (G > 1, pipelined gather): int32 [G, max arrivals of a forwarder], our row of forwarder f's arrival a,
    # -1 where another GPU holds it: the index table of gather_tiles
    gather_by_arrival: Optional[torch.Tensor] = None
    # what the handle's first combine plans for the backward pass while its partial sums land (_guesses)
    later_guesses: Optional[list] = None
    device: Optional[torch.device] = field(default=None, repr=False)
    _recv_tokens_per_expert_dev: Optional[torch.Tensor] = field(default=None, repr=False)
    # a sync-free dispatch that returned before the host read the counts (docs/internode.md, "Sync-free dispatch:
    # returning before the count read"): makes the aligned tokens per local expert on the device, from what the
    # device holds, while the host list is still unknown (the next call's entry fills it in)
    device_counts: Optional[Callable[[], torch.Tensor]] = field(default=None, repr=False)

    @property
    def num_recv_tokens_per_expert(self) -> Optional[torch.Tensor]:
        """[num_local_experts] int32 on the device, aligned (backends.DispatchResult's contract)."""
        if self._recv_tokens_per_expert_dev is None:
            if self.recv_tokens_per_expert is not None:
                self._recv_tokens_per_expert_dev = _upload_values(self.recv_tokens_per_expert, np.int32, self.device)
            elif self.device_counts is not None:
                self._recv_tokens_per_expert_dev = self.device_counts()
        return self._recv_tokens_per_expert_dev

    @property
    def counts_read(self) -> bool:
        """Whether the host has read this handle's counts (False only between a sync-free dispatch that returned
        before them and the next call of its backend)."""
        return self.counts is not None


@dataclass
class HopPlan:
    """One network hop of a call: the push table (host rows and their device copy), the counters to wait for, the
    arrivals' blocks for a gated reader, and the records per chunk. Depends only on the counts and the record size."""

    rows: List[List[int]]
    # the device copy: ``rows``, then ``head_rows``, then ``tail_rows`` (one upload, possibly shared with other
    # plans), held here; the launches take the addresses below (a slice of a device tensor costs ~5 us of host time)
    table: Optional[torch.Tensor]
    waits: List[Tuple[int, int]]
    gate_blocks: List[Tuple[int, int, int]]
    per_chunk: int
    # the same writes cut into a head and a tail (split_push_head): the wire starts once the head's records are
    # written, and the rest is written while it moves; head_records = 0: not cut
    head_first: int = 0
    head_records: int = 0
    head_rows: List[List[int]] = field(default_factory=list)
    tail_rows: List[List[int]] = field(default_factory=list)
    rows_at: int = 0  # device addresses of rows, head_rows and tail_rows in ``table`` (0: not uploaded)
    head_at: int = 0
    tail_at: int = 0

    def rest_of(self, ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """``ranges`` of records without the head's."""
        lo, hi = self.head_first, self.head_first + self.head_records
        out = []
        for a, b in ranges:
            out += [r for r in ((a, min(b, lo)), (max(a, hi), b)) if r[1] > r[0]]
        return out


@dataclass
class DispatchShape:
    """What a dispatch derives from its counts and record layout alone (the same in every cached dispatch of a handle
    with the same columns): the own node's receive block, whether any record crosses the network, the areas it fills
    (for the next combine's barrier decision), and the arrival rows as a view of the receive half. Made and checked
    once per handle: every step of it sat between a cached dispatch's entry and its push, while the GPU idled."""

    own_block: int  # byte offset in the RDMA region of our own node's receive block
    sends_remote: bool
    extents: Tuple[List[int], List[int]]
    arrivals: torch.Tensor  # uint8 [A, stride] view of the receive half
    forward_bases: Optional[torch.Tensor]  # [N, 1 + G] int64 on the device (forward_block_bases); None with G = 1
    # the final rows of each local GPU on the device, forward_rows' range check (G > 1; made at the first forward)
    forward_limits: Optional[torch.Tensor] = None


@dataclass
class CombineShape:
    """What a combine of one handle derives from its counts alone (the same in every combine of the handle with the
    same wire row): records back from each node, where its rows go in every rank's RDMA region, and the rows it moves
    over NVLink and the network (the traffic report). Made once: these were ~25 us of host time per combine."""

    recv_by_node: List[int]
    areas: CombineAreas
    nvlink_rows: int
    network_rows: int
    # the gather's forward_rows table (G > 1; made at the first gather of a payload size, which places the weights):
    # (payload bytes, int64 [3, G] on the device: every local GPU's gather block for our rows' payload, their
    # weights, its rows; the OR of each of the first two rows)
    gather: Optional[Tuple[int, torch.Tensor, Tuple[int, int]]] = None
    # the pipelined gather's table (G > 1, docs/internode.md, "Pipelined combine gather"): (wire row bytes, int64
    # [3, G] on the device: our gather block at each forwarder, our flag row there, its arrivals; arrivals per tile;
    # the most arrivals of a forwarder, at least 1)
    gather_tiles: Optional[Tuple[int, torch.Tensor, int, int]] = None


@dataclass
class PlannedAhead:
    """The shapes and hop plans a call makes for its handle's next calls during its own hop (_plan_ahead), keyed as
    on the handle: what those calls would make at their first use. The caller puts them on the handle once its hop
    is drained (_adopt_plans); tables staged while a reader spun are copied at the next call's entry
    (_commit_staged_plans)."""

    dispatch_shapes: dict = field(default_factory=dict)
    combine_shapes: dict = field(default_factory=dict)
    hop_plans: dict = field(default_factory=dict)
    # tables written and allocated while a reader spun (UploadStaging.Staged), whose copies the next call's entry
    # queues (_commit_staged_plans)
    staged: list = field(default_factory=list)
