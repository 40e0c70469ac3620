"""The kernel timeline's host side (uccl_ep_train/kernel_timeline.py): its rows start as the kernel's atomics need,
each launch is labelled by the call that made it, and the stamps become microseconds after the launch's start. The
kernel's own stamps are checked on a GPU (tests/internode/test_internode_gpu.py)."""
import pytest
import torch

from uccl_ep_train import native
from uccl_ep_train.kernel_timeline import (COMBINE, DISPATCH, DISPATCH_DURING_NOTIFY, EARLIEST, TIMES,
                                           KernelTimeline, launch_record, on_host_clock, start_lags, summarize,
                                           waited_for_rows_us)

FIELDS = ("start", "rows_in", "first_ready", "first_push", "last_push", "packers_done", "chunks", "reader_start",
          "all_in", "reader_end")


class _Module:
    TIMELINE_FIELDS = FIELDS
    TIMELINE_WIDTH = 10


class _Context:
    """Stands in for InternodeContext: each launch() stamps the next row, as the kernel's launcher counts them."""

    def __init__(self):
        self.calls, self.used, self.rows = [], 0, None

    def set_timeline(self, ptr, capacity):
        self.calls.append((ptr, capacity))
        self.used = 0

    def timeline_launches(self):
        return self.used

    def launch(self, timeline, stamps):
        row = timeline._stamps[self.used]
        for name, v in stamps.items():
            row[FIELDS.index(name)] = v
        self.used += 1


def _row(start=1_000_000, **us):
    """A row of stamps: start in ns, the others given in us after it (absent: what the kernel leaves)."""
    values = {"start": start, "rows_in": 0, "first_ready": -1, "first_push": -1, "last_push": 0, "packers_done": 0,
              "chunks": 0, "reader_start": -1, "all_in": 0, "reader_end": 0}
    for name, v in us.items():
        values[name] = v if name == "chunks" else start + int(v * 1000)
    return [values[f] for f in FIELDS]


def test_the_field_names_are_the_ones_the_native_module_stamps_in_its_column_order():
    if not native.available() or not hasattr(native.module(), "internode"):
        pytest.skip("the native module is not built with its internode kernels")
    k = native.module().internode
    assert tuple(k.TIMELINE_FIELDS) == FIELDS
    assert int(k.TIMELINE_WIDTH) >= len(FIELDS)
    assert set(EARLIEST) | set(TIMES) | {"chunks"} == set(FIELDS)


def test_rows_start_at_the_values_the_kernels_atomics_need_and_only_new_launches_are_labelled():
    cx = _Context()
    tl = KernelTimeline(cx, _Module, torch.device("cpu"), 4)
    assert cx.calls == [(tl._stamps.data_ptr(), 4)]
    for name in FIELDS:  # the earliest-wins fields start at UINT64_MAX (-1 as int64), the rest at 0
        expected = -1 if name in EARLIEST else 0
        assert tl._stamps[:, FIELDS.index(name)].eq(expected).all(), name
    cx.launch(tl, {"start": 5_000, "first_ready": 6_000, "first_push": 7_000, "last_push": 9_000, "chunks": 2})
    tl.note(DISPATCH)
    tl.note(COMBINE)  # a launch that wrote no record stamped no row: nothing to label
    cx.launch(tl, {"start": 20_000, "rows_in": 50_000, "first_ready": 30_000, "first_push": 51_000,
                   "last_push": 60_000, "chunks": 1})
    tl.note(DISPATCH_DURING_NOTIFY)
    launches = tl.stop()
    assert cx.calls[-1] == (0, 0), "stop() turns the stamping off"
    assert [m["kind"] for m in launches] == [DISPATCH, DISPATCH_DURING_NOTIFY]
    first, second = launches
    assert first["rows_in_us"] is None and first["first_push_us"] == 2.0 and first["last_push_us"] == 4.0
    assert second["rows_in_us"] == 30.0 and second["first_ready_us"] == 10.0 and second["chunks"] == 1


def test_a_timeline_needs_room_for_one_launch():
    with pytest.raises(ValueError, match="at least one launch"):
        KernelTimeline(_Context(), _Module, torch.device("cpu"), 0)


def test_times_are_microseconds_after_the_start_and_absent_events_are_none():
    m = launch_record(DISPATCH, _row(first_ready=3.5, first_push=4.0, last_push=90.25, packers_done=80, chunks=7),
                      FIELDS)
    assert m == {"kind": DISPATCH, "start_ns": 1_000_000, "chunks": 7, "rows_in_us": None, "first_ready_us": 3.5,
                 "first_push_us": 4.0, "last_push_us": 90.25, "packers_done_us": 80.0, "reader_start_us": None,
                 "all_in_us": None, "reader_end_us": None}
    never = launch_record(COMBINE, _row(start=-1), FIELDS)  # a launch whose blocks all returned before stamping
    assert never["start_ns"] is None and all(never[f"{t}_us"] is None for t in TIMES)


