"""What the NativeInternodeBackend tests on GPUs (test_internode_gpu.py) and on CPU with the stand-in native module
(test_internode_backend_cpu.py) share: routings, the exact comparison, and the case loop against reference.py."""
from __future__ import annotations

import contextlib
import functools
import operator
import time

import pytest
import torch


# A one-rank InternodeContext whose proxy writes to the rank itself (1 thread, 2 FIFOs): the kernel checks' setting,
# on a GPU (test_internode_gpu.py) and on the stand-in (test_internode_backend_cpu.py)
ONE_RANK_CONTEXT = dict(rank=0, world=1, rdma_bytes=1 << 16, nvl_bytes=1 << 16, num_threads=1, fifos_per_thread=2,
                        fifo_depth=64, cpus=[], idle_backoff_us=0, max_inflight_writes=8, max_inflight_bytes=4096,
                        reorder_window=256, num_signal_slots=512, loopback_reorder=0, loopback_delay_us=0,
                        loopback_bandwidth_gbps=0.0, loopback_seed=0)


@contextlib.contextmanager
def one_rank_context(context_class, **args):
    """A started ``context_class`` (the native or stand-in InternodeContext) with ONE_RANK_CONTEXT's arguments
    updated by ``args``, its proxy connected to itself; destroyed on leaving."""
    cx = context_class(**{**ONE_RANK_CONTEXT, **args})
    try:
        cx.proxy_connect([[cx.proxy_local_info(0)]])
        cx.proxy_start()
        yield cx
    finally:
        cx.destroy()


