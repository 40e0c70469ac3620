"""Teardown contract of the host core: stopping a proxy never silently drops writes a peer is waiting for.

A rank's call returns once *its incoming* data arrived; its own outgoing writes may still sit in its proxy (queued,
in flight, or not yet taken from the FIFO). Stopping the proxy then drops them, and the receiver, which sees a clean
close rather than an error, waits until its deadline with all but the tail of a lane: the intermittent "last chunk
of a lane never arrived" failure of the 2 x 2 internode test (docs/internode.md, "Teardown"). Here two in-process
ranks play a forwarder and a source on one GPU-style-fed FIFO each (reorder 8, one write in flight, 4 KiB writes);
``loopback_delay_us`` stands in for a device copy that waits for another CUDA context's time slice.
"""
import time

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

DATA = 1 << 16
CHUNK = 3 * 1040  # three 1040-byte combine records (H=256 fp32 + 4 weights): one 4 KiB-capped write
SEND_SLOT, BACK_SLOT = 71, 72  # the lane counter at the receiver, and the one the sender waits on
CHUNKS_OUT, CHUNKS_IN = 9, 1  # the forwarder sends more than it receives


def _pair(delay_us):
    opts = dict(num_threads=1, fifos_per_thread=2, idle_backoff_us=0, timeout_secs=5.0, loopback_reorder=8,
                max_inflight_writes=1, max_inflight_bytes=4096, loopback_delay_us=delay_us)
    cs = [comm.HostComm(DATA, r, 2, settings=load_settings({}), num_signal_slots=128, **opts) for r in range(2)]
    comm.connect_in_process(cs)
    return cs


def _network_hop(C, cs):
    """Both ranks push their chunks as push_chunks_kernel does; rank 0 then waits for its own incoming counter only,
    which is all a combine waits for before it returns."""
    for i in range(CHUNKS_OUT):
        cs[0].proxy.fifo_push_as_device(0, C.command.write_signal(1, CHUNK, i * CHUNK, 32768 + i * CHUNK, SEND_SLOT, 3))
    for i in range(CHUNKS_IN):
        cs[1].proxy.fifo_push_as_device(0, C.command.write_signal(0, CHUNK, i * CHUNK, 32768 + i * CHUNK, BACK_SLOT, 3))
    cs[0].wait_signal(BACK_SLOT, 3 * CHUNKS_IN)


def _receiver_sees(cs, timeout):
    deadline = time.time() + timeout
    while cs[1].signals()[SEND_SLOT] < 3 * CHUNKS_OUT and time.time() < deadline:
        time.sleep(0.001)
    return int(cs[1].signals()[SEND_SLOT])


def test_close_delivers_every_write_before_it_stops_the_proxy():
    """Every chunk's counter and bytes: the receiver gets the sender's random bytes, not just the signals."""
    C = native.module()
    cs = _pair(delay_us=20_000)
    rng = np.random.default_rng(7)
    try:
        for c in cs:
            c.data()[:] = rng.integers(0, 256, DATA, dtype=np.uint8)
        sent = cs[0].data()[:CHUNKS_OUT * CHUNK].copy()  # (the sender's buffer goes with its close)
        _network_hop(C, cs)
        cs[0].close()
        assert _receiver_sees(cs, timeout=2.0) == 3 * CHUNKS_OUT
        assert not cs[1].proxy.failed
        assert np.array_equal(cs[1].data()[32768:32768 + CHUNKS_OUT * CHUNK], sent)
    finally:
        for c in cs:
            c.close()


def test_a_stop_without_delivery_loses_whole_chunks_silently_at_the_receiver_and_says_so_at_the_sender(capfd):
    """The failure's signature on the receiving side (nothing failed, nothing held for order, whole chunks missing),
    and the line the stopped proxy now prints where the cause is."""
    C = native.module()
    cs = _pair(delay_us=20_000)
    try:
        _network_hop(C, cs)
        cs[0].close(deliver=False)
        seen = _receiver_sees(cs, timeout=1.0)
        assert seen < 3 * CHUNKS_OUT and seen % 3 == 0, seen
        assert not cs[1].proxy.failed
        assert cs[1].stats()[0]["max_reorder_held"] == 0
        err = capfd.readouterr().err
        assert "stopped with" in err and "dropped" in err, err
    finally:
        for c in cs:
            c.close()


def test_a_lanes_last_write_is_released_by_the_reorder_emulation_without_any_later_post():
    """Ruled out as the cause: with reorder 8 and one write in flight, a lone last write completes on the next poll
    and the receiver holds nothing for order."""
    C = native.module()
    cs = _pair(delay_us=0)
    try:
        for n in range(1, 6):
            cs[0].proxy.fifo_push_as_device(0, C.command.write_signal(1, CHUNK, 0, 32768, SEND_SLOT, 3))
            cs[1].wait_signal(SEND_SLOT, 3 * n, 2.0)
        cs[0].wait_idle(2.0)
        assert cs[1].stats()[0]["max_reorder_held"] == 0
    finally:
        for c in cs:
            c.close()
