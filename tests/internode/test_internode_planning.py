"""The internode plan (offsets, push tables, waits, records, limits) executed by a byte-level simulator of the
proxies and NVLink, against reference.py's hierarchical dispatch and combine (gloo, CPU, several emulated nodes).

The simulator does what the GPU path does with the same planning functions: pack wire records, apply every
WRITE_SIGNAL of the push tables chunk by chunk to the destination's receive area (adding its value to the signal
slot), copy the own node's block locally, stamp arrivals, forward final rows by dest_row, and for combine gather the
copies at the forwarder, add them in local-rank order, send the partial sums back and add them in node order.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from tests.distributed import run_distributed
from uccl_ep_train.internode import plan
from uccl_ep_train import reference as ref
from uccl_ep_train.internode.handle import HopPlan


def _inputs(rank: int, T: int, H: int, R: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((T, H), generator=g)
    itr = torch.rand((T, R), generator=g) < 0.4
    if kind == "skewed":
        itr[:] = False
        itr[:, 0] = True
    elif kind == "empty":
        itr[:] = False
    elif kind == "dropped":
        itr[torch.rand((T,), generator=g) < 0.5] = False
    return x, itr


STALE = 0x5A  # every receive area starts full of bytes from "an earlier call": a record read before it lands is junk


class _Network:
    """The proxies + transport of the simulation. ``contract``: a WRITE_SIGNAL's bytes land before its increment is
    applied (what the loopback and verbs transports must guarantee). ``signal_first``: the increment is applied when
    the command is taken and the bytes land only later (after the reader has gone on) -- what the loopback transport
    did with a device-to-device cudaMemcpy on the legacy stream (it returns before the copy ran; see
    docs/internode.md, "Transport ordering"). The plan must make the second one fail loudly, never silently."""

    def __init__(self, rdma, signals, chunk_bytes: int, mode: str, num_lanes: int) -> None:
        self.rdma, self.signals, self.chunk_bytes, self.mode = rdma, signals, chunk_bytes, mode
        self.num_lanes = num_lanes
        self.late = []
        self.lanes = {}  # (src, dst, slot) -> FIFOs seen: a destination slot must be fed by one FIFO only
        self.blocks = self.writes = 0  # push-table rows with records, and the signalled writes they took

    def execute(self, push_table, src: int) -> None:
        for row in push_table:
            assert len(row) == 7, row
            dst, loff, roff, st, recs, first_slot, hint = row
            per = plan.chunk_records(st, self.chunk_bytes)
            self.blocks += recs > 0
            for c, first in enumerate(range(0, recs, per)):  # as push_chunks: chunk c through FIFO (hint + c) % L
                fifo = (hint + c) % self.num_lanes
                slot = first_slot + fifo
                self.lanes.setdefault((src, dst, slot), set()).add(fifo)
                n = min(per, recs - first)
                a, b = loff + first * st, roff + first * st
                assert b % 16 == 0 and a % 16 == 0 and n * st <= plan.CMD_MAX_BYTES and n <= plan.CMD_MAX_VALUE
                assert b + n * st <= self.rdma[dst].numel() and a + n * st <= self.rdma[src].numel()
                data = self.rdma[src][a:a + n * st].clone()
                if self.mode == "contract":
                    self.rdma[dst][b:b + n * st] = data
                else:
                    self.late.append((dst, b, data))
                self.signals[dst][slot] += n
                self.writes += 1

    def land_late_writes(self) -> None:
        for dst, b, data in self.late:
            self.rdma[dst][b:b + data.numel()] = data
        self.late.clear()


def _scatter(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """scatter_rows with its range check: a row index outside the destination area is an error, never a write."""
    bad = (idx >= dst.size(0)) | (idx < -1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise plan.InternodeError(f"{what}: destination row {int(idx[i])} (list position {i}) is outside the "
                                 f"{dst.size(0)} rows of the area")
    sel = idx >= 0
    dst[idx[sel]] = rows[sel]


def _simulate(R: int, G: int, T: int, H: int, kind: str, seed: int, chunk_bytes: int, mode: str = "contract",
              num_lanes: int = 1, network: Optional[list] = None):
    """Run the plan for every rank; return (final recv_x per rank, src_idx per rank, combined per rank, y per rank,
    inputs). ``network``: a list that gets the simulated _Network appended (its write counts)."""
    N = R // G
    inputs = [_inputs(r, T, H, R, kind, seed) for r in range(R)]
    counts = plan.counts_from_rows(torch.stack([plan.local_count_row(itr, G) for _, itr in inputs]), R)
    plans = [plan.send_plan(itr, counts, r, G) for r, (_, itr) in enumerate(inputs)]
    layout = plan.record_layout([H * 4], G)
    stride, half = layout.stride, 1 << 22
    rdma = [torch.full((2 * half,), STALE, dtype=torch.uint8) for _ in range(R)]
    L = num_lanes
    signals = [[0] * (2 * N * L) for _ in range(R)]
    net = _Network(rdma, signals, chunk_bytes, mode, L)
    if network is not None:
        network.append(net)
    per = plan.chunk_records(stride, chunk_bytes)

    for r, (x, _) in enumerate(inputs):
        p = plans[r]
        S1 = p.hop1_token.numel()
        assert S1 == sum(p.node_send) and list(p.dest_rows.shape) == [S1, G]
        plan.pack_records(rdma[r][:S1 * stride].view(S1, stride), [x], p, layout)
    for r in range(R):
        node = r // G
        recv = plan.recv_counts(counts, r, G)
        own = plans[r].node_send[node]
        so, ro = plan.block_offsets(plans[r].node_send, stride), plan.block_offsets(recv, stride)
        rdma[r][half + ro[node]:half + ro[node] + own * stride] = rdma[r][so[node]:so[node] + own * stride]
        rows = plan.dispatch_push_rows(counts, plans[r], r, G, stride, half, L)
        assert all(row[6] == row[0] // G for row in rows), "FIFO hint must be the destination node"
        net.execute(rows, r)
    final = [torch.full((plan.num_recv_rows(counts, r), layout.final_bytes), STALE, dtype=torch.uint8)
             for r in range(R)]
    written = [torch.zeros(plan.num_recv_rows(counts, r), dtype=torch.int64) for r in range(R)]
    fwd = []
    for f in range(R):
        waits = plan.dispatch_waits(counts, f, G, per, L)
        assert sum(c for _, c in waits) == sum(n for m, n in enumerate(plan.recv_counts(counts, f, G)) if m != f // G)
        for slot, c in waits:
            assert signals[f][slot] == c, (f, slot)  # exactly: nothing more arrives on a counter than awaited
        A = sum(plan.recv_counts(counts, f, G))
        arrivals = rdma[f][half:half + A * stride].view(A, stride)
        dest = plan.stamp_arrivals(arrivals, layout.arrival_offset, layout.dest_rows_offset, G,
                                  plan.bases_per_arrival(plan.forward_block_bases(counts, f, G)))
        fwd.append(dest)
        node = f // G
        for j in range(G):
            t = node * G + j
            _scatter(final[t], dest[:, j], arrivals[:, :layout.final_bytes],
                     f"rank {f}, dispatch forward to local GPU {j} (rank {t})")
            written[t].index_add_(0, dest[:, j][dest[:, j] >= 0], torch.ones(int((dest[:, j] >= 0).sum()),
                                                                              dtype=torch.int64))
    net.land_late_writes()  # too late for the forwarders: they already read the areas
    for r in range(R):
        assert bool((written[r] == 1).all()), f"rank {r}: every final row must be written exactly once"
    recv_x = [final[r][:, :H * 4].contiguous().view(torch.float32) for r in range(R)]
    src_idx = [plan.int32_column(final[r], layout.src_idx_offset) for r in range(R)]
    arrival = [plan.int32_column(final[r], layout.arrival_offset) for r in range(R)]

    # combine: y = per-rank transform of the received rows (fresh values, not the payload)
    ys = [recv_x[r] * (r + 1.5) + 0.25 for r in range(R)]
    C = H
    cstride = plan._align(4 * C)
    gather = [torch.zeros((G, max(1, sum(plan.recv_counts(counts, f, G))), C)) for f in range(R)]
    for d in range(R):
        src_rank = torch.repeat_interleave(torch.arange(R), counts.rank_counts[:, d])
        fl = src_rank % G
        node = d // G
        for j in range(G):
            f = node * G + j
            sel = (fl == j).nonzero(as_tuple=True)[0]
            A_f = sum(plan.recv_counts(counts, f, G))
            _scatter(gather[f][d % G][:A_f], arrival[d][sel], ys[d][sel],
                     f"rank {d}, combine gather to local GPU {j} (rank {f})")
    rdma = [torch.full((2 * half,), STALE, dtype=torch.uint8) for _ in range(R)]
    net.rdma = rdma
    dispatch_signals = [list(v) for v in signals]
    areas = plan.combine_areas(counts, G, cstride, half)
    for f in range(R):
        A = fwd[f].size(0)
        partial = torch.zeros((A, C))
        for j in range(G):
            partial += torch.where((fwd[f][:, j] >= 0).unsqueeze(1), gather[f][j, :A], torch.zeros(A, C))
        sb = areas.send_base[f]
        rdma[f][sb:sb + A * cstride].view(A, cstride)[:, :4 * C] = partial.view(torch.uint8)
    for f in range(R):
        node = f // G
        recv = plan.recv_counts(counts, f, G)
        back = counts.node_counts[f].tolist()
        own = recv[node]
        bo, ao = plan.block_offsets(back, cstride), plan.block_offsets(recv, cstride)
        sb, rb = areas.send_base[f], areas.recv_base[f]
        rdma[f][rb + bo[node]:rb + bo[node] + own * cstride] = rdma[f][sb + ao[node]:sb + ao[node] + own * cstride]
        rows = plan.combine_push_rows(counts, f, G, cstride, areas, L)
        assert all(row[6] == row[0] // G for row in rows), "FIFO hint must be the destination node"
        net.execute(rows, f)
    combined = []
    for s in range(R):
        for slot, c in plan.combine_waits(counts, s, G, plan.chunk_records(cstride, chunk_bytes), L):
            assert signals[s][slot] - dispatch_signals[s][slot] == c, (s, slot)
        back = plans[s].node_send
        S1 = sum(back)
        rb = areas.recv_base[s]
        got = rdma[s][rb:rb + S1 * cstride].view(S1, cstride)[:, :4 * C].contiguous().view(torch.float32)
        out = torch.zeros((T, C))
        start = 0
        for c in back:
            out.index_add_(0, plans[s].hop1_token[start:start + c], got[start:start + c])
            start += c
        combined.append(out)
    net.land_late_writes()
    for (src, dst, slot), hints in net.lanes.items():
        assert len(hints) == 1, f"rank {src} -> rank {dst} slot {slot} used FIFO hints {hints}: one lane per slot"
    return recv_x, src_idx, combined, ys, inputs


def _check_rank(rank, world, G, T, H, kind, seed, chunk_bytes, num_lanes=1, network=None):
    recv_x, src_idx, combined, ys, inputs = _simulate(world, G, T, H, kind, seed, chunk_bytes, num_lanes=num_lanes,
                                                      network=network)
    x, itr = inputs[rank]
    res = ref.dispatch(x, None, None, is_token_in_rank=itr, num_experts=world, ranks_per_node=G)
    assert torch.equal(res.recv_x, recv_x[rank]), "dispatch rows differ from the reference's rank-major order"
    assert torch.equal(res.handle.recv_src_idx, src_idx[rank])
    back = ref.combine(ys[rank], res.handle)
    assert torch.equal(back.combined_x, combined[rank]), "combine differs from the reference's summation order"
    return int(res.recv_x.size(0))


# (world, ranks per node): 1 GPU per node (no NVLink hop), 2x2 (the GPU test topology), 2x3, 3x2, 3x1, 4x2 and 2x4.
TOPOLOGIES = [(2, 1), (4, 1), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4)]


@pytest.mark.parametrize("world,G", TOPOLOGIES)
@pytest.mark.parametrize("kind", ["random", "skewed", "empty", "dropped"])
def test_simulated_internode_plan_matches_reference_dispatch_and_combine(world, G, kind):
    rows = run_distributed(_check_rank, world, G, 37, 16, kind, 3, 4096, timeout=180)
    if kind == "empty":
        assert rows == [0] * world
    elif kind == "skewed":
        assert rows[0] == 37 * world and rows[1:] == [0] * (world - 1)


def _writes_per_block(rank, world, G, T, H, kind, seed, chunk_bytes):
    nets: list = []
    _check_rank(rank, world, G, T, H, kind, seed, chunk_bytes, network=nets)
    return nets[0].blocks, nets[0].writes


def test_tiny_chunks_split_blocks_into_many_signalled_writes_and_still_match():
    # 64-byte chunks hold one 48-byte record (H = 8 fp32 + meta): a write per record, where 4 KiB takes a block whole
    tiny = run_distributed(_writes_per_block, 4, 2, 53, 8, "random", 5, 64, timeout=120)
    whole = run_distributed(_writes_per_block, 4, 2, 53, 8, "random", 5, 4096, timeout=120)
    for (blocks, writes), (blocks_whole, writes_whole) in zip(tiny, whole):
        assert blocks == blocks_whole > 0 and writes_whole == blocks_whole, (blocks, writes_whole)
        assert writes >= 4 * blocks, (blocks, writes)


@pytest.mark.parametrize("world,G,lanes", [(4, 2, 4), (4, 1, 3), (8, 2, 8)])
def test_chunks_spread_over_every_proxy_fifo_with_one_counter_per_fifo_still_match(world, G, lanes):
    """A block's chunks rotate over all proxy FIFOs (so every proxy thread moves bytes at once); each lane has its
    own counter, the receiver derives every lane's share from the counts alone, and the outputs stay exact."""
    run_distributed(_check_rank, world, G, 53, 8, "random", 5, 256, lanes, timeout=180)


