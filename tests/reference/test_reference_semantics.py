"""uccl_ep_train.reference against an independent oracle (tests/reference/ep_oracle.py), in gloo groups that simulate
1 node x 4 ranks, 2 nodes x 2 ranks and 4 nodes x 2 ranks.

One process group per topology runs every check (start-up is the expensive part); each test below asserts the outcome
of one named check on every rank.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import ep_oracle as oracle
from tests.reference.check_group import checks_in, expect, outcomes_fixture, run_named, soft

TOPOLOGIES = {"1x4": (4, 4), "2x2": (4, 2), "4x2": (8, 2)}  # name -> (ranks, ranks per node)
NUM_EXPERTS, NUM_TOPK, HIDDEN = 16, 3, 256


def _inputs(kind: str, rank: int, world: int, dtype=torch.bfloat16, seed: int = 0):
    return oracle.make_inputs(kind, rank, world, NUM_EXPERTS, NUM_TOPK, HIDDEN, dtype, seed, 7919 * rank + seed)


def _assert_rows(got: torch.Tensor, rows: list, what: str):
    want = torch.stack(rows) if rows else got.new_zeros((0,) + tuple(got.shape[1:]))
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want.to(got.dtype)), f"{what}: values differ"


# ---------------------------------------------------------------------------------------------------------- checks
# Each check asserts inside `soft(...)` after its collectives (tests/reference/check_group.py says why).

def check_layout(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
        with soft(kind):
            per_rank, per_node, per_expert, in_rank = ref.get_dispatch_layout(topk, NUM_EXPERTS, world, g)
            e_rank, e_node, e_expert, e_in_rank = oracle.expected_layout(wld, rank)
            assert per_rank.dtype == torch.int32 and per_rank.tolist() == e_rank
            assert per_expert.tolist() == e_expert
            assert torch.equal(in_rank, e_in_rank)
            if world // g == 1:
                assert per_node is None, "single node must report num_tokens_per_rdma_rank=None"
            else:
                assert per_node.tolist() == e_node


def check_rank_major_receive(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        for alignment in (1, 3):
            x, topk, w = _inputs(kind, rank, world)
            wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
            res = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g, expert_alignment=alignment)
            with soft(f"{kind}/alignment={alignment}"):
                exp = oracle.expected_receive(wld, rank)
                _assert_rows(res.recv_x, exp["x"], "recv_x")
                assert res.recv_topk_idx.tolist() == exp["topk"], "recv_topk_idx"
                assert res.recv_topk_weights.tolist() == exp["weights"], "recv_topk_weights"
                got_src = list(zip(res.handle.recv_src_rank.tolist(), res.handle.recv_src_idx.tolist()))
                assert got_src == exp["src"], "order must be by source rank, then source token"
                counts = [0] * (NUM_EXPERTS // world)
                for ids in exp["topk"]:
                    for i in ids:
                        if i >= 0:
                            counts[i] += 1
                assert res.num_recv_tokens_per_expert_list == [-(-c // alignment) * alignment for c in counts]


def check_combine(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world, dtype=torch.float32)
        wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
        res = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        out = ref.combine(res.recv_x * (rank + 1), res.handle, res.recv_topk_weights)
        with soft(kind):
            want_x, want_w = oracle.expected_combine(wld, rank, lambda d, e: d + 1)
            assert out.combined_x.dtype == torch.float32
            torch.testing.assert_close(out.combined_x.double(), want_x, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(out.combined_topk_weights.double(), want_w, rtol=0, atol=0)


def check_round_trip(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        res = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        out = ref.combine(res.recv_x, res.handle)
        with soft(kind):
            experts_per_rank = NUM_EXPERTS // world
            distinct = torch.tensor([len({e // experts_per_rank for e in row if e >= 0}) for row in topk.tolist()],
                                    dtype=torch.float64)
            want = (x.double() * distinct[:, None]).to(torch.bfloat16)
            assert out.combined_x.dtype == torch.bfloat16 and torch.equal(out.combined_x, want)
            assert out.combined_topk_weights is None


def check_cached_mode(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        first = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        fresh = ref.dispatch(x2, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        cached = ref.dispatch(x2, handle=first.handle)
        with soft(kind):
            assert torch.equal(cached.recv_x, fresh.recv_x)
            assert cached.recv_topk_idx is None and cached.num_recv_tokens_per_expert_list is None
            assert cached.handle is first.handle


def check_num_worst_tokens(rank, world, g):
    from uccl_ep_train import reference as ref
    worst = 128
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        plain = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        padded = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g, num_worst_tokens=worst)
        back_padded = ref.combine(padded.recv_x, padded.handle).combined_x
        back_plain = ref.combine(plain.recv_x, plain.handle).combined_x
        with soft(kind):
            n = plain.recv_x.size(0)
            assert padded.recv_x.shape == (worst, HIDDEN) and padded.num_recv_tokens_per_expert_list == []
            assert torch.equal(padded.recv_x[:n], plain.recv_x) and not padded.recv_x[n:].any()
            assert (padded.recv_topk_idx[n:] == -1).all() and not padded.recv_topk_weights[n:].any()
            assert padded.handle.num_recv_tokens_per_expert.tolist() == plain.num_recv_tokens_per_expert_list
            assert torch.equal(back_padded, back_plain)
    # Every rank receives 2 tokens from every rank here, so every rank raises (the group stays in step).
    topk = torch.stack([torch.tensor([r * (NUM_EXPERTS // world), -1, -1]) for r in range(world)] * 2)
    x = torch.randn(topk.size(0), HIDDEN).to(torch.bfloat16)
    with soft("overflow"):
        try:
            ref.dispatch(x, topk, None, num_experts=NUM_EXPERTS, ranks_per_node=g, num_worst_tokens=1)
        except RuntimeError as exc:
            assert "num_worst_tokens=1" in str(exc) and "raise num_worst_tokens" in str(exc), str(exc)
        else:
            raise AssertionError("too small num_worst_tokens must raise")


def check_fp8_passthrough(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in ("random", "drops"):
        x, topk, w = _inputs(kind, rank, world, dtype=torch.float32)
        x_fp8 = x.to(torch.float8_e4m3fn)
        scales = torch.rand(x.size(0), HIDDEN // 128) + 0.5
        wld = oracle.gather_world(x_fp8, topk, w, NUM_EXPERTS, g, x_scales=scales)
        res = ref.dispatch(x_fp8, topk, w, num_experts=NUM_EXPERTS, x_scales=scales, ranks_per_node=g)
        cached = ref.dispatch(x_fp8, x_scales=scales, handle=res.handle)
        with soft(kind):
            exp = oracle.expected_receive(wld, rank)
            assert res.recv_x.dtype == torch.float8_e4m3fn
            _assert_rows(res.recv_x.view(torch.uint8), [r.view(torch.uint8) for r in exp["x"]], "fp8 bits")
            _assert_rows(res.recv_x_scales, exp["scales"], "fp8 scales")
            assert torch.equal(cached.recv_x.view(torch.uint8), res.recv_x.view(torch.uint8))
            assert torch.equal(cached.recv_x_scales, res.recv_x_scales)


def check_expert_major(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        for alignment, worst in ((1, 0), (4, 0), (4, 320)):
            x, topk, w = _inputs(kind, rank, world, dtype=torch.float32)
            wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
            res = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g, expert_major=True,
                               expert_alignment=alignment, num_worst_tokens=worst)
            y = res.recv_x * ((rank + 1) * (res.recv_topk_idx.clamp(min=0) + 1))[:, None]
            out = ref.combine(y, res.handle, res.recv_topk_weights)
            cached = ref.dispatch(x * 2, handle=res.handle)
            with soft(f"{kind}/alignment={alignment}/worst={worst}"):
                exp = oracle.expected_expert_major(wld, rank, alignment)
                rows = len(exp["x"])
                if worst:
                    assert res.recv_x.size(0) == worst and not res.recv_x[rows:].any()
                    assert (res.recv_topk_idx[rows:] == -1).all() and res.num_recv_tokens_per_expert_list == []
                else:
                    assert res.num_recv_tokens_per_expert_list == exp["counts"]
                _assert_rows(res.recv_x[:rows], exp["x"], "expert-major x")
                assert res.recv_topk_idx[:rows].tolist() == exp["expert"], "experts"
                assert res.recv_topk_weights[:rows].tolist() == exp["weights"], "weights"
                want_x, want_w = oracle.expected_combine(wld, rank, lambda d, e: (d + 1) * (e + 1), expert_major=True)
                torch.testing.assert_close(out.combined_x.double(), want_x, rtol=1e-6, atol=1e-4)
                torch.testing.assert_close(out.combined_topk_weights.double(), want_w, rtol=0, atol=0)
                assert torch.equal(cached.recv_x, res.recv_x * 2)


def check_traffic(rank, world, g):
    from uccl_ep_train import reference as ref
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
        res = ref.dispatch(x, topk, w, num_experts=NUM_EXPERTS, ranks_per_node=g)
        back = ref.combine(res.recv_x.float(), res.handle)
        with soft(kind):
            want = oracle.expected_traffic(wld, rank, HIDDEN * 2, HIDDEN * 4)
            got_d, got_c = res.traffic, back.traffic
            assert (got_d.nvlink_bytes, got_d.network_bytes, got_d.logical_bytes) == want["dispatch"]
            assert (got_c.nvlink_bytes, got_c.network_bytes, got_c.logical_bytes) == want["combine"]
            if world == g:
                assert got_d.network_bytes == 0 and got_c.network_bytes == 0


def check_gradients(rank, world, g):
    """Reference autograd (each rank backpropagates its own loss through the collectives) vs autograd of a
    single-process formulation over the gathered global inputs whose loss is the sum of every rank's loss."""
    from uccl_ep_train import reference as ref
    per, alignment = NUM_EXPERTS // world, 2

    def cot(r, shape, tag):  # fixed cotangents, reproducible on every rank
        return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * r + tag), dtype=torch.float64)

    for kind in oracle.ROUTINGS:
        for expert_major in (False, True):
            x, topk, w = _inputs(kind, rank, world, dtype=torch.float32)
            wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)

            xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            res = ref.dispatch_with_grad(xl, topk, wl, num_experts=NUM_EXPERTS, ranks_per_node=g,
                                         expert_major=expert_major, expert_alignment=alignment)
            rw = res.recv_topk_weights
            y = res.recv_x * ((rw[:, None] if expert_major else rw.sum(1, keepdim=True)) + 1.0)
            cx, cw = ref.combine_with_grad(y, res.handle, rw * 3.0)
            loss = ((res.recv_x.double() * cot(rank, res.recv_x.shape, 1)).sum()
                    + (cx.double() * cot(rank, cx.shape, 2)).sum() + (cw.double() * cot(rank, cw.shape, 3)).sum())
            loss.backward()
            with soft(f"{kind} expert_major={expert_major}"):
                _check_gradients_against_oracle(wld, rank, world, xl, wl, expert_major, per, alignment, cot)


