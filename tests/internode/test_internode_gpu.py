"""NativeInternodeBackend against the reference on one host whose GPUs play several nodes (loopback transport).

Each case runs in fresh processes (tests.distributed, gloo group): rank r uses GPU r % num_gpus, so 2 GPUs host
"2 nodes x 1 GPU" and "2 nodes x 2 GPUs" (two processes per GPU). The reference runs on CPU copies of the same inputs
in the same group. Every output must be equal, bit for bit (combine adds in the reference's order in fp32).

Coverage: routings random / skewed / empty / dropped; BF16 and FP8 (+ scales); rank-major, expert-major and
num_worst_tokens; uncached and cached dispatch, combine with weights; ordered transport with the default in-flight cap
and reordered transport with an in-flight cap of 1 and 4 KiB chunks; a rank that stops participating and a rank that
is killed mid-dispatch (deadlines); and the transport contract behind issue 5's G=2 failures (a signal never
overtakes its bytes, even while the sender's own wait kernel spins on the default stream).
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from uccl_ep_train import native  # noqa: E402

if not (native.available() and hasattr(native.module(), "internode")):
    pytest.skip("uccl_ep_train._C has no internode submodule (module.cpp must call bind_internode)",
                allow_module_level=True)

from tests.distributed import run_distributed  # noqa: E402
from uccl_ep_train.internode.transport import mps_enabled  # noqa: E402

from internode_cases import (ALL, area_too_small_after_a_push_during_notify,  # noqa: E402  (shared with
                             gpu_sharing_skip_reason, EVERY_RANK_CASES, worst_routing_in_hinted_buffers,
                             EXPERT_MAJOR_CASES, OWN_ROW_CASES,
                             check_a_failed_rank_sends_and_forwards_nothing,
                             one_rank_context,
                             FORWARD_ROW_SHAPES, FORWARD_ROW_SHAPE_IDS,
                             check_forward_rows_sends_each_row_to_every_gpu_that_needs_it,
                             check_a_gated_unpack_reads_rows_only_after_their_chunks_land,  # the CPU tests)
                             FORWARD_ARRIVAL_SHAPES, FORWARD_ARRIVAL_SHAPE_IDS,
                             check_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped,
                             check_a_chunk_whose_records_are_never_written_makes_pack_and_push_fail_naming_it,
                             check_pack_and_push_writes_the_records_of_pack_records_and_the_chunks_of_push_chunks,
                             check_node_sums_wait_for_tile_flags_and_name_a_gpu_that_never_flags,
                             check_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends,
                             check_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them,
                             check_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named,
                             compare_cases, one_forwarder_of_a_node_forwards_after_the_count_read,
                             records_past_the_partial_sums, too_few_worst_rows)

RDMA = 64 << 20
NVL = 64 << 20


def _backends(rank, world, G, rdma=RDMA, nvl=NVL):
    """(native backend on this rank's GPU, reference backend on CPU, the GPU)."""
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext
    from uccl_ep_train.internode import NativeInternodeBackend
    from uccl_ep_train.reference import ReferenceBackend
    from uccl_ep_train.settings import load_settings

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    s = load_settings()

    def mk(d):
        return BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G, device=d,
                              num_nvl_bytes=nvl, num_rdma_bytes=rdma, settings=s)
    return NativeInternodeBackend(mk(dev)), ReferenceBackend(mk(torch.device("cpu"))), dev


def _cases(rank, world, G, cases, iters, H=256):
    nat, ref, dev = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, dev, rank, world, cases, iters, H=H)
        return done, dict(nat.proxy_stats(), drain_after_waits=nat._drain_after_waits,
                          copy_agent=nat._copy_agent is not None)
    finally:
        nat.destroy()


# (world, ranks per node): 2 nodes x 1 GPU, and 2 nodes x 2 ranks (on 2 GPUs two processes per GPU, on 4 GPUs one
# each; the topology with an NVLink forwarding hop); with 4 GPUs also 4 nodes x 1 GPU.
# UCCL_EP_TEST_TOPOLOGIES="world:G,..." adds more, e.g. "8:4,6:2" with UCCL_EP_TEST_SHARE_GPU=1 (and
# UCCL_EP_TEST_MAX_RANKS_PER_GPU raised to the ranks per GPU) on few GPUs: several GPUs per node and more source nodes
# than 2 x 2 has, as production clusters run (8 GPUs per node).
TOPOLOGIES = [(2, 1), (4, 2)] + ([(4, 1)] if torch.cuda.device_count() >= 4 else []) + [
    tuple(int(v) for v in t.split(":")) for t in os.environ.get("UCCL_EP_TEST_TOPOLOGIES", "").split(",") if t.strip()]


def _need(world, gpus=2):
    """Skip where these GPUs cannot host ``world`` ranks (internode_cases.gpu_sharing_skip_reason says why)."""
    have = torch.cuda.device_count()
    reason = gpu_sharing_skip_reason(world, have, gpus, os.environ, mps_enabled(0) if have < world else None)
    if reason:
        pytest.skip(reason)


