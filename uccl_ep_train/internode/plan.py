"""Planning of the internode path (pure: torch only, any device). docs/internode.md.

Everything the hierarchical dispatch/combine needs to agree on before a byte moves, derived identically on every rank
from the notify counts: the wire record layout, who sends how many records to which node, the offsets of every block
at its destination, the push tables the ``push_chunks`` kernel turns into WRITE_SIGNAL commands, the counter targets
each rank waits for, and the limits of the command format. tests/internode/test_internode_planning.py executes these
plans with a byte-level simulator of the proxies and NVLink against reference.py on CPU; the backend that runs them
on GPUs is uccl_ep_train/internode/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from uccl_ep_train.backends import check_combine_element_size


#: Command-format limits (csrc/include/uccl_ep/command.hpp); mirrored here so planning can check without _C.
CMD_UNIT = 16
CMD_MAX_RANKS = 1 << 12
CMD_MAX_SLOTS = (1 << 14) - 1
CMD_MAX_VALUE = (1 << 18) - 1
CMD_MAX_BYTES = ((1 << 24) - 1) * CMD_UNIT
CMD_MAX_REGION = (1 << 28) * CMD_UNIT  # 28-bit offsets in 16-byte units: 4 GiB
SLOT_PAGE = 512  # signal counters are registered for the GPU in whole pages (512 x int64)



class InternodeError(RuntimeError):
    """A failure of the internode path; the message names the rank, what was awaited and the value expected."""




def _align(n: int, a: int = CMD_UNIT) -> int:
    return (n + a - 1) // a * a



@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one wire record: payload columns, then src_idx, arrival and dest_row[G] (all int32)."""

    column_offsets: Tuple[int, ...]
    column_bytes: Tuple[int, ...]
    src_idx_offset: int
    arrival_offset: int
    dest_rows_offset: int
    final_bytes: int  # prefix written into a destination's final row (through `arrival`), multiple of 16
    stride: int  # wire record, multiple of 16


def record_layout(column_bytes: Sequence[int], ranks_per_node: int) -> RecordLayout:
    offsets, off = [], 0
    for nb in column_bytes:
        off = _align(off, 8)
        offsets.append(off)
        off += int(nb)
    off = _align(off, 8)
    src_idx_offset, arrival_offset = off, off + 4
    dest_rows_offset = off + 8
    return RecordLayout(tuple(offsets), tuple(int(b) for b in column_bytes), src_idx_offset, arrival_offset,
                        dest_rows_offset, _align(arrival_offset + 4), _align(dest_rows_offset + 4 * ranks_per_node))


