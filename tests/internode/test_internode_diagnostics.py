"""What a rank reports about itself when something fails (uccl_ep_train/internode/diagnostics.py): the FIFO clause of
every InternodeError, and the state the test harness asks the ranks still running for (tests/distributed.py)."""
from __future__ import annotations

from uccl_ep_train.internode import diagnostics as diag


def test_fifo_clause_tells_a_lost_push_from_queued_commands_and_stays_short_when_all_were_taken():
    def state(fifo, head, tail, full=0, first=-1, last=-1):
        return {"fifo": fifo, "device_head": head, "tail": tail, "full": full, "first_full": first, "last_full": last}
    healthy = [state(i, 40, 40) for i in range(8)]
    assert diag.describe_fifo_states(healthy, 2) == ("rank 2 FIFOs: every command kernels pushed was taken by the "
                                                     "proxy (8 FIFOs)")
    # slot 41 reserved, its store never seen; 42 is full behind it: the proxy waits at 41 forever
    hole = diag.describe_fifo_states([state(0, 40, 40), state(5, 43, 41, 1, 42, 42)], 0)
    assert "fifo 5 head 43 tail 41 (LOST PUSH: slot 41 is empty, 2 reserved past the tail, 1 full)" in hole
    assert "fifo 0" not in hole
    # reserved and none visible at all is a lost push too
    assert "LOST PUSH" in diag.describe_fifo_states([state(3, 10, 9)], 1)
    # full from the tail on: the proxy is merely behind
    behind = diag.describe_fifo_states([state(1, 12, 9, 3, 9, 11)], 1)
    assert "fifo 1 head 12 tail 9 (3 queued)" in behind and "LOST" not in behind
    assert "head unreadable" in diag.describe_fifo_states([state(0, -1, 5)], 0)


def test_live_state_reports_fifos_counters_and_only_the_signals_that_differ_and_skips_destroyed_backends():
    class FakeContext:
        def signal_value(self, i):
            return [5, 3, 1][i]

        def fifo_states(self):
            return [{"fifo": 0, "device_head": 7, "tail": 6, "full": 0, "first_full": -1, "last_full": -1}]

        def proxy_totals(self):
            return {"commands": 6}

        def proxy_error(self):
            return ""

        def proxy_counters(self):
            return "rank 1 proxy thread 0: 0 operations queued"

    class FakeBackend:
        def __init__(self, rank, destroyed=False):
            self.rank, self._destroyed, self._cx, self._expected = rank, destroyed, FakeContext(), [5, 4, 1]

    alive, gone = FakeBackend(1), FakeBackend(2, destroyed=True)
    diag.track(alive)
    diag.track(gone)
    try:
        text = diag.live_state()
    finally:
        diag._LIVE.discard(alive)
        diag._LIVE.discard(gone)
    assert text.startswith("rank 1: rank 1 FIFOs: fifo 0 head 7 tail 6 (LOST PUSH: slot 6 is empty")
    assert "(slot=value/expected): 1=3/4\n" in text  # slots 0 and 2 match what was waited for
    assert "proxy totals {'commands': 6}" in text and "rank 1 proxy thread 0: 0 operations queued" in text
    assert "rank 2" not in text
    assert diag.live_state() == "no live internode backend in this process"
