"""The loopback transport moves the adjacent writes of one post as one copy, and still completes each write on its
own: every byte lands where its write said, and every signal is counted (host memory here; the device copies take the
same path, through one cudaMemcpyAsync and one event, on the GPU machine), whether the proxy thread copies or a copy
agent process does."""
import os
import re

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

DATA = 1 << 16
HALF = DATA // 2


def _unstarted(copier="proxy", **kw):
    """One rank writing to itself, its proxy not started yet: every command pushed is taken in the first round and
    posted as one chain. ``copier``: who moves the bytes, the proxy thread or a copy agent process
    (UCCL_EP_LOOPBACK_COPY_AGENT)."""
    env = {"UCCL_EP_LOOPBACK_COPY_AGENT": "on" if copier == "agent" else "off"}
    c = comm.HostComm(DATA, 0, 1, settings=load_settings(env), num_signal_slots=64, num_threads=1,
                      fifos_per_thread=1, idle_backoff_us=20, timeout_secs=5.0, **kw)
    c.connect_infos([c.local_infos()])
    native.module().unlink_shared_host_memory_names()
    c.data()[:HALF] = np.random.default_rng(7).integers(0, 256, HALF, dtype=np.uint8)
    c.data()[HALF:] = 0
    return c


def _copies_and_writes(c):
    m = re.search(r"(\d+) copies for (\d+) writes", c.proxy.describe())
    assert m, c.proxy.describe()
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("copier", ["proxy", "agent"])
@pytest.mark.parametrize("reorder", [0, 4])
def test_adjacent_writes_of_one_post_move_as_one_copy_and_each_still_lands_and_signals(reorder, copier):
    C = native.module()
    c = _unstarted(copier, loopback_reorder=reorder)
    try:
        # (local offset, remote offset, bytes): three that continue each other, one that skips 64 bytes at the
        # source, one that continues that, and one that continues the source but not the destination
        writes = [(0, HALF, 512), (512, HALF + 512, 1024), (1536, HALF + 1536, 256),
                  (1856, HALF + 1792, 320), (2176, HALF + 2112, 64), (2240, HALF + 4096, 128)]
        for i, (lo, ro, n) in enumerate(writes):
            c.proxy.push(0, C.command.write_signal(0, n, lo, ro, i % 2, i + 1))
        c.start()
        c.proxy.wait_idle(5)
        assert _copies_and_writes(c) == (3, 6)
        data = c.data()
        for lo, ro, n in writes:
            assert np.array_equal(data[ro:ro + n], data[lo:lo + n]), (lo, ro, n)
        landed = np.zeros(DATA - HALF, dtype=bool)
        for _, ro, n in writes:
            landed[ro - HALF:ro - HALF + n] = True
        assert not data[HALF:][~landed].any()  # nothing between or past the writes was touched
        assert c.signals()[:2].tolist() == [1 + 3 + 5, 2 + 4 + 6]
        if copier == "agent":  # its three copies were made by another process, and landed
            assert c.copy_agent.pid != os.getpid()
            assert f"copy agent pid {c.copy_agent.pid} lane 0: 3 of 3 copies landed" in c.proxy.describe()
    finally:
        c.close()
    assert c.copy_agent is None or not c.copy_agent.alive()  # (close stops the agent too)


def test_writes_posted_apart_are_copied_apart_even_when_they_continue_each_other():
    # A cap of two writes in flight cuts four adjacent writes into posts of two: a copy never spans two posts, so a
    # write never waits for one posted after it.
    C = native.module()
    c = _unstarted(max_inflight_writes=2)
    try:
        for i in range(4):
            c.proxy.push(0, C.command.write_signal(0, 1024, 1024 * i, HALF + 1024 * i, 0, 1))
        c.start()
        c.proxy.wait_idle(5)
        assert _copies_and_writes(c) == (2, 4)
        assert np.array_equal(c.data()[HALF:HALF + 4096], c.data()[:4096])
        assert c.signals()[0] == 4
    finally:
        c.close()
