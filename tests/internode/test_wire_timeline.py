"""wire_timeline: a call's time split against the emulated wire's busy runs (bench internode --timeline with a capped
loopback). Synthetic runs and windows, so every part is known exactly."""
import pytest

from uccl_ep_train.kernel_timeline import DISPATCH, launch_record
from uccl_ep_train.wire_timeline import (READER_PARTS, CallWindow, ReaderStamps, WireRun, call_on_wire,
                                         readers_in_calls, runs_from_log, summarize)

US = 1000  # ns


def test_a_call_splits_into_before_its_first_byte_busy_idle_and_after_its_last_byte():
    # the wire: busy with the last call until 5 us into this one, then this call's writes 20-120 us and 150-300 us
    runs = [WireRun(-50 * US, 5 * US, 4096, 1), WireRun(20 * US, 120 * US, 1 << 20, 2),
            WireRun(150 * US, 300 * US, 3 << 19, 3)]
    got = call_on_wire(CallWindow("dispatch", 0, 340 * US), runs)
    assert got == {"call_us": 340.0, "carried_in_us": 5.0, "wire_bytes": (1 << 20) + (3 << 19),
                   "wire_start_us": 20.0, "wire_busy_us": 250.0, "wire_idle_us": 30.0, "wire_end_us": 300.0,
                   "after_wire_us": 40.0, "longest_idle_us": 30.0, "longest_idle_at_us": 120.0,
                   "bytes_before_longest_idle": 1 << 20, **dict.fromkeys(READER_PARTS)}


def test_the_longest_idle_stretch_says_where_it_began_and_how_much_the_call_had_sent_by_then():
    # a count row (64 bytes) at 10 us, the records from 70 us with a 5 us hiccup at 500 us
    runs = [WireRun(10 * US, 11 * US, 64, 1), WireRun(70 * US, 500 * US, 3 << 20, 6),
            WireRun(505 * US, 900 * US, 3 << 20, 6)]
    got = call_on_wire(CallWindow("forward dispatch", 0, 950 * US), runs)
    assert (got["wire_idle_us"], got["longest_idle_us"], got["longest_idle_at_us"],
            got["bytes_before_longest_idle"]) == (64.0, 59.0, 11.0, 64)
    alone = call_on_wire(CallWindow("combine", 0, 950 * US), runs[1:2])
    assert alone["longest_idle_us"] == 0.0 and alone["longest_idle_at_us"] is None


def test_runs_outside_the_window_do_not_count_and_one_running_past_its_end_counts_whole():
    # the call returned at 100 us (the others' bytes were in) while its own last byte left at 180 us
    runs = [WireRun(-90 * US, -10 * US, 1, 1), WireRun(60 * US, 180 * US, 7, 1), WireRun(400 * US, 500 * US, 9, 1)]
    got = call_on_wire(CallWindow("combine", 0, 100 * US), runs)
    assert (got["carried_in_us"], got["wire_start_us"], got["wire_busy_us"], got["wire_end_us"],
            got["after_wire_us"], got["wire_bytes"]) == (0.0, 60.0, 120.0, 180.0, -80.0, 7)
    # ... and the next call finds that tail carried in, up to its own end
    nxt = call_on_wire(CallWindow("dispatch", 150 * US, 170 * US), runs)
    assert nxt["carried_in_us"] == 20.0 and nxt["wire_bytes"] == 0


def test_a_call_that_put_nothing_on_the_wire_has_no_wire_times():
    got = call_on_wire(CallWindow("dispatch", 1000, 2000), [WireRun(0, 1500, 64, 1)])
    assert got["carried_in_us"] == 0.5 and got["wire_busy_us"] == 0.0 and got["wire_bytes"] == 0
    assert got["wire_start_us"] is None and got["wire_idle_us"] is None and got["after_wire_us"] is None


def test_a_window_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="ends before it starts"):
        call_on_wire(CallWindow("dispatch", 10, 5), [])


def test_summarize_gives_each_kind_its_medians_so_one_slow_call_does_not_move_them():
    runs, calls = [], []
    for i, start in enumerate((10, 20, 200)):  # the third call's first byte is late
        t0 = i * 10_000 * US
        runs.append(WireRun(t0 + start * US, t0 + (start + 1000) * US, 1 << 20, 2))
        calls.append(CallWindow("forward dispatch", t0, t0 + (start + 1010) * US))
        calls.append(CallWindow("forward combine", t0 + 5000 * US, t0 + 6000 * US))  # nothing of its own
    got = summarize(calls, runs)
    assert got["forward dispatch"]["calls"] == 3
    assert got["forward dispatch"]["median_wire_start_us"] == 20.0
    assert got["forward dispatch"]["median_wire_busy_us"] == 1000.0
    assert got["forward dispatch"]["median_after_wire_us"] == 10.0
    assert got["forward dispatch"]["median_wire_bytes"] == 1 << 20
    assert got["forward combine"]["median_wire_start_us"] is None and got["forward combine"]["calls"] == 3