def gpu_sharing_skip_reason(world, have, gpus, env, mps):
    """Why the GPU cases of ``world`` ranks (asking ``gpus`` GPUs) cannot run on ``have`` GPUs, or None. ``env``: the
    environment; ``mps``: whether the driver says the GPUs are shared through MPS (None: it cannot say).
    UCCL_EP_TEST_SHARE_GPU=1 lets ranks share the GPUs there are, e.g. on a 1-GPU machine; at most
    UCCL_EP_TEST_MAX_RANKS_PER_GPU (2) on one: four ranks on one GPU stall when the proxy threads copy
    (docs/internode.md, "Hardware work queues"); with the copy agent under MPS they did not (session 49:
    `scripts/gpu-check.sh internode_mps_agent` raises it to 4). And ranks share a GPU only under MPS: time-sliced,
    2 x 2 on 2x H200 stalled in 8 cases and 2 x 1 on one H200 in one, cases that pass under MPS (session 50);
    UCCL_EP_TEST_TIME_SLICED=1 runs them anyway (`scripts/gpu-check.sh internode_shared`)."""
    if have < gpus and not (env.get("UCCL_EP_TEST_SHARE_GPU") == "1" and have >= 1):
        return f"needs {gpus} GPUs (UCCL_EP_TEST_SHARE_GPU=1: ranks share the GPUs there are)"
    if have >= world:
        return None
    most = int(env.get("UCCL_EP_TEST_MAX_RANKS_PER_GPU", "2"))
    if -(-world // have) > most:
        return f"{world} ranks on {have} GPU(s) puts more than {most} on one (UCCL_EP_TEST_MAX_RANKS_PER_GPU)"
    if mps is False and env.get("UCCL_EP_TEST_TIME_SLICED") != "1":
        return (f"{world} ranks on {have} GPU(s) would share them time-sliced (no MPS), where such cases stalled "
                "(session 50): run them under MPS (scripts/gpu-check.sh internode_mps), or set "
                "UCCL_EP_TEST_TIME_SLICED=1")
    return None


def _routing(kind, T, K, E, R, g):
    if kind == "every_rank":  # each token to K distinct experts covering every rank: what the buffer hints size for
        assert R <= K <= E, (R, K, E)
        local, j = E // R, torch.arange(K)
        turn = torch.randint(0, local, (T, 1), generator=g)
        return (j % R) * local + (j // R + turn) % local
    scores = torch.rand((T, E), generator=g)
    if kind == "skewed":
        scores[:, :K] += 10.0
    elif kind == "empty":
        scores[:, E // R:] = -1.0
    idx = scores.topk(K, dim=1).indices
    if kind == "dropped":
        idx[torch.rand((T, K), generator=g) < 0.3] = -1
    return idx


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if a.dtype.is_floating_point and a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b), f"{what} differs"


# (routing, fp8, expert_major, num_worst_tokens, seed)
ALL = [(k, fp8, em, worst, i) for i, (k, fp8, em, worst) in enumerate([
    ("random", False, False, 0), ("skewed", False, False, 0), ("empty", False, False, 0),
    ("dropped", False, False, 0), ("random", True, False, 0), ("dropped", True, False, 0),
    ("random", False, True, 0), ("random", False, False, 512), ("random", True, True, 2048),
    ("empty", False, True, 0)])]  # (a rank that receives nothing hands expert-major kernels empty tensors)
# expert-major cases beyond ALL's: skewed routing, dropped experts with FP8, and num_worst_tokens without FP8
EXPERT_MAJOR_CASES = [ALL[6], ("skewed", False, True, 0, 11), ALL[9], ("dropped", False, True, 0, 10), ALL[8],
                      ("dropped", True, True, 0, 12), ("random", False, True, 512, 13)]
# our own rows read from the columns: rank-major and expert-major receives with FP8 scales, dropped experts, skew,
# and a rank that receives nothing
OWN_ROW_CASES = [ALL[0], ALL[2], ALL[5], EXPERT_MAJOR_CASES[1], EXPERT_MAJOR_CASES[5], ALL[9]]


def compare_cases(nat, ref, dev, rank, world, cases, iters, H=256, unweighted=False, combine_dtype=torch.bfloat16):
    """Run every case ``iters`` times on both backends (the reference on CPU copies of the same inputs): uncached
    dispatch, cached dispatch, combine with the received weights (``unweighted``: and once more without), then a
    cached dispatch and a combine again (as a backward pass orders them: the dispatch right after a combine, where it
    may skip its entry barrier); every output must be equal bit for bit. The combines take rows of
    ``combine_dtype`` (bfloat16 or float32). Returns the number of (case, iteration) pairs compared."""
    from uccl_ep_train.backends import DispatchArgs

    done = 0
    for (kind, fp8, expert_major, worst, seed) in cases:
        for it in range(iters):
            g = torch.Generator().manual_seed(seed * 7919 + it * 31 + rank)
            T, K, E = 96 + 13 * rank, 4, 4 * world
            if worst:  # at least every token of every rank (T grows with the rank), so 8 ranks fit as 2 to 4 do
                worst = max(worst, sum(96 + 13 * r for r in range(world)))
            idx = _routing(kind, T, K, E, world, g)
            x = torch.randn((T, H), generator=g)
            w = torch.rand((T, K), generator=g)
            scales = None
            if fp8:
                x = x.clamp(-400, 400).to(torch.float8_e4m3fn)
                scales = torch.rand((T, H // 128), generator=g) + 0.5
            else:
                x = x.to(torch.bfloat16)
            outs = []
            for b, d in ((ref, torch.device("cpu")), (nat, dev)):
                tpr, tpn, tpe, itr = b.get_dispatch_layout(idx.to(d), E)
                a = DispatchArgs(x.to(d), None if scales is None else scales.to(d), None, tpr, tpn, itr, tpe,
                                 idx.to(d), w.to(d), expert_alignment=4 if expert_major else 1,
                                 num_worst_tokens=worst, expert_major=expert_major)
                r = b.dispatch(a)
                cached = b.dispatch(DispatchArgs(x.to(d), None if scales is None else scales.to(d), r.handle,
                                                 None, None, None, None, None, None))
                # scaled per rank, so the copies of a token differ (as expert outputs do) and a node's partial sum
                # is not exact in bf16: the rounding of the partials on the wire is checked too
                y = (r.recv_x.float() * (0.5 + 0.375 * rank) + 1.0).to(combine_dtype)
                cx, cw = b.combine(y, r.handle, r.recv_topk_weights, None)
                traffic = b.last_traffic
                ux, uw = b.combine(y, r.handle, None, None) if unweighted else (None, None)
                again = b.dispatch(DispatchArgs(x.to(d), None if scales is None else scales.to(d), r.handle,
                                                None, None, None, None, None, None))
                ax, aw = b.combine(y, r.handle, r.recv_topk_weights, None)
                outs.append((r, cached, cx, cw, traffic, ux, uw, again, ax, aw))
            (r0, c0, x0, w0, t0, u0, v0, _, _, _), (r1, c1, x1, w1, t1, u1, v1, a1, ax1, aw1) = outs
            tag = f"rank {rank} {kind} fp8={fp8} em={expert_major} worst={worst} it={it}"
            _same(r0.recv_x, r1.recv_x, f"{tag}: recv_x")
            _same(r0.recv_x_scales, r1.recv_x_scales, f"{tag}: scales")
            _same(r0.recv_topk_idx, r1.recv_topk_idx, f"{tag}: topk_idx")
            _same(r0.recv_topk_weights, r1.recv_topk_weights, f"{tag}: topk_weights")
            assert r0.num_recv_tokens_per_expert_list == r1.num_recv_tokens_per_expert_list, tag
            _same(r0.handle.num_recv_tokens_per_expert, r1.handle.num_recv_tokens_per_expert,
                  f"{tag}: the handle's tokens per expert (sync-free callers read them on the device)")
            _same(c0.recv_x, c1.recv_x, f"{tag}: cached recv_x")
            _same(x0, x1, f"{tag}: combined_x")
            _same(w0, w1, f"{tag}: combined weights")
            _same(u0, u1, f"{tag}: combined_x without weights")
            assert v0 is None and v1 is None, f"{tag}: combine without weights returned weights"
            _same(c0.recv_x, a1.recv_x, f"{tag}: cached recv_x right after a combine")
            _same(x0, ax1, f"{tag}: combined_x after that")
            _same(w0, aw1, f"{tag}: combined weights after that")
            assert (t0.nvlink_bytes, t0.network_bytes, t0.logical_bytes) == \
                (t1.nvlink_bytes, t1.network_bytes, t1.logical_bytes), f"{tag}: traffic"
            done += 1
    return done


# Every token to every rank: rank-major BF16, FP8 with scales, expert-major; then sync-free, rank-major (a row per
# token of every rank) and expert-major (num_worst_tokens past every (token, local expert) pair, as Megatron's
# dispatcher asks: tokens x ranks x min(top-k, local experts))
EVERY_RANK_CASES = [("every_rank", False, False, 0, 20), ("every_rank", True, False, 0, 21),
                    ("every_rank", False, True, 0, 22), ("every_rank", False, False, 1, 23),
                    ("every_rank", True, True, 2048, 24)]


def worst_routing_in_hinted_buffers(backends, rank, world, G):
    """In buffers of exactly Buffer.get_internode_bytes_hint for compare_cases' largest rank (BF16 combines, the
    default), EVERY_RANK_CASES match the reference; a float32 combine (twice the partial row) is then refused before
    any launch, and the next calls match again. ``backends(nvl, rdma)`` gives (native, reference, device) for those
    sizes. Returns (cases done, the refusal's message, or None if nothing refused)."""
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.buffer import Buffer
    from uccl_ep_train.internode import InternodeError

    T_max, H, K, E = 96 + 13 * (world - 1), 256, 4, 4 * world  # compare_cases' shapes
    nat, ref, dev = backends(*Buffer.get_internode_bytes_hint(T_max, H, K, world, G))
    try:
        done = compare_cases(nat, ref, dev, rank, world, EVERY_RANK_CASES, 1, H=H)
        g = torch.Generator().manual_seed(23 + rank)
        T = 96 + 13 * rank
        idx = _routing("every_rank", T, K, E, world, g).to(dev)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)
        r = nat.dispatch(DispatchArgs(torch.randn((T, H), generator=g).to(torch.bfloat16).to(dev), None, None, tpr,
                                      tpn, itr, tpe, idx, torch.rand((T, K), generator=g).to(dev)))
        refused = None
        try:
            nat.combine(r.recv_x.float(), r.handle, r.recv_topk_weights, None)
        except InternodeError as exc:
            refused = str(exc)
        done += compare_cases(nat, ref, dev, rank, world, EVERY_RANK_CASES[:1], 1, H=H)
        return done, refused
    finally:
        nat.destroy()


def check_a_failed_rank_sends_and_forwards_nothing(cx, scatter_rows, dev):
    """Once this rank's wait failed or was aborted (its stop flag holds the current generation), push_chunks queues
    no command and scatter_rows writes no row: a step launched behind the failed wait must not pass on rows it never
    received. After clear_error(), steps launched with the new generation move data again, while one launched with
    the failed generation (queued behind the failure) still does nothing.
    ``cx``: a one-rank InternodeContext (the native one or the CPU stand-in); ``dev``: where its regions live."""
    from uccl_ep_train.internode.columns import _raw_bytes

    rdma = _raw_bytes(cx.rdma_ptr, cx.rdma_bytes, dev)
    rdma[:4096] = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=dev)

    def scatter(generation):
        scatter_rows(cx.rdma_ptr + 2048, 32, 0, cx.rdma_ptr, 16, 0, 4, 16, 0, dst_rows=4, err=cx.error_word_ptr,
                     stop_flag=cx.stop_flag_ptr, stop_generation=generation, rank=0, phase=3, target=0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    cx.abort_waits()
    failed_generation = cx.stop_generation
    table = torch.tensor([[0, 0, 1024, 16, 10, 7, 1]], dtype=torch.int64, device=dev)
    cx.push_chunks(table.data_ptr(), 1, 4, 1, 0)
    before = rdma[2048:2048 + 4 * 32].clone()
    scatter(failed_generation)
    assert [f["tail"] for f in cx.fifo_states()] == [0] * len(cx.fifo_states()), "a failed rank pushed commands"
    assert cx.signal_value(7) == 0 and cx.signal_value(8) == 0
    assert torch.equal(rdma[2048:2048 + 4 * 32], before), "a failed rank forwarded rows"
    cx.clear_error()  # the host raised the error; the next call's steps run
    assert cx.stop_generation != failed_generation
    scatter(failed_generation)
    assert torch.equal(rdma[2048:2048 + 4 * 32], before), "a step queued behind the failure forwarded rows"
    scatter(cx.stop_generation)
    assert torch.equal(rdma[2048:2064], rdma[:16]) and torch.equal(rdma[2080:2096], rdma[16:32])


def _await_counters(cx, slots, want, secs=10.0):
    """Poll ``cx``'s counters ``slots`` until they read ``want`` (a GPU's writes land asynchronously)."""
    deadline = time.monotonic() + secs
    while [cx.signal_value(s) for s in slots] != want:
        assert time.monotonic() < deadline, f"counters {[cx.signal_value(s) for s in slots]} != {want}"
        time.sleep(0.001)


def check_pack_and_push_writes_the_records_of_pack_records_and_the_chunks_of_push_chunks(cx, pack_records, rdma, dev):
    """pack_and_push on one rank that writes to itself: 11 records (80 bytes: a 64-byte column, the source index,
    two final rows) of tokens in random order, the last two our own node's (written to their own place, never
    pushed), the other 9 pushed in chunks of 2 through two lanes. What lands, and what sits in the send area and the
    own block, must be exactly what pack_records writes; each lane's counter must move by its chunks' records; the
    chunk counters must be left zero (the next launch reuses them). A launch with every record our own node's (combine
    rows, no index fields) pushes nothing. ``rdma``: a uint8 view of cx's RDMA region on ``dev``."""
    stride, n, own, per, hint, slot = 80, 11, 2, 2, 1, 7
    send, own_at, recv, T, cb = 0, 2048, 4096, 16, 64
    g = torch.Generator().manual_seed(9)
    x = torch.randint(0, 256, (T, cb), generator=g, dtype=torch.uint8).to(dev)
    tokens = torch.randperm(T, generator=g)[:n].to(torch.int64).to(dev)
    dest = torch.randint(-1, 50, (n, 2), generator=g, dtype=torch.int64).to(dev)
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    rdma[:8192] = 0xAB
    expect = torch.zeros((n, stride), dtype=torch.uint8, device=dev)
    pack_records(expect.data_ptr(), 0, 0, 0, stride, tokens.data_ptr(), dest.data_ptr(), 2, n,
                 [(x.data_ptr(), cb, 0)], 64, 68, stream)
    base = [cx.signal_value(slot + f) for f in range(2)]
    table = torch.tensor([[0, send, recv, stride, n - own, slot, hint]], dtype=torch.int64, device=dev)
    ready = torch.zeros(8, dtype=torch.int32, device=dev)
    cx.pack_and_push(table.data_ptr(), 1, per, cx.rdma_ptr + send, cx.rdma_ptr + own_at, n - own, own, stride,
                     tokens.data_ptr(), dest.data_ptr(), 2, n, [(x.data_ptr(), cb, 0)], 64, 68, ready.data_ptr(), 1,
                     stream)
    if cuda:
        torch.cuda.synchronize(dev)
    # chunks 0..4 (records 2, 2, 2, 2, 1) through lanes (1 + c) % 2: lane 1 carries chunks 0, 2, 4, lane 0 chunks 1, 3
    want = [base[0] + 4, base[1] + 5]
    _await_counters(cx, [slot, slot + 1], want)
    assert cx.error_fields()["code"] == 0, cx.error_message()
    sent, used = n - own, 64 + 4 + 2 * 4  # the record's last 4 bytes are padding, which neither kernel writes
    assert torch.equal(rdma[send:send + sent * stride].view(sent, stride)[:, :used], expect[:sent, :used]), "send area"
    assert torch.equal(rdma[recv:recv + sent * stride].view(sent, stride)[:, :used], expect[:sent, :used]), "landed"
    assert torch.equal(rdma[own_at:own_at + own * stride].view(own, stride)[:, :used], expect[sent:, :used]), "own"
    assert int(ready.count_nonzero()) == 0, "pack_and_push left chunk counters behind"
    # every record our own node's, identity rows, no index fields (combine's rows): written where they go, no push
    rows = torch.randint(0, 256, (3, 48), generator=g, dtype=torch.uint8).to(dev)
    empty = torch.tensor([[0, send, recv, 64, 0, slot, hint]], dtype=torch.int64, device=dev)
    cx.pack_and_push(empty.data_ptr(), 1, per, cx.rdma_ptr + send, cx.rdma_ptr + own_at, 0, 3, 64, 0, 0, 0, 3,
                     [(rows.data_ptr(), 48, 0)], -1, 0, ready.data_ptr(), 2, stream)
    if cuda:
        torch.cuda.synchronize(dev)
    assert torch.equal(rdma[own_at:own_at + 3 * 64].view(3, 64)[:, :48], rows)
    assert [cx.signal_value(slot + f) for f in range(2)] == want, "a launch with nothing to send pushed"


def check_a_chunk_whose_records_are_never_written_makes_pack_and_push_fail_naming_it(cx, dev, codes):
    """A push table whose block holds 6 records while the launch writes 4 (a planning bug): the pusher must not wait
    forever for chunk 2 (records 4 and 5, chunks of 2) nor push it, but fail at the GPU deadline naming the chunk,
    the destination, the records counted and the records it waited for. ``cx``: a one-rank context with a short GPU
    deadline; ``codes``: the module's ERROR_CODES."""
    rows = torch.randint(0, 256, (4, 48), dtype=torch.uint8).to(dev)
    table = torch.tensor([[0, 0, 4096, 64, 6, 7, 1]], dtype=torch.int64, device=dev)
    ready = torch.zeros(8, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream if dev.type == "cuda" else 0
    t0 = time.monotonic()
    cx.pack_and_push(table.data_ptr(), 1, 2, cx.rdma_ptr, 0, 4, 0, 64, 0, 0, 0, 4, [(rows.data_ptr(), 48, 0)], -1, 0,
                     ready.data_ptr(), 1, stream)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    assert time.monotonic() - t0 < 30, "the pusher waited far past its deadline"
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["aux"], e["observed"], e["expected"]) == (codes["records_unwritten"], 2, 0, 0, 2), e
    msg = cx.error_message()
    assert "pack_and_push" in msg and "chunk 2" in msg and "0 of 2" in msg, msg
    cx.clear_error()


def check_node_sums_wait_for_tile_flags_and_name_a_gpu_that_never_flags(
        cx, gather_tiles, rdma, nvl, dev, codes, f32, blocks=0, own_range=None):
    """The pipelined combine gather (docs/internode.md, "Pipelined combine gather") on one rank that writes to itself,
    playing a forwarder and its node's 3 GPUs: GPU j's gather_tiles copies its random rows (and 3 fp32 weights) of a
    random subset of 40 arrivals into its gather block, in tiles of 8, and flags each tile; pack_and_push with node
    sums writes record a as the sum over j of those copies (fp32 in j order, one rounding: torch's) and pushes the 34
    records for "other nodes" in chunks of 4, the last 6 going to our own place. GPU 2 gathers late, from another
    thread and stream, over stale bytes: the records must still be exact, so the packers waited for its flags (also
    where it holds no copy: every GPU's flag gates every tile). Then
    wait_node_flags returns for the epoch reached; at the next epoch, with GPU 1 never flagging, both it and
    pack_and_push fail at the GPU deadline naming the GPU, a tile it holds, its flag and the epoch, and nothing is
    pushed. A row index past GPU 0's rows is reported and its tile never flagged. ``rdma``, ``nvl``: uint8 views of
    cx's regions on ``dev``; ``codes``: the module's ERROR_CODES; ``blocks``: gather_tiles' grid (0: a block per
    tile; fewer than the 5 tiles: each block takes several, in order); ``own_range`` (first, end): an own node's
    block of arrivals that the copies take last (e.g. (8, 20): tiles 0, 2, 3, 4, then 1), so that every tile must
    still be copied once and flagged whatever the order."""
    import threading

    dtype = torch.float32 if f32 else torch.bfloat16
    H, kw, A, own, tile, per, G = 64 // dtype.itemsize, 3, 40, 6, 8, 4, 3
    pay, stride, max_tiles = 64, 80, 1024
    send, recv, own_at, slot, hint = 0, 8192, 16384, 7, 1
    flags_at, gather_at, rows_per_block = 0, 16384, 48  # NVL: flags int32 [G][max_tiles], then the gather blocks
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(23 + f32)
    held = torch.rand((G, A), generator=g) < 0.6
    held[2, 8:16] = False  # a tile GPU 2 holds nothing of: its flag is still waited for (its stream is past the unpack)
    held[1] = True
    xs = [torch.randn((A, H), generator=g).to(dtype).to(dev) for _ in range(G)]
    ws = [torch.rand((A, kw), generator=g).to(dev) for _ in range(G)]
    # GPU j's row of arrival a: a permutation of its rows (its rows are in its own order, not the forwarder's)
    perms = [torch.randperm(A, generator=g) for _ in range(G)]
    nvl[:flags_at + 4 * G * max_tiles] = 0
    nvl[gather_at:gather_at + G * rows_per_block * stride] = 0xAB  # stale bytes where the copies go
    rdma[:own_at + own * stride] = 0xCD
    expect_x = torch.zeros((A, H))
    expect_w = torch.zeros((A, kw))
    for j in range(G):
        rows = perms[j].to(dev)
        expect_x += torch.where(held[j].unsqueeze(1), xs[j][rows].float().cpu(), 0.0)
        expect_w += torch.where(held[j].unsqueeze(1), ws[j][rows].cpu(), 0.0)
    expect_x = expect_x.to(dtype)
    rows_of = torch.where(held, torch.arange(G).unsqueeze(1) * rows_per_block + torch.arange(A), -1)
    rows_of = rows_of.to(torch.int32).to(dev)

    # GPU j's tables: where its gather block and flag row sit at the forwarder, and its row of each arrival
    tables = [(torch.tensor([cx.nvl_ptr + gather_at + j * rows_per_block * stride], dtype=torch.int64, device=dev),
               torch.tensor([cx.nvl_ptr + flags_at + 4 * j * max_tiles], dtype=torch.int64, device=dev),
               torch.where(held[j], perms[j], -1).to(torch.int32).view(1, A).to(dev)) for j in range(G)]
    arrivals = torch.tensor([A], dtype=torch.int64, device=dev)
    own_ranges = torch.tensor([[own_range[0]], [own_range[1]]], dtype=torch.int64, device=dev) if own_range else None

    def gather(j, epoch, stream):
        dsts, flags, by_arrival = tables[j]
        gather_tiles(dsts.data_ptr(), flags.data_ptr(), 1, by_arrival.data_ptr(), A, arrivals.data_ptr(), tile,
                     xs[j].data_ptr(), pay, ws[j].data_ptr(), kw, A, stride, epoch, stream,
                     err=cx.error_word_ptr, stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation, rank=0,
                     phase=4, blocks=blocks, own_ranges=own_ranges.data_ptr() if own_ranges is not None else 0)

    main = torch.cuda.Stream(dev) if cuda else None
    late = torch.cuda.Stream(dev) if cuda else None
    stream = main.cuda_stream if cuda else 0

    def late_gather():
        if cuda:
            torch.cuda.set_device(dev)
        time.sleep(0.3)
        gather(2, 1, late.cuda_stream if cuda else 0)
        if cuda:
            late.synchronize()

    table = torch.tensor([[0, send, recv, stride, A - own, slot, hint]], dtype=torch.int64, device=dev)
    ready = torch.zeros(16, dtype=torch.int32, device=dev)
    if cuda:
        torch.cuda.synchronize(dev)  # the tables are on the device before any launch on the side streams
    base = [cx.signal_value(slot + f) for f in range(2)]
    for j in range(2):
        gather(j, 1, stream)
    node_sums = (cx.nvl_ptr + gather_at, rows_of.data_ptr(), G, pay, kw, f32, cx.nvl_ptr + flags_at, tile, 1)
    late_thread = threading.Thread(target=late_gather)
    late_thread.start()  # on the GPU the packers spin while GPU 2's gather comes; the stand-in waits in this thread
    cx.pack_and_push(table.data_ptr(), 1, per, cx.rdma_ptr + send, cx.rdma_ptr + own_at, A - own, own, stride,
                     0, 0, 0, A, [], -1, 0, ready.data_ptr(), 2, stream, node_sums=node_sums)
    late_thread.join(timeout=60)  # (the late gather never waits; a thread still alive here would be a hang)
    assert not late_thread.is_alive(), "GPU 2's late gather did not finish within 60 s"
    if cuda:
        main.synchronize()
    assert cx.error_fields()["code"] == 0, cx.error_message()
    chunks = -(-(A - own) // per)  # lanes (hint + c) % 2: lane 1 carries the even chunks
    want = [base[0] + sum(min(per, A - own - c * per) for c in range(chunks) if (hint + c) % 2 == 0),
            base[1] + sum(min(per, A - own - c * per) for c in range(chunks) if (hint + c) % 2 == 1)]
    _await_counters(cx, [slot, slot + 1], want)
    landed = torch.cat([rdma[recv:recv + (A - own) * stride], rdma[own_at:own_at + own * stride]]).view(A, stride)
    got_x = landed[:, :pay].contiguous().view(dtype).cpu()
    got_w = landed[:, pay:pay + 4 * kw].contiguous().view(torch.float32).cpu()
    assert torch.equal(got_x, expect_x), "node sums differ from the copies' sum (a record read before its tile?)"
    assert torch.equal(got_w, expect_w), "summed weights differ"
    assert int(ready.count_nonzero()) == 0, "pack_and_push left chunk counters behind"
    cx.wait_node_flags(cx.nvl_ptr + flags_at, G, A // tile, 1, 4, stream)  # every tile of every GPU flagged
    if cuda:
        main.synchronize()
    assert cx.error_fields()["code"] == 0, cx.error_message()
    # epoch 2: GPUs 0 and 2 gather, GPU 1 never does
    gather(0, 2, stream)
    gather(2, 2, stream)
    t0 = time.monotonic()
    node_sums = node_sums[:-1] + (2,)
    cx.pack_and_push(table.data_ptr(), 1, per, cx.rdma_ptr + send, cx.rdma_ptr + own_at, A - own, own, stride,
                     0, 0, 0, A, [], -1, 0, ready.data_ptr(), 2, stream, node_sums=node_sums)
    if cuda:
        main.synchronize()
    assert time.monotonic() - t0 < 30, "the packers waited far past their deadline"
    e = cx.error_fields()
    tiles_of_1 = {int(a) // tile for a in held[1].nonzero().squeeze(1)}
    assert (e["code"], e["slot"], e["observed"], e["expected"]) == (codes["node_flag_timeout"], 1, 1, 2), e
    assert e["aux"] in tiles_of_1, (e, tiles_of_1)
    msg = cx.error_message()
    assert "local GPU 1 did not raise flag" in msg and "waited for epoch 2" in msg, msg
    assert [cx.signal_value(slot + f) for f in range(2)] == want, "a chunk left without its node sums"
    cx.clear_error()
    ready.zero_()  # (a failed launch may leave counts behind: the backend drops its counters then)
    cx.wait_node_flags(cx.nvl_ptr + flags_at, G, 1, 2, 4, stream)
    if cuda:
        main.synchronize()
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["aux"], e["expected"]) == (codes["node_flag_timeout"], 1, 0, 2), e
    cx.clear_error()
    # epoch 3: GPU 0's table names a row it does not have for arrival 21 (tile 2): reported, and that tile never
    # flagged, so its forwarder cannot sum the tile with a copy missing
    dsts, flags, by_arrival = tables[0]
    by_arrival[0, 21] = A
    if cuda:
        torch.cuda.synchronize(dev)  # (the table's change, on the default stream, before the launch on ours)
    gather(0, 3, stream)
    if cuda:
        main.synchronize()
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["aux"], e["observed"], e["expected"]) == (codes["scatter_range"], 0, 21, A, A), e
    flag_row = nvl[flags_at:flags_at + 4 * max_tiles].view(torch.int32)
    assert int(flag_row[21 // tile]) == 2, "a tile with a corrupt index was flagged"
    cx.clear_error()


def check_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named(cx, raise_flags, nvl, dev, codes):
    """The dispatch forward's node barrier (docs/internode.md, "The dispatch forward's node barrier") on one rank
    playing a node of 3 GPUs: GPUs 0 and 2 raise their flags (column 0 of their rows) to epoch 5, and the wait for every
    GPU's flag fails at the GPU deadline naming GPU 1, flag 0, the value it saw and the epoch; a stopped rank raises
    nothing; once GPU 1 raises its flag the wait passes. ``nvl``: a uint8 view of cx's NVL region on ``dev``."""
    G, width, epoch = 3, 1024, 5
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    nvl[:4 * G * width] = 0
    at = torch.tensor([cx.nvl_ptr + 4 * j * width for j in range(G)], dtype=torch.int64, device=dev)
    flags = nvl[:4 * G * width].view(torch.int32).view(G, width)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    raise_flags(at[0:1].data_ptr(), 1, epoch, stream)
    raise_flags(at[2:3].data_ptr(), 1, epoch, stream)
    sync()
    assert flags[:, 0].tolist() == [epoch, 0, epoch] and int(flags[:, 1:].count_nonzero()) == 0, flags[:, :2]
    t0 = time.monotonic()
    cx.wait_node_flags(cx.nvl_ptr, G, 1, epoch, 3, stream)
    sync()
    assert time.monotonic() - t0 < 30, "the wait went far past its deadline"
    e = cx.error_fields()
    assert ((e["code"], e["slot"], e["aux"], e["observed"], e["expected"])
            == (codes["node_flag_timeout"], 1, 0, 0, epoch))
    msg = cx.error_message()
    assert "local GPU 1 did not raise flag 0" in msg and f"waited for epoch {epoch}" in msg, msg
    # a stopped rank (the error above set its stop flag) raises nothing
    raise_flags(at[1:2].data_ptr(), 1, epoch, stream, stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation)
    sync()
    assert int(flags[1, 0]) == 0, "a stopped rank raised its flag"
    cx.clear_error()
    raise_flags(at[1:2].data_ptr(), 1, epoch, stream, stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation)
    cx.wait_node_flags(cx.nvl_ptr, G, 1, epoch, 3, stream)
    sync()
    assert cx.error_fields()["code"] == 0, cx.error_message()


def check_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them(cx, rdma, dev, codes):
    """push_after_counts on one rank that writes to itself (node 0: no source node comes before it, so each block
    stays at its row's offset; the moves themselves are proven by place_blocks and the multi-rank comparisons). Its
    count row is pushed into the rows area first, signalling counter 20; the push, launched behind it, must wait for
    that signal, then send 7 records of 64 bytes in chunks of 2 through lanes (1 + c) % 2 (counters 7 and 8), exactly
    as push_chunks. On a GPU, where ``cx``'s loopback delays each write, the records must land a whole delay after the
    row, not with it. A destination whose arrivals exceed the receive area gets nothing, and no error. A table made
    before our own counts were read gets its records from our row, and sends none past the send limit. A row
    that never comes fails at the GPU deadline naming the counter, the value seen and the one waited for, and
    nothing is pushed. ``rdma``: a uint8 view of cx's RDMA region on ``dev``; ``codes``: the module's ERROR_CODES."""
    stride, n, per, hint, slot, row_slot = 64, 7, 2, 1, 7, 20
    recv, rows_at, staging, row_words = 16384, 8192, 12288, 4
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    g = torch.Generator().manual_seed(11)
    rdma[:n * stride] = torch.randint(0, 256, (n * stride,), generator=g, dtype=torch.uint8).to(dev)
    rdma[recv:recv + n * stride] = 0xAB  # stale bytes where the records land
    rdma[rows_at:rows_at + 8 * row_words] = 0  # no count row yet
    # our count row: n tokens for rank 0 and for node 0 (column R + 0 = 1)
    rdma[staging:staging + 8 * row_words] = torch.tensor([n, n, 0, 0], dtype=torch.int64).view(torch.uint8).to(dev)
    lanes = [cx.signal_value(slot + f) for f in range(2)]
    rows_base = cx.signal_value(row_slot)
    row_push = torch.tensor([[0, staging, rows_at, 8 * row_words, 1, row_slot, 0]], dtype=torch.int64, device=dev)
    table = torch.tensor([[0, 0, recv, stride, n, slot, hint]], dtype=torch.int64, device=dev)
    receive = 1 << 14
    cx.push_chunks(row_push.data_ptr(), 1, 1, 6, stream)
    cx.push_after_counts(table.data_ptr(), 1, per, row_slot, rows_base + 1, cx.rdma_ptr + rows_at, row_words, 1,
                         receive, 1, stream)
    if cuda:
        # each write lands a delay after it was posted: had the block left with the row, it would land right after
        # it; posted once the row is in, it lands a whole delay later
        deadline = time.monotonic() + 10
        while cx.signal_value(row_slot) < rows_base + 1:
            assert time.monotonic() < deadline, "the count row never landed"
            time.sleep(0.0005)
        time.sleep(0.005)
        assert [cx.signal_value(slot + f) for f in range(2)] == lanes, "the block left before the count rows were in"
        torch.cuda.synchronize(dev)
    # chunks 0..3 (records 2, 2, 2, 1) through lanes (1 + c) % 2: lane 1 carries chunks 0 and 2, lane 0 chunks 1, 3
    want = [lanes[0] + 3, lanes[1] + 4]
    _await_counters(cx, [slot, slot + 1], want)
    assert cx.error_fields()["code"] == 0, cx.error_message()
    assert torch.equal(rdma[recv:recv + n * stride], rdma[:n * stride]), "the records did not land at their block"
    # a receive area one record short of the destination's arrivals: nothing goes, and that is no error
    rdma[recv:recv + n * stride] = 0xAB
    cx.push_after_counts(table.data_ptr(), 1, per, row_slot, rows_base + 1, cx.rdma_ptr + rows_at, row_words, 1,
                         (n - 1) * stride, 1, stream)
    if cuda:
        torch.cuda.synchronize(dev)
    time.sleep(0.05)
    assert [cx.signal_value(slot + f) for f in range(2)] == want, "a block too big for its destination's area left"
    assert bool((rdma[recv:recv + n * stride] == 0xAB).all()) and cx.error_fields()["code"] == 0
    # a table made before our own counts were read (records 0): with a send limit the kernel takes the records from
    # our own row (column R + 0 of row 0: n), and sends none when they pass the limit, which is no error either
    blank = torch.tensor([[0, 0, recv, stride, 0, slot, hint]], dtype=torch.int64, device=dev)
    cx.push_after_counts(blank.data_ptr(), 1, per, row_slot, rows_base + 1, cx.rdma_ptr + rows_at, row_words, 1,
                         receive, 1, stream, send_limit=n * stride - 1)
    if cuda:
        torch.cuda.synchronize(dev)
    time.sleep(0.05)
    assert [cx.signal_value(slot + f) for f in range(2)] == want, "records past the send limit left"
    assert bool((rdma[recv:recv + n * stride] == 0xAB).all()) and cx.error_fields()["code"] == 0
    cx.push_after_counts(blank.data_ptr(), 1, per, row_slot, rows_base + 1, cx.rdma_ptr + rows_at, row_words, 1,
                         receive, 1, stream, send_limit=n * stride)
    want = [want[0] + 3, want[1] + 4]
    _await_counters(cx, [slot, slot + 1], want)
    assert cx.error_fields()["code"] == 0, cx.error_message()
    assert torch.equal(rdma[recv:recv + n * stride], rdma[:n * stride]), "records taken from our row did not land"
    # a count row that never comes: the deadline, naming the counter, what it saw and what it waited for
    t0 = time.monotonic()
    cx.push_after_counts(table.data_ptr(), 1, per, row_slot, rows_base + 2, cx.rdma_ptr + rows_at, row_words, 1,
                         receive, 1, stream)
    if cuda:
        torch.cuda.synchronize(dev)
    assert time.monotonic() - t0 < 30, "the push waited far past its deadline"
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["observed"], e["expected"]) == (codes["wait_timeout"], row_slot, rows_base + 1,
                                                                     rows_base + 2), e
    assert [cx.signal_value(slot + f) for f in range(2)] == want, "the push went on without the count rows"
    cx.clear_error()


def check_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends(cx, rdma, dev):
    """pack_and_push_after_counts given our count row's pushes (the notify's push table) on one rank writing to
    itself: the row leaves with the launch -- it lands in the rows area and moves its counter once -- also when the
    launch then sends no record (here our records pass the send limit), and when there is no launch at all (no
    token: capacity 0). Pushes without a table are refused before any launch. signals_short reads how far counters
    are from targets (what the backend asks of a hop's counters). ``rdma``: a uint8 view of cx's RDMA
    region on ``dev``."""
    stride, n, per, hint, slot, row_slot = 80, 5, 2, 1, 7, 20
    recv, rows_at, staging, row_words, cb = 16384, 8192, 12288, 4, 64
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    g = torch.Generator().manual_seed(13)
    x = torch.randint(0, 256, (n, cb), generator=g, dtype=torch.uint8).to(dev)
    hop1 = torch.zeros(n, dtype=torch.int64, device=dev)
    dest = torch.zeros((n, 1), dtype=torch.int64, device=dev)
    ready = torch.zeros(16, dtype=torch.int32, device=dev)
    row = torch.randint(1, 1 << 20, (row_words,), generator=g, dtype=torch.int64)
    row[:2] = n  # n tokens for rank 0 and node 0
    rdma[staging:staging + 8 * row_words] = row.view(torch.uint8).to(dev)
    rdma[rows_at:rows_at + 8 * row_words] = 0
    row_push = torch.tensor([[0, staging, rows_at, 8 * row_words, 1, row_slot, 0]], dtype=torch.int64, device=dev)
    blank = torch.tensor([[0, 0, recv, stride, 0, slot, hint]], dtype=torch.int64, device=dev)
    lanes, rows_base = [cx.signal_value(slot + f) for f in range(2)], cx.signal_value(row_slot)

    def launch(capacity, pushes=row_push.data_ptr(), rows=1):
        cx.pack_and_push_after_counts(blank.data_ptr(), 1, per, cx.rdma_ptr, stride, hop1.data_ptr(), dest.data_ptr(),
                                      1, capacity, [(x.data_ptr(), cb, 0)], 64, 68, row_slot, rows_base + 1,
                                      cx.rdma_ptr + rows_at, row_words, 1 << 14, n * stride - 1, ready.data_ptr(), 1,
                                      stream, own_row_pushes=pushes, own_row_push_rows=rows, own_row_push_phase=6)
        if cuda:
            torch.cuda.synchronize(dev)

    launch(n)  # our n records pass the send limit (n * stride - 1): only the row goes
    _await_counters(cx, [row_slot], [rows_base + 1])
    # how far counters are from targets (a hop's records still to land): past or at a target counts nothing
    assert cx.signals_short([(row_slot, rows_base + 3), (slot, lanes[0] + 2), (slot + 1, lanes[1] - 1)]) == 4
    assert cx.error_fields()["code"] == 0, cx.error_message()
    assert torch.equal(rdma[rows_at:rows_at + 8 * row_words].cpu(), row.view(torch.uint8)), "the row did not land"
    assert [cx.signal_value(slot + f) for f in range(2)] == lanes, "records past the send limit left"
    rdma[rows_at:rows_at + 8 * row_words] = 0
    launch(0)  # no token, no launch: the row still leaves
    _await_counters(cx, [row_slot], [rows_base + 2])
    assert cx.signals_short([(row_slot, rows_base + 2)]) == 0
    assert torch.equal(rdma[rows_at:rows_at + 8 * row_words].cpu(), row.view(torch.uint8)), "no row without a launch"
    with pytest.raises(ValueError, match="own_row_push_rows"):
        launch(n, pushes=0)
    assert cx.signal_value(row_slot) == rows_base + 2 and cx.error_fields()["code"] == 0


def check_a_gated_unpack_reads_rows_only_after_their_chunks_land(cx, unpack_records, rdma, dev, codes):
    """The arrival gate on one rank that writes to itself: ten 64-byte records in chunks of 3 through two lanes
    (chunk c through lane (1 + c) % 2, counters 7 and 8) land over stale bytes in the receive area, and an unpack gated
    on them must copy the records, not the stale bytes; on a GPU (where ``cx``'s loopback delays each write, one at a
    time) it must still be waiting while they land. Then the last chunk never comes: the wait must fail at the GPU
    deadline naming lane 0's counter, the value it stopped at and the one its last chunk would reach (what the
    launch's watcher waits for), and nothing is read. ``rdma``: a uint8 view of cx's RDMA region on ``dev``."""
    stride, n, per, hint, slot, recv = 64, 10, 3, 1, 7, 4096
    g = torch.Generator().manual_seed(5)
    rdma[:n * stride] = torch.randint(0, 256, (n * stride,), generator=g, dtype=torch.uint8).to(dev)
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    for records in (n, n - 1):
        rdma[recv:recv + n * stride] = 0xAB  # stale bytes where the records land
        base = [cx.signal_value(slot + f) for f in range(2)]
        push = torch.tensor([[0, 0, recv, stride, records, slot, hint]], dtype=torch.int64, device=dev)
        gate_table = torch.tensor([[0, n, slot, hint] + base], dtype=torch.int64, device=dev)
        out = torch.zeros((n, 48), dtype=torch.uint8, device=dev)
        gate = cx.arrival_gate(gate_table.data_ptr(), 1, per, 1)
        cx.push_chunks(push.data_ptr(), 1, per, 1, stream)
        unpack_records(cx.rdma_ptr + recv, stride, n, n, [(out.data_ptr(), 48, 0)], 0, 0, 0, 0, 0, 0, 0, 48, 0, -1,
                       0, stream, gate=gate)
        if cuda:
            done = torch.cuda.Event()
            done.record()
            if records == n:
                time.sleep(0.03)  # the writes land 20 ms apart
                assert not done.query(), "the gated unpack finished before its chunks landed"
            done.synchronize()
        e = cx.error_fields()
        if records == n:
            assert e["code"] == 0, cx.error_message()
            assert torch.equal(out, rdma[:n * stride].view(n, stride)[:, :48]), "a row was read before it landed"
        else:
            # the missing chunk 3 (the tenth record) goes through lane (1 + 3) % 2 = 0, which carries chunks 1 and 3
            assert (e["code"], e["slot"], e["observed"], e["expected"]) == \
                (codes["wait_timeout"], slot, base[0] + 3, base[0] + 4), e
            assert not bool((out[9] != 0).any()), "a row was read after the wait failed"
            cx.clear_error()


def _pair_matches(nat, ref, dev, idx, g, E, H=128):
    """A dispatch of ``idx``'s tokens (random bf16 rows, random weights from ``g``) and its combine on both backends,
    the native one on ``dev`` and the reference on CPU copies: whether both outputs are equal."""
    from uccl_ep_train.backends import DispatchArgs

    T = idx.size(0)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    w = torch.rand((T, idx.size(1)), generator=g)
    outs = []
    for b, d in ((ref, torch.device("cpu")), (nat, dev)):
        tpr, tpn, tpe, itr = b.get_dispatch_layout(idx.to(d), E)
        r = b.dispatch(DispatchArgs(x.to(d), None, None, tpr, tpn, itr, tpe, idx.to(d), w.to(d)))
        outs.append((r.recv_x.cpu(), b.combine(r.recv_x, r.handle, r.recv_topk_weights, None)[0].cpu()))
    return all(torch.equal(a, b) for a, b in zip(*outs))


def a_peers_next_count_row_leaves_this_calls_rows_intact(nat, ref, dev, rank, world):
    """Two uncached dispatches back to back, no combine between: rank 1 pushes its second count row as soon as its
    first dispatch is done, and rank 0 waits until that row has landed before its own second dispatch. Returns (for
    rank 0: whether the count rows of its first dispatch -- which its kernels may still read -- were left as they
    were, else None; whether both dispatches' outputs and the second one's combine equal the reference's). With one
    notify area the second row overwrote them (session 50); the areas are taken in turns."""
    from uccl_ep_train.backends import DispatchArgs

    E = 4 * world
    g = torch.Generator().manual_seed(100 + rank)

    def dispatch(idx, after_native=lambda: None):
        # the native backend's call first, then ``after_native``: no peer can start its next call before our
        # reference call below (a collective), so what it sees is this call's alone
        x = torch.randn((idx.size(0), 128), generator=g).to(torch.bfloat16)
        w = torch.rand(idx.shape, generator=g)
        outs = []
        for b, d in ((nat, dev), (ref, torch.device("cpu"))):
            tpr, tpn, tpe, itr = b.get_dispatch_layout(idx.to(d), E)
            outs.append(b.dispatch(DispatchArgs(x.to(d), None, None, tpr, tpn, itr, tpe, idx.to(d), w.to(d))))
            if b is nat:
                after_native()
        return torch.equal(outs[0].recv_x.cpu(), outs[1].recv_x), outs

    # every rank's first and second routings differ, so a count row of the second call differs from the first's
    first = torch.rand((48, E), generator=g).topk(2, dim=1).indices
    second = torch.rand((80, E), generator=g).topk(3, dim=1).indices

    seen = []  # (the count rows of the first call where its kernels read them, a copy of them)

    def keep_rows():
        rows_at = nat._notify_rows_at
        rows = _raw_bytes(rows_at.ptr, 8 * world * rows_at.row_words, dev)
        seen.extend((rows, rows.clone()))

    same_first, _ = dispatch(first, keep_rows)
    rows, before = seen
    intact = None
    if rank == 0:
        slot, target = nat._notify_slot, nat._expected[nat._notify_slot] + 1  # a peer's next row in
        deadline = time.monotonic() + 30
        while nat._cx.signal_value(slot) < target:
            assert time.monotonic() < deadline, (
                f"rank {rank}: notify slot {slot} (count rows) stayed at {nat._cx.signal_value(slot)} for 30 s, "
                f"waiting for {target}: no peer pushed its next count row")
            time.sleep(0.001)
        intact = torch.equal(rows, before)
    same_second, outs = dispatch(second)
    combined = [b.combine(r.recv_x, r.handle, r.recv_topk_weights, None)[0].cpu() for b, r in zip((nat, ref), outs)]
    return intact, same_first and same_second and torch.equal(*combined)


def _raw_bytes(ptr, nbytes, dev):
    from uccl_ep_train.internode.columns import _raw_bytes as raw

    return raw(ptr, nbytes, dev)


def records_past_the_partial_sums(nat, ref, dev, rank, world):
    """A dispatch whose every token goes to both nodes and its combine (whose partial sums fill the top of each send
    half), then a bigger uncached dispatch whose records would reach into them, then a small one; the native backend
    on ``dev`` (an RDMA area of 2 MiB), the reference on CPU copies. Returns ((packs, pushes during notify) after
    each of the three, whether every output equals the reference's)."""
    E = 4 * world
    g = torch.Generator().manual_seed(rank)
    seen, same = [], True
    for T in (700, 1300, 300):
        # 700: its combine's partial sums, 1400 arrivals' worth at the top of each send half; 1300: 2600 records,
        # past where those start, so packed after notify; 300: 600 records, below the 2600 partial sums of the
        # combine before, packed and pushed during notify
        idx = torch.tensor([[0, E // 2]] * T)  # the first expert of node 0 and of node 1
        same = _pair_matches(nat, ref, dev, idx, g, E) and same
        seen.append((nat.packs_during_notify, nat.pushes_during_notify))
    return seen, same


def one_forwarder_of_a_node_forwards_after_the_count_read(nat, ref, dev, rank, world):
    """2 x 2, an RDMA area of 2 MiB: a dispatch whose every token goes to both nodes and its combine (whose partial
    sums fill the top of each send half), then a dispatch of as many tokens in which rank 0 again sends every token to
    both nodes -- past those partial sums, so it packs after notify and its forward before the count read must not go
    -- while the other ranks send theirs to their own node only, below them, and forward before the count read. The
    node barrier then has rank 0's flag come from its forward after the count read. Returns ((forwards before the
    count read, readers that handed back) after each dispatch, whether every output equals the reference's)."""
    E, T = 4 * world, 1000
    g = torch.Generator().manual_seed(rank)
    seen, same = [], True
    for step in range(2):
        own_node = 0 if rank < world // 2 else E // 2  # the first expert of our own node
        both = step == 0 or rank == 0
        idx = torch.tensor([[0, E // 2]] * T) if both else torch.tensor([[own_node, own_node + 1]] * T)
        same = _pair_matches(nat, ref, dev, idx, g, E) and same
        seen.append((nat.forwards_before_counts, nat.reads_before_counts_declined))
    return seen, same


def area_too_small_after_a_push_during_notify(nat, ref, dev, rank, world):
    """A dispatch and its combine, then an uncached dispatch (packed and pushed during notify) whose arrivals
    overflow rank 1's receive area but not rank 0's: rank 1 sends rank 0 20 records, rank 0 sends rank 1 every token
    (2 x 1, an RDMA area of 2 MiB). Returns (the error, whether the dispatch counters are at their targets, pushes
    during notify, pairs compared by a whole case run afterwards)."""
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode import InternodeError

    E, H = 4 * world, 128
    g = torch.Generator().manual_seed(rank)

    def dispatch(idx):
        x = torch.randn((idx.size(0), H), generator=g).to(torch.bfloat16).to(dev)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx.to(dev), E)
        return nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx.to(dev), None))

    r = dispatch(torch.randint(0, E, (64, 2), generator=g))
    nat.combine(r.recv_x, r.handle, None, None)
    records = nat.half_rdma // (2 * H + 48)  # records of this shape an area holds (each side of the region)
    if rank == 0:  # 0.45 of an area to each node
        idx = torch.tensor([[0, 4]] * int(0.45 * records))
    else:  # 0.7 of an area to its own node, 20 records to node 0: node 1's arrivals overflow, node 0's do not
        idx = torch.tensor([[4, 5]] * int(0.7 * records))
        idx[:20] = torch.tensor([0, 4])
    try:
        dispatch(idx)
        err = "no error"
    except InternodeError as exc:
        err = str(exc)
    # every dispatch lane's counter at the host's target: what was pushed to us landed, and was accounted for (the
    # peer's next call sends on these lanes only after our next count row, which comes after this)
    in_step = all(nat._cx.signal_value(s) == nat._expected[s] for s in range(nat.N * nat.L))
    done = compare_cases(nat, ref, dev, rank, world, ALL[:1], 1)
    return err, in_step, nat.pushes_during_notify, done


def too_few_worst_rows(nat, ref, dev, rank, world):
    """A dispatch and its combine, then two uncached dispatches whose receive needs more rows than num_worst_tokens
    (8): rank-major (the received tokens) and expert-major (the aligned expert-major rows, checked before the reader's
    launch with its outputs). Returns, per kind, (the error, whether the dispatch counters are at their targets),
    then the pairs compared by a rank-major and an expert-major case run afterwards."""
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode import InternodeError

    E, H = 4 * world, 128
    g = torch.Generator().manual_seed(rank)

    def dispatch(worst, expert_major):
        idx = torch.randint(0, E, (64, 2), generator=g)
        x = torch.randn((64, H), generator=g).to(torch.bfloat16).to(dev)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx.to(dev), E)
        return nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx.to(dev), torch.rand((64, 2)).to(dev),
                                         num_worst_tokens=worst, expert_major=expert_major))

    r = dispatch(0, False)
    nat.combine(r.recv_x, r.handle, None, None)
    seen = []
    for expert_major in (False, True):
        try:
            dispatch(8, expert_major)
            err = "no error"
        except InternodeError as exc:
            err = str(exc)
        seen.append((err, all(nat._cx.signal_value(s) == nat._expected[s] for s in range(nat.N * nat.L))))
    return seen, compare_cases(nat, ref, dev, rank, world, [ALL[0], ALL[6]], 1)

# (row bytes, source stride, destination stride, destination bases' offset): 16-byte, 4-byte and 1-byte words in
# forward_rows, and 16-byte rows at 8-byte bases (the combine gather's weights behind a payload of 8 mod 16 bytes)
FORWARD_ROW_SHAPES = [(48, 64, 80, 0), (48, 64, 80, 8), (20, 36, 24, 4), (7, 9, 11, 1)]
FORWARD_ROW_SHAPE_IDS = ["16B", "16B-rows-8B-bases", "4B", "1B"]


def check_forward_rows_sends_each_row_to_every_gpu_that_needs_it(cx, forward_rows, dev, shape):
    """forward_rows (the dispatch forward over NVLink): each of n source rows lands at the row its index names in every
    target's area (-1: not that target), and nothing else in the region changes; an index at or past a target's rows
    is reported with that target and the row's list position and never written; while the rank's stop flag holds
    the launch's generation nothing moves. Destination bases only 8-, 4- or 1-byte aligned take narrower words
    (on a GPU, 16-byte stores there fault). Three targets carved from the RDMA region stand in for the node's GPUs.
    ``cx``: a one-rank InternodeContext (the native one or the CPU stand-in); ``dev``: where its regions live."""
    from uccl_ep_train.internode.columns import _raw_bytes

    row_bytes, src_stride, dst_stride, offset = shape
    G, n, cap, span = 3, 37, 50, 8192
    rdma = _raw_bytes(cx.rdma_ptr, cx.rdma_bytes, dev)
    bases = [4096 + offset + j * span for j in range(G)]
    end = bases[-1] + span
    bases_or = functools.reduce(operator.or_, (cx.rdma_ptr + b for b in bases))
    gen = torch.Generator().manual_seed(row_bytes)
    idx = torch.stack([torch.randperm(cap, generator=gen)[:n] for _ in range(G)], 1)
    idx[torch.rand((n, G), generator=gen) < 0.3] = -1  # rows some GPUs do not need
    idx[3] = -1  # a row no GPU needs
    targets = torch.tensor([cx.rdma_ptr + b for b in bases], dtype=torch.int64, device=dev)
    limits = torch.full((G,), cap, dtype=torch.int64, device=dev)

    def run(index, generation):
        rdma[:end] = torch.randint(0, 256, (end,), dtype=torch.uint8, generator=gen).to(dev)
        before = rdma[:end].cpu().clone()  # (.cpu() is no copy on the CPU stand-in)
        index = index.to(dev)
        forward_rows(targets.data_ptr(), bases_or, dst_stride, index.data_ptr(), G, cx.rdma_ptr, src_stride, n,
                     row_bytes, limits.data_ptr(), 0, err=cx.error_word_ptr, stop_flag=cx.stop_flag_ptr,
                     stop_generation=generation, rank=0, phase=3)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return before, rdma[:end].cpu().clone()

    def expected(before, index):
        want = before.clone()
        for j in range(G):
            for r in range(n):
                d = int(index[r, j])
                if 0 <= d < cap:
                    at = bases[j] + d * dst_stride
                    want[at:at + row_bytes] = before[r * src_stride:r * src_stride + row_bytes]
        return want

    before, after = run(idx, cx.stop_generation)
    assert cx.error_fields()["code"] == 0, cx.error_message()
    assert torch.equal(after, expected(before, idx)), "forward_rows differs from a scatter per GPU"
    assert not torch.equal(after, before)
    bad = idx.clone()
    bad[5, 1] = cap  # one row past target 1's area: reported, not written
    before, after = run(bad, cx.stop_generation)
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["aux"], e["observed"], e["expected"]) == (4, 1, 5, cap, cap), e
    past = bases[1] + cap * dst_stride
    assert torch.equal(after[past:bases[1] + span], before[past:bases[1] + span]), "written past the area"
    failed = cx.stop_generation  # the report set the stop flag: a launch of that generation moves nothing
    before, after = run(idx, failed)
    assert torch.equal(after, before), "a stopped rank forwarded rows"
    cx.clear_error()
    before, after = run(idx, cx.stop_generation)
    assert torch.equal(after, expected(before, idx))



def sync_free_dispatch_returns_before_the_count_read(nat, ref, dev, rank, world):
    """Sync-free dispatches without drains (UCCL_EP_DRAIN_AFTER_WAITS=never), each right after a combine: rank-major
    and expert-major, bf16 and FP8. Each must return before the host read the counts (its handle says so), with
    every output and the handle's tokens per expert already right on the device; the next call (a cached dispatch)
    reads the counts, and from then on the handle carries the host list too, equal to the device's; the combine
    matches. Then a dispatch whose expert-major receive needs more rows than num_worst_tokens: it returns, and the
    call after it raises, naming that dispatch and what to raise, after its records landed; the calls after that
    match the reference. Returns (dispatches that returned before the count read in the four cases, the error, whether
    the counters were at their targets after it, pairs compare_cases compared afterwards)."""
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode import InternodeError

    E, K, H = 4 * world, 4, 256
    total = sum(96 + 13 * r for r in range(world))  # every token of every rank
    g = torch.Generator().manual_seed(100 + rank)

    def inputs(fp8):
        idx = _routing("random", 96 + 13 * rank, K, E, world, g)
        x = torch.randn((idx.size(0), H), generator=g)
        scales = (torch.rand((idx.size(0), H // 128), generator=g) + 0.5) if fp8 else None
        x = x.clamp(-400, 400).to(torch.float8_e4m3fn) if fp8 else x.to(torch.bfloat16)
        return idx, x, scales, torch.rand(idx.shape, generator=g)

    def dispatch(b, d, idx, x, scales, w, expert_major, worst):
        tpr, tpn, tpe, itr = b.get_dispatch_layout(idx.to(d), E)
        return b.dispatch(DispatchArgs(x.to(d), None if scales is None else scales.to(d), None, tpr, tpn, itr, tpe,
                                       idx.to(d), w.to(d), expert_alignment=4 if expert_major else 1,
                                       num_worst_tokens=worst, expert_major=expert_major))

    idx, x, scales, w = inputs(False)
    r = dispatch(nat, dev, idx, x, scales, w, False, 0)
    nat.combine(r.recv_x, r.handle, None, None)  # the next uncached dispatch follows a combine
    early = nat.dispatches_before_counts
    for expert_major, fp8 in ((False, False), (True, False), (False, True), (True, True)):
        idx, x, scales, w = inputs(fp8)
        worst = total * (K if expert_major else 1)
        r0 = dispatch(ref, torch.device("cpu"), idx, x, scales, w, expert_major, worst)
        r1 = dispatch(nat, dev, idx, x, scales, w, expert_major, worst)
        tag = f"rank {rank} em={expert_major} fp8={fp8}"
        assert not r1.handle.counts_read, f"{tag}: the dispatch read the counts before it returned"
        _same(r0.handle.num_recv_tokens_per_expert, r1.handle.num_recv_tokens_per_expert,
              f"{tag}: the tokens per expert on the device, before the count read")
        for name in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"):
            _same(getattr(r0, name), getattr(r1, name), f"{tag}: {name}")
        again = DispatchArgs(x.to(dev), None if scales is None else scales.to(dev), r1.handle, None, None, None,
                             None, None, None)
        cached = nat.dispatch(again)
        assert r1.handle.counts_read, f"{tag}: the call after it did not read the counts"
        assert r1.handle.recv_tokens_per_expert == r0.handle.num_recv_tokens_per_expert.tolist(), tag
        _same(r0.recv_x, cached.recv_x, f"{tag}: cached recv_x")
        y = (r0.recv_x.float() * (0.5 + 0.375 * rank) + 1.0).to(torch.bfloat16)
        rx, rw = ref.combine(y, r0.handle, r0.recv_topk_weights, None)
        cx, cw = nat.combine(y.to(dev), r1.handle, r1.recv_topk_weights, None)
        _same(rx, cx, f"{tag}: combined_x")
        _same(rw, cw, f"{tag}: combined weights")
    early = nat.dispatches_before_counts - early
    idx, x, scales, w = inputs(False)
    small = dispatch(nat, dev, idx, x, scales, w, True, 8)  # returns; the next call finds out
    try:
        nat.combine(torch.zeros((8, H), dtype=torch.bfloat16, device=dev), small.handle, None, None)
        err = "no error"
    except InternodeError as exc:
        err = str(exc)
    in_step = all(nat._cx.signal_value(s) == nat._expected[s] for s in range(nat.N * nat.L))
    return early, err, in_step, compare_cases(nat, ref, dev, rank, world, [ALL[0], ALL[7], ALL[8]], 1)


# (payload bytes of the record, the targets' offset): 16-byte words, and 4-byte words where the targets sit 4-byte
# aligned (forward_arrivals patches the arrival field inside a word of either size)
FORWARD_ARRIVAL_SHAPES = [(48, 0), (20, 4)]
FORWARD_ARRIVAL_SHAPE_IDS = ["16B", "4B"]


def check_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped(cx, forward_arrivals, rdma, dev,
                                                                                    codes, shape):
    """forward_arrivals (the dispatch forward as the forwarder's reader of its arrivals). Ten records, pushed by the
    rank to itself in chunks of 3 through two lanes (chunk c through lane (1 + c) % 2, counters 7 and 8), land over
    stale bytes; the forward is gated on them and starts at row 4. Every record must reach each of three targets
    (areas carved from the RDMA region) at its dest row plus its block's base (three blocks, one empty), with its
    arrival index in the arrival field and everything else as sent; dst_idx_out must hold those rows (-1 where the
    record names none, exactly); the receive area's records get their arrival index too; nothing else changes. On a
    GPU (``cx``'s loopback delays each write) the forward must still be waiting while the chunks land. Then the
    last chunk never comes: the wait fails at the GPU deadline naming lane 0's counter, and the record it carries
    reaches no target. Last, ungated, a record whose row at target 1 is past that area's rows is reported (target 1,
    its row) and not written."""
    from uccl_ep_train.internode.plan import record_layout

    payload, offset = shape
    G, n, per, hint, slot, cap = 3, 10, 3, 1, 7, 50
    layout = record_layout((payload,), G)
    stride, final = layout.stride, layout.final_bytes
    send, recv, span = 0, 4096, 4096
    bases_at = [12288 + offset + j * span for j in range(G)]
    end = bases_at[-1] + span
    g = torch.Generator().manual_seed(payload)
    idx = torch.stack([torch.randperm(cap, generator=g)[:n] for _ in range(G)], 1)
    idx[torch.rand((n, G), generator=g) < 0.3] = -1  # rows some GPUs do not need
    idx[2] = -1  # a record no GPU needs
    # the arrivals in three source-node blocks, the middle one empty (forward_block_bases: each block's end, then its
    # base per GPU); a block's base stays at or below its rows, so that every dest row in a record is >= 0
    ends = [4, 4, n]
    low = torch.where(idx >= 0, idx, cap)
    lows = torch.stack([low[lo:hi].min(0).values if hi > lo else torch.full((G,), cap)
                        for lo, hi in zip([0] + ends[:-1], ends)])
    block_bases = (torch.rand(lows.shape, generator=g) * (lows + 1)).long()
    blocks = torch.cat([torch.tensor(ends).view(-1, 1), block_bases], 1)
    base = torch.repeat_interleave(block_bases, torch.tensor([4, 0, n - 4]), dim=0)  # each row's, as the kernel adds
    targets = torch.tensor([cx.rdma_ptr + b for b in bases_at], dtype=torch.int64, device=dev)
    bases_or = functools.reduce(operator.or_, (cx.rdma_ptr + b for b in bases_at))
    limits = torch.full((G,), cap, dtype=torch.int64, device=dev)
    blocks_dev = blocks.to(dev)
    cuda = dev.type == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0

    def records(rows):
        rec = torch.randint(0, 256, (n, stride), dtype=torch.uint8, generator=g)
        rel = torch.where(rows >= 0, rows - base, torch.full_like(rows, -1)).to(torch.int32)
        rec[:, layout.dest_rows_offset:layout.dest_rows_offset + 4 * G] = rel.view(torch.uint8).view(n, 4 * G)
        return rec

    def run(rows, landing, gated):
        sent = records(rows)
        rdma[send:send + n * stride] = sent.reshape(-1).to(dev)
        rdma[recv:end] = torch.randint(0, 256, (end - recv,), dtype=torch.uint8, generator=g).to(dev)
        if gated:
            rdma[recv:recv + n * stride] = 0xAB  # stale bytes where the records land
        else:
            rdma[recv:recv + n * stride] = sent.reshape(-1).to(dev)
        before = rdma[:end].cpu().clone()  # (.cpu() is no copy on the CPU stand-in)
        out = torch.full((n, G), -7, dtype=torch.int64, device=dev)
        gate = None
        if gated:
            counters = [cx.signal_value(slot + f) for f in range(2)]
            push = torch.tensor([[0, send, recv, stride, landing, slot, hint]], dtype=torch.int64, device=dev)
            table = torch.tensor([[0, n, slot, hint] + counters], dtype=torch.int64, device=dev)
            gate = cx.arrival_gate(table.data_ptr(), 1, per, 1)
            cx.push_chunks(push.data_ptr(), 1, per, 1, stream)
        forward_arrivals(targets.data_ptr(), bases_or, final, G, cx.rdma_ptr + recv, stride, n, final,
                         limits.data_ptr(), blocks_dev.data_ptr(), len(ends), layout.dest_rows_offset,
                         layout.arrival_offset, out.data_ptr(), stream, gate=gate, first_row=4, err=cx.error_word_ptr,
                         stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation, rank=0, phase=3)
        if cuda:
            done = torch.cuda.Event()
            done.record()
            if gated and landing == n:
                time.sleep(0.03)  # the writes land 20 ms apart
                assert not done.query(), "the gated forward finished before its chunks landed"
            done.synchronize()
        return sent, before, rdma[:end].cpu().clone(), out.cpu()

    def expected(sent, before, rows, forwarded):
        want = before.clone()
        for r in range(n):
            if r not in forwarded:
                continue
            stamped = sent[r].clone()
            stamped[layout.arrival_offset:layout.arrival_offset + 4] = torch.tensor([r], dtype=torch.int32) \
                .view(torch.uint8)
            at = recv + r * stride
            want[at:at + stride] = stamped
            for j in range(G):
                d = int(rows[r, j])
                if 0 <= d < cap:
                    want[bases_at[j] + d * final:bases_at[j] + (d + 1) * final] = stamped[:final]
        return want

    sent, before, after, out = run(idx, n, True)
    assert cx.error_fields()["code"] == 0, cx.error_message()
    assert torch.equal(out, idx), f"the final rows differ:\n{out}\nwant\n{idx}"
    assert torch.equal(after[recv:], expected(sent, before, idx, range(n))[recv:]), \
        "a forwarded row differs from its record with its arrival stamped, or something else changed"
    sent, before, after, out = run(idx, n - 1, True)  # the tenth record's chunk (3, lane 0) never comes
    e = cx.error_fields()
    assert (e["code"], e["slot"]) == (codes["wait_timeout"], slot), e
    for j in range(G):
        d = int(idx[9, j])
        if d >= 0:
            at = bases_at[j] + d * final
            assert torch.equal(after[at:at + final], before[at:at + final]), "a row was forwarded after its wait failed"
    cx.clear_error()
    bad = idx.clone()
    bad[5, 1] = cap  # one row past target 1's area: reported, not written
    sent, before, after, out = run(bad, n, False)
    e = cx.error_fields()
    assert (e["code"], e["slot"], e["aux"], e["observed"], e["expected"]) == \
        (codes["scatter_range"], 1, 5, cap, cap), e
    assert torch.equal(after[bases_at[1] + cap * final:bases_at[1] + span],
                       before[bases_at[1] + cap * final:bases_at[1] + span]), "written past the area"
    cx.clear_error()