def test_chunk_lanes_rotate_from_the_hint_and_add_up_to_the_block():
    got = plan.chunk_lanes(10, 3, 1, 4)
    assert got == [1, 3, 3, 3] and sum(got) == 10
    assert plan.chunk_lanes(0, 5, 2, 3) == [0, 0, 0]
    assert plan.chunk_lanes(7, 100, 5, 4) == [0, 7, 0, 0]  # one chunk: FIFO hint % L
    waits = plan.lane_waits([(8, 10)], 3, 1, 4)
    assert waits == [(8, 1), (9, 3), (10, 3), (11, 3)]


@pytest.mark.parametrize("world,G", [(4, 2), (8, 4), (8, 2)])
def test_a_signal_that_overtakes_its_bytes_is_caught_by_the_forward_range_check(world, G):
    """The loopback bug of issue 5 (G=2 failures): the immediate was published before the device copy ran. The
    forwarder then reads stale records; their dest_row must be rejected by the range check (kernel: scatter_rows
    with dst_rows, error kErrScatterRange naming rank, phase, target and row), not written out of bounds."""
    with pytest.raises(plan.InternodeError, match=r"rank \d+, dispatch forward to local GPU \d+ .*outside"):
        _simulate(world, G, 37, 16, "random", 3, 4096, mode="signal_first")
    _simulate(world, G, 37, 16, "random", 3, 4096, mode="contract")  # the same plan is fine when bytes land first