def bytes_needed(num_tokens: int, hidden: int, num_topk: int, num_ranks: int, ranks_per_node: int,
                 element_size: int = 2, combine_element_size: int = 2) -> Tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) that the staged internode path needs for up to ``num_tokens`` tokens per rank
    under the worst routing (every token to every rank). The areas hold a whole call: RDMA halves for the records a
    rank sends (one per token and node) and receives (one per token of each source node) *and* the last combine's
    partial sums at their top, since a dispatch right after a combine packs its records during notify below those
    sums (a sync-free one that returns before the count read must, or it raises); NVL halves for the final rows (a
    token of every rank) and the combine gather (one block per local GPU), whichever row is wider, plus the notify
    rows. The price of staging: ring buffers with credits would need far less.

    ``element_size``: the dispatch payload's (2 for BF16; FP8 with its scales is narrower). ``combine_element_size``:
    the combine input's, whose rows cross in x's dtype (2 for BF16, 4 for float32). Until session 49 every combine
    was sized as float32 and the RDMA halves held the wider row only: that doubled the NVL region for BF16 steps and
    was short for float32 ones (records plus float32 sums). A combine wider than the hint raises InternodeError
    naming the setting, before any kernel."""
    check_combine_element_size(combine_element_size)
    G = ranks_per_node
    N = num_ranks // G
    # x, top-k ids, weights and (expert-major in the reader) the pairs' ranks; FP8 + scales is narrower
    record = record_layout([hidden * element_size, num_topk * 8, num_topk * 4, num_topk * 4], G)
    partial = _align(combine_element_size * hidden + 4 * num_topk)  # a combine wire row: payload, then fp32 weights
    notify = NOTIFY_AREAS * num_ranks * _align(8 * notify_row_words(num_ranks, N))
    rdma = 2 * N * num_tokens * (record.stride + partial) + notify
    final = 2 * num_ranks * num_tokens * max(record.final_bytes, partial)
    # (room for the ready words of UCCL_EP_UNPACK_BESIDE_FORWARD, which take ~1/512 of what lies below the flags)
    nvl = final + (_align(final // 511 + 8192, 4096) if G > 1 else 0) + node_flag_bytes(G)
    return _align(nvl, 4096), _align(rdma, 4096)


# The NVLink flags among a node's GPUs, at the end of each rank's NVL region: the pipelined combine gather's tile flags
# (csrc/kernels/internode.hpp, NodeSums; docs/internode.md, "Pipelined combine gather"), int32 [G][GATHER_MAX_TILES],
# a row per local GPU; then the dispatch forward's flags ("The dispatch forward's node barrier"), rows of the same
# width of which column 0 is used (wait_node_flags reads either block).
GATHER_MAX_TILES = 1024
GATHER_MIN_TILE_ROWS = 8  # a tile is a block's work, a row per warp: the fewer rows, the sooner its flag


def node_flag_bytes(ranks_per_node: int) -> int:
    """The NVL bytes the flags take (none with one GPU per node: nothing moves over NVLink)."""
    return _align(2 * 4 * ranks_per_node * GATHER_MAX_TILES, 4096) if ranks_per_node > 1 else 0


def ready_word_rows(flag_base: int, ranks_per_node: int, on: bool) -> int:
    """Final rows with a ready word (the unpack beside the dispatch forward): one per KiB of the final-row half of
    the NVL bytes below the flags (``flag_base``), so that rows of 1 KiB or more always have one; 0 when off or with
    one GPU per node."""
    return flag_base // 2048 if on and ranks_per_node > 1 else 0


def ready_word_bytes(rows: int) -> int:
    """NVL bytes the ready words of ``rows`` final rows take, below the flags."""
    return _align(4 * rows, 4096) if rows else 0


def gather_tile_rows(arrivals: Sequence[int]) -> int:
    """Arrivals per tile of the pipelined combine gather for forwarders with these arrivals (the node's: every GPU of
    the node computes the same from the same counts), so that each forwarder's tiles fit its GATHER_MAX_TILES flags."""
    return max(GATHER_MIN_TILE_ROWS, -(-max(arrivals, default=0) // GATHER_MAX_TILES))


def check_topology(num_ranks: int, ranks_per_node: int, num_lanes: int = 1) -> int:
    """Raise ValueError for a topology the command format cannot address; return the signal slots needed (two per
    node and lane: dispatch records and combine partial sums, one counter per proxy FIFO that carries them; plus the
    barrier and the notify counters)."""
    if ranks_per_node < 1 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the group size {num_ranks} "
                         "(UCCL_EP_RANKS_PER_NODE)")
    if num_ranks > CMD_MAX_RANKS:
        raise ValueError(f"{num_ranks} ranks exceed the command format's {CMD_MAX_RANKS} (12-bit destination rank)")
    if num_lanes < 1:
        raise ValueError(f"num_lanes={num_lanes} must be >= 1 (proxy FIFOs: UCCL_EP_NUM_PROXY_THREADS x "
                         "UCCL_EP_FIFOS_PER_THREAD)")
    num_nodes = num_ranks // ranks_per_node
    need = 2 * num_nodes * num_lanes + 2
    slots = _align(need, SLOT_PAGE)
    if slots > CMD_MAX_SLOTS:
        most = (CMD_MAX_SLOTS // SLOT_PAGE * SLOT_PAGE - 2) // (2 * num_lanes)
        raise ValueError(f"{num_nodes} nodes x {num_lanes} proxy FIFOs need {need} signal slots (two per node and "
                         f"FIFO, barrier, notify); the command format has {CMD_MAX_SLOTS}: at most {most} nodes "
                         f"with {num_lanes} FIFOs (fewer UCCL_EP_NUM_PROXY_THREADS / UCCL_EP_FIFOS_PER_THREAD allow "
                         "more nodes)")
    return slots


#: The notify row carries every source's tokens per expert for up to this many experts, so a receiver knows how many
#: (token, local expert) pairs it gets before any byte moves: the expert-aligned counts of a dispatch then need no
#: device read after the payload arrived. Beyond it the backend counts the received expert ids on the GPU (one sync).
NOTIFY_MAX_EXPERTS = 1024


def notify_row_words(num_ranks: int, num_nodes: int) -> int:
    """int64 words a notify row may use: per rank, per node, per expert at its cap."""
    return num_ranks + num_nodes + NOTIFY_MAX_EXPERTS


#: Notify areas in each RDMA region, taken in turns by the count exchanges through the proxies. A peer whose call
#: needs nothing more of ours (a dispatch that raised, or one followed by another uncached dispatch) may push its
#: next count row while our kernels still read this call's rows on the device; with one area it overwrote them (a
#: reader's gate then waited for records never sent: session 50). A peer is at most one exchange ahead -- its next
#: one needs our next row, which leaves behind everything we queued before -- so two areas suffice.
NOTIFY_AREAS = 2


def notify_area_turn(exchanges_before: int) -> int:
    """Which notify area a count exchange uses, given how many exchanges through the proxies came before it (the same
    on every rank: the exchange is collective)."""
    return exchanges_before % NOTIFY_AREAS


@dataclass
class Counts:
    """Notify's result, identical on every rank: rank_counts[s, d] tokens of s for rank d; node_counts[s, m] tokens
    of s that hit node m (each crosses to node m once); expert_counts[s, e] tokens of s routed to expert e (None
    when the rows did not carry it)."""

    rank_counts: torch.Tensor  # [R, R] int64, CPU
    node_counts: torch.Tensor  # [R, N] int64, CPU
    expert_counts: Optional[torch.Tensor] = None  # [R, E] int64, CPU
    # Per-rank totals derived once per Counts (every call with a handle reuses them): a Python loop over the ranks
    # that indexes these tensors costs ~1.5 ms per total at 8 nodes x 8 GPUs. They are summed through numpy views of
    # the tensors: a torch op on a tensor this small costs ~5-10 us of host time, a numpy one ~1-2, and an uncached
    # dispatch derives them between its push and the launch of the reader that must keep up with its wire.
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def recv_matrix(self, ranks_per_node: int) -> torch.Tensor:
        """[R, N]: records rank r receives as forwarder from source node n (from rank n * G + local(r)), for every
        r at once (``recv_counts`` of one rank is its row)."""
        key = ("recv", ranks_per_node)
        if key not in self._derived:
            R, N = self.node_counts.shape
            m = _host(self.node_counts).reshape(N, ranks_per_node, N).transpose(2, 1, 0).reshape(R, N)
            self._derived[key] = torch.from_numpy(np.ascontiguousarray(m))
        return self._derived[key]

    def final_rows(self) -> List[int]:
        """Final rows each rank receives (one per token routed to it)."""
        if "final" not in self._derived:
            self._derived["final"] = _host(self.rank_counts).sum(0).tolist()
        return self._derived["final"]

    def totals(self, ranks_per_node: int) -> "CountTotals":
        key = ("totals", ranks_per_node)
        if key not in self._derived:
            self._derived[key] = CountTotals(
                sends=_host(self.node_counts).sum(1).tolist(),
                arrivals=_host(self.recv_matrix(ranks_per_node)).sum(1).tolist(),
                final_rows=self.final_rows())
        return self._derived[key]


@dataclass(frozen=True)
class CountTotals:
    """Per rank r: records it sends (one per token and node it hits, own node included), records it receives as
    forwarder (its arrivals), and final rows it receives (one per token routed to it)."""

    sends: List[int]
    arrivals: List[int]
    final_rows: List[int]


def local_count_row(is_token_in_rank: torch.Tensor, ranks_per_node: int,
                    tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's contribution to notify: [tokens per destination rank (R) | tokens per destination node (N) |
    tokens per expert (E, when given: get_dispatch_layout's num_tokens_per_expert)]. Device ops only."""
    T, R = is_token_in_rank.shape
    per_rank = is_token_in_rank.sum(0)
    per_node = is_token_in_rank.view(T, R // ranks_per_node, ranks_per_node).any(2).sum(0)
    parts = [per_rank.to(torch.int64), per_node.to(torch.int64)]
    if tokens_per_expert is not None:
        parts.append(tokens_per_expert.to(device=per_rank.device, dtype=torch.int64))
    return torch.cat(parts)


def _host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU int64 count tensor (no copy): sums and lists of small counts for a fraction of torch's
    per-op host cost (Counts)."""
    return t.numpy() if t.device.type == "cpu" and t.dtype == torch.int64 else t.to(torch.int64).cpu().numpy()


def counts_from_rows(rows: torch.Tensor, num_ranks: int, num_nodes: Optional[int] = None, num_experts: int = 0
                     ) -> Counts:
    """Split the gathered notify rows [R, R + N (+ E)]; without ``num_nodes`` every column after the ranks' is a
    node, and without ``num_experts`` every column after the nodes' is an expert. Each part is a contiguous CPU int64
    tensor of its own (split through numpy: a third of torch's host time)."""
    a = _host(rows)
    R = num_ranks
    N = a.shape[1] - R if num_nodes is None else num_nodes
    E = num_experts or a.shape[1] - R - N
    part = lambda m: torch.from_numpy(np.ascontiguousarray(m))  # noqa: E731  (copies a strided slice, as .contiguous())
    experts = part(a[:, R + N:R + N + E]) if E > 0 else None
    return Counts(part(a[:, :R]), part(a[:, R:R + N]), experts)


def recv_expert_counts(counts: Counts, rank: int, experts_per_rank: int) -> List[int]:
    """(token, expert) pairs ``rank`` receives per local expert: what counting the received top-k ids would give, known
    from notify alone (every source's tokens per expert, summed over sources for this rank's experts)."""
    if counts.expert_counts is None:
        raise InternodeError("the notify rows carried no per-expert counts")
    lo = rank * experts_per_rank
    return _host(counts.expert_counts)[:, lo:lo + experts_per_rank].sum(0).tolist()


def expert_major_places(counts: Counts, rank: int, experts_per_rank: int, aligned: Sequence[int]) -> np.ndarray:
    """What the reader of an expert-major receive needs to place each arriving (token, local expert) pair from its
    record alone (csrc/kernels/expert_major_receive.hpp), int64, flat: the final row where each source's rows start
    ([R + 1], rows run by source rank, the last entry their end), then per (source s, local expert e) the
    expert-major row of s's first pair of e and how many pairs s sends e ([R, L, 2]). Expert e's segment starts at
    the sum of the aligned counts before it (``aligned``), and within it the sources follow each other in rank order,
    so a pair whose sender ranked it j-th among its pairs of e (pair_ranks) lands at that first row + j: the order of
    the reference's rank-major received rows."""
    lo = rank * experts_per_rank
    sent = _host(counts.expert_counts)[:, lo:lo + experts_per_rank]  # [R, L]: pairs of each source per local expert
    seg = np.cumsum(np.asarray([0] + list(aligned[:-1]), dtype=np.int64))
    first = seg[None, :] + np.cumsum(sent, 0) - sent
    rows = np.concatenate([[0], np.cumsum(_host(counts.rank_counts)[:, rank])])
    return np.concatenate([rows, np.stack([first, sent], -1).reshape(-1)]).astype(np.int64)


def recv_row_ends(counts: Counts, rank: int) -> List[int]:
    """Where each source rank's rows end among the rows ``rank`` receives (rows arrive in source-rank order,
    rank_counts[s, rank] from source s): the exclusive ends, one per source."""
    return np.cumsum(_host(counts.rank_counts)[:, rank]).tolist()


def source_local_of_rows(row_ends: torch.Tensor, num_rows: int, ranks_per_node: int) -> torch.Tensor:
    """int64 [num_rows] on ``row_ends``' device: the local index of each received row's source (its forwarder in
    combine, source s = n * G + local). ``row_ends``: recv_row_ends of the receiving rank on that device. Three
    device ops and no read of the device: a grouping per source cost ~15 torch ops and two pageable copies, ~0.5-0.9
    ms of a forward combine's host time at 2 nodes x 2 GPUs (session 42)."""
    rows = torch.arange(num_rows, dtype=torch.int64, device=row_ends.device)
    return torch.bucketize(rows, row_ends, right=True).remainder_(ranks_per_node)


@dataclass
class SendPlan:
    """What one rank sends in dispatch (and receives back in combine)."""

    hop1_token: torch.Tensor  # [S1] int64: token of each send record, by destination node then token
    node_send: List[int]  # records per destination node
    # [S1, G] int64: the token's row among our tokens for each GPU of the destination node, -1 = not needed; the
    # forwarder adds the rows of the ranks before us there (forward_block_bases), so no other rank's count is needed
    dest_rows: torch.Tensor
    dest_row_all: torch.Tensor  # [T, R] int64: row of the token among our tokens for every rank, -1 = not sent
    row_of: torch.Tensor  # [N, T] int32: index of record (token, node) in the send list, -1 = not sent to that node


def send_plan(is_token_in_rank: torch.Tensor, counts: Counts, rank: int, ranks_per_node: int) -> SendPlan:
    T, R = is_token_in_rank.shape
    G, N = ranks_per_node, R // ranks_per_node
    device = is_token_in_rank.device
    itr = is_token_in_rank.to(torch.bool)
    # the scan runs along the inner dimension: a cumsum over dim 0 of [T, R] scans each of the R columns serially
    # (385 us per dispatch at T = 4096, R = 2 on H200, session 7 profile); along dim 1 of the transpose it is a
    # parallel scan
    ordinal = itr.t().to(torch.int64).cumsum(1).t() - 1
    dest_row_all = torch.where(itr, ordinal, torch.full_like(ordinal, -1))
    node_hit = itr.view(T, N, G).any(2)
    # The counts (host) already say how many tokens go to each node: a nonzero of known size needs no device sync.
    node_send = [int(c) for c in counts.node_counts[rank].tolist()]
    hit = torch.nonzero_static(node_hit.t(), size=sum(node_send))
    hop1_node, hop1_token = hit[:, 0], hit[:, 1]
    dest_rows = dest_row_all.view(T, N, G)[hop1_token, hop1_node]
    # combine adds, per token, the partial sum of every node in node order: where each sits in the returned blocks
    row_of = torch.full((N, T), -1, dtype=torch.int32, device=device)
    row_of[hop1_node, hop1_token] = torch.arange(hop1_token.numel(), dtype=torch.int32, device=device)
    return SendPlan(hop1_token, node_send, dest_rows.reshape(-1, G), dest_row_all, row_of)


def recv_counts(counts: Counts, rank: int, ranks_per_node: int) -> List[int]:
    """Records arriving at ``rank`` (as forwarder) from each source node n: from rank n*G + local(rank)."""
    return _host(counts.recv_matrix(ranks_per_node))[rank].tolist()


def dispatch_nvlink_rows(counts: Counts, rank: int, ranks_per_node: int) -> int:
    """Rows ``rank`` forwards over NVLink in a dispatch: its arrivals (from the sources sharing its local index, its own
    tokens included) that another GPU of its node needs. From the counts, so the traffic report reads no device."""
    G = ranks_per_node
    node, local = divmod(rank, G)
    # the sources sharing our local index, to every GPU of our node, less what goes to us (through numpy: each torch
    # op on these small count tensors costs several times a numpy one, "Counts")
    block = _host(counts.rank_counts)[local::G, node * G:(node + 1) * G]
    return int(block.sum() - block[:, local].sum())


def combine_nvlink_rows(counts: Counts, rank: int, ranks_per_node: int) -> int:
    """Rows ``rank`` sends over NVLink in a combine: each received row goes back through the forwarder of its source
    (the GPU of this node with the source's local index), so every row whose source has another local index."""
    G = ranks_per_node
    to_us = _host(counts.rank_counts)[:, rank]
    return int(to_us.sum() - to_us[rank % G::G].sum())


def block_offsets(sizes: Sequence[int], stride: int) -> List[int]:
    out, off = [], 0
    for s in sizes:
        out.append(off)
        off += int(s) * stride
    return out


def remote_block_offset(counts: Counts, dst_rank: int, src_node: int, ranks_per_node: int, stride: int) -> int:
    """Byte offset of source node ``src_node``'s block inside ``dst_rank``'s receive area."""
    return block_offsets(recv_counts(counts, dst_rank, ranks_per_node), stride)[src_node]


def num_recv_rows(counts: Counts, rank: int) -> int:
    return counts.final_rows()[rank]


def chunk_records(stride: int, max_bytes: int) -> int:
    """Records per WRITE_SIGNAL: within the byte cap (at least one record), the 18-bit value and the byte field."""
    if stride % CMD_UNIT or stride > CMD_MAX_BYTES:
        raise InternodeError(f"a record of {stride} bytes must be a multiple of {CMD_UNIT} and at most "
                             f"{CMD_MAX_BYTES} (24-bit byte count of a command)")
    return max(1, min(min(max_bytes, CMD_MAX_BYTES) // stride, CMD_MAX_VALUE))


def chunk_bytes(max_inflight_bytes: int, write_bytes: Optional[int] = None) -> int:
    """Bytes per write: ``write_bytes`` when set (UCCL_EP_WRITE_BYTES), else a quarter of the proxy thread's in-flight
    byte cap, so several writes overlap (a chunk as large as the cap left exactly one write in flight: 12 GB/s on 2x
    H200). Caps below 256 KiB (Thor-2/Pollara style tuning, or tests with tiny chunks) are used whole."""
    if write_bytes is not None:
        return int(write_bytes)
    return max_inflight_bytes // 4 if max_inflight_bytes >= (256 << 10) else max_inflight_bytes


def chunk_lanes(records: int, per_chunk: int, hint: int, num_lanes: int) -> List[int]:
    """Records each lane (proxy FIFO) carries when a block of ``records`` is cut into chunks of ``per_chunk`` and chunk
    c goes to FIFO ``(hint + c) % num_lanes`` -- what the push_chunks kernel does. Sender and receiver both derive it
    from the counts, so the receiver knows what to wait for on every lane's counter without being told."""
    full, rest = divmod(int(records), per_chunk)
    rounds, extra = divmod(full, num_lanes)  # every lane carries `rounds` whole chunks, the first `extra` one more
    out = [(rounds + ((lane - hint) % num_lanes < extra)) * per_chunk for lane in range(num_lanes)]
    if rest:
        out[(hint + full) % num_lanes] += rest
    return out


def push_rows(node_send_or_recv: Sequence[int], rank: int, ranks_per_node: int, local_base: int,
              remote_offset_of, stride: int, slot_base: int, num_lanes: int = 1) -> List[List[int]]:
    """One push-table row per remote node with records (columns of _C.internode: dst, local off, remote off, stride,
    records, first slot, FIFO hint). ``remote_offset_of(dst_rank)`` returns the block's byte offset at the
    destination. The block's chunks are spread over every proxy FIFO (lane), chunk c through FIFO
    ``(hint + c) % num_lanes``, and the chunk taken by FIFO f adds to slot ``first slot + f``: each counter is fed by
    one FIFO, hence one proxy thread, which is what the ordering emulation of an unordered NIC needs (every increment
    of a slot in one sequence), while all proxy threads move one block's bytes at once. The hint is the destination
    node, so destinations start on different lanes."""
    G = ranks_per_node
    node, local = divmod(rank, G)
    rows = []
    offs = block_offsets(node_send_or_recv, stride)
    for m, count in enumerate(node_send_or_recv):
        if m == node or count == 0:
            continue
        dst = m * G + local
        rows.append([dst, local_base + offs[m], remote_offset_of(dst), stride, int(count),
                     (slot_base + node) * num_lanes, m])
    return rows


def split_push_head(rows: List[List[int]], local_base: int, per_chunk: int, head_fraction: int = 16
                    ) -> Tuple[int, int, List[List[int]], List[List[int]]]:
    """Cut a push table so that the wire starts before the rest of the records is written: the head is the first
    ``1/head_fraction`` of the first block's chunks (at least one), the tail the rest of that block and every other
    block. Returns (first record of the head, records in it, head rows, tail rows), the records counted in the send
    area from ``local_base``; (0, 0, [], rows) when the first block has a single chunk. Pushed head first, the two
    tables make exactly the writes of ``rows`` -- the same chunks, each through the same lane, in the same order on
    every lane -- because the head is a whole number of chunks and the tail's first row starts its lanes where the
    head stopped (hint advanced by the head's chunks): receivers wait and gate exactly as for ``rows``."""
    if not rows:
        return 0, 0, [], rows
    dst, local, remote, stride, records, slot, hint = rows[0]
    chunks = -(-records // per_chunk)
    head_chunks = max(1, chunks // head_fraction)
    if chunks <= head_chunks:
        return 0, 0, [], rows
    n = head_chunks * per_chunk
    head = [[dst, local, remote, stride, n, slot, hint]]
    tail = [[dst, local + n * stride, remote + n * stride, stride, records - n, slot, hint + head_chunks]] + rows[1:]
    return (local - local_base) // stride, n, head, tail


def push_writes(rows: Sequence[Sequence[int]], per_chunk: int, num_lanes: int) -> List[Tuple[int, ...]]:
    """The writes the push_chunks kernel makes of a table, in push order: (lane, dst, bytes, local offset, remote
    offset, slot, records) -- the kernel's loop, for tests and tools."""
    out = []
    for dst, local, remote, stride, records, slot, hint in rows:
        for c, first in enumerate(range(0, records, per_chunk)):
            lane = (hint + c) % num_lanes
            n = min(per_chunk, records - first)
            out.append((lane, dst, n * stride, local + first * stride, remote + first * stride, slot + lane, n))
    return out


def dispatch_push_rows(counts: Counts, plan: SendPlan, rank: int, ranks_per_node: int, stride: int,
                       recv_base: int, num_lanes: int = 1) -> List[List[int]]:
    """Hop 1 of dispatch: our block for node m goes to rank m*G + local, into the block of our node there."""
    node = rank // ranks_per_node
    return push_rows(plan.node_send, rank, ranks_per_node, 0,
                     lambda d: recv_base + remote_block_offset(counts, d, node, ranks_per_node, stride), stride, 0,
                     num_lanes)


def dispatch_push_rows_before_counts(rank: int, ranks_per_node: int, num_nodes: int, stride: int, recv_base: int,
                                     num_lanes: int = 1) -> List[List[int]]:
    """The rows of dispatch_push_rows made before any count is read, not even our own: a row for every other node,
    its records 0 and its block at the start of our send area, aimed at the start of the destination's receive
    area. push_after_counts with a send limit gives each row its records and block from our own count row
    (rows_from_own_row), then moves it to its place (place_blocks). The same on every call of a record size."""
    return [[dst, 0, remote, stride, 0, slot, hint] for dst, _, remote, stride, _, slot, hint in
            push_rows([1] * num_nodes, rank, ranks_per_node, 0, lambda d: recv_base, stride, 0, num_lanes)]


def rows_from_own_row(node_send: Sequence[int], rows: List[List[int]], ranks_per_node: int, send_limit: int
                      ) -> List[List[int]]:
    """What push_after_counts makes of dispatch_push_rows_before_counts' rows from our own tokens per node
    (``node_send``, our count row's node columns) before it places the blocks: each row gets its node's records and
    its block in our send area (records by node, as send_plan lists them); rows without records push nothing. When
    all our records together pass ``send_limit`` bytes nothing is pushed: pack_records, counting on the device, packed
    none of them by the same rule."""
    if not rows or sum(node_send) * rows[0][3] > send_limit:
        return []
    out = []
    for dst, local, remote, stride, _, slot, hint in rows:
        m = dst // ranks_per_node
        if node_send[m]:
            out.append([dst, local + sum(node_send[:m]) * stride, remote, stride, int(node_send[m]), slot, hint])
    return out


def place_blocks(count_rows: torch.Tensor, rows: List[List[int]], rank: int, ranks_per_node: int,
                 receive_bytes: int) -> List[List[int]]:
    """What push_after_counts pushes, once every rank's count row (``count_rows`` [R, >= R + N]: column R + m of rank
    n * G + local holds node n's tokens for node m) is in: each row of rows_from_own_row with its
    remote offset moved past the records the source nodes before ours send its destination -- dispatch_push_rows'
    offsets. A destination whose arrivals (every source node's records for it) exceed ``receive_bytes`` is left out:
    every rank raises from the same counts after notify (the dispatch's area check), and no write overruns the area."""
    G = ranks_per_node
    R = count_rows.size(0)
    node = rank // G
    out = []
    for row in rows:
        dst, stride = int(row[0]), int(row[3])
        m, local = divmod(dst, G)
        per_source = [int(count_rows[n * G + local, R + m]) for n in range(R // G)]
        if sum(per_source) * stride > receive_bytes:
            continue
        out.append([row[0], row[1], row[2] + sum(per_source[:node]) * stride] + list(row[3:]))
    return out


def lane_waits(blocks: Sequence[Tuple[int, int]], per_chunk: int, hint: int, num_lanes: int
               ) -> List[Tuple[int, int]]:
    """(slot, records) per lane for blocks given as (first slot, records) that were pushed with FIFO hint ``hint``."""
    out = []
    for first, records in blocks:
        out += [(first + f, c) for f, c in enumerate(chunk_lanes(records, per_chunk, hint, num_lanes)) if c]
    return out


def dispatch_waits(counts: Counts, rank: int, ranks_per_node: int, per_chunk: int = CMD_MAX_VALUE,
                   num_lanes: int = 1) -> List[Tuple[int, int]]:
    """(slot, records) the forwarder waits for: slot n * L + f counts the records from node n that came through the
    sender's FIFO f (the sender's hint was our node)."""
    blocks = dispatch_gate_blocks(counts, rank, ranks_per_node, num_lanes)
    return lane_waits([(slot, c) for _, c, slot in blocks], per_chunk, rank // ranks_per_node, num_lanes)


#: Fixed columns of a gate-table row (csrc/kernels/arrival_gate.hpp): first row, records, lane 0's counter, FIFO
#: hint; then one counter base per lane.
GATE_FIXED_COLUMNS = 4


def dispatch_gate_blocks(counts: Counts, rank: int, ranks_per_node: int, num_lanes: int = 1
                         ) -> List[Tuple[int, int, int]]:
    """(first row, records, lane 0's counter) of each block of a dispatch's arrivals that crosses the network, in the
    row space of the receive area (blocks by source node, back to back): what dispatch_waits waits for, row by row."""
    node = rank // ranks_per_node
    recv = recv_counts(counts, rank, ranks_per_node)
    first = [sum(recv[:n]) for n in range(len(recv))]
    return [(first[n], c, n * num_lanes) for n, c in enumerate(recv) if n != node and c]


def combine_gate_blocks(counts: Counts, rank: int, ranks_per_node: int, num_lanes: int = 1
                        ) -> List[Tuple[int, int, int]]:
    """The same for a combine's partial sums at their source, in the row space of its receive area (blocks by
    forwarder node, each as long as what we sent that node): what combine_waits waits for, row by row."""
    node = rank // ranks_per_node
    num_nodes = counts.node_counts.size(1)
    back = [int(c) for c in counts.node_counts[rank].tolist()]
    first = [sum(back[:m]) for m in range(num_nodes)]
    return [(first[m], c, (num_nodes + m) * num_lanes) for m, c in enumerate(back) if m != node and c]


def gate_rows(blocks: Sequence[Tuple[int, int, int]], hint: int, num_lanes: int, counter_before: Sequence[int]
              ) -> List[List[int]]:
    """The gate table (device int64 [blocks][GATE_FIXED_COLUMNS + lanes]) for blocks from *_gate_blocks that the
    senders pushed with FIFO hint ``hint`` (our node); ``counter_before``: every counter's target before this call
    (the counters are monotone across calls)."""
    return [[first, records, slot, hint] + [int(counter_before[slot + f]) for f in range(num_lanes)]
            for first, records, slot in blocks]


def gate_threshold(row: int, table: Sequence[Sequence[int]], per_chunk: int, num_lanes: int
                   ) -> Optional[Tuple[int, int]]:
    """(counter, value) after which ``row`` has landed; None when no block holds it (our own node's rows, copied
    locally). Chunk c of a block goes through lane (hint + c) % lanes, whose counter moves in lane order, and the
    chunks before c on that lane are whole: so the counter has passed base + (c // lanes) * per_chunk + (records of
    chunk c) exactly when chunk c and every earlier chunk of its lane have landed. The gated kernels
    (csrc/kernels/arrival_gate.cuh) compute the same."""
    for first, records, slot, hint, *base in table:
        if first <= row < first + records:
            c = (row - first) // per_chunk
            lane = (hint + c) % num_lanes
            return slot + lane, _chunk_threshold(base[lane], c, records, per_chunk, num_lanes)
    return None


def _chunk_threshold(base: int, chunk: int, records: int, per_chunk: int, num_lanes: int) -> int:
    """The lane counter's value once chunk ``chunk`` of a block of ``records`` has landed (see gate_threshold)."""
    return base + (chunk // num_lanes) * per_chunk + min(per_chunk, records - chunk * per_chunk)


def gate_lane_target(row: Sequence[int], lane: int, per_chunk: int, num_lanes: int) -> Optional[int]:
    """The counter value at which ``lane`` has carried every chunk of the block of gate-table ``row`` (the threshold of
    its last chunk there), None when no chunk of the block goes through it: where a gated launch's watcher stops
    (gate_watch in csrc/kernels/arrival_gate.cuh)."""
    first, records, _, hint, *base = row
    chunks = -(-records // per_chunk)
    c0 = (lane - hint) % num_lanes
    if c0 >= chunks:
        return None
    return _chunk_threshold(base[lane], c0 + (chunks - 1 - c0) // num_lanes * num_lanes, records, per_chunk, num_lanes)


#: The words of a dispatch reader launched before the host read the counts (csrc/kernels/internode_plan.hpp, ReadDim):
#: go, arrival rows, our own block's first row, gate rows, our own records' first index in our send list and count.
READ_GO, READ_ROWS, READ_FIRST_ROW, READ_BLOCKS, READ_OWN_FIRST, READ_OWN_COUNT = range(6)
READ_DIMS = 8


def read_before_counts(rank_counts: torch.Tensor, node_counts: torch.Tensor, rank: int, num_lanes: int,
                       counter_before: Sequence[int], stride: int, send_limit: int, receive_bytes: int,
                       capacity_rows: int) -> Tuple[List[List[int]], List[int]]:
    """One GPU per node: what a dispatch's reader launched before the host read the count matrix takes from the count
    rows on the device (the gate_from_count_rows kernel; docs/internode.md, "Reading before the count read"):
    (its gate table, as gate_rows makes it from dispatch_gate_blocks, and its READ_DIMS words). It reads only when
    our records were packed during notify (they fit ``send_limit`` bytes), our arrivals were pushed (they fit
    ``receive_bytes``) and they fit the ``capacity_rows`` rows of the outputs allocated before the counts were known:
    the host applies this same rule to the same counts after notify, so it knows whether the reader read."""
    rc, nc = _host(rank_counts), _host(node_counts)
    R = rc.shape[0]
    recv = [int(v) for v in rc[:, rank]]  # blocks by source rank, back to back
    first = [sum(recv[:s]) for s in range(R)]
    own_send = [int(v) for v in nc[rank]]  # our records by node, in send-list order
    n, sent = sum(recv), sum(own_send)
    table = gate_rows([(first[s], c, s * num_lanes) for s, c in enumerate(recv) if s != rank and c], rank,
                      num_lanes, counter_before)
    go = sent * stride <= send_limit and n * stride <= receive_bytes and n <= capacity_rows
    dims = [int(go), n, first[rank], len(table), sum(own_send[:rank]), own_send[rank]] + [0] * (READ_DIMS - 6)
    return table, dims


#: Words of a forward launched before the count read (several GPUs per node): the forward's READ_DIMS words, then the
#: unpack's (go and rows; the rest 0), which read_before_counts' readers take as they are.
FORWARD_DIMS = 2 * READ_DIMS


def forward_before_counts(rank_counts: torch.Tensor, node_counts: torch.Tensor, rank: int, ranks_per_node: int,
                          num_lanes: int, counter_before: Sequence[int], stride: int, final_bytes: int,
                          send_limit: int, receive_bytes: int, final_limit: int, capacity_rows: int,
                          ready_rows: int = 0) -> Tuple[List[List[int]], List[List[int]], List[int], List[int]]:
    """Several GPUs per node: what a forward dispatch's forwarder launched before the host read the count matrix takes
    from the count rows on the device (the forward_from_count_rows kernel; docs/internode.md, "The forward before the
    count read"): (its arrivals' gate table, as gate_rows makes it from dispatch_gate_blocks; the forward's block table
    as forward_block_bases makes it; each local GPU's final rows; FORWARD_DIMS words). The words are the forward's
    (go, our arrivals, our own node's block's first row, gate rows, our own records' first index and count in our send
    list), then the unpack's (go, our final rows). The forward goes when our records were packed and pushed during
    notify (they fit ``send_limit`` bytes: a record left for the host to push would queue behind our spinning forward),
    our arrivals fit ``receive_bytes`` and every local GPU's final rows fit ``final_limit`` bytes of ``final_bytes``
    each; the unpack when the forward goes, our final rows fit the ``capacity_rows`` outputs allocated before the
    counts and, with ``ready_rows`` (the unpack beside the forward reads each final row once its ready word is
    released; the words cover that many rows, 0: none are used), every final row of our node has a word. The host
    applies this same rule to the same counts after notify."""
    rc, nc = _host(rank_counts), _host(node_counts)
    G = ranks_per_node
    R = rc.shape[0]
    N = R // G
    node, local = divmod(rank, G)
    recv = [int(nc[n * G + local, node]) for n in range(N)]  # our arrivals by source node (recv_counts)
    first = [sum(recv[:n]) for n in range(N)]
    A = sum(recv)
    table = gate_rows([(first[n], c, n * num_lanes) for n, c in enumerate(recv) if n != node and c], node,
                      num_lanes, counter_before)
    to_here = np.asarray(rc[:, node * G:(node + 1) * G], dtype=np.int64)
    before = np.cumsum(to_here, axis=0) - to_here
    blocks = [[first[n] + recv[n]] + [int(v) for v in before[n * G + local]] for n in range(N)]
    limits = [int(v) for v in to_here.sum(0)]
    own_send = [int(v) for v in nc[rank]]
    go = (sum(own_send) * stride <= send_limit and A * stride <= receive_bytes
          and all(v * final_bytes <= final_limit for v in limits))
    words = [int(go), A, first[node], len(table), sum(own_send[:node]), own_send[node]] + [0] * (READ_DIMS - 6)
    marked = not ready_rows or max(limits) <= ready_rows
    words += [int(go and limits[local] <= capacity_rows and marked), limits[local]] + [0] * (READ_DIMS - 2)
    return table, blocks, limits, words


@dataclass(frozen=True)
class CombineAreas:
    """Where one combine's partial sums sit in every rank's RDMA region (byte offsets, per rank): the rows a rank
    sends end at the top of its send half, the rows it gets back end at the top of its receive half. Dispatch fills
    both halves from the bottom, so while a combine's rows stay above the last dispatch's, the combine writes nothing
    that a rank may still be reading from that dispatch (combine_overlaps_dispatch): that is what lets a combine
    right after a dispatch skip its entry barrier."""

    send_base: List[int]
    recv_base: List[int]


def combine_areas(counts: Counts, ranks_per_node: int, cstride: int, half: int) -> CombineAreas:
    """Every rank sends one partial sum per arrival (its receive counts) and gets one back per record it sent."""
    t = counts.totals(ranks_per_node)  # a rank sends a partial per arrival and gets one back per record it sent
    return CombineAreas([half - a * cstride for a in t.arrivals], [2 * half - b * cstride for b in t.sends])


def dispatch_extents(counts: Counts, ranks_per_node: int, stride: int) -> Tuple[List[int], List[int]]:
    """Bytes a dispatch fills from the bottom of every rank's send half (its records, own node's block included in
    the layout) and receive half (its arrivals)."""
    t = counts.totals(ranks_per_node)
    return [b * stride for b in t.sends], [a * stride for a in t.arrivals]


def combine_overlaps_dispatch(areas: CombineAreas, extents: Tuple[List[int], List[int]], half: int) -> bool:
    """Whether, on some rank, the combine's rows reach down into what the dispatch filled (then the combine needs its
    entry barrier). The same answer on every rank: it depends on the counts only."""
    send_d, recv_d = extents
    return any(send_d[r] > areas.send_base[r] or half + recv_d[r] > areas.recv_base[r] for r in range(len(send_d)))


def sends_to_every_node(counts: Counts, ranks_per_node: int) -> bool:
    """Whether every rank sent at least one record to every other node (then every rank hears from every other node
    in each hop of the call: what lets a later call use that traffic as proof of the peers' progress)."""
    key = ("sends_to_every_node", ranks_per_node)  # asked by every cached dispatch after a combine: made once
    if key not in counts._derived:
        counts._derived[key] = all(c > 0 for r, row in enumerate(counts.node_counts.tolist()) for m, c in enumerate(row)
                                   if m != r // ranks_per_node)
    return counts._derived[key]


def dispatch_may_skip_entry_barrier(dispatch_counts: Counts, combine_counts: Counts, areas: CombineAreas,
                                    ranks_per_node: int, stride: int, half: int) -> bool:
    """Whether a cached dispatch that directly follows a combine may skip its entry barrier; the same answer on every
    rank (counts only). What the barrier would prove, the combine's traffic already does when every rank sent to
    every other node both in that combine's dispatch and in this one: each rank got partial sums from every other
    node, and a node pushes them only after it is done with that dispatch's arrivals (its unpack or forward comes
    first on its stream); its NVLink peers passed the combine's gather barrier after their own. The combine's own
    rows still in use -- partial sums being added at their source, ours still on the wire -- lie at the top of the
    halves, so this dispatch's rows must stay below them on every rank. After such a dispatch a combine may skip its
    barrier by the same rule as after a synced one: each source pushed this dispatch's records after its last
    combine's sum, and every rank hears from every node."""
    return (sends_to_every_node(dispatch_counts, ranks_per_node) and sends_to_every_node(combine_counts, ranks_per_node)
            and not combine_overlaps_dispatch(areas, dispatch_extents(dispatch_counts, ranks_per_node, stride), half))


def combine_push_rows(counts: Counts, rank: int, ranks_per_node: int, cstride: int, areas: CombineAreas,
                      num_lanes: int = 1) -> List[List[int]]:
    """Combine's network hop: the partial sums of the arrivals from node n go back to rank n*G + local, into the
    block of our node there (blocks at a source are ordered by forwarder node and sized by its own send counts)."""
    node = rank // ranks_per_node
    num_nodes = counts.node_counts.size(1)
    return push_rows(recv_counts(counts, rank, ranks_per_node), rank, ranks_per_node, areas.send_base[rank],
                     lambda d: areas.recv_base[d] + block_offsets(counts.node_counts[d].tolist(), cstride)[node],
                     cstride, num_nodes, num_lanes)


def combine_waits(counts: Counts, rank: int, ranks_per_node: int, per_chunk: int = CMD_MAX_VALUE,
                  num_lanes: int = 1) -> List[Tuple[int, int]]:
    """(slot, partial sums) the source waits for: slot (N + m) * L + f counts those from node m's forwarder that came
    through its FIFO f (the forwarder's hint was our node)."""
    blocks = combine_gate_blocks(counts, rank, ranks_per_node, num_lanes)
    return lane_waits([(slot, c) for _, c, slot in blocks], per_chunk, rank // ranks_per_node, num_lanes)


def slot_meaning(slot: int, rank: int, ranks_per_node: int, num_nodes: int, num_lanes: int = 1) -> str:
    """What a signal slot of ``rank`` counts and which rank's proxy feeds it (for error messages)."""
    G, N, L = ranks_per_node, num_nodes, num_lanes
    local = rank % G
    if slot == 2 * N * L:
        return (f"slot {slot} counts barrier arrivals: one zero-byte signal from every other rank per barrier, "
                f"through each rank's proxy FIFO 0")
    if slot == 2 * N * L + 1:
        return (f"slot {slot} counts notify rows: every other rank's token counts, one write per rank and dispatch, "
                f"through each rank's proxy FIFO 0")
    group, lane = divmod(slot, L)
    via = f" through its FIFO {lane}" if L > 1 else ""
    if 0 <= group < N:
        return (f"slot {slot} counts dispatch records from node {group}, written by rank {group * G + local}'s proxy"
                f"{via} (rank {group * G + local} -> forwarder rank {rank})")
    if N <= group < 2 * N:
        n = group - N
        return (f"slot {slot} counts combine partial sums from node {n}, written by forwarder rank {n * G + local}'s "
                f"proxy{via} (rank {n * G + local} -> source rank {rank})")
    return f"slot {slot} is outside the 2 x {N} x {L} + 2 slots this topology uses"


def describe_gpu_error(fields: dict, rank: int, ranks_per_node: int, num_nodes: int, codes: dict,
                       num_lanes: int = 1) -> str:
    """Topology context for a GPU error word (appended to the kernel's own message): who should have sent what."""
    code = fields.get("code", 0)
    if code == codes.get("wait_timeout"):
        return " [" + slot_meaning(int(fields["slot"]), rank, ranks_per_node, num_nodes, num_lanes) + "]"
    if code == codes.get("scatter_range"):
        node = rank // ranks_per_node
        return f" [target local GPU {fields['slot']} is rank {node * ranks_per_node + int(fields['slot'])}]"
    if code in (codes.get("push_timeout"), codes.get("records_unwritten")):
        return f" [destination rank {fields['aux']} is node {int(fields['aux']) // ranks_per_node}]"
    return ""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(t.size(0), math.prod(t.shape[1:])).view(torch.uint8)


def word_columns(rows: torch.Tensor, off: int, nb: int) -> torch.Tensor:
    """Bytes [off, off + nb) of every row of ``rows`` (uint8 [n, stride], rows laid out back to back) as the widest
    integers that tile them (int64, int32, int16, else bytes). A copy into or out of the slice then moves up to 8
    bytes per element: strided byte copies of a 58 MB payload column took hundreds of microseconds on H200 (session
    7 profile of the internode calls)."""
    for dtype, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if off % w == 0 and nb % w == 0 and rows.size(1) % w == 0 and rows.storage_offset() % w == 0:
            return rows.view(dtype)[:, off // w:(off + nb) // w]
    return rows[:, off:off + nb]


def pack_records(out: torch.Tensor, columns: Sequence[torch.Tensor], plan: SendPlan, layout: RecordLayout) -> None:
    """Fill ``out`` (uint8 [S1, stride]) with the wire records of the plan's send list."""
    if out.size(0) == 0:
        return
    for c, off, nb in zip(columns, layout.column_offsets, layout.column_bytes):
        if nb:
            dst = word_columns(out, off, nb)
            dst.copy_(_bytes_of(c).view(dst.dtype)[plan.hop1_token])
    out[:, layout.src_idx_offset:layout.src_idx_offset + 4] = \
        plan.hop1_token.to(torch.int32).view(-1, 1).view(torch.uint8)
    G = plan.dest_rows.size(1)
    out[:, layout.dest_rows_offset:layout.dest_rows_offset + 4 * G] = \
        plan.dest_rows.to(torch.int32).contiguous().view(torch.uint8)


def forward_block_bases(counts: Counts, rank: int, ranks_per_node: int) -> torch.Tensor:
    """int64 [N, 1 + G] (CPU) at ``rank`` as forwarder: its arrivals run in blocks by source node n (from source rank
    s = n * G + local); per block, the end of its rows among the arrivals (exclusive, cumulative), then the rows that
    the ranks before s fill at each GPU g of this node. A record's dest rows count from its source's first token for
    that GPU (send_plan); the final row adds its block's base, which gives the rank-major order of reference.py. The
    sources need no other rank's counts, so they can pack and push during notify. One row per source node, not per
    arrival (bases_per_arrival expands it): [arrivals, G] was ~130 KB at 2 nodes x 2 GPUs and grows past the upload
    staging area with the nodes. Made once per Counts (every layout of a handle shares the one tensor: one upload)."""
    G = ranks_per_node
    key = ("forward_block_bases", rank, G)
    if key not in counts._derived:
        node, local = divmod(rank, G)
        to_here = _host(counts.rank_counts)[:, node * G:(node + 1) * G]  # [R, G]: tokens of each source rank for us
        before = np.cumsum(to_here, axis=0) - to_here  # exclusive prefix over source ranks
        ends = np.cumsum(_host(counts.recv_matrix(G))[rank])
        table = np.concatenate([ends[:, None], before[local::G]], axis=1)
        counts._derived[key] = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
    return counts._derived[key]


def bases_per_arrival(blocks: torch.Tensor) -> torch.Tensor:
    """forward_block_bases' table as one row of bases per arrival [A, G] (what forward_arrivals adds to each)."""
    ends = blocks[:, 0]
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(blocks[:, 1:], sizes, dim=0)


def stamp_arrivals(arrivals: torch.Tensor, arrival_offset: int, dest_rows_offset: int, G: int, bases: torch.Tensor
                   ) -> torch.Tensor:
    """Write each arrival's row index into its record (the int32 at ``arrival_offset``); return its final rows at each
    GPU of the node [A, G] int64: the record's dest rows (G int32 at ``dest_rows_offset``) plus ``bases`` ([A, G]:
    bases_per_arrival of forward_block_bases, on the arrivals' device), -1 where not needed. The forwarder's reader
    (forward_arrivals) does this row by row as the arrivals land."""
    A = arrivals.size(0)
    if A == 0:
        return torch.empty((0, G), dtype=torch.int64, device=arrivals.device)
    arrivals[:, arrival_offset:arrival_offset + 4] = \
        torch.arange(A, dtype=torch.int32, device=arrivals.device).view(-1, 1).view(torch.uint8)
    rel = arrivals[:, dest_rows_offset:dest_rows_offset + 4 * G].contiguous().view(torch.int32).to(torch.int64)
    return torch.where(rel >= 0, rel + bases, rel)


def int32_column(rows: torch.Tensor, offset: int) -> torch.Tensor:
    return rows[:, offset:offset + 4].contiguous().view(torch.int32).view(-1).to(torch.int64)


def check_area(what: str, rows_by_rank: Sequence[int], stride: int, capacity: int, env: str) -> None:
    """Raise the same InternodeError on every rank when some rank's area cannot hold its rows."""
    for r, rows in enumerate(rows_by_rank):
        need = int(rows) * stride
        if need > capacity:
            raise InternodeError(f"rank {r}: the {what} area needs {need} bytes ({rows} rows x {stride} B) but has "
                                 f"{capacity}; raise {env} (the area is a fixed share of it, see docs/internode.md)")
