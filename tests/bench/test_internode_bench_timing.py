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
