"""Native intranode kernels against the pure-torch reference, on 1 GPU (plain pytest) and 2+ GPUs
(`torchrun --nproc-per-node 2 -m pytest tests/kernels/test_intranode_gpu.py`). Every rank runs the same tests in the
same order, so the collectives of both backends line up.

Exact equality for payloads, indices, weights and counts; combine sums within float32 rounding (bf16 output).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from uccl_ep_train import native  # noqa: E402

if not native.has_kernels():
    pytest.skip("uccl_ep_train._C was built without GPU kernels", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from uccl_ep_train.backends import BackendContext, DispatchArgs  # noqa: E402
from uccl_ep_train.intranode import NativeIntranodeBackend  # noqa: E402
from uccl_ep_train.reference import ReferenceBackend  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

NVL_BYTES = 1 << 30


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD


@pytest.fixture(scope="module")
def backends(group):
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = BackendContext(group=group, rank=rank, num_ranks=world, ranks_per_node=world,
                         device=torch.device("cuda", torch.cuda.current_device()), num_nvl_bytes=NVL_BYTES,
                         num_rdma_bytes=0, settings=load_settings())
    nat, ref = NativeIntranodeBackend(ctx), ReferenceBackend(ctx)
    import uccl_ep_train.intranode as intranode

    # the copy-engine receive at every shape
    saved, intranode.COPY_ENGINE_MIN_BYTES = intranode.COPY_ENGINE_MIN_BYTES, 0
    yield nat, ref
    intranode.COPY_ENGINE_MIN_BYTES = saved
    nat.destroy()


def make_routing(kind: str, T: int, K: int, E: int, R: int, gen: torch.Generator) -> torch.Tensor:
    dev = torch.device("cuda", torch.cuda.current_device())
    if T == 0:
        return torch.empty((0, K), dtype=torch.int64, device=dev)
    scores = torch.rand((T, E), generator=gen, device="cpu")
    if kind == "skewed":  # every token picks the same experts
        scores[:, :K] += 10.0
    elif kind == "empty":  # only rank 0's experts: every other rank receives nothing
        scores[:, E // R:] = -1.0
    idx = scores.topk(K, dim=1).indices
    if kind == "dropped":
        idx[torch.rand((T, K), generator=gen) < 0.3] = -1
    return idx.to(dev)


def make_inputs(T, H, K, fp8: bool, gen: torch.Generator):
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn((T, H), generator=gen).to(dev)
    w = torch.rand((T, K), generator=gen).to(dev)
    if fp8:
        x8 = x.clamp(-400, 400).to(torch.float8_e4m3fn)
        scales = (torch.rand((T, H // 128), generator=gen) + 0.5).to(dev)
        return x8, scales, w
    return x.to(torch.bfloat16), None, w


def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert torch.equal(a, b), f"{what}: differs at {(a != b).nonzero()[:5].tolist()}"


def run_case(backends, kind, T, H, K, E, *, fp8=False, worst=0, expert_major=False, align=1, seed=0):
    nat, ref = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    topk_idx = make_routing(kind, T, K, E, R, gen)
    x, scales, w = make_inputs(T, H, K, fp8, gen)

    layout_n = nat.get_dispatch_layout(topk_idx, E)
    layout_r = ref.get_dispatch_layout(topk_idx, E)
    for a, b, name in zip(layout_n, layout_r, ("per_rank", "per_rdma_rank", "per_expert", "is_token_in_rank")):
        same(a, b, f"layout {name}")
    per_rank, per_rdma, per_expert, in_rank = layout_r

    if worst:  # an upper bound of the rows any rank can need (expert-major: every slot local, plus padding)
        worst = T * R * K + (E // R) * align if expert_major else T * R

    def args(handle=None, xx=x, ss=scales):
        if handle is not None:
            return DispatchArgs(x=xx, x_scales=ss, handle=handle, num_tokens_per_rank=None,
                                num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                                topk_idx=None, topk_weights=None)
        return DispatchArgs(x=xx, x_scales=ss, handle=None, num_tokens_per_rank=per_rank,
                            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w,
                            expert_alignment=align, num_worst_tokens=worst, expert_major=expert_major)

    rn, rr = nat.dispatch(args()), ref.dispatch(args())
    same(rn.recv_x, rr.recv_x, "recv_x")
    same(rn.recv_x_scales, rr.recv_x_scales, "recv_x_scales")
    same(rn.recv_topk_idx, rr.recv_topk_idx, "recv_topk_idx")
    same(rn.recv_topk_weights, rr.recv_topk_weights, "recv_topk_weights")
    assert rn.num_recv_tokens_per_expert_list == rr.num_recv_tokens_per_expert_list
    assert rn.handle.num_recv_rows == rr.handle.num_recv_rows
    same(rn.handle.num_recv_tokens_per_expert, rr.handle.num_recv_tokens_per_expert, "aligned counts")
    if expert_major:
        same(rn.handle.expert_major_token, rr.handle.expert_major_token, "expert_major_token")
        same(rn.handle.expert_major_slot, rr.handle.expert_major_slot, "expert_major_slot")

    # cached dispatch of a fresh payload
    x2, s2, _ = make_inputs(T, H, K, fp8, gen)
    cn, cr = nat.dispatch(args(rn.handle, x2, s2)), ref.dispatch(args(rr.handle, x2, s2))
    same(cn.recv_x, cr.recv_x, "cached recv_x")
    same(cn.recv_x_scales, cr.recv_x_scales, "cached recv_x_scales")
    # the other receive path (peers' rows by copy engine, or every row by the kernel), normal then cached
    with dispatch_path(nat, not nat.dispatch_copy_engine):
        an = nat.dispatch(args())
        acn = nat.dispatch(args(an.handle, x2, s2))
    for got, want, what in ((an.recv_x, rr.recv_x, "recv_x"), (an.recv_x_scales, rr.recv_x_scales, "recv_x_scales"),
                            (an.recv_topk_idx, rr.recv_topk_idx, "recv_topk_idx"),
                            (an.recv_topk_weights, rr.recv_topk_weights, "recv_topk_weights"),
                            (acn.recv_x, cr.recv_x, "cached recv_x"),
                            (acn.recv_x_scales, cr.recv_x_scales, "cached recv_x_scales")):
        same(got, want, f"{what}, other receive path")

    # combine of a fresh bf16 payload in the received layout, with weights
    rows = rn.handle.num_recv_rows
    y = torch.randn((rows, H), generator=gen).to(x.device, torch.bfloat16)
    yw = rn.recv_topk_weights
    on, own = nat.combine(y, rn.handle, yw, None)
    orr, owr = ref.combine(y, rr.handle, rr.recv_topk_weights, None)
    torch.testing.assert_close(on.float(), orr.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(own, owr, rtol=1e-5, atol=1e-5)
    if rn.handle.rows_from is not None:  # both combine paths, same inputs: bit for bit
        same_combine_both_ways(nat, y, rn.handle, yw, on, own)
    # combine(dispatch(w)) gives w back on every kept slot
    kept = topk_idx >= 0
    torch.testing.assert_close(own[kept], w[kept], rtol=1e-6, atol=1e-6)
    # combine without weights, with the handle a cached dispatch went through: the same rows, bit for bit
    # (expert-major: the local partial sums and the send are separate launches, each must cope with no weights)
    on2, own2 = nat.combine(y, cn.handle, None, None)
    assert own2 is None
    same(on2, on, "combine without weights")
    torch.cuda.synchronize()


@contextlib.contextmanager
def dispatch_path(nat, copy_engine: bool):
    """Run the backend's dispatches with the peers' rows copied out by the copy engine, or all rows by the kernel."""
    saved = nat.dispatch_copy_engine
    nat.dispatch_copy_engine = copy_engine
    try:
        yield
    finally:
        nat.dispatch_copy_engine = saved


@contextlib.contextmanager
def combine_path(nat, copy_engine: bool, chunk_bytes=None):
    """Run the backend's combines on the copy-engine or the SM-store path (and a chunk size) for the block."""
    saved = nat.combine_copy_engine, nat.copy_chunk_bytes
    nat.combine_copy_engine = copy_engine
    nat.copy_chunk_bytes = chunk_bytes if chunk_bytes is not None else saved[1]
    try:
        yield
    finally:
        nat.combine_copy_engine, nat.copy_chunk_bytes = saved