def _need_gpu_per_rank(world):
    """The copy agent's cases: by default (UCCL_EP_LOOPBACK_COPY_AGENT=auto) it moves the loopback's bytes only where
    every rank has a GPU of its own; ranks that share one keep the proxy threads' copies and the drains
    (docs/internode.md, "Two processes per GPU"), so there these cases do not apply, even with
    UCCL_EP_TEST_SHARE_GPU."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs a GPU per rank ({world}): ranks sharing a GPU get no copy agent by default")


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_every_output_matches_reference_over_routings_dtypes_and_layouts(world, G):
    _need(world)
    out = run_distributed(_cases, world, G, ALL, 2, timeout=420, env={"UCCL_EP_CPU_TIMEOUT_SECS": "60",
                                                                      "UCCL_EP_GPU_TIMEOUT_SECS": "60"})
    assert all(done == len(ALL) * 2 for done, _ in out)
    assert sum(st["commands"] for _, st in out) > 0, "no command went through the proxies"


def _expert_major_cases(rank, world, G, cases):
    nat, ref, dev = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, dev, rank, world, cases, 1)
        return (done, dict(nat.expert_major_reads), nat._cx.spin_blocks, nat.expert_major_reads_before_counts,
                nat.reads_before_counts_declined, nat._drain_after_waits)
    finally:
        nat.destroy()


@pytest.mark.parametrize("in_reader", ["always", "never", "auto"], ids=["reader", "copy", "auto"])
@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_on_gpus_an_expert_major_receive_equals_the_reference_whether_the_reader_writes_its_rows_or_a_copy_follows(
        world, G, in_reader):
    """Expert-major receives (random, skewed, a rank that receives nothing, dropped experts, FP8 with and without
    num_worst_tokens) written by the gated reader as the chunks land, from each record's pair ranks, and cached ones
    from the handle's slots (UCCL_EP_EXPERT_MAJOR_IN_READER=always), or by the plan and copy after the hop (never),
    or as auto picks (where ranks share a GPU: the reader for cached receives and, with one GPU per node, for
    uncached ones that read before the count read; the copy for the others): every output equals the reference bit
    for bit. The reader's runs use a reordering transport with small chunks, so that its tiles wait on many chunks
    landing out of order."""
    _need(world)
    env = {"UCCL_EP_EXPERT_MAJOR_IN_READER": in_reader, "UCCL_EP_CPU_TIMEOUT_SECS": "60",
           "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    if in_reader == "always":
        env.update(UCCL_EP_LOOPBACK_REORDER="8", UCCL_IB_MAX_INFLIGHT_BYTES="16384", UCCL_EP_LOOPBACK_SEED="3")
    out = run_distributed(_expert_major_cases, world, G, EXPERT_MAJOR_CASES, timeout=420, env=env)
    n = len(EXPERT_MAJOR_CASES)
    for done, reads, spin_blocks, before_counts, declined, drains in out:
        assert done == n, done
        assert reads["cached"] == (2 * n if in_reader in ("always", "auto") else 0), (reads, spin_blocks)
        if in_reader == "auto" and spin_blocks:  # (a reader that passed its guessed rows read after the counts)
            assert before_counts <= reads["uncached"] <= before_counts + declined, (reads, before_counts, declined)
            # with the proxy threads' copies (and so drains) only one GPU per node read any before the count read;
            # with the copy agent forced on (UCCL_EP_LOOPBACK_COPY_AGENT=on, no drains) 2 x 2 did too (session 49)
            assert (reads["uncached"] > 0) == (G == 1 or not drains), (reads, G, drains)
        else:
            assert reads["uncached"] == (n if in_reader != "never" else 0), (reads, spin_blocks)


def _expert_sum_cases(rank, world, G, cases):
    nat, ref, dev = _backends(rank, world, G)
    try:
        done = sum(compare_cases(nat, ref, dev, rank, world, cases, 1, unweighted=True, combine_dtype=dt)
                   for dt in (torch.bfloat16, torch.float32))
        return done, nat.expert_sums_in_packs, nat.packs_and_pushes["combine_network"]
    finally:
        nat.destroy()


@pytest.mark.parametrize("in_pack", ["1", "0"], ids=["sums-in-pack", "sums-first"])
@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_on_gpus_an_expert_major_combine_equals_the_reference_whether_its_pack_sums_the_rows_or_a_kernel_first(
        world, G, in_pack):
    """UCCL_EP_EXPERT_SUMS_IN_PACK: with one GPU per node the expert-major combine's pack_and_push sums each token's
    local expert rows as it writes its record (bfloat16 and float32 rows, weighted and not), or a kernel sums them
    all first (0, and always with several GPUs per node): every output of the expert-major cases equals the reference
    bit for bit, and the counters show which path ran (with several GPUs per node every combine's records are the
    forwarders' node sums, written and pushed by pack_and_push: "Pipelined combine gather"). A reordering transport
    with small chunks, so that records leave while others are still being summed."""
    _need(world)
    env = {"UCCL_EP_EXPERT_SUMS_IN_PACK": in_pack, "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
           "UCCL_EP_LOOPBACK_REORDER": "8", "UCCL_IB_MAX_INFLIGHT_BYTES": "16384", "UCCL_EP_LOOPBACK_SEED": "5"}
    out = run_distributed(_expert_sum_cases, world, G, EXPERT_MAJOR_CASES, timeout=420, env=env)
    for done, sums, packs in out:
        assert done == 2 * len(EXPERT_MAJOR_CASES), done
        assert sums == (packs if G == 1 and in_pack == "1" else 0) and packs > 0, (sums, packs)


def _every_output_without_drains(which, env, copy_agent):
    """Every case against the reference on 2 GPUs without drains: all routings and dtypes ("every"), or expert-major
    receives read by the gated reader from a reordering transport with a 16 KiB in-flight cap; ``copy_agent``: whether
    a copy agent must have moved the loopback's bytes."""
    if which == "every":
        out = run_distributed(_cases, 2, 1, ALL, 1, timeout=420, env=env)
        for done, stats in out:
            assert done == len(ALL), done
            assert stats["drain_after_waits"] is False, "the backend drained after its waits"
            assert stats["copy_agent"] is copy_agent, stats
    else:
        env = dict(env, UCCL_EP_EXPERT_MAJOR_IN_READER="always", UCCL_EP_LOOPBACK_REORDER="8",
                   UCCL_IB_MAX_INFLIGHT_BYTES="16384", UCCL_EP_LOOPBACK_SEED="3")
        out = run_distributed(_expert_major_cases, 2, 1, EXPERT_MAJOR_CASES, timeout=420, env=env)
        for done, *_ in out:
            assert done == len(EXPERT_MAJOR_CASES), done


@pytest.mark.parametrize("which", ["every", "expert-major-reader"])
def test_without_drains_every_output_matches_when_the_caller_runs_on_a_non_default_stream(which):
    """UCCL_EP_DRAIN_AFTER_WAITS=never with the proxy threads copying (no copy agent): the host launches on while a
    network wait spins, and the test's own reads (pageable .cpu() copies, uploads) follow at once. Over the loopback
    that is correct only off the legacy default stream: there, a pageable copy that waits behind a running kernel
    holds every other thread's copies and launches in the process, the loopback proxy's included, until that kernel
    (our wait) gives up (docs/internode.md, "Drains"). On a non-blocking stream, with the loopback's events made
    ahead, every output equals the reference."""
    _need(2)
    # (tests.distributed puts each rank on a side stream; on the legacy stream the backend would refuse the calls)
    _every_output_without_drains(which, {
        "UCCL_EP_TEST_SIDE_STREAM": "1", "UCCL_EP_DRAIN_AFTER_WAITS": "never", "CUDA_MODULE_LOADING": "EAGER",
        "CUDA_DEVICE_MAX_CONNECTIONS": "32", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
        "UCCL_EP_LOOPBACK_COPY_AGENT": "off"}, copy_agent=False)


@pytest.mark.parametrize("which", ["every", "expert-major-reader"])
def test_with_the_copy_agent_every_output_matches_without_drains_on_the_legacy_default_stream(which):
    """The defaults with a GPU per rank: a copy agent process moves the loopback's bytes, so the host does not drain
    (UCCL_EP_DRAIN_AFTER_WAITS=auto), on torch's legacy default stream, with lazy module loading and CUDA's default
    queues -- where the proxy threads' own copies stalled until the GPU deadline (the test's pageable reads, and the
    first launches of torch's kernels, behind our spinning waits: docs/internode.md, "Drains"). Every output equals
    the reference."""
    _need_gpu_per_rank(2)
    _every_output_without_drains(which, {"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"},
                                 copy_agent=True)


def _frees_and_reads_while_our_waits_spin(rank, world, G, rounds=4):
    from uccl_ep_train.backends import DispatchArgs

    nat, ref, dev = _backends(rank, world, G)
    try:
        assert torch.cuda.current_stream(dev).cuda_stream == 0  # the legacy default stream
        g = torch.Generator().manual_seed(17 + rank)
        T, K, E, H = 512, 4, 4 * world, 2048
        for it in range(rounds):
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            x = torch.randn((T, H), generator=g).to(torch.bfloat16)
            outs = []
            for b, d in ((ref, torch.device("cpu")), (nat, dev)):
                tpr, tpn, tpe, itr = b.get_dispatch_layout(idx.to(d), E)
                r = b.dispatch(DispatchArgs(x.to(d), None, None, tpr, tpn, itr, tpe, idx.to(d), None))
                if b is nat:  # while our reader may still spin: free cached memory (cudaFree), read a result
                    junk = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
                    del junk
                    torch.cuda.empty_cache()
                    float(r.recv_x[:1].float().sum())  # a pageable read on the legacy stream, behind our reader
                y = (r.recv_x.float() * (1.0 + rank)).to(torch.bfloat16)
                cx, _ = b.combine(y, r.handle, None, None)
                if b is nat:
                    torch.cuda.empty_cache()
                outs.append((r.recv_x.cpu(), cx.cpu()))
            assert torch.equal(outs[0][0], outs[1][0]), f"rank {rank} round {it}: recv_x"
            assert torch.equal(outs[0][1], outs[1][1]), f"rank {rank} round {it}: combined_x"
        return rounds, nat._copy_agent is not None, nat._drain_after_waits
    finally:
        nat.destroy()


def test_with_the_copy_agent_a_caller_that_frees_memory_and_reads_while_our_waits_spin_gets_every_output():
    """What held the proxy threads' copies in sessions 33-35, done on purpose by both ranks right after each call
    returns (no drains, the defaults with a GPU per rank): cudaFree through torch.cuda.empty_cache() and a pageable
    read on the legacy default stream while our reader spins, over a slow wire so that it spins long. The copy agent
    copies in another process, so the calls finish and equal the reference."""
    _need_gpu_per_rank(2)
    env = {"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "30", "UCCL_EP_LOOPBACK_BW_GBPS": "1"}
    out = run_distributed(_frees_and_reads_while_our_waits_spin, 2, 1, timeout=300, env=env)
    for rank, (rounds, agent, drains) in enumerate(out):
        assert rounds == 4 and agent and drains is False, (rank, rounds, agent, drains)


def _sync_free_before_counts(rank, world, G):
    from internode_cases import sync_free_dispatch_returns_before_the_count_read

    nat, ref, dev = _backends(rank, world, G)
    try:
        return sync_free_dispatch_returns_before_the_count_read(nat, ref, dev, rank, world)
    finally:
        nat.destroy()


def test_without_drains_a_sync_free_dispatch_returns_before_the_count_read_and_the_next_call_finishes_it():
    """UCCL_EP_DRAIN_AFTER_WAITS=never with num_worst_tokens, on side streams, right after a combine: the dispatch
    returns before the host reads the counts -- rank-major and expert-major, bf16 and FP8 -- with every output and
    the handle's tokens per expert (made on the device) equal to the reference's; the next call reads the counts and
    fills in the handle; a receive past num_worst_tokens is raised by the next call with the counters in step, and
    the calls after it match."""
    _need(2)
    env = {"UCCL_EP_TEST_SIDE_STREAM": "1", "UCCL_EP_DRAIN_AFTER_WAITS": "never", "CUDA_MODULE_LOADING": "EAGER",
           "CUDA_DEVICE_MAX_CONNECTIONS": "32", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_sync_free_before_counts, 2, 1, timeout=300, env=env)
    for rank, (early, err, in_step, done) in enumerate(out):
        assert early == 4, (rank, early)
        assert "the sync-free dispatch before this call" in err and "raise num_worst_tokens" in err, (rank, err)
        assert in_step, f"rank {rank}: the dispatch counters are not at their targets after the error"
        assert done == 3, (rank, done)


def _never_on_the_default_stream(rank, world, G):
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.internode import InternodeError

    nat, ref, dev = _backends(rank, world, G)
    try:
        assert torch.cuda.current_stream(dev).cuda_stream == 0
        x = torch.randn(8, 256, device=dev).to(torch.bfloat16)
        idx = torch.randint(0, 4 * world, (8, 4), device=dev)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        before = nat.proxy_stats()["commands"]
        try:
            nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        except InternodeError as e:
            return str(e), nat.proxy_stats()["commands"] - before
        return None, nat.proxy_stats()["commands"] - before
    finally:
        nat.destroy()


def test_without_drains_a_loopback_call_on_the_legacy_default_stream_raises_before_any_launch():
    """UCCL_EP_DRAIN_AFTER_WAITS=never, called on torch's default stream over a loopback whose proxy threads copy (no
    copy agent): dispatch raises at its entry, naming the rank and the fix, and no command of it reached the proxies
    (nothing was launched)."""
    _need(2)
    out = run_distributed(_never_on_the_default_stream, 2, 1, timeout=240,
                          env={"UCCL_EP_DRAIN_AFTER_WAITS": "never", "UCCL_EP_CPU_TIMEOUT_SECS": "30",
                               "UCCL_EP_LOOPBACK_COPY_AGENT": "off"})
    for rank, (err, commands) in enumerate(out):
        assert err is not None and f"rank {rank}: UCCL_EP_DRAIN_AFTER_WAITS=never" in err, err
        assert "torch.cuda.stream" in err, err
        assert commands == 0, commands


def _own_row_cases(rank, world, G, cases):
    nat, ref, dev = _backends(rank, world, G)
    try:
        return compare_cases(nat, ref, dev, rank, world, cases, 1), nat.own_rows_read_from_columns
    finally:
        nat.destroy()


@pytest.mark.parametrize("from_columns", ["1", "0"], ids=["from-columns", "packed"])
@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_on_gpus_a_gated_reader_takes_our_own_rows_from_the_columns_or_from_the_records_and_outputs_match(
        world, G, from_columns):
    """With one GPU per node the gated readers -- rank-major unpack and the expert-major reader, uncached and cached,
    FP8 scales, dropped experts, skew, a rank that receives nothing -- read our own node's rows straight from the
    input columns, which the sender never packs (UCCL_EP_OWN_ROWS_FROM_COLUMNS=1, the default), or from the records
    packed into the receive area (0): every output equals the reference bit for bit either way; with several GPUs per
    node the records are always packed (the forwarders need them)."""
    _need(world)
    env = {"UCCL_EP_OWN_ROWS_FROM_COLUMNS": from_columns, "UCCL_EP_EXPERT_MAJOR_IN_READER": "always",
           "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_own_row_cases, world, G, OWN_ROW_CASES, timeout=420, env=env)
    for done, read in out:
        assert done == len(OWN_ROW_CASES)
        assert (read >= 2 * len(OWN_ROW_CASES)) if G == 1 and from_columns == "1" else read == 0, read


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_reordered_transport_with_inflight_cap_one_and_tiny_chunks_still_matches(world, G, tmp_path):
    _need(world)
    # The proxy watchdog (CPU deadline) fires before the GPU waits: if a sender's write is stuck, its own error
    # names the FIFO, the writes in flight and the transport's state, rather than only a receiver's counter.
    env = {"UCCL_EP_LOOPBACK_REORDER": "8", "UCCL_IB_MAX_INFLIGHT_NORMAL": "1", "UCCL_IB_MAX_INFLIGHT_BYTES": "4096",
           "UCCL_EP_LOOPBACK_SEED": "7", "UCCL_EP_CPU_TIMEOUT_SECS": "20", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
           # on a failure the harness touches it: every proxy thread then prints its side (run pytest with -s)
           "UCCL_EP_PROXY_DUMP_FILE": str(tmp_path / "dump-proxies")}
    out = run_distributed(_cases, world, G, ALL[:5], 1, timeout=420, env=env)
    stats = [st for _, st in out]
    assert max(st["max_inflight_writes"] for st in stats) == 1
    assert sum(st["commands"] for st in stats) > 20, "tiny chunks should have made many commands"


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_outputs_also_match_when_arrivals_are_read_only_after_the_whole_hop(world, G):
    """UCCL_EP_GATED_ARRIVALS=0: the readers of a hop's arrivals wait for every counter first (the path before
    session 10); every other test here runs the gated readers, which start with the hop."""
    _need(world)
    env = {"UCCL_EP_GATED_ARRIVALS": "0", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases_counting, world, G, ALL[:5], ("forwards_during_hop", "own_rows_read_from_columns"),
                          timeout=420, env=env)
    # (both happen only in gated readers: forwards during the hop with several GPUs per node, own rows with one)
    assert all(done == 5 and forwarded == 0 and own == 0 for done, forwarded, own in out), out


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_reordered_transport_with_several_writes_in_flight_still_matches(world, G):
    """With one write in flight the loopback never actually reorders (a write's completion and its immediate leave
    together); four in flight let deliveries overtake each other, so the sequence numbers must restore the order.
    Holding happens only between writes of one (sender, slot) lane, so: one proxy thread with one FIFO (every chunk
    on one lane), a byte cap of 256 KiB (64 KiB chunks: caps below 256 KiB are one chunk, one write in flight), and
    a 100 us delivery delay, so that the writes posted together become ready together and are shuffled as a group.
    Hidden 1024: a block of ~100 tokens is then several chunks in both directions (with bf16 partials and hidden 256
    a combine block fit one chunk)."""
    _need(world)
    env = {"UCCL_EP_LOOPBACK_REORDER": "8", "UCCL_IB_MAX_INFLIGHT_NORMAL": "4", "UCCL_IB_MAX_INFLIGHT_BYTES": "262144",
           "UCCL_EP_NUM_PROXY_THREADS": "1", "UCCL_EP_FIFOS_PER_THREAD": "1", "UCCL_EP_LOOPBACK_DELAY_US": "100",
           "UCCL_EP_LOOPBACK_SEED": "11", "UCCL_EP_CPU_TIMEOUT_SECS": "30", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases, world, G, ALL, 1, 1024, timeout=420, env=env)
    assert all(done == len(ALL) for done, _ in out)
    assert max(st["max_inflight_writes"] for _, st in out) > 1, "never more than one write in flight"
    assert max(st["max_reorder_held"] for _, st in out) > 0, "nothing was delivered out of order"


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_slow_writes_of_the_last_combine_are_delivered_before_teardown(world, G):
    """Each loopback write held 20 ms, one in flight: when a rank's last combine returns, its own partial sums to a
    peer are still in its proxy. destroy() must deliver them before it stops the proxy (it used to drop them, and the
    peer timed out with all but the last chunk of a lane: the old intermittent 2 x 2 failure)."""
    _need(world)
    env = {"UCCL_EP_LOOPBACK_DELAY_US": "20000", "UCCL_IB_MAX_INFLIGHT_NORMAL": "1",
           "UCCL_IB_MAX_INFLIGHT_BYTES": "4096", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases, world, G, ALL[:2], 1, timeout=420, env=env)
    assert all(done == 2 for done, _ in out)


def _absent_peer(rank, world, G):
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext, DispatchArgs
    from uccl_ep_train.internode import InternodeError, NativeInternodeBackend
    from uccl_ep_train.settings import load_settings

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G, device=dev,
                         num_nvl_bytes=NVL, num_rdma_bytes=RDMA, settings=load_settings())
    nat = NativeInternodeBackend(ctx)
    try:
        if rank == world - 1:
            time.sleep(12)  # never joins the dispatch: to the others it is gone
            return None
        idx = torch.randint(0, 4 * world, (64, 2), device=dev)
        x = torch.randn((64, 128), device=dev).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        t0 = time.time()
        try:
            nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        except InternodeError as exc:
            return time.time() - t0, str(exc)
        return time.time() - t0, "no error"
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_a_rank_that_stops_participating_makes_the_others_raise_within_the_deadline(world, G):
    _need(world)
    out = run_distributed(_absent_peer, world, G, timeout=120, env={"UCCL_EP_CPU_TIMEOUT_SECS": "3",
                                                                    "UCCL_EP_GPU_TIMEOUT_SECS": "3"})
    for rank in range(world - 1):
        elapsed, msg = out[rank]
        assert msg != "no error" and f"rank {rank}" in msg, msg
        assert f"proxy threads:\nrank {rank} proxy thread 0: " in msg, msg  # each thread's queues and flight
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f} s"


def _killed_peer(rank, world, G, out_dir):
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext, DispatchArgs
    from uccl_ep_train.internode import InternodeError, NativeInternodeBackend
    from uccl_ep_train.settings import load_settings

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G, device=dev,
                         num_nvl_bytes=NVL, num_rdma_bytes=RDMA, settings=load_settings())
    nat = NativeInternodeBackend(ctx)
    if rank == world - 1:  # joins notify, then dies before pushing: its peers are already waiting on the GPU
        nat._push_and_wait = lambda *a, **k: os._exit(0)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 4 * world, (64, 2), generator=g).to(dev)
    x = torch.randn((64, 128), generator=g).to(dev).to(torch.bfloat16)
    tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
    t0 = time.time()
    try:
        nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        res = [time.time() - t0, "no error"]
    except InternodeError as exc:
        res = [time.time() - t0, str(exc)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    try:
        nat.destroy()
    except Exception:  # noqa: BLE001 - the peer is gone; teardown errors are not what this test checks
        pass
    return res


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_a_rank_killed_mid_dispatch_makes_the_others_raise_fast_naming_the_dead_peer(world, G, tmp_path):
    """The killed rank exits with status 0 and never reports, so run_distributed runs into its own deadline; the
    survivors record what they saw. The GPU deadline is long (30 s): a fast error proves that the proxy's dead-peer
    detection aborts the GPU waits (abort_waits) instead of every rank waiting out UCCL_EP_GPU_TIMEOUT_SECS."""
    _need(world)
    with pytest.raises(TimeoutError):
        run_distributed(_killed_peer, world, G, str(tmp_path), timeout=25,
                        env={"UCCL_EP_CPU_TIMEOUT_SECS": "20", "UCCL_EP_GPU_TIMEOUT_SECS": "30"})
    for rank in range(world - 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} did not finish its dispatch within the test's deadline"
        elapsed, msg = json.loads(path.read_text())
        assert msg != "no error" and f"rank {rank}" in msg, msg
        assert f"rank {world - 1}" in msg, f"rank {rank} does not name the dead peer: {msg}"
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f} s: {msg}"


