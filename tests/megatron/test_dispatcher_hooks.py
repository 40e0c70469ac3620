"""UCCLTokenDispatcher's six hooks in gloo groups on CPU, reference backend, against a communication-free oracle.

Megatron's own MoEAlltoAllTokenDispatcher cannot be the oracle here: its constructor creates a CUDA stream. The
oracle (tests/megatron/hook_cases.py) computes every token's output from every expert's weights locally, which is
what an all-to-all formulation computes, without any of the code under test. Megatron's real MoELayer is compared
against its allgather dispatcher, which does run on CPU.

Cases of one world size share one process group (importing Megatron in every child dominates the run time).
"""
from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron import hook_cases

pytest.importorskip("uccl_ep_train.buffer")

EXACT = 1e-5
MOELAYER = dict(ep=2, num_experts=4, topk=2, tokens=8, hidden=16)
# Sync-free mode hands Megatron's SequentialMLP (the local spec's experts) fixed-size rows, padding included
MOELAYER_SYNC_FREE = {
    f"moelayer_sync_free_{order}": ("moelayer_case", dict(MOELAYER, uccl_env={
        "UCCL_EP_SYNC_FREE": "1", "UCCL_EP_EXPERT_MAJOR": "1" if order == "expert_major" else "0"}))
    for order in ("expert_major", "local_permute")}
# ... and with Megatron's router dropping tokens over capacity (factor 0.5: 2 per expert from each rank), the rows
# sized by that capacity
MOELAYER_SYNC_FREE["moelayer_sync_free_capacity"] = ("moelayer_case", dict(
    MOELAYER, capacity_factor=0.5, uccl_env={"UCCL_EP_SYNC_FREE": "1", "UCCL_EP_EXPERT_MAJOR": "1"}))
TWO_RANKS = dict(hook_cases.hook_cases(2), moelayer=("moelayer_case", MOELAYER), **MOELAYER_SYNC_FREE)
FOUR_RANKS = hook_cases.four_rank_cases()


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(hook_cases.many_cases, 2, TWO_RANKS, timeout=300)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(hook_cases.many_cases, 4, FOUR_RANKS, timeout=300)


def _assert_matches_oracle(per_rank, name, tol=EXACT):
    for rank, results in enumerate(per_rank):
        r = results[name]
        assert r["out"] < tol and r["grad_x"] < tol and r["grad_probs"] < tol, (name, rank, r)


def test_output_equals_input_with_identity_experts_and_probs_summing_to_one(two_ranks):
    for results in two_ranks:
        assert results["identity"]["identity_err"] < EXACT
    _assert_matches_oracle(two_ranks, "identity")


@pytest.mark.parametrize("name", ["expert_major", "local_permute"])
def test_output_and_gradients_to_hidden_and_probs_match_the_oracle(two_ranks, name):
    _assert_matches_oracle(two_ranks, name)
    assert all(results[name]["received"] > 0 for results in two_ranks)
    assert all(results[name]["expert_major"] is (name == "expert_major") for results in two_ranks)


@pytest.mark.parametrize("name", ["sync_free_expert_major", "sync_free_local_permute"])
def test_sync_free_mode_with_a_rank_receiving_nothing_matches_the_oracle(two_ranks, name):
    _assert_matches_oracle(two_ranks, name)
    # "skewed" routes every token to the first half of the experts: rank 1 receives nothing, and still hands its
    # experts the fixed number of rows (all padding), as every rank does in sync-free mode
    kw = TWO_RANKS[name][1]
    E, K, T, world = kw["num_experts"], kw["topk"], kw["tokens"], 2
    seed = kw.get("seed", 7)  # hooks_case's default seed; its routing of rank r uses seed * 17 + r
    routed = sum(hook_cases.routing(T, E, K, seed * 17 + r, "skewed")[0] for r in range(world))
    assert [r for r in range(world) if not routed[:, r * E // world:(r + 1) * E // world].any()] == [1]
    per_token = min(K, E // world) if name.endswith("expert_major") else K
    assert all(results[name]["received"] == T * world * per_token for results in two_ranks), two_ranks


@pytest.mark.parametrize("name", ["sync_free_capacity_expert_major", "sync_free_capacity_local_permute"])
def test_sync_free_rows_shrink_to_the_routers_expert_capacity_and_outputs_still_match_the_oracle(two_ranks, name):
    # Megatron's token dropping at factor 0.5 keeps 2 tokens per expert from each rank: 8 rows per rank
    # expert-major (2 local experts x 2 ranks x 2) instead of the worst case's 32, and the oracle still holds
    _assert_matches_oracle(two_ranks, name)
    kw = TWO_RANKS[name][1]
    rows = hook_cases.capacity_bound_rows(kw, 2)
    worst = kw["tokens"] * 2 * kw["topk"]  # the worst case either way here (top-2 = the 2 local experts)
    assert rows < worst
    assert all(results[name]["received"] == rows for results in two_ranks), (rows, two_ranks)


def test_fp8_dispatch_stays_within_fp8_rounding_of_the_oracle(two_ranks):
    for results in two_ranks:
        r = results["fp8"]
        assert 0 < r["out_rel"] < 0.08, r  # e4m3 keeps 3 mantissa bits: a few percent, and never exact
        assert r["grad_probs_rel"] < 0.08, r


def test_megatron_moelayer_with_uccl_matches_allgather_dispatcher_on_cpu(two_ranks):
    for results in two_ranks:
        r = results["moelayer"]
        assert r["uccl"] == "UCCLTokenDispatcher"
        assert r["out_norm"] > 0
        assert r["out"] < EXACT and r["grad_x"] < EXACT and r["grad_params"] < EXACT, r


@pytest.mark.parametrize("name", sorted(MOELAYER_SYNC_FREE))
def test_megatron_sequential_mlp_takes_sync_free_rows_and_matches_the_allgather_dispatcher(two_ranks, name):
    # The padding rows are counted in the last local expert so that SequentialMLP's torch.split accepts the rows
    # (it raised before); they hold zeros and no combine reads them, so outputs and gradients stay exact
    for results in two_ranks:
        r = results[name]
        assert r["uccl"] == "UCCLTokenDispatcher"
        assert r["out_norm"] > 0
        assert r["out"] < EXACT and r["grad_x"] < EXACT and r["grad_params"] < EXACT, (name, r)


def test_megatron_router_dropping_over_capacity_sizes_the_sync_free_rows_and_matches_the_allgather_dispatcher(
        two_ranks):
    # 8 tokens x top-2 over 4 experts at factor 0.5: capacity 2 per expert from each rank, so 2 local experts x 2
    # ranks x 2 = 8 rows per rank (the worst case: 8 x 2 x 2 = 32), and Megatron's own router did the dropping
    for results in two_ranks:
        r = results["moelayer_sync_free_capacity"]
        assert r["uccl_num_worst_tokens"] == [8], r
        assert results["moelayer_sync_free_expert_major"]["uccl_num_worst_tokens"] == [32]  # no factor: worst case
        assert r["out_norm"] > 0
        assert r["out"] < EXACT and r["grad_x"] < EXACT and r["grad_params"] < EXACT, r


def test_four_ranks_with_router_dropped_slots_match_the_oracle(four_ranks):
    _assert_matches_oracle(four_ranks, "dropped")


def test_expert_tensor_parallel_partial_sums_are_combined_over_the_tp_ep_group(four_ranks):
    # EP 2 x expert-TP 2: every TP rank of the destination receives the token and returns a partial sum.
    _assert_matches_oracle(four_ranks, "expert_tp")
