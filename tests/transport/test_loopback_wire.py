"""The loopback's emulated wire under a bandwidth cap records when it was busy (LoopbackWire's log): writes posted
while it is busy join the run, a pause starts a new one, and each run lasts its bytes over the cap -- what
bench internode --timeline splits each call's time with (uccl_ep_train/wire_timeline.py)."""
import time

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402
from uccl_ep_train.wire_timeline import CallWindow, call_on_wire, runs_from_log  # noqa: E402

DATA = 1 << 20
GBPS = 0.01  # 10 MB/s: a 32 KiB write holds the wire 3.3 ms, far longer than the host takes between two posts
SIZE = 32 << 10


def _pair(**kw):
    opts = dict(num_threads=2, fifos_per_thread=1, idle_backoff_us=20, timeout_secs=5.0, max_inflight_writes=8,
                max_inflight_bytes=1 << 20)
    opts.update(kw)
    cs = [comm.HostComm(DATA, r, 2, settings=load_settings({}), num_signal_slots=64, **opts) for r in range(2)]
    comm.connect_in_process(cs)
    return cs


def _send(C, c, peer, writes, slot, fifo=0):
    """`writes` write+signal commands to `peer`, pushed at once (one call, so the proxy finds them together)."""
    cmds = np.array([C.command.write_signal(peer, SIZE, SIZE * i, DATA // 2 + SIZE * i, slot, 1)
                     for i in range(writes)], dtype=np.uint64)
    c.push_array(fifo, cmds)


def _wait(c, slot, want, timeout=10.0):
    deadline = time.time() + timeout
    while c.signals()[slot] < want:
        assert time.time() < deadline, f"signal {slot} is {c.signals()[slot]}, expected {want}"
        time.sleep(0.0005)


def test_back_to_back_writes_are_one_run_a_pause_starts_another_and_each_lasts_its_bytes_over_the_cap():
    C = native.module()
    cs = _pair(loopback_bandwidth_gbps=GBPS)
    try:
        cs[0].proxy.start_wire_log(16)
        _send(C, cs[0], 1, 8, 0)  # both proxy threads' FIFOs would share the wire; one suffices here
        _wait(cs[1], 0, 8)
        time.sleep(0.05)
        t0 = C.steady_clock_ns()
        _send(C, cs[0], 1, 4, 1, fifo=1)  # the other thread: the one wire all the same
        _wait(cs[1], 1, 4)
        t1 = C.steady_clock_ns()
        log = cs[0].proxy.stop_wire_log()
        runs = runs_from_log(log)
        assert [(r.bytes, r.writes) for r in runs] == [(8 * SIZE, 8), (4 * SIZE, 4)], runs
        per_write = int(SIZE / GBPS)  # ns
        assert [r.end_ns - r.start_ns for r in runs] == [8 * per_write, 4 * per_write]
        assert runs[1].start_ns - runs[0].end_ns >= 20_000_000  # the 50 ms pause, less what the signal took
        got = call_on_wire(CallWindow("second batch", t0, t1), runs)
        assert got["wire_bytes"] == 4 * SIZE and got["wire_idle_us"] == 0.0 and got["carried_in_us"] == 0.0
        assert got["wire_busy_us"] == pytest.approx(4 * per_write / 1000)
        assert 0 <= got["wire_start_us"] and got["after_wire_us"] >= 0  # the signal lands after the wire time
        assert cs[1].proxy.stop_wire_log()["runs"] == []  # rank 1 sent nothing (and never started a log)
    finally:
        for c in cs:
            c.close()


def test_a_log_out_of_room_counts_the_runs_it_dropped_and_reading_it_refuses_them():
    C = native.module()
    cs = _pair(loopback_bandwidth_gbps=GBPS)
    try:
        cs[0].proxy.start_wire_log(1)
        for batch in range(2):
            _send(C, cs[0], 1, 2, batch)
            _wait(cs[1], batch, 2)
            time.sleep(0.02)
        log = cs[0].proxy.stop_wire_log()
        assert len(log["runs"]) == 1 and log["dropped"] == 1
        with pytest.raises(ValueError, match="dropped 1 runs"):
            runs_from_log(log)
        _send(C, cs[0], 1, 1, 3)  # a stopped log records nothing more
        _wait(cs[1], 3, 1)
        assert cs[0].proxy.stop_wire_log() == {"runs": [], "dropped": 1}
    finally:
        for c in cs:
            c.close()


def test_without_a_bandwidth_cap_there_is_no_wire_to_log():
    C = native.module()
    cs = _pair()
    try:
        with pytest.raises(ValueError, match="no emulated wire"):
            cs[0].proxy.start_wire_log(16)
        _send(C, cs[0], 1, 3, 0)  # ... and writes still go, uncapped, with no log kept or asked for
        _wait(cs[1], 0, 3)
        with pytest.raises(ValueError, match="no emulated wire"):
            cs[0].proxy.stop_wire_log()
    finally:
        for c in cs:
            c.close()
