"""Which transport the internode backend's proxies run over (UCCL_EP_TRANSPORT), decided without a GPU or a NIC:
the rule on host names, the NIC of this GPU from recorded sysfs trees (tests/fixtures/sysfs), and every error naming
the setting or the build step that fixes it. The agreement step runs on 4 gloo ranks."""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from tests.distributed import run_distributed
from uccl_ep_train import comm, topology
from uccl_ep_train.internode.plan import InternodeError
from uccl_ep_train.internode.transport import resolve_internode_transport, select_internode_transport
from uccl_ep_train.settings import load_settings

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")
ONE_HOST = ["gpu-a"] * 4
TWO_HOSTS = ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]


def _nics(host: str, gpu: int = 0, env: dict | None = None):
    """What comm.gpu_nics finds for ``gpu`` on a recorded host, as the backend asks for it."""
    topo = topology.discover(os.path.join(FIXTURES, host), use_tools=False)
    return lambda: comm.gpu_nics(load_settings(env or {}), 0, gpu=gpu, topology=topo)


def _never():
    raise AssertionError("the NIC survey ran although no rank needs the verbs transport")


@pytest.mark.parametrize("setting", ["auto", "loopback"])
def test_ranks_all_on_one_host_use_loopback_without_looking_at_nics(setting):
    t = resolve_internode_transport(setting, ONE_HOST, 2, _never, verbs_built=True)
    assert (t.name, t.devices, t.gid_index) == ("loopback", (), ())
    assert "all 4 ranks on host gpu-a" in t.reason


def test_auto_across_hosts_uses_verbs_on_the_nic_nearest_this_gpu_with_its_gid():
    t = resolve_internode_transport("auto", TWO_HOSTS, 3, _nics("cx7_roce", gpu=3), verbs_built=True)
    assert (t.name, t.devices, t.gid_index, t.efa) == ("verbs", ("mlx5_3",), (3,), False)
    assert "spans 2 hosts" in t.reason and "GPU 3 -> mlx5_3" in t.reason and "RoCE v2" in t.reason


def test_verbs_on_an_efa_host_drives_both_nics_of_the_gpu_and_says_efa():
    t = resolve_internode_transport("verbs", TWO_HOSTS, 0, _nics("p5en", gpu=0), verbs_built=True)
    assert (t.name, t.devices, t.gid_index, t.efa) == ("verbs", ("rdmap39s0", "rdmap40s0"), (0, 0), True)


def test_explicit_verbs_on_one_host_goes_through_the_nic_instead_of_loopback():
    t = resolve_internode_transport("verbs", ONE_HOST, 1, _nics("cx7_roce", gpu=1), verbs_built=True)
    assert (t.name, t.devices) == ("verbs", ("mlx5_1",))


def test_loopback_across_hosts_is_refused_naming_the_hosts_and_the_setting_to_use():
    with pytest.raises(InternodeError) as e:
        resolve_internode_transport("loopback", TWO_HOSTS, 1, _never, verbs_built=True)
    msg = str(e.value)
    assert msg.startswith("rank 1: UCCL_EP_TRANSPORT=loopback but the group spans 2 hosts")
    assert "gpu-a: ranks 0-1; gpu-b: ranks 2-3" in msg
    assert "shared memory and CUDA IPC" in msg and "set UCCL_EP_TRANSPORT=auto or verbs" in msg


def test_loopback_across_many_hosts_lists_four_and_counts_the_rest():
    hosts = [f"node{r // 2}" for r in range(16)]
    with pytest.raises(InternodeError, match=r"spans 8 hosts \(node0: ranks 0-1; .*node3: ranks 6-7; \.\.\. 4 more "
                                             r"hosts\)"):
        resolve_internode_transport("loopback", hosts, 0, _never, verbs_built=True)


def test_verbs_without_an_rdma_device_names_what_was_found_and_uccl_ib_hca():
    with pytest.raises(InternodeError) as e:
        resolve_internode_transport("auto", TWO_HOSTS, 2, _nics("no_rdma", gpu=0), verbs_built=True)
    msg = str(e.value)
    assert msg.startswith("rank 2: UCCL_EP_TRANSPORT=auto and the group spans 2 hosts")
    assert "no RDMA NIC for GPU 0" in msg and "RDMA devices on this host: none" in msg
    assert "Set UCCL_IB_HCA" in msg and "uccl-ep-train doctor" in msg


