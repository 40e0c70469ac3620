"""The command ring: concurrent producers lose and duplicate nothing, keep per-producer order, and block (with a
deadline) on a full ring."""
import threading
import time

import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")


@pytest.fixture(scope="module")
def C():
    return native.module()


@pytest.mark.parametrize("depth,producers", [(2, 3), (8, 4), (1024, 2)])
def test_concurrent_producers_deliver_every_command_exactly_once_in_order(C, depth, producers):
    per = 50_000
    r = C.fifo_stress(depth, producers, per, pause_every=997, timeout_secs=60)
    assert r["error"] == ""
    assert r["received"] == producers * per
    assert r["bad"] == 0 and r["out_of_order"] == 0
    assert r["per_producer"] == [per] * producers
    assert r["tail"] == r["head"] == producers * per


def test_full_ring_blocks_producer_until_consumer_frees_a_slot(C):
    f = C.Fifo(4)
    for i in range(4):
        assert f.push(C.command.write(0, 16, 0, 16 * i), 1.0) == i
    done = threading.Event()

    def producer():
        f.push(C.command.write(0, 16, 0, 16 * 4), 10.0)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert not done.is_set(), "a push into a full ring must wait"
    assert C.command.decode(*f.pop())["remote_offset"] == 0
    t.join(5)
    assert done.is_set()
    got = [C.command.decode(*f.pop())["remote_offset"] for _ in range(4)]
    assert got == [16, 32, 48, 64]
    assert f.pop() is None


def test_full_ring_push_times_out_naming_fifo_and_counters(C):
    f = C.Fifo(2, rank=3, fifo_id=5)
    f.push(C.command.quiet(), 1.0)
    f.push(C.command.quiet(), 1.0)
    t0 = time.time()
    with pytest.raises(TimeoutError, match=r"rank 3 fifo 5 .*tail is 0"):
        f.push(C.command.quiet(), 0.3)
    assert time.time() - t0 < 5


def test_fifo_rejects_invalid_depth_and_empty_command(C):
    with pytest.raises(RuntimeError, match="power of two"):
        C.Fifo(6)
    with pytest.raises(RuntimeError, match="not a valid command"):
        C.Fifo(4).push((0, 0), 1.0)
