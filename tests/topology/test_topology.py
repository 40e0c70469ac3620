"""Topology discovery against recorded sysfs trees: GPUs, NICs, NIC per GPU, GID per NIC, CPUs near each NIC."""
from __future__ import annotations

import os

import pytest

from uccl_ep_train import topology

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")


def _discover(host):
    return topology.discover(os.path.join(FIXTURES, host), use_tools=False)


def test_p5en_has_8_h200_and_16_efa_with_two_nics_behind_each_gpu_switch():
    topo = _discover("p5en")
    assert [g.vendor for g in topo.gpus] == ["nvidia"] * 8
    assert len(topo.nics) == 16 and all(n.is_efa and n.driver == "efa" for n in topo.nics)
    assert topo.has_efa and all(n.rate_gbps == 200 and n.active for n in topo.nics)
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    plans = topology.plan(topo)
    assert [p.nics for p in plans][:2] == [("rdmap39s0", "rdmap40s0"), ("rdmap60s0", "rdmap61s0")]
    used = [n for p in plans for n in p.nics]
    assert len(used) == 16 and len(set(used)) == 16
    assert all(p.gid_index == (0, 0) for p in plans)
    assert 48 in plans[4].cpus and 0 not in plans[4].cpus   # GPU 4's NICs sit on socket 1


def test_mi300x_thor2_gets_one_bnxt_re_per_gpu_with_ipv6_gid_and_xgmi_peers():
    topo = _discover("mi300x_thor2")
    assert [g.vendor for g in topo.gpus] == ["amd"] * 8 and not topo.has_efa
    assert topo.gpus[0].peers == (1, 2, 3, 4, 5, 6, 7)
    plans = topology.plan(topo)
    assert [p.nics for p in plans] == [(f"bnxt_re{i}",) for i in range(8)]
    assert all(p.gid_index == (3,) and "global IPv6" in p.gid_reason[0] for p in plans)


def test_cx7_roce_skips_the_far_frontend_nic_and_uses_gid_3():
    topo = _discover("cx7_roce")
    assert len(topo.nics) == 9
    plans = topology.plan(topo)
    assert [p.nics for p in plans] == [(f"mlx5_{i}",) for i in range(8)]
    assert {p.gid_index for p in plans} == {(3,)}


def test_hca_filter_follows_nccl_syntax():
    topo = _discover("cx7_roce")
    assert topology.nics_for_gpus(topo, ("mlx5_8",)) == {i: ["mlx5_8"] for i in range(8)}
    excluded = topology.nics_for_gpus(topo, ("^mlx5_0", "mlx5_1"))
    assert "mlx5_0" not in sum(excluded.values(), []) and "mlx5_1" not in sum(excluded.values(), [])
    assert topology.nics_for_gpus(topo, ("=mlx5_1:1",))[0] == ["mlx5_1"]


def test_gid_override_applies_to_every_nic_and_a_bad_one_raises():
    topo = _discover("mi300x_thor2")
    assert {p.gid_index for p in topology.plan(topo, gid_index=1)} == {(1,)}
    with pytest.raises(ValueError, match="UCCL_IB_GID_INDEX=9"):
        topology.plan(topo, gid_index=9)


def test_host_without_rdma_has_gpus_and_no_nics():
    topo = _discover("no_rdma")
    assert len(topo.gpus) == 2 and topo.nics == []
    assert [p.nics for p in topology.plan(topo)] == [(), ()]


def test_empty_sysfs_root_discovers_nothing_without_errors(tmp_path):
    topo = topology.discover(str(tmp_path), use_tools=False)
    assert topo.gpus == [] and topo.nics == [] and topology.plan(topo) == []


def test_pci_distance_prefers_shared_switch_over_shared_root_over_other_socket():
    gpu = ("0000:20:01.0", "0000:21:00.0", "0000:22:00.0", "0000:26:00.0")
    same_switch = ("0000:20:01.0", "0000:21:00.0", "0000:22:01.0", "0000:27:00.0")
    same_root = ("0000:20:01.0", "0000:30:00.0")
    other = ("0000:80:01.0", "0000:81:00.0")
    assert topology.pci_distance(gpu, same_switch) < topology.pci_distance(gpu, same_root) < \
        topology.pci_distance(gpu, other)


def test_cpulist_round_trip():
    assert topology.parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert topology.format_cpulist((11, 0, 1, 2, 3, 8, 10)) == "0-3,8,10-11"
