"""How many rows UCCLTokenDispatcher receives per rank in sync-free mode (megatron/dispatcher.py, sync_free_rows):
the user's UCCL_EP_NUM_WORST_TOKENS, else the worst case, bounded by the expert capacity where Megatron's router
drops tokens over it (moe_expert_capacity_factor)."""
import math

import pytest

pytest.importorskip("megatron.core")

from uccl_ep_train.megatron.dispatcher import sync_free_rows  # noqa: E402

# DeepSeek-V3 shape on EP 2: 4096 tokens, top-8 of 256 experts, 128 local experts per rank
DSV3 = dict(num_tokens=4096, comm_size=2, topk=8, num_experts=256, num_local_experts=128)


def test_without_a_capacity_factor_it_is_every_token_of_every_rank_per_rank_or_per_local_expert():
    assert sync_free_rows(**DSV3, expert_major=False) == 4096 * 2
    assert sync_free_rows(**DSV3, expert_major=True) == 4096 * 2 * 8
    # a token picks at most as many local experts as the rank has
    assert sync_free_rows(16, 4, 4, 8, 2, expert_major=True) == 16 * 4 * 2


def test_the_routers_capacity_bounds_the_rows_at_local_experts_x_ranks_x_capacity():
    # capacity = ceil(4096 x 8 / 256 x 1.0) = 128 tokens per expert from each rank: 128 x 2 x 128 (token, local
    # expert) pairs, half the expert-major worst case; rank-major keeps its smaller worst case
    assert sync_free_rows(**DSV3, expert_major=True, capacity_factor=1.0) == 128 * 2 * 128 == 32768
    assert sync_free_rows(**DSV3, expert_major=False, capacity_factor=1.0) == 4096 * 2
    capacity = math.ceil(4096 * 8 / 256 * 1.1)
    assert sync_free_rows(**DSV3, expert_major=True, capacity_factor=1.1) == 128 * 2 * capacity
    # a small factor bounds rank-major rows too: capacity 13 -> 128 x 2 x 13 rows < 4096 x 2
    assert sync_free_rows(**DSV3, expert_major=False, capacity_factor=0.1) == 128 * 2 * 13


def test_a_capacity_past_the_worst_case_or_the_tokens_leaves_the_worst_case():
    # factor 100: capacity 12800 > 4096 tokens, so an expert takes at most every token: no smaller than the worst case
    assert sync_free_rows(**DSV3, expert_major=True, capacity_factor=100.0) == 4096 * 2 * 8
    assert sync_free_rows(**DSV3, expert_major=False, capacity_factor=100.0) == 4096 * 2


def test_the_users_setting_wins_and_a_zero_capacity_still_receives_one_row():
    assert sync_free_rows(**DSV3, expert_major=True, capacity_factor=1.0, asked=36000) == 36000
    assert sync_free_rows(**DSV3, expert_major=False, asked=5) == 5
    # factor 0: the router keeps nothing, but a sync-free dispatch needs num_worst_tokens > 0
    assert sync_free_rows(**DSV3, expert_major=True, capacity_factor=0.0) == 1