def _one_rank_fails_while_the_others_wait_on_the_gpu(rank, world, G):
    """Every rank dispatches once; then rank 0 raises, and the others start a dispatch that waits for it on the GPU
    (deadline 3 s). The harness asks them for their state while they wait, and again while they tear down."""
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext, DispatchArgs
    from uccl_ep_train.internode import InternodeError, NativeInternodeBackend
    from uccl_ep_train.settings import load_settings

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G, device=dev,
                         num_nvl_bytes=NVL, num_rdma_bytes=RDMA, settings=load_settings())
    nat = NativeInternodeBackend(ctx)
    g = torch.Generator().manual_seed(rank)

    def dispatch():
        idx = torch.randint(0, 4 * world, (64, 2), generator=g).to(dev)
        x = torch.randn((64, 128), generator=g).to(dev).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 4 * world)
        nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))

    try:
        dispatch()
        if rank == 0:
            raise ValueError("rank 0 fails on purpose after its first dispatch")
        try:
            dispatch()
        except InternodeError:
            pass  # rank 0 never joins: the deadline is this rank's expected way out
        time.sleep(1)  # still alive, with its backend torn down, when the state request of a slow harness comes
    finally:
        nat.destroy()


def _setup_warnings(rank, world, G):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        nat, _, _ = _backends(rank, world, G)
    nat.destroy()
    return [str(w.message) for w in seen if "hardware work queue" in str(w.message)]


