"""UCCLTokenDispatcher's six hooks on the native INTERNODE backend, on CPU, against the communication-free oracle.

The same per-rank bodies and oracle as test_dispatcher_hooks.py (tests/megatron/hook_cases.py), but the Buffer the
dispatcher creates runs NativeInternodeBackend over the CPU stand-in of its native module
(tests/internode/fake_internode_native.py) in emulated topologies: 2 nodes x 1 rank (UCCL_EP_RANKS_PER_NODE=1, 2
ranks) and 2 nodes x 2 ranks (UCCL_EP_RANKS_PER_NODE=2, 4 ranks), with UCCL_EP_BACKEND=native. Everything from the
hooks down to the stand-in's push/wait/scatter is the project's real code: routing-map conversion, layout, notify,
push tables, the NVLink hop, expert-major receive, sync-free padding, FP8 payload + scales, combine, and both
backwards (a combine, and a cached dispatch).

Two seams in each child, nothing in uccl_ep_train/ changes: ``fake.install()`` makes ``native.module()`` return the
stand-in, and ``uccl_ep_train.backends._native_class`` (which refuses a CPU device) returns NativeInternodeBackend for
a CPU group spanning several emulated nodes. Every case records which backend its Buffer(s) used, so a test cannot
pass on the reference backend.
"""
from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed
from tests.internode import fake_internode_native as fake
from tests.megatron import hook_cases

pytest.importorskip("uccl_ep_train.buffer")

EXACT = 1e-5  # as test_dispatcher_hooks.py
# As test_internode_backend_cpu.py: several lanes and small writes, so blocks are cut into chunks over every lane.
ENV = {"UCCL_EP_BACKEND": "native", "UCCL_EP_NUM_PROXY_THREADS": "2", "UCCL_EP_FIFOS_PER_THREAD": "2",
       "UCCL_IB_MAX_INFLIGHT_BYTES": "4096", "UCCL_EP_CPU_TIMEOUT_SECS": "30", "UCCL_EP_GPU_TIMEOUT_SECS": "30"}

TWO_RANKS = hook_cases.hook_cases(2)  # 2 nodes x 1 rank
# 2 nodes x 2 ranks: NVLink hop and network hop both carry tokens
FOUR_RANKS = dict(hook_cases.hook_cases(4), **hook_cases.four_rank_cases())

# Without drains (UCCL_EP_DRAIN_AFTER_WAITS=never), several training steps on one dispatcher: from the second step on,
# a step's first dispatch follows the previous step's last combine (the backward of a dispatch), which is where a
# sync-free dispatch returns before the host reads the counts and the next call (the combine) reads them.
STEPS = 3
WITHOUT_DRAINS = {name: (fn, dict(kw, steps=STEPS)) for name, (fn, kw) in TWO_RANKS.items()
                  if name in ("expert_major", "local_permute", "sync_free_expert_major", "sync_free_local_permute")}
# ... and Megatron's real MoELayer (SequentialMLP experts) against its allgather dispatcher
WITHOUT_DRAINS["moelayer_sync_free"] = ("moelayer_case", dict(ep=2, num_experts=4, topk=2, tokens=8, hidden=16,
                                                              steps=STEPS, uccl_env={"UCCL_EP_SYNC_FREE": "1"}))


def _install_internode_on_cpu() -> list:
    """The two seams (see the module docstring), plus a hook on release_buffers that records, for every Buffer the
    dispatcher made, its backend's name, topology and proxy command count, then destroys the backend (its shared
    memory files go away). Returns the list the records are appended to."""
    fake.install()
    from uccl_ep_train import backends
    from uccl_ep_train.internode import NativeInternodeBackend
    from uccl_ep_train.megatron import dispatcher

    native_class = backends._native_class

    def cpu_aware_native_class(ctx):
        if ctx.device.type == "cpu" and ctx.num_nodes > 1:
            return NativeInternodeBackend
        return native_class(ctx)

    backends._native_class = cpu_aware_native_class
    used: list = []
    release = dispatcher.release_buffers

    def record_and_release() -> None:
        for buf in list(dispatcher._BUFFERS.values()):
            b = buf.backend
            stats = b.proxy_stats() if hasattr(b, "proxy_stats") else {}
            used.append(dict(name=b.name, num_nodes=buf.num_nodes, ranks_per_node=buf.ranks_per_node,
                             commands=int(stats.get("commands", 0))))
            b.destroy()
        release()

    dispatcher.release_buffers = record_and_release  # hooks_case imports it by name after this ran
    return used


