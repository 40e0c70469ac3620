"""Timeouts raised by the host core through HostComm end with doctor.TIMEOUT_HINT; other failures do not."""
from __future__ import annotations

import pytest

from uccl_ep_train import comm, native
from uccl_ep_train.doctor import TIMEOUT_HINT
from uccl_ep_train.settings import load_settings

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")


def _comm(world=1, rank=0, **env):
    base = {"UCCL_EP_TRANSPORT": "loopback", "UCCL_EP_NUM_PROXY_THREADS": "1", "UCCL_EP_FIFOS_PER_THREAD": "1"}
    return comm.HostComm(1 << 12, rank, world, settings=load_settings(base | env))


def test_wait_signal_timeout_ends_with_hint_and_names_slot():
    with _comm() as c:
        comm.connect_in_process([c])
        with pytest.raises(TimeoutError) as e:
            c.wait_signal(3, 1, timeout_secs=0.05)
    msg = str(e.value)
    assert msg.endswith(TIMEOUT_HINT) and "signal slot 3 is 0, expected >= 1" in msg


def test_push_into_a_full_ring_times_out_with_hint():
    c = comm.HostComm(1 << 12, 0, 1, settings=load_settings({"UCCL_EP_TRANSPORT": "loopback",
                                                             "UCCL_EP_NUM_PROXY_THREADS": "1",
                                                             "UCCL_EP_FIFOS_PER_THREAD": "1",
                                                             "UCCL_EP_CPU_TIMEOUT_SECS": "0.2"}), fifo_depth=4)
    cmd = native.module().command.write(0, 16, 0, 0)
    with pytest.raises(TimeoutError) as e:  # never started: nothing drains the ring
        for _ in range(5):
            c.push(0, cmd)
    assert str(e.value).endswith(TIMEOUT_HINT)
    c.close()


def test_watchdog_proxy_error_ends_with_hint():
    a, b = (_comm(2, r, UCCL_EP_CPU_TIMEOUT_SECS="0.3") for r in range(2))
    infos = [a.local_infos(), b.local_infos()]
    a.connect_infos(infos)
    b.connect_infos(infos)
    a.start()  # rank 1 never runs: rank 0's barrier waits until its watchdog fires
    a.push(0, native.module().command.barrier())
    with pytest.raises(native.module().ProxyError) as e:
        a.wait_idle(10)
    assert a.proxy.timed_out
    msg = str(e.value)
    assert msg.endswith(TIMEOUT_HINT) and "barrier epoch 0 has 0 of 1 ranks" in msg and msg.count(TIMEOUT_HINT) == 1
    with pytest.raises(native.module().ProxyError) as again:
        a.check()
    assert str(again.value).endswith(TIMEOUT_HINT)
    a.close()
    b.close()


def test_malformed_command_error_carries_no_timeout_hint():
    with _comm() as c:
        comm.connect_in_process([c])
        c.push(0, native.module().command.write(5, 16, 0, 0))  # rank 5 in a world of 1
        with pytest.raises(native.module().ProxyError) as e:
            c.wait_idle(10)
    assert "dst_rank 5 >= world size 1" in str(e.value) and TIMEOUT_HINT not in str(e.value)
    assert not c.proxy.timed_out
