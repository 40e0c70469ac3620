"""A HostComm configured for verbs, end to end through the proxy threads down to the ibv_* calls (recording fake):
transport choice from topology.plan() and settings, the chains a few write+signal commands become, and a peer's
immediate landing in the signal buffer. No NIC needed."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from verbs_fake_support import SKIP_REASON, K, calls, cx7, fake, verbs

from uccl_ep_train import comm, native, topology
from uccl_ep_train.settings import SettingsError, load_settings

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")
THREADS, WORLD = 2, 2
ENV = {"UCCL_EP_TRANSPORT": "verbs", "UCCL_EP_NUM_PROXY_THREADS": str(THREADS), "UCCL_EP_FIFOS_PER_THREAD": "1",
       "UCCL_IB_SL": "5", "UCCL_IB_TC": "96", "UCCL_EP_CPU_TIMEOUT_SECS": "20"}

needs_verbs = pytest.mark.skipif(verbs is None, reason=SKIP_REASON)


def _topo(host):
    return topology.discover(os.path.join(FIXTURES, host), use_tools=False)


def _qp(created, rank, thread, peer):
    """QPs are created rank by rank, proxy thread by thread, one per peer."""
    return created[(rank * THREADS + thread) * WORLD + peer]


def _imm(slot, value):  # in-order transport: slot[31:18] | negative[17] | magnitude[16:0]
    return (slot << 18) | value


@needs_verbs
def test_verbs_proxy_posts_write_signal_chains_and_applies_injected_immediate(fake_nics):
    fake_nics([cx7("mlx5_0", 0), cx7("mlx5_1", 1)])
    settings, topo = load_settings(ENV), _topo("cx7_roce")
    comms = [comm.HostComm(1 << 16, r, WORLD, settings=settings, gpu=r, topology=topo) for r in range(WORLD)]
    try:
        for r, c in enumerate(comms):  # topology.plan(): GPU r -> mlx5_r, RoCE v2 IPv4-mapped GID 3; SL/TC settings
            assert c.options["transport"] == "verbs" and c.options["ib_devices"] == [f"mlx5_{r}"]
            assert c.options["ib_gid_index"] == [3] and (c.options["ib_sl"], c.options["ib_tc"]) == (5, 96)
            assert c.proxy.caps["name"] == "verbs-rc" and c.proxy.caps["in_order"]
        assert [x["device"] for x in calls("ibv_open_device")] == ["mlx5_0"] * THREADS + ["mlx5_1"] * THREADS
        created = [x["qp_num"] for x in calls("ibv_create_qp")]
        assert len(created) == WORLD * THREADS * WORLD  # one endpoint per proxy thread, one RC QP per peer
        regs = calls("ibv_reg_mr")
        # region 0 = data, region 1 = signals, registered by every thread's transport; thread 0 of rank 1's keys:
        data_rkey = [x["rkey"] for x in regs if x["addr"] == comms[1].buffer.ptr][0]
        sig_rkey = [x["rkey"] for x in regs if x["addr"] == comms[1].proxy.signals_ptr][0]
        for r in range(WORLD):
            assert sum(x["addr"] == comms[r].buffer.ptr for x in regs) == THREADS

        infos = [c.local_infos() for c in comms]
        for c in comms:
            c.connect_infos(infos)
        rtr = [x for x in calls("ibv_modify_qp") if x["qp_state"] == K["IBV_QPS_RTR"]]
        assert len(rtr) == len(created)
        assert all(x["ah_sgid_index"] == 3 and x["ah_traffic_class"] == 96 and x["ah_sl"] == 5 and x["ah_is_global"]
                   for x in rtr)

        rng = np.random.default_rng(7)
        comms[0].data()[:] = rng.integers(1, 256, size=1 << 16, dtype=np.uint8)
        cmd = native.module().command
        pushed = [cmd.write_signal(1, 256, 0, 4096, slot=2, value=3),
                  cmd.write(1, 64, 512, 8192),
                  cmd.write_signal(0, 128, 1024, 16384, slot=7, value=1),  # to itself: its own QP, its own chain
                  cmd.write_signal(1, 0, 0, 0, slot=5, value=2),           # a pure signal
                  cmd.atomic(1, slot=9, add=-4)]                            # native fetch-add on the signal region
        for x in pushed:  # pushed before the threads start, so one proxy round takes all of them
            comms[0].push(0, x)
        fake.clear_calls()
        for c in comms:
            c.start()
        comms[0].wait_idle(10)

        posts = calls("ibv_post_send")
        assert [p["qp_num"] for p in posts] == [_qp(created, 0, 0, 0), _qp(created, 0, 0, 1), _qp(created, 0, 0, 1)]
        (to_self,), to_peer, (atomic,) = posts[0]["wrs"], posts[1]["wrs"], posts[2]["wrs"]
        assert to_self["opcode"] == K["IBV_WR_RDMA_WRITE_WITH_IMM"] and to_self["signaled"] == 1
        assert to_self["imm_data_raw"] == socket.htonl(_imm(7, 1))
        assert to_self["remote_addr"] == comms[0].buffer.ptr + 16384 and to_self["sge_length"] == 128
        assert [w["opcode"] for w in to_peer] == [K["IBV_WR_RDMA_WRITE_WITH_IMM"], K["IBV_WR_RDMA_WRITE"],
                                                  K["IBV_WR_RDMA_WRITE_WITH_IMM"]]
        assert [w["has_next"] for w in to_peer] == [1, 1, 0] and [w["signaled"] for w in to_peer] == [0, 0, 1]
        assert [w["num_sge"] for w in to_peer] == [1, 1, 0]
        assert [w["sge_length"] for w in to_peer[:2]] == [256, 64]
        assert [w["sge_addr"] for w in to_peer[:2]] == [comms[0].buffer.ptr, comms[0].buffer.ptr + 512]
        assert [w["remote_addr"] for w in to_peer] == [comms[1].buffer.ptr + 4096, comms[1].buffer.ptr + 8192,
                                                       comms[1].buffer.ptr]
        assert all(w["rkey"] == data_rkey for w in to_peer)
        assert [to_peer[0]["imm_data_raw"], to_peer[2]["imm_data_raw"]] == [socket.htonl(_imm(2, 3)),
                                                                            socket.htonl(_imm(5, 2))]
        assert atomic["opcode"] == K["IBV_WR_ATOMIC_FETCH_AND_ADD"] and atomic["rkey"] == sig_rkey
        assert atomic["remote_addr"] == comms[1].proxy.signals_ptr + 9 * 8
        assert atomic["compare_add"] == (-4) & (2 ** 64 - 1)
        s0 = comms[0].stats()[0]
        assert s0["commands"] == len(pushed) and s0["writes_posted"] == len(pushed)

        # rank 1's NIC reports rank 0's two writes-with-immediate: its proxy must apply them to the counters
        qp = _qp(created, 1, 0, 0)
        before = fake.posted_recvs(qp)
        for w in (to_peer[0], to_peer[2]):
            fake.inject_recv(qp, imm=socket.ntohl(w["imm_data_raw"]))
        assert comms[1].wait_signal(2, 3, 10) == 3 and comms[1].wait_signal(5, 2, 10) == 2
        sig = comms[1].signals()
        assert sig[2] == 3 and sig[5] == 2 and np.count_nonzero(sig) == 2
        assert comms[1].stats()[0]["signals_applied"] == 2
        assert fake.posted_recvs(qp) == before  # every consumed receive was re-posted
        comms[1].check()
    finally:
        for c in comms:
            c.close()


@needs_verbs
def test_auto_picks_verbs_when_the_gpu_has_a_nic_and_an_ibv_table_loads(fake_nics):
    fake_nics([cx7("mlx5_3", 3)])
    choice = comm.choose_transport(load_settings({}), 0, gpu=3, topology=_topo("cx7_roce"))
    assert choice.transport == "verbs" and choice.devices == ("mlx5_3",) and choice.gid_index == (3,)
    assert "GPU 3 -> mlx5_3" in choice.reason


def test_auto_picks_loopback_on_this_host_without_rdma_nic():
    if topology.discover("/sys").nics:
        pytest.skip("this host has an RDMA NIC")
    opts = comm.proxy_options(load_settings({}), 0, 2)
    assert opts.transport == "loopback" and opts.ib_devices == ()
    assert "UCCL_EP_TRANSPORT=auto" in opts.transport_reason
    with comm.HostComm(1 << 12, 0, 1, settings=load_settings({"UCCL_EP_NUM_PROXY_THREADS": "1"})) as c:
        assert c.proxy.caps["name"] == "loopback"


def test_auto_without_nic_is_loopback_and_explicit_verbs_raises_with_the_fix():
    topo = _topo("no_rdma")
    assert comm.choose_transport(load_settings({}), 0, gpu=0, topology=topo).transport == "loopback"
    with pytest.raises(SettingsError, match="no RDMA NIC for GPU 0.*UCCL_EP_TRANSPORT=loopback"):
        comm.proxy_options(load_settings({"UCCL_EP_TRANSPORT": "verbs"}), 0, 2, gpu=0, topology=topo)


def test_hca_filter_that_excludes_every_nic_makes_auto_fall_back_and_verbs_raise():
    topo = _topo("cx7_roce")
    env = {"UCCL_IB_HCA": "=mlx5_99"}
    assert comm.choose_transport(load_settings(env), 0, gpu=0, topology=topo).transport == "loopback"
    with pytest.raises(SettingsError, match="UCCL_IB_HCA"):
        comm.choose_transport(load_settings(env | {"UCCL_EP_TRANSPORT": "verbs"}), 0, gpu=0, topology=topo)


@needs_verbs
def test_verbs_proxy_with_efa_nics_gets_the_efa_byte_cap_and_unordered_caps(fake_nics):
    topo = _topo("p5en")
    nics = topology.plan(topo)[0].nics
    fake_nics([{"name": n, "link_layer": "Unknown", "vendor_id": 0x1d0f, "atomics": False,
                "gids": [{"index": 0, "gid": f"fe80:0000:0000:0000:0401:27ff:fe00:{i:04x}", "type": "IB/RoCE v1"}]}
               for i, n in enumerate(nics)])
    opts = comm.proxy_options(load_settings({"UCCL_EP_TRANSPORT": "verbs"}), 0, 2, gpu=0, topology=topo)
    assert opts.transport == "verbs" and opts.ib_devices == nics and opts.ib_gid_index == (0, 0)
    assert opts.max_inflight_bytes == comm.DEFAULT_INFLIGHT_BYTES_EFA
