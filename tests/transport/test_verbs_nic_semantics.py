"""What a real NIC / provider does that a naive fake would not: checked through the recording fake ibv table.

Each test names a provider behaviour from rdma-core (libefa's efa_post_recv, CQ overrun, efadv device caps, the
initiator vs responder RDMA-read/atomic depths) and proves the transport copes with it. See /work/notes/verbs-review.md.
"""
from __future__ import annotations

import errno

import pytest

from verbs_fake_support import SKIP_REASON, K, calls, connect_all, cx7, efa, fake, verbs

if verbs is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


def _ranks(world, devices=("mlx5_0",), **kw):
    return [verbs.VerbsTransport(r, world, list(devices), **kw) for r in range(world)]


def _connect(ts, buffers, nbytes=4096):
    """Register an ``nbytes`` buffer on every rank and connect them all (the setup most tests share)."""
    for t in ts:
        t.register_memory(buffers.new(nbytes), nbytes)
    connect_all(ts)
    return ts


def _local_write_lkeys():
    """lkeys of the local-only registrations (the receive scratch buffer and the atomics scratch word)."""
    out = set()
    for c in calls("ibv_reg_mr"):
        if "rkey" in c and c["access"] == K["IBV_ACCESS_LOCAL_WRITE"]:
            out.add(c["rkey"] - 1)  # the fake hands out lkey, rkey = n, n + 1
    return out


@pytest.mark.parametrize("nic", ["roce", "efa"])
def test_every_receive_carries_one_registered_sge_since_efa_drops_zero_sge_receives(fake_nics, buffers, nic):
    # libefa's efa_post_recv writes an RX descriptor per SGE: a receive with num_sge = 0 is accepted but never reaches
    # the device, so every write-with-immediate would meet RNR. The fake models that on SRD QPs.
    dev = efa("rdmap39s0") if nic == "efa" else cx7("mlx5_0")
    fake_nics([dev])
    ts = _ranks(2, devices=(dev["name"],), rq_depth=4)
    posts = calls("ibv_post_recv")
    assert posts and all(p["total_sge"] == p["count"] for p in posts)
    assert all(p["sge_lkey"] in _local_write_lkeys() and p["sge_length"] > 0 for p in posts)
    _connect(ts, buffers)
    if nic == "efa":
        qpn = [c["qp_num"] for c in calls("efadv_create_qp_ex")]
        assert fake.posted_recvs(qpn[1]) == 4
        ahn_on_1_for_0 = calls("ibv_create_ah")[2]["ahn"]
        fake.inject_recv(qpn[1], src_qp=qpn[0], slid=ahn_on_1_for_0, imm=3)
    else:
        qpn_on_1_from_0 = [c["qp_num"] for c in calls("ibv_create_qp")][2]
        fake.inject_recv(qpn_on_1_from_0, imm=3)
    (c,) = ts[1].poll(4)
    assert (c["src_rank"], c["imm"], c["status"]) == (0, 3, 0)
    repost = calls("ibv_post_recv")[-1]
    assert repost["count"] == 1 and repost["total_sge"] == 1


def test_cq_holds_every_signalled_send_and_posted_receive_of_its_queue_pairs(fake_nics, buffers):
    # One CQ per device serves all its QPs; an overrun is an asynchronous CQ error that kills every QP on it. With
    # 4 peers x (64 sends + 64 receives) a 256-entry CQ (the requested cq_depth) would overrun.
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(4, sq_depth=64, rq_depth=64, cq_depth=256, max_chain=1)
    qps = calls("ibv_create_qp")[:4]                        # rank 0's QPs, to ranks 0..3
    (cq,) = [c for c in calls("ibv_create_cq")][:1]
    assert cq["cqe"] >= sum(q["max_send_wr"] + q["max_recv_wr"] for q in qps)
    _connect(ts, buffers, 1 << 16)
    # rank 0 stops polling while every peer fills its receive queue and it fills every send queue
    for q in qps:
        for _ in range(q["max_recv_wr"]):
            fake.inject_recv(q["qp_num"], imm=1)
    for dst in range(4):
        reqs = [{"dst_rank": dst, "bytes": 8, "wr_id": i} for i in range(qps[dst]["max_send_wr"])]
        assert ts[0].post_writes(reqs) == qps[dst]["max_send_wr"]
    assert calls("cq_overrun") == []
    got = ts[0].poll(100000)
    assert len(got) == 4 * 64 + 4 * 64


