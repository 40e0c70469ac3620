"""The planning kernels (csrc/kernels/internode_plan.cu) against the torch definitions in internode/plan.py, on one
GPU: the notify count row, the send plan and the packed wire records must be equal, element for element, over
random, skewed, empty and dropped routings, topologies from 2 x 1 to 8 nodes x 8 GPUs, and column widths that force
every vector width of the pack kernel."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from uccl_ep_train import native  # noqa: E402

if not (native.available() and hasattr(native.module(), "internode")):
    pytest.skip("uccl_ep_train._C has no internode submodule", allow_module_level=True)

from internode_cases import _routing  # noqa: E402
from uccl_ep_train.internode.plan import (Counts, _bytes_of, local_count_row, pack_records,  # noqa: E402
                                          record_layout, send_plan)
from uccl_ep_train.reference import get_dispatch_layout  # noqa: E402

K_ = native.module().internode
DEV = torch.device("cuda", 0)
STREAM = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
# (ranks, ranks per node, tokens, top-k, experts per rank)
SHAPES = [(2, 1, 4096, 8, 128), (4, 2, 333, 4, 3), (16, 8, 1000, 8, 4), (64, 8, 257, 8, 4), (8, 4, 1, 2, 2)]
KINDS = ["random", "skewed", "empty", "dropped"]


def _layout(R, G, T, K, epr, kind, seed):
    g = torch.Generator().manual_seed(seed)
    E = R * epr
    idx = _routing(kind, T, min(K, E), E, R, g)
    _, _, tpe, itr = get_dispatch_layout(idx, E, R, G)
    return idx.to(DEV), tpe.to(DEV), itr.to(DEV), g


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("R,G,T,K,epr", SHAPES)
def test_count_row_kernel_equals_local_count_row(R, G, T, K, epr, kind):
    idx, tpe, itr, _ = _layout(R, G, T, K, epr, kind, seed=R * 1000 + T)
    for tpe_in in (tpe.to(torch.int32), tpe.to(torch.int64), None):
        want = local_count_row(itr, G, tpe_in)
        got = torch.full_like(want, -7)
        K_.count_row(got.data_ptr(), itr.data_ptr(), itr.size(0), R, G, tpe_in.data_ptr() if tpe_in is not None else 0,
                     tpe_in is not None and tpe_in.dtype == torch.int64, tpe_in.numel() if tpe_in is not None else 0,
                     STREAM())
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"{kind} R={R} G={G}: count row differs at {(got != want).nonzero()[:4]}"


def test_count_row_kernel_refuses_rows_wider_than_its_shared_memory():
    itr = torch.ones((4, 8192), dtype=torch.bool, device=DEV)  # 8192 ranks + 8192 nodes > COUNT_ROW_MAX_BINS
    out = torch.empty(8192 * 3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="bins exceed"):
        K_.count_row(out.data_ptr(), itr.data_ptr(), 4, 8192, 1, 0, False, 0, STREAM())


def _random_counts(itr, R, G, rank, g):
    """Counts as notify would give them at ``rank``: other ranks' rows random, ours from itr."""
    N = R // G
    rank_counts = torch.randint(0, 50, (R, R), generator=g)
    rank_counts[rank] = itr.sum(0).cpu()
    node_counts = torch.randint(0, 50, (R, N), generator=g)
    node_counts[rank] = itr.view(-1, N, G).any(2).sum(0).cpu()
    return Counts(rank_counts, node_counts)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("R,G,T,K,epr", SHAPES)
def test_send_plan_kernel_equals_the_torch_send_plan(R, G, T, K, epr, kind):
    idx, _, itr, g = _layout(R, G, T, K, epr, kind, seed=R * 77 + T)
    N = R // G
    rank = R - 1
    counts = _random_counts(itr, R, G, rank, g)
    want = send_plan(itr, counts, rank, G)
    S1 = sum(want.node_send)
    table = torch.tensor([sum(want.node_send[:m]) for m in range(N)], dtype=torch.int64).to(DEV)
    got = [torch.full(shape, -7, dtype=dtype, device=DEV) for shape, dtype in
           (((T, R), torch.int64), ((S1,), torch.int64), ((S1, G), torch.int64), ((N, T), torch.int32))]
    # the node bases given, then counted by the kernel from the tokens (node_base 0): the same tables
    for node_base in (table.data_ptr(), 0):
        for t in got:
            t.fill_(-7)
        K_.send_plan(itr.data_ptr(), T, R, G, node_base, *[t.data_ptr() for t in got], STREAM())
        torch.cuda.synchronize()
        for name, a, b in zip(("dest_row_all", "hop1_token", "dest_rows", "row_of"), got,
                              (want.dest_row_all, want.hop1_token, want.dest_rows, want.row_of)):
            assert torch.equal(a, b.contiguous()), f"{kind} R={R} G={G} node_base={bool(node_base)}: {name} differs"


