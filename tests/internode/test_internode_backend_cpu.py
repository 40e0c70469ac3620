"""NativeInternodeBackend's own host path on CPU, with a stand-in for its native module (fake_internode_native.py):
the same comparisons against reference.py as test_internode_gpu.py, in multi-process gloo groups over emulated
topologies (2 nodes x 1 rank, 2 x 2, 4 x 1), and the deadline error of a peer that never pushes.

The stand-in moves bytes and signal counts through shared memory exactly as the push table says, so everything above
it is the backend's real code: transport choice, proxy bootstrap, notify through the proxies, packing, push tables
and waits, the own-node copy, stamping, the NVLink scatter and gather, expert-major receive, barriers, and
the error reporting. Every output must equal the reference bit for bit.
"""
from __future__ import annotations

import ctypes
import os
import time
import types

import pytest
import torch

from tests.distributed import run_distributed

import fake_internode_native as fake
from internode_cases import (ALL, EXPERT_MAJOR_CASES, OWN_ROW_CASES, area_too_small_after_a_push_during_notify,
                             EVERY_RANK_CASES, one_rank_context, worst_routing_in_hinted_buffers,
                             check_a_failed_rank_sends_and_forwards_nothing,
                             FORWARD_ROW_SHAPES, FORWARD_ROW_SHAPE_IDS,
                             check_forward_rows_sends_each_row_to_every_gpu_that_needs_it,
                             check_a_gated_unpack_reads_rows_only_after_their_chunks_land,
                             FORWARD_ARRIVAL_SHAPES, FORWARD_ARRIVAL_SHAPE_IDS,
                             check_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped,
                             check_a_chunk_whose_records_are_never_written_makes_pack_and_push_fail_naming_it,
                             check_pack_and_push_writes_the_records_of_pack_records_and_the_chunks_of_push_chunks,
                             check_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends,
                             check_node_sums_wait_for_tile_flags_and_name_a_gpu_that_never_flags,
                             check_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them,
                             check_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named,
                             compare_cases, one_forwarder_of_a_node_forwards_after_the_count_read,
                             records_past_the_partial_sums, too_few_worst_rows,
                             a_peers_next_count_row_leaves_this_calls_rows_intact)

RDMA = 16 << 20
NVL = 16 << 20
# Two proxy threads x two FIFOs and 4 KiB writes: a block of records is cut into many chunks spread over every lane.
ENV = {"UCCL_EP_NUM_PROXY_THREADS": "2", "UCCL_EP_FIFOS_PER_THREAD": "2", "UCCL_IB_MAX_INFLIGHT_BYTES": "4096",
       "UCCL_EP_CPU_TIMEOUT_SECS": "30", "UCCL_EP_GPU_TIMEOUT_SECS": "30"}


def _backends(rank, world, G, rdma=RDMA, nvl=None):
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext
    from uccl_ep_train.internode import NativeInternodeBackend
    from uccl_ep_train.reference import ReferenceBackend
    from uccl_ep_train.settings import load_settings

    fake.install()
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G,
                         device=torch.device("cpu"), num_nvl_bytes=NVL if nvl is None else nvl, num_rdma_bytes=rdma,
                         settings=load_settings())
    return NativeInternodeBackend(ctx), ReferenceBackend(ctx)


def _cases(rank, world, G, cases, iters):
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, iters, unweighted=True)
        return done, nat.proxy_stats(), list(nat._cx._names.values())
    finally:
        nat.destroy()


def _combine_barrier_decisions(rank, world, G, cases, iters, rdma):
    """compare_cases (dispatch, cached dispatch, combine, combine again without weights) in an RDMA region of
    ``rdma`` bytes; returns how many combines skipped their entry barrier."""
    nat, ref = _backends(rank, world, G, rdma)
    try:
        compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, iters, unweighted=True)
        return nat.combine_barriers_skipped, nat.dispatch_barriers_skipped
    finally:
        nat.destroy()


def _proxy_cpus(rank, world, G):
    """(this rank's share, what its context was given, whether setup warned that some of the share lies outside
    this process's CPUs, whether some does)."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        nat, _ = _backends(rank, world, G)
    try:
        warned = any("may not run on" in str(w.message) for w in seen)
        return (tuple(nat.proxy_cpus), tuple(nat._cx.cpus), warned,
                not set(nat.proxy_cpus) <= os.sched_getaffinity(0))
    finally:
        dist.barrier()  # (no rank tears its regions down while a peer still maps them)
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_each_rank_of_a_host_gives_its_proxy_its_own_share_of_the_proxy_cpus(world, G):
    """Every rank runs on this one host, whatever the emulated nodes: the host's list is split among all of them,
    each context gets its rank's share, and setup warns exactly where the share names CPUs this process may not
    run on (this machine's size decides which ranks do; a list of CPUs no machine has warns on every rank)."""
    out = run_distributed(_proxy_cpus, world, G, timeout=120, env=dict(ENV, UCCL_EP_PROXY_CPUS="4-11"))
    per = 8 // world
    assert [o[:2] for o in out] == [(tuple(range(4 + per * r, 4 + per * (r + 1))),) * 2 for r in range(world)]
    assert all(warned == outside for _, _, warned, outside in out), out
    far = run_distributed(_proxy_cpus, world, G, timeout=120, env=dict(ENV, UCCL_EP_PROXY_CPUS="100000-100007"))
    assert all(warned and outside for _, _, warned, outside in far), far


@pytest.mark.parametrize("world,G,tight", [(2, 1, 256 << 10), (4, 2, 300 << 10)], ids=["2x1", "2x2"])
def test_entry_barriers_are_skipped_after_the_other_kind_of_call_only_where_its_traffic_and_areas_allow(
        world, G, tight):
    cases = ALL[:3]  # random, skewed, empty routing
    # roomy: per (case, iteration) the first combine follows the cached dispatch and skips the barrier; the second
    # (without weights) follows a combine, so it must not; the third follows the second cached dispatch and skips it
    # again. That cached dispatch follows a combine: it skips its own where every rank sent to every other node in
    # both calls' routing -- random routing does; skewed and empty routing leave nodes without traffic, so they keep it
    out = run_distributed(_combine_barrier_decisions, world, G, cases, 2, 16 << 20, timeout=120, env=ENV)
    assert out == [(len(cases) * 2 * 2, 2)] * world
    # a region where a dispatch and a combine each fit but not side by side: every combine and dispatch keeps it
    out = run_distributed(_combine_barrier_decisions, world, G, cases, 1, tight, timeout=120, env=ENV)
    assert out == [(0, 0)] * world


def _raw_hop(rank, world, G):
    """A dispatch, then the raw hop of its handle (bench internode's raw transport) with fresh random bytes where the
    hop's push table reads: every block must land, byte for byte, where its row points on its destination; then the
    usual calls must still match the reference (the raw hop leaves the barrier rules a cached dispatch would).
    Returns (blocks this rank received and checked, blocks it sent, compare_cases' count)."""
    import hashlib

    import torch.distributed as dist

    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode.columns import _record_layout, _row_bytes

    nat, ref = _backends(rank, world, G)
    try:
        T, K, E, H = 96 + 13 * rank, 4, 4 * world, 256
        g = torch.Generator().manual_seed(40 + rank)
        idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
        x = torch.randn((T, H), generator=g).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)
        h = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None)).handle
        stride = _record_layout((_row_bytes(x),), G).stride
        nat.raw_dispatch_hop(h, [x])  # makes the hop plan; then again with the send area's bytes replaced
        rows = h.hop_plans[("dispatch", stride)].rows
        sent = []
        for dst, local, remote, row_stride, records, *_ in rows:
            n = row_stride * records
            nat._rdma[local:local + n] = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
            sent.append((dst, remote, n, hashlib.sha256(nat._rdma[local:local + n].numpy().tobytes()).hexdigest()))
        nat.raw_dispatch_hop(h, [x])
        every = [None] * world
        dist.all_gather_object(every, sent)
        mine = [(remote, n, digest) for per in every for dst, remote, n, digest in per if dst == rank]
        for remote, n, digest in mine:
            got = hashlib.sha256(nat._rdma[remote:remote + n].numpy().tobytes()).hexdigest()
            assert got == digest, f"rank {rank}: the block at {remote} ({n} bytes) is not what its sender held"
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, ALL[:2], 1, unweighted=True)
        return len(mine), len(sent), done
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_the_raw_hop_moves_the_send_areas_bytes_where_the_push_table_points_and_later_calls_still_match(world, G):
    out = run_distributed(_raw_hop, world, G, timeout=120, env=ENV)
    assert all(received > 0 and sent > 0 and done == 2 for received, sent, done in out), out
    assert sum(r for r, _, _ in out) == sum(s for _, s, _ in out)


def _cases_without_expert_counts(rank, world, G, cases, iters):
    """More experts than a notify row holds (the cap lowered to 1): the receiver counts the received expert ids."""
    from uccl_ep_train.internode import NativeInternodeBackend, notify

    NativeInternodeBackend.notify_max_experts = 1  # (this rank's process only)
    read = notify.counts_from_rows
    with_expert_counts = []  # per count matrix read: whether it carried per-expert counts

    def counts_from_rows(*a, **kw):
        counts = read(*a, **kw)
        with_expert_counts.append(counts.expert_counts is not None)
        return counts
    notify.counts_from_rows = counts_from_rows
    return _cases(rank, world, G, cases, iters), with_expert_counts


@pytest.mark.parametrize("world,G", [(4, 2)], ids=["2x2"])
def test_without_per_expert_counts_in_notify_the_received_ids_are_counted_and_outputs_still_match(world, G):
    cases = [ALL[0], ALL[3], ALL[6], ALL[8]]  # random, dropped, expert-major, FP8 expert-major with worst tokens
    out = run_distributed(_cases_without_expert_counts, world, G, cases, 1, timeout=120, env=ENV)
    assert all(done == len(cases) for (done, _, _), _ in out)
    assert all(seen and not any(seen) for _, seen in out), [seen for _, seen in out]


def _worst_routing_in_hinted_buffers(rank, world, G, scale, combine_dtype="bfloat16", combine_element_size=2):
    """Every token to every rank (one expert on each), in buffers of ``scale`` x Buffer.get_internode_bytes_hint for
    combines of ``combine_element_size``, the combine's x in ``combine_dtype``."""
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext, DispatchArgs
    from uccl_ep_train.buffer import Buffer
    from uccl_ep_train.internode import InternodeError, NativeInternodeBackend
    from uccl_ep_train.settings import load_settings

    T, H, E = 40, 256, 2 * world
    nvl, rdma = Buffer.get_internode_bytes_hint(T, H, world, world, G, combine_element_size=combine_element_size)
    fake.install()
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G,
                         device=torch.device("cpu"), num_nvl_bytes=int(nvl * scale), num_rdma_bytes=int(rdma * scale),
                         settings=load_settings())
    nat = NativeInternodeBackend(ctx)
    try:
        idx = (torch.arange(world) * 2).expand(T, world).contiguous()  # expert 2r lives on rank r
        x = torch.randn((T, H)).to(torch.bfloat16)
        w = torch.rand((T, world))
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)
        try:
            r = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w))
            nat.combine(r.recv_x.to(getattr(torch, combine_dtype)), r.handle, r.recv_topk_weights, None)
        except InternodeError as exc:
            return str(exc)
        return int(r.recv_x.size(0))
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G,beside", [(4, 2, "0"), (4, 1, "0"), (4, 2, "1")],
                         ids=["2x2", "4x1", "2x2-ready-words"])
