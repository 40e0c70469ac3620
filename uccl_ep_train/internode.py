"""NativeInternodeBackend: hierarchical dispatch/combine across nodes through the CPU proxies (docs/internode.md).

A token crosses the network once per destination node, to the rail-aligned rank there (same local index), as part of
a per-node block of records that the GPU hands to the proxy as WRITE_SIGNAL commands; the forwarder waits on the
signal counters and copies every record over NVLink to the GPUs of its node that need it. Combine reduces within the
node at the forwarder and sends one fp32 partial sum per (token, node) back; the source adds them in node order.

What every rank must agree on before a byte moves (offsets, push tables, waits, limits) is pure planning in
internode_plan.py, proven on CPU against reference.py. This file drives the native module (``_C.internode``):
regions, proxy bootstrap, and the push/wait/scatter kernels. The transport choice is in internode_transport.py, what a
rank reports about a failure in internode_diagnostics.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import operator
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from uccl_ep_train import native
from uccl_ep_train.backends import BackendContext, DispatchArgs, DispatchResult
from uccl_ep_train.internode_diagnostics import describe_fifo_states, timeout_hint, track
from uccl_ep_train.kernel_timeline import COMBINE, DISPATCH, DISPATCH_DURING_NOTIFY, KernelTimeline
from uccl_ep_train.internode_plan import (  # noqa: F401 - planning names are part of this module's API
    InternodeError, CMD_UNIT, CMD_MAX_RANKS, CMD_MAX_SLOTS, CMD_MAX_VALUE, CMD_MAX_BYTES, CMD_MAX_REGION, SLOT_PAGE,
    RecordLayout, record_layout, check_topology, Counts, local_count_row, counts_from_rows, SendPlan, send_plan,
    recv_counts, block_offsets, remote_block_offset, num_recv_rows, chunk_records, chunk_bytes, chunk_lanes,
    push_rows, dispatch_push_rows, lane_waits, dispatch_waits, combine_push_rows, combine_waits, slot_meaning,
    describe_gpu_error, pack_records, forward_block_bases, int32_column, check_area, _align, _bytes_of,
    NOTIFY_MAX_EXPERTS, expert_major_places, notify_row_words, recv_expert_counts,
    recv_row_ends, source_local_of_rows, dispatch_nvlink_rows, combine_nvlink_rows, CombineAreas, combine_areas,
    dispatch_extents, combine_overlaps_dispatch, dispatch_gate_blocks, combine_gate_blocks, gate_rows,
    dispatch_may_skip_entry_barrier, split_push_head, dispatch_push_rows_before_counts, place_blocks, READ_DIMS,
    READ_GO, read_before_counts, FORWARD_DIMS, forward_before_counts, GATE_FIXED_COLUMNS as GATE_FIXED,
    GATHER_MAX_TILES, GATHER_MIN_TILE_ROWS, node_flag_bytes, gather_tile_rows, ready_word_rows, ready_word_bytes)
from uccl_ep_train.internode_transport import (SHARED_GPU_WARNING, device_pci_address, loopback_queue_hazard,
                                               mps_enabled, other_nodes_on_this_gpu, select_internode_transport,
                                               shared_gpu_spin_blocks, use_copy_agent)
from uccl_ep_train.cpu_placement import rank_cpus
from uccl_ep_train.upload_staging import UploadStaging


def drain_after_waits(setting: str, transport: str = "loopback", copy_agent: bool = False) -> bool:
    """Whether the host waits for its stream after every network wait (UCCL_EP_DRAIN_AFTER_WAITS). ``never`` lets
    the host launch the next steps while a wait spins, and a sync-free dispatch return before the count read; a
    caller's CUDA call made meanwhile may then wait for our spinning kernel. That is harmless where the bytes the
    kernel waits for move beside the process -- over verbs, and over the loopback with its copy agent -- and stalls
    the loopback whose proxy threads copy: a pageable copy on the legacy default stream, a free or a module load
    holds the driver locks their copies need (sessions 33-35). ``auto`` (the default) is ``never`` for the former
    and ``always`` for the latter. docs/internode.md, "Drains" and "The copy agent"."""
    if setting == "auto":
        return not (transport == "verbs" or copy_agent)
    return setting == "always"


# The legacy default stream, as torch's default stream (0) and CUDA's explicit handle for it (cudaStreamLegacy, 1):
# the only streams whose waiting pageable copies hold the loopback's (blocking streams and the per-thread default
# stream do not; scripts/probe_blocking_calls.cu PROBE_LEGACY).
_LEGACY_STREAMS = (0, 1)


def check_stream_without_drains(drains: bool, transport: str, stream: int, rank: int,
                                copy_agent: bool = False) -> None:
    """Raise before any launch where a call would stall: without drains (UCCL_EP_DRAIN_AFTER_WAITS=never), over the
    loopback transport whose proxy threads copy (no copy agent), on the legacy default stream. There any pageable
    copy of the caller that queues behind our spinning wait would hold the proxies' copies until the GPU deadline
    (docs/internode.md, "Drains")."""
    if drains or transport != "loopback" or copy_agent or stream not in _LEGACY_STREAMS:
        return
    raise InternodeError(
        f"rank {rank}: UCCL_EP_DRAIN_AFTER_WAITS=never over the loopback transport needs the caller on a non-default "
        f"stream, and this call runs on the legacy default stream: a pageable copy there (.cpu(), .item()) while our "
        f"wait spins would hold the loopback's copies until the GPU deadline. Run the calls under "
        f"`with torch.cuda.stream(torch.cuda.Stream()):`, let the copy agent move the loopback's bytes "
        f"(UCCL_EP_LOOPBACK_COPY_AGENT=on), or leave UCCL_EP_DRAIN_AFTER_WAITS at auto or always "
        f"(docs/internode.md, \"Drains\")")


# ====================================================================================================================
# Native backend
# ====================================================================================================================

class _DeviceView:
    """Exposes raw device memory to torch (``__cuda_array_interface__``) without copying or owning it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


# Settings that choose how the ranks synchronize with each other: a rank that took the other way would wait for flags
# or signals its peers never send, until the GPU deadline. Checked alike at setup (environment name -> field).
_GROUP_SETTINGS = {"UCCL_EP_PIPELINED_COMBINE_GATHER": "pipelined_combine_gather",
                   "UCCL_EP_FORWARD_NODE_BARRIER": "forward_node_barrier",
                   "UCCL_EP_PACK_AND_PUSH": "pack_and_push",
                   "UCCL_EP_UNPACK_BESIDE_FORWARD": "unpack_beside_forward",
                   # the unpack beside the forward waits for ready words that only a gated forwarder writes
                   "UCCL_EP_GATED_ARRIVALS": "gated_arrivals"}


def group_settings_disagree(per_rank: List[Tuple[Any, ...]], names: Tuple[str, ...]) -> Optional[str]:
    """None when every rank holds the same values of the settings ``names`` (``per_rank[r]``: rank r's values in
    that order), else what differs and on which ranks, with what to do."""
    for i, name in enumerate(names):
        values = [v[i] for v in per_rank]
        if len(set(values)) > 1:
            by_value: dict = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            seen = "; ".join(f"{v} on ranks {rs}" for v, rs in by_value.items())
            return (f"{name} differs between the ranks ({seen}); every rank must use the same value (they would "
                    "wait for each other's flags or barriers in vain)")
    return None