def test_push_rows_route_each_destination_through_its_own_fifo_hint_in_every_call():
    G, R = 2, 8
    for seed in range(3):
        _, itr = _inputs(1, 29, 4, R, "random", seed)
        rows = [plan.local_count_row(_inputs(r, 29, 4, R, "random", seed)[1], G) for r in range(R)]
        counts = plan.counts_from_rows(torch.stack(rows), R)
        sp = plan.send_plan(itr, counts, 1, G)
        for row in plan.dispatch_push_rows(counts, sp, 1, G, 64, 1 << 20, 4):
            assert row[6] == row[0] // G and row[5] == 0  # slots 0..3 = source node 0's lanes, hint = dest node
        for row in plan.combine_push_rows(counts, 1, G, 64, plan.combine_areas(counts, G, 64, 1 << 20), 4):
            assert row[6] == row[0] // G and row[5] == (R // G + 0) * 4


def test_gpu_error_context_names_the_counter_its_feeder_and_the_target_rank():
    codes = {"wait_timeout": 1, "push_timeout": 2, "encode": 3, "scatter_range": 4, "aborted": 5,
             "records_unwritten": 6}
    # the failure of issue 5: rank 3 (node 1, local 1 of 2x2) waited on slot 0
    msg = plan.describe_gpu_error({"code": 1, "slot": 0, "aux": 0}, 3, 2, 2, codes)
    assert "dispatch records from node 0" in msg and "rank 1's proxy" in msg and "forwarder rank 3" in msg
    msg = plan.describe_gpu_error({"code": 1, "slot": 3, "aux": 0}, 0, 2, 2, codes)
    assert "combine partial sums from node 1" in msg and "forwarder rank 2" in msg
    assert "outside" in plan.slot_meaning(9, 0, 2, 2)
    # with 4 FIFOs per proxy: slot 6 = dispatch from node 1 through FIFO 2; slot 13 = combine from node 1, FIFO 1
    assert "dispatch records from node 1" in plan.slot_meaning(6, 0, 2, 2, 4)
    assert "FIFO 2" in plan.slot_meaning(6, 0, 2, 2, 4)
    assert "combine partial sums from node 1" in plan.slot_meaning(13, 0, 2, 2, 4)
    assert "barrier" in plan.slot_meaning(16, 0, 2, 2, 4)  # the one slot after the 2 x N x L data counters
    assert "rank 3" in plan.describe_gpu_error({"code": 4, "slot": 1, "aux": 5}, 2, 2, 2, codes)
    assert "node 1" in plan.describe_gpu_error({"code": 2, "slot": 0, "aux": 2}, 0, 2, 2, codes)
    assert "destination rank 2 is node 1" in plan.describe_gpu_error({"code": 6, "slot": 5, "aux": 2}, 0, 2, 2, codes)
    assert plan.describe_gpu_error({"code": 0}, 0, 2, 2, codes) == ""


