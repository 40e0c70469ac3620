"""Proxy behaviour within one process (two ranks over loopback): signals, splits, atomics, quiet, barrier,
watchdog, wait_idle for host- and GPU-fed FIFOs, describe(), and rejection of malformed commands before any byte
moves."""
import json
import re
import time

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.settings import SettingsError, load_settings  # noqa: E402

DATA = 1 << 16


def make_pair(**kw):
    opts = dict(num_threads=1, fifos_per_thread=2, idle_backoff_us=20, timeout_secs=5.0)
    opts.update(kw)
    s = load_settings({})
    cs = [comm.HostComm(DATA, r, 2, settings=s, num_signal_slots=64, **opts) for r in range(2)]
    comm.connect_in_process(cs)
    rng = np.random.default_rng(1)
    for c in cs:
        c.data()[:] = rng.integers(0, 256, DATA, dtype=np.uint8)
    return cs


@pytest.fixture
def C():
    return native.module()


@pytest.mark.parametrize("reorder", [0, 8])
def test_large_increments_and_signed_atomics_sum_exactly(C, reorder):
    cs = make_pair(loopback_reorder=reorder)
    try:
        assert cs[0].proxy.caps["in_order"] == (reorder == 0)
        want = np.zeros(64, dtype=np.int64)
        rng = np.random.default_rng(2)
        for i in range(300):
            slot = int(rng.integers(0, 8))
            if i % 3 == 0:
                add = int(rng.integers(-(1 << 20), 1 << 20))
                cs[0].push(0, C.command.atomic(1, slot, add))
            else:
                add = int(rng.choice([0, 1, 255, 256, (1 << 18) - 1]))
                cs[0].push(0, C.command.write_signal(1, 64, 64 * (i % 100), 8192 + 64 * (i % 100), slot, add))
            want[slot] += add
        cs[0].proxy.wait_done(0, cs[0].push(0, C.command.quiet()))
        deadline = time.time() + 5
        while not np.array_equal(cs[1].signals(), want):
            assert time.time() < deadline, (cs[1].signals()[:8], want[:8])
            time.sleep(0.001)
        assert cs[0].stats()[0]["writes_posted"] > 300  # the largest increments were split
    finally:
        for c in cs:
            c.close()


def test_quiet_completes_only_after_earlier_writes_landed(C):
    cs = make_pair(loopback_delay_us=50_000)
    try:
        src = cs[0].data()[:4096].copy()
        cs[0].push(0, C.command.write(1, 4096, 0, 32768))
        q = cs[0].push(0, C.command.quiet())
        time.sleep(0.01)
        assert cs[0].proxy.fifo_tail(0) <= q, "quiet passed while a write was still in flight"
        cs[0].proxy.wait_done(0, q)
        assert np.array_equal(cs[1].data()[32768:32768 + 4096], src)
    finally:
        for c in cs:
            c.close()


def test_barrier_completes_when_every_rank_arrives(C):
    cs = make_pair()
    try:
        for round_ in range(3):
            i0 = cs[0].push(1, C.command.barrier())
            time.sleep(0.02)
            assert cs[0].proxy.fifo_tail(1) <= i0, "barrier passed before the other rank arrived"
            i1 = cs[1].push(1, C.command.barrier())
            cs[0].proxy.wait_done(1, i0)
            cs[1].proxy.wait_done(1, i1)
    finally:
        for c in cs:
            c.close()


def test_watchdog_names_the_barrier_that_never_completes(C):
    cs = make_pair(timeout_secs=0.5)
    try:
        cs[0].push(1, C.command.barrier())
        t0 = time.time()
        with pytest.raises(C.ProxyError,
                           match=r"rank 0 proxy thread 0: no progress .* fifo 1 barrier epoch 0 has 0 of 1"):
            cs[0].wait_idle(10)
        assert time.time() - t0 < 3
    finally:
        for c in cs:
            c.close()


MALFORMED = [
    ("destination rank outside the world", lambda C: C.command.write(5, 16, 0, 0), "dst_rank 5 >= world size 2"),
    ("remote range past the region", lambda C: C.command.write(1, 32, 0, DATA - 16), "exceeds rank 1's"),
    ("local range past the region", lambda C: C.command.write(1, 32, DATA - 16, 0), "exceeds the registered"),
    ("signal slot past the buffer", lambda C: C.command.write_signal(1, 16, 0, 0, 64, 1), "signal slot 64 >= 64"),
]