def test_loopback_setup_warns_when_cuda_gives_the_proxy_threads_copies_one_hardware_queue():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (what Megatron launchers set) let a loopback copy made by the proxy threads wait
    behind a kernel spinning for its bytes until the GPU deadline (session 22, one H200): where the proxy threads copy
    (UCCL_EP_LOOPBACK_COPY_AGENT=off), every rank says so at setup, naming what to set. With the CUDA default nobody
    warns, nor with the copy agent (the default with a GPU per rank since session 38), whose copies are another
    process's; where the two ranks share a GPU the default gives no copy agent, so they warn there too."""
    _need(2)
    threads = {"UCCL_EP_LOOPBACK_COPY_AGENT": "off"}
    one = run_distributed(_setup_warnings, 2, 1, timeout=120, env=dict(threads, CUDA_DEVICE_MAX_CONNECTIONS="1"))
    for rank, said in enumerate(one):
        assert len(said) == 1 and said[0].startswith(f"rank {rank}: the loopback transport"), said
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1 gives this process 1 hardware work queue(s)" in said[0]
    assert run_distributed(_setup_warnings, 2, 1, timeout=120,
                           env=dict(threads, CUDA_DEVICE_MAX_CONNECTIONS="8")) == [[], []]
    default = run_distributed(_setup_warnings, 2, 1, timeout=120, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    if torch.cuda.device_count() >= 2:
        assert default == [[], []], default
    else:  # (UCCL_EP_TEST_SHARE_GPU on one GPU: UCCL_EP_LOOPBACK_COPY_AGENT=auto leaves the copies to the threads)
        assert [len(said) for said in default] == [1, 1] and all("1 hardware work queue" in s[0] for s in default)


def _random_routing(nat, dev, T, H, E, K, seed):
    """BF16 tokens routed to K of E experts at random: (x, topk_idx, nat's dispatch layout of them)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.rand((T, E), device=dev, generator=g).topk(K, dim=1).indices
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    return x, idx, nat.get_dispatch_layout(idx, E)


def _timeline(rank, world, G):
    """A dispatch (pushed after notify), its combine, a dispatch pushed during notify, its combine, a cached dispatch
    and its combine, every pack-and-push launch stamped; the launch records by rank."""
    from uccl_ep_train.backends import DispatchArgs

    nat, _, dev = _backends(rank, world, G)
    try:
        x, idx, (tpr, tpn, tpe, itr) = _random_routing(nat, dev, T=512, H=256, E=16, K=4, seed=100 + rank)
        nat.start_kernel_timeline(8)
        for _ in range(2):
            r = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
            nat.combine(r.recv_x, r.handle, None, None)
        c = nat.dispatch(DispatchArgs(x, None, r.handle, None, None, None, None, None, None))
        nat.combine(c.recv_x, r.handle, None, None)
        return nat.stop_kernel_timeline()
    finally:
        nat.destroy()


def test_the_kernel_timeline_stamps_each_pack_and_push_in_order_and_shows_a_push_held_back_for_late_count_rows():
    """bench internode --timeline at kernel level (2 x 1, every loopback write delayed 20 ms): every pack-and-push
    launch of the six calls is stamped and labelled by its call, and so is the gated reader of its hop; in each, the
    first chunk is written before it is pushed and the first command before the last, and the reader starts, sees
    the last chunk land (a delay after the push) and ends in that order; only the dispatch pushed during notify waits
    for the count rows,
    which come a write's delay late, so it holds its written first chunk back until they are in. How long each rank
    waits depends on which started first (the later rank's row comes one delay after it started, the earlier rank's
    one delay after the earlier start), but the two waits add up to about two delays."""
    from uccl_ep_train.kernel_timeline import COMBINE, DISPATCH, DISPATCH_DURING_NOTIFY, waited_for_rows_us

    _need(2)
    out = run_distributed(_timeline, 2, 1, timeout=240, env={"UCCL_EP_LOOPBACK_DELAY_US": "20000"})
    waited = 0.0
    for rank, launches in enumerate(out):
        kinds = [m["kind"] for m in launches]
        assert kinds == [DISPATCH, COMBINE, DISPATCH_DURING_NOTIFY, COMBINE, DISPATCH, COMBINE], (rank, kinds)
        for m in launches:
            assert m["start_ns"] is not None and m["chunks"] >= 1, (rank, m)
            assert 0 <= m["first_ready_us"] <= m["first_push_us"] <= m["last_push_us"], (rank, m)
            assert m["packers_done_us"] is not None, (rank, m)
            if m["kind"] == DISPATCH_DURING_NOTIFY:
                assert m["rows_in_us"] is not None and m["first_push_us"] >= m["rows_in_us"], (rank, m)
                waited += waited_for_rows_us(m)
            else:
                assert m["rows_in_us"] is None, (rank, m)
            # the hop's gated reader: launched behind the push; its watcher sees the last chunk land after it began
            # and its blocks end after that (a block may read the last chunk a moment before the watcher stamps: 5 us
            # of slack)
            assert 0 < m["reader_start_us"] <= m["all_in_us"] <= m["reader_end_us"] + 5, (rank, m)
    assert waited >= 30_000, f"the pushes during notify waited {waited:.0f} us in all for rows delayed 20 ms each"


def _wire_calls(rank, world, G):
    """A forward pair (dispatch, combine) and a backward pair (cached dispatch, combine), each call timed to the end
    of its GPU work on the wire's clock; (each call's wire_timeline.call_on_wire, the dispatch's network payload
    bytes, its record stride's bound)."""
    import torch.distributed as dist

    from uccl_ep_train import native
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.wire_timeline import CallWindow, call_on_wire, readers_in_calls, runs_from_log

    clock = native.module().steady_clock_ns
    nat, _, dev = _backends(rank, world, G)
    try:
        H = 2048
        x, idx, (tpr, tpn, tpe, itr) = _random_routing(nat, dev, T=2048, H=H, E=16, K=4, seed=300 + rank)
        r = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))  # warm: modules, plans
        nat.combine(r.recv_x, r.handle, None, None)
        torch.cuda.synchronize()
        offsets = [nat._k.gpu_timer_minus_steady_ns(dev.index)]
        nat.start_wire_log(4096)
        nat.start_kernel_timeline(8)
        calls, out = [], {}

        def timed(kind, fn):
            # every rank's last call is over, so no byte of it is still to go on any wire: each call's window holds
            # its own runs only (back to back, a call that returned before its own last byte left -- its peer's were
            # in -- would hand its tail to the next one)
            dist.barrier()
            t0 = clock()
            res = fn()
            torch.cuda.synchronize()
            calls.append(CallWindow(kind, t0, clock()))
            return res

        r = timed("forward dispatch", lambda: nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None)))
        out["network_bytes"] = nat.last_traffic.network_bytes
        timed("forward combine", lambda: nat.combine(r.recv_x, r.handle, None, None))
        c = timed("backward cached dispatch",
                  lambda: nat.dispatch(DispatchArgs(x, None, r.handle, None, None, None, None, None, None)))
        timed("backward combine", lambda: nat.combine(c.recv_x, r.handle, None, None))
        runs = runs_from_log(nat.stop_wire_log())
        launches = nat.stop_kernel_timeline()
        offsets.append(nat._k.gpu_timer_minus_steady_ns(dev.index))
        out["offsets"] = offsets
        readers = readers_in_calls(calls, launches, (offsets[0][0] + offsets[1][0]) // 2)
        out["calls"] = {call.kind: call_on_wire(call, runs, reader) for call, reader in zip(calls, readers)}
        out["stride_bound"] = 2 * H + 16 * idx.size(1) + 64  # payload, top-k ids and weights, index fields, padding
        return out
    finally:
        nat.destroy()


def test_the_wire_timeline_puts_each_calls_records_on_the_capped_wire_within_the_call():
    """bench internode --timeline's wire part at backend level (2 x 1, the loopback capped at 5 GB/s): every call of a
    forward and a backward pair put its own bytes on this rank's wire, each dispatch at least its network payload and
    at most its records, and the wire was busy for them exactly their bytes over the cap (also where a call returned
    before its own last byte left, its peer's bytes being in: session 24 on 2x H200); the parts of each call add up
    to it. The GPU timer's offset from the host clock is known to a few us and steady over the calls, and with it
    each call's reader lands in the call: it sees the hop's last chunk land within the call and ends before the call
    returns, the three parts after the wire adding up to the time after it."""
    _need(2)
    out = run_distributed(_wire_calls, 2, 1, timeout=240, env={"UCCL_EP_LOOPBACK_BW_GBPS": "5"})
    for rank, got in enumerate(out):
        payload, per_record = got["network_bytes"], got["stride_bound"] / (2 * 2048)
        assert payload > 0, (rank, got)
        for kind, c in got["calls"].items():
            assert c["wire_bytes"] > 0 and c["wire_start_us"] >= 0, (rank, kind, c)
            assert c["wire_busy_us"] == pytest.approx(c["wire_bytes"] / 5e3, rel=1e-3, abs=0.01), (rank, kind, c)
            assert c["wire_end_us"] == pytest.approx(c["wire_start_us"] + c["wire_busy_us"] + c["wire_idle_us"])
            assert c["wire_end_us"] + c["after_wire_us"] == pytest.approx(c["call_us"]), (rank, kind, c)
            if kind.endswith("dispatch"):  # + the count rows and the signals' zero-length writes
                assert payload <= c["wire_bytes"] <= payload * per_record + (1 << 20), (rank, kind, c)
            # the reader, on the host clock (the offset's error, a few us, is the tolerance)
            err = max(e for _, e in got["offsets"]) / 1e3 + 1.0
            assert c["reader_after_all_in_us"] >= 0 and c["return_after_reader_us"] >= -err, (rank, kind, c)
            assert c["all_in_after_wire_us"] + c["reader_after_all_in_us"] + c["return_after_reader_us"] == \
                pytest.approx(c["after_wire_us"], abs=0.01), (rank, kind, c)
            # the last chunk landed within the call (a wrong offset puts it seconds away)
            assert -c["wire_end_us"] - err <= c["all_in_after_wire_us"] <= c["after_wire_us"] + err, (rank, kind, c)
        (before, e0), (after, e1) = got["offsets"]
        assert e0 < 20_000 and e1 < 20_000, got["offsets"]  # ns: a PCIe round trip, not a scheduling hiccup
        assert abs(after - before) < e0 + e1 + 50_000, got["offsets"]  # the clocks drift far less in a second


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_ranks_asked_for_their_state_after_a_peers_failure_answer_it_and_none_crashes(world, G, tmp_path):
    """The harness's state request (SIGUSR1) reads each rank's FIFOs, proxy counters and signals from a thread of its
    own while the main thread waits on the GPU or tears its backend down, and the proxy threads print their own
    (UCCL_EP_PROXY_DUMP_FILE, touched by the harness). Before session 21's build fix every rank asked died of SIGSEGV
    while formatting that state. Twice per topology, since a request may find a rank waiting or tearing down."""
    _need(world)
    env = {"UCCL_EP_CPU_TIMEOUT_SECS": "3", "UCCL_EP_GPU_TIMEOUT_SECS": "3",
           "UCCL_EP_PROXY_DUMP_FILE": str(tmp_path / "dump")}
    for _ in range(2):
        with pytest.raises(RuntimeError) as exc:
            run_distributed(_one_rank_fails_while_the_others_wait_on_the_gpu, world, G, timeout=120, env=env)
        msg = str(exc.value)
        assert msg.startswith(f"rank 0 of {world} failed first") and "fails on purpose" in msg, msg
        assert "died of signal" not in msg and "died with exit code" not in msg, msg
        for r in range(1, world):
            answer = re.search(rf"state of rank {r} when asked after the failure:\n(.*)", msg)
            assert answer, f"rank {r} did not answer: {msg}"
            # its backend's own line (rank r: its FIFOs ...), or the backend was already torn down
            assert answer.group(1).startswith((f"rank {r}: rank {r} FIFOs", "no live internode backend")), msg


class _View:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


def _bytes_before_signal(rank, world, same_gpu):
    """Rank 0 pushes 64 KiB to rank 1 and then spins on the default (legacy) stream until rank 1 acknowledges;
    rank 1 waits for the signal, copies what landed, then acknowledges. A transport that publishes the signal before
    the bytes land (or whose copy queues behind the sender's spinning kernel) fails here deterministically."""
    import torch.distributed as dist

    from uccl_ep_train import native

    k = native.module().internode
    assert k.PUSH_COLUMNS == 7
    dev = torch.device("cuda", 0 if same_gpu else rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    RB, n = 1 << 20, 4096  # 4096 records of 16 bytes
    cx = k.InternodeContext(rank=rank, world=world, device=dev.index, rdma_bytes=RB, nvl_bytes=1 << 16,
                            num_threads=1, fifos_per_thread=1, fifo_depth=64, cpus=[], idle_backoff_us=0,
                            timeout_secs=20.0, max_inflight_writes=8, max_inflight_bytes=2 << 20, reorder_window=256,
                            num_signal_slots=512, loopback_reorder=0, loopback_delay_us=0,
                            loopback_bandwidth_gbps=0.0, loopback_seed=0, gpu_timeout_secs=10.0)
    try:
        infos = [None] * world
        dist.all_gather_object(infos, cx.proxy_local_info(0))
        cx.proxy_connect([infos])
        dist.barrier()
        native.module().unlink_shared_host_memory_names()
        cx.proxy_start()
        rdma = torch.as_tensor(_View(cx.rdma_ptr, RB), device=dev)
        half = RB // 2
        pattern = (torch.arange(n * 16, device=dev) % 251 + 1).to(torch.uint8)
        s = torch.cuda.current_stream().cuda_stream  # the legacy default stream, as torch uses it
        ok = True
        if rank == 0:
            rdma[:n * 16].copy_(pattern)
            torch.cuda.synchronize()
            dist.barrier()
            table = torch.tensor([[1, 0, half, 16, n, 0, 0]], dtype=torch.int64, device=dev)
            cx.push_chunks(table.data_ptr(), 1, n, 1, s)
            cx.wait_signals([(1, 1)], 1, s)  # slot 1 >= 1: rank 1 has looked
            torch.cuda.synchronize()
        else:
            dist.barrier()
            cx.wait_signals([(0, n)], 1, s)
            got = rdma[half:half + n * 16].clone()  # stream-ordered right behind the wait
            table = torch.tensor([[0, 0, RB - 16, 16, 1, 1, 0]], dtype=torch.int64, device=dev)
            cx.push_chunks(table.data_ptr(), 1, 1, 1, s)
            torch.cuda.synchronize()
            ok = torch.equal(got, pattern)
        err = cx.error_message() or cx.proxy_error()
        dist.barrier()  # nobody closes its endpoint while the other still needs it
        return ok, err
    finally:
        cx.destroy()


# Not placed under CUDA_LAUNCH_BLOCKING=1: that makes every launch and copy of the process synchronous, so rank 0's
# host thread does not return from launching its wait kernel (which spins until rank 1's bytes and signal arrive), and
# its proxy thread's copy, made synchronous, returns only after that kernel's deadline (observed on 2x H200: rank 0
# waited 10 s for slot 1, saw 0). GPU-initiated communication through a CPU proxy, like NCCL, needs asynchronous
# launches (docs/internode.md, "Verification on GPUs").
@pytest.mark.parametrize("placement", ["same_gpu", "two_gpus"])
def test_a_signal_never_arrives_before_its_bytes_while_the_sender_spins_on_the_default_stream(placement):
    same = placement == "same_gpu"
    _need(2, 1 if same else 2)
    out = run_distributed(_bytes_before_signal, 2, same, timeout=120)
    for rank, (ok, err) in enumerate(out):
        assert not err, f"rank {rank}: {err}"
        assert ok, f"rank {rank}: the signal arrived before the bytes (stale data read after the wait)"


def _one_rank_context(**overrides):
    """A started one-rank InternodeContext on GPU 0 whose proxy writes to the rank itself (1 thread, 2 FIFOs),
    destroyed on leaving."""
    return one_rank_context(native.module().internode.InternodeContext,
                            **{"device": 0, "timeout_secs": 5.0, "gpu_timeout_secs": 5.0, **overrides})


def test_tables_reach_the_gpu_from_the_pinned_area_also_when_staged_before_a_drain_and_committed_after_it():
    """UploadStaging with the native copy (copy_to_device) on one GPU: random int64 rows uploaded, an int32 table
    staged, the stream drained (the area is not freed: the staged table waits), another upload, then the staged
    table's commit; every table lands exactly and nothing fell back to a pageable copy."""
    import numpy as np

    from uccl_ep_train.upload_staging import UploadStaging

    with _one_rank_context() as cx:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        stream = torch.cuda.current_stream().cuda_stream
        st = UploadStaging(dev, cx.copy_to_device, nbytes=4096)
        g = torch.Generator().manual_seed(5)
        rows = torch.randint(-(1 << 40), 1 << 40, (16, 7), generator=g).tolist()
        a = st.upload(rows, np.int64, stream)
        staged = st.stage(list(range(100)), np.int32)
        cx.record_drain_mark(stream)
        torch.cuda.synchronize()
        assert cx.drain_mark_reached()
        st.drained(stream)
        b = st.upload([[1, 2], [3, 4]], np.int64, stream)
        c = st.commit(staged, stream)
        torch.cuda.synchronize()
        assert a.cpu().tolist() == rows and b.cpu().tolist() == [[1, 2], [3, 4]]
        assert c.dtype == torch.int32 and c.cpu().tolist() == list(range(100))
        assert (st.staged, st.fallbacks) == (3, 0)


def test_a_gated_unpack_waits_for_each_chunk_and_a_missing_chunk_times_out_naming_its_lane():
    """The arrival gate at kernel level, on one GPU writing to itself through the loopback (each write delayed 20 ms,
    one at a time): the watcher block, the device mirror and the readers' L2 loads (internode_cases)."""
    k = native.module().internode
    with _one_rank_context(max_inflight_writes=1, loopback_delay_us=20000, gpu_timeout_secs=2.0) as cx:
        dev = torch.device("cuda", 0)
        check_a_gated_unpack_reads_rows_only_after_their_chunks_land(
            cx, k.unpack_records, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev), dev,
            dict(k.ERROR_CODES))


@pytest.mark.parametrize("shape", FORWARD_ARRIVAL_SHAPES, ids=FORWARD_ARRIVAL_SHAPE_IDS)
def test_the_gated_forward_sends_each_record_once_its_chunk_landed_with_its_arrival_stamped(shape):
    """The dispatch forward as the forwarder's reader (forward_arrivals_kernel; docs/internode.md, "Gated forward"),
    on one rank whose proxy writes to itself, each write delayed 20 ms: waits for each chunk, forwards byte for byte
    with the arrival stamped, times out naming a missing chunk's counter, checks its range."""
    k = native.module().internode
    with _one_rank_context(max_inflight_writes=1, loopback_delay_us=20000, gpu_timeout_secs=2.0) as cx:
        dev = torch.device("cuda", 0)
        check_forward_arrivals_forwards_each_record_once_landed_with_its_arrival_stamped(
            cx, k.forward_arrivals, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev), dev,
            dict(k.ERROR_CODES), shape)