def test_record_layout_is_16_byte_aligned_and_grows_with_ranks_per_node_without_a_cap():
    for G in (1, 2, 8, 9, 72):
        lay = plan.record_layout([7168 * 2, 56 * 4, 8 * 8, 8 * 4], G)
        assert lay.stride % 16 == 0 and lay.final_bytes % 16 == 0
        assert lay.stride >= lay.dest_rows_offset + 4 * G
        assert lay.final_bytes <= lay.stride


def test_chunking_respects_byte_cap_value_bits_and_rejects_unencodable_records():
    assert plan.chunk_records(16, 1 << 40) == plan.CMD_MAX_VALUE
    assert plan.chunk_records(1024, 2 << 20) == 2048
    assert plan.chunk_records(4096, 100) == 1  # one record larger than the cap still goes alone
    with pytest.raises(plan.InternodeError, match="multiple of 16"):
        plan.chunk_records(24, 1 << 20)
    with pytest.raises(plan.InternodeError, match="24-bit"):
        plan.chunk_records(plan.CMD_MAX_BYTES + 16, 1 << 20)


def test_writes_are_a_quarter_of_the_inflight_byte_cap_so_several_overlap_except_for_tiny_caps():
    assert plan.chunk_bytes(2 << 20) == 512 << 10  # the IB/RoCE default: four writes in flight per proxy thread
    assert plan.chunk_bytes(8 << 20) == 2 << 20    # EFA's default
    assert plan.chunk_bytes(4096) == 4096          # tiny caps (tests, Thor-2-style tuning) are used whole


def test_topology_limits_come_from_the_command_format_not_fixed_gpu_or_node_counts():
    assert plan.check_topology(4096, 128) >= 64
    assert plan.check_topology(64, 1) == 512  # 64 nodes of 1 GPU: no 20-node limit
    assert plan.check_topology(1024, 8, 4) == 1536  # 128 nodes x 4 FIFOs x 2 phases + 1 barrier, in 512-slot pages
    with pytest.raises(ValueError, match="FIFOs"):
        plan.check_topology(2048, 1, 8)  # 2048 nodes x 8 FIFOs x 2 > 14-bit slots
    with pytest.raises(ValueError, match="12-bit"):
        plan.check_topology(8192, 8)
    with pytest.raises(ValueError, match="must divide"):
        plan.check_topology(6, 4)


def test_area_check_names_rank_area_rows_and_setting():
    with pytest.raises(plan.InternodeError, match=r"rank 1: the dispatch receive \(RDMA\) area needs 3200 bytes"):
        plan.check_area("dispatch receive (RDMA)", [1, 100], 32, 1024, "num_rdma_bytes")