@pytest.mark.parametrize("name,make,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_command_is_rejected_before_any_byte_moves(C, name, make, needle):
    cs = make_pair()
    try:
        before = cs[1].data().copy()
        cs[0].push(0, make(C))
        with pytest.raises(C.ProxyError, match=needle):
            cs[0].wait_idle(5)
        assert np.array_equal(cs[1].data(), before)
        with pytest.raises(C.ProxyError):  # the failure sticks and further pushes report it
            cs[0].push(0, C.command.quiet())
    finally:
        for c in cs:
            c.close()


def test_unknown_command_type_is_refused_at_push(C):
    cs = make_pair()
    try:
        with pytest.raises(C.ProxyError, match="type 15 is not a valid command"):
            cs[0].push(0, (0xF, 0))
        cs[0].check()  # the proxy itself is unaffected
    finally:
        for c in cs:
            c.close()


def _wait_signal(c, slot, want, timeout):
    deadline = time.time() + timeout
    while c.signals()[slot] < want:
        assert time.time() < deadline, f"signal {slot} is {c.signals()[slot]}, expected {want}"
        time.sleep(0.0005)


@pytest.mark.parametrize("inflight", [1, 8])
def test_bandwidth_cap_paces_delivery_at_bytes_over_the_cap_without_stalling(C, inflight):
    gbps, writes, size = 0.1, 64, 32 << 10  # 2 MiB at 100 MB/s: 21 ms on the emulated wire
    cs = make_pair(loopback_bandwidth_gbps=gbps, max_inflight_writes=inflight, max_inflight_bytes=1 << 20)
    try:
        t0 = time.perf_counter()
        for _ in range(writes):
            cs[0].push(0, C.command.write_signal(1, size, 0, DATA // 2, 0, 1))
        cs[0].proxy.wait_done(0, cs[0].push(0, C.command.quiet()))
        _wait_signal(cs[1], 0, writes, 10)
        took, ideal = time.perf_counter() - t0, writes * size / (gbps * 1e9)
        assert took >= 0.9 * ideal, f"{took * 1e3:.1f} ms is faster than the {ideal * 1e3:.1f} ms cap"
        assert took <= 3.0 * ideal + 0.2, f"{took * 1e3:.1f} ms: the cap of {ideal * 1e3:.1f} ms stalls delivery"
    finally:
        for c in cs:
            c.close()


def test_reorder_window_wider_than_an_inflight_cap_of_one_still_drains_promptly(C):
    cs = make_pair(loopback_reorder=8, max_inflight_writes=1, max_inflight_bytes=4096)
    try:
        t0 = time.perf_counter()
        for i in range(200):
            cs[0].push(0, C.command.write_signal(1, 4096, 0, DATA // 2 + 4096 * (i % 8), 0, 1))
        cs[0].proxy.wait_done(0, cs[0].push(0, C.command.quiet()))
        _wait_signal(cs[1], 0, 200, 10)
        assert time.perf_counter() - t0 < 2.0
    finally:
        for c in cs:
            c.close()


def test_settings_reach_the_proxy_and_bad_combinations_are_refused():
    s = load_settings({"UCCL_EP_NUM_PROXY_THREADS": "3", "UCCL_IB_MAX_INFLIGHT_NORMAL": "2",
                       "UCCL_IB_MAX_INFLIGHT_BYTES": "4096", "UCCL_EP_LOOPBACK_REORDER": "4",
                       "UCCL_EP_PROXY_CPUS": "0-1", "UCCL_EP_CPU_TIMEOUT_SECS": "7"})
    o = comm.proxy_options(s, 1, 2)
    assert (o.num_threads, o.max_inflight_writes, o.max_inflight_bytes, o.loopback_reorder, o.cpus,
            o.timeout_secs) == (3, 2, 4096, 4, (0, 1), 7.0)
    assert comm.proxy_options(s, 0, 2, low_latency=True).max_inflight_writes == 32
    with pytest.raises(ValueError, match="rank 2 is outside"):
        comm.proxy_options(s, 2, 2)
    with pytest.raises(SettingsError, match="UCCL_EP_TRANSPORT=verbs"):
        comm.proxy_options(load_settings({"UCCL_EP_TRANSPORT": "verbs"}), 0, 1)
    with pytest.raises(SettingsError, match="reorder window"):
        comm.HostComm(4096, 0, 1, settings=s, loopback_reorder=4, max_inflight_writes=300, reorder_window=256)


def test_fifo_depth_must_be_a_power_of_two():
    with pytest.raises(RuntimeError, match="power of two"):
        comm.HostComm(4096, 0, 1, settings=load_settings({}), fifo_depth=3)


def make_unstarted(**kw):
    """One rank, connected but with its proxy threads not started: whatever is pushed stays in the FIFOs."""
    opts = dict(num_threads=1, fifos_per_thread=2, idle_backoff_us=20, timeout_secs=5.0)
    opts.update(kw)
    c = comm.HostComm(DATA, 0, 1, settings=load_settings({}), num_signal_slots=64, **opts)
    c.connect_infos([c.local_infos()])
    native.module().unlink_shared_host_memory_names()
    c.data()[:] = np.random.default_rng(3).integers(0, 256, DATA, dtype=np.uint8)
    return c


@pytest.mark.parametrize("producer", ["host", "gpu"])
def test_wait_idle_waits_until_the_proxy_took_every_published_command(C, producer):
    c = make_unstarted()
    try:
        cmd = C.command.write_signal(0, 256, 0, DATA // 2, 3, 1)
        if producer == "host":
            c.proxy.push(1, cmd)
            stuck = r"fifo 1 tail 0 != head 1"
        else:  # slots written as a kernel writes them: the host head stays 0, so only the ring shows the command
            c.proxy.fifo_push_as_device(1, cmd)
            stuck = r"fifo 1 \(GPU producers\) holds command #0 not yet taken"
        with pytest.raises(TimeoutError, match=r"rank 0: proxy not idle after .*: " + stuck):
            c.proxy.wait_idle(0.2)
        c.start()
        c.proxy.wait_idle(5)
        assert c.signals()[3] == 1  # idle means done: the write and its signal landed
        assert np.array_equal(c.data()[DATA // 2:DATA // 2 + 256], c.data()[:256])
        assert c.stats()[0]["commands"] == 1
    finally:
        c.close()


def test_wait_idle_is_not_fooled_by_a_barrier_waiting_in_a_gpu_fed_fifo(C):
    # The barrier's announcements completed (nothing queued or in flight), but the barrier itself stays in rank 0's
    # ring until rank 1 arrives: a GPU-fed FIFO must still count as busy although its host head says nothing.
    cs = make_pair()
    try:
        cs[0].proxy.fifo_push_as_device(1, C.command.barrier())
        time.sleep(0.05)
        with pytest.raises(TimeoutError, match=r"fifo 1 \(GPU producers\) holds command #0"):
            cs[0].proxy.wait_idle(0.2)
        cs[1].proxy.fifo_push_as_device(1, C.command.barrier())
        for c in cs:
            c.proxy.wait_idle(5)
            assert c.proxy.fifo_tail(1) == 1
    finally:
        for c in cs:
            c.close()


def test_describe_names_each_thread_with_its_writes_in_flight_and_queued(C):
    cs = make_pair(num_threads=2, fifos_per_thread=1, loopback_delay_us=400_000, max_inflight_writes=4,
                   max_inflight_bytes=1 << 20)
    try:
        for i in range(10):
            cs[0].push(0, C.command.write(1, 4096, 0, 4096 * (i % 8)))
        want = (r"rank 0 proxy thread 0: 6 operations queued, 4 writes / 16384 bytes in flight \(caps 4 / 1048576\);"
                r" fifo 0 10 outstanding; 0 signals held for order; transport: \S")
        deadline = time.time() + 2
        text = cs[0].proxy.describe()
        while not re.search(want, text):
            assert time.time() < deadline, text
            time.sleep(0.005)
            text = cs[0].proxy.describe()
        lines = text.splitlines()
        assert len(lines) == 2 and re.match(want, lines[0]), text
        assert lines[1].startswith("rank 0 proxy thread 1: 0 operations queued, 0 writes / 0 bytes in flight"), text
        cs[0].wait_idle(5)
        assert "0 operations queued, 0 writes / 0 bytes in flight" in cs[0].proxy.describe().splitlines()[0]
    finally:
        for c in cs:
            c.close()


def test_describe_reads_the_transport_directly_when_the_threads_are_not_running(C):
    c = make_unstarted()
    try:
        text = c.proxy.describe()
        assert text.startswith("rank 0 proxy thread 0: 0 operations queued, 0 writes / 0 bytes in flight")
        assert "transport: " in text and "no answer" not in text
    finally:
        c.close()
    assert "no answer" not in c.proxy.describe()  # stopped: answered without the thread


def test_watchdog_message_ends_with_the_transport_debug_state(C):
    cs = make_pair(timeout_secs=0.5, loopback_delay_us=3_000_000)
    try:
        cs[0].push(0, C.command.write(1, 64, 0, 0))
        with pytest.raises(C.ProxyError, match=r"rank 0 proxy thread 0: no progress .* 1 writes in flight waiting for "
                                               r"completion .* transport: loopback rank 0 thread 0: 1 posted"):
            cs[0].wait_idle(10)
    finally:
        for c in cs:
            c.close()


def test_bench_proxy_prefill_runs_each_fifo_count_and_reports_the_commands_it_drained(tmp_path):
    from uccl_ep_train import cli

    out = tmp_path / "proxy.json"
    assert cli.main(["bench", "proxy", "--producer", "cpu", "--prefill", "--fifos", "1,2", "--commands", "3000",
                     "--latency-samples", "20", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["fifos"], r["commands"], r["push"]) for r in results] == [(1, 3000, "prefill"), (2, 6000, "prefill")]
    assert all(r["commands_per_s"] > 0 and r["max_inflight_writes"] >= 1 for r in results)


@pytest.mark.parametrize("value", ["0", "1,x", "33", ""])
def test_bench_proxy_rejects_a_malformed_watcher_count_before_any_kernel_runs(value):
    from uccl_ep_train import cli

    with pytest.raises(SystemExit, match="--poll-warps"):
        cli.main(["bench", "proxy", "--producer", "gpu", "--poll-warps", value, "--fifos", "1"])


@pytest.mark.parametrize("producer", ["host", "gpu"])
def test_a_drain_of_a_full_small_ring_takes_each_command_once(C, producer):
    """A drain takes commands until the ring is empty and clears their slots only at its end; with a full ring it
    must stop after one lap, or it reads its own taken (not yet cleared) slots again: duplicated writes and signals.
    Found with a 4-slot ring filled before the proxy thread started (UCCL_EP_FIFO_DEPTH accepts any power of two)."""
    c = make_unstarted(fifo_depth=4)
    try:
        cmd = C.command.write_signal(0, 256, 0, DATA // 2, 3, 1)
        for _ in range(4):  # the ring is full when the proxy thread first looks at it
            if producer == "host":
                c.push(0, cmd)
            else:
                c.proxy.fifo_push_as_device(0, cmd)
        c.start()
        for _ in range(8):  # and it keeps being refilled while the proxy drains
            if producer == "host":
                c.push(0, cmd)
            else:
                c.proxy.fifo_push_as_device(0, cmd)
        _wait_signal(c, 3, 12, 5)
        time.sleep(0.05)  # a lap would show up as extra increments and commands
        assert c.signals()[3] == 12
        assert sum(s["commands"] for s in c.stats()) == 12
    finally:
        c.close()


def test_touching_the_dump_file_makes_every_proxy_thread_print_its_fifos_and_queue(C, tmp_path, capfd):
    dump = tmp_path / "dump-proxies"
    s = load_settings({"UCCL_EP_PROXY_DUMP_FILE": str(dump)})
    c = comm.HostComm(DATA, 0, 1, settings=s, num_signal_slots=64, num_threads=2, fifos_per_thread=2,
                      timeout_secs=5.0)
    comm.connect_in_process([c])
    try:
        c.push(1, C.command.write_signal(0, 256, 0, 4096, 3, 1))
        c.wait_signal(3, 1, 10.0)
        capfd.readouterr()
        dump.touch()
        err, deadline = "", time.monotonic() + 10
        while time.monotonic() < deadline and err.count("uccl-ep proxy dump:") < 2:
            time.sleep(0.05)
            err += capfd.readouterr().err
        assert "uccl-ep proxy dump: rank 0 proxy thread 0: 0 operations queued" in err
        assert "uccl-ep proxy dump: rank 0 proxy thread 1" in err
        # FIFO 1 (thread 0's second) carried the one command: taken, its slot given back, nothing left in the ring
        assert "fifo 1: taken 1, given back (tail) 1, non-empty slots from the tail 0" in err
        assert "transport: loopback rank 0 thread 0" in err
        err = capfd.readouterr().err
        time.sleep(0.3)
        assert "uccl-ep proxy dump" not in err + capfd.readouterr().err, "one touch, one dump"
    finally:
        c.close()