def test_pack_and_push_writes_what_pack_records_writes_and_pushes_every_chunk_once_written():
    """The fused kernel (docs/internode.md, "Pack and push") against pack_records and push_chunks' chunking, on one
    rank whose proxy writes to itself."""
    k = native.module().internode
    with _one_rank_context() as cx:
        dev = torch.device("cuda", 0)
        check_pack_and_push_writes_the_records_of_pack_records_and_the_chunks_of_push_chunks(
            cx, k.pack_records, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev), dev)


@pytest.mark.parametrize("blocks,own_range", [(0, None), (2, None), (2, (8, 20)), (1, (0, 13))],
                         ids=["block-per-tile", "2-blocks-in-order", "2-blocks-own-block-last", "1-block-own-first"])
@pytest.mark.parametrize("f32", [False, True], ids=["bf16", "fp32"])
def test_the_pipelined_gather_sums_each_record_once_its_tiles_are_flagged_and_names_a_gpu_that_never_flags(
        f32, blocks, own_range):
    """The pipelined combine gather's kernels (gather_tiles, pack_and_push with node sums, wait_node_flags;
    docs/internode.md, "Pipelined combine gather") on one rank playing a forwarder and its node's 3 GPUs, one of
    which gathers late from another stream while the packers spin."""
    k = native.module().internode
    with _one_rank_context(gpu_timeout_secs=2.0) as cx:
        dev = torch.device("cuda", 0)
        check_node_sums_wait_for_tile_flags_and_name_a_gpu_that_never_flags(
            cx, k.gather_tiles, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev),
            torch.as_tensor(_View(cx.nvl_ptr, cx.nvl_bytes), device=dev), dev, dict(k.ERROR_CODES), f32, blocks,
            own_range)