@pytest.mark.parametrize("limit", [None, 64 << 10], ids=["default-1MiB", "device-64KiB"])
def test_efa_write_size_limit_comes_from_efadv_max_rdma_size(fake_nics, buffers, limit):
    # ibv_query_port's max_msg_sz on EFA is the SEND limit; RDMA writes are bounded by efadv max_rdma_size (the fake
    # EFA reports 1 MiB unless told otherwise), and a larger write must be refused before it reaches the NIC.
    fake_nics([efa("rdmap39s0") | ({"efa_max_rdma_size": limit} if limit else {})])
    limit = limit or 1 << 20
    ts = _ranks(2, devices=("rdmap39s0",))
    (q, _) = calls("efadv_query_device")
    assert q["inlen"] >= 32                                  # up to max_rdma_size (rdma-core >= 46 layout)
    assert ts[0].caps()["max_write_bytes"] == limit
    _connect(ts, buffers, 4 << 20)
    with pytest.raises(ValueError, match="message limit"):
        ts[0].post_writes([{"dst_rank": 1, "bytes": limit + 1}])
    assert ts[0].post_writes([{"dst_rank": 1, "bytes": limit}]) == 1


def test_efa_device_query_failure_names_efadv_and_the_fix(fake_nics):
    fake_nics([efa("rdmap39s0")])
    fake.fail_next("efadv_query_device", errno.EOPNOTSUPP)
    with pytest.raises(RuntimeError, match="efadv_query_device.*rdmap39s0.*rdma-core"):
        verbs.VerbsTransport(0, 1, ["rdmap39s0"])


def _connected_srd_pair(fake_nics, buffers):
    """Two ranks on one fake EFA device, 4 receives posted each: the transports and their SRD QP numbers."""
    fake_nics([efa("rdmap39s0")])
    ts = _connect(_ranks(2, devices=("rdmap39s0",), rq_depth=4), buffers)
    qpn = [c["qp_num"] for c in calls("efadv_create_qp_ex")]
    return ts, qpn


def test_stray_srd_immediate_from_an_unknown_sender_still_replaces_its_receive(fake_nics, buffers):
    # The SRD QP is shared by every peer of the device: a receive consumed by traffic nobody can attribute must be
    # re-posted too, or strays would slowly drain the queue and real peers would hit RNR.
    ts, qpn = _connected_srd_pair(fake_nics, buffers)
    fake.inject_recv(qpn[1], src_qp=0xdead, slid=0x777, imm=1)
    (c,) = ts[1].poll(4)
    assert c["status"] != 0 and "unknown sender" in c["error"]
    assert fake.posted_recvs(qpn[1]) == 4


def test_failed_srd_receive_names_no_sender_and_is_replaced(fake_nics, buffers):
    # ibv_poll_cq(3): after a failed completion only wr_id, status, qp_num and vendor_err are valid, so slid/src_qp
    # cannot name the sender; the SRD QP stays usable, so the consumed receive is posted again.
    ts, qpn = _connected_srd_pair(fake_nics, buffers)
    ahn_on_1_for_0 = calls("ibv_create_ah")[2]["ahn"]
    fake.inject_recv(qpn[1], src_qp=qpn[0], slid=ahn_on_1_for_0, imm=1, status=K["IBV_WC_REM_ACCESS_ERR"])
    (c,) = ts[1].poll(4)
    assert c["status"] == K["IBV_WC_REM_ACCESS_ERR"] and c["src_rank"] == -1 and "unnamed sender" in c["error"]
    assert fake.posted_recvs(qpn[1]) == 4


