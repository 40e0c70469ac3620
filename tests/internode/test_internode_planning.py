"""The internode plan (offsets, push tables, waits, records, limits) executed by a byte-level simulator of the
proxies and NVLink, against reference.py's hierarchical dispatch and combine (gloo, CPU, several emulated nodes).

The simulator does what the GPU path does with the same planning functions: pack wire records, apply every
WRITE_SIGNAL of the push tables chunk by chunk to the destination's receive area (adding its value to the signal
slot), copy the own node's block locally, stamp arrivals, forward final rows by dest_row, and for combine gather the
copies at the forwarder, add them in local-rank order, send the partial sums back and add them in node order.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from uccl_ep_train import internode as inn
from uccl_ep_train import reference as ref


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


def _simulate(R: int, G: int, T: int, H: int, kind: str, seed: int, chunk_bytes: int):
    """Run the plan for every rank; return (final recv_x per rank, combined per rank, signals, y per rank)."""
    N = R // G
    inputs = [_inputs(r, T, H, R, kind, seed) for r in range(R)]
    counts = inn.counts_from_rows(torch.stack([inn.local_count_row(itr, G) for _, itr in inputs]), R)
    plans = [inn.send_plan(itr, counts, r, G) for r, (_, itr) in enumerate(inputs)]
    layout = inn.record_layout([H * 4], G)
    stride, half = layout.stride, 1 << 22
    rdma = [torch.zeros(2 * half, dtype=torch.uint8) for _ in range(R)]
    signals = [[0] * (2 * N) for _ in range(R)]

    def execute(push_table, src):
        for dst, loff, roff, st, recs, slot in push_table:
            per = inn.chunk_records(st, chunk_bytes)
            for first in range(0, recs, per):
                n = min(per, recs - first)
                a, b = loff + first * st, roff + first * st
                assert b % 16 == 0 and a % 16 == 0 and n * st <= inn.CMD_MAX_BYTES and n <= inn.CMD_MAX_VALUE
                rdma[dst][b:b + n * st] = rdma[src][a:a + n * st]
                signals[dst][slot] += n

    for r, (x, _) in enumerate(inputs):
        p = plans[r]
        S1 = p.hop1_token.numel()
        inn.pack_records(rdma[r][:S1 * stride].view(S1, stride), [x], p, layout)
    for r in range(R):
        node = r // G
        recv = inn.recv_counts(counts, r, G)
        own, so, ro = plans[r].node_send[node], inn.block_offsets(plans[r].node_send, stride), inn.block_offsets(recv, stride)
        rdma[r][half + ro[node]:half + ro[node] + own * stride] = rdma[r][so[node]:so[node] + own * stride]
        execute(inn.dispatch_push_rows(counts, plans[r], r, G, stride, half), r)
    final = [torch.zeros((inn.num_recv_rows(counts, r), layout.final_bytes), dtype=torch.uint8) for r in range(R)]
    fwd = []
    for f in range(R):
        for slot, c in inn.dispatch_waits(counts, f, G):
            assert signals[f][slot] == c, (f, slot)
        A = sum(inn.recv_counts(counts, f, G))
        arrivals = rdma[f][half:half + A * stride].view(A, stride)
        dest = inn.stamp_arrivals(arrivals, layout, G)
        fwd.append(dest)
        node = f // G
        for j in range(G):
            sel = dest[:, j] >= 0
            final[node * G + j][dest[sel, j]] = arrivals[sel, :layout.final_bytes]
    recv_x = [final[r][:, :H * 4].contiguous().view(torch.float32) for r in range(R)]
    src_idx = [inn.int32_column(final[r], layout.src_idx_offset) for r in range(R)]
    arrival = [inn.int32_column(final[r], layout.arrival_offset) for r in range(R)]

    # combine: y = per-rank transform of the received rows (fresh values, not the payload)
    ys = [recv_x[r] * (r + 1.5) + 0.25 for r in range(R)]
    C = H
    cstride = inn._align(4 * C)
    gather = [torch.zeros((G, max(1, sum(inn.recv_counts(counts, f, G))), C)) for f in range(R)]
    for d in range(R):
        src_rank = torch.repeat_interleave(torch.arange(R), counts.rank_counts[:, d])
        fl = src_rank % G
        node = d // G
        for i in range(ys[d].size(0)):
            gather[node * G + int(fl[i])][d % G, arrival[d][i]] = ys[d][i]
    rdma = [torch.zeros(2 * half, dtype=torch.uint8) for _ in range(R)]
    for f in range(R):
        A = fwd[f].size(0)
        partial = torch.zeros((A, C))
        for j in range(G):
            partial += torch.where((fwd[f][:, j] >= 0).unsqueeze(1), gather[f][j, :A], torch.zeros(A, C))
        rdma[f][:A * cstride].view(A, cstride)[:, :4 * C] = partial.view(torch.uint8)
    for f in range(R):
        node = f // G
        recv = inn.recv_counts(counts, f, G)
        back = counts.node_counts[f].tolist()
        own = recv[node]
        bo, ao = inn.block_offsets(back, cstride), inn.block_offsets(recv, cstride)
        rdma[f][half + bo[node]:half + bo[node] + own * cstride] = rdma[f][ao[node]:ao[node] + own * cstride]
        execute(inn.combine_push_rows(counts, f, G, cstride, half), f)
    combined = []
    for s in range(R):
        for slot, c in inn.combine_waits(counts, s, G):
            assert signals[s][slot] == c, (s, slot)
        back = plans[s].node_send
        S1 = sum(back)
        got = rdma[s][half:half + S1 * cstride].view(S1, cstride)[:, :4 * C].contiguous().view(torch.float32)
        out = torch.zeros((T, C))
        start = 0
        for c in back:
            out.index_add_(0, plans[s].hop1_token[start:start + c], got[start:start + c])
            start += c
        combined.append(out)
    return recv_x, src_idx, combined, ys, inputs


def _check_rank(rank, world, G, T, H, kind, seed, chunk_bytes):
    recv_x, src_idx, combined, ys, inputs = _simulate(world, G, T, H, kind, seed, chunk_bytes)
    x, itr = inputs[rank]
    res = ref.dispatch(x, None, None, is_token_in_rank=itr, num_experts=world, ranks_per_node=G)
    assert torch.equal(res.recv_x, recv_x[rank]), "dispatch rows differ from the reference's rank-major order"
    assert torch.equal(res.handle.recv_src_idx, src_idx[rank])
    back = ref.combine(ys[rank], res.handle)
    assert torch.equal(back.combined_x, combined[rank]), "combine differs from the reference's summation order"
    return int(res.recv_x.size(0))


@pytest.mark.parametrize("world,G", [(4, 2), (6, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty", "dropped"])
def test_simulated_internode_plan_matches_reference_dispatch_and_combine(world, G, kind):
    rows = run_distributed(_check_rank, world, G, 37, 16, kind, 3, 4096, timeout=120)
    if kind == "empty":
        assert rows == [0] * world
    elif kind == "skewed":
        assert rows[0] == 37 * world and rows[1:] == [0] * (world - 1)


def test_tiny_chunks_split_blocks_into_many_signalled_writes_and_still_match():
    run_distributed(_check_rank, 4, 2, 53, 8, "random", 5, 64, timeout=120)


def test_record_layout_is_16_byte_aligned_and_grows_with_ranks_per_node_without_a_cap():
    for G in (1, 2, 8, 9, 72):
        lay = inn.record_layout([7168 * 2, 56 * 4, 8 * 8, 8 * 4], G)
        assert lay.stride % 16 == 0 and lay.final_bytes % 16 == 0
        assert lay.stride >= lay.dest_rows_offset + 4 * G
        assert lay.final_bytes <= lay.stride


def test_chunking_respects_byte_cap_value_bits_and_rejects_unencodable_records():
    assert inn.chunk_records(16, 1 << 40) == inn.CMD_MAX_VALUE
    assert inn.chunk_records(1024, 2 << 20) == 2048
    assert inn.chunk_records(4096, 100) == 1  # one record larger than the cap still goes alone
    with pytest.raises(inn.InternodeError, match="multiple of 16"):
        inn.chunk_records(24, 1 << 20)
    with pytest.raises(inn.InternodeError, match="24-bit"):
        inn.chunk_records(inn.CMD_MAX_BYTES + 16, 1 << 20)


def test_topology_limits_come_from_the_command_format_not_fixed_gpu_or_node_counts():
    assert inn.check_topology(4096, 128) >= 64
    assert inn.check_topology(64, 1) == 512  # 64 nodes of 1 GPU: no 20-node limit
    with pytest.raises(ValueError, match="12-bit"):
        inn.check_topology(8192, 8)
    with pytest.raises(ValueError, match="must divide"):
        inn.check_topology(6, 4)


def test_area_check_names_rank_area_rows_and_setting():
    with pytest.raises(inn.InternodeError, match=r"rank 1: the dispatch receive \(RDMA\) area needs 3200 bytes"):
        inn.check_area("dispatch receive (RDMA)", [1, 100], 32, 1024, "num_rdma_bytes")
