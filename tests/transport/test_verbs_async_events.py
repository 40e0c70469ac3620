"""Asynchronous ibv events (ibv_get_async_event): a port going down, a QP/CQ/device error reach the transport only
this way, never as a completion of their own. Checked through the recording fake, whose contexts have a pipe as
async fd (one byte per queued event) so the transport's fcntl/poll work on it as on a real uverbs fd.

Fatal events fail the transport (an error completion, which the proxy turns into its error) naming the device, the
event and the peer rank; benign ones are acknowledged, counted in debug_state() and change nothing; every event the
transport reads is acknowledged (ibv_destroy_qp / ibv_close_device wait for those acks).
"""
from __future__ import annotations

import gc
import os
import time

import pytest

from verbs_fake_support import SKIP_REASON, K, calls, connect_all, cx7, efa, fake, verbs

if verbs is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from uccl_ep_train import comm, native  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

POLLS = 200  # more than the transport's check interval (every 64th poll, and the first)


def _ranks(world, devices=("mlx5_0",), **kw):
    return [verbs.VerbsTransport(r, world, list(devices), **kw) for r in range(world)]


def _connected(fake_nics, buffers, world=2, devices=("mlx5_0",), nics=None, **kw):
    fake_nics(nics or [cx7(d, i) for i, d in enumerate(devices)])
    ts = _ranks(world, devices=devices, **kw)
    for t in ts:
        t.register_memory(buffers.new(1 << 16), 1 << 16)
    connect_all(ts)
    return ts


def _rc_qp(rank, peer, world=2):
    """QP numbers in creation order: rank by rank, one RC QP per peer."""
    return [c["qp_num"] for c in calls("ibv_create_qp")][rank * world + peer]


def _poll_until_error(t, polls=POLLS):
    seen = []
    for _ in range(polls):
        got = t.poll(64)
        seen += got
        errs = [c for c in got if c["status"] != 0]
        if errs:
            return errs[0], seen
    return None, seen


def _all_acked():
    n = fake.async_counts()
    return n["injected"] == n["delivered"] == n["acked"] and n["bad_acks"] == 0 and n["blocking_reads"] == 0


# ------------------------------------------------------------------------------------------ transport level
def test_every_context_async_fd_is_made_non_blocking_so_reading_events_never_blocks_the_proxy(fake_nics, buffers):
    ts = _connected(fake_nics, buffers, devices=("mlx5_0", "mlx5_1"))
    fds = fake.async_fds("mlx5_0") + fake.async_fds("mlx5_1")
    assert len(fds) == 4 and all(not os.get_blocking(fd) for fd in fds)  # 2 ranks x 2 devices, each its own context
    for t in ts:
        for _ in range(POLLS):
            assert t.poll(8) == []
    assert fake.async_counts()["blocking_reads"] == 0


@pytest.mark.parametrize("event,text", [("IBV_EVENT_QP_FATAL", "catastrophic"),
                                        ("IBV_EVENT_QP_REQ_ERR", "invalid request"),
                                        ("IBV_EVENT_QP_ACCESS_ERR", "access violation")])
def test_qp_error_event_fails_the_transport_naming_device_event_and_the_qps_peer_rank(fake_nics, buffers, event,
                                                                                       text):
    ts = _connected(fake_nics, buffers)
    assert fake.inject_async_event(K[event], qp_num=_rc_qp(0, 1)) == 1
    err, _ = _poll_until_error(ts[0])
    assert err is not None, "the event never failed the transport"
    msg = err["error"]
    assert msg.startswith("verbs: asynchronous event on mlx5_0 (rank 0): ") and event in msg and text in msg, msg
    assert f"on qp {_rc_qp(0, 1)} to rank 1" in msg and err["src_rank"] == 1
    assert "dmesg" in msg or "rkey" in msg or "builds" in msg  # the likely cause follows
    assert "failed by " + event + " on mlx5_0" in ts[0].debug_state()
    assert ts[1].poll(8) == [] and _all_acked()


@pytest.mark.parametrize("event,subject", [
    ("IBV_EVENT_CQ_ERR", "on the completion queue of mlx5_0, serving ranks 0, 1"),
    ("IBV_EVENT_DEVICE_FATAL", "carrying ranks 0, 1")])