def _topk(rank: int, T: int, K: int, E: int, seed: int, skew: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skew:  # most tokens to the first rank's experts
        idx[: T * 3 // 4] = torch.arange(K).expand(T * 3 // 4, K)
    idx[torch.rand((T, K), generator=g) < 0.2] = -1  # dropped slots
    return idx


@pytest.mark.parametrize("R,G,skew", [(4, 2, False), (8, 2, True), (4, 1, False), (6, 3, True)])
def test_notify_rows_carry_per_expert_counts_equal_to_counting_the_received_expert_ids(R, G, skew):
    E, K, N = 8 * R, 4, R // G
    L = E // R
    topk = [_topk(r, 40 + 3 * r, K, E, 7, skew) for r in range(R)]
    layouts = [ref.get_dispatch_layout(t, E, R, G) for t in topk]
    rows = torch.stack([plan.local_count_row(lay[3], G, lay[2]) for lay in layouts])
    counts = plan.counts_from_rows(rows, R, N)
    assert counts.expert_counts is not None and counts.expert_counts.shape == (R, E)
    for dst in range(R):
        # the oracle: every (token, slot) a source routes to one of dst's experts is one row dst receives there
        seen = torch.zeros(L, dtype=torch.int64)
        for t in topk:
            mine = t[(t >= dst * L) & (t < (dst + 1) * L)] - dst * L
            seen += torch.bincount(mine, minlength=L)
        assert plan.recv_expert_counts(counts, dst, L) == seen.tolist()
        assert plan.num_recv_rows(counts, dst) == sum(int(lay[3][:, dst].sum()) for lay in layouts)
    # rows without the expert columns still split as before, and asking them for experts is an error
    plain = plan.counts_from_rows(rows[:, :R + N], R)
    assert plain.expert_counts is None and torch.equal(plain.node_counts, counts.node_counts)
    with pytest.raises(plan.InternodeError, match="no per-expert counts"):
        plan.recv_expert_counts(plain, 0, L)


@pytest.mark.parametrize("R,G", [(4, 2), (8, 4), (6, 3), (2, 1)])
def test_each_received_row_is_given_the_local_index_of_its_source_rank(R, G):
    rows = torch.stack([plan.local_count_row(_inputs(r, 23, 4, R, "random", 5)[1], G) for r in range(R)])
    rows[:, 1] = 0  # one source sends nothing anywhere: its empty range must not shift the others
    rows[R - 1, :R] = 0  # and one sends to no rank at all
    counts = plan.counts_from_rows(rows, R)
    for rank in range(R):
        src_rank = torch.repeat_interleave(torch.arange(R), counts.rank_counts[:, rank])  # what dispatch records
        ends = torch.tensor(plan.recv_row_ends(counts, rank))
        assert ends.tolist() == torch.cumsum(counts.rank_counts[:, rank], 0).tolist()
        got = plan.source_local_of_rows(ends, src_rank.numel(), G)
        assert got.dtype == torch.int64 and torch.equal(got, src_rank % G), rank
    assert plan.source_local_of_rows(torch.tensor([0, 0]), 0, 2).numel() == 0  # a rank that receives nothing


@pytest.mark.parametrize("R,G,kind", [(4, 2, "random"), (8, 4, "skewed"), (6, 3, "dropped"), (4, 1, "random"),
                                      (4, 2, "empty")])
def test_nvlink_rows_of_the_traffic_report_follow_from_the_counts_as_from_the_forwarded_rows(R, G, kind):
    inputs = [_inputs(r, 31, 4, R, kind, 9)[1] for r in range(R)]
    counts = plan.counts_from_rows(torch.stack([plan.local_count_row(itr, G) for itr in inputs]), R)
    for rank in range(R):
        node, local = divmod(rank, G)
        # dispatch: what the forwarder scatters -- each arrival (a token of a source with our local index that hits
        # our node) once per other GPU of the node that needs it
        forwarded = sum(int(inputs[s][:, d].sum()) for s in range(local, R, G)
                        for d in range(node * G, node * G + G) if d != rank)
        assert plan.dispatch_nvlink_rows(counts, rank, G) == forwarded
        # combine: every received row whose forwarder (the GPU of our node with its source's local index) is not us
        back = sum(int(inputs[s][:, rank].sum()) for s in range(R) if s % G != local)
        assert plan.combine_nvlink_rows(counts, rank, G) == back


@pytest.mark.parametrize("off,nb,dtype", [(0, 64, torch.int64), (8, 24, torch.int64), (4, 12, torch.int32),
                                          (2, 6, torch.int16), (1, 5, torch.uint8)])
def test_word_columns_is_the_same_bytes_as_the_byte_slice_in_the_widest_words_that_tile_it(off, nb, dtype):
    rows = torch.randint(0, 256, (5, 96), dtype=torch.uint8)
    words = plan.word_columns(rows, off, nb)
    assert words.dtype == dtype
    assert torch.equal(words.contiguous().view(torch.uint8), rows[:, off:off + nb])
    words.fill_(0)  # a view: writing through it writes the rows
    assert int(rows[:, off:off + nb].sum()) == 0 and int(rows[:, :off].sum() + rows[:, off + nb:].sum()) > 0


def test_combine_rows_sit_at_the_top_of_each_half_and_overlap_is_found_on_any_rank():
    G, R, T = 2, 4, 40
    rows = [plan.local_count_row(_inputs(r, T, 4, R, "skewed", 3)[1], G) for r in range(R)]
    counts = plan.counts_from_rows(torch.stack(rows), R)
    stride, cstride = 96, 64
    sends = [sum(plan.recv_counts(counts, r, G)) for r in range(R)]
    backs = [int(counts.node_counts[r].sum()) for r in range(R)]
    extents = plan.dispatch_extents(counts, G, stride)
    assert extents == ([b * stride for b in backs], [a * stride for a in sends])
    roomy = 1 << 20
    areas = plan.combine_areas(counts, G, cstride, roomy)
    assert [b + a * cstride for b, a in zip(areas.send_base, sends)] == [roomy] * R  # sent rows end at the half
    assert [b + n * cstride for b, n in zip(areas.recv_base, backs)] == [2 * roomy] * R  # received: at the top
    assert not plan.combine_overlaps_dispatch(areas, extents, roomy)
    # just enough for the busiest rank's dispatch and combine side by side, then one 16-byte unit less
    tight = max(max(b * stride + a * cstride, a * stride + b * cstride) for a, b in zip(sends, backs))
    assert not plan.combine_overlaps_dispatch(plan.combine_areas(counts, G, cstride, tight), extents, tight)
    assert plan.combine_overlaps_dispatch(plan.combine_areas(counts, G, cstride, tight - 16), extents, tight - 16)


@pytest.mark.parametrize("R,G", [(2, 1), (8, 2), (64, 8), (16, 16)])
def test_per_rank_totals_derived_at_once_equal_their_per_rank_definitions(R, G):
    """Counts.recv_matrix / totals / final_rows replace Python loops over the ranks (~1.5 ms each at 8 x 8 GPUs);
    they must give what the definitions give rank by rank: arrivals of r from node n come from rank n * G + local(r)."""
    N = R // G
    g = torch.Generator().manual_seed(R * G)
    counts = plan.Counts(torch.randint(0, 50, (R, R), generator=g), torch.randint(0, 50, (R, N), generator=g))
    t = counts.totals(G)
    for r in range(R):
        node, local = divmod(r, G)
        arrivals = [int(counts.node_counts[n * G + local, node]) for n in range(N)]
        assert plan.recv_counts(counts, r, G) == arrivals
        assert t.arrivals[r] == sum(arrivals)
        assert t.sends[r] == int(counts.node_counts[r].sum())
        assert t.final_rows[r] == plan.num_recv_rows(counts, r) == int(counts.rank_counts[:, r].sum())
        ends = plan.recv_row_ends(counts, r)
        assert ends == [int(counts.rank_counts[:s + 1, r].sum()) for s in range(R)]


@pytest.mark.parametrize("R,G,lanes,per,seed", [(2, 1, 1, 3, 0), (4, 1, 4, 2, 1), (8, 2, 3, 5, 2), (6, 3, 2, 1, 3),
                                                (4, 2, 4, 7, 4)])
def test_a_gated_row_is_ready_exactly_when_the_chunk_carrying_it_has_landed(R, G, lanes, per, seed):
    """The gated readers (csrc/kernels/arrival_gate.cuh) read a row once its lane's counter passes gate_threshold.
    Chunks land in any interleaving of the lanes, each lane in its own order (one FIFO per counter; the proxy's
    sequencer restores that order on an unordered NIC). After every landing, each row of every block must be ready
    exactly when its chunk has landed: never before (it would read bytes not yet written), never later (the reader
    would wait for chunks it does not need). Dispatch and combine blocks, with counters that start where the calls
    before left them; and the watcher of a gated launch stops each lane where the host-side wait would."""
    N = R // G
    g = torch.Generator().manual_seed(seed)
    counts = plan.Counts(torch.randint(0, 12, (R, R), generator=g), torch.randint(0, 20, (R, N), generator=g))
    for r in range(R):
        node = r // G
        for blocks, waits in ((plan.dispatch_gate_blocks(counts, r, G, lanes), plan.dispatch_waits(counts, r, G, per,
                                                                                                    lanes)),
                              (plan.combine_gate_blocks(counts, r, G, lanes), plan.combine_waits(counts, r, G, per,
                                                                                                  lanes))):
            before = torch.randint(0, 100, (2 * N * lanes,), generator=g).tolist()
            table = plan.gate_rows(blocks, node, lanes, before)
            # what the counters finally reach is what the host-side waits expect
            final = list(before)
            for slot, c in waits:
                final[slot] += c
            # the chunks as push_chunks cuts each block: chunk c through lane (hint + c) % lanes, in order per lane
            queues = [[] for _ in range(2 * N * lanes)]
            for first, records, slot in blocks:
                for c, lo in enumerate(range(0, records, per)):
                    lane = (node + c) % lanes
                    queues[slot + lane].append((first + lo, min(per, records - lo)))
            counters, landed = list(before), set()
            rows = [(first + i, first) for first, records, _ in blocks for i in range(records)]
            while True:
                for row, first in rows:
                    chunk_first = first + (row - first) // per * per
                    slot, value = plan.gate_threshold(row, table, per, lanes)
                    assert (counters[slot] >= value) == (chunk_first in landed), (r, row, slot, value, counters)
                live = [i for i, q in enumerate(queues) if q]
                if not live:
                    break
                lane_slot = live[int(torch.randint(0, len(live), (1,), generator=g))]
                lo, n = queues[lane_slot].pop(0)
                counters[lane_slot] += n
                landed.add(lo)
            assert counters == final
            # the watcher of a gated launch stops each lane where the host-side wait expects it
            for row in table:
                for lane, n in enumerate(plan.chunk_lanes(row[1], per, row[3], lanes)):
                    want = row[4 + lane] + n if n else None
                    assert plan.gate_lane_target(row, lane, per, lanes) == want, (row, lane)
            own_rows = [i for i in range(sum(int(c) for c in counts.rank_counts[:, r]))
                        if all(not first <= i < first + n for first, n, _ in blocks)]
            assert all(plan.gate_threshold(i, table, per, lanes) is None for i in own_rows)


def test_a_cached_dispatch_after_a_combine_skips_its_barrier_only_with_traffic_between_all_nodes_and_room():
    R, G = 4, 2
    full = plan.Counts(torch.full((R, R), 5), torch.full((R, 2), 5))
    stride, cstride, half = 64, 48, 1 << 20
    areas = plan.combine_areas(full, G, cstride, half)
    assert plan.sends_to_every_node(full, G)
    assert plan.dispatch_may_skip_entry_barrier(full, full, areas, G, stride, half)
    # rank 3 sent nothing to node 0 in the dispatch before that combine: node 0 never answered it, so nothing proves
    # node 0 is done with that dispatch's arrivals
    gap = plan.Counts(full.rank_counts.clone(), full.node_counts.clone())
    gap.node_counts[3, 0] = 0
    assert not plan.sends_to_every_node(gap, G)
    assert not plan.dispatch_may_skip_entry_barrier(full, gap, plan.combine_areas(gap, G, cstride, half), G, stride,
                                                    half)
    # ... or in this dispatch (the combine after it could not skip its own)
    assert not plan.dispatch_may_skip_entry_barrier(gap, full, areas, G, stride, half)
    # a rank's own node needs no traffic, and one node is trivially complete
    own_only = plan.Counts(full.rank_counts.clone(), full.node_counts.clone())
    own_only.node_counts[0, 0] = own_only.node_counts[3, 1] = 0
    assert plan.sends_to_every_node(own_only, G)
    assert plan.sends_to_every_node(plan.Counts(torch.zeros((2, 2)), torch.zeros((2, 1))), 2)
    # the dispatch's rows must stay below the combine's on every rank
    tight = max(b * stride + a * cstride for a, b in zip(full.totals(G).arrivals, full.totals(G).sends))
    assert plan.dispatch_may_skip_entry_barrier(full, full, plan.combine_areas(full, G, cstride, tight), G, stride,
                                                tight)
    assert not plan.dispatch_may_skip_entry_barrier(full, full, plan.combine_areas(full, G, cstride, tight - 16), G,
                                                    stride, tight - 16)


@pytest.mark.parametrize("records,per,lanes", [(4096, 35, 32), (300, 7, 4), (64, 8, 3), (5, 8, 4), (33, 8, 32)])
def test_a_push_table_cut_into_a_head_and_a_tail_makes_the_same_writes_through_the_same_lanes_in_lane_order(
        records, per, lanes):
    stride, base = 48, 1 << 20
    rows = [[1, base + 10 * stride, 7 * stride, stride, records, 64, 1],
            [3, base + (10 + records) * stride, 0, stride, records // 2 + 1, 64, 3]]
    first, n, head, tail = plan.split_push_head(rows, base, per)
    whole = plan.push_writes(rows, per, lanes)
    pieces = plan.push_writes(head, per, lanes) + plan.push_writes(tail, per, lanes)
    assert sorted(pieces) == sorted(whole)
    by_lane = lambda writes, lane: [w for w in writes if w[0] == lane]  # noqa: E731
    for lane in range(lanes):  # each lane's counter moves in the same order: receivers gate exactly as before
        assert by_lane(pieces, lane) == by_lane(whole, lane)
    chunks = -(-records // per)
    if chunks == 1:
        assert (first, n, head, tail) == (0, 0, [], rows)
    else:
        # the head is a whole number of chunks of the first block, from its first record, and leaves a tail
        assert first == 10 and n % per == 0 and 0 < n < records
        assert n // per == max(1, chunks // 16)
        assert head[0][4] == n and tail[0][4] == records - n and tail[1:] == rows[1:]


@pytest.mark.parametrize("lanes", [1, 3, 32])
def test_chunk_lanes_counts_the_records_the_push_kernel_sends_through_each_lane(lanes):
    for records in (0, 1, 34, 35, 36, 4000, 4096):
        for per, hint in ((35, 0), (35, 5), (1, 31), (512, 2)):
            sent = [0] * lanes
            for lane, *_, n in plan.push_writes([[1, 0, 0, 16, records, 0, hint]], per, lanes):
                sent[lane] += n
            assert plan.chunk_lanes(records, per, hint, lanes) == sent, (records, per, hint)


def test_the_rest_of_a_hop_is_every_record_range_without_the_heads_records():
    hop = HopPlan([], None, [], [], 8, head_first=10, head_records=16)
    # the head inside one range, at its start, across none, and ranges left empty by it are dropped
    assert hop.rest_of([(0, 5), (10, 40)]) == [(0, 5), (26, 40)]
    assert hop.rest_of([(10, 26)]) == []
    assert hop.rest_of([(0, 12), (20, 30)]) == [(0, 10), (26, 30)]
    assert hop.rest_of([(30, 50)]) == [(30, 50)]


@pytest.mark.parametrize("R,G,skew", [(2, 1, False), (4, 1, True), (8, 2, True), (6, 3, False)])
def test_blocks_filled_from_our_row_and_placed_from_the_count_rows_go_where_dispatch_push_rows_puts_them(R, G, skew):
    """push_after_counts' rules (rows_from_own_row, then place_blocks) against the hop plan made after notify: the
    table made before any count is read, filled from our own count row and moved by every row, is
    dispatch_push_rows' rows, for every rank; with a receive area too small for some destinations, exactly the rows
    for those are left out, and with a send limit below our records nothing is pushed."""
    E, K, N, stride, recv_base, lanes = 8 * R, 4, R // G, 96, 1 << 20, 3
    topk = [_topk(r, 40 + 3 * r, K, E, 7, skew) for r in range(R)]
    rows = torch.stack([plan.local_count_row(ref.get_dispatch_layout(t, E, R, G)[3], G) for t in topk])
    counts = plan.counts_from_rows(rows, R, N)
    arrivals = [sum(plan.recv_counts(counts, d, G)) for d in range(R)]
    assert len(set(arrivals)) > 1 or not skew, "a skewed routing should leave some rank more arrivals than another"
    for rank in range(R):
        node_send = [int(c) for c in counts.node_counts[rank].tolist()]
        blank = plan.dispatch_push_rows_before_counts(rank, G, N, stride, recv_base, lanes)
        assert len(blank) == N - 1 and all(row[2] == recv_base and row[4] == 0 for row in blank)
        total = sum(node_send) * stride
        assert plan.rows_from_own_row(node_send, blank, G, total - 1) == []
        early = plan.rows_from_own_row(node_send, blank, G, total)
        assert [row[4] for row in early] == [c for m, c in enumerate(node_send) if m != rank // G and c]
        after = plan.dispatch_push_rows(counts, SimpleNamespace(node_send=node_send), rank, G, stride, recv_base,
                                        lanes)
        assert plan.place_blocks(rows, early, rank, G, max(arrivals) * stride) == after
        limit = sorted(arrivals)[len(arrivals) // 2] * stride  # some destinations fit, the others do not
        fits = [row for row in after if arrivals[row[0]] * stride <= limit]
        assert plan.place_blocks(rows, early, rank, G, limit) == fits


def test_rows_filled_from_our_row_skip_nodes_we_send_nothing_and_put_each_block_after_the_earlier_nodes_records():
    """rows_from_own_row by hand: rank 2 of 4 nodes x 2 GPUs (node 1) sends 3, 0, 5 and 2 records of 32 bytes to
    nodes 0..3. Node 1 is ours, and the blocks sit in our send area by node: node 0's at 0, node 2's at 3 records,
    node 3's at 8 (our own node's 0 records count too); the rows keep their slot and hint."""
    blank = plan.dispatch_push_rows_before_counts(2, 2, 4, 32, 1000, 1)
    assert [(row[0], row[5], row[6]) for row in blank] == [(0, 1, 0), (4, 1, 2), (6, 1, 3)]
    rows = plan.rows_from_own_row([3, 0, 5, 2], blank, 2, 320)
    assert rows == [[0, 0, 1000, 32, 3, 1, 0], [4, 96, 1000, 32, 5, 1, 2], [6, 256, 1000, 32, 2, 1, 3]]
    assert plan.rows_from_own_row([3, 0, 5, 2], blank, 2, 319) == []
    assert plan.rows_from_own_row([0, 4, 0, 0], blank, 2, 320) == []  # only our own node: nothing crosses


def test_forward_bases_give_each_arrival_the_rows_that_earlier_source_ranks_fill_at_each_gpu_of_the_node():
    """2 nodes x 2 GPUs; at forwarder rank 3 (node 1, local 1) arrivals come from rank 1 (node 0's block), then from
    rank 3 itself (node 1's block). At GPU g of node 1 (rank 2 + g) rank 1's rows follow rank 0's, and rank 3's follow
    ranks 0, 1 and 2's: the bases are those sums, one row per source block with the block's end before them."""
    G = 2
    rank_counts = torch.tensor([[5, 1, 7, 2],    # rank 0: 7 tokens for rank 2, 2 for rank 3
                                [0, 3, 4, 6],    # rank 1
                                [1, 1, 9, 8],    # rank 2
                                [2, 2, 3, 5]])   # rank 3
    # records of rank 1 to node 1: 2 (some tokens go to both GPUs there); of rank 3 to node 1: 3
    node_counts = torch.tensor([[6, 8], [3, 2], [2, 10], [4, 3]])
    counts = plan.Counts(rank_counts, node_counts)
    got = plan.forward_block_bases(counts, 3, G)
    from_rank1 = [7, 2]             # ranks before 1 at ranks 2 and 3: rank 0's
    from_rank3 = [7 + 4 + 9, 2 + 6 + 8]  # ranks 0, 1, 2
    assert got.tolist() == [[2] + from_rank1, [2 + 3] + from_rank3]
    assert plan.bases_per_arrival(got).tolist() == [from_rank1] * 2 + [from_rank3] * 3
    # at forwarder rank 0 (node 0, local 0): blocks from rank 0 (node 0), then rank 2 (node 1)
    got = plan.forward_block_bases(counts, 0, G)
    assert got.tolist() == [[6, 0, 0], [6 + 2, 5 + 0, 1 + 3]]
    assert plan.bases_per_arrival(got).tolist() == [[0, 0]] * 6 + [[5 + 0, 1 + 3]] * 2
    # a source node that sends a forwarder nothing keeps its row, ending where the block before it ends
    empty = plan.Counts(rank_counts, torch.tensor([[6, 8], [3, 0], [2, 10], [4, 3]]))  # rank 1: nothing to node 1
    assert plan.forward_block_bases(empty, 3, G)[:, 0].tolist() == [0, 3]
    assert plan.bases_per_arrival(plan.forward_block_bases(empty, 3, G)).tolist() == [from_rank3] * 3
    # made once per Counts and rank: every layout of a handle gets the same tensor, which the backend uploads once
    assert plan.forward_block_bases(counts, 0, G) is got and plan.forward_block_bases(counts, 3, G) is not got
    assert got.dtype == torch.int64 and got.is_contiguous()
