"""GID choice (csrc/transport/gid.cpp) against recorded sysfs GID tables, and agreement with topology.choose_gid."""
from __future__ import annotations

import os

import pytest

from verbs_fake_support import SKIP_REASON, verbs
from uccl_ep_train import topology

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")

if verbs is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


def _root(host):
    return os.path.join(FIXTURES, host)


def _table(gids, link_layer="Ethernet", device="dev0"):
    return {"device": device, "port": 1, "link_layer": link_layer,
            "gids": [{"index": i, "gid": g, "type": t, "netdev": "eth0"} for i, g, t in gids]}


LL = "fe80:0000:0000:0000:5e25:73ff:fe3a:4c00"
V6 = "fd93:16d3:59b6:1a00:0000:0000:0000:0010"
V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def test_connectx_roce_picks_ipv4_mapped_roce_v2_at_index_3():
    t = verbs.read_gid_table(_root("cx7_roce"), "mlx5_0", 1)
    assert t["link_layer"] == "Ethernet" and [g["index"] for g in t["gids"]][:4] == [0, 1, 2, 3]
    index, reason = verbs.choose_gid(t)
    assert index == 3 and "RoCE v2, IPv4-mapped" in reason and "ens10np0" in reason


def test_broadcom_thor2_with_ipv6_only_gids_picks_global_roce_v2():
    t = verbs.read_gid_table(_root("mi300x_thor2"), "bnxt_re5", 1)
    index, reason = verbs.choose_gid(t)
    assert index == 3 and "global IPv6" in reason


def test_efa_uses_index_0_although_its_gid_looks_link_local():
    t = verbs.read_gid_table(_root("p5en"), "rdmap39s0", 1)
    assert verbs.choose_gid(t, -1, True)[0] == 0
    with pytest.raises(ValueError, match="no routable GID"):
        verbs.choose_gid(t, -1, False)  # treated as RoCE it would have nothing routable


def test_roce_v2_beats_v1_and_ipv4_beats_ipv6_and_ties_go_to_lowest_index():
    assert verbs.choose_gid(_table([(0, LL, "RoCE v2"), (1, V6, "IB/RoCE v1"), (2, V6, "RoCE v2")]))[0] == 2
    assert verbs.choose_gid(_table([(0, V6, "RoCE v2"), (1, V4, "RoCE v2")]))[0] == 1
    assert verbs.choose_gid(_table([(0, V4, "IB/RoCE v1"), (1, V6, "IB/RoCE v1")]))[0] == 0
    assert verbs.choose_gid(_table([(4, V4, "RoCE v2"), (5, V4, "RoCE v2")]))[0] == 4


def test_zero_and_link_local_only_tables_are_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"(?s)no routable GID on bnxt_re0 port 1.*\[0\] fe80.*UCCL_IB_GID_INDEX"):
        verbs.choose_gid(_table([(0, LL, "IB/RoCE v1"), (1, LL, "RoCE v2"), (2, ZERO, "RoCE v2")],
                                device="bnxt_re0"))


def test_override_wins_and_must_name_a_real_entry():
    t = _table([(0, LL, "IB/RoCE v1"), (1, LL, "RoCE v2"), (3, V4, "RoCE v2")])
    assert verbs.choose_gid(t, 1) == (1, f"UCCL_IB_GID_INDEX=1 ({LL}, RoCE v2)")
    for bad in (2, 7):
        with pytest.raises(ValueError, match=f"(?s)UCCL_IB_GID_INDEX={bad} names no GID.*\\[3\\] 0000:"):
            verbs.choose_gid(t, bad)


def test_infiniband_uses_port_gid_index_0():
    t = _table([(0, "fe80:0000:0000:0000:a088:c203:0041:3d00", "IB/RoCE v1")], link_layer="InfiniBand")
    assert verbs.choose_gid(t) == (0, "InfiniBand port: index 0 (fe80:0000:0000:0000:a088:c203:0041:3d00)")


@pytest.mark.parametrize("host", ["p5en", "mi300x_thor2", "cx7_roce"])
def test_native_and_python_gid_rules_agree_on_every_recorded_port(host):
    topo = topology.discover(_root(host), use_tools=False)
    assert topo.nics
    for nic in topo.nics:
        native_table = verbs.read_gid_table(_root(host), nic.name, 1)
        py_port = nic.ports[0]
        assert [(g["index"], g["gid"]) for g in native_table["gids"]] == [(g.index, g.gid) for g in py_port.gids]
        for override in (-1, 0, 1, 3, 5):
            try:
                native = verbs.choose_gid(native_table, override, nic.is_efa)
            except ValueError as exc:
                with pytest.raises(ValueError):
                    topology.choose_gid_for(nic, override)
                assert "GID" in str(exc)
                continue
            py = topology.choose_gid_for(nic, override)
            assert (py.index, py.reason) == native