def test_cq_and_device_errors_fail_the_transport_naming_every_rank_on_that_device(fake_nics, buffers, event, subject):
    ts = _connected(fake_nics, buffers)
    if event == "IBV_EVENT_CQ_ERR":
        fake.inject_async_event(K[event], qp_num=_rc_qp(0, 1))
    else:
        assert fake.inject_async_event(K[event], device="mlx5_0") == 2  # every open context of the device
    err, _ = _poll_until_error(ts[0])
    assert err is not None and event in err["error"] and subject in err["error"], err
    assert "mlx5_0" in err["error"] and err["src_rank"] == -1


def test_port_error_on_our_port_fails_naming_the_port_and_on_another_port_is_ignored(fake_nics, buffers):
    ts = _connected(fake_nics, buffers)
    fake.inject_async_event(K["IBV_EVENT_PORT_ERR"], device="mlx5_0", port=2)  # not the port the transport uses
    err, _ = _poll_until_error(ts[0])
    assert err is None and "1 asynchronous events acknowledged and ignored" in ts[0].debug_state()
    fake.inject_async_event(K["IBV_EVENT_PORT_ERR"], device="mlx5_0", port=1)
    err, _ = _poll_until_error(ts[0])
    assert err is not None
    msg = err["error"]
    assert "asynchronous event on mlx5_0" in msg and "IBV_EVENT_PORT_ERR" in msg and "on port 1" in msg, msg
    assert "link went down" in msg and "UCCL_IB_HCA" in msg
    for t in ts:  # rank 1's context got its copy too
        _poll_until_error(t)
    assert _all_acked()


def test_benign_events_are_acknowledged_counted_and_change_nothing(fake_nics, buffers):
    ts = _connected(fake_nics, buffers)
    for ev in ("IBV_EVENT_PORT_ACTIVE", "IBV_EVENT_LID_CHANGE", "IBV_EVENT_GID_CHANGE", "IBV_EVENT_PKEY_CHANGE",
               "IBV_EVENT_SM_CHANGE", "IBV_EVENT_CLIENT_REREGISTER"):
        fake.inject_async_event(K[ev], device="mlx5_0")
    for ev in ("IBV_EVENT_COMM_EST", "IBV_EVENT_SQ_DRAINED"):
        fake.inject_async_event(K[ev], qp_num=_rc_qp(0, 1))
    before = ts[0].debug_state()
    err, seen = _poll_until_error(ts[0])
    assert err is None and seen == []
    state = ts[0].debug_state()
    assert "8 asynchronous events acknowledged and ignored (last: IBV_EVENT_SQ_DRAINED on mlx5_0 on qp" in state
    assert state.startswith(before) and "failed" not in state
    # the transport still works: writes complete, immediates arrive
    assert ts[0].post_writes([{"dst_rank": 1, "bytes": 64, "wr_id": 7}]) == 1
    assert [(c["wr_id"], c["status"]) for c in ts[0].poll(8)] == [(7, 0)]
    fake.inject_recv(_rc_qp(1, 0), imm=5)
    assert [(c["src_rank"], c["imm"], c["status"]) for c in ts[1].poll(8)] == [(0, 5, 0)]
    for t in ts:
        _poll_until_error(t)
    assert _all_acked()


def test_every_event_read_is_acknowledged_once_fatal_or_not(fake_nics, buffers):
    ts = _connected(fake_nics, buffers, world=3, devices=("mlx5_0", "mlx5_1"))
    fake.inject_async_event(K["IBV_EVENT_GID_CHANGE"], device="mlx5_1")
    fake.inject_async_event(K["IBV_EVENT_COMM_EST"], qp_num=_rc_qp(2, 0, world=3))
    fake.inject_async_event(K["IBV_EVENT_QP_FATAL"], qp_num=_rc_qp(1, 2, world=3))
    fake.inject_async_event(K["IBV_EVENT_PORT_ACTIVE"], device="mlx5_0")
    for t in ts:
        _poll_until_error(t)
    n = fake.async_counts()
    assert n["injected"] == 3 + 1 + 1 + 3 and _all_acked(), n
    got = [c["event_type"] for c in calls("ibv_get_async_event")]
    acked = [c["event_type"] for c in calls("ibv_ack_async_event")]
    assert sorted(got) == sorted(acked) and len(got) == n["injected"]