@pytest.mark.parametrize("kind", ["random", "dropped"])
@pytest.mark.parametrize("R,G,T,K,epr", SHAPES[:3])
@pytest.mark.parametrize("columns", ["bf16", "fp8_scales", "odd_widths"])
def test_pack_records_kernel_equals_the_torch_pack_with_own_records_in_the_receive_block(R, G, T, K, epr, kind,
                                                                                         columns):
    idx, _, itr, g = _layout(R, G, T, K, epr, kind, seed=R * 31 + T)
    rank = 0
    counts = _random_counts(itr, R, G, rank, g)
    plan = send_plan(itr, counts, rank, G)
    plan.hop1_token, plan.dest_rows = plan.hop1_token.contiguous(), plan.dest_rows.contiguous()
    H = 7168 if T <= 4096 and R <= 2 else 256
    if columns == "bf16":
        cols = [torch.randn((T, H), generator=g).to(torch.bfloat16), idx, torch.rand(idx.shape, generator=g)]
    elif columns == "fp8_scales":
        cols = [torch.randn((T, H), generator=g).to(torch.float8_e4m3fn), torch.rand((T, H // 128), generator=g),
                idx, torch.rand(idx.shape, generator=g)]
    else:  # rows of 2, 6, 12 and 24 bytes: the byte, int and 8-byte paths (bf16 payloads take the 16-byte one)
        cols = [torch.randint(0, 255, (T, 2), generator=g, dtype=torch.uint8),
                torch.randint(-9, 9, (T, 3), generator=g, dtype=torch.int16), torch.rand((T, 3), generator=g),
                torch.rand((T, 3), generator=g, dtype=torch.float64)]
    cols = [c.to(DEV) for c in cols]
    layout = record_layout([_bytes_of(c).size(1) for c in cols], G)
    S1 = plan.hop1_token.numel()
    node = rank // G
    own_first, own = sum(plan.node_send[:node]), plan.node_send[node]
    want = torch.randint(0, 255, (S1, layout.stride), generator=g, dtype=torch.uint8).to(DEV)
    send = want.clone()
    send_before = send.clone()
    own_dst = torch.randint(0, 255, (max(own, 1), layout.stride), generator=g, dtype=torch.uint8).to(DEV)
    own_before = own_dst.clone()
    pack_records(want, cols, plan, layout)
    rows = [_bytes_of(c) for c in cols]
    K_.pack_records(send.data_ptr(), own_dst.data_ptr(), own_first, own, layout.stride, plan.hop1_token.data_ptr(),
                    plan.dest_rows.data_ptr(), G, S1, [(r.data_ptr(), nb, off) for r, nb, off in
                                                      zip(rows, layout.column_bytes, layout.column_offsets)],
                    layout.src_idx_offset, layout.dest_rows_offset, STREAM())
    torch.cuda.synchronize()
    # every field the torch pack writes; bytes in between (padding, the arrival field) are not part of the record
    fields = [(off, nb) for off, nb in zip(layout.column_offsets, layout.column_bytes)]
    fields += [(layout.src_idx_offset, 4), (layout.dest_rows_offset, 4 * G)]
    remote = torch.ones(S1, dtype=torch.bool, device=DEV)
    remote[own_first:own_first + own] = False
    for off, nb in fields:
        assert torch.equal(send[remote, off:off + nb], want[remote, off:off + nb]), f"field at {off} differs"
        if own:
            assert torch.equal(own_dst[:own, off:off + nb], want[own_first:own_first + own, off:off + nb]), \
                f"own record field at {off} differs"
    assert torch.equal(send[~remote], send_before[~remote]), "our own node's records were written to the send area"
    if not own:
        assert torch.equal(own_dst, own_before), "nothing of ours for our node, yet the receive block was written"


@pytest.mark.parametrize("first", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("n,pad,fp8", [(4096, 0, False), (333, 77, True), (0, 5, False), (1, 0, True)])
def test_unpack_records_kernel_splits_final_rows_into_columns_with_local_ids_and_zero_padding(n, pad, fp8, in_place,
                                                                                               first):
    """in_place: the final rows are the arrivals themselves (one GPU per node), rows of the wire stride, and each
    row's arrival is its index (arrival offset -1). ``first``: where the reading starts, as a fraction of the rows
    (first_row: a gated reader starts with the own node's rows); the outputs are the same wherever it starts. A first
    row outside the rows is refused before any launch."""
    g = torch.Generator().manual_seed(n + pad)
    K, E, lo, L, H, G = 8, 64, 16, 16, 512, 2
    cols = [torch.randn((n, H), generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)]
    if fp8:
        cols.append(torch.rand((n, H // 128), generator=g))
    ids = torch.randint(-1, E, (n, K), generator=g)
    cols += [ids, torch.rand((n, K), generator=g)]
    layout = record_layout([_bytes_of(c).size(1) for c in cols], G)
    width = layout.stride if in_place else layout.final_bytes
    rows = torch.randint(0, 255, (n, width), generator=g, dtype=torch.uint8)
    for c, off, nb in zip(cols, layout.column_offsets, layout.column_bytes):
        rows[:, off:off + nb] = _bytes_of(c)
    fields = torch.randint(0, 1 << 30, (n, 2), generator=g, dtype=torch.int32)
    rows[:, layout.src_idx_offset:layout.src_idx_offset + 8] = fields.view(torch.uint8)
    final = rows.to(DEV)[:, :layout.final_bytes]
    out_rows = n + pad
    payload = cols[:-2]
    outs = [torch.full((out_rows,) + tuple(c.shape[1:]), 3, dtype=torch.uint8, device=DEV).view(c.dtype)
            if c.element_size() == 1 else torch.full((out_rows,) + tuple(c.shape[1:]), 3.0, device=DEV).to(c.dtype)
            for c in payload]
    got_ids = torch.full((out_rows, K), 99, dtype=torch.int64, device=DEV)
    got_w = torch.full((out_rows, K), 9.0, device=DEV)
    got_src, got_arr = (torch.full((n,), -5, dtype=torch.int64, device=DEV) for _ in range(2))
    K_.unpack_records(final.data_ptr(), final.stride(0), n, out_rows,
                      [(o.data_ptr(), nb, off) for o, nb, off in zip(outs, layout.column_bytes, layout.column_offsets)],
                      got_ids.data_ptr(), got_w.data_ptr(), layout.column_offsets[len(payload)],
                      layout.column_offsets[len(payload) + 1], K, lo, L, layout.src_idx_offset, got_src.data_ptr(),
                      -1 if in_place else layout.arrival_offset, got_arr.data_ptr(), STREAM(),
                      first_row=int(first * n))
    torch.cuda.synchronize()
    for bad in (-1, n + 1):
        with pytest.raises(ValueError, match=f"first_row {bad} outside 0..{n}"):
            K_.unpack_records(final.data_ptr(), final.stride(0), n, out_rows, [], 0, 0, 0, 0, 0, 0, 0,
                              layout.src_idx_offset, 0, -1, 0, STREAM(), first_row=bad)
    for c, o in zip(payload, outs):
        o = o.cpu()
        assert torch.equal(_bytes_of(o[:n]), _bytes_of(c)), "payload column differs"
        assert not _bytes_of(o[n:]).any(), "padding rows are not zero"
    local = (ids >= lo) & (ids < lo + L)
    want_ids = torch.cat([torch.where(local, ids - lo, -1), torch.full((pad, K), -1)])
    want_w = torch.cat([torch.where(local, cols[-1], 0.0), torch.zeros(pad, K)])
    assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.equal(got_w.cpu(), want_w)
    assert torch.equal(got_src.cpu(), fields[:, 0].to(torch.int64))
    assert torch.equal(got_arr.cpu(), torch.arange(n) if in_place else fields[:, 1].to(torch.int64))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("R,G,T,K,epr", SHAPES[:4])
def test_send_plan_written_with_the_count_row_and_pack_counted_from_it_on_the_device_equal_the_torch_ones(
        R, G, T, K, epr, kind):
    """Packing during notify, before the host read anything: the count row's launch also writes our send plan
    (count_row with send_plan; each node's base counted from the tokens) into tables sized for any counts, and
    pack_records takes our tokens per node from our count row on the device. The row must equal local_count_row
    with the per-expert columns, the tables torch's send_plan, and the records
    those of the torch pack, except our own node's, which are not written; nothing is written past the records. With
    a send limit one byte below them, nothing at all."""
    idx, tpe, itr, g = _layout(R, G, T, K, epr, kind, seed=R * 53 + T)
    N, rank = R // G, G  # node 1: our own node's records sit between others'
    want_row = local_count_row(itr, G, tpe)
    row = torch.full_like(want_row, -7)
    counts = _random_counts(itr, R, G, 0, g)
    want = send_plan(itr, counts, 0, G)
    want.hop1_token, want.dest_rows = want.hop1_token.contiguous(), want.dest_rows.contiguous()
    S1, cap = sum(want.node_send), T * N
    got = [torch.full(shape, -7, dtype=dtype, device=DEV) for shape, dtype in
           (((T, R), torch.int64), ((cap,), torch.int64), ((cap, G), torch.int64), ((N, T), torch.int32))]
    K_.count_row(row.data_ptr(), itr.data_ptr(), T, R, G, tpe.data_ptr(), tpe.dtype == torch.int64, tpe.numel(),
                 STREAM(), send_plan=tuple(t.data_ptr() for t in got))
    torch.cuda.synchronize()
    assert torch.equal(row, want_row), f"{kind} R={R} G={G}: the count row differs beside the send plan"
    for name, a, b in zip(("dest_row_all", "hop1_token", "dest_rows", "row_of"), got[:1] + [got[1][:S1], got[2][:S1]]
                          + got[3:], (want.dest_row_all, want.hop1_token, want.dest_rows, want.row_of)):
        assert torch.equal(a, b), f"{kind} R={R} G={G}: {name} differs"
    assert bool((got[1][S1:] == -7).all()), "send_plan wrote past the records"
    own_counts = row.data_ptr() + 8 * R

    cols = [torch.randn((T, 64), generator=g).to(torch.bfloat16).to(DEV), idx, torch.rand(idx.shape).to(DEV)]
    layout = record_layout([_bytes_of(c).size(1) for c in cols], G)
    rows = [_bytes_of(c) for c in cols]
    packed = [(r.data_ptr(), nb, off) for r, nb, off in zip(rows, layout.column_bytes, layout.column_offsets)]
    ref = torch.randint(0, 255, (S1, layout.stride), generator=g, dtype=torch.uint8).to(DEV)
    pack_records(ref, cols, want, layout)
    for limit in (S1 * layout.stride - 1, S1 * layout.stride):
        send = torch.randint(0, 255, (cap + 1, layout.stride), generator=g, dtype=torch.uint8).to(DEV)
        before = send.clone()
        K_.pack_records(send.data_ptr(), 0, 0, 0, layout.stride, got[1].data_ptr(), got[2].data_ptr(), G, cap, packed,
                        layout.src_idx_offset, layout.dest_rows_offset, STREAM(), node_counts=own_counts,
                        num_nodes=N, skip_node=rank // G, send_limit=max(limit, 0))
        torch.cuda.synchronize()
        if limit < S1 * layout.stride:
            assert torch.equal(send, before), "records past the send limit were written"
            continue
        own_first, own = sum(want.node_send[:1]), want.node_send[1]
        remote = torch.ones(S1, dtype=torch.bool, device=DEV)
        remote[own_first:own_first + own] = False
        fields = [(off, nb) for off, nb in zip(layout.column_offsets, layout.column_bytes)]
        fields += [(layout.src_idx_offset, 4), (layout.dest_rows_offset, 4 * G)]
        for off, nb in fields:
            assert torch.equal(send[:S1][remote, off:off + nb], ref[remote, off:off + nb]), f"field at {off} differs"
        assert torch.equal(send[:S1][~remote], before[:S1][~remote]), "our own node's records were written"
        assert torch.equal(send[S1:], before[S1:]), "records were written past the ones counted"


# (2, 1, 65): more counter bases than the kernel takes as arguments, given in a device table
@pytest.mark.parametrize("R,rank,lanes", [(2, 0, 4), (2, 1, 1), (4, 2, 3), (8, 0, 2), (2, 1, 65)])
@pytest.mark.parametrize("limits", ["go", "not_packed", "too_many_rows", "arrivals_too_big"])
@pytest.mark.parametrize("pad", [False, True])
def test_a_reader_before_the_count_read_takes_its_gate_rows_and_own_records_from_the_count_rows_on_the_device(
        R, rank, lanes, limits, pad):
    """gate_from_count_rows writes the gate table and words internode.plan.read_before_counts defines, from random
    count rows (one GPU per node: a source with no record for us gets no gate row); unpack_records given those words
    unpacks the rows they name -- our own block's rows straight from our columns at the send list's tokens (never
    packed), every other row from the arrivals -- cut at the rows received or padded with zero rows, and does
    nothing at all when the words say no (its outputs keep their sentinel). A field that lies in none of the
    columns given is refused before the launch."""
    from uccl_ep_train.internode.plan import READ_DIMS, READ_GO, read_before_counts

    g = torch.Generator().manual_seed(R * 100 + rank * 10 + lanes)
    words = 2 * R + 3
    rows = torch.randint(0, 40, (R, words), generator=g)
    rows[(rank + 1) % R, rank] = 0  # a source with nothing for us
    rows[rank, rank] += 1  # our own records: some
    rows[:, R:2 * R] = rows[:, :R]  # one GPU per node: tokens per node = per rank
    H, K, E = 256, 4, 8 * R
    cols = [torch.randn((1, H), generator=g).to(torch.bfloat16), torch.zeros(1, K, dtype=torch.int64),
            torch.zeros(1, K)]
    layout = record_layout([_bytes_of(c).size(1) for c in cols], 1)
    stride = layout.stride
    n, sent = int(rows[:, rank].sum()), int(rows[rank, R:2 * R].sum())
    send_limit = sent * stride if limits != "not_packed" else sent * stride - 1
    receive = n * stride if limits != "arrivals_too_big" else n * stride - 16
    cap = n + 5 if limits != "too_many_rows" else n - 1
    bases = torch.randint(0, 1 << 40, (R * lanes,), generator=g)
    want_table, want_dims = read_before_counts(rows[:, :R], rows[:, R:2 * R], rank, lanes, bases.tolist(), stride,
                                               send_limit, receive, cap)
    assert bool(want_dims[READ_GO]) == (limits == "go")
    d_rows = rows.to(DEV)
    table = torch.full((R, 4 + lanes), -7, dtype=torch.int64, device=DEV)
    dims = torch.full((READ_DIMS,), -7, dtype=torch.int64, device=DEV)
    d_bases = bases.to(DEV)
    by_value, in_table = ([], d_bases.data_ptr()) if R * lanes > K_.READ_MAX_COUNTERS else (bases.tolist(), 0)
    K_.gate_from_count_rows(d_rows.data_ptr(), words, R, rank, lanes, by_value, stride, send_limit, receive,
                            cap, table.data_ptr(), dims.data_ptr(), STREAM(), counter_bases_table=in_table)
    with pytest.raises(ValueError, match="counter bases"):  # one per (source, lane), no more than the kernel takes
        K_.gate_from_count_rows(d_rows.data_ptr(), words, R, rank, lanes, bases.tolist()[1:], stride, send_limit,
                                receive, cap, table.data_ptr(), dims.data_ptr(), STREAM())
    assert dims.cpu().tolist()[:6] == want_dims[:6]
    assert table.cpu()[:len(want_table)].tolist() == want_table

    # the reader: arrivals (blocks by source, ours left as garbage, random record bytes) and our own columns, from
    # which our own rows come at the send list's tokens
    arrivals = torch.randint(0, 255, (max(n, 1), stride), generator=g, dtype=torch.uint8)
    ids = torch.randint(-1, E, (arrivals.size(0), K), generator=g)
    arrivals[:, layout.column_offsets[1]:layout.column_offsets[1] + 8 * K] = ids.view(torch.uint8).view(-1, 8 * K)
    w = torch.rand((arrivals.size(0), K), generator=g)
    arrivals[:, layout.column_offsets[2]:layout.column_offsets[2] + 4 * K] = w.view(torch.uint8).view(-1, 4 * K)
    T = 50
    own_x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    own_ids, own_w = torch.randint(-1, E, (T, K), generator=g), torch.rand((T, K), generator=g)
    tokens = torch.randint(0, T, (sent,), generator=g)  # the send list's tokens (any, repeats too)
    own_cols = [own_x.to(DEV), own_ids.to(DEV), own_w.to(DEV)]
    d_tokens = tokens.to(DEV)
    d_arr = arrivals.to(DEV)
    capacity = max(cap, 0) + 3
    out_x = torch.full((capacity, H), 3.0, device=DEV).to(torch.bfloat16)
    got_ids = torch.full((capacity, K), 99, dtype=torch.int64, device=DEV)
    got_w = torch.full((capacity, K), 9.0, device=DEV)
    got_src, got_arr = (torch.full((capacity,), -5, dtype=torch.int64, device=DEV) for _ in range(2))
    lo_e, epr = 8 * rank, 8
    own_columns = [(c.data_ptr(), nb, off) for c, nb, off in zip(own_cols, layout.column_bytes, layout.column_offsets)]
    unpack = lambda cols: K_.unpack_records(  # noqa: E731
        d_arr.data_ptr(), stride, capacity, capacity,
        [(out_x.data_ptr(), layout.column_bytes[0], layout.column_offsets[0])], got_ids.data_ptr(), got_w.data_ptr(),
        layout.column_offsets[1], layout.column_offsets[2], K, lo_e, epr, layout.src_idx_offset, got_src.data_ptr(),
        -1, got_arr.data_ptr(), STREAM(), dims=dims.data_ptr(), pad=pad, own=(0, 0, 0, d_tokens.data_ptr(), cols))
    with pytest.raises(ValueError, match="lies in none of the own columns"):  # the weights' column left out
        unpack(own_columns[:2])
    unpack(own_columns)
    torch.cuda.synchronize()
    if limits != "go":
        assert (got_ids == 99).all() and (got_src == -5).all(), "a reader told no wrote its outputs"
        return
    _, first, _, own_first, own_count = want_dims[1:6]
    final = arrivals[:n].clone()
    x = final[:, :layout.column_bytes[0]].contiguous().view(torch.bfloat16)
    ids = final[:, layout.column_offsets[1]:layout.column_offsets[1] + 8 * K].contiguous().view(torch.int64)
    w = final[:, layout.column_offsets[2]:layout.column_offsets[2] + 4 * K].contiguous().view(torch.float32)
    src = final[:, layout.src_idx_offset:layout.src_idx_offset + 4].contiguous().view(torch.int32).view(-1).long()
    mine = tokens[own_first:own_first + own_count]  # our own block: the columns' rows at those tokens
    x[first:first + own_count], ids[first:first + own_count] = own_x[mine], own_ids[mine]
    w[first:first + own_count], src[first:first + own_count] = own_w[mine], mine
    local = (ids >= lo_e) & (ids < lo_e + epr)
    assert torch.equal(out_x[:n].cpu().view(torch.int16), x.view(torch.int16))
    assert torch.equal(got_ids[:n].cpu(), torch.where(local, ids - lo_e, -1))
    assert torch.equal(got_w[:n].cpu(), torch.where(local, w, 0.0))
    assert torch.equal(got_src[:n].cpu(), src)
    assert torch.equal(got_arr[:n].cpu(), torch.arange(n))
    if pad:  # padded to the outputs' rows: zero payload, ids -1, weights 0
        assert not out_x[n:].view(torch.int16).any() and (got_ids[n:] == -1).all() and not got_w[n:].any()
    else:  # cut at the rows received: the rest untouched
        assert (got_ids[n:] == 99).all() and (got_src[n:] == -5).all()


@pytest.mark.parametrize("chunked", [False, True], ids=["one-launch", "chunked"])
@pytest.mark.parametrize("T,K,E", [(4096, 8, 256), (333, 4, 6), (1, 2, 3), (0, 8, 16), (8192, 8, 1024),
                                   (3000, 6, 1)])
def test_pair_ranks_kernel_ranks_each_pair_among_the_earlier_pairs_of_its_expert_and_marks_dropped_slots(T, K, E,
                                                                                                       chunked):
    """expert_major_pair_ranks against its definition, over ids with dropped slots (-1), duplicate experts within a
    token and expert counts that are no multiple of a block's four experts: rank = the (token, slot) pairs before it
    in (token, slot) order that name the same expert; -1 on a dropped slot. Both ways: the one launch, and (with a
    workspace) the three over chunks of pairs, whose counts cross chunk, warp and lane boundaries here (one expert
    only: every pair of a chunk counts)."""
    g = torch.Generator().manual_seed(T + K + E)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[torch.rand((T, K), generator=g) < 0.1] = -1
    flat = idx.view(-1)
    want = torch.full_like(flat, -1)
    for e in range(E):
        hit = (flat == e).nonzero().flatten()
        want[hit] = torch.arange(hit.numel())
    got = torch.full((T, K), 12345, dtype=torch.int32, device=DEV)  # (poisoned: every entry must be written)
    nbytes = K_.expert_major_pair_ranks_workspace_bytes(T, K, E) if chunked else 0
    work = torch.full((max(nbytes, 1),), 0x7F, dtype=torch.uint8, device=DEV)  # (poisoned: counts are written first)
    K_.expert_major_pair_ranks(idx.to(DEV).data_ptr(), T, K, E, got.data_ptr(), STREAM(),
                               workspace=work.data_ptr() if nbytes else 0, workspace_bytes=nbytes)
    assert torch.equal(got.cpu().view(-1).to(torch.int64), want)
    if chunked and T * K:
        assert nbytes == -(-T * K // 256) * E * 4, nbytes
        with pytest.raises(ValueError, match="workspace"):  # too small: refused before any launch
            K_.expert_major_pair_ranks(idx.to(DEV).data_ptr(), T, K, E, got.data_ptr(), STREAM(),
                                       workspace=work.data_ptr(), workspace_bytes=nbytes - 4)


@pytest.mark.parametrize("counts,alignment,rows", [([5, 0, 9, 1], 4, 24), ([5, 0, 9, 1], 4, 40), ([3, 3], 1, 6),
                                                   ([0, 0, 0], 8, 16), ([130] * 700, 128, 700 * 256)])
def test_pad_kernel_zeroes_exactly_the_rows_no_pair_fills_and_marks_them_empty_in_the_plan(counts, alignment, rows):
    """expert_major_pad: each segment's padding up to the alignment and the tail up to the rows (sync-free mode) are
    zeroed, with their plan columns -1 / 0; every row a pair fills keeps its bytes (poisoned before). More local
    experts than a block has threads take the scan's later chunks."""
    L, H, S = len(counts), 64, 3
    filled = torch.zeros(rows, dtype=torch.bool)
    begin = 0
    for c in counts:
        filled[begin:begin + c] = True
        begin += (c + alignment - 1) // alignment * alignment
    info = torch.tensor([sum(counts), 0] + counts, dtype=torch.int32, device=DEV)
    x = torch.full((rows, H), 7, dtype=torch.uint8, device=DEV)
    sc = torch.full((rows, S), 2.5, device=DEV)
    cols = [torch.full((rows,), 9, dtype=torch.int64, device=DEV) for _ in range(3)]
    w = torch.full((rows,), 0.25, device=DEV)
    K_.expert_major_pad(info.data_ptr(), L, alignment, rows, H, S, x.data_ptr(), sc.data_ptr(),
                        *(c.data_ptr() for c in cols), w.data_ptr(), 4, STREAM())
    f = filled.to(DEV)
    assert torch.equal(x, torch.where(f[:, None], 7, 0).to(torch.uint8).expand(rows, H))
    assert torch.equal(sc, torch.where(f[:, None], 2.5, 0.0).expand(rows, S))
    for c in cols:
        assert torch.equal(c, torch.where(f, 9, -1))
    assert torch.equal(w, torch.where(f, 0.25, 0.0))


@pytest.mark.parametrize("R,G,L,alignment", [(2, 1, 32, 1), (4, 2, 3, 8), (8, 4, 256, 128), (2, 1, 1, 4)])
def test_places_kernel_makes_the_readers_table_and_plan_sizes_from_the_count_rows_as_the_host_does(R, G, L, alignment):
    """expert_major_places from every rank's count row on the device (rows wider than their words, as notify's area
    lays them out) against internode.plan.expert_major_places and the plan's sizes (rows received, 0, pairs per local
    expert) the host uploaded before: equal for every rank, with sources and experts that send nothing."""
    from uccl_ep_train.internode.plan import counts_from_rows, expert_major_places, recv_expert_counts

    N, E = R // G, R * L
    g = torch.Generator().manual_seed(R * 1000 + L * 10 + alignment)
    words = R + N + E
    row_words = words + 3  # (the area's rows are aligned past the words)
    mat = torch.randint(0, 50, (R, words), generator=g)
    mat[torch.rand((R, words), generator=g) < 0.2] = 0  # sources and experts with nothing
    rows = torch.full((R, row_words), -9, dtype=torch.int64)
    rows[:, :words] = mat
    d_rows = rows.to(DEV)
    counts = counts_from_rows(mat, R, N, num_experts=E)
    for rank in range(R):
        raw = recv_expert_counts(counts, rank, L)
        aligned = [(c + alignment - 1) // alignment * alignment for c in raw]
        want = torch.from_numpy(expert_major_places(counts, rank, L, aligned))
        places = torch.full((R + 1 + 2 * R * L,), -7, dtype=torch.int64, device=DEV)
        info = torch.full((L + 2,), -7, dtype=torch.int32, device=DEV)
        K_.expert_major_places(d_rows.data_ptr(), row_words, R, N, rank, L, alignment, places.data_ptr(),
                               info.data_ptr(), STREAM())
        assert torch.equal(places.cpu(), want), rank
        assert info.cpu().tolist() == [int(mat[:, rank].sum()), 0] + [int(c) for c in raw], rank
        # a reader before the counts: go cleared exactly when the padded segments pass the outputs' rows
        total = sum(aligned)
        for capacity, go in ((total, 1), (total - 1, 0))[:2 if total else 1]:
            dims = torch.ones(8, dtype=torch.int64, device=DEV)
            K_.expert_major_places(d_rows.data_ptr(), row_words, R, N, rank, L, alignment, places.data_ptr(),
                                   info.data_ptr(), STREAM(), dims=dims.data_ptr(), capacity_rows=capacity)
            assert dims.cpu().tolist() == [go] + [1] * 7, (rank, capacity)
    with pytest.raises(ValueError, match="per-expert counts"):  # rows without every rank's experts
        K_.expert_major_places(d_rows.data_ptr(), R + N, R, N, 0, L, alignment, places.data_ptr(), info.data_ptr(),
                               STREAM())


# (2, 2, 1, 65): more counter bases than the kernel takes as arguments, given in a device table
@pytest.mark.parametrize("N,G,rank,lanes", [(2, 2, 1, 2), (2, 4, 6, 1), (3, 2, 2, 3), (4, 2, 7, 2), (2, 2, 1, 65)])
@pytest.mark.parametrize("limits", ["go", "not_packed", "arrivals_too_big", "final_rows_too_big", "outputs_too_small",
                                    "rows_without_ready_words"])
def test_a_forward_before_the_count_read_takes_the_hosts_tables_from_the_count_rows_and_packs_only_our_own_records(
        N, G, rank, lanes, limits):
    """forward_from_count_rows writes what internode.plan.forward_before_counts defines from random count rows, and
    that is what the host's forward after the count read uses: the gate table of dispatch_gate_blocks, the block
    table of forward_block_bases, each local GPU's final rows; the forward goes only when our records were pushed
    during notify, our arrivals fit the receive area and every local GPU's final rows fit, the unpack only when the
    forward goes and our final rows fit the outputs. pack_records given those words writes our own node's records,
    and only those, into our own block among the arrivals, byte for byte as the host's pack of that range does, and
    nothing when the forward does not go. With ready words (the unpack beside the forward) the unpack goes only when
    every local GPU's final rows have one."""
    from uccl_ep_train.internode.plan import (FORWARD_DIMS, READ_DIMS, READ_FIRST_ROW, READ_GO, READ_OWN_COUNT,
                                              READ_OWN_FIRST, dispatch_gate_blocks, forward_before_counts,
                                              forward_block_bases, gate_rows)

    R = N * G
    node, local = divmod(rank, G)
    g = torch.Generator().manual_seed(N * 1000 + G * 100 + rank * 10 + lanes)
    words = R + N + 5
    rows = torch.randint(0, 40, (R, words), generator=g)
    rows[((node + 1) % N) * G + local, R + node] = 0  # a source node with nothing for us: no gate row
    rows[rank, R + node] += 1  # our own node's records: some
    rc, nc = rows[:, :R].clone(), rows[:, R:R + N].clone()
    T, H, K = 40, 128, 4  # our own records' columns (the pack below)
    cols = [torch.randn((T, H), generator=g).to(torch.bfloat16), torch.randint(-1, 64, (T, K), generator=g)]
    layout = record_layout([_bytes_of(c).size(1) for c in cols], G)
    stride, final_bytes = layout.stride, layout.final_bytes
    sent = int(nc[rank].sum())
    A = sum(int(nc[n * G + local, node]) for n in range(N))
    finals = rc[:, node * G:(node + 1) * G].sum(0)
    send_limit = sent * stride - (limits == "not_packed")
    receive = A * stride - 16 * (limits == "arrivals_too_big")
    final_limit = int(finals.max()) * final_bytes - (limits == "final_rows_too_big")
    cap = int(finals[local]) - (limits == "outputs_too_small")
    ready_rows = int(finals.max()) - (limits == "rows_without_ready_words") if lanes % 2 else 0  # (0: no words)
    bases = torch.randint(0, 1 << 40, (N * lanes,), generator=g).tolist()
    table, blocks, finals_at, want = forward_before_counts(rc, nc, rank, G, lanes, bases, stride, final_bytes,
                                                           send_limit, receive, final_limit, cap, ready_rows)
    assert bool(want[READ_GO]) == (limits in ("go", "outputs_too_small", "rows_without_ready_words"))
    assert bool(want[READ_DIMS + READ_GO]) == (limits == "go" or (limits == "rows_without_ready_words"
                                                                   and not ready_rows))
    counts = Counts(rc, nc)  # the host's tables after the count read
    assert table == gate_rows(dispatch_gate_blocks(counts, rank, G, lanes), node, lanes, bases)
    assert blocks == forward_block_bases(counts, rank, G).tolist()
    assert finals_at == finals.tolist()

    d_rows = rows.to(DEV)
    d_table = torch.full((N, 4 + lanes), -7, dtype=torch.int64, device=DEV)
    d_blocks = torch.full((N, 1 + G), -7, dtype=torch.int64, device=DEV)
    d_finals = torch.full((G,), -7, dtype=torch.int64, device=DEV)
    dims = torch.full((FORWARD_DIMS,), -7, dtype=torch.int64, device=DEV)
    args = (stride, final_bytes, send_limit, receive, final_limit, cap, ready_rows, d_table.data_ptr(),
            d_blocks.data_ptr(), d_finals.data_ptr(), dims.data_ptr(), STREAM())
    d_bases = torch.tensor(bases, dtype=torch.int64, device=DEV)
    if N * lanes > K_.READ_MAX_COUNTERS:
        K_.forward_from_count_rows(d_rows.data_ptr(), words, R, G, rank, lanes, [], *args,
                                   counter_bases_table=d_bases.data_ptr())
    else:
        K_.forward_from_count_rows(d_rows.data_ptr(), words, R, G, rank, lanes, bases, *args)
    with pytest.raises(ValueError, match="counter bases"):  # one per (node, lane)
        K_.forward_from_count_rows(d_rows.data_ptr(), words, R, G, rank, lanes, bases[1:], *args)
    with pytest.raises(ValueError, match="several GPUs per node"):
        K_.forward_from_count_rows(d_rows.data_ptr(), words, R, 1, rank, lanes, bases, *args)
    assert dims.cpu().tolist() == want
    assert d_table.cpu()[:len(table)].tolist() == table
    assert d_blocks.cpu().tolist() == blocks and d_finals.cpu().tolist() == finals_at

    # our own records: the send list's tokens and dest rows, the random columns above
    tokens = torch.randint(0, T, (sent,), generator=g).to(DEV)
    dest = torch.randint(-1, 50, (sent, G), generator=g).to(DEV)
    d_cols = [c.to(DEV) for c in cols]
    col_args = [(c.data_ptr(), _bytes_of(c).size(1), off) for c, off in zip(d_cols, layout.column_offsets)]
    got = torch.randint(0, 255, (A + 2, stride), generator=g, dtype=torch.uint8).to(DEV)
    host = got.clone()
    K_.pack_records(0, got.data_ptr(), 0, 0, stride, tokens.data_ptr(), dest.data_ptr(), G, T, col_args,
                    layout.src_idx_offset, layout.dest_rows_offset, STREAM(), own_dims=dims.data_ptr())
    with pytest.raises(ValueError, match="own_dims"):  # their range comes from the words
        K_.pack_records(0, got.data_ptr(), 1, 2, stride, tokens.data_ptr(), dest.data_ptr(), G, T, col_args,
                        layout.src_idx_offset, layout.dest_rows_offset, STREAM(), own_dims=dims.data_ptr())
    if want[READ_GO]:  # the host's pack of our own range, to our own block
        first, count = want[READ_OWN_FIRST], want[READ_OWN_COUNT]
        others = torch.empty((first + count, stride), dtype=torch.uint8, device=DEV)  # (the records before ours)
        K_.pack_records(others.data_ptr(), host.data_ptr() + want[READ_FIRST_ROW] * stride, first, count, stride,
                        tokens.data_ptr(), dest.data_ptr(), G, first + count, col_args, layout.src_idx_offset,
                        layout.dest_rows_offset, STREAM())
        assert count > 0
    torch.cuda.synchronize()
    assert torch.equal(got, host), "our own records differ from the host's pack, or other rows were written"