def test_an_hca_filter_that_matches_nothing_lists_the_devices_the_host_has():
    env = {"UCCL_IB_HCA": "=mlx5_99"}
    with pytest.raises(InternodeError) as e:
        resolve_internode_transport("verbs", TWO_HOSTS, 0, _nics("cx7_roce", 0, env), verbs_built=True)
    msg = str(e.value)
    assert "no RDMA NIC for GPU 0 (UCCL_IB_HCA==mlx5_99)" in msg
    assert "RDMA devices on this host: mlx5_0, mlx5_1" in msg and "mlx5_8" in msg
    assert "single-host" not in msg  # loopback is no way out across hosts


def test_a_gid_index_the_nic_lacks_is_reported_with_its_gid_table_and_the_setting():
    env = {"UCCL_IB_GID_INDEX": "9"}
    with pytest.raises(InternodeError) as e:
        resolve_internode_transport("auto", TWO_HOSTS, 0, _nics("mi300x_thor2", 0, env), verbs_built=True)
    msg = str(e.value)
    assert "UCCL_IB_GID_INDEX=9 names no GID of bnxt_re" in msg and "its GIDs are:" in msg
    assert "UCCL_IB_GID_INDEX if its GID cannot be chosen" in msg
    assert "RDMA devices on this host: bnxt_re0" in msg


def test_verbs_on_one_host_without_a_device_also_offers_auto():
    with pytest.raises(InternodeError, match="or set UCCL_EP_TRANSPORT=auto for this single-host run"):
        resolve_internode_transport("verbs", ONE_HOST, 0, _nics("no_rdma"), verbs_built=True)


@pytest.mark.parametrize("setting,hosts", [("auto", TWO_HOSTS), ("verbs", ONE_HOST)])
def test_a_build_without_verbs_says_how_to_rebuild_before_surveying_nics(setting, hosts):
    with pytest.raises(InternodeError) as e:
        resolve_internode_transport(setting, hosts, 3, _never, verbs_built=False)
    msg = str(e.value)
    assert msg.startswith(f"rank 3: UCCL_EP_TRANSPORT={setting}")
    assert "built without the verbs transport" in msg and "libibverbs-dev" in msg and "rebuild" in msg
    assert ("UCCL_EP_TRANSPORT=auto for this single-host run" in msg) == (hosts is ONE_HOST)


def test_an_unknown_transport_name_is_refused():
    with pytest.raises(InternodeError, match="UCCL_EP_TRANSPORT=tcp is not a transport: use auto, verbs or loopback"):
        resolve_internode_transport("tcp", ONE_HOST, 0, _never, verbs_built=True)


# ---------------------------------------------------------------------------------------- agreement over gloo
def _select(rank, world, hosts, nic_hosts):
    """Rank r claims to run on hosts[r]; its GPU's NICs come from the recorded host nic_hosts[r]. Returns the choice,
    or the InternodeError text."""
    try:
        t = select_internode_transport("auto", rank, world, None, _nics(nic_hosts[rank], gpu=rank),
                                       verbs_built=True, hostname=hosts[rank])
        return (t.name, t.devices)
    except InternodeError as exc:
        return str(exc)


def test_every_rank_agrees_on_verbs_when_the_group_spans_hosts():
    got = run_distributed(_select, 4, TWO_HOSTS, ["cx7_roce"] * 4, timeout=120)
    assert got == [("verbs", (f"mlx5_{r}",)) for r in range(4)]


def test_ranks_on_one_host_agree_on_loopback():
    got = run_distributed(_select, 4, ONE_HOST, ["no_rdma"] * 4, timeout=120)
    assert got == [("loopback", ())] * 4


def test_a_rank_without_a_nic_makes_every_rank_raise_naming_it():
    got = run_distributed(_select, 4, TWO_HOSTS, ["cx7_roce", "cx7_roce", "no_rdma", "cx7_roce"], timeout=120)
    assert got[2].startswith("rank 2: UCCL_EP_TRANSPORT=auto") and "RDMA devices on this host: none" in got[2]
    for r in (0, 1, 3):
        assert got[r].startswith("rank 2: ") and f"(rank {r} stops too" in got[r]