def _cases_counting(rank, world, G, cases, counters):
    """compare_cases on the GPUs, then (pairs compared, *the backend's counters named in ``counters``)."""
    nat, ref, dev = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, dev, rank, world, cases, 1)
        return (done,) + tuple(getattr(nat, c) for c in counters)
    finally:
        nat.destroy()


@pytest.mark.parametrize("flags", ["both", "neither"])
def test_on_gpus_combines_gather_in_flagged_tiles_and_forwards_end_with_node_flags_unless_turned_off(flags):
    """2 x 2 (the GPU twin of the CPU tests): every output equals the reference whether the forwarders sum and push
    each record once its copies' tiles are flagged over NVLink and each dispatch forward ends with flags among the
    node's GPUs, or the whole gather, the node sum and the forward each end with a group barrier."""
    _need(4)
    on = "1" if flags == "both" else "0"
    env = {"UCCL_EP_PIPELINED_COMBINE_GATHER": on, "UCCL_EP_FORWARD_NODE_BARRIER": on,
           "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases_counting, 4, 2, ALL, ("pipelined_gathers", "forward_node_barriers"), timeout=420,
                          env=env)
    assert all(done == len(ALL) for done, _, _ in out), out
    assert all((n > 0) == (on == "1") and (m > 0) == (on == "1") for _, n, m in out), out


def test_on_gpus_the_unpack_beside_the_forward_reads_rows_as_their_forwarders_mark_them_and_outputs_match():
    """2 x 2 with UCCL_EP_UNPACK_BESIDE_FORWARD=1 (docs/internode.md, "The unpack beside the forward"): each GPU
    unpacks its final rows on the second stream as its forwarders mark them, during the hop, and every output equals
    the reference; so do those launched before the count read ("The forward before the count read"), some of which
    read so."""
    _need(4)
    env = {"UCCL_EP_UNPACK_BESIDE_FORWARD": "1", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases_counting, 4, 2, ALL, ("unpacks_beside_forward", "reads_before_counts"), timeout=420,
                          env=env)
    assert all(done == len(ALL) for done, _, _ in out), out
    assert all(n > 0 for _, n, _ in out) and sum(read for _, _, read in out) > 0, out