def test_a_log_that_dropped_runs_or_holds_overlapping_ones_is_refused():
    assert runs_from_log({"runs": [(0, 5, 16, 1), (7, 9, 16, 1)], "dropped": 0}) == [WireRun(0, 5, 16, 1),
                                                                                   WireRun(7, 9, 16, 1)]
    with pytest.raises(ValueError, match="dropped 3 runs"):
        runs_from_log({"runs": [(0, 5, 16, 1)], "dropped": 3})
    with pytest.raises(ValueError, match="overlap"):
        runs_from_log({"runs": [(0, 5, 16, 1), (4, 9, 16, 1)], "dropped": 0})


def test_the_reader_splits_the_time_after_the_last_byte_into_landing_reading_and_returning():
    # own last byte at 300 us; the peer's last chunk seen landed at 320, the reader done at 330, the call back at 345
    runs = [WireRun(20 * US, 300 * US, 1 << 20, 2)]
    got = call_on_wire(CallWindow("dispatch", 0, 345 * US), runs, ReaderStamps(320 * US, 330 * US))
    assert (got["after_wire_us"], got["all_in_after_wire_us"], got["reader_after_all_in_us"],
            got["return_after_reader_us"]) == (45.0, 20.0, 10.0, 15.0)
    # the others' bytes in before our own last one left: landing before our wire's end
    early = call_on_wire(CallWindow("dispatch", 0, 345 * US), runs, ReaderStamps(290 * US, 300 * US))
    assert early["all_in_after_wire_us"] == -10.0
    # no wire of its own: the reader still splits the end
    idle = call_on_wire(CallWindow("combine", 0, 100 * US), [], ReaderStamps(50 * US, 60 * US))
    assert idle["all_in_after_wire_us"] is None and idle["return_after_reader_us"] == 40.0
    assert got["call_returned_after_reader_us"] is None  # the call's return not recorded: no split


def test_the_time_after_the_reader_splits_at_the_calls_return_into_the_host_and_the_synchronize():
    # reader done at 330 us, the call back at 338, the benchmark's synchronize over at 345
    runs = [WireRun(20 * US, 300 * US, 1 << 20, 2)]
    got = call_on_wire(CallWindow("dispatch", 0, 345 * US, 338 * US), runs, ReaderStamps(320 * US, 330 * US))
    assert (got["return_after_reader_us"], got["call_returned_after_reader_us"],
            got["synchronized_after_return_us"]) == (15.0, 8.0, 7.0)
    assert got["drained_after_reader_us"] is None  # no drain recorded: no split of the host's part


def test_the_hosts_part_after_the_reader_splits_at_its_drain_into_noticing_and_the_calls_last_steps():
    # the drain began at 250 us (the host waited for the reader), saw its mark at 334, the call back at 338
    runs = [WireRun(20 * US, 300 * US, 1 << 20, 2)]
    call = CallWindow("dispatch", 0, 345 * US, 338 * US, (250 * US, 334 * US))
    got = call_on_wire(call, runs, ReaderStamps(320 * US, 330 * US))
    assert (got["drain_began_after_reader_us"], got["drained_after_reader_us"],
            got["returned_after_drain_us"]) == (-80.0, 4.0, 4.0)
    # a drain from before the call (a call that drained nothing) is not this call's
    stale = call_on_wire(CallWindow("dispatch", 100 * US, 345 * US, 338 * US, (50 * US, 60 * US)), runs,
                         ReaderStamps(320 * US, 330 * US))
    assert stale["drained_after_reader_us"] is None and stale["returned_after_drain_us"] is None


def _launch(start_ns, all_in_us=None, end_us=None):
    fields = ("start", "rows_in", "first_ready", "first_push", "last_push", "packers_done", "chunks", "reader_start",
              "all_in", "reader_end")
    at = {"start": start_ns, "first_ready": -1, "first_push": -1, "reader_start": -1}
    if all_in_us is not None:
        at["all_in"] = start_ns + int(all_in_us * US)
    if end_us is not None:
        at["reader_end"] = start_ns + int(end_us * US)
    return launch_record(DISPATCH, [at.get(f, 0) for f in fields], fields)


def test_each_call_gets_the_reader_of_the_launch_that_began_in_its_window_on_the_host_clock():
    offset = 7_000 * US  # GPU timer ahead of the steady clock
    calls = [CallWindow("a", 0, 1000 * US), CallWindow("b", 2000 * US, 3000 * US),
             CallWindow("c", 4000 * US, 5000 * US)]
    launches = [_launch(offset + 50 * US, 900, 910),      # in call a
                _launch(offset + 2100 * US),              # in call b, but its hop had no gated reader
                _launch(offset + 6000 * US, 10, 20)]      # in no call
    got = readers_in_calls(calls, launches, offset)
    assert got == [ReaderStamps(950 * US, 960 * US), None, None]
    summary = summarize(calls, [], got)
    assert summary["a"]["median_return_after_reader_us"] == 40.0
    assert summary["b"]["median_return_after_reader_us"] is None
    with pytest.raises(ValueError, match="2 readers for 3 calls"):
        summarize(calls, [], got[:2])