def same_combine_both_ways(nat, y, handle, weights, out, out_w, chunk_bytes=None):
    """The combine of the other path (copy engine / SM stores) on the same inputs equals ``out``/``out_w`` exactly."""
    with combine_path(nat, not nat.combine_copy_engine):
        alt, alt_w = nat.combine(y, handle, weights, None)
    same(alt, out, "combine: copy engine vs SM stores")
    same(alt_w, out_w, "combined weights: copy engine vs SM stores")
    if chunk_bytes is not None:  # many chunks: a flag per 16 KiB, the reduce waiting on most of them
        with combine_path(nat, True, chunk_bytes):
            small, small_w = nat.combine(y, handle, weights, None)
        same(small, out, f"combine with {chunk_bytes}-byte copies")
        same(small_w, out_w, f"combined weights with {chunk_bytes}-byte copies")


def normal_dispatch_args(backend, topk_idx, x, w, E):
    """DispatchArgs of a normal-mode dispatch, the layout from ``backend``."""
    per_rank, per_rdma, per_expert, in_rank = backend.get_dispatch_layout(topk_idx, E)
    return DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w)


def capture(step):
    """``step()`` once on a side stream (warm-up: allocations and lazily made streams stay out of the graph), then
    captured in a CUDA graph. Returns the graph and the captured call's outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty", "dropped"])
def test_copy_engine_combine_equals_sm_store_combine_bit_for_bit_at_the_default_and_16_kib_chunks(
        backends, kind, dtype):
    nat, ref = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(77 + rank)
    T, H, K, E = 1024 + 37 * rank, 2048, 8, 64
    topk_idx = make_routing(kind, T, K, E, R, gen)
    x, _, w = make_inputs(T, H, K, False, gen)
    args = normal_dispatch_args(ref, topk_idx, x, w, E)
    res = nat.dispatch(args)
    assert res.handle.rows_from is not None and sum(res.handle.rows_from) == res.handle.num_recv_rows
    y = torch.randn((res.handle.num_recv_rows, H), generator=gen).to(x.device, dtype)
    out, out_w = nat.combine(y, res.handle, res.recv_topk_weights, None)
    ref_out, ref_w = ref.combine(y, ref.dispatch(args).handle, res.recv_topk_weights, None)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out_w, ref_w, rtol=1e-5, atol=1e-5)
    same_combine_both_ways(nat, y, res.handle, res.recv_topk_weights, out, out_w, chunk_bytes=16384)
    torch.cuda.synchronize()


SHAPES = [  # T, H, K, E
    (1, 2048, 1, 8),
    (100, 2048, 2, 16),
    (512, 4096, 8, 64),
    (4096, 7168, 8, 256),
    (8192, 2048, 4, 32),
]


@pytest.mark.parametrize("kind", ["random", "skewed", "empty", "dropped"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_dispatch_combine_match_reference(backends, kind, shape):
    T, H, K, E = shape
    if kind == "empty" and K > E // dist.get_world_size():
        K = 1
    run_case(backends, kind, T, H, K, E)


@pytest.mark.parametrize("shape", [(128, 2048, 4, 16), (4096, 7168, 8, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_fp8_dispatch_carries_payload_and_scales_exactly(backends, shape, kind):
    run_case(backends, kind, *shape, fp8=True, seed=3)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["random", "empty", "dropped"])
def test_sync_free_dispatch_pads_to_num_worst_tokens_like_reference(backends, kind, fp8):
    run_case(backends, kind, 300, 2048, 4, 16, fp8=fp8, worst=1, seed=5)


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("worst", [0, 1])
@pytest.mark.parametrize("kind", ["random", "skewed", "dropped"])
def test_expert_major_receive_matches_reference_layout(backends, kind, worst, align):
    run_case(backends, kind, 257, 2048, 4, 16, expert_major=True, align=align, worst=worst, seed=7)


def test_expert_major_fp8_dispatch_and_combine_match_the_reference_at_deepseek_v3_shape(backends):
    run_case(backends, "random", 1024, 7168, 8, 256, fp8=True, expert_major=True, align=128, seed=9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("worst", [0, 1])
@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
def test_expert_major_partials_are_one_fp32_sum_in_slot_order(backends, kind, worst, dtype):
    """The local half of an expert-major combine, bit for bit: each rank-major row is its local experts' rows
    summed in top-k slot order in fp32 from 0 and rounded once to x's dtype (what reference.combine computes, and
    what the former fused send produced); weights go back to their slot, 0 elsewhere."""
    nat, _ = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    T, H, K, E, align = 257, 2048, 4, 16, 16
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(13 * 1000 + rank)
    topk_idx = make_routing(kind, T, K, E, R, gen)
    x, _, w = make_inputs(T, H, K, False, gen)
    per_rank, per_rdma, per_expert, in_rank = nat.get_dispatch_layout(topk_idx, E)
    res = nat.dispatch(DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                    num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w,
                                    expert_alignment=align, expert_major=True,
                                    num_worst_tokens=T * R * K + (E // R) * align if worst else 0))
    h = res.handle
    y = torch.randn((h.num_recv_rows, H), generator=gen).to(dev, dtype)
    partials, rm_w = nat._expert_major_partials(y, h, res.recv_topk_weights, torch.cuda.current_stream().cuda_stream)
    partials_nw, rm_nw = nat._expert_major_partials(y, h, None, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert rm_nw is None
    assert partials.shape == (h.num_rank_major_rows, H) and partials.dtype == dtype
    n = int(h.recv_info[0])  # rows past it (sync-free padding) are left unwritten
    slot_of = h.slot_of[:n].long()
    acc = torch.zeros((n, H), dtype=torch.float32, device=dev)
    for k in range(K):
        sel = slot_of[:, k] >= 0
        acc[sel] += y[slot_of[sel, k]].float()
    same(partials[:n], acc.to(dtype), "partials")
    same(partials_nw[:n], acc.to(dtype), "partials without weights")
    expected_w = torch.where(slot_of >= 0, res.recv_topk_weights[slot_of.clamp(min=0)],
                             torch.zeros((), dtype=torch.float32, device=dev))
    same(rm_w[:n], expected_w, "rank-major weights")
    dist.barrier()


def test_empty_batch_dispatches_and_combines_nothing(backends):
    run_case(backends, "random", 0, 2048, 2, 8, seed=11)


@pytest.mark.parametrize("expert_major", [False, True], ids=["rank-major", "expert-major"])
def test_cuda_graph_replays_sync_free_dispatch_and_combine(backends, expert_major):
    nat, ref = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    T, H, K, E = 256, 2048, 4, 16
    gen = torch.Generator().manual_seed(100 + rank)
    static_idx = make_routing("random", T, K, E, R, gen)
    static_x, _, static_w = make_inputs(T, H, K, False, gen)
    # expert-major: every slot local in the worst case, plus one padding row per expert (alignment 1 pads none)
    worst = T * R * K + E // R if expert_major else T * R

    def step():
        per_rank, per_rdma, per_expert, in_rank = nat.get_dispatch_layout(static_idx, E)
        res = nat.dispatch(DispatchArgs(x=static_x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=static_idx,
                                        topk_weights=static_w, num_worst_tokens=worst, expert_major=expert_major))
        out, out_w = nat.combine(res.recv_x, res.handle, res.recv_topk_weights, None)
        return res.recv_x, out, out_w

    graph, (g_recv, g_out, g_w) = capture(step)
    for it in range(3):
        idx = make_routing("dropped" if it % 2 else "random", T, K, E, R, gen)
        x, _, w = make_inputs(T, H, K, False, gen)
        static_idx.copy_(idx)
        static_x.copy_(x)
        static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        per_rank, per_rdma, per_expert, in_rank = ref.get_dispatch_layout(idx, E)
        rr = ref.dispatch(DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                       num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                       num_worst_tokens=worst, expert_major=expert_major))
        same(g_recv, rr.recv_x, f"replay {it} recv_x")
        orr, owr = ref.combine(rr.recv_x, rr.handle, rr.recv_topk_weights, None)
        torch.testing.assert_close(g_out.float(), orr.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(g_w, owr, rtol=1e-5, atol=1e-5)


def test_cuda_graph_replays_copy_engine_combine_of_a_normal_handle(backends):
    """The copy-engine combine under capture: copy streams forked and joined by events, write-value flags, the flag
    clear. Each replay on fresh rows must equal the SM-store combine of the same rows (which is not captured)."""
    nat, ref = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    T, H, K, E = 512, 2048, 4, 16
    gen = torch.Generator().manual_seed(200 + rank)
    idx = make_routing("random", T, K, E, R, gen)
    x, _, w = make_inputs(T, H, K, False, gen)
    res = nat.dispatch(normal_dispatch_args(nat, idx, x, w, E))
    h = res.handle
    assert h.rows_from is not None and nat.combine_copy_engine
    static_y = torch.randn((h.num_recv_rows, H), generator=gen).to(x.device, torch.bfloat16)
    graph, (g_out, g_w) = capture(lambda: nat.combine(static_y, h, res.recv_topk_weights, None))
    for it in range(4):
        static_y.copy_(torch.randn((h.num_recv_rows, H), generator=gen).to(x.device, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        with combine_path(nat, False):
            want, want_w = nat.combine(static_y, h, res.recv_topk_weights, None)
        same(g_out, want, f"replay {it}: combined rows")
        same(g_w, want_w, f"replay {it}: combined weights")


def test_thousand_random_iterations_keep_matching_without_leaks(backends):
    nat, ref = backends
    R, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.synchronize()
    gen_shared = torch.Generator().manual_seed(4242)  # same shapes on every rank
    gen = torch.Generator().manual_seed(77 + rank)
    before = None
    for it in range(1000):
        T = int(torch.randint(0, 300, (1,), generator=gen_shared))
        K = int(torch.randint(1, 5, (1,), generator=gen_shared))
        kind = ["random", "dropped", "skewed"][it % 3]
        topk_idx = make_routing(kind, T, K, 16, R, gen)
        x, _, w = make_inputs(T, 1024, K, False, gen)
        per_rank, per_rdma, per_expert, in_rank = nat.get_dispatch_layout(topk_idx, 16)
        res = nat.dispatch(DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w))
        out, out_w = nat.combine(res.recv_x, res.handle, res.recv_topk_weights, None)
        # combine(dispatch(x)) = x times the number of ranks the token visited
        copies = in_rank.sum(1, keepdim=True).float()
        torch.testing.assert_close(out.float(), x.float() * copies, rtol=1e-2, atol=1e-2)
        kept = topk_idx >= 0
        assert torch.equal(out_w[kept], w[kept])
        if it % 100 == 0:
            rr = ref.dispatch(DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                           num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w))
            same(res.recv_x, rr.recv_x, f"iteration {it} recv_x")
        if it == 10:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20), "device memory grew over the loop"


def test_too_small_buffer_reports_the_size_needed(group):
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = BackendContext(group=group, rank=rank, num_ranks=world, ranks_per_node=world,
                         device=torch.device("cuda", torch.cuda.current_device()), num_nvl_bytes=1 << 20,
                         num_rdma_bytes=0, settings=load_settings())
    nat = NativeIntranodeBackend(ctx)
    try:
        T, H, K, E = 512, 7168, 4, 16
        gen = torch.Generator().manual_seed(1)
        idx = make_routing("random", T, K, E, world, gen)
        x, _, w = make_inputs(T, H, K, False, gen)
        per_rank, per_rdma, per_expert, in_rank = nat.get_dispatch_layout(idx, E)
        with pytest.raises(ValueError, match="num_nvl_bytes >= "):
            nat.dispatch(DispatchArgs(x=x, x_scales=None, handle=None, num_tokens_per_rank=per_rank,
                                      num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
    finally:
        nat.destroy()


def test_every_token_to_every_rank_combines_in_exactly_the_hint_and_a_float32_combine_needs_the_float32_hint(group):
    """The GPU twin of the CPU test: in a buffer of exactly Buffer.get_nvl_bytes_hint (BF16 combines, the default)
    the worst routing dispatches and combines as the reference does; a float32 combine there is refused with the
    size it needs, and fits the hint asked with combine_element_size=4."""
    from uccl_ep_train.buffer import Buffer

    rank, world = dist.get_rank(), dist.get_world_size()
    T, H = 256, 2048
    gen = torch.Generator().manual_seed(71 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = (torch.arange(world, device=dev) * 2).expand(T, world).contiguous()  # every token to every rank
    x, _, w = make_inputs(T, H, world, False, gen)
    for combine_element_size, dtype, fits in ((2, torch.bfloat16, True), (2, torch.float32, False),
                                              (4, torch.float32, True)):
        nvl = Buffer.get_nvl_bytes_hint(T, H, world, world, combine_element_size=combine_element_size)
        ctx = BackendContext(group=group, rank=rank, num_ranks=world, ranks_per_node=world, device=dev,
                             num_nvl_bytes=nvl, num_rdma_bytes=0, settings=load_settings())
        nat, ref = NativeIntranodeBackend(ctx), ReferenceBackend(ctx)
        try:
            received, combined = [], []
            for b in (ref, nat):
                tpr, tpn, tpe, itr = b.get_dispatch_layout(idx, 2 * world)
                r = b.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w))
                received.append(r.recv_x)
                if b is nat and not fits:
                    with pytest.raises(ValueError, match="need num_nvl_bytes >= "):
                        b.combine(r.recv_x.to(dtype), r.handle, r.recv_topk_weights, None)
                    break
                combined.append(b.combine(r.recv_x.to(dtype), r.handle, r.recv_topk_weights, None)[0])
            same(received[1], received[0], f"recv_x in exactly the hint ({combine_element_size}, {dtype})")
            if fits:  # (sums within float32 rounding, as the other combine checks)
                torch.testing.assert_close(combined[1].float(), combined[0].float(), rtol=1e-2, atol=1e-2)
        finally:
            nat.destroy()