# ------------------------------------------------------------------ device limits given to the fake NIC
def test_efa_device_without_rdma_write_capability_is_refused_with_the_generation_and_versions_needed(fake_nics):
    # efadv device_caps without EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE (8): libefa would later fail efadv_create_qp_ex
    # with a bare EOPNOTSUPP; the transport refuses up front and says what is needed.
    fake_nics([efa("rdmap39s0") | {"efa_device_caps": 1 | 2}])
    with pytest.raises(RuntimeError, match=r"rdmap39s0 reports no RDMA write \(efadv device_caps 0x3\).*p5.*"
                                           r"EFA driver >= 2\.1 and rdma-core >= 46"):
        verbs.VerbsTransport(0, 2, ["rdmap39s0"])
    assert calls("efadv_create_qp_ex") == []


def test_small_max_cqe_shrinks_queue_depths_so_the_cq_holds_every_completion(fake_nics, buffers):
    # 4 peers x (1024 sends + 1024 receives) need 8192 CQEs; a NIC with max_cqe 512 cannot hold that, so each QP gets
    # 64 + 64 and the CQ (<= max_cqe, else create_cq fails) still holds everything they can have outstanding.
    fake_nics([cx7("mlx5_0") | {"max_cqe": 512}])
    ts = _ranks(4, sq_depth=1024, rq_depth=1024, max_chain=1)
    cq = calls("ibv_create_cq")[0]
    qps = calls("ibv_create_qp")[:4]  # rank 0's QPs, to ranks 0..3
    assert cq["cqe"] <= 512
    assert all(q["max_send_wr"] < 1024 and q["max_recv_wr"] < 1024 for q in qps)
    assert cq["cqe"] >= sum(q["max_send_wr"] + q["max_recv_wr"] for q in qps)
    posted = sum(p["count"] for p in calls("ibv_post_recv")[:4])
    assert posted == sum(q["max_recv_wr"] for q in qps)  # receives fill exactly the shrunken receive queues
    _connect(ts, buffers, 1 << 16)
    for q in qps:  # rank 0 stops polling while peers fill its receive queues and it fills its send queues
        for _ in range(q["max_recv_wr"]):
            fake.inject_recv(q["qp_num"], imm=1)
    for dst, q in enumerate(qps):
        reqs = [{"dst_rank": dst, "bytes": 8, "wr_id": i} for i in range(q["max_send_wr"] + 1)]
        assert ts[0].post_writes(reqs) == q["max_send_wr"]  # the send queue depth is enforced, not just requested
    assert calls("cq_overrun") == []
    assert len(ts[0].poll(100000)) == sum(q["max_send_wr"] + q["max_recv_wr"] for q in qps)


@pytest.mark.parametrize("limits,responder,initiator", [({}, 16, 8), ({"max_qp_rd_atom": 4, "max_qp_init_rd_atom": 2},
                                                                    4, 2)], ids=["cx7", "broadcom-like"])
def test_rc_depths_follow_the_responder_and_initiator_limits_the_device_reports(fake_nics, buffers, limits,
                                                                                responder, initiator):
    # max_dest_rd_atomic (responder) <= max_qp_rd_atom and max_rd_atomic (initiator) <= max_qp_init_rd_atom, as
    # ibv_query_device(3) reports them (the fake CX-7: 16 and 8; a Broadcom-like NIC with asymmetric limits: 4 and
    # 2); a provider rejects RTR/RTS above them with EINVAL.
    fake_nics([cx7("mlx5_0") | limits])
    _connect(_ranks(2), buffers)
    mods = calls("ibv_modify_qp")
    rtr = [m for m in mods if m["qp_state"] == K["IBV_QPS_RTR"]]
    rts = [m for m in mods if m["qp_state"] == K["IBV_QPS_RTS"]]
    assert rtr and {m["max_dest_rd_atomic"] for m in rtr} == {responder}
    assert rts and {m["max_rd_atomic"] for m in rts} == {initiator}