def test_buffers_sized_by_the_internode_hint_hold_the_worst_routing_and_half_of_it_is_refused_clearly(world, G, beside):
    """(2x2-ready-words: the hint leaves room for the ready words of UCCL_EP_UNPACK_BESIDE_FORWARD below the flags.)"""
    env = dict(ENV, UCCL_EP_UNPACK_BESIDE_FORWARD=beside)
    assert (run_distributed(_worst_routing_in_hinted_buffers, world, G, 1.0, timeout=120, env=env)
            == [40 * world] * world)
    small = run_distributed(_worst_routing_in_hinted_buffers, world, G, 0.5, timeout=120, env=env)
    assert all(isinstance(m, str) and "area needs" in m and "raise num_" in m for m in small), small


def _hinted(rank, world, G):
    return worst_routing_in_hinted_buffers(
        lambda nvl, rdma: (*_backends(rank, world, G, rdma=rdma, nvl=nvl), torch.device("cpu")), rank, world, G)


@pytest.mark.parametrize("drains", ["always", "never"])
@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_every_token_to_every_rank_matches_in_buffers_of_exactly_the_hint_and_a_float32_combine_is_refused(
        world, G, drains):
    """Every output equals the reference, FP8 and expert-major too, in buffers of exactly the hint; a float32
    combine in them is refused naming the setting, on every rank alike, and the calls after it match. Without drains
    (a GPU per rank: verbs, or the loopback's copy agent) a sync-free dispatch after a combine packs its records
    during notify below that combine's partial sums and returns before the count read, so the hint's RDMA send half
    must hold both: with room for the larger only, it raised "raise num_rdma_bytes" (session 49, on a GPU)."""
    env = dict(ENV, UCCL_EP_DRAIN_AFTER_WAITS=drains)
    for done, refused in run_distributed(_hinted, world, G, timeout=180, env=env):
        assert done == len(EVERY_RANK_CASES) + 1, done
        assert refused is not None and "area needs" in refused and "raise num_" in refused, refused


def test_a_float32_combine_in_buffers_hinted_for_bfloat16_is_refused_clearly_and_fits_the_float32_hint():
    """The hint sizes combines in BF16 by default (a float32 partial row is the widest row and would double both
    regions); a caller that combines in float32 says so with combine_element_size=4."""
    from uccl_ep_train.buffer import Buffer

    refused = run_distributed(_worst_routing_in_hinted_buffers, 4, 2, 1.0, "float32", 2, timeout=120, env=ENV)
    assert all(isinstance(m, str) and "area needs" in m and "raise num_" in m for m in refused), refused
    assert run_distributed(_worst_routing_in_hinted_buffers, 4, 2, 1.0, "float32", 4, timeout=120,
                           env=ENV) == [40 * 4] * 4
    bf16, fp32 = (Buffer.get_internode_bytes_hint(4096, 7168, 8, 16, 8, combine_element_size=c) for c in (2, 4))
    # DeepSeek-V3 shape, 2 nodes x 8 GPUs: the NVL region holds the wider row, the RDMA halves a record and a sum
    assert fp32[0] > 1.9 * bf16[0] and 1.4 * bf16[1] < fp32[1] < 1.6 * bf16[1], (bf16, fp32)
    with pytest.raises(ValueError, match="combine_element_size must be 2"):
        Buffer.get_internode_bytes_hint(40, 256, 4, 4, 2, combine_element_size=1)


def _cases_with_a_small_write_limit_on_rank_1(rank, world, G, cases, iters):
    """Rank 1's transport takes writes of at most 2 KiB (an EFA device with a small max_rdma_size)."""
    if rank == 1:
        os.environ["FAKE_MAX_WRITE_BYTES"] = "2048"
    return _cases(rank, world, G, cases, iters)


@pytest.mark.parametrize("world,G", [(4, 2)], ids=["2x2"])
def test_one_ranks_smaller_transport_write_limit_bounds_every_ranks_chunks_and_outputs_still_match(world, G):
    # 4 KiB writes by default here (ENV): without the group-wide limit rank 1's transport would refuse them
    out = run_distributed(_cases_with_a_small_write_limit_on_rank_1, world, G, ALL[:3], 1, timeout=120, env=ENV)
    assert all(done == 3 for done, _, _ in out)
    # the stand-in posts one write at a time: its largest in flight is the largest write
    assert all(0 < stats["max_inflight_bytes"] <= 2048 for _, stats, _ in out), [s for _, s, _ in out]


def _cases_with_write_sizes(rank, world, G, cases, sizes):
    """Rank r asks for writes of sizes[r] bytes (UCCL_EP_WRITE_BYTES; None: unset): (pairs compared, the write size
    the rank used, the largest write its proxy posted)."""
    if sizes[rank] is not None:
        os.environ["UCCL_EP_WRITE_BYTES"] = str(sizes[rank])
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return done, nat.write_bytes, nat.proxy_stats()["max_inflight_bytes"]  # the stand-in posts one at a time
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_the_write_size_setting_cuts_every_ranks_chunks_at_the_groups_smallest_and_outputs_still_match(world, G):
    """UCCL_EP_WRITE_BYTES sets the write size apart from the in-flight cap (4 KiB here, used whole when unset: ENV):
    every rank cuts its chunks at the smallest size any rank asked for, since receivers
    derive their lanes from it, and no write the proxies post is larger."""
    sizes = [3072, 2048] + [None] * (world - 2)
    out = run_distributed(_cases_with_write_sizes, world, G, ALL[:3], sizes, timeout=120, env=ENV)
    assert [(done, used) for done, used, _ in out] == [(3, 2048)] * world
    assert all(0 < largest <= 2048 for _, _, largest in out)
    out = run_distributed(_cases_with_write_sizes, world, G, ALL[:1], [None] * world, timeout=120, env=ENV)
    assert [(done, used) for done, used, _ in out] == [(1, 4096)] * world  # unset: the whole cap below 256 KiB
    assert all(2048 < largest <= 4096 for _, _, largest in out)


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_every_output_matches_reference_over_routings_dtypes_and_layouts(world, G):
    out = run_distributed(_cases, world, G, ALL, 1, timeout=120, env=ENV)
    assert all(done == len(ALL) for done, _, _ in out)
    assert sum(st["commands"] for _, st, _ in out) > 10 * world, "the chunks did not go through push_chunks"
    left = [n for _, _, names in out for n in names if os.path.exists(os.path.join("/dev/shm", n))]
    assert not left, f"shared memory left behind after destroy: {left}"


def _cases_through_the_staging_area(rank, world, G, cases, nbytes):
    """The cases with the backend's small tables uploaded through an upload staging area of ``nbytes`` (as on a GPU;
    the stand-in has none: its "copy" is a memmove, run at once); returns (cases done, upload_counts())."""
    from uccl_ep_train.upload_staging import UploadStaging

    nat, ref = _backends(rank, world, G)
    try:
        assert nat.upload_counts() is None  # (no area on the stand-in)
        nat._staging = UploadStaging(torch.device("cpu"), lambda dst, src, n, stream: ctypes.memmove(dst, src, n),
                                     nbytes=nbytes, pinned=False)
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 2, unweighted=True)
        return done, nat.upload_counts()
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_tables_uploaded_through_the_staging_area_give_the_same_outputs_and_fall_back_only_when_it_is_full(world, G):
    """Uploads through the pinned staging area (upload_staging.py, every GPU run) on the stand-in: the outputs still
    equal the reference, and upload_counts reports the tables staged. With a 1 MiB area nothing falls back to a
    pageable copy over these calls; with a 64-byte area, which most tables do not fit, some do, and the outputs are
    the same."""
    out = run_distributed(_cases_through_the_staging_area, world, G, ALL[:4], 1 << 20, timeout=120, env=ENV)
    assert [done for done, _ in out] == [8] * world, out  # 4 cases, twice each
    assert all(c["staged"] > 0 and c["fallbacks"] == 0 for _, c in out), out
    out = run_distributed(_cases_through_the_staging_area, world, G, ALL[:4], 64, timeout=120, env=ENV)
    assert [done for done, _ in out] == [8] * world, out  # 4 cases, twice each
    assert all(c["fallbacks"] > 0 for _, c in out), out


def _gather_beside_push_order(rank, world, G, cases):
    """compare_cases with the calls of the pipelined gather's kernels and the stream orderings recorded in order:
    (cases done, the events of the last combine, gathers launched beside the push)."""
    nat, ref = _backends(rank, world, G)
    events = []
    gather, pack_and_push, stream_wait = nat._k.gather_tiles, nat._cx.pack_and_push, nat._cx.stream_wait

    def on_gather(*a, **k):
        events.append(("gather", a[14]))  # (its stream argument)
        return gather(*a, **k)

    def on_push(*a, **k):
        events.append(("push", nat._cx.spin_blocks) if k.get("node_sums") else ("other push",))
        return pack_and_push(*a, **k)

    def on_wait(waiter, signaller):
        events.append(("wait", waiter, signaller))
        return stream_wait(waiter, signaller)
    nat._k = types.SimpleNamespace(**{n: getattr(nat._k, n) for n in dir(nat._k) if not n.startswith("__")})
    nat._k.gather_tiles, nat._cx.pack_and_push, nat._cx.stream_wait = on_gather, on_push, on_wait
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        last = max(i for i, e in enumerate(events) if e[0] == "gather")
        return done, events[last - 1:last + 4], nat.gathers_beside_push
    finally:
        nat.destroy()


def test_a_pipelined_gather_runs_on_the_side_stream_between_a_fork_and_a_join_around_its_node_sum_push():
    """With UCCL_EP_GATHER_BESIDE_PUSH (the default) the local side of the pipelined combine gather is launched on the
    context's second stream after it waited for ours (fork), the node sum and push is launched on ours held to
    UCCL_EP_GATHER_BESIDE_PUSH_BLOCKS blocks, and only then does our stream wait for the side stream (join): the
    push runs beside the copies, and whatever follows comes after them. Outputs equal the reference either way; with
    the setting off the gather runs on our stream and no wait is queued."""
    out = run_distributed(_gather_beside_push_order, 4, 2, ALL[:4], timeout=120,
                          env={**ENV, "UCCL_EP_GATHER_BESIDE_PUSH_BLOCKS": "24"})
    for done, events, beside in out:
        assert done == 4 and beside >= 4
        assert [e[0] for e in events] == ["wait", "gather", "push", "wait"], events
        (_, fork_waiter, fork_signaller), (_, gather_stream), (_, blocks), (_, join_waiter, join_signaller) = events
        side = fake.InternodeContext.side_stream
        assert (fork_waiter, gather_stream, join_signaller) == (side, side, side)
        assert fork_signaller == join_waiter != side  # our stream
        assert blocks == 24
    out = run_distributed(_gather_beside_push_order, 4, 2, ALL[:4], timeout=120,
                          env={**ENV, "UCCL_EP_GATHER_BESIDE_PUSH": "0"})
    for done, events, beside in out:
        assert done == 4 and beside == 0
        assert [e[0] for e in events[1:3]] == ["gather", "push"] and "wait" not in [e[0] for e in events], events
        assert events[1][1] != fake.InternodeContext.side_stream and events[2][1] == 0  # (no cap: ranks own GPUs)


