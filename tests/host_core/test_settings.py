"""uccl_ep_train.settings: defaults, parsing, and clear errors naming the variable for malformed values."""
import pytest

from uccl_ep_train.settings import Settings, SettingsError, describe, load_settings


def test_empty_environment_gives_documented_defaults():
    s = load_settings({})
    assert s == Settings().validate()
    assert s.proxy.num_threads == 4 and s.proxy.fifos_per_thread == 8 and s.proxy.fifo_depth == 2048
    assert s.transport.ib_max_inflight_normal == 8 and s.transport.ib_max_inflight_bytes is None
    assert s.proxy.timeout_secs == 100.0 and s.transport.reorder_window == 256


def test_values_are_parsed_into_typed_fields():
    s = load_settings({"UCCL_IB_HCA": "mlx5_0:1, mlx5_1:1", "UCCL_EP_PROXY_CPUS": "0-3,8,10-11",
                       "UCCL_IB_GID_INDEX": "0x3", "UCCL_EP_CPU_TIMEOUT_SECS": "2.5", "UCCL_EP_TRANSPORT": "LOOPBACK",
                       "UCCL_IB_MAX_INFLIGHT_BYTES": "1572864", "UCCL_EP_FIFO_DEPTH": "  ",
                       "UCCL_SOCKET_IFNAME": " eth0 "})
    assert s.transport.ib_hca == ("mlx5_0:1", "mlx5_1:1")
    assert s.proxy.cpus == (0, 1, 2, 3, 8, 10, 11)
    assert s.transport.ib_gid_index == 3
    assert s.proxy.timeout_secs == 2.5
    assert s.transport.transport == "loopback"
    assert s.transport.ib_max_inflight_bytes == 1572864
    assert s.proxy.fifo_depth == 2048  # blank keeps the default
    assert s.transport.socket_ifname == "eth0"


@pytest.mark.parametrize("name,value", [
    ("UCCL_EP_NUM_PROXY_THREADS", "0"), ("UCCL_EP_NUM_PROXY_THREADS", "four"), ("UCCL_IB_GID_INDEX", "256"),
    ("UCCL_EP_CPU_TIMEOUT_SECS", "nan"), ("UCCL_EP_CPU_TIMEOUT_SECS", "0"), ("UCCL_EP_TRANSPORT", "tcp"),
    ("UCCL_EP_PROXY_CPUS", "3-1"), ("UCCL_EP_PROXY_CPUS", "-1"), ("UCCL_IB_MAX_INFLIGHT_NORMAL", "0"),
    ("UCCL_IB_MAX_INFLIGHT_BYTES", "-5"), ("UCCL_EP_REORDER_WINDOW", "1"), ("UCCL_IB_SL", "16"),
    ("UCCL_EP_LOCAL_SMS", "-1"), ("UCCL_EP_LOCAL_SMS", "all"),
])
def test_malformed_value_raises_naming_the_variable(name, value):
    with pytest.raises(SettingsError, match=name):
        load_settings({name: value})


@pytest.mark.parametrize("env,needle", [
    ({"UCCL_EP_FIFO_DEPTH": "1000"}, "power of two"),
    ({"UCCL_EP_REORDER_WINDOW": "16", "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": "16"}, "must exceed the writes in flight"),
    ({"UCCL_EP_LOOPBACK_REORDER": "300"}, "exceeds UCCL_EP_REORDER_WINDOW"),
    ({"UCCL_EP_NUM_SMS": "23"}, "must be even"),
])
def test_conflicting_settings_are_rejected_with_the_fix(env, needle):
    with pytest.raises(SettingsError, match=needle):
        load_settings(env)


def test_to_env_reproduces_the_settings():
    env = {"UCCL_EP_NUM_PROXY_THREADS": "2", "UCCL_EP_PROXY_CPUS": "1,3", "UCCL_EP_LOOPBACK_REORDER": "8"}
    s = load_settings(env)
    assert load_settings(s.to_env()) == s
    assert s.to_env() == {"UCCL_EP_NUM_PROXY_THREADS": "2", "UCCL_EP_PROXY_CPUS": "1,3",
                          "UCCL_EP_LOOPBACK_REORDER": "8"}


def test_every_setting_is_described_with_a_uccl_name():
    rows = describe()
    names = [r[0] for r in rows]
    assert len(names) == len(set(names))
    assert all(n.startswith("UCCL_") and doc for n, _, doc in rows)
    for required in ("UCCL_SOCKET_IFNAME", "UCCL_IB_HCA", "UCCL_IB_GID_INDEX", "UCCL_IB_SL", "UCCL_IB_TC",
                     "UCCL_IB_MAX_INFLIGHT_BYTES", "UCCL_IB_MAX_INFLIGHT_NORMAL", "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY",
                     "UCCL_EP_CPU_TIMEOUT_SECS"):
        assert required in names
