"""Which internode GPU cases a machine runs (internode_cases.gpu_sharing_skip_reason): the rule that decides, on the
CPU, so that a GPU machine without MPS skips the time-sliced cases with a reason instead of stalling in them."""
from __future__ import annotations

from internode_cases import gpu_sharing_skip_reason


def test_a_gpu_per_rank_runs_every_case_whatever_mps_says():
    for mps in (True, False, None):
        assert gpu_sharing_skip_reason(2, 2, 2, {}, mps) is None
        assert gpu_sharing_skip_reason(4, 4, 2, {}, mps) is None


def test_two_ranks_per_gpu_run_under_mps_and_where_the_driver_cannot_say():
    assert gpu_sharing_skip_reason(4, 2, 2, {}, True) is None
    assert gpu_sharing_skip_reason(4, 2, 2, {}, None) is None


def test_time_sliced_ranks_are_skipped_naming_mps_unless_asked_for():
    """2 x 2 on 2x H200 without MPS stalled in 8 cases in session 50; UCCL_EP_TEST_TIME_SLICED=1 still runs them."""
    reason = gpu_sharing_skip_reason(4, 2, 2, {}, False)
    assert reason is not None and "time-sliced" in reason and "internode_mps" in reason
    assert "UCCL_EP_TEST_TIME_SLICED=1" in reason
    assert gpu_sharing_skip_reason(4, 2, 2, {"UCCL_EP_TEST_TIME_SLICED": "1"}, False) is None
    assert gpu_sharing_skip_reason(4, 2, 2, {"UCCL_EP_TEST_TIME_SLICED": "0"}, False) == reason


def test_one_gpu_hosts_ranks_only_when_sharing_is_asked_for_and_at_most_the_cap_per_gpu():
    share = {"UCCL_EP_TEST_SHARE_GPU": "1"}
    assert "needs 2 GPUs" in gpu_sharing_skip_reason(2, 1, 2, {}, True)
    assert gpu_sharing_skip_reason(2, 1, 2, share, True) is None
    assert "more than 2 on one" in gpu_sharing_skip_reason(4, 1, 2, share, True)
    assert gpu_sharing_skip_reason(4, 1, 2, {**share, "UCCL_EP_TEST_MAX_RANKS_PER_GPU": "4"}, True) is None
    # the cap is checked before MPS: a crowded GPU is named for its crowding, not for time-slicing
    assert "UCCL_EP_TEST_MAX_RANKS_PER_GPU" in gpu_sharing_skip_reason(4, 1, 2, share, False)
    assert "time-sliced" in gpu_sharing_skip_reason(2, 1, 2, share, False)
    assert gpu_sharing_skip_reason(2, 0, 2, share, None).startswith("needs 2 GPUs")