def _packs_during_notify(rank, world, G, cases):
    """compare_cases, then an uncached dispatch of another size right after its last combine, then one right after a
    dispatch: (pairs compared, dispatches that packed during notify in compare_cases, and after it; send-plan tables
    made during a combine's hop and taken, in compare_cases and after it)."""
    from uccl_ep_train.backends import DispatchArgs

    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        packed, taken = nat.packs_during_notify, nat.spare_send_tables_taken
        idx = torch.randint(0, 4 * world, (64, 2), generator=torch.Generator().manual_seed(rank))
        x = torch.randn((64, 128)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        for _ in range(2):  # the first follows compare_cases' last combine; the second follows a dispatch
            nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        return done, packed, nat.packs_during_notify - packed, taken, nat.spare_send_tables_taken - taken
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_an_uncached_dispatch_right_after_a_combine_of_the_last_dispatch_packs_during_notify_and_still_matches(world,
                                                                                                            G):
    """Every case after the first starts right after the previous case's combine of its last dispatch's handle: its
    records for the other nodes are packed while notify runs (with several GPUs per node their final rows are
    rewritten after notify), and every output still equals the reference; a dispatch right after a dispatch packs
    after notify, as does every dispatch with UCCL_EP_PACK_DURING_NOTIFY=0. The send-plan tables of each packing
    during notify were made during the combine's hop before it, except for a dispatch of another size (64 tokens
    after 96 + 13 x rank), which makes its own."""
    cases = ALL[:4]
    out = run_distributed(_packs_during_notify, world, G, cases, timeout=120, env=ENV)
    assert out == [(len(cases), len(cases) - 1, 1, len(cases) - 1, 0)] * world
    out = run_distributed(_packs_during_notify, world, G, cases, timeout=120,
                          env=dict(ENV, UCCL_EP_PACK_DURING_NOTIFY="0"))
    assert out == [(len(cases), 0, 0, 0, 0)] * world


def _cases_counting(rank, world, G, cases, counters):
    """compare_cases, then (pairs compared, *the backend's counters named in ``counters``)."""
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return (done,) + tuple(getattr(nat, c) for c in counters)
    finally:
        nat.destroy()


# dispatches that packed during notify, that pushed during notify too, launches that did both at once, and of those
# the ones that pushed our count row too
PUSH_COUNTERS = ("packs_during_notify", "pushes_during_notify", "packs_and_pushes_during_notify",
                 "count_rows_pushed_with_records")


@pytest.mark.parametrize("world,G", [(2, 1), (4, 1), (4, 2)], ids=["2x1", "4x1", "2x2"])
def test_records_packed_during_notify_are_pushed_during_notify_with_one_or_several_gpus_per_node_and_still_match(
        world, G):
    """An uncached dispatch that packs its records during notify pushes them then too, each block placed by the
    kernel from the count rows (4 x 1: sources before and after ours), and every output still equals the reference.
    With several GPUs per node the records' dest rows count from their source's first token and the forwarder adds
    the rows of the sources before it (forward_row_bases), so they need no rewrite after notify. With
    UCCL_EP_PUSH_DURING_NOTIFY=0 the push waits for the host's plan. The pack and the push are one launch
    (pack_and_push_after_counts), which also pushes our count row to the others (no push of its own before it),
    unless UCCL_EP_PACK_AND_PUSH=0, which takes two launches after the row's."""
    cases = ALL[:4]
    out = run_distributed(_cases_counting, world, G, cases, PUSH_COUNTERS, timeout=120, env=ENV)
    for done, packed, pushed, fused, rows in out:
        assert (done, packed) == (len(cases), len(cases) - 1)
        assert 1 <= pushed <= packed, (G, packed, pushed)
        assert fused == packed == rows, (G, packed, fused, rows)
    out = run_distributed(_cases_counting, world, G, cases, PUSH_COUNTERS, timeout=120,
                          env=dict(ENV, UCCL_EP_PACK_AND_PUSH="0"))
    for done, packed, pushed, fused, rows in out:
        assert (done, packed, fused, rows) == (len(cases), len(cases) - 1, 0, 0)
        assert 1 <= pushed <= packed, (G, packed, pushed)
    out = run_distributed(_cases_counting, world, G, cases, PUSH_COUNTERS, timeout=120,
                          env=dict(ENV, UCCL_EP_PUSH_DURING_NOTIFY="0"))
    assert [(done, pushed, fused, rows) for done, _, pushed, fused, rows in out] == [(len(cases), 0, 0, 0)] * world


def _scenario(rank, world, G, which):
    """One of internode_cases' scenarios on the stand-in, with an RDMA area of 2 MiB."""
    nat, ref = _backends(rank, world, G, rdma=2 << 20)
    try:
        return dict(past=records_past_the_partial_sums, small=area_too_small_after_a_push_during_notify,
                    worst=too_few_worst_rows, one_after=one_forwarder_of_a_node_forwards_after_the_count_read,
                    row_ahead=a_peers_next_count_row_leaves_this_calls_rows_intact)[which](
            nat, ref, torch.device("cpu"), rank, world)
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_records_that_would_reach_the_last_combines_partial_sums_are_packed_after_notify_and_still_match(world, G):
    """Packing during notify is safe only below the last combine's partial sums, which may still be on the wire. The
    kernels counting on the device pack and push nothing when our records would pass them, and the host, applying
    the same rule to the counts after notify, packs and pushes after notify instead: the dispatch does not count as
    packed during notify, and every output equals the reference; the next dispatch that fits packs during notify."""
    out = run_distributed(_scenario, world, G, "past", timeout=120, env=ENV)
    for seen, same in out:
        assert same, "an output differs from the reference"
        (p0, q0), (p1, q1), (p2, q2) = seen
        assert (p1, q1) == (p0, q0), f"the dispatch past the partial sums packed during notify: {seen}"
        assert p2 == p1 + 1 and q2 == q1 + 1, seen  # packed and pushed during notify, whatever the GPUs per node


@pytest.mark.parametrize("beside", ["0", "1"], ids=["barrier", "unpack-beside"])
def test_a_forwarder_whose_records_pass_the_partial_sums_forwards_after_the_count_read_beside_its_nodes_others(beside):
    """2 x 2 (docs/internode.md, "The forward before the count read"): where one GPU of a node may not forward before
    the count read (its records pass the last combine's partial sums, so they are pushed after notify) and its node's
    other GPU does, that other GPU forwards from the count rows and waits at the node barrier for the first one's flag,
    which its forward after the count read raises at the same epoch; every output equals the reference. With the
    unpack beside the forward, the other GPU's unpack waits for the ready words that forward releases, at that epoch
    too."""
    out = run_distributed(_scenario, 4, 2, "one_after", timeout=120,
                          env=dict(ENV, UCCL_EP_UNPACK_BESIDE_FORWARD=beside))
    for rank, ((f0, d0), (f1, d1)), same in ((r, *o) for r, o in enumerate(out)):
        assert same, f"rank {rank}: an output differs from the reference"
        assert (f0, d0) == (0, 0), (rank, f0, d0)  # the first dispatch follows no combine: read after notify
        assert (f1, d1) == ((0, 1) if rank == 0 else (1, 0)), (rank, f1, d1)


def test_an_area_too_small_for_records_pushed_during_notify_raises_on_every_rank_and_the_next_calls_match():
    """The area check comes after notify, so records pushed during notify have left already: the kernel sends
    nothing to a destination whose arrivals overflow its area, every rank raises the same area error from the same
    counts, a rank that did receive records waits for them first, and the next calls run and match the reference
    (the counters stayed in step)."""
    out = run_distributed(_scenario, 2, 1, "small", timeout=120, env=ENV)
    for rank, (err, in_step, pushed, done) in enumerate(out):
        assert "dispatch receive (RDMA)" in err and "num_rdma_bytes" in err, f"rank {rank}: {err}"
        assert in_step, f"rank {rank}: the dispatch counters are not at their targets after the error"
        assert pushed == 1 and done == 1, (rank, pushed, done)


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_a_receive_past_num_worst_tokens_raises_naming_it_on_every_rank_rank_or_expert_major_and_the_next_calls_match(
        world, G):
    """A dispatch whose received tokens (rank-major), or whose aligned expert-major rows (checked with the outputs
    before the reader's launch), exceed num_worst_tokens raises an InternodeError that says to raise it, after its
    records have landed (the counters at their targets), and the next rank-major and expert-major calls match."""
    out = run_distributed(_scenario, world, G, "worst", timeout=120, env=ENV)
    for rank, (seen, done) in enumerate(out):
        (rm_err, rm_in_step), (em_err, em_in_step) = seen
        assert "received" in rm_err and "raise num_worst_tokens" in rm_err, f"rank {rank}: {rm_err}"
        assert "expert-major receive needs" in em_err and "raise num_worst_tokens" in em_err, f"rank {rank}: {em_err}"
        assert rm_in_step and em_in_step, f"rank {rank}: the dispatch counters are not at their targets after an error"
        assert done == 2, (rank, done)


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_a_peers_next_count_row_lands_in_the_other_notify_area_and_back_to_back_dispatches_match(world, G):
    """A peer one count exchange ahead (two uncached dispatches back to back, or a dispatch that raised) pushes its
    next count row while our kernels may still read this call's rows: it lands in the other notify area, so this
    call's rows stay as they were, and both dispatches and the combine equal the reference. With one area the row
    overwrote them, and a reader's gate computed from them waited for records never sent (a rare stall of
    test_a_receive_past_num_worst_tokens_... in session 50)."""
    out = run_distributed(_scenario, world, G, "row_ahead", timeout=120, env=ENV)
    assert out[0][0] is True, "rank 0's count rows changed when a peer pushed its next row"
    assert all(same for _, same in out), out


def _hop_fields(p):
    return (p.rows, p.waits, p.gate_blocks, p.per_chunk, p.head_first, p.head_records, p.head_rows, p.tail_rows)


def _small_step(rank, world):
    """The planning tests' inputs: 64 tokens of 128 bf16 values, each to 2 of 4 experts per rank, with weights;
    returns (E, K, H, topk_idx, x, weights)."""
    E, K, T, H = 4 * world, 2, 64, 128
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    x, w = torch.randn((T, H), generator=g).to(torch.bfloat16), torch.rand((T, K), generator=g)
    return E, K, H, idx, x, w


def _uncached_dispatch(b, E, idx, x, w, **kw):
    from uccl_ep_train.backends import DispatchArgs

    tpr, tpn, tpe, itr = b.get_dispatch_layout(idx, E)
    return b.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w, **kw))


def _log_calls(obj, names, log, entry):
    """Wrap ``obj``'s methods ``names`` so that each call first appends ``entry(name)`` to ``log``."""
    for name in names:
        if hasattr(obj, name):
            real = getattr(obj, name)
            setattr(obj, name, lambda *a, _real=real, _name=name, **k: (log.append(entry(_name)), _real(*a, **k))[1])