def test_on_a_gpu_an_unpack_whose_row_is_never_marked_reports_the_row_and_leaves_it_unwritten():
    """unpack_records with ready words on one GPU: the rows whose words hold the epoch are read, the one whose word
    never does is reported after the GPU deadline as row_not_ready (row, word, epoch) and not written."""
    k = native.module().internode
    with _one_rank_context(gpu_timeout_secs=1.0) as cx:
        dev = torch.device("cuda", 0)
        rows, stride = 64, 256
        src = torch.randint(0, 255, (rows, stride), dtype=torch.uint8, device=dev)
        out = torch.full((rows, 128), 7, dtype=torch.uint8, device=dev)
        words = torch.full((rows,), 3, dtype=torch.int32, device=dev)
        words[37] = 2
        stream = torch.cuda.current_stream().cuda_stream
        k.unpack_records(src.data_ptr(), stride, rows, rows, [(out.data_ptr(), 128, 0)], 0, 0, 0, 0, 0, 0, 0, 128, 0,
                         -1, 0, stream, ready_words=words.data_ptr(), ready_epoch=3, ready_timeout_secs=1.0,
                         ready_blocks=2, err=cx.error_word_ptr, stop_flag=cx.stop_flag_ptr,
                         stop_generation=cx.stop_generation, rank=0, phase=3)
        torch.cuda.synchronize(dev)
        e = cx.error_fields()
        assert (e["code"], e["aux"], e["observed"], e["expected"]) == (
            dict(k.ERROR_CODES)["row_not_ready"], 37, 2, 3), e
        assert "final row 37" in cx.error_message(), cx.error_message()
        assert bool((out[37] == 7).all()), "a row whose word was never marked was written"
        cx.clear_error()


def test_on_a_gpu_an_expert_major_receive_whose_row_is_never_marked_reports_the_row_and_leaves_its_rows_unwritten():
    """expert_major_receive with ready words on one GPU (the receive beside the forward; slots given): the rows whose
    words hold the epoch reach the rows slot_of names, the one whose word never does is reported after the GPU
    deadline as row_not_ready (row, word, epoch) and its expert-major rows are not written."""
    k = native.module().internode
    with _one_rank_context(gpu_timeout_secs=1.0) as cx:
        dev = torch.device("cuda", 0)
        rows, stride, x_bytes = 64, 256, 128
        src = torch.randint(0, 255, (rows, stride), dtype=torch.uint8, device=dev)
        out = torch.full((2 * rows, x_bytes), 7, dtype=torch.uint8, device=dev)
        perm = torch.randperm(2 * rows, device=dev).to(torch.int32)
        slot_of = torch.full((rows, 2), -1, dtype=torch.int32, device=dev)
        slot_of[:, 0] = perm[:rows]
        slot_of[::3, 1] = perm[rows:rows + (rows + 2) // 3]  # (every third row reaches a second row)
        words = torch.full((rows,), 3, dtype=torch.int32, device=dev)
        words[37] = 2
        k.expert_major_receive(src.data_ptr(), stride, rows, 0, x_bytes, 0, 0, out.data_ptr(), 0, 2 * rows, 2, True,
                               slot_of.data_ptr(), -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 128, 0, -1, 0,
                               torch.cuda.current_stream().cuda_stream, ready_words=words.data_ptr(), ready_epoch=3,
                               ready_timeout_secs=1.0, ready_blocks=8, err=cx.error_word_ptr,
                               stop_flag=cx.stop_flag_ptr, stop_generation=cx.stop_generation, rank=0, phase=3)
        torch.cuda.synchronize(dev)
        e = cx.error_fields()
        assert (e["code"], e["aux"], e["observed"], e["expected"]) == (
            dict(k.ERROR_CODES)["row_not_ready"], 37, 2, 3), e
        assert "final row 37" in cx.error_message(), cx.error_message()
        for r in range(rows):
            for q in slot_of[r][slot_of[r] >= 0].tolist():
                want = torch.full((x_bytes,), 7, dtype=torch.uint8, device=dev) if r == 37 else src[r, :x_bytes]
                assert torch.equal(out[q], want), (r, q, "the rows of a row whose word was never marked were written"
                                                   if r == 37 else "a marked row was not received")
        cx.clear_error()


def test_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named():
    """raise_flags and the wait for a node's flags (the dispatch forward's node barrier) on one GPU."""
    k = native.module().internode
    with _one_rank_context(gpu_timeout_secs=1.0) as cx:
        dev = torch.device("cuda", 0)
        check_raised_flags_end_the_wait_and_a_gpu_that_never_raises_is_named(
            cx, k.raise_flags, torch.as_tensor(_View(cx.nvl_ptr, cx.nvl_bytes), device=dev), dev, dict(k.ERROR_CODES))


def test_pack_and_push_fails_at_the_deadline_naming_a_chunk_whose_records_are_never_written():
    with _one_rank_context(gpu_timeout_secs=1.0) as cx:
        check_a_chunk_whose_records_are_never_written_makes_pack_and_push_fail_naming_it(
            cx, torch.device("cuda", 0), dict(native.module().internode.ERROR_CODES))


def test_push_after_counts_waits_on_the_gpu_for_the_count_rows_and_places_each_block_from_them():
    """The push during notify at kernel level (docs/internode.md, "Push during notify"), on one GPU writing to
    itself through a loopback that delays each write by 20 ms: the push must wait for the count row's signal."""
    with _one_rank_context(loopback_delay_us=20000, gpu_timeout_secs=1.0, max_inflight_bytes=1 << 20) as cx:
        dev = torch.device("cuda", 0)
        check_push_after_counts_waits_for_the_count_rows_and_places_each_block_from_them(
            cx, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev), dev,
            dict(native.module().internode.ERROR_CODES))


def test_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends():
    """The count row's push made by the launch that packs and pushes during notify (one launch fewer before the
    wire), on one GPU writing to itself: it leaves also when no record does, and without a launch."""
    with _one_rank_context(gpu_timeout_secs=1.0) as cx:
        dev = torch.device("cuda", 0)
        check_pack_and_push_during_notify_pushes_our_count_row_first_whatever_it_sends(
            cx, torch.as_tensor(_View(cx.rdma_ptr, cx.rdma_bytes), device=dev), dev)


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_outputs_also_match_with_records_packed_and_pushed_in_separate_launches(world, G):
    """UCCL_EP_PACK_AND_PUSH=0: the pack launches and push launches of before (with the push head); every other test
    here writes and pushes a hop's records in one launch."""
    _need(world)
    env = {"UCCL_EP_PACK_AND_PUSH": "0", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}
    out = run_distributed(_cases_counting, world, G, ALL[:5], ("packs_and_pushes", "pipelined_gathers"), timeout=420,
                          env=env)
    # (the pipelined gather's forwarders sum and push in pack_and_push: off with it)
    assert all(done == 5 and sum(n.values()) == 0 and gathers == 0 for done, n, gathers in out), out


def test_a_rank_whose_wait_failed_pushes_no_command_and_scatters_no_row():
    """push_chunks_kernel and scatter_rows_kernel return at once when the rank's error word is set: steps launched
    behind a failed wait used to pass stale rows on to the node's peers, which then returned them without an error
    (seen with the drains off, session 6)."""
    with _one_rank_context() as cx:
        check_a_failed_rank_sends_and_forwards_nothing(cx, native.module().internode.scatter_rows,
                                                       torch.device("cuda", 0))


@pytest.mark.parametrize("shape", FORWARD_ROW_SHAPES, ids=FORWARD_ROW_SHAPE_IDS)
def test_forward_rows_sends_each_row_to_every_gpu_that_needs_it_in_one_launch_and_checks_its_range(shape):
    """The dispatch forward's kernel (forward_rows_kernel) against a scatter per GPU, byte for byte, with its range
    check and stop flag (internode_cases.check_forward_rows_sends_each_row_to_every_gpu_that_needs_it)."""
    with _one_rank_context() as cx:
        check_forward_rows_sends_each_row_to_every_gpu_that_needs_it(cx, native.module().internode.forward_rows,
                                                                      torch.device("cuda", 0), shape)


def test_a_wait_on_more_counters_than_one_launch_carries_waits_for_each_and_names_a_late_one_in_the_last_launch():
    """wait_signals passes its (slot, expected) pairs as kernel arguments, 64 per launch: 130 pairs take three
    launches, every one is waited for, and a counter short of its target in the last launch times out, named."""
    k = native.module().internode
    with _one_rank_context(gpu_timeout_secs=0.5) as cx:
        s = torch.cuda.current_stream().cuda_stream
        cx.wait_signals([(slot, 0) for slot in range(130)], 1, s)  # every counter is 0: each wait is met
        torch.cuda.synchronize()
        assert cx.error_fields()["code"] == 0, cx.error_message()
        cx.wait_signals([(slot, 0) for slot in range(129)] + [(129, 1)], 1, s)
        torch.cuda.synchronize()
        e = cx.error_fields()
        assert (e["code"], e["slot"], e["observed"], e["expected"]) == (dict(k.ERROR_CODES)["wait_timeout"], 129, 0,
                                                                        1), cx.error_message()
        cx.clear_error()
        with pytest.raises(ValueError, match="slot 512 outside"):
            cx.wait_signals([(512, 0)], 1, s)