def test_the_wait_for_count_rows_is_what_the_rows_came_after_the_first_chunk_was_ready():
    late = launch_record(DISPATCH_DURING_NOTIFY, _row(rows_in=40, first_ready=15, first_push=41), FIELDS)
    early = launch_record(DISPATCH_DURING_NOTIFY, _row(rows_in=5, first_ready=15, first_push=16), FIELDS)
    cached = launch_record(DISPATCH, _row(first_ready=15, first_push=16), FIELDS)
    assert waited_for_rows_us(late) == 25.0
    assert waited_for_rows_us(early) == 0.0
    assert waited_for_rows_us(cached) is None


def test_summary_gives_each_kind_its_launches_and_medians_over_the_launches_that_have_each_time():
    launches = [launch_record(DISPATCH_DURING_NOTIFY, _row(rows_in=r, first_ready=10, first_push=r + 1,
                                                           last_push=100 + r), FIELDS) for r in (20, 40, 60)]
    launches += [launch_record(COMBINE, _row(first_ready=2, first_push=3, last_push=50), FIELDS),
                 launch_record(COMBINE, _row(), FIELDS)]  # wrote records but pushed nothing
    s = summarize(launches)
    assert list(s) == [DISPATCH_DURING_NOTIFY, COMBINE]
    d = s[DISPATCH_DURING_NOTIFY]
    assert d["launches"] == 3 and d["median_rows_in_us"] == 40.0 and d["median_first_push_us"] == 41.0
    assert d["median_waited_for_rows_us"] == 30.0 and d["median_last_push_us"] == 140.0
    c = s[COMBINE]
    assert c["launches"] == 2 and c["median_rows_in_us"] is None and c["median_first_push_us"] == 3.0
    assert c["median_waited_for_rows_us"] is None


def test_start_lags_say_how_long_after_the_earliest_rank_each_rank_began_the_same_launch():
    def launch(kind, start):
        return {"kind": kind, "start_ns": start}

    by_rank = [[launch(DISPATCH_DURING_NOTIFY, 100_000), launch(COMBINE, 500_000), launch(DISPATCH, 900_000)],
               [launch(DISPATCH_DURING_NOTIFY, 160_000), launch(COMBINE, 480_000), launch(DISPATCH, None)]]
    lags = start_lags(by_rank)
    assert lags[0] == {DISPATCH_DURING_NOTIFY: 0.0, COMBINE: 20.0, DISPATCH: None}
    assert lags[1] == {DISPATCH_DURING_NOTIFY: 60.0, COMBINE: 0.0, DISPATCH: None}  # a launch never started: no lag
    mismatched = [[launch(DISPATCH, 1_000)], [launch(COMBINE, 2_000)]]  # not the same call: nothing to compare
    assert start_lags(mismatched) == [{DISPATCH: None, COMBINE: None}, {DISPATCH: None, COMBINE: None}]


def test_a_hops_reader_stamps_its_start_the_last_chunks_landing_and_its_end_in_the_launchs_row():
    m = launch_record(COMBINE, _row(first_push=3, last_push=70, reader_start=150, all_in=1200.5, reader_end=1210),
                      FIELDS)
    assert (m["reader_start_us"], m["all_in_us"], m["reader_end_us"]) == (150.0, 1200.5, 1210.0)


def test_a_row_of_an_older_module_without_reader_fields_reads_as_no_reader():
    old = FIELDS[:7]
    m = launch_record(DISPATCH, _row(first_push=2)[:7], old)
    assert m["first_push_us"] == 2.0 and m["reader_end_us"] is None and m["all_in_us"] is None


def test_stamps_go_to_the_host_clock_by_the_gpu_timers_offset():
    m = launch_record(DISPATCH, _row(start=5_000_000, first_push=2, all_in=1000, reader_end=1012.5), FIELDS)
    offset = 4_000_000  # the GPU timer reads 4 ms ahead of the host's steady clock
    assert on_host_clock(m, "start", offset) == 1_000_000
    assert on_host_clock(m, "all_in", offset) == 2_000_000
    assert on_host_clock(m, "reader_end", offset) == 2_012_500
    assert on_host_clock(m, "rows_in", offset) is None  # never stamped
    never = launch_record(DISPATCH, _row(start=-1), FIELDS)
    assert on_host_clock(never, "start", offset) is None