def test_the_nic_follows_the_gpus_pci_address_when_cuda_visible_devices_renumbers_gpus():
    topo = topology.discover(os.path.join(FIXTURES, "p5en"), use_tools=False)
    s = load_settings({})
    # a job given GPUs 4-7 of the node: its CUDA device 0 (LOCAL_RANK 0) is the host's GPU 4 at 0000:9c:00.0
    by_rank = comm.gpu_nics(s, 0, gpu=0, topology=topo)
    by_address = comm.gpu_nics(s, 0, gpu=0, topology=topo, pci_address="0000:9C:00.0")
    assert by_rank.devices == ("rdmap39s0", "rdmap40s0")
    assert by_address.gpu == 4 and by_address.devices == ("rdmap157s0", "rdmap158s0")
    assert topology.bdf(0, 0x9C, 0) == "0000:9c:00.0"
    missing = comm.gpu_nics(s, 0, topology=topo, pci_address="0000:01:00.0")
    assert not missing.devices and "no GPU at PCI address 0000:01:00.0" in missing.problem
    assert "0000:26:00.0" in missing.problem


def test_by_default_the_host_drains_after_network_waits_only_where_the_proxy_threads_copy():
    """auto (the default) drains where the loopback's proxy threads make the copies our waits need, and launches on
    where the bytes move beside the process: verbs, or the loopback's copy agent. always and never are as said."""
    from uccl_ep_train.internode import drain_after_waits
    from uccl_ep_train.settings import SettingsError, load_settings

    assert load_settings({}).kernel.drain_after_waits == "auto"
    assert drain_after_waits("auto", "loopback", copy_agent=False)
    assert not drain_after_waits("auto", "loopback", copy_agent=True)
    assert not drain_after_waits("auto", "verbs")
    for transport, agent in (("loopback", False), ("loopback", True), ("verbs", False)):
        assert drain_after_waits("always", transport, agent) and not drain_after_waits("never", transport, agent)
    with pytest.raises(SettingsError, match="UCCL_EP_DRAIN_AFTER_WAITS"):
        load_settings({"UCCL_EP_DRAIN_AFTER_WAITS": "sometimes"})


def test_the_internode_loopback_takes_a_copy_agent_by_default_only_where_each_rank_has_a_gpu_of_its_own():
    from uccl_ep_train.internode.transport import use_copy_agent
    from uccl_ep_train.settings import SettingsError, load_settings

    assert load_settings({}).emulation.loopback_copy_agent == "auto"
    assert use_copy_agent("auto", shares_gpu=False) and not use_copy_agent("auto", shares_gpu=True)
    assert use_copy_agent("on", shares_gpu=True) and not use_copy_agent("off", shares_gpu=False)
    with pytest.raises(SettingsError, match="UCCL_EP_LOOPBACK_COPY_AGENT"):
        load_settings({"UCCL_EP_LOOPBACK_COPY_AGENT": "yes"})


def test_without_drains_the_loopback_refuses_calls_on_the_legacy_default_stream_and_allows_side_streams():
    """UCCL_EP_DRAIN_AFTER_WAITS=never over the loopback: a call on the legacy default stream (torch's 0, or
    cudaStreamLegacy) raises, naming the rank, the setting and the fix; a side stream, verbs, or draining pass."""
    from uccl_ep_train.internode import InternodeError, check_stream_without_drains

    for legacy in (0, 1):
        with pytest.raises(InternodeError, match=r"rank 3: UCCL_EP_DRAIN_AFTER_WAITS=never .* legacy default stream"
                                                 r".*torch\.cuda\.stream"):
            check_stream_without_drains(False, "loopback", legacy, 3)
    side = 0x5D1E0000
    check_stream_without_drains(False, "loopback", side, 3)  # a torch pool stream: non-blocking
    check_stream_without_drains(False, "verbs", 0, 3)  # the verbs proxy makes no CUDA call
    check_stream_without_drains(True, "loopback", 0, 3)  # drains: the host is in our drain while the wait spins
    check_stream_without_drains(False, "loopback", 0, 3, copy_agent=True)  # the agent's copies take no lock of ours


