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


def test_host_push_is_refused_on_a_fifo_gpu_producers_use(C):
    # A kernel's device view claims the FIFO (what bench proxy --producer gpu and the internode context do); the host
    # head would not know the GPU's pushes, so a host push must fail loudly instead of filling a slot nobody reads.
    f = C.Fifo(8, rank=2, fifo_id=6)
    assert f.producer == "none"
    f.bind_producer("device")
    assert f.producer == "device"
    with pytest.raises(C.ProxyError, match=r"rank 2 fifo 6: host push refused: GPU producers feed this FIFO"):
        f.push(C.command.quiet(), 1.0)
    assert f.head == 0 and f.pop() is None


def test_device_view_is_refused_on_a_fifo_host_producers_use(C):
    f = C.Fifo(8, rank=1, fifo_id=3)
    f.push(C.command.quiet(), 1.0)
    assert f.producer == "host"
    with pytest.raises(C.ProxyError, match=r"rank 1 fifo 3: device view refused: host producers already pushed 1"):
        f.bind_producer("device")
    assert f.producer == "host"
    f.push(C.command.quiet(), 1.0)  # the host side keeps working
    f.bind_producer("host")
    with pytest.raises(ValueError, match="'host' or 'device'"):
        f.bind_producer("gpu")



def test_drained_tracks_published_commands_for_host_and_gpu_style_producers(C):
    # Host producers: drained once the tail caught up with the host head. GPU producers: their head lives in GPU
    # memory (host_head stays 0), so drained must look at the slot at the tail; push_as_device writes slots the way a
    # kernel does, from the host.
    cmd = C.command.write(0, 16, 0, 0)
    host = C.Fifo(8, rank=0, fifo_id=1)
    assert host.drained
    host.push(cmd, 1.0)
    assert not host.drained
    assert host.pop() == cmd and host.drained

    gpu = C.Fifo(8, rank=0, fifo_id=2)
    assert gpu.drained
    assert gpu.push_as_device(cmd, 1.0) == 0 and gpu.push_as_device(cmd, 1.0) == 1
    assert gpu.producer == "device" and gpu.head == 0 and gpu.tail == 0
    assert not gpu.drained  # tail == host head == 0, yet two commands wait
    assert gpu.pop() == cmd and not gpu.drained
    assert gpu.pop() == cmd and gpu.drained and gpu.tail == 2


def test_gpu_style_pushes_wrap_the_ring_and_refuse_host_pushes(C):
    f = C.Fifo(4, rank=5, fifo_id=7)
    for i in range(10):  # several laps of a 4-slot ring, one command in it at a time
        cmd = C.command.write(0, 16, 0, 16 * i)
        assert f.push_as_device(cmd, 1.0) == i
        assert not f.drained
        assert f.pop() == cmd and f.drained
    with pytest.raises(C.ProxyError, match=r"rank 5 fifo 7: host push refused: GPU producers feed this FIFO"):
        f.push(C.command.quiet(), 1.0)
    h = C.Fifo(4, rank=5, fifo_id=8)
    h.push(C.command.quiet(), 1.0)
    with pytest.raises(C.ProxyError, match=r"rank 5 fifo 8: device view refused: host producers already pushed 1"):
        h.push_as_device(C.command.quiet(), 1.0)