def _cases_on_internode(rank: int, world: int, cases: dict) -> dict:
    used = _install_internode_on_cpu()
    out = {}
    for name, (fn_name, kwargs) in cases.items():
        del used[:]
        out[name] = getattr(hook_cases, fn_name)(rank, world, **kwargs)
        out[name]["buffers"] = list(used)
    out["shm_left"] = sorted(f for f in os.listdir(fake._SHM) if f.startswith(f"{fake._PREFIX}-{os.getpid()}-"))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_cases_on_internode, 2, TWO_RANKS, timeout=300,
                           env=dict(ENV, UCCL_EP_RANKS_PER_NODE="1"))


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_cases_on_internode, 4, FOUR_RANKS, timeout=300,
                           env=dict(ENV, UCCL_EP_RANKS_PER_NODE="2"))


@pytest.fixture(scope="module")
def two_ranks_without_drains():
    return run_distributed(_cases_on_internode, 2, WITHOUT_DRAINS, timeout=300,
                           env=dict(ENV, UCCL_EP_RANKS_PER_NODE="1", UCCL_EP_DRAIN_AFTER_WAITS="never"))


@pytest.fixture(params=["2x1", "2x2"])
def topology(request):
    """(per-rank results, ranks per node) of 2 nodes x 1 rank or 2 nodes x 2 ranks (only the one asked for runs)."""
    name, ranks_per_node = {"2x1": ("two_ranks", 1), "2x2": ("four_ranks", 2)}[request.param]
    return request.getfixturevalue(name), ranks_per_node


def _assert_matches_oracle(per_rank, name, tol=EXACT):
    for rank, results in enumerate(per_rank):
        r = results[name]
        assert r["out"] < tol and r["grad_x"] < tol and r["grad_probs"] < tol, (name, rank, r)