def test_a_buffer_on_its_comm_stream_has_the_backend_check_the_callers_stream_too():
    """Buffer runs the backend on its comm stream while the caller's stream waits on it: without drains over the
    loopback, a caller on the legacy default stream is refused there as well (Megatron's dispatcher stalled until the
    GPU deadline that way), before the backend runs; a caller on a side stream passes."""
    import types

    from uccl_ep_train.buffer import Buffer
    from uccl_ep_train.internode import InternodeError, NativeInternodeBackend

    backend = types.SimpleNamespace(_check_stream=True, _drain_after_waits=False, rank=2, _copy_agent=None,
                                    transport=types.SimpleNamespace(name="loopback"))
    backend.check_caller_stream = lambda s: NativeInternodeBackend.check_caller_stream(backend, s)
    ran = []

    class _Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    buf = Buffer.__new__(Buffer)
    buf.backend, buf.device, buf._comm_stream = backend, torch.device("cuda", 0), _Stream(0x5D1E0001)
    for caller, refused in ((0, True), (0x5D1E0000, False)):
        with mock.patch("torch.cuda.current_stream", lambda device=None, h=caller: _Stream(h)), \
                mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()):
            if refused:
                with pytest.raises(InternodeError, match=r"rank 2: UCCL_EP_DRAIN_AFTER_WAITS=never .* legacy default"):
                    buf._run(lambda: ran.append(caller), [], None, False, False)
            else:
                buf._run(lambda: ran.append(caller), [], None, False, False)
    assert ran == [0x5D1E0000]


def test_ranks_of_other_nodes_on_this_gpu_are_named_for_the_shared_gpu_warning():
    """2 nodes x 2 ranks on 2 GPUs (ranks 0 and 2 on GPU a, 1 and 3 on GPU b): each rank's network peer of the other
    node shares its GPU, so the loopback's copies between them run as kernels on that GPU; same-node sharing, one GPU
    per rank and unknown GPUs (the CPU stand-in) name nobody."""
    from uccl_ep_train.internode.transport import SHARED_GPU_WARNING, other_nodes_on_this_gpu

    gpus = ["a", "b", "a", "b"]
    assert [other_nodes_on_this_gpu(gpus, r, 2) for r in range(4)] == [[2], [3], [0], [1]]
    assert other_nodes_on_this_gpu(["a", "a", "b", "b"], 0, 2) == []  # a node's two ranks on one GPU
    assert other_nodes_on_this_gpu(["a", "b"], 0, 1) == []
    assert other_nodes_on_this_gpu(["a", "a"], 1, 1) == [0]  # one GPU playing two nodes
    assert other_nodes_on_this_gpu([None, None], 0, 1) == []
    text = SHARED_GPU_WARNING.format(rank=1, gpu="0000:19:00.0", others=[0], blocks=264)
    assert "rank 1 shares its GPU (0000:19:00.0) with rank(s) [0]" in text and "held to 264 blocks" in text


def test_more_than_two_ranks_sharing_a_gpu_through_mps_are_warned_of_the_stall_seen_there_unless_the_agent_copies():
    """The stall needs the proxy threads' copies: with the copy agent four ranks on one GPU under MPS passed (session
    49), so the warning names that setting and is not given where the agent copies."""
    from uccl_ep_train.internode.transport import SHARED_GPU_WARNING, shared_gpu_warning

    plain = SHARED_GPU_WARNING.format(rank=2, gpu="g", others=[0], blocks=16)
    # two ranks on the GPU under MPS, or MPS unknown: the shared-GPU warning alone
    assert shared_gpu_warning(2, "g", [0], 16, 2, True) == plain
    assert shared_gpu_warning(2, "g", [0], 16, 4, None) == plain
    crowded = shared_gpu_warning(2, "g", [0], 16, 4, True)
    assert crowded.startswith(plain) and "4 ranks share this GPU through MPS" in crowded
    assert "at most two ranks on a GPU" in crowded and "Hardware work queues" in crowded
    assert "UCCL_EP_LOOPBACK_COPY_AGENT=on" in crowded
    assert shared_gpu_warning(2, "g", [0], 16, 4, True, copy_agent=True) == plain