def _plans_made_ahead(rank, world, G):
    """An uncached dispatch (bf16 with top-k weights), then a combine of its handle: the hop plans the handle holds
    after each, whether every plan equals the one its call would make at first use and has its device table, the
    plans made ahead in all, and what a planning guess whose areas do not fit leaves behind."""
    from uccl_ep_train.internode.columns import _record_layout
    from uccl_ep_train.internode.handle import PlannedAhead
    from uccl_ep_train.internode.plan import _align

    nat, _ = _backends(rank, world, G)
    try:
        E, K, H, idx, x, w = _small_step(rank, world)
        res = _uncached_dispatch(nat, E, idx, x, w)
        h = res.handle
        after_dispatch = sorted(h.hop_plans)
        nat.combine(res.recv_x, h, None, None)
        after_combine = sorted(h.hop_plans)
        same = True
        for (kind, stride), p in h.hop_plans.items():
            if kind == "combine":
                fresh = nat._combine_hop(h.counts, stride, nat._combine_shape(h.counts, stride).areas)
            else:
                fresh = nat._dispatch_hop(h.counts, h.plan, stride)
            same &= _hop_fields(p) == _hop_fields(fresh) and (p.table is not None or not p.rows)
        too_big = PlannedAhead()  # rows of a GiB fit no area
        nat._plan_ahead(h.counts, h.plan, [("dispatch", (1 << 30,)), ("combine", 1 << 30)], too_big, "test")
        bf16 = ("dispatch", _record_layout((2 * H,), G).stride)
        expected = ([("combine", _align(2 * H))],
                    sorted([("combine", _align(2 * H)), ("combine", _align(2 * H + 4 * K)), bf16]))
        return ((after_dispatch, after_combine) == expected, same, nat.plans_made_ahead,
                (too_big.hop_plans, too_big.combine_shapes, too_big.dispatch_shapes))
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_a_dispatch_plans_its_handles_next_combine_and_that_combine_the_backward_calls_as_their_first_use_would(
        world, G):
    """While its records land, an uncached dispatch plans its handle's combine of bf16 rows without weights; while
    that combine's partial sums land, it plans the backward's calls: a cached dispatch of the bf16 payload and a
    combine with the top-k weights. Each plan equals the one the call would make itself and is on the device; a guess
    whose rows fit no area is skipped, not raised (the call that needs it raises). UCCL_EP_PLAN_AHEAD=0 plans nothing
    ahead; its default, auto, plans ahead only with one GPU per node. The outputs of the calls that use the plans
    are compared with the reference by every other test here (2 x 1 plans ahead by default)."""
    out = run_distributed(_plans_made_ahead, world, G, timeout=120, env=dict(ENV, UCCL_EP_PLAN_AHEAD="1"))
    assert out == [(True, True, 3, ({}, {}, {}))] * world
    out = run_distributed(_plans_made_ahead, world, G, timeout=120, env=dict(ENV, UCCL_EP_PLAN_AHEAD="0"))
    assert [(same, made) for _, same, made, _ in out] == [(True, 0)] * world
    out = run_distributed(_plans_made_ahead, world, G, timeout=120, env=ENV)
    assert [(same, made) for _, same, made, _ in out] == [(True, 3 if G == 1 else 0)] * world


def _forward_bases_uploads(rank, world, G):
    """An uncached dispatch (bf16 with top-k weights) and a combine of its handle, which plans the backward's cached
    dispatch of another record layout: how often the forward block bases went through _upload, and whether the
    backward's shape reads the device copy the forward dispatch uploaded."""
    from uccl_ep_train.internode.plan import forward_block_bases

    nat, _ = _backends(rank, world, G)
    try:
        uploaded = []
        real = nat._upload
        nat._upload = lambda rows, *a, **k: (uploaded.append(rows), real(rows, *a, **k))[1]
        E, K, H, idx, x, w = _small_step(rank, world)
        res = _uncached_dispatch(nat, E, idx, x, w)
        nat.combine(res.recv_x, res.handle, None, None)
        bases = forward_block_bases(res.handle.counts, rank, G)
        shapes = list(res.handle.dispatch_shapes.values())  # (the backward's, planned ahead)
        return (sum(1 for t in uploaded if t is bases), len(shapes),
                all(s.forward_bases is nat._forward_bases_memo[1] for s in shapes))
    finally:
        nat.destroy()


def test_the_forward_bases_of_a_handle_are_uploaded_once_for_the_forward_dispatch_and_the_backwards_layout():
    """2 x 2: the forward dispatch and the backward's cached dispatch (planned during the combine) have different
    record layouts but the same counts, so the same forward bases; they go to the device once, and the backward's
    shape reads that copy (planning ahead on: at 2 x 2 its default is off)."""
    assert run_distributed(_forward_bases_uploads, 4, 2, timeout=120, env=dict(ENV, UCCL_EP_PLAN_AHEAD="1")) == \
        [(1, 1, True)] * 4


def _staged_plans_copied_at_the_next_entry(rank, world, G):
    """The stand-in backend given a staging area (as on a GPU) whose copies run at once and are logged: after an
    uncached dispatch whose plans were made while its reader ran (forced), which of its staged tables were copied; their
    device tables then poisoned, and after the next call (a combine, then a cached dispatch and a combine): whether
    each was copied at that call's entry, before its first kernel, and how many (case, iteration) pairs matched."""
    import ctypes

    from uccl_ep_train.upload_staging import UploadStaging

    nat, ref = _backends(rank, world, G)
    log = []

    def copy(dst, src, nbytes, stream):
        log.append(dst)
        ctypes.memmove(dst, src, nbytes)

    nat._staging = UploadStaging(torch.device("cpu"), copy, pinned=False)
    nat._plan_before_reader = lambda pending: False  # plans made while the reader runs (most of the hop landed)
    launches = []  # how many copies had run at each kernel launch
    _log_calls(nat._k, ("push_chunks", "pack_and_push", "unpack_records", "sum_node_partials", "gather_rows"),
               launches, lambda name: len(log))
    try:
        E, K, H, idx, x, w = _small_step(rank, world)
        res = _uncached_dispatch(nat, E, idx, x, w)
        staged = [st.out.data_ptr() for st in nat._staged_plans]
        copied_in_dispatch = [p for p in staged if p in log]
        for st in nat._staged_plans:
            st.out.fill_(-1)  # what a table never copied would hold: the combine below would move garbage
        del launches[:]
        before = len(log)
        ref_res = _uncached_dispatch(ref, E, idx, x, w)
        got = nat.combine(res.recv_x, res.handle, res.recv_topk_weights, None)
        want = ref.combine(ref_res.recv_x, ref_res.handle, ref_res.recv_topk_weights, None)
        first_launch = launches[0] if launches else None
        copied_at_entry = all(p in log[before:first_launch] for p in staged)
        same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, ALL[:1] + ALL[6:7], 1)
        return len(staged), copied_in_dispatch, copied_at_entry, same, done
    finally:
        nat.destroy()


def _expert_major_plans(rank, world, G):
    """An expert-major uncached dispatch whose hop was mostly in when its reader launched (forced): the order of the
    reader's launch (rank-major unpack or the expert-major reader), the expert-major copy's launch and the planning of
    the handle's next combine; whether anything was staged, whether the combine's plan equals the one it would make
    itself, and the pairs a case run matched."""
    from uccl_ep_train.internode.plan import _align

    nat, ref = _backends(rank, world, G)
    order = []
    nat._plan_before_reader = lambda pending: False
    _log_calls(nat._k, ("unpack_records", "expert_major_copy", "expert_major_receive"), order, lambda name: name)
    _log_calls(nat, ("_plan_ahead",), order, lambda name: "plan_ahead")
    try:
        E, K, H, idx, x, w = _small_step(rank, world)
        res = _uncached_dispatch(nat, E, idx, x, w, expert_major=True)
        key = ("combine", _align(2 * H))
        p = res.handle.hop_plans.get(key)
        fresh = nat._combine_hop(res.handle.counts, key[1], nat._combine_shape(res.handle.counts, key[1]).areas)
        same = p is not None and _hop_fields(p) == _hop_fields(fresh) and p.table is not None
        staged = len(nat._staged_plans)
        first = order[:]
        return first, staged, same, compare_cases(nat, ref, torch.device("cpu"), rank, world, ALL[6:7], 1)
    finally:
        nat.destroy()


def test_an_expert_major_dispatch_read_rank_major_plans_its_next_calls_after_launching_its_copy():
    """UCCL_EP_EXPERT_MAJOR_IN_READER=never: the reader moves no payload and ends soon after the last chunk, so the
    next calls' plans are not made while it spins (that held its drain back) but after the copy's launch, uploaded at
    once while the GPU copies: nothing is staged, the combine's plan equals its own, and outputs match."""
    env = dict(ENV, UCCL_EP_EXPERT_MAJOR_IN_READER="never")
    out = run_distributed(_expert_major_plans, 2, 1, timeout=120, env=env)
    for rank, (order, staged, same, done) in enumerate(out):
        assert order == ["unpack_records", "expert_major_copy", "plan_ahead"], f"rank {rank}: {order}"
        assert staged == 0 and same and done == 1, (rank, staged, same, done)


def test_an_expert_major_dispatch_whose_reader_writes_the_expert_rows_plans_its_next_calls_while_the_reader_runs():
    """By default the reader moves the payload into the expert-major rows itself, so it runs as long as the wire and
    the next calls' plans are made after its launch, while it runs, as a rank-major dispatch's are; no copy follows
    it; the combine's plan equals its own and outputs match."""
    out = run_distributed(_expert_major_plans, 2, 1, timeout=120, env=ENV)
    for rank, (order, _, same, done) in enumerate(out):
        assert order == ["expert_major_receive", "plan_ahead"], f"rank {rank}: {order}"
        assert same and done == 1, (rank, same, done)


def _cases_counting_as_on_a_shared_gpu(rank, world, G, cases, counters):
    """_cases_counting with the expert-major choice UCCL_EP_EXPERT_MAJOR_IN_READER=auto makes where ranks share a GPU
    (held to 33 spinning blocks, as two ranks under MPS on an H100): the stand-in has no grid to share."""
    from uccl_ep_train.internode import reads_expert_major_rows

    nat, ref = _backends(rank, world, G)
    try:
        nat.expert_major_in_reader = {kind: reads_expert_major_rows("auto", 33, kind != "uncached")
                                      for kind in nat.expert_major_in_reader}
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return (done,) + tuple(getattr(nat, c) for c in counters) + (
            (nat.expert_major_reads_before_counts, nat.reads_before_counts_declined),)
    finally:
        nat.destroy()


# per case: an uncached dispatch, then two cached ones; which of them the reader wrote
READS = {"always": lambda n: {"uncached": n, "cached": 2 * n}, "never": lambda n: {"uncached": 0, "cached": 0}}


@pytest.mark.parametrize("in_reader", ["always", "never", "shared-auto"], ids=["reader", "copy", "copy-then-reader"])
@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_an_expert_major_receive_equals_the_reference_whether_the_reader_writes_its_rows_or_a_copy_follows(
        world, G, in_reader):
    """Expert-major receives -- random, skewed, a rank that receives nothing, dropped experts, FP8 with and without
    num_worst_tokens -- written by the reader from each record's pair ranks (UCCL_EP_EXPERT_MAJOR_IN_READER=always,
    and cached ones from the handle's slots), by the plan and copy after the hop (never), or, as auto has it where
    ranks share a GPU, by the copy for the uncached dispatch and the reader from the slots the plan made for the
    cached ones: every output of compare_cases (dispatch, cached dispatch, combine, again after a combine) equals the
    reference bit for bit, and the counters show which path ran. Each uncached reader's table and the plan's sizes
    were made from notify's count rows where they lie (expert_major_places), not uploaded from the host's copy.
    Where ranks share a GPU, auto takes the reader for an uncached dispatch only where it may read before the count
    read (a dispatch of a size seen before, right after a combine): some do, and every one that took the reader read
    before the counts but those whose rows passed the guess (declined); with several GPUs per node after the forward
    before the count read."""
    counters = ("expert_major_reads", "expert_major_places_on_device")
    if in_reader == "shared-auto":
        out = run_distributed(_cases_counting_as_on_a_shared_gpu, world, G, EXPERT_MAJOR_CASES, counters,
                              timeout=180, env=ENV)
    else:
        out = [r + (None,) for r in run_distributed(
            _cases_counting, world, G, EXPERT_MAJOR_CASES, counters,
            timeout=180, env=dict(ENV, UCCL_EP_EXPERT_MAJOR_IN_READER=in_reader))]
    n = len(EXPERT_MAJOR_CASES)
    for done, reads, places_on_device, early in out:
        assert done == n, done
        if in_reader == "shared-auto":
            before_counts, declined = early
            assert reads["cached"] == 2 * n, reads
            assert before_counts <= reads["uncached"] <= before_counts + declined, (reads, early)
            assert before_counts > 0 and reads["uncached"] > 0, (reads, early, G)
        else:
            assert reads == READS[in_reader](n)
        assert places_on_device == reads["uncached"], (places_on_device, reads)


