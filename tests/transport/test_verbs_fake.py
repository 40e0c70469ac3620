"""The verbs transport checked down to the ibv_* calls, through the recording fake table (no NIC needed)."""
from __future__ import annotations

import errno
import socket

import pytest

from verbs_fake_support import SKIP_REASON, K, calls, connect_all, cx7, efa, fake, verbs

if verbs is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


def _ranks(world, devices_per_rank=("mlx5_0",), **kw):
    return [verbs.VerbsTransport(r, world, list(devices_per_rank), **kw) for r in range(world)]


def _region_rkeys():
    """rkey of every region peers may write (not the local atomics scratch word), in registration order."""
    return [c["rkey"] for c in calls() if c["fn"] in ("ibv_reg_mr", "ibv_reg_dmabuf_mr") and "rkey" in c
            and c["access"] & K["IBV_ACCESS_REMOTE_WRITE"]]


def _qp_of(created, rank, world, peer):
    """QP numbers are handed out in creation order: rank r creates one RC QP per peer 0..world-1."""
    return created[rank * world + peer]


def test_batch_to_two_destinations_posts_one_linked_chain_per_destination(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(3)
    created = [c["qp_num"] for c in calls("ibv_create_qp")]
    bases = [buffers.new(1 << 16) for _ in ts]
    for t, b in zip(ts, bases):
        assert t.register_memory(b, 1 << 16) == 0
    rkeys = _region_rkeys()
    connect_all(ts)
    fake.clear_calls()
    reqs = [
        {"dst_rank": 1, "local_offset": 0, "remote_offset": 4096, "bytes": 512, "wr_id": 11},
        {"dst_rank": 2, "local_offset": 512, "remote_offset": 64, "bytes": 100, "imm": 0x01020304, "wr_id": 12},
        {"dst_rank": 1, "local_offset": 1024, "remote_offset": 8192, "bytes": 0, "imm": 0xdeadbeef, "wr_id": 13},
        {"dst_rank": 2, "local_offset": 2048, "remote_offset": 128, "bytes": 7, "wr_id": 14},
    ]
    assert ts[0].post_writes(reqs) == 4
    posts = calls("ibv_post_send")
    assert [p["qp_num"] for p in posts] == [_qp_of(created, 0, 3, 1), _qp_of(created, 0, 3, 2)]
    to1, to2 = posts[0]["wrs"], posts[1]["wrs"]
    # rank 1: a plain write then a zero-length write-with-immediate (a pure signal), linked, only the last signalled
    assert [w["opcode"] for w in to1] == [K["IBV_WR_RDMA_WRITE"], K["IBV_WR_RDMA_WRITE_WITH_IMM"]]
    assert [w["has_next"] for w in to1] == [1, 0] and [w["signaled"] for w in to1] == [0, 1]
    assert to1[0]["sge_length"] == 512 and to1[0]["sge_addr"] == bases[0] and to1[0]["num_sge"] == 1
    assert to1[1]["num_sge"] == 0
    assert to1[0]["remote_addr"] == bases[1] + 4096 and to1[1]["remote_addr"] == bases[1] + 8192
    assert to1[0]["rkey"] == rkeys[1] and to2[0]["rkey"] == rkeys[2]
    assert to1[1]["imm_data_raw"] == socket.htonl(0xdeadbeef)
    # rank 2
    assert [w["opcode"] for w in to2] == [K["IBV_WR_RDMA_WRITE_WITH_IMM"], K["IBV_WR_RDMA_WRITE"]]
    assert to2[0]["imm_data_raw"] == socket.htonl(0x01020304) and to2[0]["imm_data_raw"] != 0x01020304
    assert to2[0]["sge_addr"] == bases[0] + 512 and to2[0]["remote_addr"] == bases[2] + 64
    assert [w["signaled"] for w in to2] == [0, 1]
    # one local completion per request, although only two WRs were signalled
    done = ts[0].poll(16)
    assert sorted(c["wr_id"] for c in done) == [11, 12, 13, 14]
    assert all(c["kind"] == "local_write" and c["status"] == 0 and c["error"] == "" for c in done)


def test_long_batches_split_into_chains_of_max_chain(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2, max_chain=4)
    for t in ts:
        t.register_memory(buffers.new(1 << 12), 1 << 12)
    connect_all(ts)
    fake.clear_calls()
    assert ts[0].post_writes([{"dst_rank": 1, "bytes": 8, "local_offset": 8 * i, "remote_offset": 8 * i,
                               "wr_id": i} for i in range(10)]) == 10
    assert [len(p["wrs"]) for p in calls("ibv_post_send")] == [4, 4, 2]
    assert [c["wr_id"] for c in ts[0].poll(64)] == list(range(10))


def test_full_send_queue_accepts_only_a_prefix(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2, sq_depth=4)
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    fake.set_auto_complete(False)
    reqs = [{"dst_rank": 1, "bytes": 8, "wr_id": i} for i in range(6)]
    assert ts[0].post_writes(reqs) == 4
    assert ts[0].post_writes(reqs[4:]) == 0


def test_remote_immediate_reports_sender_rank_and_reposts_receive(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2, rq_depth=8)
    created = [c["qp_num"] for c in calls("ibv_create_qp")]
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    qp_on_rank1_from_rank0 = _qp_of(created, 1, 2, 0)
    assert fake.posted_recvs(qp_on_rank1_from_rank0) == 8
    fake.inject_recv(qp_on_rank1_from_rank0, imm=0xa1b2c3d4)
    (c,) = ts[1].poll(8)
    assert c["kind"] == "remote_imm" and c["src_rank"] == 0 and c["imm"] == 0xa1b2c3d4 and c["status"] == 0
    assert fake.posted_recvs(qp_on_rank1_from_rank0) == 8


def test_failed_completion_names_peer_status_and_fix(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2)
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    fake.fail_next_completion(K["IBV_WC_RETRY_EXC_ERR"], 0x81)
    ts[0].post_writes([{"dst_rank": 1, "bytes": 64, "wr_id": 1}, {"dst_rank": 1, "bytes": 64, "wr_id": 2}])
    done = ts[0].poll(8)
    assert [c["wr_id"] for c in done] == [1, 2]
    err = done[0]["error"]
    assert done[0]["status"] == K["IBV_WC_RETRY_EXC_ERR"]
    assert "to rank 1" in err and "mlx5_0" in err and "transport retry counter exceeded" in err
    assert "UCCL_IB_GID_INDEX" in err and "UCCL_IB_MAX_INFLIGHT" in err and "0x81" in err


def test_rc_queue_pairs_walk_init_rtr_rts_with_chosen_gid_sl_tc(fake_nics, buffers):
    fake_nics([cx7("mlx5_0", 0)])
    ts = _ranks(2)
    created = [c["qp_num"] for c in calls("ibv_create_qp")]
    assert all(c["qp_type"] == K["IBV_QPT_RC"] and c["sq_sig_all"] == 0 for c in calls("ibv_create_qp"))
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    qp = _qp_of(created, 0, 2, 1)
    steps = [c for c in calls("ibv_modify_qp") if c["qp_num"] == qp]
    assert [s["qp_state"] for s in steps] == [K["IBV_QPS_INIT"], K["IBV_QPS_RTR"], K["IBV_QPS_RTS"]]
    init, rtr, rts = steps
    assert init["port_num"] == 1 and init["qp_access_flags"] & K["IBV_ACCESS_REMOTE_WRITE"]
    assert init["qp_access_flags"] & K["IBV_ACCESS_REMOTE_ATOMIC"]
    assert rtr["ah_sgid_index"] == 3 and rtr["ah_is_global"] == 1      # RoCE v2 IPv4-mapped
    assert rtr["ah_sl"] == 3 and rtr["ah_traffic_class"] == 104         # IB/RoCE defaults
    assert rtr["ah_dgid"] == "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert rtr["dest_qp_num"] == _qp_of(created, 1, 2, 0)
    assert rts["retry_cnt"] == 7 and rts["rnr_retry"] == 7 and rts["timeout"] == 20
    assert "GID index 3" in ts[0].describe()[0]


def test_sl_tc_and_gid_index_settings_reach_the_queue_pair(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2, gid_index=[2], sl=5, tc=106)
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    rtr = [c for c in calls("ibv_modify_qp") if c["qp_state"] == K["IBV_QPS_RTR"]][0]
    assert (rtr["ah_sgid_index"], rtr["ah_sl"], rtr["ah_traffic_class"]) == (2, 5, 106)
    assert [c["index"] for c in calls("ibv_query_gid")] == [2, 2]


def test_gid_index_override_without_entry_is_a_clear_error(fake_nics):
    fake_nics([cx7("mlx5_0")])
    with pytest.raises(ValueError, match=r"UCCL_IB_GID_INDEX=9 names no GID of mlx5_0 port 1"):
        verbs.VerbsTransport(0, 1, ["mlx5_0"], gid_index=[9])


def test_native_atomics_post_fetch_and_add(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2)
    bases = [buffers.new(4096) for _ in ts]
    for t, b in zip(ts, bases):
        t.register_memory(b, 4096)
    rkeys = _region_rkeys()
    connect_all(ts)
    assert ts[0].caps()["native_atomics"] and ts[0].caps()["in_order"]
    fake.clear_calls()
    assert ts[0].post_atomics([{"dst_rank": 1, "remote_offset": 64, "add": 5, "wr_id": 77}]) == 1
    (w,) = calls("ibv_post_send")[0]["wrs"]
    assert w["opcode"] == K["IBV_WR_ATOMIC_FETCH_AND_ADD"] and w["compare_add"] == 5
    assert w["remote_addr"] == bases[1] + 64 and w["rkey"] == rkeys[-1] and w["sge_length"] == 8
    (c,) = ts[0].poll(4)
    assert c["kind"] == "local_atomic" and c["wr_id"] == 77
    with pytest.raises(ValueError, match="8-byte aligned"):
        ts[0].post_atomics([{"dst_rank": 1, "remote_offset": 3}])


def test_out_of_bounds_write_is_rejected_before_posting(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    ts = _ranks(2)
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    connect_all(ts)
    fake.clear_calls()
    with pytest.raises(ValueError, match="exceeds rank 1's region 0 of 4096 bytes"):
        ts[0].post_writes([{"dst_rank": 1, "remote_offset": 4000, "bytes": 200}])
    with pytest.raises(ValueError, match="dst_rank 5 out of range"):
        ts[0].post_writes([{"dst_rank": 5, "bytes": 1}])
    assert calls("ibv_post_send") == []


def test_efa_uses_srd_queue_pairs_address_handles_and_signals_every_write(fake_nics, buffers):
    fake_nics([efa("rdmap39s0", 0)])
    ts = _ranks(2, devices_per_rank=("rdmap39s0",), rq_depth=4)
    qps = calls("efadv_create_qp_ex")
    assert len(qps) == 2 and calls("ibv_create_qp") == []
    q = qps[0]
    assert q["qp_type"] == K["IBV_QPT_DRIVER"] and q["driver_qp_type"] == 0  # EFADV_QP_DRIVER_TYPE_SRD
    assert q["send_ops_flags"] & K["IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM"] and q["sl"] == 8
    states = [c for c in calls("ibv_modify_qp") if c["qp_num"] == q["qp_num"]]
    assert [s["qp_state"] for s in states] == [K["IBV_QPS_INIT"], K["IBV_QPS_RTR"], K["IBV_QPS_RTS"]]
    assert states[0]["qkey"] != 0
    bases = [buffers.new(4096) for _ in ts]
    for t, b in zip(ts, bases):
        t.register_memory(b, 4096)
    connect_all(ts)
    caps = ts[0].caps()
    assert caps["name"] == "verbs-srd" and not caps["in_order"] and not caps["native_atomics"]
    ahs = calls("ibv_create_ah")
    fake.clear_calls()
    ts[0].post_writes([{"dst_rank": 1, "bytes": 256, "remote_offset": 512, "imm": 7, "wr_id": 1},
                       {"dst_rank": 1, "bytes": 0, "imm": 8, "wr_id": 2},
                       {"dst_rank": 1, "bytes": 16, "wr_id": 3}])
    (chain,) = calls("ibv_wr_complete")
    wrs = chain["wrs"]
    assert [w["opcode"] for w in wrs] == [K["IBV_WR_RDMA_WRITE_WITH_IMM"]] * 2 + [K["IBV_WR_RDMA_WRITE"]]
    assert all(w["signaled"] == 1 for w in wrs)           # SRD completes out of order: no selective signalling
    assert [w["imm_data_raw"] for w in wrs[:2]] == [socket.htonl(7), socket.htonl(8)]
    assert {w["remote_qpn"] for w in wrs} == {qps[1]["qp_num"]}
    assert wrs[0]["remote_addr"] == bases[1] + 512 and wrs[1]["num_sge"] == 0 and wrs[0]["sge_length"] == 256
    ah_to_1 = [a for a in ahs if a["dgid"].endswith("fe00:0000")][1]["ahn"]  # rank 0's AH for rank 1
    assert {w["ahn"] for w in wrs} == {ah_to_1}
    assert sorted(c["wr_id"] for c in ts[0].poll(8)) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="no native atomics"):
        ts[0].post_atomics([{"dst_rank": 1}])
    # receive side: the sender is found from (address handle number, source QP)
    ah_on_1_for_0 = ahs[2]["ahn"]                          # rank 1's AHs were created after rank 0's two
    fake.inject_recv(qps[1]["qp_num"], src_qp=qps[0]["qp_num"], slid=ah_on_1_for_0, imm=0x55)
    (c,) = ts[1].poll(4)
    assert (c["kind"], c["src_rank"], c["imm"]) == ("remote_imm", 0, 0x55)
    assert fake.posted_recvs(qps[1]["qp_num"]) == 4


def test_device_memory_registers_through_dmabuf_when_exported(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")], dmabuf=True)
    t = verbs.VerbsTransport(0, 1, ["mlx5_0"])
    base = buffers.new(1 << 20) + 100
    t.register_memory(base, 4096, device=True)
    (d,) = calls("ibv_reg_dmabuf_mr")
    assert d["iova"] == base and d["offset"] == base & 4095 and d["length"] == 4096 and d["fd_valid"] == 1
    assert d["access"] & K["IBV_ACCESS_REMOTE_WRITE"]
    assert [c for c in calls("ibv_reg_mr") if c["addr"] == base] == []
    t.register_dmabuf(base, 4096, fd=0, offset=4096)
    assert calls("ibv_reg_dmabuf_mr")[-1]["offset"] == 4096


def test_device_memory_without_dmabuf_or_peermem_names_the_missing_module(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")], dmabuf=False)
    t = verbs.VerbsTransport(0, 1, ["mlx5_0"])
    fake.fail_next("ibv_reg_mr", errno.EINVAL)
    with pytest.raises(RuntimeError) as info:
        t.register_memory(buffers.new(4096), 4096, device=True)
    msg = str(info.value)
    assert "Invalid argument" in msg and "mlx5_0" in msg and "GPU memory" in msg
    assert "modprobe nvidia_peermem" in msg and "efa_nv_peermem" in msg and "dmabuf" in msg


def test_several_nics_per_gpu_stripe_destinations(fake_nics, buffers):
    fake_nics([efa("rdmap39s0", 0), efa("rdmap40s0", 1)])
    t0 = verbs.VerbsTransport(0, 4, ["rdmap39s0", "rdmap40s0"])
    others = [verbs.VerbsTransport(r, 4, ["rdmap39s0", "rdmap40s0"]) for r in (1, 2, 3)]
    ts = [t0, *others]
    for t in ts:
        t.register_memory(buffers.new(4096), 4096)
    assert len(_region_rkeys()) == 8                   # every region on both NICs
    connect_all(ts)
    fake.clear_calls()
    t0.post_writes([{"dst_rank": r, "bytes": 8, "imm": r} for r in (1, 2, 3)])
    chains = calls("ibv_wr_complete")
    assert len(chains) == 3
    used = [c["qp_num"] for c in chains]
    assert used[0] == used[2] != used[1]                # ranks 1 and 3 on the second NIC, rank 2 on the first


def test_mixing_efa_and_roce_devices_is_refused(fake_nics):
    fake_nics([efa("rdmap39s0"), cx7("mlx5_0")])
    with pytest.raises(ValueError, match="cannot mix EFA and IB/RoCE"):
        verbs.VerbsTransport(0, 1, ["rdmap39s0", "mlx5_0"])


def test_unknown_device_lists_what_exists(fake_nics):
    fake_nics([cx7("mlx5_0")])
    with pytest.raises(RuntimeError, match=r"'mlx5_9' not found \(this host has: mlx5_0\); fix UCCL_IB_HCA"):
        verbs.VerbsTransport(0, 1, ["mlx5_9"])


def test_no_rdma_device_says_so(fake_nics):
    fake_nics([])
    with pytest.raises(RuntimeError, match="no RDMA device found.*UCCL_EP_TRANSPORT=loopback"):
        verbs.VerbsTransport(0, 1, ["mlx5_0"])


def test_register_after_local_info_is_refused(fake_nics, buffers):
    fake_nics([cx7("mlx5_0")])
    t = verbs.VerbsTransport(0, 1, ["mlx5_0"])
    t.local_info()
    with pytest.raises(RuntimeError, match="after local_info"):
        t.register_memory(buffers.new(64), 64)


def test_system_library_on_a_host_without_nics_reports_no_device():
    status = verbs.library_status()
    if not status["libibverbs"]:
        assert "libibverbs" in status["error"] and "install" in status["error"]
        return
    import os
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    with pytest.raises(RuntimeError, match="no RDMA device found"):
        verbs.VerbsTransport(0, 1, ["mlx5_0"])
