"""tests/distributed.py: results come back by rank, a failing rank raises with its traceback, nothing hangs."""
from __future__ import annotations

import time

import pytest

from tests.distributed import run_distributed


def _rank_and_sum(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return rank, int(t)


def _rank_one_fails(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # the others would wait here for ever without the harness


def _sleeps(rank, world):
    time.sleep(60)


def _rank_zero_fails_while_one_polls(rank, world):
    if rank == 0:
        raise ValueError("rank zero gave up")
    for _ in range(600):  # a host wait that polls, like the internode backend's drain
        time.sleep(0.05)


def _rank_zero_fails_while_one_waits_in_gloo(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 0:
        time.sleep(1)
        raise ValueError("rank zero gave up")
    if rank == 1:
        dist.recv(torch.zeros(1), src=2)  # native wait: rank 2 never sends
    time.sleep(30)


def _rank_zero_fails_then_one_crashes(rank, world):
    import ctypes

    if rank == 0:
        time.sleep(1)
        raise ValueError("rank zero gave up")
    time.sleep(1.5)
    ctypes.string_at(0)  # SIGSEGV in native code: no traceback comes back


def test_run_distributed_returns_each_ranks_result_in_rank_order():
    assert run_distributed(_rank_and_sum, 3, timeout=60) == [(0, 6), (1, 6), (2, 6)]


def test_run_distributed_raises_with_the_failing_ranks_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 failed first(.|\n)*ValueError: rank one is broken"):
        run_distributed(_rank_one_fails, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_run_distributed_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        run_distributed(_sleeps, 2, timeout=3)
    assert time.monotonic() - start < 20


def test_a_failure_brings_back_the_state_of_the_ranks_still_running():
    with pytest.raises(RuntimeError) as exc:
        run_distributed(_rank_zero_fails_while_one_polls, 2, timeout=60)
    msg = str(exc.value)
    assert msg.startswith("rank 0 of 2 failed first") and "rank zero gave up" in msg
    assert "state of rank 1 when asked after the failure:\nno internode backend imported" in msg


def test_a_rank_stuck_in_a_native_wait_still_reports_its_state():
    with pytest.raises(RuntimeError) as exc:
        run_distributed(_rank_zero_fails_while_one_waits_in_gloo, 3, timeout=60)
    msg = str(exc.value)
    assert "rank zero gave up" in msg
    assert "state of rank 1 when asked after the failure:\nno internode backend imported" in msg
    assert "state of rank 2 when asked after the failure" in msg


def test_run_distributed_env_is_set_before_the_functions_module_is_imported():
    """CUDA fixes its module loading mode at initialization, which a test module's import can trigger
    (torch.cuda.device_count()): the env of run_distributed must already be there when fn's module loads."""
    from tests.fixtures.import_time_env import seen_at_import

    assert run_distributed(seen_at_import, 2, timeout=60, env={"UCCL_EP_TEST_IMPORT_PROBE": "on"}) == ["on", "on"]


def test_a_rank_that_crashes_after_the_failure_is_named_with_its_signal():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as exc:
        run_distributed(_rank_zero_fails_then_one_crashes, 2, timeout=60)
    msg = str(exc.value)
    assert msg.startswith("rank 0 of 2 failed first") and "rank zero gave up" in msg
    assert "rank 1 died of signal 11 (SIGSEGV) after the failure" in msg, msg
    assert time.monotonic() - start < 30