def test_a_failed_completion_reads_pending_events_at_once_so_the_cause_comes_before_its_flushes(fake_nics, buffers):
    ts = _connected(fake_nics, buffers)
    ts[0].poll(8)  # past the transport's first periodic check: the next one is many polls away
    fake.inject_async_event(K["IBV_EVENT_QP_FATAL"], qp_num=_rc_qp(0, 1))
    fake.fail_next_completion(K["IBV_WC_WR_FLUSH_ERR"])
    ts[0].post_writes([{"dst_rank": 1, "bytes": 64, "wr_id": 1}])
    first = ts[0].poll(8)
    assert len(first) == 2 and all(c["status"] != 0 for c in first)
    assert "IBV_EVENT_QP_FATAL" in first[0]["error"] and "Flush" in first[1]["error"]


def test_fatal_event_on_the_shared_srd_queue_pair_names_every_rank_it_carries(fake_nics, buffers):
    ts = _connected(fake_nics, buffers, devices=("rdmap39s0",), nics=[efa("rdmap39s0")])
    srd_qp_of_rank0 = [c["qp_num"] for c in calls("efadv_create_qp_ex")][0]
    fake.inject_async_event(K["IBV_EVENT_QP_FATAL"], qp_num=srd_qp_of_rank0)
    err, _ = _poll_until_error(ts[0])
    assert err is not None and f"on SRD qp {srd_qp_of_rank0}, shared by ranks 0, 1" in err["error"]
    assert "rdmap39s0" in err["error"]


# ------------------------------------------------------------------------------------------ through the proxy
@pytest.fixture
def proxies():
    """Two ranks, one proxy thread each, on fake ConnectX-7 NICs: connected and started."""
    fake.install([cx7("mlx5_0", 0), cx7("mlx5_1", 1)], False)
    comms = [comm.HostComm(1 << 16, r, 2, settings=load_settings({}), ib_devices=[f"mlx5_{r}"], ib_gid_index=[3],
                           num_threads=1, fifos_per_thread=1, timeout_secs=20.0, transport="verbs")
             for r in range(2)]
    infos = [c.local_infos() for c in comms]
    for c in comms:
        c.connect_infos(infos)
    for c in comms:
        c.start()
    yield comms
    for c in comms:
        c.close(deliver=False)
    gc.collect()
    fake.uninstall()


def _proxy_error(c, within=2.0):
    deadline = time.monotonic() + within
    while not c.proxy.error and time.monotonic() < deadline:
        time.sleep(0.005)
    return c.proxy.error


def test_qp_fatal_event_fails_the_running_proxy_within_moments_naming_device_event_and_peer_rank(proxies):
    qp_to_rank1 = [c["qp_num"] for c in calls("ibv_create_qp")][1]
    t0 = time.monotonic()
    fake.inject_async_event(K["IBV_EVENT_QP_FATAL"], qp_num=qp_to_rank1)
    err = _proxy_error(proxies[0])
    assert err, "the proxy never noticed the QP fatal event"
    assert time.monotonic() - t0 < 2.0
    assert "rank 0 proxy thread 0: transport error: verbs: asynchronous event on mlx5_0" in err, err
    assert "IBV_EVENT_QP_FATAL" in err and f"qp {qp_to_rank1} to rank 1" in err
    with pytest.raises(Exception, match="IBV_EVENT_QP_FATAL"):
        proxies[0].check()
    assert not proxies[1].proxy.error  # the other rank's NIC reported nothing
    assert _all_acked()


def test_port_error_fails_the_running_proxy_naming_the_device_and_port(proxies):
    fake.inject_async_event(K["IBV_EVENT_PORT_ERR"], device="mlx5_1", port=1)
    err = _proxy_error(proxies[1])
    assert "rank 1 proxy thread 0: transport error: verbs: asynchronous event on mlx5_1" in err, err
    assert "IBV_EVENT_PORT_ERR" in err and "on port 1" in err
    assert not proxies[0].proxy.error


def test_benign_event_leaves_the_running_proxy_working_and_shows_in_describe(proxies):
    C = native.module()
    fake.inject_async_event(K["IBV_EVENT_PORT_ACTIVE"], device="mlx5_0")
    deadline = time.monotonic() + 2
    while fake.async_counts()["acked"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _all_acked()
    proxies[0].push(0, C.command.write(1, 16, 0, 64))
    proxies[0].wait_idle(10)
    assert not proxies[0].proxy.error
    assert "1 asynchronous events acknowledged and ignored (last: IBV_EVENT_PORT_ACTIVE on mlx5_0 on port 1)" in \
        proxies[0].proxy.describe()