def _expert_major_with_poisoned_outputs(rank, world, G, cases):
    """compare_cases with every output row allocated full of 0x7F bytes, so that a row nobody writes (padding, the
    num_worst_tokens tail) cannot equal the reference's zeros; returns (pairs compared, expert-major reads)."""
    from uccl_ep_train.internode import NativeInternodeBackend

    def poisoned(like, rows):
        out = torch.empty((rows,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
        out.view(torch.uint8).fill_(0x7F)
        return out

    NativeInternodeBackend._empty_rows = staticmethod(poisoned)  # (this rank's process only)
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return done, nat.expert_major_reads["uncached"] + nat.expert_major_reads["cached"]
    finally:
        nat.destroy()


@pytest.mark.parametrize("in_reader", ["always", "never"], ids=["reader", "copy"])
@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_every_expert_major_output_row_is_written_even_when_outputs_start_poisoned(world, G, in_reader):
    """Expert-major outputs start full of 0x7F bytes instead of whatever the allocator hands back (zeros, often, on
    the CPU), and every output of compare_cases (random, skewed, empty, dropped routing, FP8, num_worst_tokens)
    still equals the reference bit for bit: the reader or the copy writes every row a pair fills, and the padding
    launch zeroes every other one -- the segments' padding and the tail up to num_worst_tokens."""
    out = run_distributed(_expert_major_with_poisoned_outputs, world, G, EXPERT_MAJOR_CASES, timeout=180,
                          env=dict(ENV, UCCL_EP_EXPERT_MAJOR_IN_READER=in_reader))
    for done, reads in out:
        assert done == len(EXPERT_MAJOR_CASES), done
        assert (reads > 0) == (in_reader == "always"), reads


def test_by_default_the_reader_writes_expert_major_rows_except_where_ranks_share_a_gpu_and_it_starts_after_the_hop():
    """UCCL_EP_EXPERT_MAJOR_IN_READER=auto: a GPU per rank (no spin cap) reads every expert-major receive into its
    rows; ranks that share a GPU, whose readers are held to a few blocks, do so only where the reader starts with
    the hop (cached dispatches, uncached ones read before the count read) and copy after the hop otherwise; always
    and never hold either way; the backend made with the default settings (no shared GPU here) takes the reader for
    both kinds."""
    from uccl_ep_train.internode import reads_expert_major_rows

    for with_hop in (False, True):
        assert reads_expert_major_rows("auto", 0, with_hop)
        assert reads_expert_major_rows("always", 33, with_hop) and reads_expert_major_rows("always", 0, with_hop)
        assert not reads_expert_major_rows("never", 0, with_hop) and not reads_expert_major_rows("never", 33, with_hop)
    assert reads_expert_major_rows("auto", 33, starts_with_hop=True)
    assert not reads_expert_major_rows("auto", 33, starts_with_hop=False)
    out = run_distributed(_cases_counting, 2, 1, [ALL[6]], ("expert_major_reads",), timeout=120, env=ENV)
    assert [reads for _, reads in out] == [{"uncached": 1, "cached": 2}] * 2


@pytest.mark.parametrize("world,G,env", [
    (2, 1, {}), (4, 1, {"UCCL_EP_PACK_AND_PUSH": "0"}), (2, 1, {"UCCL_EP_OWN_ROWS_FROM_COLUMNS": "0"}), (4, 2, {})],
    ids=["2x1", "4x1-separate-pack", "2x1-off", "2x2"])
def test_a_gated_reader_takes_our_own_rows_from_the_columns_so_the_sender_never_packs_them_and_outputs_match(
        world, G, env):
    """With one GPU per node a dispatch's gated reader (rank-major unpack, or the expert-major reader) reads our own
    node's rows straight from the input columns at their tokens, and the sender (pack_and_push, or the separate pack
    launches) never writes them to the receive area -- the stand-in poisons that block in what the reader sees, so a
    row read from it could not match. Every output equals the reference bit for bit; the counter shows the readers
    that did. UCCL_EP_OWN_ROWS_FROM_COLUMNS=0 packs them as before, and with several GPUs per node (the forwarders
    need the records) nobody reads from the columns."""
    out = run_distributed(_cases_counting, world, G, OWN_ROW_CASES, ("own_rows_read_from_columns",), timeout=180,
                          env=dict(ENV, UCCL_EP_EXPERT_MAJOR_IN_READER="always", **env))
    reads_from_columns = G == 1 and "UCCL_EP_OWN_ROWS_FROM_COLUMNS" not in env
    for done, read in out:
        assert done == len(OWN_ROW_CASES)
        # each case's cached dispatches at least (its uncached one may be read before the count read instead)
        assert (read >= 2 * len(OWN_ROW_CASES)) if reads_from_columns else read == 0, read


@pytest.mark.parametrize("world,G", [(2, 1), (4, 1)], ids=["2x1", "4x1"])  # (only one GPU per node gates dispatch)
def test_plan_tables_staged_during_a_dispatchs_reader_are_copied_at_the_next_calls_entry_and_outputs_match(world, G):
    """Plans made while a reader runs are staged (written to the pinned area, nothing queued behind the reader); the
    dispatch returns without copying them, and the next call queues their copies at its entry, before its first
    kernel: their device tables, poisoned in between, hold the plans again, and that combine and the calls after it
    equal the reference."""
    out = run_distributed(_staged_plans_copied_at_the_next_entry, world, G, timeout=120, env=ENV)
    for rank, (staged, copied_in_dispatch, copied_at_entry, same, done) in enumerate(out):
        assert staged >= 1, f"rank {rank}: no plan table was staged during the dispatch's reader"
        assert copied_in_dispatch == [], f"rank {rank}: the dispatch copied its staged tables itself"
        assert copied_at_entry, f"rank {rank}: the combine's entry did not copy the staged tables before its kernels"
        assert same and done == 2, (rank, same, done)


@pytest.mark.parametrize("world,G", [(2, 1)], ids=["2x1"])
def test_outputs_match_without_planning_ahead(world, G):
    """UCCL_EP_PLAN_AHEAD=0: every call makes its own plans at first use, and the outputs still equal the reference."""
    out = run_distributed(_cases, world, G, ALL[:4], 1, timeout=120, env=dict(ENV, UCCL_EP_PLAN_AHEAD="0"))
    assert all(done == 4 for done, _, _ in out)


def _packs_and_pushes(rank, world, G, cases, iters):
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, iters, unweighted=True)
        return done, dict(nat.packs_and_pushes)
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_a_hops_records_are_written_and_pushed_in_one_launch_unless_turned_off_and_outputs_match_either_way(world, G):
    """UCCL_EP_PACK_AND_PUSH (default on): dispatches that pack after notify, and combines too (with several GPUs per
    node the forwarders' node sums, "Pipelined combine gather"), write their records and push them in one launch
    (pack_and_push); with 0, none does. Every output equals the reference both ways (the stand-in checks that the
    chunk counters are zero at every launch)."""
    cases = ALL[:4]
    on = run_distributed(_packs_and_pushes, world, G, cases, 1, timeout=120, env=ENV)
    off = run_distributed(_packs_and_pushes, world, G, cases, 1, timeout=120, env=dict(ENV, UCCL_EP_PACK_AND_PUSH="0"))
    assert all(done == len(cases) for done, _ in on + off)
    assert all(n["dispatch_network"] > 0 for _, n in on)
    assert all(n["combine_network"] > 0 for _, n in on)
    assert all(n == {"dispatch_network": 0, "combine_network": 0} for _, n in off)


def _expert_sum_cases(rank, world, G, cases, counters):
    """compare_cases with bfloat16 and with float32 combine rows, then (pairs compared, *counters)."""
    nat, ref = _backends(rank, world, G)
    try:
        done = sum(compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True,
                                 combine_dtype=dt) for dt in (torch.bfloat16, torch.float32))
        return (done,) + tuple(getattr(nat, c) for c in counters)
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 1), (4, 2)], ids=["2x1", "4x1", "2x2"])
def test_an_expert_major_combine_sums_its_rows_in_the_pack_with_one_gpu_per_node_and_outputs_match_either_way(
        world, G):
    """UCCL_EP_EXPERT_SUMS_IN_PACK (default on): with one GPU per node, every expert-major combine's pack_and_push sums
    each token's local expert rows as it writes the token's record (ExpertSums) instead of a kernel summing them all
    first; with several GPUs per node (the sums go to the forwarders over NVLink) and with 0, none does. Every output
    of the expert-major cases (random, skewed, a rank receiving nothing, dropped experts, FP8, weighted and not,
    num_worst_tokens; bfloat16 and float32 combine rows) equals the reference bit for bit both ways."""
    cases, counters = EXPERT_MAJOR_CASES, ("expert_sums_in_packs", "packs_and_pushes")
    on = run_distributed(_expert_sum_cases, world, G, cases, counters, timeout=180, env=ENV)
    off = run_distributed(_expert_sum_cases, world, G, cases, counters, timeout=180,
                          env=dict(ENV, UCCL_EP_EXPERT_SUMS_IN_PACK="0"))
    assert all(done == 2 * len(cases) for done, _, _ in on + off)
    for _, sums, packs in on:  # every combine that packed and pushed (those with records to send)
        assert sums == (packs["combine_network"] if G == 1 else 0) and (sums > 0) == (G == 1), (sums, packs)
    assert all(sums == 0 and packs["combine_network"] > 0 for _, sums, packs in off if G == 1)
    assert all(sums == 0 for _, sums, _ in off)


def _forwarded_during_hop(rank, world, G, cases):
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return done, nat.forwards_during_hop
    finally:
        nat.destroy()


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "after-the-hop"])
@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_outputs_match_whether_arrivals_are_read_and_forwarded_as_they_land_or_only_after_the_whole_hop(world, G,
                                                                                                      gated):
    """UCCL_EP_GATED_ARRIVALS=0 keeps the wait for every counter before the readers run; by default the readers, and
    with several GPUs per node the forwarders too (forward_arrivals), read each chunk as it lands."""
    env = ENV if gated else dict(ENV, UCCL_EP_GATED_ARRIVALS="0")
    out = run_distributed(_forwarded_during_hop, world, G, ALL[:5], timeout=120, env=env)
    assert all(done == 5 for done, _ in out)
    forwarded = [n for _, n in out]
    if gated and G > 1:
        assert all(n > 0 for n in forwarded), f"no dispatch forwarded during its hop: {forwarded}"
    else:
        assert forwarded == [0] * world, forwarded


def _nvlink_flags(rank, world, G, cases):
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1, unweighted=True)
        return done, (nat.pipelined_gathers, nat._gather_epoch), (nat.forward_node_barriers, nat._forward_epoch)
    finally:
        nat.destroy()