def _assert_ran_on_internode(per_rank, name, ranks_per_node):
    world = len(per_rank)
    for rank, results in enumerate(per_rank):
        buffers = results[name]["buffers"]
        assert buffers, f"{name}: rank {rank} made no Buffer"
        for b in buffers:
            assert b["name"] == "native-internode", (name, rank, b)
            assert (b["num_nodes"], b["ranks_per_node"]) == (world // ranks_per_node, ranks_per_node), (name, b)
    # the tokens went through the stand-in's push_chunks (notify, barriers and the network hops)
    assert sum(b["commands"] for results in per_rank for b in results[name]["buffers"]) > 0, name


def test_every_case_ran_on_the_internode_backend_and_left_no_shared_memory(topology):
    per_rank, G = topology
    for name in (TWO_RANKS if G == 1 else FOUR_RANKS):
        _assert_ran_on_internode(per_rank, name, G)
    assert all(not results["shm_left"] for results in per_rank), [r["shm_left"] for r in per_rank]


def test_output_equals_input_with_identity_experts_and_probs_summing_to_one(topology):
    per_rank, G = topology
    for results in per_rank:
        assert results["identity"]["identity_err"] < EXACT, results["identity"]
    _assert_matches_oracle(per_rank, "identity")
    _assert_ran_on_internode(per_rank, "identity", G)


@pytest.mark.parametrize("name", ["expert_major", "local_permute"])
def test_output_and_gradients_to_hidden_and_probs_match_the_oracle(topology, name):
    per_rank, G = topology
    _assert_matches_oracle(per_rank, name)
    assert all(results[name]["received"] > 0 for results in per_rank)
    assert all(results[name]["expert_major"] is (name == "expert_major") for results in per_rank)
    _assert_ran_on_internode(per_rank, name, G)


@pytest.mark.parametrize("name", ["sync_free_expert_major", "sync_free_local_permute"])
def test_sync_free_mode_with_a_rank_receiving_nothing_matches_the_oracle(topology, name):
    per_rank, G = topology
    _assert_matches_oracle(per_rank, name)
    # "skewed" routes every token to the first half of the experts: the ranks owning the second half receive
    # nothing, and still return their fixed number of rows (all padding), as every rank does in sync-free mode
    world = len(per_rank)
    kw = (TWO_RANKS if G == 1 else FOUR_RANKS)[name][1]
    E, K, T = kw["num_experts"], kw["topk"], kw["tokens"]
    seed = kw.get("seed", 7)  # hooks_case's default seed; its routing of rank r uses seed * 17 + r
    routed = sum(hook_cases.routing(T, E, K, seed * 17 + r, "skewed")[0] for r in range(world))
    empty = [r for r in range(world) if not routed[:, r * E // world:(r + 1) * E // world].any()]
    assert empty == list(range(world // 2, world)), empty
    # rows handed to the experts: num_worst_tokens (T x ranks, x the local experts a token can pick when received
    # expert-major), or with the local permute every (row, top-k slot) pair, the invalid ones masked
    per_token = min(K, E // world) if name.endswith("expert_major") else K
    for rank, results in enumerate(per_rank):
        assert results[name]["received"] == T * world * per_token, (name, rank, results[name])
    _assert_ran_on_internode(per_rank, name, G)


@pytest.mark.parametrize("name", ["sync_free_capacity_expert_major", "sync_free_capacity_local_permute"])
def test_sync_free_rows_shrink_to_the_routers_expert_capacity_and_outputs_still_match_the_oracle(topology, name):
    per_rank, G = topology
    _assert_matches_oracle(per_rank, name)
    world = len(per_rank)
    kw = (TWO_RANKS if G == 1 else FOUR_RANKS)[name][1]
    rows = hook_cases.capacity_bound_rows(kw, world)
    per_token = min(kw["topk"], kw["num_experts"] // world) if name.endswith("expert_major") else kw["topk"]
    assert rows < kw["tokens"] * world * per_token  # smaller than the worst case
    for rank, results in enumerate(per_rank):
        assert results[name]["received"] == rows, (name, rank, rows, results[name])
    _assert_ran_on_internode(per_rank, name, G)


def test_fp8_dispatch_stays_within_fp8_rounding_of_the_oracle(topology):
    per_rank, G = topology
    for results in per_rank:
        r = results["fp8"]
        assert 0 < r["out_rel"] < 0.08, r  # e4m3 keeps 3 mantissa bits: a few percent, and never exact
        assert r["grad_probs_rel"] < 0.08, r
    _assert_ran_on_internode(per_rank, "fp8", G)


def test_four_ranks_with_router_dropped_slots_match_the_oracle(four_ranks):
    _assert_matches_oracle(four_ranks, "dropped")
    _assert_ran_on_internode(four_ranks, "dropped", 2)


def test_expert_tensor_parallel_partial_sums_are_combined_over_two_emulated_nodes(four_ranks):
    # EP 2 x expert-TP 2 over 2 nodes x 2: every TP rank of the destination receives the token, returns a partial sum
    _assert_matches_oracle(four_ranks, "expert_tp")
    _assert_ran_on_internode(four_ranks, "expert_tp", 2)


@pytest.mark.parametrize("name", sorted(set(WITHOUT_DRAINS) - {"moelayer_sync_free"}))
def test_without_drains_every_training_step_matches_the_oracle_and_sync_free_dispatches_return_before_the_counts(
        two_ranks_without_drains, name):
    per_rank = two_ranks_without_drains
    _assert_matches_oracle(per_rank, name)
    _assert_ran_on_internode(per_rank, name, 1)
    sync_free = name.startswith("sync_free")
    for rank, results in enumerate(per_rank):
        r = results[name]
        assert len(r["received_per_step"]) == STEPS, r
        # every step's forward dispatch after the first follows a combine: it returns early when sync-free (the
        # backward's dispatch is cached, and the first step's follows no combine); never when the host must size
        # the outputs from the counts
        assert r["before_counts"] == (STEPS - 1 if sync_free else 0), (name, rank, r)
    assert all(not results["shm_left"] for results in per_rank), [r["shm_left"] for r in per_rank]


def test_without_drains_megatron_moelayer_in_sync_free_mode_matches_allgather_over_training_steps(
        two_ranks_without_drains):
    for rank, results in enumerate(two_ranks_without_drains):
        r = results["moelayer_sync_free"]
        assert r["uccl_backend"] == ["native-internode"], r
        assert r["out_norm"] > 0
        assert r["out"] < EXACT and r["grad_x"] < EXACT and r["grad_params"] < EXACT, (rank, r)
        assert r["uccl_before_counts"] == STEPS - 1, (rank, r)  # every step's dispatch after the first


def _buffer_sizes_asked(rank: int, world: int) -> list:
    """(num_nvl_bytes, num_rdma_bytes) of the Buffer get_buffer makes for a sync-free expert-major DeepSeek-V3 layer
    (4096 tokens, hidden 7168, top-8, num_worst_tokens as the dispatcher asks), recorded instead of allocated: with
    the group split into emulated nodes (UCCL_EP_RANKS_PER_NODE=2), then as one node."""
    import torch.distributed as dist

    from uccl_ep_train import buffer as buffer_module
    from uccl_ep_train.megatron import dispatcher

    class Recorded(buffer_module.Buffer):
        def __init__(self, group, num_nvl_bytes, num_rdma_bytes):  # (no regions, no backend: only the sizes)
            self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    buffer_module.Buffer, real = Recorded, buffer_module.Buffer
    asked = []
    try:
        for per_node in ("2", "4"):
            os.environ["UCCL_EP_RANKS_PER_NODE"] = per_node
            dispatcher.release_buffers()
            b = dispatcher.get_buffer(dist.group.WORLD, 7168 * 2, 4096, 8, num_worst_tokens=4096 * world * 8)
            asked.append((b.num_nvl_bytes, b.num_rdma_bytes))
    finally:
        buffer_module.Buffer = real
        dispatcher.release_buffers()
    return asked


def test_a_buffer_for_emulated_nodes_is_sized_by_the_internode_hint_alone_not_grown_by_num_worst_tokens():
    """Across nodes only the internode backend runs, and none of its areas grows with num_worst_tokens (the sync-free
    outputs are torch tensors), so the dispatcher sizes the Buffer by the internode hint alone. Asking for the
    intranode hint too, as it did until session 49, made the NVL region hold every (token, local expert) row of a
    one-node receive: 15 GB per GPU at this shape on 2 x 8 GPUs. On one node that hint is still the one asked."""
    from uccl_ep_train.buffer import Buffer

    world = 4
    for (inter_nvl, inter_rdma), (one_node_nvl, _) in run_distributed(_buffer_sizes_asked, world, timeout=120):
        nvl, rdma = Buffer.get_internode_bytes_hint(4096, 7168, 8, world, 2)
        assert (inter_nvl, inter_rdma) == (nvl, rdma), ((inter_nvl, inter_rdma), (nvl, rdma))
        assert one_node_nvl == Buffer.get_nvl_bytes_hint(4096, 7168, 8, world, num_worst_tokens=4096 * world * 8)
        assert one_node_nvl > 4 * inter_nvl, (one_node_nvl, inter_nvl)
