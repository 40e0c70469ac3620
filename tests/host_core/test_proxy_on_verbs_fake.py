"""The proxy over the verbs transport's recording fake, whose send queues have a real depth (no NIC needed):
posting under refusal (a full send queue takes only part of a batch; the rest goes later, in per-destination order
and once), and describe() showing the send queues the NIC has not completed."""
import gc
import time

import numpy as np
import pytest

from tests.transport.verbs_fake_support import SKIP_REASON, calls, cx7, fake, verbs
from uccl_ep_train import comm, native
from uccl_ep_train.settings import load_settings

pytestmark = pytest.mark.skipif(verbs is None, reason=SKIP_REASON)

DATA = 1 << 16


@pytest.fixture
def pair():
    """Two ranks on fake ConnectX-7 NICs with 2-deep send queues; make(**options) -> connected, unstarted."""
    fake.install([cx7("mlx5_0", 0), cx7("mlx5_1", 1)], False)
    comms = []

    def make(**kw):
        opts = dict(num_threads=1, fifos_per_thread=1, timeout_secs=20.0, transport="verbs", ib_sq_depth=2)
        opts.update(kw)
        comms.extend(comm.HostComm(DATA, r, 2, settings=load_settings({}), ib_devices=[f"mlx5_{r}"],
                                   ib_gid_index=[3], **opts) for r in range(2))
        infos = [c.local_infos() for c in comms]
        for c in comms:
            c.connect_infos(infos)
        return comms

    yield make
    while comms:  # every transport gone before the fake table is; a fake NIC told to complete nothing never would
        comms.pop().close(deliver=False)
    gc.collect()
    fake.set_auto_complete(True)
    fake.uninstall()


@pytest.mark.parametrize("inflight", [1, 8])
def test_refused_posts_are_reposted_later_in_per_destination_order_and_once(pair, inflight):
    C = native.module()
    # A send queue of 2 accepts two writes per destination, so a batch of 8 to two destinations is cut short.
    comms = pair(max_inflight_writes=inflight, max_inflight_bytes=1 << 20)
    n = 64
    dst = np.random.default_rng(5).integers(0, 2, n)
    for i in range(n):  # pushed before the threads start: the first batches hold both destinations
        comms[0].push(0, C.command.write(int(dst[i]), 16, 0, 64 * i))
    fake.clear_calls()
    comms[0].start()
    comms[0].wait_idle(10)

    posted = {0: [], 1: []}
    chains = []
    for p in calls("ibv_post_send"):
        chains.append(len(p["wrs"]))
        for w in p["wrs"]:
            d = next(r for r in (0, 1) if 0 <= w["remote_addr"] - comms[r].buffer.ptr < DATA)
            posted[d].append((w["remote_addr"] - comms[d].buffer.ptr) // 64)
    for d in (0, 1):
        assert posted[d] == [i for i in range(n) if dst[i] == d], f"destination {d} out of order or duplicated"
    assert max(chains) <= 2
    s = comms[0].stats()[0]
    assert s["commands"] == n and s["writes_posted"] == n
    assert s["max_inflight_writes"] <= inflight
    if inflight == 8:
        assert s["max_inflight_writes"] > 2  # both destinations were in one batch, and part of it was refused


def test_describe_shows_the_verbs_send_queue_the_nic_has_not_completed(pair):
    C = native.module()
    comms = pair(max_inflight_writes=8, max_inflight_bytes=1 << 20)
    fake.set_auto_complete(False)  # the NIC completes nothing: what was posted stays posted
    for i in range(3):
        comms[0].push(0, C.command.write(1, 16, 0, 64 * i))
    comms[0].start()
    want = ("rank 0 proxy thread 0: 1 operations queued, 2 writes / 32 bytes in flight (caps 8 / 1048576); "
            "fifo 0 3 outstanding; 0 signals held for order; transport: verbs-rc rank 0: 1 chains (2 work requests) "
            "posted and not completed; send queue to rank 1 on mlx5_0 2/2")
    deadline = time.time() + 5
    text = comms[0].proxy.describe()
    while want not in text:
        assert time.time() < deadline, text
        time.sleep(0.005)
        text = comms[0].proxy.describe()


def test_a_post_that_never_returns_fails_the_proxy_naming_the_call_instead_of_hanging(pair, tmp_path, capfd):
    """The proxy thread is inside ibv_post_send, so its own watchdog cannot run: the monitor thread notices that its
    loop stopped turning, fails the proxy naming the call, and answers the dump file for it."""
    C = native.module()
    dump = tmp_path / "dump"
    comms = pair(timeout_secs=0.5, dump_trigger=str(dump))
    fake.block_next_post_send(3.0)
    comms[0].push(0, C.command.write(1, 16, 0, 64))
    t0 = time.monotonic()
    comms[0].start()
    time.sleep(0.2)
    dump.touch()
    deadline = t0 + 2.5
    while not comms[0].proxy.error and time.monotonic() < deadline:
        time.sleep(0.01)
    took = time.monotonic() - t0
    err = comms[0].proxy.error
    assert "rank 0 proxy thread 0: its loop has not turned for" in err, err
    assert "inside a transport post" in err
    assert took < 2.5, "raised only after the call returned by itself (3 s): the monitor did not see it"
    out = capfd.readouterr().err
    assert "uccl-ep proxy monitor: rank 0 proxy thread 0" in out and "now inside a transport post" in out
    # Stopping does not wait for the call either: the thread is detached (and its state left behind) after the
    # deadline, well before the call returns by itself.
    t1 = time.monotonic()
    comms[0].close()
    assert time.monotonic() - t1 < 1.5
    assert "proxy thread 0 is still inside a transport post" in capfd.readouterr().err
    # The detached thread returns from the stalled call (3 s) and leaves its loop; only then may the fake go away.
    deadline = time.monotonic() + 30
    while comms[0].proxy.threads_in_loop and time.monotonic() < deadline:
        time.sleep(0.05)
    assert comms[0].proxy.threads_in_loop == 0