@pytest.mark.parametrize("gather,forward", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["both", "forward-flags-only", "gather-flags-only", "group-barriers"])
@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (6, 3)], ids=["2x1", "2x2", "2x3"])
def test_combines_gather_in_flagged_tiles_and_forwards_end_with_node_flags_unless_turned_off_and_outputs_match(
        world, G, gather, forward):
    """With several GPUs per node every combine copies its rows to the forwarders in flagged tiles and each forwarder
    sums and pushes its records as their tiles are flagged (docs/internode.md, "Pipelined combine gather"), and every
    dispatch forward ends with flags among the node's GPUs ("The dispatch forward's node barrier"), every rank at the
    same epochs. UCCL_EP_PIPELINED_COMBINE_GATHER=0 keeps the whole gather and a group barrier before the node sum,
    UCCL_EP_FORWARD_NODE_BARRIER=0 the group barrier after the forward, each on its own. With one GPU per node nothing
    moves over NVLink either way. Every output matches the reference in every combination."""
    env = dict(ENV, UCCL_EP_PIPELINED_COMBINE_GATHER=str(int(gather)), UCCL_EP_FORWARD_NODE_BARRIER=str(int(forward)))
    out = run_distributed(_nvlink_flags, world, G, ALL, timeout=240, env=env)
    assert all(done == len(ALL) for done, _, _ in out)
    for which, on in ((1, gather), (2, forward)):
        counts, epochs = [o[which][0] for o in out], [o[which][1] for o in out]
        if on and G > 1:
            assert all(n > 0 for n in counts) and len(set(epochs)) == 1 and epochs[0] == counts[0], (counts, epochs)
        else:
            assert counts == [0] * world, (which, counts)


def _unpacks_beside_forward(rank, world, G, cases):
    nat, ref = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, torch.device("cpu"), rank, world, cases, 1)
        return (done, nat.unpacks_beside_forward, nat.forward_node_barriers, nat._forward_epoch, nat._unpack_beside,
                nat.reads_before_counts)
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2), (6, 3)], ids=["2x1", "2x2", "2x3"])
def test_with_the_unpack_beside_the_forward_each_gpu_unpacks_rows_its_forwarders_marked_and_outputs_match(world, G):
    """UCCL_EP_UNPACK_BESIDE_FORWARD=1 (docs/internode.md, "The unpack beside the forward"): with several GPUs per
    node every rank-major dispatch's forwarders mark each final row they write with the forward's epoch, and each GPU
    unpacks its rows once marked, on the second stream, then ends with the node barrier at the same epoch; every
    output matches the reference (each row read only once its word was marked: the stand-in waits for every word).
    Expert-major copies after the hop keep the barrier before them. With one GPU per node nothing changes.
    Dispatches launched before the count read ("The forward before the count read") unpack beside their forward too:
    with several GPUs per node some read so (expert-major receives read so: the reads-before-the-count-read test of
    expert-major dispatches)."""
    out = run_distributed(_unpacks_beside_forward, world, G, ALL, timeout=240,
                          env=dict(ENV, UCCL_EP_UNPACK_BESIDE_FORWARD="1"))
    assert all(done == len(ALL) for done, *_ in out), out
    beside = [o[1] for o in out]
    if G > 1:
        assert all(n > 0 for n in beside), beside
        assert sum(o[5] for o in out) > 0, out  # (each of those read its rows as their words were released)
        # one epoch per forward whether its rows went beside it or not, the same on every rank; none left pending
        assert len({o[3] for o in out}) == 1 and all(o[3] == o[2] for o in out) and all(o[4] is None for o in out), out
    else:
        assert beside == [0] * world, beside


def test_an_unpack_whose_row_is_never_marked_reports_the_row_and_leaves_it_unwritten():
    """unpack_records with ready words (the stand-in's): a row whose word never reaches the epoch is reported after
    the deadline as row_not_ready, naming the row, its word and the epoch, and that row's output is not written (the
    stand-in writes none; on a GPU the marked rows may be); with every word marked it unpacks. The GPU twin is in
    test_internode_gpu.py."""
    rows, stride = 4, 32
    src = torch.randint(0, 255, (rows, stride), dtype=torch.uint8)
    out = torch.full((rows, 16), 7, dtype=torch.uint8)
    words = torch.tensor([3, 3, 2, 3], dtype=torch.int32)
    err = fake.ErrorWord()
    stop = ctypes.c_int32(0)
    kw = dict(ready_words=words.data_ptr(), ready_epoch=3, ready_timeout_secs=0.05, err=ctypes.addressof(err),
              stop_flag=ctypes.addressof(stop), stop_generation=1, rank=5, phase=3)
    fake.unpack_records(src.data_ptr(), stride, rows, rows, [(out.data_ptr(), 16, 0)], 0, 0, 0, 0, 0, 0, 0, 16, 0,
                        -1, 0, 0, **kw)
    assert (err.code, err.aux, err.observed, err.expected, err.rank) == (fake.ERROR_CODES["row_not_ready"], 2, 2, 3, 5)
    assert bool((out[2] == 7).all()), "an unpack wrote a row that was never marked"
    words[2] = 3
    stop.value = 0
    fake.unpack_records(src.data_ptr(), stride, rows, rows, [(out.data_ptr(), 16, 0)], 0, 0, 0, 0, 0, 0, 0, 16, 0,
                        -1, 0, 0, **dict(kw, stop_generation=2))
    assert torch.equal(out, src[:, :16])


def test_an_expert_major_receive_whose_row_is_never_marked_reports_the_row_and_leaves_its_rows_unwritten():
    """expert_major_receive with ready words (the stand-in's; the receive beside the forward): a row whose word never
    reaches the epoch is reported after the deadline as row_not_ready (row, word, epoch) and its expert-major rows are
    not written; with every word marked each row reaches the rows slot_of names. The GPU twin is in
    test_internode_gpu.py."""
    rows, stride, x_bytes = 4, 48, 32
    src = torch.randint(0, 255, (rows, stride), dtype=torch.uint8)
    out = torch.full((2 * rows, x_bytes), 7, dtype=torch.uint8)
    slot_of = torch.tensor([[5, -1], [0, 3], [6, 1], [-1, -1]], dtype=torch.int32)
    words = torch.tensor([3, 3, 2, 3], dtype=torch.int32)
    err = fake.ErrorWord()
    stop = ctypes.c_int32(0)
    kw = dict(ready_words=words.data_ptr(), ready_epoch=3, ready_timeout_secs=0.05, err=ctypes.addressof(err),
              stop_flag=ctypes.addressof(stop), stop_generation=1, rank=5, phase=3)

    def receive(**more):
        fake.expert_major_receive(src.data_ptr(), stride, rows, 0, x_bytes, 0, 0, out.data_ptr(), 0, 2 * rows, 2, True,
                                  slot_of.data_ptr(), -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 40, 0, -1, 0, 0,
                                  **dict(kw, **more))
    receive()
    assert (err.code, err.aux, err.observed, err.expected, err.rank) == (fake.ERROR_CODES["row_not_ready"], 2, 2, 3, 5)
    assert bool((out == 7).all()), "a receive wrote rows before every row it reads was marked"
    words[2] = 3
    stop.value = 0
    receive(stop_generation=2)
    for r, k in ((0, 0), (1, 0), (1, 1), (2, 0), (2, 1)):
        assert torch.equal(out[int(slot_of[r, k])], src[r, :x_bytes]), (r, k)
    assert bool((out[[2, 4, 7]] == 7).all()), "rows no pair names were written"


def _setup_with_own_setting(rank, world, G, name, value_of_last_rank):
    from uccl_ep_train.internode import InternodeError

    if rank == world - 1:
        os.environ[name] = value_of_last_rank
    try:
        nat, _ = _backends(rank, world, G)
    except InternodeError as exc:
        return str(exc)
    nat.destroy()
    return "no error"


@pytest.mark.parametrize("name", ["UCCL_EP_PIPELINED_COMBINE_GATHER", "UCCL_EP_FORWARD_NODE_BARRIER",
                                  "UCCL_EP_PACK_AND_PUSH", "UCCL_EP_GATED_ARRIVALS"])
def test_a_synchronization_setting_that_differs_between_ranks_is_refused_at_setup_on_every_rank_naming_it(name):
    """A rank that took the other way would wait for flags or barriers its peers never send, until the GPU deadline:
    setup compares these settings across the group and every rank raises, naming the setting and who holds what."""
    out = run_distributed(_setup_with_own_setting, 4, 2, name, "0", timeout=60, env=ENV)
    for rank, msg in enumerate(out):
        assert f"rank {rank}: {name} differs between the ranks" in msg, msg
        assert "False on ranks [3]" in msg and "True on ranks [0, 1, 2]" in msg, msg