def _check_gradients_against_oracle(wld, rank, world, xl, wl, expert_major, per, alignment, cot):
    """Autograd of the same losses over every rank's inputs as leaves, routed with Python loops."""
    gx = [t.double().requires_grad_(True) for t in wld.xs]
    gw = [t.double().requires_grad_(True) for t in wld.weights]
    combined = [torch.zeros(t.shape, dtype=torch.float64) for t in wld.xs]
    combined_w = [torch.zeros(t.shape, dtype=torch.float64) for t in wld.weights]
    total = 0.0
    for d in range(world):
        # (source rank, token, slots) in rank d's received order; None = padding row.
        pairs = [(s, t, [k for k, e in enumerate(wld.topks[s][t].tolist()) if e >= 0 and e // per == d])
                 for s in range(world) for t in range(wld.xs[s].size(0))]
        pairs = [p for p in pairs if p[2]]
        if expert_major:
            rows = []
            for e in range(per):
                seg = [(s, t, [k]) for s, t, slots in pairs for k in slots
                       if int(wld.topks[s][t, k]) % per == e]
                rows += seg + [None] * (-len(seg) % alignment)
        else:
            rows = pairs
        c1 = cot(d, (len(rows), HIDDEN), 1)
        for i, row in enumerate(rows):
            if row is None:
                continue
            s, t, slots = row
            weight = sum(gw[s][t, k] for k in slots)
            total = total + (gx[s][t] * c1[i]).sum()
            combined[s][t] = combined[s][t] + gx[s][t] * (weight + 1.0)
            for k in slots:
                combined_w[s][t, k] = combined_w[s][t, k] + gw[s][t, k] * 3.0
    for s in range(world):
        total = total + (combined[s] * cot(s, combined[s].shape, 2)).sum()
        total = total + (combined_w[s] * cot(s, combined_w[s].shape, 3)).sum()
    total.backward()
    for got, leaf in ((xl.grad, gx[rank]), (wl.grad, gw[rank])):
        want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)  # a rank with no tokens
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


CHECKS = checks_in(globals())


def run_checks(rank, world, g):
    torch.manual_seed(rank)
    return run_named(CHECKS, rank, world, g)


outcomes = outcomes_fixture(run_checks, TOPOLOGIES)


def test_layout_counts_tokens_per_rank_node_and_expert(outcomes):
    expect(outcomes, "layout")


def test_dispatch_delivers_each_token_once_per_rank_ordered_by_source_rank_then_token(outcomes):
    expect(outcomes, "rank_major_receive")


def test_combine_sums_copies_from_every_destination_rank_and_their_weights(outcomes):
    expect(outcomes, "combine")


def test_round_trip_returns_x_times_number_of_destination_ranks(outcomes):
    expect(outcomes, "round_trip")


def test_cached_dispatch_reuses_routing_for_new_payload(outcomes):
    expect(outcomes, "cached_mode")


def test_num_worst_tokens_pads_outputs_and_rejects_overflow(outcomes):
    expect(outcomes, "num_worst_tokens")


def test_fp8_payload_and_scales_pass_through_bit_exact(outcomes):
    expect(outcomes, "fp8_passthrough")


def test_expert_major_layout_groups_pairs_by_expert_with_alignment_and_combines_back(outcomes):
    expect(outcomes, "expert_major")


def test_hierarchical_traffic_counts_network_once_per_node_and_nvlink_forwarding(outcomes):
    expect(outcomes, "traffic")


def test_gradients_match_autograd_of_independent_all_to_all_formulation(outcomes):
    expect(outcomes, "gradients")


def test_count_ids_equals_bincount_of_the_in_range_ids_and_never_reads_back_to_the_host():
    """count_ids replaces bincount and boolean-mask gathers where the GPU must not be waited for (the layout and the
    notify row of the internode backend): same counts, out-of-range and dropped ids (-1) counted nowhere, and no
    data-dependent output size (torch.bincount on a GPU reads the maximum back to size its output)."""
    from uccl_ep_train.reference import count_ids

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 40, (257, 8), generator=g)  # -1: dropped; 32..39: beyond the 32 bins
    ids[:20] = 5  # skewed: one id dominates
    kept = ids[(ids >= 0) & (ids < 32)]
    assert torch.equal(count_ids(ids, 32), torch.bincount(kept, minlength=32))
    assert count_ids(torch.full((4, 2), -1), 7).tolist() == [0] * 7  # everything dropped
    assert count_ids(ids, 32).dtype == torch.int64 and count_ids(ids, 32).shape == (32,)
    # No host read: on "meta" tensors (shapes, no data) every op whose output depends on the values fails, as
    # bincount and a boolean mask do; count_ids runs there
    meta = ids.to("meta")
    assert count_ids(meta, 32).shape == (32,)
    with pytest.raises(NotImplementedError):
        torch.bincount(meta.reshape(-1).clamp(min=0), minlength=32)
    with pytest.raises(NotImplementedError):
        meta[meta >= 0]