def _scenario(rank, world, G, which):
    nat, ref, dev = _backends(rank, world, G, rdma=2 << 20)
    try:
        return dict(past=records_past_the_partial_sums, small=area_too_small_after_a_push_during_notify,
                    worst=too_few_worst_rows, one_after=one_forwarder_of_a_node_forwards_after_the_count_read)[which](
            nat, ref, dev, rank, world)
    finally:
        nat.destroy()


@pytest.mark.parametrize("beside", ["0", "1"], ids=["barrier", "unpack-beside"])
def test_on_gpus_a_forwarder_that_forwards_after_the_count_read_meets_its_nodes_others_at_the_barrier(beside):
    """The GPU twin of the CPU test (2 x 2): rank 0's records pass the last combine's partial sums, so its forward
    goes after the count read while its node's other GPU forwards from the count rows and waits for rank 0's flag
    (and, beside, its ready words) at the same epoch; every output equals the reference."""
    _need(4)
    out = run_distributed(_scenario, 4, 2, "one_after", timeout=240,
                          env={"UCCL_EP_UNPACK_BESIDE_FORWARD": beside, "UCCL_EP_CPU_TIMEOUT_SECS": "60",
                               "UCCL_EP_GPU_TIMEOUT_SECS": "60"})
    for rank, (seen, same) in enumerate(out):
        assert same, f"rank {rank}: an output differs from the reference"
        assert seen == [(0, 0), (0, 1) if rank == 0 else (1, 0)], (rank, seen)


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2-1", "4-2"])
def test_on_gpus_records_past_the_last_combines_partial_sums_pack_after_notify_and_the_next_during_it(world, G):
    """The GPU twin of the CPU test (2 x 1 and 2 x 2): packing and pushing during notify counts on the device, in one
    pack_and_push launch; a dispatch whose records would reach the last combine's partial sums packs and pushes
    nothing then (the host, by the same rule, does it after notify), and every output equals the reference. With
    two GPUs per node the forwarders add the other sources' rows to the records' dest rows."""
    _need(world)
    out = run_distributed(_scenario, world, G, "past", timeout=240)
    for seen, same in out:
        assert same, "an output differs from the reference"
        (p0, q0), (p1, q1), (p2, q2) = seen
        assert (p1, q1) == (p0, q0) and (p2, q2) == (p1 + 1, q1 + 1), seen


def test_on_gpus_a_receive_past_num_worst_tokens_raises_naming_it_rank_or_expert_major_and_the_next_calls_match():
    """The GPU twin of the CPU test (2 x 1): rank-major and expert-major receives past num_worst_tokens raise after
    their records landed, and the next calls match the reference. With drains, as the CPU stand-in runs: each
    dispatch raises itself (without them a sync-free dispatch returns before the count read and the next call
    raises its error: test_without_drains_a_sync_free_dispatch_returns_before_the_count_read_...)."""
    _need(2)
    out = run_distributed(_scenario, 2, 1, "worst", timeout=240, env={"UCCL_EP_DRAIN_AFTER_WAITS": "always"})
    for rank, (seen, done) in enumerate(out):
        (rm_err, rm_in_step), (em_err, em_in_step) = seen
        assert "raise num_worst_tokens" in rm_err and "raise num_worst_tokens" in em_err, f"rank {rank}: {seen}"
        assert rm_in_step and em_in_step and done == 2, (rank, seen, done)


def test_on_gpus_an_area_too_small_for_records_pushed_during_notify_raises_on_every_rank_and_the_next_calls_match():
    """The GPU twin of the CPU test (2 x 1): the pack_and_push launch during notify sends nothing to the destination
    whose area overflows and still resets that destination's chunk counters (the next pack_and_push starts from
    zeros), every rank raises the same area error, and the next calls match the reference."""
    _need(2)
    out = run_distributed(_scenario, 2, 1, "small", timeout=240)
    for rank, (err, in_step, pushed, done) in enumerate(out):
        assert "dispatch receive (RDMA)" in err and "num_rdma_bytes" in err, f"rank {rank}: {err}"
        assert in_step, f"rank {rank}: the dispatch counters are not at their targets after the error"
        assert pushed == 1 and done == 1, (rank, pushed, done)


def _hinted(rank, world, G):
    return worst_routing_in_hinted_buffers(lambda nvl, rdma: _backends(rank, world, G, rdma=rdma, nvl=nvl),
                                           rank, world, G)


@pytest.mark.parametrize("world,G", TOPOLOGIES)
def test_on_gpus_every_token_to_every_rank_matches_in_buffers_of_exactly_the_hint_and_a_float32_combine_is_refused(
        world, G):
    """The GPU twin of the CPU test: in buffers of exactly Buffer.get_internode_bytes_hint (BF16 combines) every
    token sent to every rank matches the reference, rank-major, FP8 and expert-major; a float32 combine is refused
    naming the setting before any launch, and the calls after it match."""
    _need(world)
    out = run_distributed(_hinted, world, G, timeout=300, env={"UCCL_EP_CPU_TIMEOUT_SECS": "60",
                                                                "UCCL_EP_GPU_TIMEOUT_SECS": "60"})
    for done, refused in out:
        assert done == len(EVERY_RANK_CASES) + 1, done
        assert refused is not None and "area needs" in refused and "raise num_" in refused, refused


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_on_gpus_a_dispatch_reads_before_the_host_reads_the_counts_or_hands_back_and_every_output_matches(world, G):
    """The GPU twin of the CPU test (2 x 1, and 2 x 2 with the forward before the count read): after the first case
    every uncached dispatch is pushed during notify and launches its reader behind notify's wait -- with several GPUs
    per node the own records' pack, the gated forward, the node barrier and the unpack -- with its rows, gate, tables
    and own records' place from the count rows on the device; it reads (num_worst_tokens, or rows within the last
    dispatch's plus the slack) or does nothing and the host reads after notify (rank 1 after receiving nothing in the
    "empty" case). Every output equals the reference."""
    _need(world)
    cases = ALL[:4] + [ALL[7]]
    out = run_distributed(_cases_counting, world, G, cases, ("packs_and_pushes_during_notify", "reads_before_counts",
                                                              "reads_before_counts_declined", "forwards_before_counts"),
                          timeout=300,
                          env={"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"})
    for done, fused, read, declined, forwarded in out:
        assert done == len(cases) and fused == len(cases) - 1 == read + declined, (done, fused, read, declined)
        assert (forwarded >= read) if G > 1 else forwarded == 0, (read, forwarded)
    assert out[1][3] >= 1 and sum(row[2] for row in out) >= world, out



def _expert_major_reads_before_counts(rank, world, G, cases):
    nat, ref, dev = _backends(rank, world, G)
    try:
        done = compare_cases(nat, ref, dev, rank, world, cases, 1)
        return (done, nat.packs_and_pushes_during_notify, nat.reads_before_counts, nat.reads_before_counts_declined,
                nat.expert_major_reads_before_counts, nat.expert_major_receives_beside_forward)
    finally:
        nat.destroy()


@pytest.mark.parametrize("world,G,beside", [(2, 1, "0"), (4, 2, "0"), (4, 2, "1")], ids=["2x1", "2x2", "2x2-beside"])
def test_on_gpus_an_expert_major_dispatch_whose_reader_writes_the_rows_reads_before_the_count_read_and_matches(world,
                                                                                                             G, beside):
    """The GPU twin of the CPU test (2 x 1 and 2 x 2, UCCL_EP_EXPERT_MAJOR_IN_READER=always): an uncached expert-major
    dispatch pushed during notify launches its reader behind notify's wait -- gate, rows and our own rows' place from
    the count rows (with several GPUs per node after the forward before the count read, reading the final rows after
    its barrier, or with UCCL_EP_UNPACK_BESIDE_FORWARD on the second stream as its forwarders mark them), places and
    plan sizes from the same rows (expert_major_places), padding and reader told by the device words whether to run --
    into expert-major rows sized before the counts, or hands back (the skewed case). Every output, the rank-major
    dispatches' between them included, equals the reference bit for bit."""
    _need(world)
    cases = [ALL[0], ALL[6], ALL[6], ALL[9], ("dropped", False, True, 0, 10), ALL[8], ALL[1],
             ("skewed", False, True, 0, 11), ALL[6]]
    out = run_distributed(_expert_major_reads_before_counts, world, G, cases, timeout=300,
                          env={"UCCL_EP_EXPERT_MAJOR_IN_READER": "always", "UCCL_EP_CPU_TIMEOUT_SECS": "60",
                               "UCCL_EP_GPU_TIMEOUT_SECS": "60", "UCCL_EP_UNPACK_BESIDE_FORWARD": beside})
    for done, fused, read, declined, em_read, em_beside in out:
        assert done == len(cases) and fused == len(cases) - 1 >= read + declined, (done, fused, read, declined)
        assert em_read >= 2, em_read
        assert (em_beside >= em_read) if beside == "1" else em_beside == 0, (em_read, em_beside)