def _absent_peer(rank, world, G):
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode import InternodeError

    nat, _ = _backends(rank, world, G)
    try:
        if rank == world - 1:
            time.sleep(4)  # never joins the dispatch: to the others it is gone
            return None
        idx = torch.randint(0, 4 * world, (64, 2))
        x = torch.randn((64, 128)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        t0 = time.time()
        try:
            nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        except InternodeError as exc:
            return time.time() - t0, str(exc), nat._notify_slot
        return time.time() - t0, "no error", nat._notify_slot
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", [(4, 2)], ids=["2x2"])
def test_a_rank_that_never_pushes_makes_the_others_raise_naming_rank_phase_and_slot_at_the_gpu_deadline(world, G):
    env = dict(ENV, UCCL_EP_GPU_TIMEOUT_SECS="1")
    out = run_distributed(_absent_peer, world, G, timeout=60, env=env)
    for rank in range(world - 1):
        elapsed, msg, slot = out[rank]
        assert msg != "no error", f"rank {rank} did not notice the absent peer"
        assert f"rank {rank}, notify" in msg and f"signal slot {slot} to reach {world - 1}" in msg, msg
        assert f"saw {world - 2}" in msg, msg  # every other rank's count row did arrive
        assert "proxy threads:\nfake proxy" in msg, msg  # and what its proxy holds
        assert 1 <= elapsed < 3.5, f"rank {rank} took {elapsed:.1f} s with a 1 s GPU deadline"


def _context(world=1, **kw):
    """A started stand-in context of rank 0 (its proxy connected to itself), destroyed on leaving."""
    return one_rank_context(fake.InternodeContext, **{"world": world, "device": None, "timeout_secs": 1.0,
                                                      "gpu_timeout_secs": 0.05, **kw})


def test_stand_in_pack_and_push_writes_what_pack_records_writes_and_pushes_every_chunk():
    with _context() as cx:
        check_pack_and_push_writes_the_records_of_pack_records_and_the_chunks_of_push_chunks(
            cx, fake.pack_records, fake._at(cx.rdma_ptr, cx.rdma_bytes), torch.device("cpu"))


def test_stand_in_pack_and_push_fails_naming_a_chunk_whose_records_are_never_written():
    with _context() as cx:
        check_a_chunk_whose_records_are_never_written_makes_pack_and_push_fail_naming_it(
            cx, torch.device("cpu"), fake.ERROR_CODES)


@pytest.mark.parametrize("f32", [False, True], ids=["bf16", "fp32"])
def test_stand_in_pipelined_gather_sums_each_record_once_its_tiles_are_flagged_and_names_a_gpu_that_never_flags(f32):
    with _context(gpu_timeout_secs=2.0) as cx:
        check_node_sums_wait_for_tile_flags_and_name_a_gpu_that_never_flags(
            cx, fake.gather_tiles, fake._at(cx.rdma_ptr, cx.rdma_bytes), fake._at(cx.nvl_ptr, cx.nvl_bytes),
            torch.device("cpu"), fake.ERROR_CODES, f32)


def test_stand_in_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named():
    with _context(gpu_timeout_secs=0.5) as cx:
        check_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named(
            cx, fake.raise_flags, fake._at(cx.nvl_ptr, cx.nvl_bytes), torch.device("cpu"), fake.ERROR_CODES)


def test_stand_in_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them():
    with _context(gpu_timeout_secs=0.2) as cx:
        check_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them(
            cx, fake._at(cx.rdma_ptr, cx.rdma_bytes), torch.device("cpu"), fake.ERROR_CODES)


def test_stand_in_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends():
    with _context() as cx:
        check_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends(
            cx, fake._at(cx.rdma_ptr, cx.rdma_bytes), torch.device("cpu"))


def test_stand_in_gated_unpack_reads_landed_rows_and_times_out_naming_the_lane_of_a_missing_chunk():
    with _context(gpu_timeout_secs=0.2) as cx:
        check_a_gated_unpack_reads_rows_only_after_their_chunks_land(
            cx, fake.unpack_records, fake._at(cx.rdma_ptr, cx.rdma_bytes), torch.device("cpu"), fake.ERROR_CODES)


@pytest.mark.parametrize("shape", FORWARD_ARRIVAL_SHAPES, ids=FORWARD_ARRIVAL_SHAPE_IDS)
def test_stand_in_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped(shape):
    with _context(gpu_timeout_secs=0.2) as cx:
        check_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped(
            cx, fake.forward_arrivals, fake._at(cx.rdma_ptr, cx.rdma_bytes), torch.device("cpu"), fake.ERROR_CODES,
            shape)


def test_stand_in_cuts_chunks_like_the_kernel_and_reports_encode_scatter_range_and_timeouts():
    with _context() as cx:
        rdma = fake._at(cx.rdma_ptr, cx.rdma_bytes)
        rdma[:160] = torch.arange(160, dtype=torch.uint8)
        # 10 records of 16 bytes in chunks of 4 from lane hint 1: chunks 4, 4, 2 on lanes 1, 0, 1 of slots 7 + lane
        table = torch.tensor([[0, 0, 1024, 16, 10, 7, 1]], dtype=torch.int64)
        cx.push_chunks(table.data_ptr(), 1, 4, 1, 0)
        assert torch.equal(rdma[1024:1184], rdma[:160])
        assert (cx.signal_value(7), cx.signal_value(8)) == (4, 6)
        assert [f["tail"] for f in cx.fifo_states()] == [1, 2]
        waits = [(8, 6), (7, 4)]
        cx.wait_signals(waits, 1, 0)
        assert cx.error_fields()["code"] == 0
        waits[1] = (7, 5)
        cx.wait_signals(waits, 1, 0)
        e = cx.error_fields()
        assert (e["code"], e["slot"], e["observed"], e["expected"]) == (fake.ERROR_CODES["wait_timeout"], 7, 4, 5)
        assert "slot 7 to reach 5, saw 4" in cx.error_message()
        cx.clear_error()
        table[0, 1] = 8  # unaligned local offset: the command does not encode, nothing moves
        cx.push_chunks(table.data_ptr(), 1, 4, 2, 0)
        e = cx.error_fields()
        assert (e["code"], e["aux"], e["phase"]) == (fake.ERROR_CODES["encode"], 8, 2)
        assert cx.signal_value(7) == 4 and "local offset not a multiple of 16" in cx.error_message()
        cx.clear_error()
        idx = torch.tensor([0, -1, 5, 1], dtype=torch.int64)  # row 5 is outside a 2-row area: reported, not written
        before = rdma[2048 + 5 * 32:2048 + 6 * 32].clone()
        fake.scatter_rows(cx.rdma_ptr + 2048, 32, idx.data_ptr(), cx.rdma_ptr, 16, 0, 4, 16, 0, dst_rows=2,
                          err=cx.error_word_ptr, stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation,
                          rank=0, phase=3, target=1)
        e = cx.error_fields()
        assert (e["code"], e["slot"], e["aux"], e["observed"], e["expected"]) == (4, 1, 2, 5, 2)
        assert torch.equal(rdma[2048:2064], rdma[:16]) and torch.equal(rdma[2080:2096], rdma[48:64])
        assert torch.equal(rdma[2048 + 5 * 32:2048 + 6 * 32], before)
        cx.clear_error()
        cx.abort_waits()  # a wait with the error word set returns at once
        t0 = time.monotonic()
        cx.wait_signals(waits, 1, 0)
        assert time.monotonic() - t0 < 0.04 and cx.error_fields()["code"] == fake.ERROR_CODES["aborted"]


def _backend_with_a_forward_limit_of_one(rank, world, G):
    from uccl_ep_train.internode import InternodeError

    fake.FORWARD_MAX_TARGETS = 1  # (this child process only)
    try:
        _backends(rank, world, G)[0].destroy()
    except InternodeError as e:
        return str(e)
    return None


def test_more_gpus_per_node_than_the_forward_takes_raise_at_setup_naming_both():
    """The dispatch forward keeps one destination per local GPU in a block's shared memory (FORWARD_MAX_TARGETS): a
    node with more GPUs than that is refused when the backend is made, on every rank, before anything is allocated."""
    out = run_distributed(_backend_with_a_forward_limit_of_one, 4, 2, timeout=60, env=ENV)
    assert all(e is not None and "2 GPUs per node" in e and "at most 1" in e for e in out), out


@pytest.mark.parametrize("shape", FORWARD_ROW_SHAPES, ids=FORWARD_ROW_SHAPE_IDS)
def test_stand_in_forward_rows_sends_each_row_to_every_gpu_that_needs_it_and_checks_its_range_as_the_kernel(shape):
    with _context() as cx:
        check_forward_rows_sends_each_row_to_every_gpu_that_needs_it(cx, fake.forward_rows, torch.device("cpu"), shape)


def test_stand_in_like_the_kernels_sends_and_forwards_nothing_once_the_ranks_error_word_is_set():
    with _context() as cx:
        check_a_failed_rank_sends_and_forwards_nothing(cx, fake.scatter_rows, torch.device("cpu"))


def _host_steps(rank, world, G):
    from uccl_ep_train.backends import DispatchArgs

    nat, _ = _backends(rank, world, G)
    try:
        idx = torch.randint(0, 4 * world, (64, 2))
        x = torch.randn((64, 128)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        nat.host_timing = {}
        r = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        nat.combine(r.recv_x, r.handle, None, None)
        return {k: n for k, (_, n) in nat.host_timing.items()}
    finally:
        nat.destroy()


def test_benchmark_host_timing_splits_notify_into_row_exchange_and_read_back_and_times_every_step_once():
    """bench internode reports where a call's host time goes; notify (2 ms at DeepSeek-V3 shape on 2x H200 in
    session 6) is split so that the ranks' skew (the exchange) shows apart from the work around it."""
    steps = run_distributed(_host_steps, 2, 1, timeout=60, env=ENV)[0]
    for name in ("dispatch.entry", "dispatch.notify_row", "dispatch.notify_exchange", "dispatch.notify",
                 "dispatch.network", "dispatch.finish", "combine.entry", "combine.network", "combine.finish"):
        assert steps.get(name) == 1, (name, steps)


class _Counters:
    """InternodeContext's signals_short over fixed counter values."""

    def __init__(self, values):
        self.values, self.asked = values, []

    def signals_short(self, targets):
        self.asked.append(list(targets))
        return sum(max(0, t - self.values[s]) for s, t in targets)


def test_planning_goes_before_the_reader_while_at_least_half_the_hops_records_are_still_to_land():
    """_plan_before_reader: with half or more of a hop's records still to land the wire is busy for a while, and the
    next calls' planning (with its upload) goes before the reader's launch; with less the reader goes first. The
    counters' targets are the backend's running ones; no hop, or one with nothing to land, plans after."""
    from uccl_ep_train.internode import NativeInternodeBackend
    from uccl_ep_train.internode.call_state import Pending

    b = NativeInternodeBackend.__new__(NativeInternodeBackend)  # no context: only the decision is exercised
    b._expected = [0, 60, 40]
    pending = Pending(gate=None, t0=None, slots=[1, 2], records=100)
    for landed, first in (((10, 40), True), ((30, 20), True), ((31, 20), False), ((60, 40), False)):
        b._cx = _Counters({1: landed[0], 2: landed[1]})
        assert b._plan_before_reader(pending) is first, landed
        assert b._cx.asked == [[(1, 60), (2, 40)]]
    assert b._plan_before_reader(None) is False
    assert b._plan_before_reader(pending._replace(records=0)) is False


# launches that packed and pushed during notify, readers launched before the count read that read, that handed back
# to the host's path, and outputs made during a combine's hop that a reader took
READ_COUNTERS = ("packs_and_pushes_during_notify", "reads_before_counts", "reads_before_counts_declined",
                 "spare_read_outputs_taken")


@pytest.mark.parametrize("world,G", [(2, 1), (4, 1), (4, 2)], ids=["2x1", "4x1", "2x2"])
def test_a_dispatch_pushed_during_notify_reads_before_the_host_reads_the_counts_or_hands_back_and_still_matches(world,
                                                                                                                G):
    """An uncached dispatch whose records are packed and pushed during notify launches its reader behind notify's
    wait, taking its rows, gate and our own records' place from the count rows on the device, into outputs sized
    before any count is known: num_worst_tokens (the 512-row case), else the rows the last dispatch received plus the
    slack. With several GPUs per node (2 x 2) the forward goes there too ("The forward before the count read"): our
    own records packed into our arrivals, the gated forward, the node barrier and the unpack of the final rows, all
    from the count rows. Where the counts say it may not (more rows than that: rank 1 after the "empty" case, in
    which it received nothing), it does nothing and the host reads after notify as before. Every output equals the
    reference either way; with UCCL_EP_READ_BEFORE_COUNTS=0 no reader goes before the count read. The outputs of
    the bf16 readers without num_worst_tokens after the second case were made during the hop of the combine before
    them (that of the first case follows a dispatch that read after notify, which leaves nothing to make; the
    worst-tokens case has another row count, so it makes its own)."""
    cases = ALL[:4] + [ALL[7]]  # random, skewed, empty (rank 0 receives everything), dropped, worst tokens
    counters = READ_COUNTERS + ("forwards_before_counts",)
    out = run_distributed(_cases_counting, world, G, cases, counters, timeout=180, env=ENV)
    for done, fused, read, declined, spare, forwarded in out:
        assert done == len(cases) and fused == len(cases) - 1, (done, fused)
        assert read + declined == fused, (fused, read, declined)  # every case after the first has a guess
        assert spare == 2, spare  # the "empty" and "dropped" cases
        # several GPUs per node: every reader that read forwarded first (a forward that went while its unpack
        # handed back is counted too); none with one
        assert (forwarded >= read) if G > 1 else forwarded == 0, (read, forwarded)
    assert out[1][3] >= 1, out  # rank 1: the "dropped" case after receiving nothing
    assert sum(row[2] for row in out) >= world, out
    out = run_distributed(_cases_counting, world, G, cases[:3], counters, timeout=180,
                          env=dict(ENV, UCCL_EP_READ_BEFORE_COUNTS="0"))
    assert [row[2:] for row in out] == [(0, 0, 0, 0)] * world


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_more_counter_bases_than_kernel_arguments_hold_go_in_a_device_table_and_reads_before_the_count_read_match(
        world, G):
    """Nodes x lanes past READ_MAX_COUNTERS (here 2 nodes x 80 lanes: 160; at the default 32 lanes, groups of more than
    4 nodes) used to turn reading before the count read off. The bases now go to the kernel that reads the count rows
    as a device table uploaded before notify (by value that kernel refuses more than READ_MAX_COUNTERS), and the
    dispatches still read before the count read, every output equal to the reference."""
    env = dict(ENV, UCCL_EP_NUM_PROXY_THREADS="2", UCCL_EP_FIFOS_PER_THREAD="40")
    assert (world // G) * 80 > fake.READ_MAX_COUNTERS
    cases = ALL[:4] + [ALL[7]]
    out = run_distributed(_cases_counting, world, G, cases, READ_COUNTERS, timeout=180, env=env)
    for done, fused, read, declined, _ in out:
        assert done == len(cases) and fused == len(cases) - 1 and read + declined == fused, (done, fused, read)
    assert sum(row[2] for row in out) >= world, out
    # ... and expert-major receives written by their reader (the second random one and the FP8 worst-tokens one)
    cases = [ALL[0], ALL[6], ALL[6], ALL[8]]
    out = run_distributed(_cases_counting, world, G, cases, ("expert_major_reads_before_counts",), timeout=180,
                          env=dict(env, UCCL_EP_EXPERT_MAJOR_IN_READER="always"))
    assert all(done == len(cases) and em_read >= 2 for done, em_read in out), out


@pytest.mark.parametrize("world,G", [(8, 1), (8, 2)], ids=["8x1", "4x2"])
def test_eight_ranks_at_the_default_lanes_read_before_the_count_read_on_both_sides_of_the_argument_limit(world, G):
    """The production lane count (4 proxy threads x 8 FIFOs: 32 lanes) with 8 ranks: 8 nodes x 32 lanes = 256 counter
    bases go in the device table, 4 nodes x 32 = 128 exactly fit the kernel's arguments. Both read before the count
    read, and every output equals the reference."""
    env = dict(ENV, UCCL_EP_NUM_PROXY_THREADS="4", UCCL_EP_FIFOS_PER_THREAD="8")
    cases = ALL[:4] + [ALL[6], ALL[7]]
    out = run_distributed(_cases_counting, world, G, cases, READ_COUNTERS, timeout=300, env=env)
    for done, fused, read, declined, _ in out:
        # (the expert-major case is the first of its kind: no row guess, so it neither reads before nor declines)
        assert done == len(cases) and fused == len(cases) - 1 and read + declined == fused - 1, (done, fused, read)
        assert read >= 2, read  # the worst-tokens case and one more at least


def test_the_count_row_kernels_take_counter_bases_by_value_up_to_the_limit_or_in_a_table_not_both():
    """The stand-in's checks, as internode_plan.cu's read_bases makes them: 2 ranks x 65 lanes are 130 bases."""
    lanes = fake.READ_MAX_COUNTERS // 2 + 1
    rows = torch.tensor([[2, 0, 2, 0], [3, 1, 3, 1]], dtype=torch.int64)  # rank 1 sends rank 0 three records
    table = torch.zeros((2, fake.GATE_COLUMNS + lanes), dtype=torch.int64)
    dims = torch.zeros(fake.READ_DIMS, dtype=torch.int64)
    bases = torch.randint(0, 1 << 40, (2 * lanes,), dtype=torch.int64)
    args = (rows.data_ptr(), 4, 2, 0, lanes)
    with pytest.raises(ValueError, match="at most 128 by value \\(more: counter_bases_table\\), got 130"):
        fake.gate_from_count_rows(*args, bases.tolist(), 16, 0, 0, 0, table.data_ptr(), dims.data_ptr(), 0)
    with pytest.raises(ValueError, match="not both"):
        fake.gate_from_count_rows(*args, [0], 16, 0, 0, 0, table.data_ptr(), dims.data_ptr(), 0,
                                  counter_bases_table=bases.data_ptr())
    fake.gate_from_count_rows(*args, [], 16, 1 << 20, 1 << 20, 64, table.data_ptr(), dims.data_ptr(), 0,
                              counter_bases_table=bases.data_ptr())
    assert dims[:4].tolist() == [1, 5, 0, 1], dims  # go, 5 arrivals, ours first, one gate row: rank 1's block
    assert torch.equal(table[0, fake.GATE_COLUMNS:], bases[lanes:]), "rank 1's lanes take their bases from the table"


EM_READ_COUNTERS = ("reads_before_counts", "reads_before_counts_declined", "expert_major_reads_before_counts",
                    "expert_major_places_on_device", "expert_major_reads")


@pytest.mark.parametrize("in_reader", ["always", "never"], ids=["reader", "copy"])
@pytest.mark.parametrize("world,G,beside", [(2, 1, "0"), (4, 1, "0"), (4, 2, "0"), (4, 2, "1")],
                         ids=["2x1", "4x1", "2x2", "2x2-beside"])
def test_an_expert_major_dispatch_whose_reader_writes_the_rows_reads_before_the_count_read_and_every_output_matches(
        world, G, beside, in_reader):
    """An uncached expert-major dispatch whose reader writes the expert-major rows (always) launches that reader
    behind notify's wait, as a rank-major one does (with several GPUs per node after the forward before the count
    read, reading the final rows after its barrier, or with UCCL_EP_UNPACK_BESIDE_FORWARD on the second stream as
    its forwarders mark them, "The unpack beside the forward"): its gate, rows and our own rows' place from
    the count rows, its places and the plan's sizes from the same rows (expert_major_places), into expert-major rows
    allocated before the counts -- num_worst_tokens, else the rows the last such dispatch of that size filled plus
    the slack -- and hands back where the counts do not fit them (skew after a random case; a rank that received
    nothing has no guess and reads after notify). With never, the copy after the hop reads the final rows, where a
    reader before the counts leaves our own rows out, so no expert-major dispatch reads before the count read. Every
    output (random, skewed, a rank that receives nothing, dropped experts, FP8 with num_worst_tokens, and the
    rank-major dispatches between them) equals the reference."""
    cases = [ALL[0], ALL[6], ALL[6], ALL[9], ("dropped", False, True, 0, 10), ALL[8], ALL[1],
             ("skewed", False, True, 0, 11), ALL[6]]
    out = run_distributed(_cases_counting, world, G, cases,
                          ("packs_and_pushes_during_notify",) + EM_READ_COUNTERS
                          + ("unpacks_beside_forward", "expert_major_receives_beside_forward"),
                          timeout=180, env=dict(ENV, UCCL_EP_EXPERT_MAJOR_IN_READER=in_reader,
                                                UCCL_EP_UNPACK_BESIDE_FORWARD=beside))
    em_cases = sum(1 for c in cases if c[2])
    # beside the forward: every read before the counts launched so (those that went, at least), the expert-major
    # receives among them where the reader writes the rows
    for row in out:
        read_before, em_read_before, unpacks, em_beside = row[2], row[4], row[7], row[8]
        if beside == "1":
            assert unpacks >= read_before and em_beside >= em_read_before, row
            assert (em_beside > 0) == (in_reader == "always"), row
        else:
            assert unpacks == em_beside == 0, row
    for done, fused, read, declined, em_read, places, reads, *_ in out:
        assert done == len(cases) and fused == len(cases) - 1, (done, fused)
        assert read + declined <= fused and em_read <= read, (read, declined, em_read)
        if in_reader == "never":
            assert em_read == 0 and places == 0 and reads == {"uncached": 0, "cached": 0}, (em_read, places, reads)
        else:  # every uncached receive's places from the count rows, before or after the count read
            assert places == reads["uncached"] >= em_cases, (places, reads)
    if in_reader == "always":
        assert all(row[4] >= 2 for row in out), out  # the second random case and the worst-tokens case at least
        assert sum(row[3] for row in out) >= 1, out  # the skewed case on the ranks it sends more to


def _sync_free_before_counts(rank, world, G):
    from internode_cases import sync_free_dispatch_returns_before_the_count_read

    nat, ref = _backends(rank, world, G)
    try:
        return sync_free_dispatch_returns_before_the_count_read(nat, ref, torch.device("cpu"), rank, world)
    finally:
        nat.destroy()


def _laps_of_a_deferred_dispatch(rank, world, G, pause):
    """A sync-free dispatch that returns before the count read, ``pause`` seconds outside the backend, then the
    combine that finishes it, with the benchmark's host laps on: (returned early, the laps' total over both calls)."""
    import time

    from uccl_ep_train.backends import DispatchArgs

    nat, _ = _backends(rank, world, G)
    try:
        E, T = 4 * world, 64
        g = torch.Generator().manual_seed(rank)
        idx = torch.rand((T, E), generator=g).topk(4, dim=1).indices
        x = torch.randn((T, 256), generator=g).to(torch.bfloat16)

        def dispatch():
            tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)
            return nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None,
                                             num_worst_tokens=T * world))

        r = dispatch()
        nat.combine(r.recv_x, r.handle, None, None)  # the next uncached dispatch follows a combine
        nat.host_timing = {}
        r = dispatch()
        early = not r.handle.counts_read
        time.sleep(pause)  # the caller's own work, between the calls
        nat.combine(r.recv_x, r.handle, None, None)
        return early, sum(total for total, _ in nat.host_timing.values())
    finally:
        nat.destroy()


