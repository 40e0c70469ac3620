"""How `bench internode` splits wall time between calls made in training order (no synchronize between them)."""
import types

import pytest

torch = pytest.importorskip("torch")

from uccl_ep_train.bench import internode as bench  # noqa: E402


class _Clock:
    """perf_counter that moves only when a fake call (or the final synchronize) spends time."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_calls_in_turn_are_each_timed_from_the_previous_return_and_the_last_carries_the_stream_tail(monkeypatch):
    clock = _Clock()
    syncs = []

    def synchronize():
        syncs.append(clock.now)
        if len(syncs) == 2:  # the synchronize after the timed loop: the last call's tail still on the stream
            clock.now += 0.5

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    spent = {"a": iter([1.0, 2.0, 3.0, 4.0, 5.0]), "b": iter([10.0, 20.0, 30.0, 40.0, 50.0])}

    def call(name):
        def fn():
            clock.now += next(spent[name])
        return fn

    a, b = bench._in_turn((call("a"), call("b")), iters=3, warmup=2)
    # the two warm-up pairs are not timed; each timed call runs from the previous call's return to its own
    assert a == [3.0, 4.0, 5.0]
    assert b == [30.0, 40.0, 50.5]
    assert len(syncs) == 2  # once before the timed loop, once after it: never between calls


def test_training_steps_give_every_layer_a_fresh_handle_and_take_the_backward_in_reverse_with_weights(monkeypatch):
    """Each layer's forward dispatch makes its own handle, its combine uses it without weights; the backward pass
    takes the layers in reverse, a cached dispatch then a weighted combine of the same layer's handle; each call is
    timed as _in_turn times it and filed under its kind."""
    clock = _Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    made, log = [], []

    def dispatch():
        clock.now += 1.0
        made.append(object())
        return made[-1]

    def combine(result, weighted):
        clock.now += 2.0 if weighted else 3.0
        log.append(("combine", made.index(result), weighted))

    def cached(result):
        clock.now += 4.0
        log.append(("cached", made.index(result)))

    out = bench._training_steps(dispatch, combine, cached, layers=3, iters=2, warmup=1)
    assert out == {"forward_dispatch": [1.0] * 6, "forward_combine": [3.0] * 6,
                   "backward_cached_dispatch": [4.0] * 6, "backward_combine": [2.0] * 6}
    assert len(made) == 9  # three steps (one warm-up) of three fresh handles
    assert log[-9:] == [("combine", 6, False), ("combine", 7, False), ("combine", 8, False),  # the last step
                        ("cached", 8), ("combine", 8, True), ("cached", 7), ("combine", 7, True),
                        ("cached", 6), ("combine", 6, True)]


def test_the_quoted_pairs_are_also_given_as_a_fraction_of_the_ceiling_and_of_the_raw_transport():
    row = {"in_turn_network_GBps": {"forward_pair": 30.0, "backward_pair": 45.0, "layer": 36.0,
                                    "forward_dispatch": 1.0},
           "training_step_network_GBps": {"forward_pair": 20.0, "backward_pair": 40.0, "layer": 26.0}}
    assert bench._pairs_vs(row, 50.0, "ceiling") == {
        "in_turn_pairs_vs_ceiling": {"forward_pair": 0.6, "backward_pair": 0.9, "layer": 0.72},
        "training_step_pairs_vs_ceiling": {"forward_pair": 0.4, "backward_pair": 0.8, "layer": 0.52}}
    assert bench._pairs_vs(row, 40.0, "raw_transport") == {
        "in_turn_pairs_vs_raw_transport": {"forward_pair": 0.75, "backward_pair": 1.125, "layer": 0.9},
        "training_step_pairs_vs_raw_transport": {"forward_pair": 0.5, "backward_pair": 1.0, "layer": 0.65}}


def test_a_layers_figure_takes_all_four_calls_so_time_moved_between_calls_leaves_it_unchanged():
    # 100 MB per pair; the forward dispatch returns early and its work is waited for in the forward combine
    drained = {"forward_dispatch": [1e-3] * 4, "forward_combine": [1e-3] * 4, "backward_cached_dispatch": [1e-3] * 4,
               "backward_combine": [1e-3] * 4}
    early = dict(drained, forward_dispatch=[0.25e-3] * 4, forward_combine=[1.75e-3] * 4,
                 backward_cached_dispatch=[0.5e-3] * 4, backward_combine=[1.5e-3] * 4)
    a, b = bench._pair_figures(drained, 100_000_000), bench._pair_figures(early, 100_000_000)
    assert a == {"forward_pair": 50.0, "backward_pair": 50.0, "layer": 50.0}
    assert b["layer"] == 50.0 and b["forward_pair"] == 50.0 and b["backward_pair"] == 50.0
    slower = dict(early, backward_combine=[3.5e-3] * 4)  # 2 ms more in the layer: 200 MB over 6 ms
    assert bench._pair_figures(slower, 100_000_000)["layer"] == pytest.approx(200 / 6)
    assert bench._pair_figures(slower, 100_000_000, reduce=lambda t: 2 * t)["layer"] == pytest.approx(100 / 6)


class _Stream:
    """A fake GPU stream: work queued on it runs in order, each item advancing the stream's clock; an event records
    the clock when the stream reaches it."""

    def __init__(self):
        self.clock = 0.0
        self.queued = []

    def work(self, name, ms):
        self.queued.append(name)
        self.clock += ms

    def event_class(self):
        stream = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self):
                self.at = stream.clock
                stream.queued.append("event")

            def elapsed_time(self, other):
                return other.at - self.at

        return Event


def test_calls_beside_compute_are_each_timed_on_the_gpu_from_the_end_of_the_compute_before_them(monkeypatch):
    """Compute goes before every call (warm-ups too), an event pair brackets each timed call and nothing else, so a
    call's span is its own GPU work and never the compute's; spans are filed by kind in training order."""
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", stream.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    made = []

    def dispatch():
        stream.work("dispatch", 1.0)
        made.append(object())
        return made[-1]

    def combine(result, weighted):
        stream.work("combine", 3.0 if weighted else 2.0)

    def cached(result):
        stream.work("cached", 4.0)

    out = bench._training_steps_beside_compute(dispatch, combine, cached, layers=2, iters=3, warmup=1,
                                               compute=lambda: stream.work("compute", 100.0))
    assert out == {"forward_dispatch": [1e-3] * 6, "forward_combine": [2e-3] * 6,
                   "backward_cached_dispatch": [4e-3] * 6, "backward_combine": [3e-3] * 6}
    per_call = 8  # calls per step: two layers, four calls each
    warm, timed = stream.queued[:2 * per_call], stream.queued[2 * per_call:]
    assert warm[::2] == ["compute"] * per_call and "event" not in warm
    assert timed[::4] == ["compute"] * (3 * per_call)
    assert timed[1::4] == ["event"] * (3 * per_call) and timed[3::4] == ["event"] * (3 * per_call)
    assert timed[2:4 * per_call:4] == ["dispatch", "combine", "dispatch", "combine",
                                       "cached", "combine", "cached", "combine"]


def test_the_host_op_probe_reports_the_median_host_time_of_each_kind_of_call_a_host_step_makes(monkeypatch):
    # each probe call costs a known time on a fake clock; the median, not the mean, is reported (one slow outlier of
    # 50 us among 2 us calls leaves it at 2), in microseconds, for each of the three kinds of call
    clock = _Clock()
    costs = iter([2e-6] * 3 + [50e-6] + [2e-6] * 1000)

    def perf_counter():
        return clock.perf_counter()

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    import uccl_ep_train.native as native
    real_stream_handle = native.stream_handle

    def spend(fn):
        def run(*a, **k):
            clock.now += next(costs)
            return fn(*a, **k)
        return run
    monkeypatch.setattr(native, "stream_handle", spend(real_stream_handle))
    real_add, real_copy = torch.Tensor.add_, torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "add_", spend(real_add))
    monkeypatch.setattr(torch.Tensor, "copy_", spend(real_copy))
    out = bench._host_op_us(torch.device("cpu"), reps=11)
    assert set(out) == {"torch_op", "pinned_upload_1KiB", "stream_handle"}
    assert out == {"torch_op": 2.0, "pinned_upload_1KiB": 2.0, "stream_handle": 2.0}


def test_gc_pauses_counts_each_collection_by_generation_and_stops_counting_once_stopped():
    import gc

    watch = bench.GcPauses().start()
    gc.collect(0)
    gc.collect()  # the oldest generation
    out = watch.stop()
    assert out["collections"][0] >= 1 and out["collections"][2] >= 1
    assert out["max_pause_ms"] > 0 and sum(out["pause_ms"]) >= out["max_pause_ms"]
    gc.collect()
    assert watch.stop()["collections"] == out["collections"]  # no longer called back


def test_the_main_threads_usage_per_pair_is_the_difference_over_the_pairs_with_cpu_in_microseconds():
    before = bench._thread_usage()
    x = 0
    for i in range(200000):  # some CPU on this thread
        x += i
    after = bench._thread_usage()
    assert set(after) == {"cpu_s", "voluntary_switches", "involuntary_switches", "minor_faults", "major_faults"}
    assert after["cpu_s"] > before["cpu_s"]
    per = bench._per_pair({"cpu_s": 0.003, "voluntary_switches": 10, "involuntary_switches": 4, "minor_faults": 8,
                           "major_faults": 0}, {"cpu_s": 0.001, "voluntary_switches": 2, "involuntary_switches": 0,
                                                "minor_faults": 0, "major_faults": 0}, 4)
    assert per == {"voluntary_switches": 2.0, "involuntary_switches": 1.0, "minor_faults": 2.0, "major_faults": 0.0,
                   "cpu_us": 500.0}
