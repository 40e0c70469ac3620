"""Loopback NIC emulation on host memory (CPU only, fast): the bandwidth cap paces delivery at bytes / cap (not much
slower: a cap that also serialized the copies behind the wire time, or started a copy only at a later poll, would
stall the internode path), and a reorder window larger than the writes in flight still drains."""
import time

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

DATA = 1 << 20


def make_pair(**kw):
    opts = dict(num_threads=1, fifos_per_thread=1, idle_backoff_us=0, timeout_secs=10.0)
    opts.update(kw)
    s = load_settings({})
    cs = [comm.HostComm(DATA, r, 2, settings=s, num_signal_slots=64, **opts) for r in range(2)]
    comm.connect_in_process(cs)
    rng = np.random.default_rng(3)
    for c in cs:
        c.data()[:] = rng.integers(0, 256, DATA, dtype=np.uint8)
    return cs


def _send(C, cs, writes, size, slot=0):
    for i in range(writes):
        off = (i * size) % (DATA // 2)
        cs[0].push(0, C.command.write_signal(1, size, off, DATA // 2 + off, slot, 1))
    cs[0].proxy.wait_done(0, cs[0].push(0, C.command.quiet()))


def _wait_signal(c, slot, want, timeout):
    deadline = time.time() + timeout
    while c.signals()[slot] < want:
        assert time.time() < deadline, f"signal {slot} is {c.signals()[slot]}, expected {want}"
        time.sleep(0.0005)


@pytest.mark.parametrize("inflight", [1, 8])
def test_a_capped_transfer_takes_about_bytes_over_the_cap(inflight):
    C = native.module()
    gbps, writes, size = 0.1, 64, 32 << 10  # 2 MiB at 100 MB/s: 21 ms on the emulated wire
    cs = make_pair(loopback_bandwidth_gbps=gbps, max_inflight_writes=inflight, max_inflight_bytes=1 << 20)
    try:
        t0 = time.perf_counter()
        _send(C, cs, writes, size)
        _wait_signal(cs[1], 0, writes, 10)
        took = time.perf_counter() - t0
        ideal = writes * size / (gbps * 1e9)
        assert took >= 0.9 * ideal, f"{took * 1e3:.1f} ms is faster than the {ideal * 1e3:.1f} ms cap"
        assert took <= 2.0 * ideal + 0.05, f"{took * 1e3:.1f} ms: the cap of {ideal * 1e3:.1f} ms stalls delivery"
    finally:
        for c in cs:
            c.close()


def test_reorder_window_above_an_inflight_cap_of_one_still_drains_promptly():
    C = native.module()
    cs = make_pair(loopback_reorder=8, max_inflight_writes=1, max_inflight_bytes=4096)
    try:
        t0 = time.perf_counter()
        _send(C, cs, 200, 4096)
        _wait_signal(cs[1], 0, 200, 10)
        assert time.perf_counter() - t0 < 2.0
    finally:
        for c in cs:
            c.close()
