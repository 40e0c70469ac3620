"""The shared transport factory (csrc/proxy/transport_factory.cpp), which both the standalone Proxy binding and the
internode Context build their proxies with, exercised through the Proxy binding: verbs over the recording fake ibv
table (no NIC), its argument checks, and loopback's per-GPU bandwidth cap: one wire shared by the proxy threads. The
internode Context needs a GPU; what these prove about the factory holds for it because it calls the same function."""
from __future__ import annotations

import gc
import re
import time

import pytest

from tests.transport.verbs_fake_support import SKIP_REASON, K, calls, cx7, fake, verbs
from uccl_ep_train import comm, native
from uccl_ep_train.settings import load_settings

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

DATA = 1 << 16
THREADS = 2


@pytest.fixture
def fake_cx7():
    fake.install([cx7("mlx5_0", 0), cx7("mlx5_1", 1)], False)
    yield
    gc.collect()  # every transport gone before the fake table is
    fake.uninstall()


@pytest.mark.skipif(verbs is None, reason=SKIP_REASON)
def test_verbs_proxy_gets_one_endpoint_per_thread_on_the_given_device_gid_sl_tc_and_queue_depths(fake_cx7):
    C = native.module()
    bufs = [C.HostBuffer(DATA) for _ in range(2)]
    proxies = [C.Proxy(bufs[r], r, 2, num_threads=THREADS, transport="verbs", ib_devices=[f"mlx5_{r}"],
                       ib_gid_index=[2], ib_sl=5, ib_tc=96, ib_sq_depth=64, ib_rq_depth=32) for r in range(2)]
    try:
        assert all(p.caps["name"] == "verbs-rc" and p.caps["in_order"] for p in proxies)
        # thread t of each rank opens its own endpoint on that rank's device: 2 ranks x 2 threads
        assert [x["device"] for x in calls("ibv_open_device")] == ["mlx5_0"] * THREADS + ["mlx5_1"] * THREADS
        qps = calls("ibv_create_qp")
        assert len(qps) == 2 * THREADS * 2  # one RC QP per peer (itself included) per endpoint
        assert {(x["max_send_wr"], x["max_recv_wr"]) for x in qps} == {(64, 32)}
        infos = [[p.local_info(t) for p in proxies] for t in range(THREADS)]
        for p in proxies:
            p.connect(infos)
        rtr = [x for x in calls("ibv_modify_qp") if x["qp_state"] == K["IBV_QPS_RTR"]]
        assert len(rtr) == len(qps)
        # GID index 2 is the IPv4-mapped RoCE v1 entry, not what the automatic rule would pick (3): it came through
        assert {(x["ah_sgid_index"], x["ah_sl"], x["ah_traffic_class"]) for x in rtr} == {(2, 5, 96)}
    finally:
        for p in proxies:
            p.stop()
        del proxies


@pytest.mark.parametrize("kwargs,message", [
    (dict(transport="verbs"), re.escape("Proxy: transport 'verbs' needs at least one RDMA device (ib_devices)")),
    (dict(transport="verbs", ib_devices=["mlx5_0"], ib_gid_index=[3, 3]),
     r"one per device in ib_devices \(1 devices, 2 indices"),
    (dict(transport="tcp"), "Proxy: transport must be 'loopback' or 'verbs', got 'tcp'"),
])
def test_the_factory_refuses_a_spec_it_cannot_build_before_touching_a_nic(kwargs, message):
    C = native.module()
    with pytest.raises(ValueError, match=message):
        C.Proxy(C.HostBuffer(DATA), 0, 1, **kwargs)


def _timed_writes(busy_threads: int, gbps: float, writes: int, size: int) -> float:
    """Seconds until ``writes`` writes of ``size`` bytes from each of the first ``busy_threads`` proxy threads of
    rank 0 (of THREADS) have landed at rank 1, with the loopback NIC capped at ``gbps``."""
    C = native.module()
    s = load_settings({})
    cs = [comm.HostComm(DATA, r, 2, settings=s, num_signal_slots=64, num_threads=THREADS, fifos_per_thread=1,
                        loopback_bandwidth_gbps=gbps, max_inflight_bytes=1 << 20, timeout_secs=10.0)
          for r in range(2)]
    comm.connect_in_process(cs)
    try:
        t0 = time.perf_counter()
        for _ in range(writes):
            for fifo in range(busy_threads):  # FIFO f belongs to proxy thread f; each thread counts on its own slot
                cs[0].push(fifo, C.command.write_signal(1, size, 0, DATA // 2, fifo, 1))
        for fifo in range(busy_threads):
            cs[0].wait_done(fifo, cs[0].push(fifo, C.command.quiet()))
        for fifo in range(busy_threads):
            cs[1].wait_signal(fifo, writes, 10)
        return time.perf_counter() - t0
    finally:
        for c in cs:
            c.close()


def test_loopback_bandwidth_cap_is_per_gpu_shared_by_the_proxy_threads():
    """Two threads writing at once get the cap between them: if each had the whole cap, this would take half as
    long."""
    gbps, writes, size = 0.1, 32, 32 << 10  # 2 x 1 MiB at 100 MB/s in total: 21 ms on the emulated wire
    took, ideal = _timed_writes(THREADS, gbps, writes, size), THREADS * writes * size / (gbps * 1e9)
    assert took >= 0.9 * ideal, f"{took * 1e3:.1f} ms: each thread had the whole {gbps} GB/s cap"
    assert took <= 3.0 * ideal + 0.2, f"{took * 1e3:.1f} ms: the {ideal * 1e3:.1f} ms cap stalls delivery"


def test_one_busy_proxy_thread_gets_the_whole_cap_while_the_others_idle():
    """The cap is one NIC, not a share per thread: a thread with more chunks than the others (the last chunks of a
    block) must not be paced at 1/THREADS of the cap while the wire is idle."""
    gbps, writes, size = 0.1, 64, 32 << 10  # 2 MiB at 100 MB/s: 21 ms on the whole wire, 42 ms at half of it
    took, ideal = _timed_writes(1, gbps, writes, size), writes * size / (gbps * 1e9)
    assert took >= 0.9 * ideal, f"{took * 1e3:.1f} ms: faster than the {gbps} GB/s cap"
    assert took <= 1.35 * ideal + 0.005, f"{took * 1e3:.1f} ms for {ideal * 1e3:.1f} ms of wire time: the thread was " \
        f"paced at a share of the cap"