def test_ranks_time_sliced_on_a_shared_gpu_are_warned_of_the_stalls_seen_there_and_sent_to_mps():
    """Without MPS (the driver says so) two ranks on a GPU stalled until the GPU deadline in session 50, where under
    MPS they passed: the warning says so and names what to run instead, whatever the ranks per GPU and whoever copies.
    Where the driver cannot say (None: no libcuda, an old driver), no such claim is made."""
    from uccl_ep_train.internode.transport import SHARED_GPU_WARNING, TIME_SLICED_WARNING, shared_gpu_warning

    plain = SHARED_GPU_WARNING.format(rank=1, gpu="g", others=[0], blocks=66)
    for ranks_on_gpu in (2, 4):
        for agent in (False, True):
            text = shared_gpu_warning(1, "g", [0], 66, ranks_on_gpu, False, copy_agent=agent)
            assert text == plain + TIME_SLICED_WARNING
    assert "time-sliced" in TIME_SLICED_WARNING and "stalled until the GPU deadline" in TIME_SLICED_WARNING
    assert "nvidia-cuda-mps-control -d" in TIME_SLICED_WARNING
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in TIME_SLICED_WARNING
    assert shared_gpu_warning(1, "g", [0], 66, 2, None) == plain
    assert shared_gpu_warning(1, "g", [0], 66, 2, True) == plain


def test_ranks_sharing_a_gpu_through_mps_split_the_spinning_share_and_time_sliced_ranks_each_take_it():
    """Under MPS the ranks' kernels run at once: four ranks of 66 blocks each on a 132-SM H100 left the loopback's
    copy kernels no SM (session 23), so they split the share; time-sliced contexts (MPS off or unknown) run one at a
    time and each keeps it. Never below one block."""
    from uccl_ep_train.internode.transport import SHARED_GPU_SPIN_SM_FRACTION, shared_gpu_spin_blocks

    assert SHARED_GPU_SPIN_SM_FRACTION == 0.5
    assert shared_gpu_spin_blocks(132, 4, True) == 16
    assert shared_gpu_spin_blocks(132, 2, True) == 33
    assert shared_gpu_spin_blocks(132, 4, False) == shared_gpu_spin_blocks(132, 4, None) == 66
    assert shared_gpu_spin_blocks(2, 8, True) == 1


def test_loopback_warns_when_few_hardware_queues_could_put_its_copies_behind_spinning_kernels():
    """CUDA_DEVICE_MAX_CONNECTIONS=1, and MPS without the variable, both stalled the loopback's copies behind the
    backend's spinning kernels on one H200 until the GPU deadline (session 22); 8 (the default) ran, and 8 or 32
    set under MPS. The warning names the value to set; a value the driver cannot read is left to the driver."""
    from uccl_ep_train.internode.transport import loopback_queue_hazard

    one = loopback_queue_hazard(3, "1", mps=False, proxy_threads=4)
    assert one is not None and one.startswith("rank 3: the loopback transport")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 gives this process 1 hardware work queue(s)" in one
    assert "CUDA_DEVICE_MAX_CONNECTIONS=6 or more" in one and "UCCL_EP_GPU_TIMEOUT_SECS" in one
    under_mps = loopback_queue_hazard(0, None, mps=True, proxy_threads=4)
    assert under_mps is not None and "shared through MPS" in under_mps
    assert "CUDA_DEVICE_MAX_CONNECTIONS=10 or more" in loopback_queue_hazard(0, "4", mps=None, proxy_threads=8)
    assert loopback_queue_hazard(0, None, mps=False, proxy_threads=4) is None  # the CUDA default: 8 queues
    assert loopback_queue_hazard(0, "32", mps=True, proxy_threads=4) is None
    assert loopback_queue_hazard(0, "6", mps=None, proxy_threads=4) is None
    assert loopback_queue_hazard(0, "many", mps=False, proxy_threads=4) is None


def test_mps_state_is_unknown_rather_than_an_error_where_the_driver_cannot_say(monkeypatch):
    """Without libcuda (CI, the CPU stand-in) the MPS question has no answer: None, never an exception."""
    import ctypes

    from uccl_ep_train.internode import transport

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert transport.mps_enabled(0) is None