def test_the_host_laps_of_a_dispatch_finished_by_the_next_call_start_in_that_call_not_at_the_last_return():
    """bench internode's host steps: the host half of a sync-free dispatch that returned before the count read runs at
    the next call's entry; its laps count from there, so the caller's time between the calls (here 0.5 s) is in no
    step (it had read as tens of ms of `dispatch.plan` per call on 2x H200)."""
    out = run_distributed(_laps_of_a_deferred_dispatch, 2, 1, 0.5, timeout=120,
                          env=dict(ENV, UCCL_EP_DRAIN_AFTER_WAITS="never"))
    for rank, (early, laps) in enumerate(out):
        assert early, f"rank {rank}: the dispatch did not return before the count read"
        assert laps < 0.4, (rank, laps)


@pytest.mark.parametrize("world", [2, 4], ids=["2x1", "4x1"])
def test_a_sync_free_dispatch_without_drains_returns_before_the_count_read_and_the_next_call_finishes_it(world):
    """UCCL_EP_DRAIN_AFTER_WAITS=never with num_worst_tokens, one GPU per node, right after a combine: the dispatch
    returns before the host reads the counts -- rank-major and expert-major, bf16 and FP8, every output and the
    handle's tokens per expert (on the device) equal to the reference's -- and the next call reads them and fills in
    the handle. A receive past num_worst_tokens is raised by the next call, naming the dispatch before it and
    num_worst_tokens, with the counters in step; the calls after it match."""
    out = run_distributed(_sync_free_before_counts, world, 1, timeout=180,
                          env=dict(ENV, UCCL_EP_DRAIN_AFTER_WAITS="never"))
    for rank, (early, err, in_step, done) in enumerate(out):
        assert early == 4, (rank, early)
        assert "the sync-free dispatch before this call" in err and "raise num_worst_tokens" in err, (rank, err)
        assert in_step, f"rank {rank}: the dispatch counters are not at their targets after the error"
        assert done == 3, (rank, done)