def _raw_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 tensor over a region of the native module, without copying or owning it."""
    if device.type == "cuda":
        return torch.as_tensor(_DeviceView(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)  # CPU stand-in (tests)


@dataclass
class InternodeHandle:
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


class Pending(NamedTuple):
    """A hop pushed but not awaited (_push_and_gate): its reader launches gated on ``gate`` and closes the hop."""

    gate: Any  # the native ArrivalGate
    t0: Any  # timing start (_hop_started)
    slots: List[int]  # the counters the hop's waits name
    first_row: int = 0  # where the reader starts: the first of the rows already in (unpack_records' first_row)
    records: int = 0  # what the hop's waits add up to: its records (chunks' signal values) to land
    # our own node's rows, never packed, for the reader to take from the columns (docs/internode.md, "Own rows from
    # the columns"): (first row, count, first record, tokens, columns) as unpack_records' `own`; None: packed
    own: Optional[tuple] = None
    own_columns: Any = None  # the columns' tensors, alive until the reader's launch


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


@dataclass(frozen=True)
class CountRows:
    """Where notify's count rows land on this rank, and what proves they did: for a kernel that waits for them on the
    GPU (push_after_counts, "Push during notify")."""

    slot: int
    target: int  # signal[slot] >= target: every other rank's row is in
    ptr: int  # device address of rank 0's row; rank r's at ptr + 8 * r * row_words
    row_words: int
    # our own row's pushes to the others (device push table, rows), left to the kernel that waits for theirs when the
    # caller asked (_notify's row_goes_with_then); None: pushed already
    own_pushes: Optional[Tuple[int, int]] = None


@dataclass
class ReadingBeforeCounts:
    """A dispatch whose reader is launched before the host reads the count matrix (docs/internode.md, "Reading before
    the count read"): its outputs, allocated for ``rows`` rows before any count is known, what the reader needs
    besides, and, once launched, its hop's timing start. The reader reads only when the count rows say it may
    (read_before_counts); the host learns which from the same counts after notify."""

    # the outputs' (rows, (dtype, row shape) of each payload column, top-k) (_read_spec); rows: num_worst_tokens,
    # or a guess from the last dispatch of this size
    spec: tuple
    pad: bool  # padded to the rows (num_worst_tokens), else cut at the rows received
    layout: RecordLayout
    experts_per_rank: int
    own_columns: List[Tuple[int, int, int]]  # our columns, as pack_records takes them (_column_args)
    own_tokens: int  # device address of the send plan's tokens (hop1_token)
    # taken from the spare made during the last combine's hop, or made at the launch (_launch_reader_before_counts)
    outs: List[torch.Tensor] = field(default_factory=list)
    topk_idx: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    src_idx: Optional[torch.Tensor] = None
    arrival: Optional[torch.Tensor] = None
    t0: Any = None
    # an expert-major receive written by its reader (docs/internode.md, "Expert-major rows in the reader"): the
    # expert-major rows allocated before the counts (num_worst_tokens, or a guess as for the rows), 0: rank-major;
    # the outputs, made at the launch (_launch_reader_before_counts)
    expert_rows: int = 0
    alignment: int = 1
    em: Optional["ExpertMajorRows"] = None
    # several GPUs per node (docs/internode.md, "The forward before the count read"): the send plan's dest rows (our
    # own records are packed into our arrivals from them), the tokens (the pack's grid), the forward's final rows at
    # each local GPU for as many arrivals as the receive area holds (made before notify), and its node barrier's epoch
    own_dest_rows: int = 0
    tokens: int = 0
    fwd_dest: Optional[torch.Tensor] = None
    epoch: int = 0
    # the counters' bases for the kernel that reads the count rows: by value, or (more than READ_MAX_COUNTERS) a
    # device table uploaded before notify (_counter_bases)
    bases: List[int] = field(default_factory=list)
    bases_table: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.spec[0]


def reads_expert_major_rows(mode: str, spin_blocks: int, starts_with_hop: bool) -> bool:
    """Whether an expert-major dispatch's reader writes the expert-major rows itself (UCCL_EP_EXPERT_MAJOR_IN_READER:
    auto, always, never). auto: always where the gated readers may take the whole GPU. Where ranks share one they are
    held to ``spin_blocks`` blocks, which copy slower than the full grid of the copy after the hop, so there only a
    reader that ``starts_with_hop`` does: a cached dispatch's, launched as its pack-and-push launch ends, and an
    uncached one's launched before the count read. Such a reader returned ~150-300 us (cached) and ~300-600 us
    (uncached) sooner than the copy after the hop. An uncached reader launched after the host read the counts and
    planned the receive starts, under MPS, only as the hop's last chunk lands; left to copy everything then, it
    returned ~200-400 us later than the copy (sessions 29-32, one H100 under MPS: docs/internode.md, "Expert-major
    rows in the reader")."""
    return mode == "always" or (mode == "auto" and (starts_with_hop or not spin_blocks))


@dataclass
class UncachedDispatch:
    """An uncached dispatch as notify leaves it, for the steps that follow from the counts (_after_counts): right
    away, or, where it returned before the count read (``returned_early``), at the next call's entry."""

    args: Any  # DispatchArgs
    combined_send_base: Optional[int]
    itr: torch.Tensor
    in_reader: bool
    cols: List[torch.Tensor]
    early: dict  # what packing during notify did
    reading: Optional[ReadingBeforeCounts]
    returned_early: bool


@dataclass
class ExpertMajorRows:
    """An expert-major receive's plan and payload outputs, allocated -- and the plan's sizes uploaded -- before the
    reader's launch, where an allocation may still call into CUDA ("Drains"), so that after the drain only the plan
    and copy launches are left (~200-300 us of host steps there under MPS in session 27). Sizes from the counts."""

    rows: int  # expert-major rows: the aligned counts' sum, or num_worst_tokens
    info: torch.Tensor  # int32 [received rows, 0, raw count per local expert]: recv_info's layout
    token: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    weights: torch.Tensor
    slot_of: torch.Tensor
    out: List[torch.Tensor]  # the payload columns (x, then the scales if any)
    # written by the reader itself (expert_major_places): where each source's rows and pairs go
    places: Optional[torch.Tensor] = None


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


class NativeInternodeBackend:
    """The ``Backend`` of uccl_ep_train.backends when the group spans several (possibly emulated) nodes."""

    name = "native-internode"
    #: The process that moves this rank's loopback bytes (loopback_copy_agent.CopyAgent), or None: the proxy threads
    #: copy (over verbs there is nothing to copy).
    _copy_agent: Optional[Any] = None

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.rank, self.R, self.G = ctx.rank, ctx.num_ranks, ctx.ranks_per_node
        self.N = self.R // self.G
        self.node, self.local = divmod(self.rank, self.G)
        s = ctx.settings
        self.L = int(s.proxy.num_threads) * int(s.proxy.fifos_per_thread)  # lanes: every proxy FIFO carries chunks
        slots = check_topology(self.R, self.G, self.L)
        _C = native.module()
        if not hasattr(_C, "internode"):
            raise InternodeError("uccl_ep_train._C has no `internode` submodule (built without CUDA, or module.cpp "
                                 "does not call bind_internode)")
        self._k = _C.internode
        if self.G > self._k.FORWARD_MAX_TARGETS:  # (its destinations sit in one block's shared memory)
            raise InternodeError(f"{self.G} GPUs per node: the dispatch forward (forward_arrivals) takes at most "
                                 f"{self._k.FORWARD_MAX_TARGETS}")
        # a CPU device means the CPU stand-in of _C.internode (tests/internode/fake_internode_native.py)
        self.device = ctx.device if ctx.device.index is not None or ctx.device.type != "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        self.cpu_timeout = float(s.proxy.timeout_secs)
        self.gpu_timeout = float(s.kernel.gpu_timeout_secs)
        self.rdma_bytes = _align(int(ctx.num_rdma_bytes) or (1 << 28))
        self.nvl_bytes = _align(int(ctx.num_nvl_bytes) or (1 << 28))
        if self.rdma_bytes > CMD_MAX_REGION:
            raise ValueError(f"num_rdma_bytes={self.rdma_bytes} exceeds the 4 GiB a command can address "
                             "(28-bit offsets in 16-byte units)")
        t, p, e = s.transport, s.proxy, s.emulation
        ranks = dist.get_process_group_ranks(ctx.group) if ctx.group is not None else list(range(self.R))
        self._gloo = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self.cpu_timeout))
        from uccl_ep_train import comm

        self.transport = select_internode_transport(
            t.transport, self.rank, self.R, self._gloo,
            lambda: comm.gpu_nics(s, self.local, pci_address=device_pci_address(self.device)),
            verbs_built=bool(getattr(getattr(_C, "verbs", None), "available", False)))
        default_bytes = comm.DEFAULT_INFLIGHT_BYTES_EFA if self.transport.efa else comm.DEFAULT_INFLIGHT_BYTES
        self.inflight_bytes = t.ib_max_inflight_bytes if t.ib_max_inflight_bytes is not None else default_bytes
        # whether this GPU is shared through MPS (None: unknown, or not asked): what the loopback's copies need of
        # CUDA's queues and of the SMs beside our spinning kernels depends on it
        loopback_on_gpu = self.device.type == "cuda" and self.transport.name == "loopback"
        mps = mps_enabled(self.device.index) if loopback_on_gpu else None
        if self.device.type == "cuda":  # no CUDA on the CPU stand-in
            torch.cuda.set_device(self.device)
        # our share of the host's UCCL_EP_PROXY_CPUS, for the proxy threads and the copy agent (cpu_placement.py)
        self.proxy_cpus = rank_cpus(p.cpus, self.rank, self._gloo)
        # who moves the loopback's bytes: a process of our own (the copy agent) or the proxy threads
        self._copy_agent = None
        if loopback_on_gpu:
            gpus: List[Any] = [None] * self.R
            dist.all_gather_object(gpus, device_pci_address(self.device), group=self._gloo)
            if use_copy_agent(e.loopback_copy_agent, shares_gpu=gpus.count(gpus[self.rank]) > 1):
                from uccl_ep_train.loopback_copy_agent import CopyAgent

                # (stopped by destroy(); if this setup raises, by its __del__, or by itself once we are gone)
                self._copy_agent = CopyAgent(p.num_threads, self.device.index, cpus=self.proxy_cpus)
            else:  # the proxy threads' copies share this process's hardware work queues with our kernels
                hazard = loopback_queue_hazard(self.rank, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), mps,
                                               p.num_threads)
                if hazard:
                    warnings.warn(hazard, RuntimeWarning, stacklevel=2)
        self._cx = self._k.InternodeContext(
            rank=self.rank, world=self.R, device=self.device.index, rdma_bytes=self.rdma_bytes,
            nvl_bytes=self.nvl_bytes, num_threads=p.num_threads, fifos_per_thread=p.fifos_per_thread,
            fifo_depth=p.fifo_depth, cpus=list(self.proxy_cpus), idle_backoff_us=p.idle_backoff_us,
            timeout_secs=self.cpu_timeout, max_inflight_writes=t.ib_max_inflight_normal,
            max_inflight_bytes=self.inflight_bytes, reorder_window=t.reorder_window, num_signal_slots=slots,
            loopback_reorder=e.loopback_reorder, loopback_delay_us=e.loopback_delay_us,
            loopback_bandwidth_gbps=e.loopback_bandwidth_gbps, loopback_seed=e.loopback_seed,
            gpu_timeout_secs=float(s.kernel.gpu_timeout_secs), transport=self.transport.name,
            ib_devices=list(self.transport.devices), gid_index=list(self.transport.gid_index),
            sl=-1 if t.ib_sl is None else t.ib_sl, tc=-1 if t.ib_tc is None else t.ib_tc,
            dump_trigger=p.dump_file or "",
            loopback_copy_agent=self._copy_agent.name if self._copy_agent is not None else "")
        infos = [self._cx.proxy_local_info(i) for i in range(p.num_threads)]
        gathered: List[Any] = [None] * self.R
        gpu = device_pci_address(self.device)
        agreed = tuple(getattr(s.kernel, field) for field in _GROUP_SETTINGS.values())
        dist.all_gather_object(gathered, (infos, self._cx.nvl_ipc_handle(), int(self._cx.max_write_bytes),
                                          chunk_bytes(self.inflight_bytes, t.write_bytes), gpu, agreed),
                               group=self._gloo)
        disagreement = group_settings_disagree([g[5] for g in gathered], tuple(_GROUP_SETTINGS))
        if disagreement:  # (every rank sees the same values, so every rank raises here)
            raise InternodeError(f"rank {self.rank}: {disagreement}")
        others = other_nodes_on_this_gpu([g[4] for g in gathered], self.rank, self.G)
        if others and self.transport.name == "loopback":
            # the copies of those ranks' writes are kernels on this GPU: leave them room beside our spinning grids
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            on_gpu = sum(1 for g in gathered if g[4] == gpu)
            self._cx.spin_blocks = shared_gpu_spin_blocks(sms, on_gpu, mps)
            warnings.warn(SHARED_GPU_WARNING.format(rank=self.rank, gpu=gpu, others=others,
                                                    blocks=self._cx.spin_blocks), RuntimeWarning, stacklevel=2)
        # Every rank cuts chunks the same way (receivers derive their lanes from it), so the smallest largest write
        # of any rank's transport bounds them all (EFA devices may take less than a chunk: efadv max_rdma_size), and
        # so does the smallest chunk any rank's settings ask for.
        self.max_write_bytes = min(int(g[2]) for g in gathered) or CMD_MAX_BYTES
        self.write_bytes = min(min(int(g[3]) for g in gathered), self.max_write_bytes)
        self._cx.proxy_connect([[gathered[r][0][i] for r in range(self.R)] for i in range(p.num_threads)])
        # the NVL region: final rows below half_nvl, the combine's gather blocks above, the flags among the node's GPUs
        # at the end (several GPUs per node: the gather's tile flags, then the forward's), which start below every
        # epoch on every rank before the barrier
        self._flag_base = self.nvl_bytes - node_flag_bytes(self.G)
        self._forward_flag_base = self._flag_base + 4 * self.G * GATHER_MAX_TILES
        # ... and below the flags, with UCCL_EP_UNPACK_BESIDE_FORWARD, a ready word per final row (the same on every
        # rank: the setting is agreed and every NVL region has the same size)
        self._ready_rows = ready_word_rows(self._flag_base, self.G, bool(s.kernel.unpack_beside_forward))
        self._ready_base = self._flag_base - ready_word_bytes(self._ready_rows)
        if self._ready_base < self.nvl_bytes:
            _raw_bytes(self._cx.nvl_ptr + self._ready_base, self.nvl_bytes - self._ready_base, self.device).zero_()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        dist.barrier(group=self._gloo)
        native.module().unlink_shared_host_memory_names()
        self._cx.proxy_start()
        node_ranks = range(self.node * self.G, (self.node + 1) * self.G)
        self.peer_nvl = self._cx.open_nvl_peers([bytes(gathered[r][1]) for r in node_ranks], self.local)
        # the dispatch forward's destinations, on the device for its one launch (forward_rows)
        self._forward_targets = torch.tensor(self.peer_nvl, dtype=torch.int64).to(self.device)
        # ... and where each one's ready words are (UCCL_EP_UNPACK_BESIDE_FORWARD)
        self._ready_targets = torch.tensor([p + self._ready_base for p in self.peer_nvl],
                                           dtype=torch.int64).to(self.device)
        self._forward_targets_or = functools.reduce(operator.or_, self.peer_nvl)
        self._rdma = _raw_bytes(self._cx.rdma_ptr, self.rdma_bytes, self.device)
        self._nvl = _raw_bytes(self._cx.nvl_ptr, self.nvl_bytes, self.device)
        # The notify area (one count row per rank, at the end of the RDMA region) is the count exchange through the
        # proxies; with very many ranks it would eat the region, and notify falls back to a gloo all_gather.
        # A row: [tokens per rank | per node | per expert, up to NOTIFY_MAX_EXPERTS]; the area holds R of the widest
        # (a call packs its rows at the width it uses).
        self._notify_row = _align(8 * notify_row_words(self.R, self.N))
        notify_bytes = self.R * self._notify_row
        self._notify_via_proxies = notify_bytes <= self.rdma_bytes // 16
        usable = self.rdma_bytes - (notify_bytes if self._notify_via_proxies else 0)
        self.half_rdma = usable // 2 // CMD_UNIT * CMD_UNIT
        self._notify_base = 2 * self.half_rdma
        # where the matrix lands on the host: copied on the stream behind the notify wait, so the drain that follows
        # the wait also brings it home (a read-back after the drain was one more synchronous copy per dispatch). The
        # CPU stand-in copies there too, at the wait: read from the area later, a peer's next count row could be
        # there already (a peer whose dispatch needs nothing more of ours -- a forward before the count read -- may
        # start its next notify before we read this one)
        self._notify_host = (torch.empty(notify_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                             if self._notify_via_proxies else None)
        self._notify_view_cache: dict = {}  # _notify_views
        # small tables go to the device from pinned memory allocated now (a first pinned allocation may synchronize)
        self._staging = (UploadStaging(self.device, self._cx.copy_to_device)
                         if self.device.type == "cuda" and s.kernel.pinned_uploads else None)
        self.half_nvl = self._ready_base // 2 // CMD_UNIT * CMD_UNIT
        self.gather_block = self.half_nvl // self.G // CMD_UNIT * CMD_UNIT
        if self._cx.num_fifos != self.L:
            raise InternodeError(f"the proxy has {self._cx.num_fifos} FIFOs, planning assumed {self.L}")
        self._barrier_slot = 2 * self.N * self.L
        self._notify_slot = self._barrier_slot + 1
        self._fixed_tables: dict = {}  # (phase, row bytes) -> device push table that never changes (barrier, notify)
        self._zero_rows: dict = {}  # payload bytes -> zero row (combine: a node without a partial sum adds it)
        drains = drain_after_waits(s.kernel.drain_after_waits, self.transport.name, self._copy_agent is not None)
        self._drain_after_waits = self.device.type == "cuda" and drains
        # sync-free dispatches return before the count read only without drains (the CPU stand-in, which never
        # drains, follows the setting too: its tests see the GPU's behaviour)
        self._sync_free_returns_early = not drains
        # without drains, the loopback's calls must come from a non-default stream unless the copy agent moves its
        # bytes (check_stream_without_drains, the one rule; this only spares the stream lookup where it cannot refuse)
        self._check_stream = self.device.type == "cuda" and not self._drain_after_waits
        self.gated_arrivals = bool(s.kernel.gated_arrivals)  # docs/internode.md, "Gated arrivals"
        self.skip_dispatch_barrier = bool(s.kernel.skip_dispatch_barrier)
        self.push_head = bool(s.kernel.push_head)
        self.pack_and_push = bool(s.kernel.pack_and_push)
        self.expert_sums_in_pack = bool(s.kernel.expert_sums_in_pack)
        # docs/internode.md, "Pipelined combine gather": every rank of the group takes the same way (the forwarders
        # wait for flags only the pipelined gather raises), so nothing of one rank's hop decides it
        self.pipelined_gather = (bool(s.kernel.pipelined_combine_gather) and self.G > 1 and self.pack_and_push
                                 and self.G <= self._k.NODE_SUMS_MAX_RANKS_PER_NODE)
        if self.G > 1 and self._k.GATHER_MAX_TILES != GATHER_MAX_TILES:
            raise InternodeError(f"the module has {self._k.GATHER_MAX_TILES} gather tile flags, planning assumed "
                                 f"{GATHER_MAX_TILES} (rebuild _C)")
        # ... and its copies beside the node sum and push, on the context's second stream (the same on every rank)
        self.gather_beside_push = self.pipelined_gather and bool(s.kernel.gather_beside_push)
        self.gather_beside_push_blocks = int(s.kernel.gather_beside_push_blocks)
        self.gather_blocks = int(s.kernel.gather_blocks)
        self._gather_to_join = False  # a gather launched on the side stream that our stream has not waited for yet
        self.gathers_beside_push = 0  # (tests, benchmarks)
        self._gather_epoch = 0  # pipelined combines so far: the value their tile flags are raised to (the same count
        # on every rank of the group)
        self.pipelined_gathers = 0  # (tests, benchmarks)
        # docs/internode.md, "The dispatch forward's node barrier": likewise the same on every rank
        self.forward_node_barrier = bool(s.kernel.forward_node_barrier) and self.G > 1
        # docs/internode.md, "The unpack beside the forward": likewise agreed (a forwarder marks the rows its GPUs wait
        # for); each GPU's own unpack on the second stream, beside its forward
        self.unpack_beside_forward = bool(s.kernel.unpack_beside_forward) and self.G > 1 and self.gated_arrivals
        self.unpack_beside_forward_blocks = int(s.kernel.unpack_beside_forward_blocks)
        self._unpack_beside: Optional[int] = None  # the forward's epoch, while its rows are to be unpacked beside it
        self._beside_keep: Optional[torch.Tensor] = None  # the forward's output, held until that unpack's end
        self.unpacks_beside_forward = 0  # (tests, benchmarks) reads launched beside: unpacks, expert-major receives
        self.expert_major_receives_beside_forward = 0  # ... those of expert-major receives
        self._forward_epoch = 0  # dispatch forwards ended with it so far: their flags' value
        # our flag row in each local GPU's NVL region (column 0 of the forward's block)
        self._forward_flag_targets = torch.tensor(
            [self.peer_nvl[j] + self._forward_flag_base + 4 * self.local * GATHER_MAX_TILES for j in range(self.G)],
            dtype=torch.int64).to(self.device) if self.G > 1 else None
        self.expert_sums_in_packs = 0  # expert-major combines whose pack summed the rows (tests, benchmarks)
        # hops whose records were written and pushed in one launch, by phase (tests, benchmarks)
        self.packs_and_pushes = {"dispatch_network": 0, "combine_network": 0}
        self._chunk_ready: Optional[torch.Tensor] = None  # pack_and_push's per-chunk counters, zero between launches
        self.pack_during_notify = bool(s.kernel.pack_during_notify)
        self.push_during_notify = bool(s.kernel.push_during_notify)
        # docs/internode.md, "Planning ahead": with several GPUs per node the dispatch's planning sits between its
        # count read and its return, with the GPU waiting behind it; at first use it hides behind the caller's work
        self.plan_ahead = s.kernel.plan_ahead == "on" or (s.kernel.plan_ahead == "auto" and self.G == 1)
        # docs/internode.md, "Reading before the count read": the setting, where it can apply (with several GPUs per
        # node, "The forward before the count read", the forward ends with the node barrier over NVLink, which the GPU
        # raises and waits for without the host)
        self.read_before_counts = (bool(s.kernel.read_before_counts)
                                   and (self.G == 1 or bool(s.kernel.forward_node_barrier)))
        self.read_slack = float(s.kernel.read_before_counts_slack)
        # ... and every other condition of it fixed at setup (pack and push during notify: _reading_before_counts)
        self._reads_before_counts_at_all = (self.read_before_counts and self.gated_arrivals and self.pack_during_notify
                                            and self._notify_via_proxies)
        self.own_rows_from_columns = bool(s.kernel.own_rows_from_columns)  # docs/internode.md, "Own rows from ..."
        self.own_rows_read_from_columns = 0  # gated readers that did (tests, benchmarks)
        # docs/internode.md, "Expert-major rows in the reader" (where notify carries the per-expert counts): by
        # default every one, except, where ranks share a GPU (their readers are held to spin_blocks), uncached ones
        # that read after the count read
        self.expert_major_in_reader = {  # by kind of dispatch
            kind: reads_expert_major_rows(s.kernel.expert_major_in_reader, self._cx.spin_blocks, kind != "uncached")
            for kind in ("uncached", "uncached early", "cached")}  # early: launched before the count read
        self.expert_major_reads = {"uncached": 0, "cached": 0}  # receives the reader wrote (tests, benchmarks)
        self.expert_major_places_on_device = 0  # ... whose places were made from the count rows (tests, benchmarks)
        self._notify_rows_at: Optional[CountRows] = None  # where the last notify's rows are on the device (or None)
        self._recv_rows_seen: dict = {}  # tokens -> rows the last uncached dispatch of that size received
        self._expert_rows_seen: dict = {}  # ... and the expert-major rows it filled (an expert-major receive)
        # the gate table and words a reader before the counts takes from the device (gate_from_count_rows)
        self._read_gate = torch.zeros((self.N, GATE_FIXED + self.L), dtype=torch.int64, device=self.device)
        self._read_dims = torch.zeros(READ_DIMS, dtype=torch.int64, device=self.device)
        # ... and with several GPUs per node the forward's block table, final rows per local GPU and words, then the
        # unpack's words (forward_from_count_rows)
        self._fwd_blocks = torch.zeros((self.N, 1 + self.G), dtype=torch.int64, device=self.device)
        self._fwd_limits = torch.zeros(self.G, dtype=torch.int64, device=self.device)
        self._fwd_dims = torch.zeros(FORWARD_DIMS, dtype=torch.int64, device=self.device)
        self.forwards_before_counts = 0  # forwards launched before the count read that forwarded (tests, benchmarks)
        self.reads_before_counts = 0  # readers launched before the count read that read (tests, benchmarks)
        self.reads_before_counts_declined = 0  # ... that the counts sent back to the reader after notify
        # sync-free dispatches that returned before the count read (tests, benchmarks), and the last one's handle with
        # the rest of its host work, which the next call's entry does (_finish_dispatch_before_counts)
        self.dispatches_before_counts = 0
        self._deferred_dispatch: Optional[Tuple[InternodeHandle, Callable[[], DispatchResult]]] = None
        self.expert_major_reads_before_counts = 0  # ... of expert-major receives, whose reader wrote the rows
        # the outputs of the next such reader, made during a combine's hop: (spec, tensors) (_spare_read_outputs)
        self._next_read: Optional[tuple] = None
        self._spare_read_outputs: Optional[tuple] = None
        self.spare_read_outputs_taken = 0  # (tests, benchmarks)
        self._staged_plans: list = []  # plan tables staged during a reader's spin, copied at the next call's entry
        # (forward_block_bases host table, its device copy): the last one uploaded, shared by every layout of a handle
        self._forward_bases_memo: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.plans_made_ahead = 0  # hop plans made for a handle's next calls (_plan_ahead; tests, benchmarks)
        self.last_drain_ns: Optional[Tuple[int, int]] = None  # the last drain's start and end (wire timeline)
        self._em_grids: dict = {}  # expert-major kernels' grids (_expert_major_grid)
        self._expected = [0] * (2 * self.N * self.L + 2)  # running targets of the monotone signal counters
        # Entry barrier of combine (docs/internode.md, "Areas"): a combine may skip it when every rank synchronized
        # (notify or barrier) since the last combine and its rows stay clear of what the last dispatch filled, whose
        # per-rank extents are kept here. Every rank holds the same values (same calls, same counts).
        self._synced_since_combine = False
        self._last_dispatch_extents: Optional[Tuple[List[int], List[int]]] = None
        self.combine_barriers_skipped = 0  # benchmarks and tests
        # ... and a cached dispatch right after a combine may skip its own (dispatch_may_skip_entry_barrier): the
        # counts and areas of the last call when it was a combine
        self._last_combine: Optional[Tuple[Counts, CombineAreas]] = None
        # the handle of the last dispatch that completed, and -- while the last call was a combine of that handle that
        # completed -- where that combine's partial sums start in our send half: what lets the next uncached dispatch
        # pack its records while notify is still exchanging the counts (_pack_during_notify)
        self._last_dispatch_handle: Optional[InternodeHandle] = None
        self._combined_send_base: Optional[int] = None
        # send-plan tables made while the last combine's hop ran, for the next dispatch's packing during notify:
        # ((tokens, records), the tables), taken by the first send plan of that size (_send_tables)
        self._spare_send_tables: Optional[Tuple[Tuple[int, int], Tuple[torch.Tensor, ...]]] = None
        self.spare_send_tables_taken = 0  # (tests, benchmarks)
        self.packs_during_notify = 0  # uncached dispatches that did (tests, benchmarks)
        self.pushes_during_notify = 0  # ... and that pushed them during notify too
        self.packs_and_pushes_during_notify = 0  # launches that did both (_pack_and_push_during_notify)
        self.count_rows_pushed_with_records = 0  # ... and pushed our count row too (no push_chunks for it)
        self.dispatch_barriers_skipped = 0
        self.forwards_during_hop = 0  # dispatches whose forwarders read their arrivals as they landed (G > 1)
        self.forward_node_barriers = 0  # dispatch forwards that ended with the node barrier over NVLink (G > 1)
        self._phases = dict(self._k.PHASES)
        self._codes = dict(self._k.ERROR_CODES)
        if self.read_before_counts and self.G == 1:
            # its kernel's first launch now, with nothing spinning: the first real one queues behind notify's spinning
            # wait, where a lazy module load might wait for that wait ("Drains"); the zero rows make words only
            zeros = torch.zeros((self.R, 2 * self.R), dtype=torch.int64, device=self.device)
            bases, table = self._counter_bases([0] * (self.N * self.L))
            self._k.gate_from_count_rows(zeros.data_ptr(), 2 * self.R, self.R, self.rank, self.L, bases, 16, 0, 0, 0,
                                         self._read_gate.data_ptr(), self._read_dims.data_ptr(), self._stream(),
                                         counter_bases_table=_address(table))
            self._drain("setup: the reader-before-counts kernel's first launch")
        elif self.read_before_counts:
            self._first_launches_before_counts()
        if self.G > 1:
            self._first_forward_launches()
        if self.pipelined_gather:
            self._first_gather_launches()
        self._destroyed = False
        track(self)
        self.last_traffic = None
        # Benchmarks set this to time the network hop alone (push -> last signal) with CUDA events: phase -> [ms]
        self.network_timing: Optional[dict] = None
        # ... and this to split the host's wall time of each call into its steps: step -> [seconds, calls]
        self.host_timing: Optional[dict] = None
        self._lap_t = 0.0
        # ... and this to read the pack-and-push launches' GPU stamps (start_kernel_timeline)
        self.kernel_timeline: Optional[KernelTimeline] = None

    def _first_forward_launches(self) -> None:
        """The forwarder's reader's first launches (gated and not), with nothing spinning: the first real one queues
        behind the push, whose kernel may spin for FIFO room that the proxies make ("Drains": a lazy module load then
        waits for it). One record whose dest rows are all -1: nothing leaves it."""
        layout = _record_layout((16,), self.G)
        record = torch.full((1, layout.stride), 255, dtype=torch.uint8, device=self.device)
        zeros = torch.zeros((1, 1 + self.G), dtype=torch.int64, device=self.device)  # (limits; one block, bases 0)
        out = torch.empty((1, self.G), dtype=torch.int64, device=self.device)
        for gate in (None, self._cx.arrival_gate(0, 0, 1, self._phases["dispatch_network"])):
            self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes,
                                     self.G, record.data_ptr(), layout.stride, 1, layout.final_bytes,
                                     zeros.data_ptr(), zeros.data_ptr(), 1, layout.dest_rows_offset,
                                     layout.arrival_offset, out.data_ptr(), self._stream(), gate=gate)
        flags = torch.zeros(self.G, dtype=torch.int32, device=self.device)  # the node barrier's kernels too
        at = (flags.data_ptr() + 4 * torch.arange(self.G, dtype=torch.int64)).to(self.device)
        self._k.raise_flags(at.data_ptr(), self.G, 1, self._stream())
        raised = torch.ones((self.G, GATHER_MAX_TILES), dtype=torch.int32, device=self.device)
        self._cx.wait_node_flags(raised.data_ptr(), self.G, 1, 1, self._phases["dispatch_forward"], self._stream())
        self._drain("setup: the dispatch forward's first launches")
        if bool((out != -1).any()) or bool((flags != 1).any()):
            raise InternodeError(f"rank {self.rank}: the dispatch forward kernel misread a record whose dest rows are "
                                 f"all -1 (got {out.tolist()}), or raise_flags missed a flag ({flags.tolist()}); "
                                 "rebuild _C")

    def _first_launches_before_counts(self) -> None:
        """The first launches of the kernels a forward before the count read queues behind notify's spinning wait, as
        _first_forward_launches does for the forward's: forward_from_count_rows on zero rows with a send limit that
        refuses (the words say no), then the pack of our own records and the unpack taking those words (nothing
        written)."""
        dev, G = self.device, self.G
        zeros = torch.zeros((self.R, 2 * self.R), dtype=torch.int64, device=dev)
        dims = self._fwd_dims.data_ptr()
        bases, table = self._counter_bases([0] * (self.N * self.L))
        self._k.forward_from_count_rows(zeros.data_ptr(), 2 * self.R, self.R, G, self.rank, self.L, bases, 16, 16, -1,
                                        0, 0, 0, 0, self._read_gate.data_ptr(), self._fwd_blocks.data_ptr(),
                                        self._fwd_limits.data_ptr(), dims, self._stream(),
                                        counter_bases_table=_address(table))
        layout = _record_layout((16,), G)
        column = torch.zeros((1, 16), dtype=torch.uint8, device=dev)
        plan = torch.zeros(1 + G, dtype=torch.int64, device=dev)  # token 0, its dest rows
        self._k.pack_records(0, self._cx.rdma_ptr + self.half_rdma, 0, 0, layout.stride, plan.data_ptr(),
                             plan.data_ptr() + 8, G, 1, _column_args([column], layout), layout.src_idx_offset,
                             layout.dest_rows_offset, self._stream(), own_dims=dims)
        out = torch.empty((1, 16), dtype=torch.uint8, device=dev)
        self._unpack_launch(self._cx.nvl_ptr, layout.final_bytes, 1, 1, layout, [out], None, None, 1, 0, 0, None,
                            None, dims=dims + 8 * READ_DIMS, pad=False)
        self._drain("setup: the forward-before-counts kernels' first launches")
        if int(self._fwd_dims[READ_GO]) or int(self._fwd_dims[READ_DIMS + READ_GO]):
            raise InternodeError(f"rank {self.rank}: forward_from_count_rows let a refused forward go "
                                 f"({self._fwd_dims.tolist()}); rebuild _C")

    def _first_gather_launches(self) -> None:
        """The pipelined combine gather's kernels' first launches, with nothing spinning, as _first_forward_launches
        does for the forward (which also launches wait_node_flags first): gather_tiles with no arrivals (nothing
        copied or flagged), and pack_and_push with node sums over one record of our own node whose copies nobody
        holds (written as zeros to a scratch row, nothing pushed)."""
        dev, G, k = self.device, self.G, self._k
        targets = torch.zeros((3, G), dtype=torch.int64, device=dev)  # no gather block, no flag row, no arrivals
        by_arrival = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.gather_rows_by_arrival(by_arrival.data_ptr(), G, 1, 0, 0, 0, 0, self._stream())  # (memset only: -1)
        k.gather_tiles(targets[0].data_ptr(), targets[1].data_ptr(), G, by_arrival.data_ptr(), 1,
                       targets[2].data_ptr(), GATHER_MIN_TILE_ROWS, 0, 16, 0, 0, 0, 16, 1, self._stream(),
                       blocks=self.gather_blocks)
        # the per-handle tables' kernels with one row each: a row of source 0 at arrival 0, an arrival with no copy
        ends, arrival = torch.ones(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
        row_table = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.gather_rows_by_arrival(row_table.data_ptr(), G, 1, ends.data_ptr(), 1, arrival.data_ptr(), 1,
                                 self._stream())
        no_copy = torch.full((1, G), -1, dtype=torch.int64, device=dev)
        sum_rows = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.forward_sum_rows(sum_rows.data_ptr(), G, 1, 1, no_copy.data_ptr(), self._stream())
        flags = torch.ones((G, GATHER_MAX_TILES), dtype=torch.int32, device=dev)  # (already at the epoch)
        scratch = torch.full((2, 16), 255, dtype=torch.uint8, device=dev)
        table = torch.tensor([[self.rank, 0, 0, 16, 0, self._barrier_slot, 0]], dtype=torch.int64, device=dev)
        ready = torch.zeros(1, dtype=torch.int32, device=dev)
        rows_of = torch.full((G, 1), -1, dtype=torch.int32, device=dev)
        node_sums = (scratch[1].data_ptr(), rows_of.data_ptr(), G, 16, 0, False, flags.data_ptr(),
                     GATHER_MIN_TILE_ROWS, 1)
        self._cx.pack_and_push(table.data_ptr(), 1, 1, self._cx.rdma_ptr, scratch[0].data_ptr(), 0, 1, 16, 0, 0, 0, 1,
                               [], -1, 0, ready.data_ptr(), self._phases["combine_network"], self._stream(),
                               node_sums=node_sums)
        self._drain("setup: the pipelined combine gather's first launches")
        if bool((scratch[0] != 0).any()):
            raise InternodeError(f"rank {self.rank}: the node sum of a record nobody holds a copy of is not zero (got "
                                 f"{scratch[0].tolist()}); rebuild _C")
        if row_table.view(-1).tolist() != [0] + [-1] * (G - 1) or bool((sum_rows != -1).any()):
            raise InternodeError(f"rank {self.rank}: the combine's table kernels misread one row (by arrival "
                                 f"{row_table.view(-1).tolist()}, node-sum rows {sum_rows.view(-1).tolist()}); "
                                 "rebuild _C")

    def start_kernel_timeline(self, launches: int) -> None:
        """Stamp the next ``launches`` pack_and_push launches on the GPU (docs/internode.md, "Kernel timeline")."""
        self.kernel_timeline = KernelTimeline(self._cx, self._k, self.device, launches)

    def stop_kernel_timeline(self) -> List[dict]:
        """Every launch stamped since start_kernel_timeline (kernel_timeline.launch_record), once the stream that ran
        them drained (with the backend's deadline, not a bare synchronize)."""
        timeline, self.kernel_timeline = self.kernel_timeline, None
        if timeline is None:
            return []
        self._drain("the kernel timeline's launches")
        return timeline.stop()

    def start_wire_log(self, capacity: int) -> None:
        """Record the emulated wire's busy runs (docs/internode.md, "Wire timeline"): the loopback with a bandwidth
        cap only (ValueError otherwise)."""
        if not hasattr(self._cx, "start_wire_log"):
            raise ValueError("the wire log needs the native module (the CPU stand-in has no emulated wire)")
        try:
            self._cx.start_wire_log(int(capacity))
        except (RuntimeError, ValueError) as e:  # the binding's std::invalid_argument
            raise ValueError(f"rank {self.rank}: {e}") from None

    def stop_wire_log(self) -> dict:
        """The runs recorded since start_wire_log: {'runs': [(start_ns, end_ns, bytes, writes)], 'dropped': n}."""
        return self._cx.stop_wire_log()

    def raw_dispatch_hop(self, handle: InternodeHandle, columns: List[torch.Tensor]) -> None:
        """Benchmarks: the transport alone on a cached dispatch's bytes. The handle's dispatch hop for these columns
        is pushed as it is -- the same chunks, lanes, commands and waits, of whatever the send area holds -- and
        awaited, with no packing, no reading of the arrivals and no host planning: what the transport takes to move
        this call's network bytes, for the benchmark's ratio of each call to it. Every rank calls it together; an
        entry barrier first (the receive areas get stale bytes, which the next dispatch overwrites). Timed like
        the calls' hops when ``network_timing`` is set (phase dispatch_network)."""
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        rows = [_dense(c, c.dtype) for c in columns]
        layout = _record_layout(tuple(_row_bytes(r) for r in rows), self.G)
        h: InternodeHandle = handle
        shape = h.dispatch_shapes.get(layout)
        if shape is None:  # made and checked once per handle and layout, as a cached dispatch keeps it (_move)
            shape = h.dispatch_shapes[layout] = self._dispatch_shape(h.counts, h.plan, layout)
        hop = self._hop_plan(h, ("dispatch", layout.stride),
                             lambda: self._dispatch_hop(h.counts, h.plan, layout.stride))
        self._barrier("entry of the raw dispatch hop")
        # the areas it used are a cached dispatch's: the next calls' barrier rules take it for one
        self._combined_send_base, self._last_combine, self._synced_since_combine = None, None, True
        self._last_dispatch_extents = shape.extents
        self._push_and_wait(hop.rows, hop.waits, "dispatch_network", hop.per_chunk, "raw dispatch hop", hop=hop)

    # ---------------------------------------------------------------- host-side steps
    def _stream(self) -> int:
        return native.stream_handle(self.device)  # 0 for the CPU stand-in: synchronous, no stream

    def check_caller_stream(self, stream: int) -> None:
        """check_stream_without_drains for the caller's stream where the calls run on another (Buffer's comm stream):
        the caller's stream then waits on ours, and a pageable copy queued there behind our spinning wait stalls the
        loopback just the same (docs/internode.md, "Drains")."""
        if self._check_stream:
            check_stream_without_drains(self._drain_after_waits, self.transport.name, stream, self.rank,
                                        copy_agent=self._copy_agent is not None)

    def _refuse_a_stall_without_drains(self) -> None:
        """check_stream_without_drains at a call's entry; the stream is looked up only where it can matter."""
        if self._check_stream:
            self.check_caller_stream(self._stream())

    def _check(self, what: str = "") -> None:
        """Raise InternodeError if a kernel of this rank recorded an error or its proxy failed. The message names
        the rank, the phase and kernel, the counter (slot) with what it counts and who feeds it, the value expected
        and the value seen, what the host sees in the same counter, and the proxy's own error."""
        fields = self._cx.error_fields()
        perr = self._cx.proxy_error()
        if not fields["code"] and not perr:
            return
        parts = []
        if fields["code"] and fields["code"] != self._codes["aborted"]:
            msg = self._cx.error_message() + describe_gpu_error(fields, self.rank, self.G, self.N, self._codes,
                                                                 self.L)
            if fields["code"] == self._codes["wait_timeout"]:
                slot = int(fields["slot"])
                msg += f" [the host reads signal[{slot}] = {self._cx.signal_value(slot)}]"
            parts.append(msg)
        if perr:
            parts.append(f"rank {self.rank} proxy: {perr}")
        elif fields["code"] == self._codes["aborted"]:
            parts.append(f"rank {self.rank}: GPU waits were aborted by the host")
        try:
            parts.append(f"proxy totals {self._cx.proxy_totals()}")
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
        try:
            parts.append(describe_fifo_states(self._cx.fifo_states(), self.rank))
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
        parts.append(self._proxy_threads())
        self._cx.clear_error()
        self._chunk_ready = None  # a failed pack_and_push may have left counts behind: the next one starts afresh
        raise InternodeError("; ".join(parts) + (f" (during {what})" if what else "") + "\n" + timeout_hint())

    def _proxy_threads(self) -> str:
        """What each proxy thread holds (operations queued, writes in flight, signals held back for order), for
        error messages."""
        try:
            return "proxy threads:\n" + self._cx.proxy_counters().rstrip("\n")
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"proxy threads: not readable ({exc})"

    def _mark_drain(self) -> bool:
        """Record the drain mark now, for a ``_drain(marked=True)`` that waits only for what is queued so far
        (False on the CPU stand-in, where everything has run)."""
        self._join_gather()  # (a drain covers the side stream's copies too)
        if self.device.type != "cuda":
            return False
        self._cx.record_drain_mark(self._stream())
        return True

    def _drain(self, what: str, marked: bool = False) -> None:
        """Wait for this rank's stream with a deadline, never an unbounded synchronize. Every GPU wait has its own
        deadline (UCCL_EP_GPU_TIMEOUT_SECS); a proxy that fails meanwhile aborts the GPU waits at once, so the
        error surfaces in milliseconds instead of after the GPU deadline. ``marked``: only up to the mark
        _mark_drain recorded (what was queued after it may still run)."""
        if not marked:
            self._join_gather()  # (a drain covers the side stream's copies too)
        if self.device.type != "cuda":  # CPU stand-in: every call has completed when it returns
            self._check(what)
            return
        stream = self._stream()
        if not marked:
            self._cx.record_drain_mark(stream)
        began = time.monotonic_ns()
        t0 = time.monotonic()
        limit = 2 * self.gpu_timeout + self.cpu_timeout
        aborted = False
        spins = 0
        while not self._cx.drain_mark_reached():
            spins += 1
            if spins % 16 == 0:
                if not aborted and self._cx.proxy_error():
                    self._cx.abort_waits()
                    aborted = True
                waited = time.monotonic() - t0
                if waited > limit:
                    self._chunk_ready = None  # a pack_and_push that never ended may have left counts behind
                    raise InternodeError(
                        f"rank {self.rank}: the GPU stream did not drain within {limit:.0f} s after {what} "
                        f"(2 x UCCL_EP_GPU_TIMEOUT_SECS + UCCL_EP_CPU_TIMEOUT_SECS); GPU error word "
                        f"{self._cx.error_fields()}; proxy error {self._cx.proxy_error()!r}; "
                        f"{self._proxy_threads()}\n{timeout_hint()}")
                time.sleep(0 if waited < 2e-3 else 1e-4)
        # (CLOCK_MONOTONIC: the clock of the emulated wire's log and the benchmark's call windows)
        self.last_drain_ns = (began, time.monotonic_ns())
        if self._staging is not None:  # every upload queued before the mark has run (none is queued after one)
            self._staging.drained(stream)
        self._check(what)

    def _settle(self, what: str, drain: Optional[bool] = None) -> None:
        """After a network wait, and at the edges of a call: drain the stream where the policy says so (default:
        ``_drain_after_waits``, see _push_and_wait), else only read the error word."""
        if self._drain_after_waits if drain is None else drain:
            self._drain(what)
        else:
            self._check(what)

    def _proxy_view(self, grace: float = 0.2) -> str:
        """The proxy's error, given it ``grace`` seconds to appear: when gloo fails because a peer died, the loopback
        names the dead rank and its pid within a few milliseconds (liveness check every 5 ms)."""
        t0 = time.monotonic()
        perr = self._cx.proxy_error()
        while not perr and time.monotonic() - t0 < grace:
            time.sleep(0.005)
            perr = self._cx.proxy_error()
        return perr

    def _barrier(self, what: str) -> None:
        """Group barrier in stream order, through the proxies: every rank pushes a zero-byte signal to every other
        rank behind all its earlier work on the stream, then waits (GPU, with the GPU deadline) for one from each;
        the host drains after it where drains are on (_settle). Work queued after it runs once every rank's earlier
        kernels -- its reads of its areas, its stores into peers' NVL areas -- are complete. The network writes they
        pushed on other lanes may still be in flight (the proxy threads are not ordered with each other): the
        receivers' own counter waits cover those. It replaced a gloo barrier over TCP (~1 ms per barrier with 4
        processes; docs/internode.md)."""
        rows = [[r, 0, 0, 0, 1, self._barrier_slot, 0] for r in range(self.R) if r != self.rank]
        self._push_and_wait(rows, [(self._barrier_slot, self.R - 1)], "barrier", 1, what, fixed=True)

    def _notify(self, is_token_in_rank: torch.Tensor, tokens_per_expert: Optional[torch.Tensor],
                then: Optional[Callable[[torch.Tensor, CountRows], None]] = None,
                plan: Optional[SendPlan] = None, row_goes_with_then: bool = False,
                ahead: Optional[Callable[[CountRows], None]] = None, defer: bool = False) -> Any:
        """Every rank's counts on every rank. With the tokens per expert (up to NOTIFY_MAX_EXPERTS) in the rows, a
        receiver knows its per-expert counts from notify alone, and neither dispatch nor combine reads anything else
        back. Every rank makes the same choice: the same group and experts. ``then(row, rows)``: work for while the
        rows are exchanged, given our own count row on the device and where every row lands (through the proxies
        only); ``plan``: tables for T x N records that the count row's launch also fills with our send plan, counted
        from our own tokens, for ``then`` (count_row with send_plan: one launch fewer before a dispatch packed during
        notify). ``row_goes_with_then``:
        ``then`` launches a kernel that pushes our row itself (the rows' ``own_pushes``), so no launch pushes it
        before. ``ahead(rows)``: launches queued behind the rows' wait and the matrix's copy, that the host does not
        wait for before it reads the matrix (a reader launched before the count read; with ``then`` only).
        ``defer`` (through the proxies only): return, instead of the counts, a function that reads them later -- the
        host waits for nothing now (a sync-free dispatch that returns before the count read)."""
        carry = tokens_per_expert is not None and tokens_per_expert.numel() <= NOTIFY_MAX_EXPERTS
        shape = dict(num_experts=tokens_per_expert.numel() if carry else 0)
        width = self.R + self.N + shape["num_experts"]
        tpe = tokens_per_expert if carry else None
        self._notify_rows_at = None  # (set where the rows land on the device: _notify_through_proxies)
        if self._notify_via_proxies:
            row = self._notify_views(width)[0]
            self._count_row(row, is_token_in_rank, tpe, plan if then is not None else None)
            return self._notify_through_proxies(width, shape,
                                                (lambda rows: then(row, rows)) if then is not None else None,
                                                row_goes_with_then, ahead, defer)
        row = torch.empty(width, dtype=torch.int64, device=self.device)
        self._count_row(row, is_token_in_rank, tpe)
        self._drain("notify")  # bounded; the copy to the host below then never waits behind a stuck kernel
        row = row.cpu()
        out = [torch.empty_like(row) for _ in range(self.R)]
        try:
            dist.all_gather(out, row, group=self._gloo)
        except Exception as exc:
            perr = self._proxy_view()
            raise InternodeError(f"rank {self.rank}: notify (count exchange) failed within {self.cpu_timeout} s: "
                                 f"{exc}" + (f"; rank {self.rank} proxy: {perr}" if perr else "")
                                 + f"\n{timeout_hint()}") from exc
        self._check()
        return counts_from_rows(torch.stack(out), self.R, self.N, **shape)

    def _count_row(self, out: torch.Tensor, is_token_in_rank: torch.Tensor, tokens_per_expert: Optional[torch.Tensor],
                   plan: Optional[SendPlan] = None) -> None:
        """local_count_row into ``out`` (int64 on the device) in one launch (count_row kernel), which also writes our
        send plan into ``plan`` (node bases counted from the tokens); through torch, and the send plan by a launch of
        its own, when the row has more bins than the kernel's shared memory holds."""
        if self.R + self.N > self._k.COUNT_ROW_MAX_BINS:
            out.copy_(local_count_row(is_token_in_rank, self.G, tokens_per_expert))
            if plan is not None:
                self._send_plan_launch(is_token_in_rank, plan, 0)
            return
        itr = _dense(is_token_in_rank, torch.bool)
        tpe = None
        if tokens_per_expert is not None:
            tpe = tokens_per_expert if tokens_per_expert.device == self.device else tokens_per_expert.to(self.device)
            tpe = _dense(tpe, tpe.dtype if tpe.dtype in (torch.int32, torch.int64) else torch.int64)
        self._k.count_row(out.data_ptr(), itr.data_ptr(), itr.size(0), self.R, self.G,
                          _address(tpe), tpe is not None and tpe.dtype == torch.int64,
                          tpe.numel() if tpe is not None else 0, self._stream(),
                          send_plan=self._table_addresses(plan) if plan is not None else None)

    def _send_plan(self, is_token_in_rank: torch.Tensor, counts: Counts) -> SendPlan:
        """internode_plan.send_plan with its device tables made by one launch (send_plan kernel); the host part (how
        many records go to each node, where each node's run starts) comes from the counts."""
        node_send = [int(c) for c in counts.node_counts[self.rank].tolist()]
        node_base = self._upload([sum(node_send[:m]) for m in range(self.N)])  # each torch op costs ~5-10 us here
        plan = self._fresh_plan(is_token_in_rank.size(0), sum(node_send), node_send)
        self._send_plan_launch(is_token_in_rank, plan, node_base.data_ptr())
        return plan

    def _fresh_plan(self, T: int, records: int, node_send: List[int]) -> SendPlan:
        """A SendPlan over fresh tables (_send_tables) for T tokens and ``records`` send records, not written yet."""
        hop1_token, dest_rows, dest_row_all, row_of = self._send_tables(T, records)
        return SendPlan(hop1_token, node_send, dest_rows, dest_row_all, row_of)

    @staticmethod
    def _table_addresses(plan: SendPlan) -> Tuple[int, int, int, int]:
        """The send plan's tables as the kernels take them: (dest_row_all, hop1_token, dest_rows, row_of)."""
        return (plan.dest_row_all.data_ptr(), plan.hop1_token.data_ptr(), plan.dest_rows.data_ptr(),
                plan.row_of.data_ptr())

    def _send_plan_launch(self, is_token_in_rank: torch.Tensor, plan: SendPlan, node_base: int) -> None:
        """The send_plan kernel into ``plan``'s tables; ``node_base``: where each node's records start in the list
        (device int64 [N]; 0: counted from the tokens)."""
        itr = _dense(is_token_in_rank, torch.bool)
        self._k.send_plan(itr.data_ptr(), itr.size(0), self.R, self.G, node_base,
                          *self._table_addresses(plan), self._stream())

    def _send_tables(self, T: int, records: int) -> Tuple[torch.Tensor, ...]:
        """Fresh (hop1_token, dest_rows, dest_row_all, row_of) for T tokens and ``records`` send records: the spare
        set when it has this size (taken: no two plans share tables), else allocated now."""
        spare, self._spare_send_tables = self._spare_send_tables, None
        if spare is not None and spare[0] == (T, records):
            self.spare_send_tables_taken += 1
            return spare[1]
        return self._new_send_tables(T, records)

    def _new_send_tables(self, T: int, records: int) -> Tuple[torch.Tensor, ...]:
        dev = self.device
        return (torch.empty(records, dtype=torch.int64, device=dev),
                torch.empty((records, self.G), dtype=torch.int64, device=dev),
                torch.empty((T, self.R), dtype=torch.int64, device=dev),
                torch.empty((self.N, T), dtype=torch.int32, device=dev))

    def _spare_for_packing_during_notify(self, T: int) -> None:
        """Make the send-plan tables of the next dispatch's packing during notify (T x N records: any counts) now,
        while the host waits for a combine's hop: four allocations (~15-20 us of host time) fewer before that
        dispatch's wire starts. A dispatch of another size makes its own, and drops the spare set."""
        key = (T, T * self.N)
        if self._spare_send_tables is None or self._spare_send_tables[0] != key:
            self._spare_send_tables = (key, self._new_send_tables(*key))

    def _per_chunk(self, stride: int) -> int:
        """Records per write; every rank derives the same number (same settings, the group's smallest transport
        write limit), so receivers know the lanes."""
        return chunk_records(stride, self.write_bytes)

    def _notify_views(self, words: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """For count rows of ``words`` int64: (our row in the notify area, the area's R rows as bytes, their pinned
        host copy or None), made once per width: each view costs host time before the count row leaves."""
        views = self._notify_view_cache.get(words)
        if views is None:
            R, base, row_bytes = self.R, self._notify_base, _align(8 * words)
            own = base + self.rank * row_bytes
            views = self._notify_view_cache[words] = (
                self._rdma[own:own + 8 * words].view(torch.int64), self._rdma[base:base + R * row_bytes],
                self._notify_host[:R * row_bytes] if self._notify_host is not None else None)
        return views

    def _notify_through_proxies(self, words: int, shape: dict, then: Optional[Callable[[CountRows], None]] = None,
                                row_goes_with_then: bool = False,
                                ahead: Optional[Callable[[CountRows], None]] = None, defer: bool = False) -> Any:
        """Count exchange in stream order: our row (``words`` int64, already in row ``rank`` of our notify area) goes
        into row ``rank`` of every rank's notify area (one write each, through the proxies), then we wait for every
        other rank's row and copy the matrix to the host. Receiving every row also proves that every rank finished
        its earlier work on the stream (each pushes behind it), so an uncached dispatch needs no entry barrier.
        Replaced a gloo all_gather (~1 ms with 4 processes).

        The rows sit back to back at the width this call uses (the same on every rank: same group, same number of
        experts), not at the area's widest row, so the matrix comes back in one contiguous copy: a strided one
        first gathered it on the device with a kernel of its own. ``then(rows)``: launched between our row's push and
        the wait for the others', told where the rows land and which counter value proves they did; with
        ``row_goes_with_then`` it pushes our row itself (``rows.own_pushes``: the push table), one launch fewer before
        the wire ("Push during notify"). ``ahead(rows)`` (with ``then``): launched behind the wait and the copy, and
        not waited for before the matrix is read ("Reading before the count read"). ``defer``: see _notify; the
        function it returns drains to the mark recorded behind the matrix's copy, then reads it."""
        R, base = self.R, self._notify_base
        row_bytes = _align(8 * words)
        own = base + self.rank * row_bytes
        self._lap("dispatch.notify_row")  # benchmarks: the count row's launches (and any wait they hide)
        rows = [[r, own, own, row_bytes, 1, self._notify_slot, 0] for r in range(R) if r != self.rank]
        _, area, host = self._notify_views(words)
        later = after = None
        carried = then is not None and row_goes_with_then
        if then is not None:
            # the wait below adds the R - 1 rows to the counter's target after `then`
            landing = CountRows(self._notify_slot, self._expected[self._notify_slot] + R - 1,
                                self._cx.rdma_ptr + base, row_bytes // 8,
                                (self._fixed_table("notify", rows).data_ptr(), len(rows)) if carried else None)
            later = lambda: then(landing)  # noqa: E731
            after = (lambda: ahead(landing)) if ahead is not None else None  # noqa: E731
        self._push_and_wait([] if carried else rows, [(self._notify_slot, R - 1)], "notify", 1,
                            "notify (count exchange)",
                            fixed=True, drain=True,  # the host reads the rows right below (or, deferred, later)
                            then=later,
                            after_wait=(lambda: host.copy_(area, non_blocking=True)) if host is not None else None,
                            unawaited=after, hold=defer)
        self._notify_rows_at = CountRows(self._notify_slot, self._expected[self._notify_slot],
                                         self._cx.rdma_ptr + base, row_bytes // 8)
        self._lap("dispatch.notify_exchange")  # until every peer's row is here: the ranks' skew shows up here

        def read() -> Counts:
            if defer:  # the drain _push_and_wait held back: the GPU has passed the matrix's copy
                self._drain("notify (count exchange) of the sync-free dispatch before this call", marked=True)
            # a copy of the pinned rows: the next notify overwrites them, and the counts live on in the handle
            mat = (host.clone() if host is not None else area.cpu()).view(torch.int64).view(R, row_bytes // 8)
            return counts_from_rows(mat[:, :words], R, self.N, **shape)
        return read if defer else read()

    def _upload(self, rows: Any, dtype: Any = np.int64) -> torch.Tensor:
        """A small host table (int64, or np.int32) on the device without a stream sync: through the pinned staging
        area (upload_staging.py), on the CPU stand-in as _upload_values."""
        if isinstance(rows, torch.Tensor):
            if rows.device.type != "cpu" or self._staging is None:
                return rows.to(self.device, non_blocking=True)
            rows = rows.numpy()
        if self._staging is not None:
            return self._staging.upload(rows, dtype, self._stream())
        return _upload_values(rows, dtype, self.device)

    def _push_and_wait(self, rows: List[List[int]], waits: List[Tuple[int, int]], phase: str, per_chunk: int,
                       what: str = "", fixed: bool = False, drain: Optional[bool] = None,
                       then: Optional[Callable[[], None]] = None, hop: Optional[HopPlan] = None,
                       rest: Optional[Callable[[], None]] = None,
                       after_wait: Optional[Callable[[], None]] = None,
                       push: Optional[Callable[[], None]] = None,
                       unawaited: Optional[Callable[[], None]] = None, hold: bool = False) -> None:
        """Push the table's chunks, wait for the signals, then drain if ``drain`` (default: the drain policy,
        ``_drain_after_waits``). ``fixed``: the rows are the same in every call of this phase (barrier, notify),
        so their device copy is made once and reused. ``then``: launches of kernels already loaded (never a first
        launch: see "Drains") that go between the push and the wait. ``hop`` (then ``rows`` are its own), ``rest``
        and ``push``: see _push_hop. ``after_wait``: copies (never a kernel) queued behind the wait, done when the
        drain returns. ``unawaited``: launches of kernels already loaded queued behind those, which the drain does
        not wait for (it waits for a mark recorded before them); they must queue no upload. ``hold``: record that
        mark and return without the drain, which the caller makes later (``_drain(marked=True)``, before any other
        mark: a sync-free dispatch's count read at the next call's entry)."""
        t0 = self._hop_started()
        if hop is not None:
            self._push_hop(hop, phase, rest, push)
        else:
            self._push(rows, phase, per_chunk, fixed)
        if then is not None:
            then()
        for slot, count in waits:
            self._expected[slot] += count
        self._wait_for_targets([slot for slot, _ in waits], phase)
        if after_wait is not None:
            after_wait()
        self._hop_ended(phase, t0)
        if hold or (unawaited is not None and (self._drain_after_waits if drain is None else drain)):
            marked = self._mark_drain()
            if unawaited is not None:
                unawaited()
            if hold:
                self._check(what or f"{phase} wait")
            else:
                self._drain(what or f"{phase} wait", marked=marked)
            return
        # Nothing else is launched while wait_signals spins (docs/internode.md, "Drains"): the host drains the
        # stream here, polling an event and aborting the waits as soon as the proxy reports a failure.
        self._settle(what or f"{phase} wait", drain)

    def _push_and_gate(self, hop: HopPlan, phase: str, then: Optional[Callable[[], None]] = None,
                       rest: Optional[Callable[[], None]] = None, push: Optional[Callable[[], None]] = None
                       ) -> Pending:
        """Push the table's chunks and return what its reader needs (Pending) instead of waiting: the kernel that reads
        the arrivals takes the gate and waits chunk by chunk (UCCL_EP_GATED_ARRIVALS), so it runs during the hop. The
        caller launches it, then calls ``_gated_done``, which drains as ``_push_and_wait`` does (the gated kernel
        spins as wait_signals did). The hop's gate blocks (dispatch_gate_blocks / combine_gate_blocks) name the
        same counters as its waits, whose targets advance here. ``rest``, ``push``: see _push_hop."""
        t0 = self._hop_started()
        self._push_hop(hop, phase, rest, push)
        if then is not None:  # as in _push_and_wait
            then()
        table = gate_rows(hop.gate_blocks, self.node, self.L, self._expected)
        for slot, count in hop.waits:
            self._expected[slot] += count
        t = self._upload(table) if table else None
        self._keep_w = t  # alive until the gated launch has run (the drain in _gated_done)
        return Pending(self._cx.arrival_gate(_address(t), len(table), hop.per_chunk,
                                             self._phases[phase]), t0, [slot for slot, _ in hop.waits],
                       records=sum(count for _, count in hop.waits))

    def _plan_before_reader(self, pending: Any) -> bool:
        """Where a call's planning for the next calls goes ("Planning ahead"): before its gated reader's launch, with
        its upload, while at least half of the hop's records are still to land -- the wire is busy for a while yet,
        so the planning costs nothing there; else after the launch, while the reader reads what is in (its tables
        staged, their copies queued at the next call's entry). One read of the hop's counters."""
        if not pending or not pending.records:
            return False
        left = self._cx.signals_short([(slot, self._expected[slot]) for slot in pending.slots])
        return 2 * left >= pending.records

    def _gated_done(self, phase: str, t0: Any, what: str) -> None:
        self._hop_ended(phase, t0)
        self._settle(what)

    def _await_pending(self, pending: Any, phase: str) -> None:
        """A gated hop whose reader will not run (the call fails after the push): wait for every counter's target
        instead, so nothing is still landing when the error reaches the caller."""
        if not pending:
            return
        self._wait_for_targets(pending.slots, phase)
        self._gated_done(phase, pending.t0, f"{phase} wait")

    def _wait_for_targets(self, slots: List[int], phase: str) -> None:
        """wait_signals on this rank's stream until each slot reaches its running target (``_expected``)."""
        if slots:
            self._cx.wait_signals([(slot, self._expected[slot]) for slot in slots], self._phases[phase],
                                  self._stream())

    def _push(self, rows: List[List[int]], phase: str, per_chunk: int, fixed: bool = False, at: int = 0) -> None:
        """push_chunks over ``rows``; ``at``: the device address of their copy when the caller has one (a HopPlan,
        which holds it)."""
        if not rows:
            return
        if not at:
            table = self._fixed_table(phase, rows) if fixed else self._push_table(rows)
            self._keep = table
            at = table.data_ptr()
        self._cx.push_chunks(at, len(rows), per_chunk, self._phases[phase], self._stream())

    def _fixed_table(self, phase: str, rows: List[List[int]]) -> torch.Tensor:
        """The device push table of rows that are the same in every call of this phase (barrier, notify), made once."""
        key = (phase, rows[0][3])  # notify rows change width with the number of experts
        table = self._fixed_tables.get(key)
        if table is None:
            table = self._fixed_tables[key] = self._push_table(rows)
        return table

    def _push_hop(self, hop: HopPlan, phase: str, rest: Optional[Callable[[], None]],
                  push: Optional[Callable[[], None]] = None) -> None:
        """Push a hop's writes: with ``push`` (the one launch that writes the records and pushes them, _pack_and_push)
        that; else the whole table (the caller wrote every record it sends), or, with ``rest`` (given only for a hop
        cut in two: the launches that write the records after the head's), the head, then ``rest``, then the tail."""
        self._keep = hop.table  # a plan made without a handle lives until the call has drained
        if push is not None:
            push()
            return
        if rest is None:
            self._push(hop.rows, phase, hop.per_chunk, at=hop.rows_at)
            return
        self._push(hop.head_rows, phase, hop.per_chunk, at=hop.head_at)
        rest()
        self._push(hop.tail_rows, phase, hop.per_chunk, at=hop.tail_at)

    def _push_table(self, rows: List[List[int]]) -> Optional[torch.Tensor]:
        if not rows:
            return None
        self._check_push_columns(rows)
        return self._upload(rows)

    def _check_push_columns(self, rows: List[List[int]]) -> None:
        if len(rows[0]) != self._k.PUSH_COLUMNS:
            raise InternodeError(f"push table has {len(rows[0])} columns, the module expects "
                                 f"{self._k.PUSH_COLUMNS} (rebuild _C)")

    def _packs_and_pushes(self, hop: HopPlan) -> bool:
        """Whether the hop's records are written and pushed in one launch (_pack_and_push): the setting, and a table
        the kernel takes."""
        return self.pack_and_push and 0 < len(hop.rows) <= self._k.PACK_PUSH_MAX_ROWS

    def _pack_and_push(self, hop: HopPlan, phase: str, send: int, stride: int, num_records: int,
                       columns: List[Tuple[int, int, int]], own: Tuple[int, int, int], hop1_token: int = 0,
                       dest_rows: int = 0, G: int = 0, src_idx_offset: int = -1, dest_rows_offset: int = 0,
                       expert_sums: Optional[tuple] = None, node_sums: Optional[tuple] = None) -> None:
        """The pack_and_push kernel (docs/internode.md, "Pack and push"): the records -- record r at ``send`` + r x
        ``stride``, carrying row ``hop1_token[r]`` (0: row r) of every column (address, row bytes, offset in the
        record), or with ``expert_sums`` (_expert_sums) combine row r summed from expert-major rows, or with
        ``node_sums`` (_gather_in_tiles) arrival r's node sum once its copies' tiles are flagged, our own node's
        (``own`` = (first record, records, where they go)) elsewhere -- written, and each of the hop's chunks pushed
        once its records are."""
        chunks = sum(-(-records // hop.per_chunk) for _, _, _, _, records, _, _ in hop.rows if records > 0)
        if self._chunk_ready is None or self._chunk_ready.numel() < chunks:
            self._chunk_ready = torch.zeros(max(chunks, 1024), dtype=torch.int32, device=self.device)
        own_first, own_count, own_dst = own
        self._cx.pack_and_push(hop.rows_at, len(hop.rows), hop.per_chunk, send, own_dst, own_first, own_count, stride,
                               hop1_token, dest_rows, G, num_records, columns, src_idx_offset, dest_rows_offset,
                               self._chunk_ready.data_ptr(), self._phases[phase], self._stream(),
                               expert_sums=expert_sums, node_sums=node_sums)
        self.packs_and_pushes[phase] += 1
        if self.kernel_timeline is not None:
            self.kernel_timeline.note(COMBINE if phase == "combine_network" else DISPATCH)

    def _hop_plan(self, h: Optional[InternodeHandle], key: Tuple[str, int], make: Callable[[], HopPlan],
                  on_device: bool = True) -> HopPlan:
        """The handle's plan for this hop (made once per handle and record size, or ahead: _plan_ahead), or a fresh
        one without a handle; on the device either way, except a fresh one whose push already ran (``on_device``
        False: only its waits and gates are used, and the upload would cost ~15-40 us of host time for nothing)."""
        plan = h.hop_plans.get(key) if h is not None else None
        if plan is None:
            plan = make()
            if on_device or h is not None:  # a handle's plan serves its cached calls' pushes later
                self._upload_hop_plans([plan])
            if h is not None:
                h.hop_plans[key] = plan
        return plan

    def _cut_hop_plan(self, plan: HopPlan, local_base: Optional[int]) -> HopPlan:
        """``plan`` cut into a head and a tail (split_push_head) where ``local_base`` -- where the sent records start in
        our RDMA region -- is given, unless UCCL_EP_PUSH_HEAD=0; host work only."""
        if local_base is not None and self.push_head:
            first, n, head, tail = split_push_head(plan.rows, local_base, plan.per_chunk)
            if n:
                plan.head_first, plan.head_records, plan.head_rows, plan.tail_rows = first, n, head, tail
        return plan

    def _upload_hop_plans(self, plans: List[HopPlan], staged: Optional[list] = None) -> None:
        """The plans' tables (each whole, and its head and tail) to the device in one upload: each upload costs ~10-18
        us of host time. ``staged``: only written and allocated (UploadStaging.stage: no copy queued, for while a
        reader spins), the Staged appended to the list, committed at the next call's entry."""
        rows: List[List[int]] = []
        for p in plans:
            rows += p.rows + p.head_rows + p.tail_rows
        if staged is not None and rows:
            self._check_push_columns(rows)
            st = self._staging.stage(rows, np.int64)
            staged.append(st)
            table = st.out
        else:
            table = self._push_table(rows)
        if table is None:
            return
        row_bytes, at = 8 * self._k.PUSH_COLUMNS, table.data_ptr()
        for p in plans:
            p.table = table
            p.rows_at = at
            p.head_at = at + row_bytes * len(p.rows)
            p.tail_at = p.head_at + row_bytes * len(p.head_rows)
            at = p.tail_at + row_bytes * len(p.tail_rows)

    def _hop_started(self) -> Any:
        """Benchmarks: a CUDA event at the push (None when not timing, and on the CPU stand-in)."""
        if self.network_timing is None or self.device.type != "cuda":
            return None
        t0 = torch.cuda.Event(enable_timing=True)
        t0.record()
        return t0

    def _hop_ended(self, phase: str, t0: Any) -> None:
        """... and one when the arrivals are in (after the wait, or after the gated kernel that read them)."""
        if t0 is None:
            return
        t1 = torch.cuda.Event(enable_timing=True)
        t1.record()
        self.network_timing.setdefault(phase, []).append((t0, t1))

    def _scatter(self, dst: int, dst_stride: int, dst_idx: int, src: int, src_stride: int, src_idx: int, n: int,
                 row_bytes: int, dst_rows: int, phase: str) -> None:
        """scatter_rows on this rank's stream into our own area (the combine's own-node gather; the other GPUs' rows
        go through _forward_rows), with its range check, error word and stop flag (a failed rank forwards nothing)."""
        self._k.scatter_rows(dst, dst_stride, dst_idx, src, src_stride, src_idx, n, row_bytes, self._stream(),
                             dst_rows=dst_rows, err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                             stop_generation=self._cx.stop_generation, rank=self.rank, phase=self._phases[phase],
                             target=self.local)

    def _forward_rows(self, bases: torch.Tensor, bases_or: int, dst_stride: int, index: torch.Tensor, src: int,
                      src_stride: int, n: int, row_bytes: int, limits: torch.Tensor, phase: str) -> None:
        """forward_rows on this rank's stream (rows [0, n) at ``src`` to the local GPUs at ``bases`` that ``index``
        [n, G] names, within ``limits``), with its range check, error word and stop flag as _scatter's."""
        self._k.forward_rows(bases.data_ptr(), bases_or, dst_stride, index.data_ptr(), self.G, src, src_stride, n,
                             row_bytes, limits.data_ptr(), self._stream(), err=self._cx.error_word_ptr,
                             stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation,
                             rank=self.rank, phase=self._phases[phase])

    def _forward_arrivals(self, counts: Counts, shape: Any, layout: RecordLayout, A: int, recv_base: int,
                          first_row: int, gate: Any, ready_epoch: int = 0) -> torch.Tensor:
        """The dispatch forward over NVLink (G > 1): forward_arrivals on this rank's stream, every local GPU that
        needs an arrival getting its final row (one launch, each row read once), gated on ``gate`` (None: the hop is
        in); with ``ready_epoch``, each final row's ready word at its GPU then released to it. Returns the arrivals'
        final rows at each local GPU [A, G] (-1: none), which the kernel writes."""
        G = self.G
        fwd_dest = torch.empty((A, G), dtype=torch.int64, device=self.device)
        if not A:
            return fwd_dest
        if shape.forward_limits is None:
            shape.forward_limits = self._upload([num_recv_rows(counts, self.node * G + j) for j in range(G)])
        self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes, G,
                                 self._cx.rdma_ptr + recv_base, layout.stride, A, layout.final_bytes,
                                 shape.forward_limits.data_ptr(), shape.forward_bases.data_ptr(), self.N,
                                 layout.dest_rows_offset, layout.arrival_offset, fwd_dest.data_ptr(), self._stream(),
                                 gate=gate, first_row=first_row if 0 <= first_row < A else 0,
                                 err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                                 stop_generation=self._cx.stop_generation, rank=self.rank,
                                 phase=self._phases["dispatch_forward"],
                                 ready_words=self._ready_targets.data_ptr() if ready_epoch else 0,
                                 ready_rows=self._ready_rows, ready_epoch=ready_epoch)
        return fwd_dest

    def _lap(self, step: Optional[str]) -> None:
        """Benchmarks: add the host wall time since the previous lap to ``step`` (None: start a call)."""
        if self.host_timing is None:
            return
        now = time.perf_counter()
        if step is not None:
            acc = self.host_timing.setdefault(step, [0.0, 0])
            acc[0] += now - self._lap_t
            acc[1] += 1
        self._lap_t = now

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        from uccl_ep_train.reference import get_dispatch_layout

        return get_dispatch_layout(topk_idx, num_experts, self.R, self.G)

    # ---------------------------------------------------------------- dispatch
    def _move(self, columns: List[torch.Tensor], counts: Counts, plan: SendPlan, gate_ok: bool = False,
              h: Optional[InternodeHandle] = None, packed: Optional[List[torch.Tensor]] = None,
              pushed: bool = False, plan_ahead: Optional[Callable[[], None]] = None, own_from_columns: bool = False,
              unpacked_next: bool = False
              ) -> Tuple[torch.Tensor, RecordLayout, Optional[torch.Tensor], int, Any]:
        """Run the two hops for per-token columns; returns (final rows uint8 [num_recv, final_bytes] view, layout,
        forwarder dest rows [A, G] (None with one GPU per node: nothing is forwarded), A, pending). ``gate_ok``: the
        caller reads every final row with one gated unpack next; then, with one GPU per node (the final rows are the
        arrivals), the hop is not awaited here and ``pending`` (Pending) is for ``_unpack`` and ``_gated_done``;
        otherwise pending is None and the rows are in. ``h``: the handle of a cached dispatch,
        which keeps the hop's plan. ``packed``: the columns (contiguous), whose records for the other nodes are packed
        already (_pack_during_notify); ``pushed``: and pushed too (_push_during_notify). ``plan_ahead``: host work
        and uploads for between the push and the wait when the hop is awaited here (when pending is returned, the
        caller runs it before it launches the gated reader). ``own_from_columns``: the gated reader can take our own
        node's rows from the columns (pending.own): then, where it is gated, they are not packed. ``unpacked_next``:
        the caller's next launch is ``_unpack`` of the final rows (a rank-major receive), which may then run beside the
        forward (several GPUs per node: "The unpack beside the forward"), and the node barrier after it."""
        G = self.G
        # contiguous byte rows, alive until the pack launches below
        rows = packed if packed is not None else [_dense(c, c.dtype) for c in columns]
        layout = _record_layout(tuple(_row_bytes(r) for r in rows), G)
        stride = layout.stride
        shape = h.dispatch_shapes.get(layout) if h is not None else None
        if shape is None:
            try:
                shape = self._dispatch_shape(counts, plan, layout)
            except InternodeError:
                if pushed:
                    self._await_pushed_during_notify(counts, stride)
                raise
            if h is not None:
                h.dispatch_shapes[layout] = shape
        self._last_dispatch_extents = shape.extents
        recv_base = self.half_rdma
        # The own node's records never cross the network: they are packed straight into their receive block, and
        # after the push, so that the push waits only for the records it sends (at 2 nodes, half the packing).
        own_block = shape.own_block
        gated = G == 1 and gate_ok and self.gated_arrivals
        # docs/internode.md, "Own rows from the columns": the gated reader takes our own rows from the columns instead
        own_unpacked = gated and own_from_columns and self.own_rows_from_columns and self._own_readable(rows, layout)

        hop = self._hop_plan(h, ("dispatch", stride), lambda: self._dispatch_hop(counts, plan, stride),
                             on_device=not pushed)
        others, own_range = self._record_ranges(plan)
        pack = lambda ranges: self._pack(rows, plan, layout, own_block, ranges)  # noqa: E731
        # What the push needs written before it starts: nothing when one launch writes the records and pushes them
        # (`fused`), or when they were packed during notify; the head's records when the plan has a head (the rest
        # is packed while the head moves: `rest`); else every other node's.
        rest = fused = None
        if packed is None and shape.sends_remote and self._packs_and_pushes(hop):
            cols = _column_args(rows, layout)
            own_first, own_end = own_range
            fused = lambda: self._pack_and_push(  # noqa: E731
                hop, "dispatch_network", self._cx.rdma_ptr, stride, int(sum(plan.node_send)), cols,
                (own_first, own_end - own_first, 0 if own_unpacked else self._cx.rdma_ptr + own_block),
                plan.hop1_token.data_ptr(),
                plan.dest_rows.data_ptr(), G, layout.src_idx_offset, layout.dest_rows_offset)
        elif not shape.sends_remote:  # every record is our own node's: nothing crosses the network
            if not own_unpacked:
                pack([own_range])
        elif packed is None and hop.head_records:
            pack([(hop.head_first, hop.head_first + hop.head_records)])
            rest = lambda: pack(hop.rest_of(others))  # noqa: E731
        elif packed is None:
            pack(others)
        self._lap("dispatch.pack")
        own_after_push = ((lambda: pack([own_range])) if shape.sends_remote and fused is None and not own_unpacked
                          else None)
        push = (lambda: None) if pushed else fused  # pushed during notify: only the waits and gates are left
        arrivals = shape.arrivals
        A = arrivals.size(0)
        if gated:
            pending = self._push_and_gate(hop, "dispatch_network", then=own_after_push, rest=rest, push=push)
            self._lap("dispatch.push")
            # the reader starts with our own node's records, which are in before any other node's: read in row
            # order they would wait behind the blocks of the nodes before ours until those had landed, and then
            # still be left to read after the wire's last byte
            own_row = (own_block - recv_base) // stride
            if own_unpacked:
                self.own_rows_read_from_columns += 1
                own = (own_row, own_range[1] - own_range[0], own_range[0], plan.hop1_token.data_ptr(),
                       _column_args(rows, layout))
                pending = pending._replace(own=own, own_columns=rows)
            return arrivals[:, :layout.final_bytes], layout, None, A, pending._replace(first_row=own_row)
        # The forward marks its rows ready wherever a read of the node may go beside it: our unpack next, or -- an
        # expert-major receive forwarded after the count read -- a local GPU's receive launched before it, whose
        # words said go by the same rule on the same counts (a node whose forwarders split)
        marks = (G > 1 and self.unpack_beside_forward
                 and max(counts.totals(G).final_rows[self.node * G:(self.node + 1) * G]) <= self._ready_rows)
        beside = marks and unpacked_next
        marked = 0  # the epoch of the rows' ready words when they are marked but unpacked after the barrier
        if G > 1 and self.gated_arrivals:
            # docs/internode.md, "Gated forward": the forwarder reads each arrival as its chunk lands and forwards it
            # over NVLink during the hop, starting with our own node's block, which is in before the hop starts
            # (the forward's grid comes with its gate) held beside an unpack so that both find room: both grids
            # together stay below what an H100/H200 holds at once (unpack_records takes ~40 registers)
            with self._spin_blocks_held(self.unpack_beside_forward_blocks if beside else 0):
                pending = self._push_and_gate(hop, "dispatch_network", then=own_after_push, rest=rest, push=push)
            if plan_ahead is not None:
                plan_ahead()
            self._lap("dispatch.push")
            own_row = (own_block - recv_base) // stride
            if beside:  # the unpack goes on the second stream, after everything before the forward (_unpack)
                self._forward_epoch = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
                self._unpack_beside = self._forward_epoch
                self._cx.stream_wait(self._cx.side_stream, self._stream())
            elif marks:
                marked = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
            fwd_dest = self._forward_arrivals(counts, shape, layout, A, recv_base, own_row, pending.gate,
                                              ready_epoch=self._unpack_beside if beside else marked)
            if beside:
                # the forward writes fwd_dest on our stream after the second stream's wait, so its memory must not go
                # back to the allocator (a cached dispatch drops it) while the unpack's outputs, allocated next and
                # written on the second stream, could be given it: session 45's first GPU run, cached recv_x differed
                self._beside_keep = fwd_dest
            self.forwards_during_hop += 1
            self._gated_done("dispatch_network", pending.t0, "dispatch_network wait")
            self._lap("dispatch.network")
        else:
            self._push_and_wait(hop.rows, hop.waits, "dispatch_network", hop.per_chunk, hop=hop, rest=rest,
                                then=_chain(own_after_push, plan_ahead), push=push)
            self._lap("dispatch.network")
            if G == 1:
                # One GPU per node: the arrivals are the final rows already, in their order (blocks by source node =
                # source rank, tokens in order within each), so they are read in place instead of copied to the NVL
                # area, and a row's arrival is its index (not stamped: unpack writes it); nobody forwards, so no dest
                # rows.
                self._lap("dispatch.forward")
                return arrivals[:, :layout.final_bytes], layout, None, A, None
            fwd_dest = self._forward_arrivals(counts, shape, layout, A, recv_base, 0, None)
        if not beside:
            self._forwarded(marked or None)  # every forwarder's rows are in our NVL area
        self._lap("dispatch.forward")
        nrecv = num_recv_rows(counts, self.rank)
        final = self._nvl[:nrecv * layout.final_bytes].view(nrecv, layout.final_bytes)
        return final, layout, fwd_dest, A, None

    def _close_unpack_beside(self) -> None:
        """The end of a forward whose rows were to be unpacked beside it (after that unpack's launch, or instead of it
        when the dispatch fails first): our stream takes the second stream's work in turn, and the node barrier at the
        forward's epoch orders the area's reuse, so that the node's other GPUs do not wait for our flag."""
        epoch, self._unpack_beside = self._unpack_beside, None
        if epoch is not None:
            self._cx.stream_wait(self._stream(), self._cx.side_stream)
            self._beside_keep = None  # (freed now: everything after it on our stream follows the forward)
            self._forwarded(epoch)

    def _forwarded(self, epoch: Optional[int] = None) -> None:
        """The end of the dispatch forward (several GPUs per node): every forwarder of our node has written its rows
        to our final rows. By default a node barrier over NVLink (docs/internode.md, "The dispatch forward's node
        barrier"): our flag raised in every local GPU's NVL region behind our forward on the stream, then a wait for
        every local GPU's flag in ours; with UCCL_EP_FORWARD_NODE_BARRIER=0 a group barrier through the proxies.
        ``epoch``: the forward's, taken already (its rows' ready words carry it: "The unpack beside the forward")."""
        if not self.forward_node_barrier:
            self._barrier("dispatch forward")
            return
        self._forward_epoch = epoch if epoch is not None else self._next_epoch(self._forward_epoch,
                                                                               "UCCL_EP_FORWARD_NODE_BARRIER")
        self._k.raise_flags(self._forward_flag_targets.data_ptr(), self.G, self._forward_epoch, self._stream(),
                            stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation)
        self._cx.wait_node_flags(self._cx.nvl_ptr + self._forward_flag_base, self.G, 1, self._forward_epoch,
                                   self._phases["dispatch_forward"], self._stream())
        self.forward_node_barriers += 1
        self._settle("dispatch forward")

    @staticmethod
    def _own_readable(rows: List[torch.Tensor], layout: RecordLayout) -> bool:
        """Whether a reader can take our own rows from these columns (contiguous, _dense; the payload first): each at
        an address its loads may use at every row -- the payload's 16-byte words, the others' elements -- as the
        records' fields are; a sliced input may not be, and its own rows are packed as before."""
        need = [16] + [r.element_size() for r in rows[1:]]
        return all(r.data_ptr() % a == 0 and b % a == 0 for r, b, a in zip(rows, layout.column_bytes, need))

    def _dispatch_hop(self, counts: Counts, plan: SendPlan, stride: int) -> HopPlan:
        """The network hop of a dispatch of records of ``stride`` bytes, cut into a head and a tail (the records are
        packed at the start of the send half); no device table yet (_upload_hop_plans)."""
        per = self._per_chunk(stride)
        return self._cut_hop_plan(
            HopPlan(dispatch_push_rows(counts, plan, self.rank, self.G, stride, self.half_rdma, self.L), None,
                    dispatch_waits(counts, self.rank, self.G, per, self.L),
                    dispatch_gate_blocks(counts, self.rank, self.G, self.L), per), 0)

    def _combine_hop(self, counts: Counts, cstride: int, areas: CombineAreas) -> HopPlan:
        """The network hop of a combine of wire rows of ``cstride`` bytes; no device table yet. Cut into a head and a
        tail with one GPU per node only: then each row pushed is written by one copy (with several, by the forwarder's
        node sum after a barrier)."""
        per = self._per_chunk(cstride)
        return self._cut_hop_plan(
            HopPlan(combine_push_rows(counts, self.rank, self.G, cstride, areas, self.L), None,
                    combine_waits(counts, self.rank, self.G, per, self.L),
                    combine_gate_blocks(counts, self.rank, self.G, self.L), per),
            areas.send_base[self.rank] if self.G == 1 else None)

    @staticmethod
    def _guesses(payload_bytes: Tuple[int, ...], hidden: int, num_topk: int) -> Tuple[list, list]:
        """What an uncached dispatch's handle is likely used for next, as (kind, record bytes) guesses: (the next
        call's, the backward pass's). Next, a combine of bf16 rows without weights (the forward's); in the backward,
        a cached dispatch of the same payload columns (x and its scales) and of one bf16 column of the same hidden
        size (the gradient), and a combine of bf16 rows with the top-k weights."""
        later = [("dispatch", cols) for cols in dict.fromkeys((payload_bytes, (2 * hidden,)))]
        later += [("combine", _align(2 * hidden + 4 * num_topk))] if num_topk else []
        return [("combine", _align(2 * hidden))], later

    def _plan_ahead(self, counts: Counts, plan: SendPlan, guesses: list, ahead: PlannedAhead, step: str,
                    have: Any = (), upload: bool = True) -> None:
        """Make the shapes and hop plans of the ``guesses`` (see _guesses; none whose hop key is in ``have``) and
        upload their tables, between a hop's push and the launch of what waits for it: the wire is busy then, while
        each of those calls made them at its first use with the GPU idle behind it (~100-200 us of a forward
        combine's host steps on 2x H200). An uncached dispatch plans its handle's next call; the handle's first
        combine the backward's. Before the reader or wait spins, as the call's other uploads there: nothing may be
        launched after it ("Drains"). A guess whose areas do not fit is skipped: the call that needs it raises.
        ``upload`` False: for while a gated reader spins, when nothing may be queued behind it ("Drains"): the
        tables are staged (written into the pinned area, allocated from torch's cache) and their copies are queued
        at the next call's entry (_commit_staged_plans)."""
        G = self.G
        for kind, size in guesses:
            try:
                if kind == "dispatch":
                    layout = _record_layout(size, G)
                    key = ("dispatch", layout.stride)
                    if key in have:
                        continue
                    ahead.dispatch_shapes[layout] = self._dispatch_shape(counts, plan, layout, upload)
                    if key not in ahead.hop_plans:  # another guess's layout may share the record size
                        ahead.hop_plans[key] = self._dispatch_hop(counts, plan, layout.stride)
                else:
                    key = ("combine", size)
                    if key in have:
                        continue
                    shape = ahead.combine_shapes[size] = self._combine_shape(counts, size)
                    ahead.hop_plans[key] = self._combine_hop(counts, size, shape.areas)
            except InternodeError:
                continue
        # while a reader spins: written and allocated now, the copies queued at the next call's entry
        self._upload_plans_ahead(ahead, stage=not upload and self._staging is not None)
        self._lap(step)

    def _commit_staged_plans(self) -> None:
        """Queue the copies of the plan tables an earlier call staged (handed over by _adopt_plans), before any launch
        of this call: a handle's next call may read them."""
        if self._staged_plans:
            stream = self._stream()
            for st in self._staged_plans:
                self._staging.commit(st, stream)
            self._staged_plans = []

    def _upload_plans_ahead(self, ahead: PlannedAhead, stage: bool = False) -> None:
        """The device tables of plans made ahead that are still on the host -- the hop plans' in one upload, the
        forward row bases of the dispatch shapes (several GPUs per node); ``stage``: only staged (UploadStaging.stage,
        into ``ahead.staged``, whose copies the next call's entry queues: _commit_staged_plans), nothing queued."""
        staged = ahead.staged if stage else None
        self._upload_hop_plans([p for p in ahead.hop_plans.values() if p.rows and p.table is None], staged)
        for shape in ahead.dispatch_shapes.values():
            if shape.forward_bases is not None and shape.forward_bases.device != self.device:
                shape.forward_bases = self._forward_bases_on_device(shape.forward_bases, staged)

    def _forward_bases_on_device(self, bases: torch.Tensor, staged: Optional[list] = None) -> torch.Tensor:
        """forward_block_bases' host table on the device. Every layout of a handle shares it (the same tensor, made
        once per Counts), so the last one uploaded is reused: one upload per forward pair, not one per layout (the
        forward dispatch's and the backward's). ``staged``: stage it (UploadStaging.stage) into the list instead of
        queuing its copy; a staged table is not reused, as its copy is queued later."""
        memo = self._forward_bases_memo
        if memo is not None and memo[0] is bases:
            return memo[1]
        if staged is not None:
            staged.append(self._staging.stage(bases.numpy(), np.int64))
            return staged[-1].out
        on_device = self._upload(bases)
        self._forward_bases_memo = (bases, on_device)
        return on_device

    def _adopt_plans(self, h: InternodeHandle, ahead: PlannedAhead) -> None:
        """The plans made ahead onto the handle, with their device tables. Tables staged while a reader spun are
        copied at the next call's entry (_commit_staged_plans), the first point where a kernel may read them: after
        the drain the GPU is idle behind every host step, while at the next call's entry it still runs the caller's
        work in between (the experts, in training); one driver call each, 20-70 us of a forward dispatch's return
        on 2x H200 in session 26."""
        self._staged_plans += ahead.staged
        ahead.staged = []
        self._upload_plans_ahead(ahead)
        h.dispatch_shapes.update(ahead.dispatch_shapes)
        h.combine_shapes.update(ahead.combine_shapes)
        h.hop_plans.update(ahead.hop_plans)
        self.plans_made_ahead += len(ahead.hop_plans)

    def _dispatch_shape(self, counts: Counts, plan: SendPlan, layout: RecordLayout, upload: bool = True
                        ) -> DispatchShape:
        """The DispatchShape of these counts and layout, after checking that every rank's areas hold the dispatch
        (the same answer on every rank: the counts are the same). ``upload`` False: the forward row bases stay on
        the host (_upload_plans_ahead takes them to the device)."""
        G, stride = self.G, layout.stride
        tot = counts.totals(G)
        check_area("dispatch send (RDMA)", tot.sends, stride, self.half_rdma, "num_rdma_bytes")
        check_area("dispatch receive (RDMA)", tot.arrivals, stride, self.half_rdma, "num_rdma_bytes")
        check_area("dispatch final rows (NVL)", tot.final_rows, layout.final_bytes, self.half_nvl, "num_nvl_bytes")
        recv_by_node = recv_counts(counts, self.rank, G)
        recv_base, A = self.half_rdma, sum(recv_by_node)
        bases = forward_block_bases(counts, self.rank, G) if G > 1 else None
        if bases is not None and upload:
            bases = self._forward_bases_on_device(bases)
        return DispatchShape(recv_base + block_offsets(recv_by_node, stride)[self.node],
                             int(plan.hop1_token.numel()) > plan.node_send[self.node],
                             dispatch_extents(counts, G, stride),
                             self._rdma[recv_base:recv_base + A * stride].view(A, stride), bases)

    def _pack_during_notify(self, row: torch.Tensor, itr: torch.Tensor, rows: List[torch.Tensor],
                            layout: RecordLayout, send_top: int, early: dict, landing: CountRows, tables: SendPlan,
                            fused: Optional[torch.Tensor]) -> None:
        """Pack the records for the other nodes while notify exchanges the counts, where it is safe: the last call
        was a combine of the last dispatch's handle (the caller checks) and our records stay below ``send_top``,
        where that combine's partial sums start in our send half. Why that is enough: every node we sent that
        dispatch's records to sent us partial sums back for them in the combine, and pushed them only after its
        dispatch had received all of them; so nothing of ours below the partial sums is still on the wire (what
        notify would otherwise prove, docs/internode.md "Packing during notify").

        Only our own tokens per node are needed, and the host reads none of them: the count row's launch wrote our
        send plan into ``tables`` (sized for any counts; _count_row), and pack_records takes them from our count row
        ``row`` on the device. The records' dest rows count from our first token, as always (the forwarder adds the
        other sources' rows: forward_block_bases). The kernels pack nothing when our records would pass ``send_top``;
        the host learns which it was after notify (_packed_during_notify). ``rows``: the columns, contiguous
        (_dense), laid out as ``layout``. Fills ``early`` (layout, rows, tables, send_top), and pushes the records too
        (_push_during_notify; ``landing``: where the count rows land), adding ``push_launched``; with ``fused`` (the
        push table, _fused_table_during_notify) in one launch, which also pushes our count row."""
        G, N = self.G, self.N
        own_counts = row.data_ptr() + 8 * self.R  # our tokens per node: the row's node columns
        capacity = itr.size(0) * N  # a token is one record per node at most
        packed = _column_args(rows, layout)
        early.update(layout=layout, rows=rows, tables=tables, send_top=send_top)
        if fused is not None:
            self._pack_and_push_during_notify(fused, tables, layout, packed, capacity, landing, send_top)
            early["push_launched"] = True
            return
        table = self._push_table_during_notify(layout.stride) if self.push_during_notify else None
        self._k.pack_records(self._cx.rdma_ptr, 0, 0, 0, layout.stride, tables.hop1_token.data_ptr(),
                             tables.dest_rows.data_ptr(), G, capacity, packed, layout.src_idx_offset,
                             layout.dest_rows_offset, self._stream(), node_counts=own_counts, num_nodes=N,
                             skip_node=self.node, send_limit=send_top)
        self._lap("dispatch.pack_during_notify")
        if table is not None:
            self._push_during_notify(table, layout.stride, landing, send_top)
            early["push_launched"] = True

    def _push_table_during_notify(self, stride: int) -> Optional[torch.Tensor]:
        """The push table of a dispatch pushed during notify: a row for every other node, made before any count is
        known (dispatch_push_rows_before_counts), so the same for every call of a record size and uploaded once; the
        kernels take each row's records and block from our own count row. None with no other node."""
        key = ("dispatch during notify", stride)
        table = self._fixed_tables.get(key)
        if table is None:
            rows = dispatch_push_rows_before_counts(self.rank, self.G, self.N, stride, self.half_rdma, self.L)
            if not rows:
                return None
            table = self._fixed_tables[key] = self._push_table(rows)
        return table

    def _fused_table_during_notify(self, stride: int) -> Optional[torch.Tensor]:
        """The push table of a dispatch whose records are packed and pushed during notify in one launch
        (_pack_and_push_during_notify, which then pushes our count row too), or None where that takes two launches:
        UCCL_EP_PUSH_DURING_NOTIFY=0 or UCCL_EP_PACK_AND_PUSH=0, no other node, or more rows than the kernel takes.
        Asked before the count row's launch: the notify then pushes no row of its own."""
        if not (self.push_during_notify and self.pack_and_push):
            return None
        table = self._push_table_during_notify(stride)
        return table if table is not None and table.size(0) <= self._k.PACK_PUSH_MAX_ROWS else None

    def _push_during_notify(self, table: torch.Tensor, stride: int, landing: CountRows, send_top: int) -> None:
        """Push the records packed during notify at once, by a kernel that waits on the GPU for every count row
        (``landing``) and places each block from them (push_after_counts; docs/internode.md, "Push during notify"):
        the wire starts when the last row lands instead of after the host read the matrix and planned the hop. The
        destination's row also proves that its earlier calls are done with its receive area, as notify does for the
        push after it. The kernel takes each row of ``table`` (_push_table_during_notify) its records and block from
        our own row (rows_from_own_row) and pushes nothing when the pack did not pack (``send_top``). The writes are
        those of the hop plan made after notify (place_blocks = dispatch_push_rows), whose waits and gates the
        receivers use."""
        self._cx.push_after_counts(table.data_ptr(), table.size(0), self._per_chunk(stride), landing.slot,
                                   landing.target, landing.ptr, landing.row_words, self.G, self.half_rdma,
                                   self._phases["dispatch_network"], self._stream(), send_limit=send_top)
        self._lap("dispatch.push_during_notify")

    def _pack_and_push_during_notify(self, table: torch.Tensor, tables: SendPlan, layout: RecordLayout,
                                     columns: List[Tuple[int, int, int]], capacity: int, landing: CountRows,
                                     send_top: int) -> None:
        """The pack and the push during notify in one launch (pack_and_push_after_counts; docs/internode.md, "Push
        during notify"): the records counted from our own row are written, and each chunk leaves once its records
        are written and every count row is in, placed as push_after_counts places it. One launch fewer before the
        wire, which starts after the first chunks' records instead of after all of them. When the rows carry our
        row's pushes (``landing.own_pushes``) the launch makes them first: one launch fewer again."""
        stride, per = layout.stride, self._per_chunk(layout.stride)
        chunks = send_top // stride // per + table.size(0) + 1  # at most, whatever our counts are
        if self._chunk_ready is None or self._chunk_ready.numel() < chunks:
            self._chunk_ready = torch.zeros(max(chunks, 1024), dtype=torch.int32, device=self.device)
        own = landing.own_pushes or (0, 0)
        self._cx.pack_and_push_after_counts(
            table.data_ptr(), table.size(0), per, self._cx.rdma_ptr, stride, tables.hop1_token.data_ptr(),
            tables.dest_rows.data_ptr(), self.G, capacity, columns, layout.src_idx_offset, layout.dest_rows_offset,
            landing.slot, landing.target, landing.ptr, landing.row_words, self.half_rdma, send_top,
            self._chunk_ready.data_ptr(), self._phases["dispatch_network"], self._stream(),
            own_row_pushes=own[0], own_row_push_rows=own[1], own_row_push_phase=self._phases["notify"])
        self.packs_and_pushes_during_notify += 1
        self.count_rows_pushed_with_records += own[1] > 0
        if self.kernel_timeline is not None:
            self.kernel_timeline.note(DISPATCH_DURING_NOTIFY)
        self._lap("dispatch.pack_and_push_during_notify")

    def _packed_during_notify(self, early: dict, counts: Counts) -> Tuple[Optional[SendPlan], bool]:
        """After notify, what the kernels launched during it did, from the counts by their own rule: (the send plan
        when they packed, else None -- nothing was packed; whether they pushed)."""
        node_send = [int(c) for c in counts.node_counts[self.rank].tolist()]
        if not early or sum(node_send) * early["layout"].stride > early["send_top"]:
            return None, False
        self.packs_during_notify += 1
        t, S1 = early["tables"], sum(node_send)
        plan = SendPlan(t.hop1_token[:S1], node_send, t.dest_rows[:S1], t.dest_row_all, t.row_of)
        pushed = early.get("push_launched", False) and any(c for m, c in enumerate(node_send) if m != self.node)
        self.pushes_during_notify += pushed
        return plan, pushed

    def _await_pushed_during_notify(self, counts: Counts, stride: int) -> None:
        """A dispatch whose records were pushed during notify fails a check of the counts: before the error goes up,
        wait for the records the others pushed to us, so that none lands after it and the counters stay in step with
        their targets. push_after_counts sent them iff our arrivals fit our receive half (place_blocks)."""
        if sum(recv_counts(counts, self.rank, self.G)) * stride <= self.half_rdma:
            waits = dispatch_waits(counts, self.rank, self.G, self._per_chunk(stride), self.L)
            for slot, count in waits:
                self._expected[slot] += count
            self._wait_for_targets([slot for slot, _ in waits], "dispatch_network")
        self._drain("dispatch_network wait for the records pushed during notify")

    def _record_ranges(self, plan: SendPlan) -> Tuple[List[Tuple[int, int]], Tuple[int, int]]:
        """(the other nodes' records, our own node's) as ranges of the record list, which runs by node."""
        own_first, own = sum(plan.node_send[:self.node]), plan.node_send[self.node]
        return _ranges_around(own_first, own, sum(plan.node_send)), (own_first, own_first + own)

    def _pack(self, rows: List[torch.Tensor], plan: SendPlan, layout: RecordLayout, own_offset: int,
              ranges: List[Tuple[int, int]]) -> None:
        """internode_plan.pack_records (pack_records kernel) into the send area, except the records of our own node,
        which go to ``own_offset`` of the RDMA region (their receive block). ``rows``: the columns, contiguous
        (_dense). ``ranges``: which records of the list (by node, see _record_ranges), a launch each."""
        own_first, own = sum(plan.node_send[:self.node]), plan.node_send[self.node]
        cols = _column_args(rows, layout)
        G, stride = self.G, layout.stride
        for lo, hi in ranges:
            if hi <= lo:
                continue
            # records [lo, hi) as a launch of their own: every table and the send area shifted to record lo
            self._k.pack_records(self._cx.rdma_ptr + lo * stride, self._cx.rdma_ptr + own_offset, own_first - lo,
                                 own, stride, plan.hop1_token.data_ptr() + 8 * lo,
                                 plan.dest_rows.data_ptr() + 8 * lo * G, G, hi - lo, cols, layout.src_idx_offset,
                                 layout.dest_rows_offset, self._stream())

    def _unpack(self, final: torch.Tensor, layout: RecordLayout, outs: List[torch.Tensor], out_rows: int = -1,
                ids: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None, ids_column: int = 0,
                expert_lo: int = 0, experts_per_rank: int = 0, src_idx: Optional[torch.Tensor] = None,
                arrival: Optional[torch.Tensor] = None, pending: Any = None,
                while_reading: Optional[Callable[[], None]] = None) -> None:
        """The final rows' columns into ``outs`` (column i into outs[i], padded with zero rows to ``out_rows``) in
        one launch (unpack_records kernel); with ``ids`` / ``weights``, column ``ids_column`` (global expert ids) and
        the next (weights) become local ids (-1 elsewhere and in padding rows) and the weights of local ids (0
        elsewhere); the src_idx and arrival fields into ``src_idx`` / ``arrival``. ``pending`` (from ``_move``): the
        rows are still landing; the unpack is gated on them and the hop is closed after it. ``while_reading``: host
        work that queues nothing on the stream, run right after the launch (while a gated reader spins: "Drains"), so
        that the reader reads the rows already in while the host makes the handle and, where the data is mostly in,
        the next calls' plans (that work had held the reader back)."""
        n = final.size(0)
        if self._unpack_beside is not None:  # docs/internode.md, "The unpack beside the forward": each row once marked
            ready = (self._cx.nvl_ptr + self._ready_base, self._unpack_beside)
            try:
                self._unpack_launch(final.data_ptr(), final.stride(0), n, n if out_rows < 0 else out_rows, layout,
                                    outs, ids, weights, ids_column, expert_lo, experts_per_rank, src_idx, arrival,
                                    stream=self._cx.side_stream, ready=ready)
            finally:
                self._close_unpack_beside()
            self.unpacks_beside_forward += 1
            self._while_reader(None, while_reading)
            return
        self._unpack_launch(final.data_ptr(), final.stride(0), n, n if out_rows < 0 else out_rows, layout, outs, ids,
                            weights, ids_column, expert_lo, experts_per_rank, src_idx, arrival,
                            gate=pending.gate if pending else None, first_row=pending.first_row if pending else 0,
                            own=pending.own if pending else None)
        self._while_reader(pending, while_reading)

    def _while_reader(self, pending: Any, while_reading: Optional[Callable[[], None]]) -> None:
        """After a dispatch reader's launch: ``while_reading`` (host work that queues nothing), then, with ``pending``
        (a gated reader), the hop closed: the reader is drained whatever the host work raised, so nothing is left
        spinning behind an error."""
        try:
            if while_reading is not None:
                self._lap("dispatch.unpack")
                while_reading()
        finally:
            if pending:
                self._gated_done("dispatch_network", pending.t0, "dispatch_network wait")
                self._lap("dispatch.network")

    def _unpack_launch(self, src: int, src_stride: int, n: int, out_rows: int, layout: RecordLayout,
                       outs: List[torch.Tensor], ids: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                       ids_column: int, expert_lo: int, experts_per_rank: int, src_idx: Optional[torch.Tensor],
                       arrival: Optional[torch.Tensor], gate: Any = None, first_row: int = 0,
                       stream: Optional[int] = None, ready: Optional[Tuple[int, int]] = None, **before: Any) -> None:
        """The unpack_records launch of _unpack (rows [0, n) at ``src``, ``src_stride`` bytes apart); ``before``: the
        arguments of a read before the counts (dims, pad) and of our own rows read from the columns (own);
        ``ready`` (our ready words, the forward's epoch): each row read once its word holds the epoch, on ``stream``
        (default: ours), the grid held to UCCL_EP_UNPACK_BESIDE_FORWARD_BLOCKS."""
        K = ids.size(1) if ids is not None else 0
        self._k.unpack_records(
            src, src_stride, n, out_rows,
            [(o.data_ptr(), layout.column_bytes[i], layout.column_offsets[i]) for i, o in enumerate(outs)],
            _address(ids), _address(weights), layout.column_offsets[ids_column] if K else 0,
            layout.column_offsets[ids_column + 1] if K else 0, K, expert_lo, experts_per_rank,
            layout.src_idx_offset, _address(src_idx), layout.arrival_offset if self.G > 1 else -1, _address(arrival),
            self._stream() if stream is None else stream, gate=gate, first_row=first_row, **before,
            **self._ready_args(ready))

    def _ready_args(self, ready: Optional[Tuple[int, int]]) -> dict:
        """A reader's arguments for ``ready`` (our ready words, the forward's epoch; "The unpack beside the forward"):
        its deadline, where it reports, and its grid held to UCCL_EP_UNPACK_BESIDE_FORWARD_BLOCKS; none for None."""
        if ready is None:
            return {}
        # where ranks share a GPU every spinning grid is held to their share (spin_blocks), and a reader that waits
        # for words is one: four such readers of 256 blocks left a 2 x 2 run on one H200 no room for the forwards
        # that release them (session 46)
        blocks = self.unpack_beside_forward_blocks
        if self._cx.spin_blocks:
            blocks = min(blocks, self._cx.spin_blocks)
        return dict(ready_words=ready[0], ready_epoch=ready[1], ready_timeout_secs=self.gpu_timeout,
                    ready_blocks=blocks, err=self._cx.error_word_ptr,
                    stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, rank=self.rank,
                    phase=self._phases["dispatch_forward"])

    # ------------------------------------------------------- reading before the count read
    def _reading_before_counts(self, args: DispatchArgs, T: int, layout: RecordLayout, pushed_in_one_launch: bool,
                               dense: List[torch.Tensor], tables: SendPlan, em_in_reader: bool = False
                               ) -> Optional[ReadingBeforeCounts]:
        """Whether this uncached dispatch launches its reader before the host reads the count matrix (docs/internode.md,
        "Reading before the count read"; with several GPUs per node the forwarder's receive, "The forward before the
        count read"), and for how many rows: a gated reader, the records packed and pushed during notify by one
        launch (``pushed_in_one_launch``), and a row count known
        before the counts -- num_worst_tokens, or the rows the last dispatch of T tokens received plus
        UCCL_EP_READ_BEFORE_COUNTS_SLACK (capped by the receive area). None: the reader follows the host's plan.
        An expert-major receive only where its reader writes the expert-major rows (``em_in_reader``): the copy after
        the hop reads the final rows, where our own rows are not (docs/internode.md, "Reading before the count
        read"); its expert-major rows are guessed as the received rows are.
        ``dense``: the columns, contiguous, from which our own node's rows are read (never packed); ``tables``: the
        send plan the count row's launch writes."""
        spare, self._spare_read_outputs = self._spare_read_outputs, None  # taken here or dropped
        if not (self.read_before_counts and pushed_in_one_launch and self.gated_arrivals
                and (em_in_reader or not args.expert_major)):
            return None
        payload = [args.x] + ([args.x_scales] if args.x_scales is not None else [])
        K = args.topk_idx.size(1) if args.topk_idx is not None else 0
        # the rows the area the outputs are read from holds: the arrivals (one GPU per node), else the final rows
        area_rows = self.half_rdma // layout.stride if self.G == 1 else self.half_nvl // layout.final_bytes
        if args.expert_major:  # (no spare outputs: an expert-major receive's are its expert-major rows)
            self._next_read = None
            spec = self._read_spec(T, args.num_worst_tokens, area_rows,
                                   tuple((c.dtype, tuple(c.shape[1:])) for c in payload), K)
            seen = self._expert_rows_seen.get(T)
            expert_rows = args.num_worst_tokens or (math.ceil(seen * (1 + self.read_slack)) if seen else 0)
            if spec is None or not spec[0] or not expert_rows:  # (nothing received last time: no guess)
                return None
            return self._before_notify(ReadingBeforeCounts(
                spec, bool(args.num_worst_tokens), layout, args.num_tokens_per_expert.numel() // self.R,
                _column_args(dense, layout), tables.hop1_token.data_ptr(), expert_rows=expert_rows,
                alignment=args.expert_alignment, own_dest_rows=tables.dest_rows.data_ptr(), tokens=T))
        # what the combine of this dispatch's handle makes the next dispatch's outputs for (_spare_read_outputs)
        self._next_read = (T, args.num_worst_tokens, area_rows,
                           tuple((c.dtype, tuple(c.shape[1:])) for c in payload), K)
        spec = self._read_spec(*self._next_read)
        if spec is None:
            return None
        reading = self._before_notify(ReadingBeforeCounts(
            spec, bool(args.num_worst_tokens), layout, args.num_tokens_per_expert.numel() // self.R,
            _column_args(dense, layout), tables.hop1_token.data_ptr(), own_dest_rows=tables.dest_rows.data_ptr(),
            tokens=T))
        if spare is not None and spare[0] == spec:  # made during the last combine's hop
            self.spare_read_outputs_taken += 1
            reading.outs, reading.topk_idx, reading.weights, reading.src_idx, reading.arrival = spare[1]
        return reading

    def _before_notify(self, reading: ReadingBeforeCounts) -> ReadingBeforeCounts:
        """What the kernels launched behind notify's wait take that must exist before it is queued: the counters'
        bases (this call's: the counters move only after the count read), and with several GPUs per node the
        forward's output for as many arrivals as the receive half holds (once notify's wait is queued, an allocation
        that reaches cudaMalloc may wait on it)."""
        reading.bases, reading.bases_table = self._counter_bases(self._expected[:self.N * self.L])
        if self.G > 1:
            reading.fwd_dest = torch.empty((self.half_rdma // reading.layout.stride, self.G), dtype=torch.int64,
                                           device=self.device)
        return reading

    def _counter_bases(self, values: List[int]) -> Tuple[List[int], Optional[torch.Tensor]]:
        """Counter bases for gate_from_count_rows / forward_from_count_rows: as kernel arguments while they fit
        (READ_MAX_COUNTERS, nodes x lanes: 4 nodes at the default 32 lanes), else in a device table uploaded now.
        Called before notify's wait is queued, so the drain after the matrix's copy covers the upload (staged uploads
        may be reused only after a drain that follows them: upload_staging.py)."""
        if len(values) <= self._k.READ_MAX_COUNTERS:
            return list(values), None
        return [], self._upload(np.asarray(values, dtype=np.int64))

    def _read_spec(self, T: int, worst: int, area_rows: int, payload: tuple, K: int) -> Optional[tuple]:
        """(rows, payload dtypes and row shapes, top-k) of the outputs of a read before the counts: num_worst_tokens
        rows, else the rows the last dispatch of T tokens received plus the slack, capped by the ``area_rows`` the
        area they are read from holds; None before any dispatch of T tokens."""
        if worst:
            return worst, payload, K
        seen = self._recv_rows_seen.get(T)
        if seen is None:
            return None
        return min(math.ceil(seen * (1 + self.read_slack)), area_rows), payload, K

    def _new_read_outputs(self, spec: tuple) -> tuple:
        """(payload outputs, top-k ids, weights, src_idx, arrival) of ``spec`` (_read_spec), uninitialised."""
        rows, payload, K = spec
        dev = self.device
        outs = [torch.empty((rows,) + shape, dtype=dtype, device=dev) for dtype, shape in payload]
        ids = torch.empty((rows, K), dtype=torch.int64, device=dev) if K else None
        w = torch.empty((rows, K), dtype=torch.float32, device=dev) if K else None
        return (outs, ids, w, torch.empty(rows, dtype=torch.int64, device=dev),
                torch.empty(rows, dtype=torch.int64, device=dev))

    def _spare_for_reading_before_counts(self) -> None:
        """Make the outputs of the next dispatch read before the counts now, while the host waits for a combine's
        hop, shaped as the last such dispatch's (_next_read): the call's largest allocations, which may reach
        cudaMalloc, kept out of the steps between notify's wait and that reader's launch. Taken by the next uncached
        dispatch if it matches, dropped by it otherwise (and by a cached dispatch)."""
        spec = self._read_spec(*self._next_read) if self._next_read is not None else None
        if spec is not None and (self._spare_read_outputs is None or self._spare_read_outputs[0] != spec):
            self._spare_read_outputs = (spec, self._new_read_outputs(spec))

    def _launch_reader_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, send_top: int) -> None:
        """Behind notify's wait (every count row is in) and the matrix's copy: the outputs, then the gate table and
        the words from the count rows on the device (gate_from_count_rows), then the gated reader taking them
        (unpack_records with dims), which reads our own node's rows straight from our columns at their tokens (the
        send plan's, written with the count row): they are never packed. Queues no upload (the drain before the count
        read does not wait for these launches)."""
        rows = reading.rows
        self._lap("dispatch.notify_wait_before_counts")
        if reading.expert_rows:
            self._launch_expert_major_reader_before_counts(reading, rows_at, send_top)
            return
        if reading.src_idx is None:  # no spare made during the last combine's hop
            reading.outs, reading.topk_idx, reading.weights, reading.src_idx, reading.arrival = \
                self._new_read_outputs(reading.spec)
        self._lap("dispatch.outputs_before_counts")
        reading.t0 = self._hop_started()
        if self.G > 1:
            self._launch_forward_before_counts(reading, rows_at, send_top)
            return
        stride = reading.layout.stride
        self._k.gate_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, self.rank, self.L, reading.bases, stride,
                                     send_top, self.half_rdma, rows, self._read_gate.data_ptr(),
                                     self._read_dims.data_ptr(), self._stream(),
                                     counter_bases_table=_address(reading.bases_table))
        gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                     self._phases["dispatch_network"])
        experts = reading.experts_per_rank
        self._unpack_launch(self._cx.rdma_ptr + self.half_rdma, stride, rows, rows, reading.layout, reading.outs,
                            reading.topk_idx, reading.weights, len(reading.outs), self.rank * experts, experts,
                            reading.src_idx, reading.arrival, gate, dims=self._read_dims.data_ptr(), pad=reading.pad,
                            own=(0, 0, 0, reading.own_tokens, reading.own_columns))
        self._lap("dispatch.reader_before_counts")

    def _launch_forward_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, send_top: int) -> None:
        """_launch_reader_before_counts with several GPUs per node (docs/internode.md, "The forward before the count
        read"), behind notify's wait and the matrix's copy: from the count rows on the device (forward_from_count_rows)
        the gate, the forward's tables and the words; our own node's records packed into their block among our
        arrivals (pack_records from the words); the gated forward (forward_arrivals from the words) and the node
        barrier, its flag raised and its wait made only when the forward went (else the host's forward after the
        count read raises it); then the read of our final rows from the unpack's words (unpack_records, or for an
        expert-major receive expert_major_places, the padding and expert_major_receive). With
        UCCL_EP_UNPACK_BESIDE_FORWARD that read runs on the second stream beside the forward, each row read once its
        ready word is released ("The unpack beside the forward"), and the barrier follows it. Queues no upload."""
        layout, G = reading.layout, self.G
        stride, dims = layout.stride, self._fwd_dims.data_ptr()
        recv = self._cx.rdma_ptr + self.half_rdma
        beside = self.unpack_beside_forward and self._ready_rows > 0
        self._k.forward_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, G, self.rank, self.L, reading.bases,
                                        stride, layout.final_bytes, send_top, self.half_rdma, self.half_nvl,
                                        reading.rows, self._ready_rows if beside else 0, self._read_gate.data_ptr(),
                                        self._fwd_blocks.data_ptr(), self._fwd_limits.data_ptr(), dims,
                                        self._stream(), counter_bases_table=_address(reading.bases_table))
        self._k.pack_records(0, recv, 0, 0, stride, reading.own_tokens, reading.own_dest_rows, G, reading.tokens,
                             reading.own_columns, layout.src_idx_offset, layout.dest_rows_offset, self._stream(),
                             own_dims=dims)
        # the epoch the host's forward would take (the ready words and the barrier carry it); kept only when the
        # forward went (_adopt_before_counts)
        reading.epoch = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
        if beside:  # the read goes on the second stream, after the words and everything else before the forward
            self._cx.stream_wait(self._cx.side_stream, self._stream())
        with self._spin_blocks_held(self.unpack_beside_forward_blocks if beside else 0):
            gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                         self._phases["dispatch_network"])
        self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes, G,
                                 recv, stride, reading.fwd_dest.size(0), layout.final_bytes,
                                 self._fwd_limits.data_ptr(), self._fwd_blocks.data_ptr(), self.N,
                                 layout.dest_rows_offset, layout.arrival_offset, reading.fwd_dest.data_ptr(),
                                 self._stream(), gate=gate, err=self._cx.error_word_ptr,
                                 stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation,
                                 rank=self.rank, phase=self._phases["dispatch_forward"], dims=dims,
                                 ready_words=self._ready_targets.data_ptr() if beside else 0,
                                 ready_rows=self._ready_rows, ready_epoch=reading.epoch if beside else 0)
        experts = reading.experts_per_rank
        unpack = lambda **where: self._unpack_launch(  # noqa: E731
            self._cx.nvl_ptr, layout.final_bytes, reading.rows, reading.rows, layout, reading.outs, reading.topk_idx,
            reading.weights, len(reading.outs), self.rank * experts, experts, reading.src_idx, reading.arrival,
            dims=dims + 8 * READ_DIMS, pad=reading.pad, **where)
        # an expert-major receive of our final rows, from the unpack's words
        final = lambda: _raw_bytes(  # noqa: E731
            self._cx.nvl_ptr, reading.rows * layout.final_bytes, self.device).view(reading.rows, layout.final_bytes)
        receive = lambda **where: self._expert_major_receive_before_counts(  # noqa: E731
            reading, rows_at, dims + 8 * READ_DIMS, final(), None, None, **where)
        read = receive if reading.expert_rows else unpack
        if beside:
            read(stream=self._cx.side_stream, ready=(self._cx.nvl_ptr + self._ready_base, reading.epoch))
            self._cx.stream_wait(self._stream(), self._cx.side_stream)
            self.unpacks_beside_forward += 1
            self.expert_major_receives_beside_forward += bool(reading.expert_rows)
        self._k.raise_flags(self._forward_flag_targets.data_ptr(), G, reading.epoch, self._stream(),
                            stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, go=dims)
        self._cx.wait_node_flags(self._cx.nvl_ptr + self._forward_flag_base, G, 1, reading.epoch,
                                 self._phases["dispatch_forward"], self._stream(), go=dims)
        if not beside:
            read()
        self._lap("dispatch.reader_before_counts")

    def _before_counts_words(self, reading: ReadingBeforeCounts, counts: Counts, send_top: int) -> List[int]:
        """After notify: the words the kernels launched before the count read took from the count rows, by their own
        rule on the same counts (read_before_counts, or forward_before_counts with several GPUs per node)."""
        layout = reading.layout
        if self.G == 1:
            return read_before_counts(counts.rank_counts, counts.node_counts, self.rank, self.L, self._expected,
                                      layout.stride, send_top, self.half_rdma, reading.rows)[1]
        ready_rows = self._ready_rows if self.unpack_beside_forward else 0
        return forward_before_counts(counts.rank_counts, counts.node_counts, self.rank, self.G, self.L,
                                     self._expected, layout.stride, layout.final_bytes, send_top, self.half_rdma,
                                     self.half_nvl, reading.rows, ready_rows)[3]

    def _adopt_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan) -> None:
        """After notify, kernels launched before the count read whose hop went: what the host's path would have left
        -- the counters' targets (first: they move whatever follows), with several GPUs per node the forward's node
        barrier epoch, and the extents (their check may raise: the caller ends the hop whatever happens)."""
        for slot, count in dispatch_waits(counts, self.rank, self.G, self._per_chunk(reading.layout.stride), self.L):
            self._expected[slot] += count
        if self.G > 1:
            self._forward_epoch = reading.epoch
            self.forwards_before_counts += 1
            self.forwards_during_hop += 1
            self.forward_node_barriers += 1
        self._last_dispatch_extents = self._dispatch_shape(counts, plan, reading.layout, upload=False).extents

    def _forward_dest_before_counts(self, reading: ReadingBeforeCounts, counts: Counts) -> Optional[torch.Tensor]:
        """The forward's final rows of our arrivals at each local GPU [A, G], which a forward before the count read
        wrote (None with one GPU per node: nothing is forwarded)."""
        if self.G == 1:
            return None
        return reading.fwd_dest[:sum(recv_counts(counts, self.rank, self.G))]

    def _forwarded_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan
                                 ) -> Tuple[torch.Tensor, RecordLayout, torch.Tensor, None]:
        """After notify, a forward before the count read that went while its unpack did not (our final rows passed
        the outputs allocated before the counts): _move's results without moving anything -- (our final rows, the
        layout, the forward's dest rows, no pending hop) -- for the unpack after the count read."""
        try:
            self._adopt_before_counts(reading, counts, plan)
        finally:
            self._gated_done("dispatch_network", reading.t0, "dispatch_network wait")
            self._lap("dispatch.network")
        layout, nrecv = reading.layout, num_recv_rows(counts, self.rank)
        final = self._nvl[:nrecv * layout.final_bytes].view(nrecv, layout.final_bytes)
        return final, layout, self._forward_dest_before_counts(reading, counts), None

    def _launch_expert_major_reader_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows,
                                                  send_top: int) -> None:
        """_launch_reader_before_counts for an expert-major receive written by its reader: the outputs (expert-major
        rows for ``reading.expert_rows``), the gate and words from the count rows (gate_from_count_rows), then from
        the same rows the reader's places and the plan's sizes (expert_major_places, which says no when the
        expert-major rows pass the outputs), the padding, and the gated reader taking its rows, first row and our
        own rows' place from the words (expert_major_receive with dims). With several GPUs per node the forward
        before the count read goes first, and the receive reads the final rows after its barrier. Queues no upload."""
        rows, stride, L = reading.rows, reading.layout.stride, reading.experts_per_rank
        (_, payload, K) = reading.spec
        like = [torch.empty((0,) + shape, dtype=dtype, device=self.device) for dtype, shape in payload]
        reading.em = self._expert_major_outputs(rows, K, L, reading.expert_rows, like, on_device=True)
        reading.src_idx = torch.empty(rows, dtype=torch.int64, device=self.device)
        reading.arrival = torch.empty(rows, dtype=torch.int64, device=self.device)
        self._lap("dispatch.outputs_before_counts")
        reading.t0 = self._hop_started()
        if self.G > 1:
            self._launch_forward_before_counts(reading, rows_at, send_top)
            return
        dims = self._read_dims.data_ptr()
        self._k.gate_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, self.rank, self.L, reading.bases, stride,
                                     send_top, self.half_rdma, rows, self._read_gate.data_ptr(), dims, self._stream(),
                                     counter_bases_table=_address(reading.bases_table))
        gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                     self._phases["dispatch_network"])
        final = _raw_bytes(self._cx.rdma_ptr + self.half_rdma, rows * stride, self.device).view(rows, stride)
        self._expert_major_receive_before_counts(reading, rows_at, dims, final, gate,
                                                 own=(0, 0, 0, reading.own_tokens, reading.own_columns))
        self._lap("dispatch.reader_before_counts")

    def _expert_major_receive_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, dims: int,
                                            final: torch.Tensor, gate: Any, own: Optional[tuple],
                                            stream: Optional[int] = None,
                                            ready: Optional[Tuple[int, int]] = None) -> None:
        """From the count rows the reader's places and the plan's sizes (expert_major_places, which clears the go word
        at ``dims`` when the expert-major rows pass the outputs), the padding, then the receive of ``final`` taking
        its rows from the words (expert_major_receive with dims); ``stream`` and ``ready`` as _unpack_launch's."""
        em, L, K = reading.em, reading.experts_per_rank, reading.spec[2]
        on = self._stream() if stream is None else stream
        self._k.expert_major_places(rows_at.ptr, rows_at.row_words, self.R, self.N, self.rank, L, reading.alignment,
                                    em.places.data_ptr(), em.info.data_ptr(), on, dims=dims, capacity_rows=em.rows)
        self._expert_major_pad(em.info, reading.alignment, em.rows, em.out, em, go=dims, stream=on)
        self._expert_major_receive(final, reading.layout, em.out, em.rows, K, em.slot_of, em, L, reading.src_idx,
                                   reading.arrival, gate=gate, dims=dims, own=own, counted=False, stream=on,
                                   ready=ready)

    def _reader_read(self, reading: ReadingBeforeCounts, words: List[int], expert_rows: Optional[int] = None) -> bool:
        """After notify: whether the reader launched before the count read reads, by its own rule on the same counts
        (``words``: _before_counts_words; for an expert-major receive its rows, ``expert_rows``, within the
        outputs'); else it did nothing."""
        read = words[READ_GO] if self.G == 1 else words[READ_DIMS + READ_GO]  # (several GPUs per node: the unpack's)
        return bool(read) and (not reading.expert_rows or expert_rows <= reading.expert_rows)

    def _while_reader_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan,
                                    host_work: Callable[[], None]) -> None:
        """The host's part of a dispatch read before the count read, while its reader spins: the counters' targets
        (first: they move whatever follows), the area checks, ``host_work``; then the drain, also when those raise.
        With several GPUs per node, what the forward before it leaves too (_adopt_before_counts)."""
        try:
            self._adopt_before_counts(reading, counts, plan)
            self.reads_before_counts += 1
            self._lap("dispatch.unpack")
            host_work()
        finally:
            self._gated_done("dispatch_network", reading.t0, "dispatch_network wait")
            self._lap("dispatch.network")

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        self._lap(None)
        x, scales = args.x, args.x_scales
        if args.handle is None and args.num_tokens_per_expert is None:  # before any traffic: peers would hang
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) when no handle is given")
        # No drain here: the previous call's waits are over (the host drained after each, _push_and_wait), and what
        # it queued after its last wait (unpack, the partial sums) may still run while this call's first launches
        # queue behind it; a drain cost ~100 us per call on 2x H200 (session 8).
        self._check("entry of dispatch")
        self._refuse_a_stall_without_drains()
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        combined_send_base, self._combined_send_base = self._combined_send_base, None
        if args.handle is not None:  # every rank finished its previous use of the areas ...
            self._spare_read_outputs = None  # (held no longer: only an uncached dispatch takes it)
            if self._cached_dispatch_needs_barrier(args.handle, [x] + ([scales] if scales is not None else [])):
                self._barrier("entry of dispatch")
            else:  # ... as the last combine's traffic proves
                self.dispatch_barriers_skipped += 1
        # ... which, without a handle, notify proves: a rank's row leaves behind everything earlier on its stream
        self._synced_since_combine = True
        self._last_combine = None
        self._lap("dispatch.entry")
        if args.handle is not None:
            return self._cached_dispatch(args)
        return self._uncached_dispatch(args, combined_send_base)

    def _cached_dispatch(self, args: DispatchArgs) -> DispatchResult:
        """A dispatch with the handle of an earlier one: its plan, hop and receive layout are the handle's."""
        from uccl_ep_train.reference import _payload_bytes

        x, scales = args.x, args.x_scales
        h: InternodeHandle = args.handle
        cols = [x] + ([scales] if scales is not None else [])
        em_out: List[torch.Tensor] = []  # expert-major: allocated between the push and the wait, not after it
        alloc = (lambda: em_out.extend(_empty_rows(c, h.num_recv_rows) for c in cols)) if h.expert_major else None
        in_reader = h.expert_major and self.expert_major_in_reader["cached"]  # the reader writes the handle's slots
        reads_all = in_reader or not h.expert_major  # (the copy after the hop reads the final rows instead)
        final, layout, _, _, pending = self._move(cols, h.counts, h.plan, gate_ok=reads_all, h=h,
                                                  plan_ahead=alloc, own_from_columns=reads_all,
                                                  unpacked_next=not h.expert_major)
        self.last_traffic = self._traffic_forward(h, _payload_bytes(x, scales))  # before a gated unpack spins
        if in_reader:
            if not em_out:  # (gated: _move left the allocation to us, before the reader's launch)
                alloc()
            self._expert_major_pad(h.expert_major_info, h.expert_alignment, h.num_recv_rows, em_out)
            self._expert_major_read(final, layout, em_out, h.num_recv_rows, h.num_topk, h.slot_of,
                                    pending=pending)
            parts = em_out
        elif h.expert_major:
            parts = self._expert_major_copy(h, _record_columns(final, layout, len(cols)), cols, em_out or None)
        else:
            parts = [_empty_rows(c, h.num_recv_rows) for c in cols]
            self._unpack(final, layout, parts, h.num_recv_rows, pending=pending)
        self._last_dispatch_handle = h
        self._lap("dispatch.finish")
        return DispatchResult(parts[0], parts[1] if scales is not None else None, None, None, None, h,
                              self.last_traffic)

    def _uncached_expert_major_reader(self, args: DispatchArgs, T: int, combined_send_base: Optional[int]
                                      ) -> Tuple[bool, bool]:
        """(whether the records carry each pair's rank among ours of its expert, whether this rank's reader writes
        the expert-major rows from them) for an uncached dispatch (docs/internode.md, "Expert-major rows in the
        reader"; the receiver's per-source counts come with notify, up to NOTIFY_MAX_EXPERTS experts).
        The column is in every sender's layout, so it is shipped by a rule every rank applies alike: wherever some
        receiver's reader may write the rows. Whether ours does is our own choice; with `auto` where ranks share a
        GPU, only if it may launch before the count read (_reading_before_counts decides: a size seen before, right
        after a combine)."""
        E = args.num_tokens_per_expert.numel()
        if not (args.expert_major and args.topk_idx is not None and E <= NOTIFY_MAX_EXPERTS):
            return False, False
        choice = self.expert_major_in_reader
        if not (choice["uncached"] or (self._reads_before_counts_at_all and choice["uncached early"])):
            return False, False
        may_read_early = (self._reads_before_counts_at_all and combined_send_base is not None
                          and bool(args.num_worst_tokens or self._expert_rows_seen.get(T)))
        return True, choice["uncached early" if may_read_early else "uncached"]

    def _uncached_dispatch(self, args: DispatchArgs, combined_send_base: Optional[int]) -> DispatchResult:
        """A dispatch without a handle: notify exchanges the counts, and the receive is planned from them (or, read
        before the count read, from the count rows on the device). ``combined_send_base``: where the last combine's
        partial sums start in our send half, when that combine proves the rest of it free (packing during notify).
        A sync-free dispatch without drains returns before the count read (_returns_before_counts); the rest of this
        method, _after_counts, then runs at the next call's entry."""
        x, scales = args.x, args.x_scales
        itr = args.is_token_in_rank
        topk_idx, weights = args.topk_idx, args.topk_weights
        if args.expert_major and topk_idx is None:
            raise ValueError("expert_major=True needs topk_idx")
        if itr is None:
            itr = self.get_dispatch_layout(topk_idx, args.num_tokens_per_expert.numel())[3]
        T = x.size(0)
        E = args.num_tokens_per_expert.numel()
        ranks_pairs, in_reader = self._uncached_expert_major_reader(args, T, combined_send_base)
        cols = [x] + ([scales] if scales is not None else [])
        if topk_idx is not None:
            cols.append(_dense(topk_idx, torch.int64))
            cols.append(_dense(weights, torch.float32) if weights is not None else
                        torch.zeros(topk_idx.shape, dtype=torch.float32, device=x.device))
            if ranks_pairs:
                cols.append(self._pair_ranks(cols[-2], E))
        early: dict = {}
        during = tables = fused = reading = None
        # (`then` of _notify runs only when the counts go through the proxies: no tables for nothing otherwise)
        if combined_send_base is not None and self.pack_during_notify and self._notify_via_proxies:
            tables = self._fresh_plan(T, T * self.N, [])  # written with the count row
            dense = [_dense(c, c.dtype) for c in cols]
            layout = _record_layout(tuple(_row_bytes(r) for r in dense), self.G)
            fused = self._fused_table_during_notify(layout.stride)
            reading = self._reading_before_counts(args, T, layout, fused is not None, dense, tables, in_reader)

            def during(row: torch.Tensor, landing: CountRows) -> None:
                self._pack_during_notify(row, itr, dense, layout, combined_send_base, early, landing, tables, fused)
        early_return = self._returns_before_counts(args, reading)
        counts = self._notify(itr, args.num_tokens_per_expert, then=during, plan=tables,
                              row_goes_with_then=fused is not None,
                              ahead=(lambda rows: self._launch_reader_before_counts(reading, rows, combined_send_base))
                              if reading is not None else None, defer=early_return)
        self._lap("dispatch.notify")
        call = UncachedDispatch(args, combined_send_base, itr, in_reader, cols, early, reading, early_return)
        if early_return:
            return self._return_before_counts(call, counts)
        return self._after_counts(call, counts)

    def _after_counts(self, call: "UncachedDispatch", counts: Counts) -> DispatchResult:
        """An uncached dispatch from the counts on: the receive planned from them (or the reader launched before the
        count read confirmed by them), the outputs, the handle and the next calls' plans."""
        from uccl_ep_train.reference import _payload_bytes

        args, combined_send_base, itr = call.args, call.combined_send_base, call.itr
        in_reader, cols, early, reading = call.in_reader, call.cols, call.early, call.reading
        x, scales, topk_idx, weights = args.x, args.x_scales, args.topk_idx, args.topk_weights
        T, E = x.size(0), args.num_tokens_per_expert.numel()
        plan, pushed = self._packed_during_notify(early, counts)
        expert_rows = None  # an expert-major receive's rows, for the reader before the counts
        if reading is not None and reading.expert_rows:
            expert_rows = sum(_align(int(c), args.expert_alignment)
                              for c in recv_expert_counts(counts, self.rank, reading.experts_per_rank))
        words = self._before_counts_words(reading, counts, combined_send_base) if reading is not None else None
        declined = reading is not None and not self._reader_read(reading, words, expert_rows)
        forwarded = None  # several GPUs per node: a forward before the count read that went, its unpack did not
        if declined:
            if self.G > 1 and words[READ_GO]:
                forwarded = reading
            reading = None  # the reader did nothing: the host plans and reads after notify, as below
            self.reads_before_counts_declined += 1
        packed = early["rows"] if plan is not None else None
        if plan is None:
            plan = self._send_plan(itr, counts)
        self._lap("dispatch.plan")
        ahead = plan_ahead = later = None
        if self.plan_ahead:
            ahead = PlannedAhead()
            now, later = self._guesses(tuple(_row_bytes(c) for c in cols[:2 if scales is not None else 1]),
                                       x.size(1), topk_idx.size(1) if topk_idx is not None else 0)
            plan_ahead = lambda upload=True: self._plan_ahead(  # noqa: E731
                counts, plan, now, ahead, "dispatch.plan_ahead", upload=upload)
        worst = args.num_worst_tokens
        L = E // self.R
        payload = cols[:2 if scales is not None else 1]
        made: dict = {}
        em: Optional[ExpertMajorRows] = None

        @functools.cache  # asked by the expert-major outputs before the reader, and by the handle during it
        def expert_sizes() -> Tuple[Optional[List[int]], Optional[List[int]]]:
            """Raw and aligned received tokens per local expert, from the counts (None: more experts than a notify
            row holds; counted from the received ids below)."""
            if counts.expert_counts is None:
                return None, None
            raw = recv_expert_counts(counts, self.rank, L)
            return raw, [_align(int(c), args.expert_alignment) for c in raw]
        if reading is not None and reading.expert_rows:  # the reader writes the expert-major rows (and their plan)
            nrecv = num_recv_rows(counts, self.rank)
            rows = nrecv
            layout, pending, final, outs = reading.layout, None, None, []
            fwd_dest = self._forward_dest_before_counts(reading, counts)
            recv_topk_idx = recv_w = None
            src_idx, arrival = reading.src_idx[:nrecv], reading.arrival[:nrecv]
            em, cut = reading.em, worst or expert_rows  # (padded to num_worst_tokens, else cut at the rows filled)
            em = ExpertMajorRows(cut, em.info, em.token[:cut], em.slot[:cut], em.expert[:cut], em.weights[:cut],
                                 em.slot_of[:nrecv], [o[:cut] for o in em.out], em.places)
            self._expert_rows_seen[T] = expert_rows
            self.expert_major_reads_before_counts += 1
            self.expert_major_reads["uncached"] += 1
            self.expert_major_places_on_device += 1
        elif reading is not None:
            nrecv = num_recv_rows(counts, self.rank)
            rows = worst or nrecv
            layout, fwd_dest, pending = reading.layout, self._forward_dest_before_counts(reading, counts), None
            final = None  # (an expert-major receive read before the counts is the branch above)
            outs = [o[:rows] for o in reading.outs]
            recv_topk_idx = reading.topk_idx[:rows] if reading.topk_idx is not None else None
            recv_w = reading.weights[:rows] if reading.weights is not None else None
            src_idx, arrival = reading.src_idx[:nrecv], reading.arrival[:nrecv]
        else:
            # (an expert-major copy after the hop reads the final rows: our own among them)
            if forwarded is not None:  # the rows are forwarded already: only their unpack is left
                final, layout, fwd_dest, pending = self._forwarded_before_counts(forwarded, counts, plan)
            else:
                final, layout, fwd_dest, _, pending = self._move(cols, counts, plan, gate_ok=True, packed=packed,
                                                                 pushed=pushed, plan_ahead=plan_ahead,
                                                                 own_from_columns=in_reader or not args.expert_major,
                                                                 unpacked_next=not args.expert_major)
            nrecv = final.size(0)
            rows = nrecv
            if worst and not args.expert_major:
                if nrecv > worst:
                    self._await_pending(pending, "dispatch_network")  # the peers' records land before we give up
                    self._close_unpack_beside()
                    raise InternodeError(f"rank {self.rank}: received {nrecv} tokens but num_worst_tokens={worst}; "
                                         "raise num_worst_tokens")
                rows = worst
            # one launch takes every column out of the final rows (padded to num_worst_tokens); expert-major gathers
            # the payload straight from the final rows below instead (one copy)
            outs = [] if args.expert_major else [_empty_rows(c, rows) for c in payload]
            recv_topk_idx = recv_w = None
            if topk_idx is not None and not in_reader:  # (the reader writes the expert-major plan instead)
                recv_topk_idx = torch.empty((rows, topk_idx.size(1)), dtype=torch.int64, device=self.device)
                recv_w = torch.empty((rows, topk_idx.size(1)), dtype=torch.float32, device=self.device)
            src_idx = torch.empty(nrecv, dtype=torch.int64, device=self.device)
            arrival = torch.empty(nrecv, dtype=torch.int64, device=self.device)
            self._lap("dispatch.outputs")
            if args.expert_major and counts.expert_counts is not None:
                # the reader's table from the count rows where they are on the device (this call's: the next
                # notify overwrites them only after every rank's combine of this receive)
                places_from = ((self._notify_rows_at.ptr, self._notify_rows_at.row_words, args.expert_alignment)
                               if in_reader and self._notify_rows_at is not None else None)
                try:
                    em = self._expert_major_rows(nrecv, topk_idx.size(1), *expert_sizes(), worst, payload,
                                                 places_from)
                except InternodeError:
                    self._await_pending(pending, "dispatch_network")  # the peers' records land before we give up
                    raise
                if in_reader:  # the reader's table, and the rows it leaves empty done before it
                    if em.places is None:
                        em.places = self._upload(expert_major_places(counts, self.rank, L, expert_sizes()[1]))
                    self._expert_major_pad(em.info, args.expert_alignment, em.rows, em.out, em)
                self._expert_rows_seen[T] = sum(expert_sizes()[1])  # (the next dispatch of T tokens guesses from it)
        self._recv_rows_seen[T] = nrecv
        # Everything that follows from the counts alone is made while the hop runs, not after the drain (~100 us per
        # call there, session 10): the outputs before the reader's launch (an allocation may call into CUDA), the
        # handle and the next calls' plans right after it, while the reader reads the rows already in (host_work:
        # with one GPU per node the reader is gated and spins, and nothing may call into CUDA then: "Drains").
        # The combine's gather table is made by the combine that needs it.
        plan_first = pending is not None and plan_ahead is not None and self._plan_before_reader(pending)
        if plan_first:
            self._lap("dispatch.outputs")
            plan_ahead()
        # An expert-major receive's reader moves no payload (the copy after the drain does), so it ends soon after the
        # last chunk lands, while planning during it held the drain back (~150-200 us under MPS, session 28): its
        # plans are made after the copy's launch instead, while the GPU copies.
        plan_after_copy = (args.expert_major and not in_reader and pending is not None and plan_ahead is not None
                           and not plan_first)

        def host_work() -> None:  # while the reader runs (spins, when gated): nothing queued on the stream
            raw, aligned = expert_sizes()
            h = InternodeHandle(num_tokens=T, num_recv_rows=nrecv,
                                num_topk=topk_idx.size(1) if topk_idx is not None else 0, num_ranks=self.R,
                                expert_major=args.expert_major, is_token_in_rank=itr, recv_tokens_per_expert=aligned,
                                device=self.device, counts=counts, plan=plan, num_recv_tokens=nrecv,
                                recv_src_idx=src_idx, recv_arrival=arrival, fwd_dest_rows=fwd_dest,
                                expert_alignment=args.expert_alignment, num_worst_tokens=args.num_worst_tokens)
            self.last_traffic = self._traffic_forward(h, _payload_bytes(x, scales))
            made.update(h=h, raw=raw, aligned=aligned)
            if (pending or reading is not None) and plan_ahead is not None and not plan_first and not plan_after_copy:
                plan_ahead(False)  # (no pending: made in _move, before the wait)

        if reading is not None:
            self._while_reader_before_counts(reading, counts, plan, host_work)
        elif in_reader:
            self._expert_major_read(final, layout, em.out, em.rows, topk_idx.size(1), em.slot_of, em, L, src_idx,
                                    arrival, pending, while_reading=host_work)
        else:
            self._unpack(final, layout, outs, rows, recv_topk_idx, recv_w, len(payload), self.rank * L, L, src_idx,
                         arrival, pending, while_reading=host_work)
        h, raw, aligned = made["h"], made["raw"], made["aligned"]
        recv_x = outs[0] if outs else None
        recv_scales = outs[1] if scales is not None and outs else None
        if raw is None:
            if topk_idx is not None:  # more experts than a notify row holds: count the received ids (a host sync)
                # non-local slots count into a spare bin L: no boolean indexing
                ids = recv_topk_idx[:nrecv]
                raw = torch.bincount(torch.where(ids >= 0, ids, L).view(-1), minlength=L + 1)[:L].tolist()
            else:  # no top-k: the per-expert counts come from every source's num_tokens_per_expert
                mine = args.num_tokens_per_expert.to(torch.int64).cpu()
                every = [torch.empty_like(mine) for _ in range(self.R)]
                dist.all_gather(every, mine, group=self._gloo)
                raw = torch.stack(every).view(self.R, self.R, L)[:, self.rank].sum(0).tolist()
            aligned = [_align(int(c), args.expert_alignment) for c in raw]
            h.recv_tokens_per_expert = aligned
        if in_reader:
            recv_topk_idx, recv_w = self._adopt_expert_major(h, em)
            recv_x = em.out[0]
            recv_scales = em.out[1] if scales is not None else None
        elif args.expert_major:
            sources = _record_columns(final, layout, len(payload))  # straight from the final rows: one copy
            if em is None:  # sized from the received ids counted above
                em = self._expert_major_rows(nrecv, topk_idx.size(1), raw, aligned, worst, payload)
            # (expert-major is never read before the counts: its top-k outputs have the received rows, no padding)
            recv_topk_idx, recv_w = self._expert_major_plan(h, recv_topk_idx, recv_w, em)
            out = self._expert_major_copy(h, sources, payload, em.out)
            recv_x = out[0]
            recv_scales = out[1] if scales is not None else None
            if plan_after_copy:
                plan_ahead()
        else:
            h.num_recv_rows = rows
        if ahead is not None:
            self._lap("dispatch.handle")
            self._adopt_plans(h, ahead)
            h.later_guesses = later
            self._lap("dispatch.adopt_plans")
        if weights is None:
            recv_w = None
        if declined and call.returned_early:  # the outputs it returned were never written (the host's read went
            # into outputs of its own above, which nobody holds)
            raise InternodeError(
                f"rank {self.rank}: its reader did not read before the counts, so the outputs it returned were not "
                f"written: the records it sent passed its send area below the last combine's partial sums (raise "
                f"num_rdma_bytes); every record has landed and the next calls run")
        self._last_dispatch_handle = h
        self._lap("dispatch.finish")
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_w, [] if worst else aligned, h,
                              self.last_traffic)

    # ------------------------------------------------------- sync-free dispatch: returning before the count read
    def _returns_before_counts(self, args: DispatchArgs, reading: Optional[ReadingBeforeCounts]) -> bool:
        """Whether this uncached dispatch returns before the host reads the counts (docs/internode.md, "Sync-free
        dispatch: returning before the count read"): sync-free (num_worst_tokens: the outputs' rows are known), no
        drains (the host would wait for the reader anyway), its reader launched before the count read (so nothing
        on the GPU waits for the host's plan), and the tokens per expert in the count rows (the handle's device
        counts come from them, or from the reader's expert-major plan)."""
        return (reading is not None and args.num_worst_tokens > 0 and self._sync_free_returns_early
                and args.num_tokens_per_expert.numel() <= NOTIFY_MAX_EXPERTS)

    def _return_before_counts(self, call: "UncachedDispatch", read_counts: Callable[[], Counts]) -> DispatchResult:
        """The outputs of a dispatch whose reader was launched before the count read, returned without reading the
        counts: num_worst_tokens rows each, written by that reader; a handle whose count-derived fields the next
        call's entry fills in (_finish_dispatch_before_counts, which runs _after_counts), and whose tokens per
        expert meanwhile come from the device."""
        args, reading = call.args, call.reading
        worst, align, L = args.num_worst_tokens, args.expert_alignment, reading.experts_per_rank
        h = InternodeHandle(num_tokens=args.x.size(0), num_recv_rows=worst,
                            num_topk=args.topk_idx.size(1) if args.topk_idx is not None else 0, num_ranks=self.R,
                            expert_major=args.expert_major, is_token_in_rank=call.itr, recv_tokens_per_expert=None,
                            device=self.device, counts=None, plan=None, expert_alignment=align,
                            num_worst_tokens=worst)
        if reading.expert_rows:
            em = reading.em
            recv_topk_idx, recv_w = self._adopt_expert_major(h, em)
            outs = em.out
            info = em.info
            raw = lambda: info[2:2 + L]  # noqa: E731  (the plan's raw counts per local expert, from the count rows)
        else:
            outs, recv_topk_idx, recv_w = reading.outs, reading.topk_idx, reading.weights
            rows_at = self._notify_rows_at  # every source's tokens per expert, until the next notify
            rows = _raw_bytes(rows_at.ptr, 8 * self.R * rows_at.row_words, self.device).view(torch.int64)
            first = self.R + self.N + self.rank * L
            per_source = rows.view(self.R, rows_at.row_words)[:, first:first + L]
            raw = lambda: per_source.sum(0)  # noqa: E731
        # made when first asked for, on the caller's stream (behind this call's launches): before the next call,
        # which fills in the host list (the next notify may overwrite the rows only after that)
        h.device_counts = lambda: _aligned_counts(raw(), align)
        self._deferred_dispatch = (h, lambda: self._after_counts(call, read_counts()))
        self.dispatches_before_counts += 1
        self._last_dispatch_handle = h
        self._lap("dispatch.returned_before_counts")
        return DispatchResult(outs[0], outs[1] if args.x_scales is not None else None, recv_topk_idx,
                              recv_w if args.topk_weights is not None else None, [], h, None)

    def _finish_dispatch_before_counts(self) -> None:
        """At a call's entry, before anything else: the host half of the sync-free dispatch before it, if that
        returned before the count read -- the counts read (draining to the mark behind their copy, so the host waits
        only for the GPU to pass that dispatch's notify), then everything _after_counts does with them: the counters'
        targets, the checks, the handle's fields, the plans made ahead. An error it finds (too few num_worst_tokens
        rows) is raised here, after the records landed, naming that dispatch."""
        if self._deferred_dispatch is None:
            return
        h, finish = self._deferred_dispatch
        self._deferred_dispatch = None
        self._lap(None)  # (benchmarks: its laps start here, not at the end of the call before, outside the backend)
        try:
            made = finish().handle
        except InternodeError as exc:
            raise InternodeError(f"the sync-free dispatch before this call failed (it returned before the counts, "
                                 f"so its error is raised here): {exc}") from exc
        on_device = h._recv_tokens_per_expert_dev
        h.__dict__.update(made.__dict__)  # the same object stays the caller's handle, and the last dispatch's
        if on_device is not None:  # (made from the device before; equal to the host list's)
            h._recv_tokens_per_expert_dev = on_device
        self._last_dispatch_handle = h

    def _expert_major_rows(self, nrecv: int, topk: int, raw: List[int], aligned: List[int], worst: int,
                           like: List[torch.Tensor], places_from: Optional[Tuple[int, int, int]] = None
                           ) -> ExpertMajorRows:
        """An expert-major receive's plan and payload outputs for these sizes (``raw``: received tokens per local
        expert; ``aligned``: padded to the alignment; ``like``: the payload columns), and the plan's sizes on the
        device; raises when the rows exceed num_worst_tokens (``worst``). ``places_from`` (the count rows on the
        device, their row words and the alignment): the reader's places and the plan's sizes are made there from
        notify's count rows, one launch (expert_major_places), instead of two uploads of the host's copy."""
        rows = sum(aligned)
        if worst:
            if rows > worst:
                raise InternodeError(f"rank {self.rank}: expert-major receive needs {rows} rows but num_worst_tokens="
                                     f"{worst}; raise num_worst_tokens")
            rows = worst
        em = self._expert_major_outputs(nrecv, topk, len(raw), rows, like, on_device=places_from is not None)
        if places_from is not None:
            count_rows, row_words, alignment = places_from
            self._k.expert_major_places(count_rows, row_words, self.R, self.N, self.rank, len(raw), alignment,
                                        em.places.data_ptr(), em.info.data_ptr(), self._stream())
            self.expert_major_places_on_device += 1
        else:
            em.info = self._upload([nrecv, 0] + [int(c) for c in raw], np.int32)  # the plan's sizes: recv_info's
        return em

    def _expert_major_outputs(self, nrecv: int, topk: int, L: int, rows: int, like: List[torch.Tensor],
                              on_device: bool) -> ExpertMajorRows:
        """An expert-major receive's outputs, uninitialised: ``rows`` expert-major rows (plan columns, and payload
        shaped as ``like``), slot_of for ``nrecv`` received rows and, where the device makes them (``on_device``;
        else the caller uploads them), the plan's sizes and the reader's places."""
        dev = self.device
        token, slot, expert = (torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(3))
        made = lambda n, dtype: torch.empty(n, dtype=dtype, device=dev) if on_device else None  # noqa: E731
        return ExpertMajorRows(rows, made(L + 2, torch.int32), token, slot, expert,
                               torch.empty(rows, dtype=torch.float32, device=dev),
                               torch.empty((nrecv, topk), dtype=torch.int32, device=dev),
                               [_empty_rows(t, rows) for t in like], made(self.R + 1 + 2 * self.R * L, torch.int64))

    def _expert_major_plan(self, h: InternodeHandle, recv_topk_idx: torch.Tensor, recv_w: torch.Tensor,
                           em: ExpertMajorRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """Where each (received token, local expert) pair goes in the expert-major rows -- experts in order, each
        segment padded to the alignment, tokens in receive order within it -- made on the device by the plan kernel
        (csrc/kernels/expert_major.hpp) into ``em`` and onto the handle; returns the rows' local experts and weights
        (-1 and 0 on padding). The sizes come from the host-side counts, so nothing here reads the device."""
        self._k.expert_major_layout(recv_topk_idx.data_ptr(), recv_w.data_ptr(), em.info.data_ptr(),
                                    h.num_recv_tokens, em.rows, em.info.numel() - 2, h.expert_alignment, h.num_topk,
                                    em.token.data_ptr(), em.slot.data_ptr(), em.expert.data_ptr(),
                                    em.weights.data_ptr(), em.slot_of.data_ptr(),
                                    # blocks clearing the rows after the last segment: only num_worst_tokens has any
                                    self._expert_major_grid("copy") if h.num_worst_tokens else 1, self._stream())
        return self._adopt_expert_major(h, em)

    @staticmethod
    def _adopt_expert_major(h: InternodeHandle, em: ExpertMajorRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """The plan in ``em`` onto the handle (its combine and cached dispatches use it); returns the rows' local
        experts and weights (-1 and 0 on padding)."""
        h.expert_major_token, h.expert_major_slot, h.slot_of = em.token, em.slot, em.slot_of
        h.expert_major_info = em.info
        h.num_recv_rows = em.rows
        return em.expert, em.weights

    def _pair_ranks(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The records' column for an expert-major receive made by the reader: per (token, slot) naming expert e,
        how many (token, slot) pairs before it name e (int32, -1 on dropped slots; docs/internode.md, "Expert-major
        rows in the reader": three short launches over chunks of pairs, one for more than 1024 experts)."""
        T, K = topk_idx.shape
        ranks = torch.empty((T, K), dtype=torch.int32, device=self.device)
        # the chunked launches' counts (0 bytes: the one-launch kernel). From the caching allocator on the stream the
        # launches use, so freeing it when this returns is stream-ordered behind them
        nbytes = self._k.expert_major_pair_ranks_workspace_bytes(T, K, num_experts)
        work = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if nbytes else None
        self._k.expert_major_pair_ranks(topk_idx.data_ptr(), T, K, num_experts, ranks.data_ptr(), self._stream(),
                                        workspace=_address(work), workspace_bytes=nbytes)
        return ranks

    def _expert_major_pad(self, info: torch.Tensor, alignment: int, rows: int, out: List[torch.Tensor],
                          em: Optional[ExpertMajorRows] = None, go: int = 0, stream: Optional[int] = None) -> None:
        """The expert-major rows no pair fills (segment padding, the tail up to ``rows``) zeroed in ``out``, and
        with ``em`` marked empty in its plan; one launch, before the reader, which writes only the other rows.
        ``go``: the device words of a reader launched before the count read (nothing done when they say no);
        ``stream``: the reader's (default: ours)."""
        self._k.expert_major_pad(info.data_ptr(), info.numel() - 2, alignment, rows, _row_bytes(out[0]),
                                 out[1][0].numel() if len(out) > 1 else 0, out[0].data_ptr(),
                                 _address(out[1]) if len(out) > 1 else 0, _address(em and em.token),
                                 _address(em and em.slot), _address(em and em.expert), _address(em and em.weights),
                                 self._expert_major_grid("copy"),
                                 self._stream() if stream is None else stream, go=go)

    def _expert_major_read(self, final: torch.Tensor, layout: RecordLayout, out: List[torch.Tensor], rows: int,
                           topk: int, slot_of: torch.Tensor, em: Optional[ExpertMajorRows] = None,
                           experts_per_rank: int = 0, src_idx: Optional[torch.Tensor] = None,
                           arrival: Optional[torch.Tensor] = None, pending: Any = None,
                           while_reading: Optional[Callable[[], None]] = None) -> None:
        """The final rows' payload straight into the expert-major rows ``out`` (``rows`` of them), one launch
        (expert_major_receive kernel). With ``em`` (uncached) each pair's row comes from its record (global id, pair
        rank) and ``em.places``, and the reader writes ``em``'s plan and ``slot_of``; without, from ``slot_of``
        (the handle's). src_idx, arrival, ``pending`` and ``while_reading`` as _unpack's."""
        self._expert_major_receive(final, layout, out, rows, topk, slot_of, em, experts_per_rank, src_idx, arrival,
                                   gate=pending.gate if pending else None,
                                   first_row=pending.first_row if pending else 0,
                                   own=pending.own if pending else None)
        self._while_reader(pending, while_reading)

    def _expert_major_receive(self, final: torch.Tensor, layout: RecordLayout, out: List[torch.Tensor], rows: int,
                              topk: int, slot_of: torch.Tensor, em: Optional[ExpertMajorRows], experts_per_rank: int,
                              src_idx: Optional[torch.Tensor], arrival: Optional[torch.Tensor], gate: Any = None,
                              first_row: int = 0, own: Optional[tuple] = None, dims: int = 0,
                              counted: bool = True, stream: Optional[int] = None,
                              ready: Optional[Tuple[int, int]] = None) -> None:
        """The expert_major_receive launch of _expert_major_read; ``dims``: read before the counts (the rows, first
        row and our own rows' place from those device words, ``own`` then giving only the tokens and columns), where
        the caller counts the receive once it knows that the reader reads (``counted`` False); ``stream`` and
        ``ready`` (beside the forward) as _unpack_launch's."""
        n = final.size(0)
        if counted:
            self.expert_major_reads["uncached" if em is not None else "cached"] += 1
        ids = len(out)  # the top-k ids' column, then the weights and the pair ranks
        scales = len(out) > 1
        places = em.places.data_ptr() if em is not None else 0
        self._k.expert_major_receive(
            final.data_ptr(), final.stride(0) * final.element_size(), n, layout.column_offsets[0],
            layout.column_bytes[0], layout.column_offsets[1] if scales else 0, out[1][0].numel() if scales else 0,
            out[0].data_ptr(), out[1].data_ptr() if scales else 0, rows, topk, em is None, slot_of.data_ptr(),
            layout.column_offsets[ids] if em else -1, layout.column_offsets[ids + 1] if em else -1,
            layout.column_offsets[ids + 2] if em else -1, self.rank * experts_per_rank, experts_per_rank, self.R,
            places, places + 8 * (self.R + 1) if em else 0, _address(em and em.token), _address(em and em.slot),
            _address(em and em.expert), _address(em and em.weights), layout.src_idx_offset, _address(src_idx),
            layout.arrival_offset if self.G > 1 else -1, _address(arrival),
            self._stream() if stream is None else stream,
            gate=gate, first_row=first_row, own=own, dims=dims, **self._ready_args(ready))

    def _expert_major_copy(self, h: InternodeHandle, sources: List[Tuple[int, int]], like: List[torch.Tensor],
                           out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """The payload columns (``sources``: each column's first row address and row stride in bytes, rank-major)
        in the handle's expert-major rows, into ``out`` (allocated here when None) shaped and typed as ``like`` (x,
        then the scales if any): one launch."""
        rows = h.num_recv_rows
        if out is None:
            out = [_empty_rows(t, rows) for t in like]
        (x_at, x_stride), x_bytes = sources[0], _row_bytes(like[0])
        s_at, s_stride = sources[1] if len(like) > 1 else (0, 0)
        num_scales = like[1][0].numel() if len(like) > 1 else 0
        self._k.expert_major_copy(x_at, x_stride, s_at, s_stride, h.expert_major_info.data_ptr(), h.num_recv_tokens,
                                  rows, x_bytes, num_scales, h.num_topk, h.slot_of.data_ptr(),
                                  h.expert_major_token.data_ptr(), out[0].data_ptr(),
                                  out[1].data_ptr() if len(out) > 1 else 0, self._expert_major_grid("copy"),
                                  self._stream())
        return out

    def _expert_major_grid(self, kernel: str) -> int:
        """Blocks of an expert-major kernel that fill the GPU (asked once per kernel: the occupancy API)."""
        grid = self._em_grids.get(kernel)
        if grid is None:
            grid = self._em_grids[kernel] = self._k.expert_major_grid(kernel)
        return grid

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: InternodeHandle, topk_weights: Optional[torch.Tensor], config: Any
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        from uccl_ep_train.reference import TrafficReport

        self._check("entry of combine")  # no drain: see dispatch
        self._refuse_a_stall_without_drains()
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        self._combined_send_base = None
        self._lap(None)
        h = handle
        G, dev = self.G, self.device
        nrecv, H = h.num_recv_tokens, x.size(1)
        if x.dtype not in (torch.bfloat16, torch.float32) or (H * x.element_size()) % 16:
            raise ValueError(f"combine: x must be bfloat16 or float32 with a hidden size of a multiple of 16 bytes, "
                             f"got {x.dtype} with hidden {H}")
        rows = w = ew = None
        if h.expert_major:
            if x.size(0) < h.num_recv_rows:
                raise ValueError(f"combine: x has {x.size(0)} rows but the expert-major handle has {h.num_recv_rows}")
            # one partial per (token, rank) in x's dtype, its local experts summed in slot order (as reference.combine):
            # by the pack itself where one launch packs and pushes (_expert_sums), else by a kernel first (_partials)
            x = _dense(x, x.dtype)
            ew = _dense(topk_weights, torch.float32) if topk_weights is not None else None
            kw = h.num_topk if ew is not None else 0
        else:  # (slices and conversions only where needed: each torch call costs host time before the wire)
            rows = _dense(x if x.size(0) == nrecv else x[:nrecv], x.dtype)
            if topk_weights is not None:
                w = _dense(topk_weights if topk_weights.size(0) == nrecv else topk_weights[:nrecv], torch.float32)
            kw = w.size(1) if w is not None else 0
        # A wire row: the payload in x's dtype, then the weights in fp32. Every copy a rank sends is a row of x (exact
        # in x's dtype), and a node partial crosses the network in x's dtype as in DeepEP (reference.combine rounds
        # it the same way): half the bytes of fp32 rows.
        pay = H * x.element_size()
        cstride = _align(pay + 4 * kw)
        shape = h.combine_shapes.get(cstride)
        if shape is None:
            shape = h.combine_shapes[cstride] = self._combine_shape(h.counts, cstride)
        recv_by_node, areas = shape.recv_by_node, shape.areas
        A = sum(recv_by_node)
        tot = h.counts.totals(G)
        c_send, c_recv = areas.send_base[self.rank], areas.recv_base[self.rank]
        self._lap("combine.prepare")
        if self._combine_needs_barrier(areas):
            self._barrier("entry of combine")  # every rank finished its previous use of the areas
        else:
            self.combine_barriers_skipped += 1
        self._synced_since_combine = False
        self._last_combine = (h.counts, areas)
        self._lap("combine.entry")
        # NVLink hop: each copy goes to its forwarder (same local index as the token's source), block = our local
        # index, row = the record's arrival. With one GPU per node we are every copy's forwarder and the only one:
        # the copies go straight into the send area (they are the partial sums), and stream order replaces the barrier.
        gbase = self.half_nvl
        # gather block j (copies from local GPU j) starts at a whole number of rows, so the forwarder's node sum
        # addresses every block's rows from one base
        rows_per_block = self.gather_block // cstride
        block = rows_per_block * cstride
        zero = self._zero_rows.get(pay)
        if zero is None:
            zero = self._zero_rows[pay] = torch.zeros(pay, dtype=torch.uint8, device=dev)
        back_offs = block_offsets(h.plan.node_send, cstride)  # at the source: records per node, in node order
        own_first = sum(recv_by_node[:self.node])
        own = recv_by_node[self.node]

        hop = self._hop_plan(h, ("combine", cstride), lambda: self._combine_hop(h.counts, cstride, areas))
        rest = fused = None
        sums_in_pack = h.expert_major and G == 1 and self.expert_sums_in_pack and self._packs_and_pushes(hop)
        if h.expert_major and not sums_in_pack:
            rows, w = self._partials(x, ew, h, nrecv)
        if G == 1 and self._packs_and_pushes(hop):
            # one launch writes the rows for the other nodes as records and pushes each chunk once it is written,
            # then writes our own node's rows where the sum reads them
            cols = [] if sums_in_pack else [(rows.data_ptr(), pay, 0)] + ([(w.data_ptr(), 4 * kw, pay)] if kw else [])
            sums = self._expert_sums(x, ew, h, pay) if sums_in_pack else None
            fused = lambda: self._pack_and_push(  # noqa: E731
                hop, "combine_network", self._cx.rdma_ptr + c_send, cstride, A, cols,
                (own_first, own, self._cx.rdma_ptr + c_recv + back_offs[self.node]), expert_sums=sums)
            self.expert_sums_in_packs += sums_in_pack
            self._lap("combine.gather")
        elif G == 1:
            # One GPU per node: the rows are the partial sums already, in arrival order (row = arrival). The other
            # nodes' go to their records in the send area and are pushed first (the head's, then the rest while the
            # head moves); our own node's go afterwards straight to where the sum reads them (their block of the
            # receive area), during the hop and without a copy.
            others = _ranges_around(own_first, own, A)

            def gather(ranges: List[Tuple[int, int]]) -> None:
                for lo, hi in ranges:
                    self._gather_rows(rows, w, lo, hi, c_send + lo * cstride, cstride)

            if hop.head_records:
                gather([(hop.head_first, hop.head_first + hop.head_records)])
                rest = lambda: gather(hop.rest_of(others))  # noqa: E731
            else:
                gather(others)
            self._lap("combine.gather")
        elif self.pipelined_gather:
            # docs/internode.md, "Pipelined combine gather": our copies go to the forwarders tile by tile, each tile
            # flagged over NVLink; our node sums are written and pushed by one launch, each record once its copies'
            # tiles are flagged, so the hop starts with the first tiles and no barrier sits before it
            epoch, tile = self._gather_in_tiles(h, shape, rows, w, nrecv, pay, kw, cstride, block)
            self.pipelined_gathers += 1
            self._lap("combine.gather")
            if A:
                sum_rows = self._forward_sum_rows(h, A, rows_per_block)
                if self._packs_and_pushes(hop):
                    node_sums = (self._cx.nvl_ptr + gbase, sum_rows.data_ptr(), G, pay, kw, x.dtype == torch.float32,
                                 self._cx.nvl_ptr + self._flag_base, tile, epoch)
                    fused = lambda: self._node_sum_push(  # noqa: E731
                        hop, cstride, A, (own_first, own, self._cx.rdma_ptr + c_recv + back_offs[self.node]),
                        self._cx.rdma_ptr + c_send, node_sums)
                else:  # no record for another node (or too many for one launch): wait for every tile, then sum
                    self._cx.wait_node_flags(self._cx.nvl_ptr + self._flag_base, G, -(-A // tile), epoch,
                                               self._phases["combine_gather"], self._stream())
                    self._join_gather()
                    self._node_sums(x, sum_rows, zero, A, pay, kw, cstride, gbase, c_send, c_recv, back_offs,
                                    own_first, own)
            else:
                self._join_gather()  # nothing of ours waits for the tiles: our stream takes the copies in turn
            self._lap("combine.node_sum")
        else:
            gather_index = self._gather_index(h, nrecv)
            if shape.gather is None or shape.gather[0] != pay:
                at = [self.peer_nvl[j] + gbase + self.local * block for j in range(G)]
                weights_at = [a + pay for a in at]
                limits = [tot.arrivals[self.node * G + j] for j in range(G)]
                shape.gather = (pay, self._upload([at, weights_at, limits]),
                                tuple(functools.reduce(operator.or_, b) for b in (at, weights_at)))
            _, table, bases_or = shape.gather
            if nrecv:  # one launch per column (payload, weights), each row to its forwarder's gather block
                for src, nbytes, i in ((rows, pay, 0), (w, 4 * kw, 1)):
                    if nbytes:
                        self._forward_rows(table[i], bases_or[i], cstride, gather_index, src.data_ptr(), nbytes,
                                           nrecv, nbytes, table[2], "combine_gather")
            self._barrier("combine gather")  # every copy of our arrivals is in our gather blocks
            self._lap("combine.gather")
            if A:
                self._node_sums(x, self._forward_sum_rows(h, A, rows_per_block), zero, A, pay, kw, cstride, gbase,
                                c_send, c_recv, back_offs, own_first, own)
            self._lap("combine.node_sum")

        pending = ahead = plan_ahead = None
        if h.later_guesses:  # the backward's plans, made while this hop runs
            ahead, later, h.later_guesses = PlannedAhead(), h.later_guesses, None
            plan_ahead = lambda upload=True: self._plan_ahead(  # noqa: E731
                h.counts, h.plan, later, ahead, "combine.plan_ahead", h.hop_plans, upload)
        if self.gated_arrivals:  # the sum below reads each token's partial sums as their chunks land
            pending = self._push_and_gate(hop, "combine_network", rest=rest, push=fused)
            self._lap("combine.push")
        else:
            self._push_and_wait(hop.rows, hop.waits, "combine_network", hop.per_chunk, hop=hop, rest=rest,
                                then=plan_ahead, push=fused)
            self._lap("combine.network")
        if G == 1 and own and fused is None:
            self._gather_rows(rows, w, own_first, own_first + own, c_recv + back_offs[self.node], cstride)
            self._lap("combine.node_sum")
        # the source adds each token's partial sums in node order, in fp32, and rounds once (one kernel)
        combined_x = torch.empty((h.num_tokens, H), dtype=x.dtype, device=dev)
        out_w = torch.empty((h.num_tokens, kw), dtype=torch.float32, device=dev) if kw else None
        eb = H * x.element_size()
        self.last_traffic = TrafficReport(shape.nvlink_rows * eb, shape.network_rows * eb, nrecv * eb)
        plan_first = pending is not None and plan_ahead is not None and self._plan_before_reader(pending)
        if plan_first:
            plan_ahead()
        self._k.sum_node_partials(combined_x.data_ptr(), out_w.data_ptr() if kw else 0, self._cx.rdma_ptr + c_recv,
                                  cstride, h.plan.row_of.data_ptr(), zero.data_ptr(), self.N, h.num_tokens, pay, kw,
                                  x.dtype == torch.float32, self._stream(), gate=pending.gate if pending else None)
        if h is self._last_dispatch_handle and self.pack_during_notify and self._notify_via_proxies:  # during the hop
            self._spare_for_packing_during_notify(h.num_tokens)
            self._spare_for_reading_before_counts()
        try:
            if pending and plan_ahead is not None and not plan_first:  # staged tables; copies after the drain
                plan_ahead(False)
        finally:  # drained whatever the planning raised
            if pending:
                self._gated_done("combine_network", pending.t0, "combine_network wait")
                self._lap("combine.network")
            else:
                self._settle("combine")
        if ahead is not None:
            self._adopt_plans(h, ahead)
        if h is self._last_dispatch_handle:  # the next uncached dispatch may pack during notify
            self._combined_send_base = areas.send_base[self.rank]
        self._lap("combine.finish")
        return combined_x, out_w

    def _partials(self, x: torch.Tensor, ew: Optional[torch.Tensor], h: InternodeHandle, nrecv: int
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine rows of expert-major ``x`` (its expert-major weights ``ew``): per received token its local
        experts' rows summed in slot order, and its top-k weights back in their slots (expert_major_partials, one
        launch over the whole GPU)."""
        rows = torch.empty((nrecv, x.size(1)), dtype=x.dtype, device=self.device)
        w = torch.empty((nrecv, h.num_topk), dtype=torch.float32, device=self.device) if ew is not None else None
        if nrecv:  # (a rank that received nothing may still hold num_worst_tokens padding rows)
            self._k.expert_major_partials(
                x.data_ptr(), _address(ew), h.slot_of.data_ptr(),
                h.expert_major_info.data_ptr(), nrecv, x.size(1), x.element_size(), h.num_topk, rows.data_ptr(),
                _address(w),
                self._expert_major_grid("partials_f32" if x.dtype == torch.float32 else "partials_bf16"),
                self._stream())
        return rows, w

    @staticmethod
    def _expert_sums(x: torch.Tensor, ew: Optional[torch.Tensor], h: InternodeHandle, pay: int) -> tuple:
        """pack_and_push's expert_sums (ExpertSums, csrc/kernels/internode.hpp): the records are the rows _partials
        makes, summed by the packers as they write each record, so the wire does not wait for a pass over every
        expert-major row first (docs/internode.md, "Expert-major sums in the pack")."""
        return (x.data_ptr(), pay, x.dtype == torch.float32, h.slot_of.data_ptr(), h.num_topk,
                _address(ew), pay)

    def _next_epoch(self, epoch: int, setting: str) -> int:
        """The epoch after ``epoch`` for a kind of NVLink flags (every rank counts its calls alike), refused before the
        int32 flags would wrap."""
        if epoch + 1 >= 2 ** 31:
            raise InternodeError(f"rank {self.rank}: 2^31 calls raised the int32 NVLink flags of {setting}; they would "
                                 f"wrap ({setting}=0 goes on without them)")
        return epoch + 1

    def _gather_index(self, h: InternodeHandle, nrecv: int) -> torch.Tensor:
        """int64 [nrecv, G]: each received row's arrival at its forwarder (the local GPU of its source) in that GPU's
        column, -1 in the others; the same in every combine of the handle, made at its first."""
        if h.gather_index is None:
            h.gather_index = torch.full((nrecv, self.G), -1, dtype=torch.int64, device=self.device)
            h.gather_index.scatter_(1, self._source_local(h, nrecv).unsqueeze(1), h.recv_arrival.unsqueeze(1))
        return h.gather_index

    def _source_local(self, h: InternodeHandle, nrecv: int) -> torch.Tensor:
        """int64 [nrecv] on the device: the local index of each received row's source (source_local_of_rows)."""
        return source_local_of_rows(self._upload(recv_row_ends(h.counts, self.rank)), nrecv, self.G)

    def _node_sum_push(self, hop: HopPlan, cstride: int, A: int, own: Tuple[int, int, int], send: int,
                       node_sums: tuple) -> None:
        """The forwarder's node sums written and pushed by one pack_and_push launch, each record once its copies'
        tiles are flagged. With our own copies on the side stream (gather_beside_push) the launch runs beside them,
        held to gather_beside_push_blocks blocks so that the copies' blocks always find room on the GPU (its blocks
        wait for the copies' flags); then our stream waits for the copies before anything queued after it."""
        try:
            with self._spin_blocks_held(self.gather_beside_push_blocks if self._gather_to_join else 0):
                self._pack_and_push(hop, "combine_network", send, cstride, A, [], own, node_sums=node_sums)
        finally:
            self._join_gather()

    @contextlib.contextmanager
    def _spin_blocks_held(self, blocks: int):
        """The spinning grids launched inside (pack_and_push's packers, the gated readers: their gates take the cap
        when made) held to ``blocks`` (0: as they are), below any cap already set (ranks sharing a GPU), so that work
        on the second stream that they wait for finds room beside them."""
        cap = self._cx.spin_blocks
        if blocks:
            self._cx.spin_blocks = min(cap, blocks) if cap else blocks
        try:
            yield
        finally:
            self._cx.spin_blocks = cap

    def _join_gather(self) -> None:
        """Our stream waits (on the GPU) for the copies launched on the side stream: whatever is queued after this
        -- the sum, the next call, the drain's mark -- comes after them, as on one stream."""
        if self._gather_to_join:
            self._gather_to_join = False
            self._cx.stream_wait(self._stream(), self._cx.side_stream)

    def _forward_sum_rows(self, h: InternodeHandle, A: int, rows_per_block: int) -> torch.Tensor:
        """int32 [G, A]: the gather row (counted from the first block) of local GPU j's copy of arrival a, -1 where
        GPU j sent none; made at the handle's first combine (and again for another gather block size)."""
        if h.forward_sum_rows is None or h.forward_sum_rows[0] != rows_per_block:
            # one launch (A <= rows_per_block: the combine's shape checked that every forwarder's arrivals fit its
            # gather block); as torch ops it took four, ~150 us of host time before the push (session 43)
            table = torch.empty((self.G, A), dtype=torch.int32, device=self.device)
            self._k.forward_sum_rows(table.data_ptr(), self.G, A, rows_per_block, h.fwd_dest_rows.data_ptr(),
                                     self._stream())
            h.forward_sum_rows = (rows_per_block, table)
        return h.forward_sum_rows[1]

    def _node_sums(self, x: torch.Tensor, sum_rows: torch.Tensor, zero: torch.Tensor, A: int, pay: int, kw: int,
                   cstride: int, gbase: int, c_send: int, c_recv: int, back_offs: List[int], own_first: int,
                   own: int) -> None:
        """The forwarder's node sums once every copy is in its gather blocks: each arrival's copies added in fp32 in
        ascending local rank and rounded once to x's dtype, straight into its send record (payload, then the fp32
        weights) in one kernel; then our own node's node sums from the send area to where the source's sum reads
        them."""
        self._k.sum_node_partials(self._cx.rdma_ptr + c_send, self._cx.rdma_ptr + c_send + pay if kw else 0,
                                  self._cx.nvl_ptr + gbase, cstride, sum_rows.data_ptr(), zero.data_ptr(), self.G, A,
                                  pay, kw, x.dtype == torch.float32, self._stream(), out_x_stride=cstride,
                                  out_w_stride=cstride)
        if own:
            dst, src = c_recv + back_offs[self.node], c_send + own_first * cstride
            self._rdma[dst:dst + own * cstride].copy_(self._rdma[src:src + own * cstride])

    def _gather_in_tiles(self, h: InternodeHandle, shape: CombineShape, rows: torch.Tensor,
                         w: Optional[torch.Tensor], nrecv: int, pay: int, kw: int, cstride: int,
                         block: int) -> Tuple[int, int]:
        """The local side of the pipelined combine gather (docs/internode.md, "Pipelined combine gather"): our rows
        (and fp32 weights) to each forwarder's gather block for us, in its arrival order, a tile at a time, each tile
        then flagged in the forwarder's NVL region. Returns (the epoch the flags are raised to, arrivals per tile),
        which every rank of the node derives alike from the counts and its count of combines."""
        G = self.G
        self._gather_epoch = self._next_epoch(self._gather_epoch, "UCCL_EP_PIPELINED_COMBINE_GATHER")
        if shape.gather_tiles is None or shape.gather_tiles[0] != cstride:
            arrivals = [h.counts.totals(G).arrivals[self.node * G + f] for f in range(G)]
            at = [self.peer_nvl[f] + self.half_nvl + self.local * block for f in range(G)]
            flags = [self.peer_nvl[f] + self._flag_base + 4 * self.local * GATHER_MAX_TILES for f in range(G)]
            # each forwarder's arrivals from our own node, which its pack sums last: our copies go in its order
            by_node = [recv_counts(h.counts, self.node * G + f, G) for f in range(G)]
            own_first = [sum(n[:self.node]) for n in by_node]
            own_end = [first + n[self.node] for first, n in zip(own_first, by_node)]
            shape.gather_tiles = (cstride, self._upload([at, flags, arrivals, own_first, own_end]),
                                  gather_tile_rows(arrivals), max(max(arrivals), 1))
        _, table, tile, width = shape.gather_tiles
        by_arrival = h.gather_by_arrival
        if by_arrival is None:  # our row of each forwarder's arrival, -1 where it is another GPU's: one upload and
            # one call (torch took ~7 launches, ~200 us of host time before the push at 2 x 2: session 43)
            by_arrival = h.gather_by_arrival = torch.empty((G, width), dtype=torch.int32, device=self.device)
            ends = self._upload(recv_row_ends(h.counts, self.rank)) if nrecv else None
            self._k.gather_rows_by_arrival(
                by_arrival.data_ptr(), G, width, ends.data_ptr() if nrecv else 0, self.R,
                h.recv_arrival.data_ptr() if nrecv else 0, nrecv, self._stream(), err=self._cx.error_word_ptr,
                stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, rank=self.rank,
                phase=self._phases["combine_gather"])
        stream = self._stream()
        if self.gather_beside_push:  # beside our node sum and push (_node_sum_push), after everything before it
            self._cx.stream_wait(self._cx.side_stream, stream)
            stream, self._gather_to_join = self._cx.side_stream, True
            self.gathers_beside_push += 1
        self._k.gather_tiles(table[0].data_ptr(), table[1].data_ptr(), G, by_arrival.data_ptr(), by_arrival.size(1),
                             table[2].data_ptr(), tile, rows.data_ptr() if nrecv else 0, pay,
                             w.data_ptr() if kw and nrecv else 0, kw, nrecv, cstride, self._gather_epoch,
                             stream, err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                             stop_generation=self._cx.stop_generation, rank=self.rank,
                             phase=self._phases["combine_gather"], blocks=self.gather_blocks,
                             own_ranges=table[3].data_ptr())
        return self._gather_epoch, tile

    def _combine_shape(self, counts: Counts, cstride: int) -> CombineShape:
        """The CombineShape of a handle with these counts for wire rows of ``cstride`` bytes, after checking that
        every rank's areas hold them (the same answer on every rank: the counts are the same)."""
        G = self.G
        tot = counts.totals(G)
        check_area("combine gather (NVL, per local rank)", tot.arrivals, cstride, self.gather_block, "num_nvl_bytes")
        check_area("combine (RDMA)", tot.arrivals, cstride, self.half_rdma, "num_rdma_bytes")
        check_area("combine (RDMA)", tot.sends, cstride, self.half_rdma, "num_rdma_bytes")
        recv_by_node = recv_counts(counts, self.rank, G)
        return CombineShape(recv_by_node, combine_areas(counts, G, cstride, self.half_rdma),
                            combine_nvlink_rows(counts, self.rank, G),
                            sum(c for n, c in enumerate(recv_by_node) if n != self.node))

    def _gather_rows(self, rows: torch.Tensor, w: Optional[torch.Tensor], lo: int, hi: int, dst_off: int,
                     cstride: int) -> None:
        """Rows [lo, hi) of the combine input (and of its fp32 weights) into consecutive wire rows of ``cstride``
        bytes at ``dst_off`` of our RDMA region: payload first, weights behind it."""
        n = hi - lo
        if n <= 0:
            return
        pay = rows.size(1) * rows.element_size()
        parts = [(rows, pay, 0)] + ([(w, 4 * w.size(1), pay)] if w is not None and w.size(1) else [])
        for src, nbytes, off in parts:
            self._scatter(self._cx.rdma_ptr + dst_off + off, cstride, 0, src.data_ptr() + lo * nbytes, nbytes, 0, n,
                          nbytes, n, "combine_gather")

    def _cached_dispatch_needs_barrier(self, h: InternodeHandle, cols: List[torch.Tensor]) -> bool:
        """Unless the last call was a combine whose traffic proves what the barrier would (docs/internode.md, "Areas
        and entry barriers"). UCCL_EP_SKIP_DISPATCH_BARRIER=0 keeps the barrier always. The answer for the same
        combine (the same counts and areas objects, held by the memo so that they stay the same) and record size is
        kept on the handle."""
        if self._last_combine is None or not self.skip_dispatch_barrier:
            return True
        stride = _record_layout(tuple(_row_bytes(c) for c in cols), self.G).stride
        counts, areas = self._last_combine
        memo = h.skip_decision
        if memo is not None and memo[0] is counts and memo[1] is areas and memo[2] == stride:
            return not memo[3]
        skip = dispatch_may_skip_entry_barrier(h.counts, counts, areas, self.G, stride, self.half_rdma)
        h.skip_decision = (counts, areas, stride, skip)
        return not skip

    def _combine_needs_barrier(self, areas: CombineAreas) -> bool:
        """Whether a rank may still use what this combine writes. Without a group sync since the last combine (two
        combines in a row), a peer may still read its received partial sums, or our proxy still send ours. After one
        (every dispatch starts with notify or a barrier, each pushed behind everything earlier on its rank's stream)
        only the last dispatch can still be in use -- its arrivals read in place, its records on the wire -- and the
        combine keeps clear of both while its rows fit above them on every rank (combine_overlaps_dispatch)."""
        return (not self._synced_since_combine or self._last_dispatch_extents is None
                or combine_overlaps_dispatch(areas, self._last_dispatch_extents, self.half_rdma))

    def _traffic_forward(self, h: InternodeHandle, row_bytes: int):
        from uccl_ep_train.reference import TrafficReport

        if h.dispatch_rows is None:  # from the counts alone: the same in every dispatch with this handle
            h.dispatch_rows = (dispatch_nvlink_rows(h.counts, self.rank, self.G),
                               sum(c for m, c in enumerate(h.plan.node_send) if m != self.node))
        nvlink, network = h.dispatch_rows
        return TrafficReport(nvlink * row_bytes, network * row_bytes, h.num_recv_tokens * row_bytes)

    # ---------------------------------------------------------------- stats / teardown
    def proxy_stats(self) -> dict:
        return dict(self._cx.proxy_totals())

    def upload_counts(self) -> Optional[dict]:
        """Benchmarks: the small tables uploaded through the pinned staging area since setup, and those that fell back
        to a pageable copy (upload_staging.py); None without the area (the CPU stand-in, UCCL_EP_PINNED_UPLOADS=0)."""
        if self._staging is None:
            return None
        return {"staged": self._staging.staged, "fallbacks": self._staging.fallbacks}

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._deferred_dispatch = None  # (its reader ends with its arrivals: the drain below waits for it)
        try:
            self._drain("destroy")  # bounded: no kernel may still use the regions when they are freed
            # A call returns once *its incoming* data arrived; its own outgoing writes (e.g. the last combine chunks
            # to a slower peer) may still be queued or in flight in our proxy. Stopping the proxy now would drop
            # them, and the peer -- which sees a clean close, not an error -- would wait until its GPU deadline with
            # all but the last chunk(s) of a lane (the intermittent 2 x 2 reorder + cap-1 failure). Deliver first.
            if not self._cx.proxy_error():
                try:
                    self._cx.proxy_wait_idle(self.cpu_timeout)
                except Exception as exc:  # noqa: BLE001 - teardown: report, then free anyway
                    print(f"uccl-ep: rank {self.rank}: destroy: the proxy did not deliver every write within "
                          f"{self.cpu_timeout:.0f} s (peers waiting for them will time out): {exc}", file=sys.stderr)
        except InternodeError as exc:
            # _check clears the error word when it raises, so what is found here no call has reported (e.g. a wait
            # of the last call that failed after the call returned), or it is the proxy's standing error. Say it.
            print(f"uccl-ep: rank {self.rank}: destroy found an error: {exc}", file=sys.stderr)
        finally:
            self._cx.destroy()
            if self._copy_agent is not None:  # (after the endpoints, which wait for their copies)
                self._copy_agent.close()


@functools.lru_cache(maxsize=64)
def _record_layout(column_bytes: Tuple[int, ...], ranks_per_node: int) -> RecordLayout:
    """record_layout, kept: every cached dispatch asks it for the same few column widths."""
    return record_layout(column_bytes, ranks_per_node)


def _column_args(rows: List[torch.Tensor], layout: RecordLayout) -> List[Tuple[int, int, int]]:
    """The columns (contiguous byte rows, _dense) as the record kernels take them: (rows, row bytes, offset in the
    record), empty columns left out."""
    return [(r.data_ptr(), nb, off) for r, nb, off in zip(rows, layout.column_bytes, layout.column_offsets) if nb]


def _record_columns(final: torch.Tensor, layout: RecordLayout, n: int) -> List[Tuple[int, int]]:
    """The first n columns of the records in ``final`` (the final rows: [rows, bytes], the record stride with one GPU
    per node, the shorter final row with several), as (first row's address, row stride in bytes)."""
    stride = final.stride(0) * final.element_size()
    return [(final.data_ptr() + layout.column_offsets[i], stride) for i in range(n)]


def _aligned_counts(raw: torch.Tensor, alignment: int) -> torch.Tensor:
    """Counts per expert rounded up to ``alignment``, as int32 (device ops: nothing is read back)."""
    raw = raw.to(torch.int64)
    return ((raw + alignment - 1) // alignment * alignment).to(torch.int32)


def _upload_values(values: Any, dtype: Any, device: torch.device) -> torch.Tensor:
    """Python ints (a list, or a list of equal rows) as a tensor on ``device``, without a stream sync: a pageable
    non-blocking copy is staged by the driver at once, so the host memory may go right away (a blocking .to()
    synchronizes the stream). Built through numpy: torch.tensor on a list costs 2-4x the host time."""
    return torch.from_numpy(np.asarray(values, dtype=dtype)).to(device, non_blocking=True)


def _address(t: Optional[torch.Tensor]) -> int:
    """A tensor's device address for a native call, 0 for none."""
    return t.data_ptr() if t is not None else 0


def _chain(*steps: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """The steps given (not None), one after the other, as one step; None when none is given."""
    given = [s for s in steps if s is not None]

    def run() -> None:
        for step in given:
            step()

    return run if given else None


def _ranges_around(first: int, count: int, total: int) -> List[Tuple[int, int]]:
    """The non-empty ranges of [0, total) before and after [first, first + count): the other nodes' rows around our
    own node's block, in a list that runs by node."""
    return [r for r in ((0, first), (first + count, total)) if r[1] > r[0]]


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype``, with no torch call when it is one already: each no-op ``.to()``,
    ``.contiguous()`` or byte view cost ~3-13 us of host time on a lent host whose proxies keep the driver busy
    (session 17 profile), and a dispatch made a dozen of them before its wire could start. The kernels take a
    column's rows as its address and row bytes (_row_bytes), so a byte view (_bytes_of) is not needed."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _row_bytes(t: torch.Tensor) -> int:
    """The bytes of one row of ``t`` as _bytes_of lays it out, without making the view."""
    return t.element_size() * math.prod(t.shape[1:])


def _empty_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised output of ``rows`` rows shaped and typed like ``like``'s rows."""
    return torch.empty((rows,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
