"""Which transport the internode backend's proxies run over, chosen alike on every rank (docs/internode.md,
"Transport choice"), what changes when ranks of several emulated nodes share one GPU ("Two processes per GPU"), and
what the loopback's copies need of CUDA's hardware work queues ("Hardware work queues").

loopback: every rank on one host, network writes as copies into peers' shared memory and CUDA IPC mappings. verbs:
the RDMA NICs nearest each GPU (comm.gpu_nics). Nothing here touches the native module.
"""
from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from uccl_ep_train.internode.plan import InternodeError

if TYPE_CHECKING:
    from uccl_ep_train.comm import GpuNics


def device_pci_address(device: torch.device) -> Optional[str]:
    """The PCI address of a CUDA device as sysfs spells it, or None when torch does not say (the NIC choice then
    falls back to LOCAL_RANK)."""
    if device.type != "cuda":  # CPU stand-in of the native module (tests): no PCI device
        return None
    try:
        p = torch.cuda.get_device_properties(device)
        from uccl_ep_train.topology import bdf

        return bdf(int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id))
    except Exception:  # noqa: BLE001 - older torch or no CUDA: fall back
        return None


def other_nodes_on_this_gpu(gpu_of_rank: Sequence[Optional[str]], rank: int, ranks_per_node: int) -> List[int]:
    """The ranks of other (emulated) nodes whose GPU is this rank's (``gpu_of_rank``: each rank's GPU PCI address,
    None where unknown). The loopback carries their network writes as copies within one GPU, which the driver makes
    with a kernel, not a copy engine (scripts/probe_copy_beside_spin.cu); see SHARED_GPU_WARNING."""
    mine = gpu_of_rank[rank]
    if mine is None:
        return []
    node = rank // ranks_per_node
    return [r for r, gpu in enumerate(gpu_of_rank) if gpu == mine and r // ranks_per_node != node]


def use_copy_agent(setting: str, shares_gpu: bool) -> bool:
    """Whether a rank's loopback has a copy agent move its bytes (UCCL_EP_LOOPBACK_COPY_AGENT): ``on``, ``off``, or
    ``auto``: where no other rank shares this rank's GPU. Where ranks share one, the loopback's copies within the
    GPU are kernels of the driver's (other_nodes_on_this_gpu), and the agent's context would be one more to
    time-slice with our spinning grids; that case keeps the proxy threads' copies, as tested since session 20."""
    if setting == "auto":
        return not shares_gpu
    return setting == "on"


# The share of the GPU's SM count that a spinning grid may take in blocks when ranks of several nodes share a GPU, so
# the copy kernels of the loopback find whole SMs free. Capping blocks per SM does not do it: a packer block holds
# 256 threads x 128 registers, half an SM's register file, so 2 blocks per SM already fill every SM
# (docs/internode.md, "Two processes per GPU").
SHARED_GPU_SPIN_SM_FRACTION = 0.5


def shared_gpu_spin_blocks(sms: int, ranks_on_gpu: int, mps: Optional[bool]) -> int:
    """Blocks a spinning grid of one of ``ranks_on_gpu`` ranks sharing a GPU of ``sms`` SMs may take. Time-sliced
    (no MPS, or unknown), one context runs at a time, so each takes SHARED_GPU_SPIN_SM_FRACTION. Under MPS the ranks'
    kernels run at once, so they split it: at 2 nodes x 2 ranks on one H100, four ranks of 66 blocks each left the
    copy kernels no SM, and a combine waited for partial sums until the GPU deadline in 10 of 15 runs (session 23);
    with 16 blocks each none of 3 did."""
    share = SHARED_GPU_SPIN_SM_FRACTION / (max(1, ranks_on_gpu) if mps else 1)
    return max(1, int(sms * share))

SHARED_GPU_WARNING = (
    "rank {rank} shares its GPU ({gpu}) with rank(s) {others} of other emulated nodes: the loopback moves their "
    "network bytes with copies within one GPU, which the driver runs as kernels, so this rank's spinning kernels are "
    "held to {blocks} blocks to leave those copies room. Timings on a shared GPU say nothing about speed; use one GPU "
    "per rank to play nodes (docs/internode.md, \"Two processes per GPU\").")
# ... and where more than two ranks share the GPU through MPS: seen to stall (session 48: the 2 x 2 every-output case
# on one H200 failed in 5 of 5 runs at the default lanes, before and after session 47's changes alike)
CROWDED_MPS_WARNING = (
    " {ranks} ranks share this GPU through MPS and the proxy threads make the loopback's copies: there those copies "
    "have been seen to wait behind the spinning waits until the GPU deadline, and a stalled run leaves MPS failing "
    "later clients. Set UCCL_EP_LOOPBACK_COPY_AGENT=on (its copies are another MPS client's; four ranks on one GPU "
    "passed so in session 49) or keep at most two ranks on a GPU (docs/internode.md, \"Hardware work queues\").")


# ... and where the driver says the GPU is not shared through MPS: its contexts are time-sliced, and there the calls
# stalled in session 50 (2x H200: 8 of the 2 x 2 cases with two ranks per GPU; one H200: every_output at 2 x 1, a
# 96-byte copy between the two ranks never ran in 60 s), where under MPS the same cases passed
TIME_SLICED_WARNING = (
    " This GPU is not shared through MPS, so its ranks' contexts are time-sliced: there calls have stalled until the "
    "GPU deadline, a loopback copy between two of them never running (session 50). Share a GPU between ranks only "
    "under MPS (nvidia-cuda-mps-control -d, with CUDA_DEVICE_MAX_CONNECTIONS=8), as scripts/gpu-check.sh "
    "internode_mps does.")


def shared_gpu_warning(rank: int, gpu: str, others: List[int], blocks: int, ranks_on_gpu: int,
                       mps: Optional[bool], copy_agent: bool = False) -> str:
    """SHARED_GPU_WARNING for ``rank``, with CROWDED_MPS_WARNING where more than two ranks share the GPU under MPS and
    the proxy threads copy (no ``copy_agent``), and TIME_SLICED_WARNING where the driver says there is no MPS (not
    where it cannot say: ``mps`` None)."""
    text = SHARED_GPU_WARNING.format(rank=rank, gpu=gpu, others=others, blocks=blocks)
    crowded = mps and ranks_on_gpu > 2 and not copy_agent
    if crowded:
        return text + CROWDED_MPS_WARNING.format(ranks=ranks_on_gpu)
    return text + (TIME_SLICED_WARNING if mps is False else "")


# CU_DEVICE_ATTRIBUTE_MPS_ENABLED (cuda.h, CUDA >= 12.3): contexts on the device are shared through MPS.
_CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133

# Hardware work queues the loopback needs besides its proxy threads' streams: the compute stream and the backend's
# communication stream. The CUDA default (8) is enough for the default 4 proxy threads.
_QUEUES_BESIDE_PROXY_STREAMS = 2

LOOPBACK_QUEUE_WARNING = (
    "rank {rank}: the loopback transport makes its network writes as copies on the proxy threads' CUDA streams, and "
    "{why}. Streams then share hardware work queues, so a copy can wait in a queue behind a kernel that spins for that "
    "copy's bytes, and the call fails at the GPU deadline (UCCL_EP_GPU_TIMEOUT_SECS). For runs over the loopback set "
    "CUDA_DEVICE_MAX_CONNECTIONS={want} or more before CUDA starts, under MPS too. The verbs transport copies nothing "
    "on the GPU and is not affected (docs/internode.md, \"Hardware work queues\").")


def mps_enabled(device_index: int) -> Optional[bool]:
    """Whether this process's contexts on the GPU (an index as torch counts them) are shared through MPS; None when
    the driver cannot say (no libcuda, or a driver older than the attribute)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, value = ctypes.c_int(), ctypes.c_int()
    if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), int(device_index)) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) != 0):
        return None
    return bool(value.value)


def loopback_queue_shortfall(max_connections: Optional[str], mps: Optional[bool],
                             proxy_threads: int) -> Optional[Tuple[str, int]]:
    """(why, the CUDA_DEVICE_MAX_CONNECTIONS to set) when the loopback's copies may queue behind spinning kernels,
    else None: the variable (``max_connections``, as the environment has it) below what the proxy threads' streams
    and the calls' two streams need, or MPS without it set (the clients then share one pool of queues)."""
    want = proxy_threads + _QUEUES_BESIDE_PROXY_STREAMS
    try:
        n = int(max_connections) if max_connections is not None else None
    except ValueError:
        n = None  # the driver ignores a value it cannot read, and so do we
    if n is not None and n < want:
        return f"CUDA_DEVICE_MAX_CONNECTIONS={n} gives this process {n} hardware work queue(s)", want
    if n is None and mps:
        return ("this GPU is shared through MPS, whose clients share one pool of hardware work queues, without "
                "CUDA_DEVICE_MAX_CONNECTIONS set"), want
    return None


def loopback_queue_hazard(rank: int, max_connections: Optional[str], mps: Optional[bool],
                          proxy_threads: int) -> Optional[str]:
    """LOOPBACK_QUEUE_WARNING for ``rank`` where loopback_queue_shortfall finds one, else None."""
    short = loopback_queue_shortfall(max_connections, mps, proxy_threads)
    return None if short is None else LOOPBACK_QUEUE_WARNING.format(rank=rank, why=short[0], want=short[1])


@dataclass(frozen=True)
class InternodeTransport:
    """What the backend's proxies run over (resolve_internode_transport), and for verbs the NICs of this GPU."""

    name: str                          # "loopback" or "verbs"
    reason: str
    devices: Tuple[str, ...] = ()
    gid_index: Tuple[int, ...] = ()
    efa: bool = False


_REBUILD_WITH_VERBS = ("this uccl_ep_train._C was built without the verbs transport (infiniband/verbs.h was not "
                       "found at build time): install rdma-core's headers (libibverbs-dev / rdma-core-devel) and "
                       "rebuild")


def resolve_internode_transport(setting: str, hostnames: Sequence[str], rank: int,
                                nics_for_this_gpu: Callable[[], "GpuNics"], verbs_built: bool) -> InternodeTransport:
    """UCCL_EP_TRANSPORT for the internode backend, given every rank's host name (``hostnames[r]``).

    auto: loopback when every rank is on this host, verbs otherwise. loopback across hosts raises: its writes are
    memcpys into peers' shared memory and CUDA IPC mappings, which exist on one host only. verbs needs the module
    built with it and an RDMA device for this GPU. ``nics_for_this_gpu`` (comm.gpu_nics for the real host) is only
    called when verbs is chosen, so single-host runs never depend on the NIC survey. Raises InternodeError naming
    what to change."""
    if setting not in ("auto", "loopback", "verbs"):
        raise InternodeError(f"rank {rank}: UCCL_EP_TRANSPORT={setting} is not a transport: use auto, verbs or "
                             "loopback")
    ranks_of: dict = {}
    for r, h in enumerate(hostnames):
        ranks_of.setdefault(h, []).append(r)
    one_host = len(ranks_of) == 1
    if one_host and setting != "verbs":
        return InternodeTransport("loopback", f"UCCL_EP_TRANSPORT={setting}: all {len(hostnames)} ranks on host "
                                  f"{next(iter(ranks_of))}")
    if not one_host and setting == "loopback":
        spread = "; ".join(f"{h}: ranks {_rank_list(rs)}" for h, rs in list(ranks_of.items())[:4])
        more = f"; ... {len(ranks_of) - 4} more hosts" if len(ranks_of) > 4 else ""
        raise InternodeError(f"rank {rank}: UCCL_EP_TRANSPORT=loopback but the group spans {len(ranks_of)} hosts "
                             f"({spread}{more}); the loopback transport reaches only ranks on one host (shared "
                             "memory and CUDA IPC): set UCCL_EP_TRANSPORT=auto or verbs to go through the RDMA NICs")
    why = ("UCCL_EP_TRANSPORT=verbs" if setting == "verbs" else
           f"UCCL_EP_TRANSPORT=auto and the group spans {len(ranks_of)} hosts")
    if not verbs_built:
        fix = "; or set UCCL_EP_TRANSPORT=auto for this single-host run" if one_host else ""
        raise InternodeError(f"rank {rank}: {why}, so the proxies need the verbs transport, but "
                             f"{_REBUILD_WITH_VERBS}{fix}")
    nics = nics_for_this_gpu()
    if not nics.devices:
        found = ", ".join(nics.host_nics) if nics.host_nics else "none (no /sys/class/infiniband entries)"
        fix = "; or set UCCL_EP_TRANSPORT=auto for this single-host run" if one_host else ""
        raise InternodeError(f"rank {rank}: {why}, but this rank has no RDMA device to use: {nics.problem}. "
                             f"RDMA devices on this host: {found}. Set UCCL_IB_HCA to the device(s) this GPU should "
                             "use (UCCL_IB_GID_INDEX if its GID cannot be chosen), see `uccl-ep-train doctor`"
                             f"{fix}")
    return InternodeTransport("verbs", f"{why}: GPU {nics.gpu} -> " + "; ".join(
        f"{n} ({r})" for n, r in zip(nics.devices, nics.gid_reason)), devices=tuple(nics.devices),
        gid_index=tuple(nics.gid_index), efa=nics.efa)


def select_internode_transport(setting: str, rank: int, world: int, group: Any,
                               nics_for_this_gpu: Callable[[], "GpuNics"], verbs_built: bool,
                               hostname: Optional[str] = None) -> InternodeTransport:
    """resolve_internode_transport on every rank of ``group`` (gloo) from the host names they gather
    (``hostname``: this rank's, default socket.gethostname()). Every rank ends the same way: a rank that cannot set
    up the transport (no NIC, no verbs in its build) raises, and so does every other rank, naming it, instead of
    waiting in the proxy bootstrap until the gloo deadline."""
    hosts: List[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname() if hostname is None else hostname, group=group)
    try:
        choice: Optional[InternodeTransport] = resolve_internode_transport(setting, hosts, rank, nics_for_this_gpu,
                                                                           verbs_built)
        failure = ""
    except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, or they wait below
        choice, failure = None, str(exc) if isinstance(exc, InternodeError) else f"{type(exc).__name__}: {exc}"
    failures: List[Any] = [None] * world
    dist.all_gather_object(failures, failure, group=group)
    if failure:
        raise InternodeError(failure)
    first = next((f for f in failures if f), "")
    if first:
        raise InternodeError(f"{first} (rank {rank} stops too: the proxies of every rank connect to each other)")
    assert choice is not None
    return choice


def _rank_list(ranks: Sequence[int]) -> str:
    """'0-3,8' for messages about many ranks."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)
