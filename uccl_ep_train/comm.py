"""The host communication core from Python: build a rank's proxy from the settings and connect it to its peers.

The native objects (`uccl_ep_train._C.Proxy`, `HostBuffer`) do the work; this module only translates
:class:`uccl_ep_train.settings.Settings` (and, for the verbs transport, :func:`uccl_ep_train.topology.plan`: the NICs
and GID indices of this rank's GPU) into their arguments and runs the connection bootstrap through
torch.distributed (``all_gather_object``; gloo on CPU is enough). See docs/host-core.md and docs/transports.md.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

from uccl_ep_train import native
from uccl_ep_train import topology as topo_mod
from uccl_ep_train.cpu_placement import cpu_share
from uccl_ep_train.settings import Settings, SettingsError, load_settings

#: Default in-flight byte cap when UCCL_IB_MAX_INFLIGHT_BYTES is unset: 2 MiB on loopback, IB and RoCE ...
DEFAULT_INFLIGHT_BYTES = 2 << 20
#: ... and 8 MiB on EFA (SRD spreads a QP's traffic over many paths and needs more in flight to fill a 200G port).
DEFAULT_INFLIGHT_BYTES_EFA = 8 << 20
#: Send/receive work requests kept per queue pair when the in-flight cap is lower (the proxy never exceeds its cap).
DEFAULT_QUEUE_DEPTH = 1024

_T = TypeVar("_T")


@dataclass(frozen=True)
class TransportChoice:
    """Which transport a rank's proxies use, and for verbs the NICs of its GPU (from topology.plan())."""

    transport: str                       # "loopback" or "verbs"
    reason: str                          # why (printed by errors and logs)
    gpu: int = -1
    devices: tuple[str, ...] = ()
    gid_index: tuple[int, ...] = ()
    efa: bool = False


@functools.lru_cache(maxsize=4)
def _discover(sysfs_root: str) -> topo_mod.Topology:
    return topo_mod.discover(sysfs_root)


def _verbs_loadable() -> tuple[bool, str]:
    """The module has the verbs transport and an ibv table is usable (system libibverbs, or a test's fake)."""
    verbs = getattr(native.module(), "verbs", None)
    if verbs is None or not getattr(verbs, "available", False):
        return False, "this build has no verbs transport (rdma-core headers were missing at build time)"
    try:
        verbs.active_api()
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def _local_gpu(rank: int, gpu: Optional[int]) -> int:
    if gpu is not None:
        return gpu
    local = os.environ.get("LOCAL_RANK")
    return int(local) if local not in (None, "") else rank


@dataclass(frozen=True)
class GpuNics:
    """The RDMA NICs topology.plan() gives one GPU, with what the host has, for messages when they are none."""

    gpu: int
    devices: tuple[str, ...] = ()
    gid_index: tuple[int, ...] = ()
    gid_reason: tuple[str, ...] = ()
    efa: bool = False
    host_nics: tuple[str, ...] = ()       # every RDMA device sysfs shows on this host
    problem: str = ""                     # why ``devices`` is empty
    gid_unusable: bool = False            # the problem is a NIC whose GIDs cannot be used (plan() raised)


def gpu_nics(settings: Settings, rank: int, *, gpu: Optional[int] = None,
             topology: Optional[topo_mod.Topology] = None, pci_address: Optional[str] = None) -> GpuNics:
    """The NICs (and GID indices) topology.plan() assigns to this rank's GPU under UCCL_IB_HCA / UCCL_IB_GID_INDEX;
    shared by every proxy owner (HostComm, the internode backend). The GPU is the one at ``pci_address`` when given
    (what the process's CUDA device really is, whatever CUDA_VISIBLE_DEVICES renumbered), else ``gpu``, else
    LOCAL_RANK, else ``rank``: host-wide GPU numbers, which a launcher that splits a node's GPUs between jobs shifts."""
    t = settings.transport
    topo = topology if topology is not None else _discover("/sys")
    gpu_index = _local_gpu(rank, gpu)
    if pci_address:
        want = pci_address.strip().lower()
        match = next((g.index for g in topo.gpus if g.pci_bus_id.lower() == want), None)
        if match is None:
            return GpuNics(gpu_index, host_nics=tuple(n.name for n in topo.nics),
                           problem=f"no GPU at PCI address {want} among this host's "
                                   f"{', '.join(g.pci_bus_id for g in topo.gpus) or 'none'}")
        gpu_index = match
    host_nics = tuple(n.name for n in topo.nics)
    try:
        plans = topo_mod.plan(topo, t.ib_hca, t.ib_gid_index)
    except ValueError as exc:  # a NIC exists but no GID of it can be used
        return GpuNics(gpu_index, host_nics=host_nics, problem=str(exc), gid_unusable=True)
    mine = next((p for p in plans if p.gpu == gpu_index), None)
    if mine is None:
        return GpuNics(gpu_index, host_nics=host_nics,
                       problem=f"no GPU {gpu_index} on this host ({len(topo.gpus)} found)")
    if not mine.nics:
        return GpuNics(gpu_index, host_nics=host_nics, problem=f"no RDMA NIC for GPU {gpu_index}" + (
            f" (UCCL_IB_HCA={','.join(t.ib_hca)})" if t.ib_hca else ""))
    by_name = {n.name: n for n in topo.nics}
    return GpuNics(gpu_index, devices=tuple(mine.nics), gid_index=tuple(mine.gid_index),
                   gid_reason=tuple(mine.gid_reason), efa=any(by_name[n].is_efa for n in mine.nics if n in by_name),
                   host_nics=host_nics)


def choose_transport(settings: Settings, rank: int, *, gpu: Optional[int] = None,
                     topology: Optional[topo_mod.Topology] = None) -> TransportChoice:
    """Resolve UCCL_EP_TRANSPORT: "verbs" (or "auto" when this GPU has a usable RDMA NIC and libibverbs loads) drives
    the NICs topology.plan() assigns to the GPU (``gpu``, default LOCAL_RANK, else ``rank``); "auto" without one is
    loopback. Raises SettingsError when "verbs" cannot run here, saying what to change."""
    t = settings.transport
    if t.transport == "loopback":
        return TransportChoice("loopback", "UCCL_EP_TRANSPORT=loopback")
    explicit = t.transport == "verbs"
    mine = gpu_nics(settings, rank, gpu=gpu, topology=topology)
    if mine.gid_unusable:
        if explicit:
            raise SettingsError(f"UCCL_EP_TRANSPORT=verbs: {mine.problem}")
        return TransportChoice("loopback", f"UCCL_EP_TRANSPORT=auto: no usable RDMA NIC ({mine.problem})")
    if not mine.devices:
        if explicit:
            raise SettingsError(f"UCCL_EP_TRANSPORT=verbs but {mine.problem}: run `uccl-ep-train doctor`, widen "
                                "UCCL_IB_HCA, or set UCCL_EP_TRANSPORT=loopback for a single-host run")
        return TransportChoice("loopback", f"UCCL_EP_TRANSPORT=auto: {mine.problem}")
    ok, why = _verbs_loadable()
    if not ok:
        if explicit:
            raise SettingsError(f"UCCL_EP_TRANSPORT=verbs but the verbs transport cannot run: {why}")
        return TransportChoice("loopback", f"UCCL_EP_TRANSPORT=auto: RDMA NIC(s) {','.join(mine.devices)} found but "
                               f"{why}")
    return TransportChoice("verbs", f"UCCL_EP_TRANSPORT={t.transport}: GPU {mine.gpu} -> " + "; ".join(
        f"{n} ({r})" for n, r in zip(mine.devices, mine.gid_reason)), gpu=mine.gpu, devices=mine.devices,
        gid_index=mine.gid_index, efa=mine.efa)


@dataclass(frozen=True)
class ProxyOptions:
    """Everything the native Proxy constructor takes, resolved from Settings (plus per-call choices)."""

    rank: int
    world: int
    num_threads: int
    fifos_per_thread: int
    fifo_depth: int
    cpus: tuple[int, ...]
    idle_backoff_us: int
    timeout_secs: float
    max_inflight_writes: int
    max_inflight_bytes: int
    reorder_window: int
    num_signal_slots: int
    transport: str
    loopback_reorder: int
    loopback_delay_us: int
    loopback_bandwidth_gbps: float
    loopback_seed: int
    ib_devices: tuple[str, ...] = ()
    ib_gid_index: tuple[int, ...] = ()
    ib_sl: int = -1                      # -1: the transport's default (3 IB/RoCE, 8 EFA)
    ib_tc: int = -1                      # -1: 104 IB/RoCE, 0 EFA
    ib_sq_depth: int = DEFAULT_QUEUE_DEPTH
    ib_rq_depth: int = DEFAULT_QUEUE_DEPTH
    dump_trigger: str = ""               # UCCL_EP_PROXY_DUMP_FILE
    loopback_copy_agent: str = ""        # a copy agent's segment (HostComm starts one: UCCL_EP_LOOPBACK_COPY_AGENT=on)
    transport_reason: str = field(default="", compare=False)  # not passed to the native proxy

    def kwargs(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("transport_reason")
        d["cpus"] = list(self.cpus)
        d["ib_devices"] = list(self.ib_devices)
        d["ib_gid_index"] = list(self.ib_gid_index)
        return d


def proxy_options(settings: Settings, rank: int, world: int, *, num_signal_slots: int = 1024,
                  low_latency: bool = False, gpu: Optional[int] = None,
                  topology: Optional[topo_mod.Topology] = None, host_slot: Tuple[int, int] = (0, 1)) -> ProxyOptions:
    """Translate settings into proxy arguments; raises SettingsError for combinations the host core cannot run.

    ``gpu`` and ``topology`` only matter for the verbs transport (see :func:`choose_transport`); tests pass a
    recorded topology. ``host_slot``: (this rank's index among its host's ranks, how many the host runs), which
    share of UCCL_EP_PROXY_CPUS its threads take (cpu_placement.py; the default takes the whole list)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    if not 1 <= num_signal_slots <= 16383:
        raise ValueError(f"num_signal_slots={num_signal_slots} must be in 1..16383")
    t, p, e = settings.transport, settings.proxy, settings.emulation
    choice = choose_transport(settings, rank, gpu=gpu, topology=topology)
    writes = t.ib_max_inflight_low_latency if low_latency else t.ib_max_inflight_normal
    default_bytes = DEFAULT_INFLIGHT_BYTES_EFA if choice.efa else DEFAULT_INFLIGHT_BYTES
    return ProxyOptions(
        rank=rank, world=world, num_threads=p.num_threads, fifos_per_thread=p.fifos_per_thread,
        fifo_depth=p.fifo_depth, cpus=cpu_share(p.cpus, *host_slot), idle_backoff_us=p.idle_backoff_us,
        timeout_secs=p.timeout_secs,
        max_inflight_writes=writes,
        max_inflight_bytes=t.ib_max_inflight_bytes if t.ib_max_inflight_bytes is not None else default_bytes,
        reorder_window=t.reorder_window, num_signal_slots=num_signal_slots, transport=choice.transport,
        loopback_reorder=e.loopback_reorder, loopback_delay_us=e.loopback_delay_us,
        loopback_bandwidth_gbps=e.loopback_bandwidth_gbps, loopback_seed=e.loopback_seed,
        ib_devices=choice.devices, ib_gid_index=choice.gid_index,
        ib_sl=-1 if t.ib_sl is None else t.ib_sl, ib_tc=-1 if t.ib_tc is None else t.ib_tc,
        ib_sq_depth=max(DEFAULT_QUEUE_DEPTH, writes), ib_rq_depth=max(DEFAULT_QUEUE_DEPTH, writes),
        dump_trigger=p.dump_file or "", transport_reason=choice.reason)


def with_timeout_hint(exc: BaseException) -> BaseException:
    """The same exception type and message, ending with doctor.TIMEOUT_HINT (unchanged if it already does)."""
    from uccl_ep_train.doctor import TIMEOUT_HINT

    text = str(exc)
    if text.endswith(TIMEOUT_HINT):
        return exc
    new = type(exc)(f"{text.rstrip()}\n{TIMEOUT_HINT}")
    return new.with_traceback(exc.__traceback__)


class HostComm:
    """One rank's data buffer, signal counters, command FIFOs and proxy threads.

    Create one per rank, then call :meth:`connect` (through torch.distributed) or :func:`connect_in_process`.
    Errors of the proxy threads surface as ``uccl_ep_train._C.ProxyError`` from :meth:`check`, :meth:`wait_idle`,
    :meth:`wait_signal` and the push methods; deadlines raise ``TimeoutError``. ``host_slot``: which share of
    UCCL_EP_PROXY_CPUS this rank's threads take (proxy_options).
    """

    def __init__(self, data_bytes: int, rank: int, world: int, *, settings: Optional[Settings] = None,
                 num_signal_slots: int = 1024, low_latency: bool = False, gpu: Optional[int] = None,
                 topology: Optional[topo_mod.Topology] = None, host_slot: Tuple[int, int] = (0, 1),
                 **overrides: Any):
        if data_bytes <= 0:
            raise ValueError(f"data_bytes={data_bytes} must be positive")
        _C = native.module()
        self.settings = settings if settings is not None else load_settings()
        opts = proxy_options(self.settings, rank, world, num_signal_slots=num_signal_slots, low_latency=low_latency,
                             gpu=gpu, topology=topology, host_slot=host_slot)
        self.transport_reason = opts.transport_reason
        kwargs = opts.kwargs()
        unknown = set(overrides) - set(kwargs)
        if unknown:
            raise TypeError(f"unknown proxy option(s): {sorted(unknown)}")
        kwargs.update(overrides)
        if kwargs["transport"] == "loopback" and kwargs["loopback_reorder"] > 1 and \
                kwargs["max_inflight_writes"] >= kwargs["reorder_window"]:
            raise SettingsError(f"the reorder window ({kwargs['reorder_window']}) must exceed the writes in flight "
                                f"({kwargs['max_inflight_writes']}); raise UCCL_EP_REORDER_WINDOW")
        self.rank, self.world = rank, world
        self._closed = False
        # host memory only: the proxy threads' copies are memcpy, which no CUDA call of the caller can hold, so the
        # agent runs here only when asked for (tests of its protocol without a GPU)
        self.copy_agent = None
        if (kwargs["transport"] == "loopback" and not kwargs["loopback_copy_agent"]
                and self.settings.emulation.loopback_copy_agent == "on"):
            from uccl_ep_train.loopback_copy_agent import CopyAgent

            self.copy_agent = CopyAgent(kwargs["num_threads"], -1, cpus=kwargs["cpus"])
            kwargs["loopback_copy_agent"] = self.copy_agent.name
        self.options = kwargs
        self.buffer = _C.HostBuffer(data_bytes)
        try:
            self.proxy = _C.Proxy(self.buffer, **kwargs)
        except BaseException:
            if self.copy_agent is not None:
                self.copy_agent.close()
            raise
        self._started = False

    # ------------------------------------------------------------------ bootstrap
    @property
    def num_threads(self) -> int:
        return int(self.options["num_threads"])

    def local_infos(self) -> list[bytes]:
        return [self.proxy.local_info(t) for t in range(self.num_threads)]

    def connect_infos(self, infos_by_rank: Sequence[Sequence[bytes]]) -> None:
        """infos_by_rank[r] = rank r's local_infos()."""
        if len(infos_by_rank) != self.world:
            raise ValueError(f"expected connection info from {self.world} ranks, got {len(infos_by_rank)}")
        per_thread = [[infos_by_rank[r][t] for r in range(self.world)] for t in range(self.num_threads)]
        self.proxy.connect(per_thread)

    def connect(self, group: Any = None) -> "HostComm":
        """Exchange connection info through torch.distributed (any backend with all_gather_object) and start."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("HostComm.connect needs torch.distributed initialised (gloo works on CPU)")
        if dist.get_world_size(group) != self.world or dist.get_rank(group) != self.rank:
            raise ValueError(f"HostComm(rank={self.rank}, world={self.world}) does not match the process group "
                             f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})")
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.local_infos(), group=group)
        self.connect_infos(gathered)
        dist.barrier(group=group)  # every peer has mapped our shared memory: the names can go
        native.module().unlink_shared_host_memory_names()
        self.start()
        return self

    def start(self) -> None:
        self.proxy.start()
        self._started = True

    # ------------------------------------------------------------------ use
    def data(self):
        """A numpy uint8 view of this rank's registered data buffer."""
        import numpy as np

        return np.frombuffer(self.buffer, dtype=np.uint8)

    def signals(self):
        """A live numpy int64 view of this rank's signal counters."""
        return self.proxy.signals()

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a native call; a deadline that passed (TimeoutError, or the proxy watchdog's ProxyError) comes back
        with doctor.TIMEOUT_HINT appended, so the message says what to inspect next."""
        try:
            return fn(*args)
        except TimeoutError as exc:
            raise with_timeout_hint(exc) from None
        except native.module().ProxyError as exc:
            if not self.proxy.timed_out:
                raise
            raise with_timeout_hint(exc) from None

    def push(self, fifo: int, command: tuple[int, int]) -> int:
        return self._call(self.proxy.push, fifo, command)

    def push_array(self, fifo: int, commands) -> None:
        self._call(self.proxy.push_array, fifo, commands)

    def wait_done(self, fifo: int, index: int) -> None:
        """Wait until the FIFO's tail passed ``index`` (a quiet pushed at ``index`` completed)."""
        self._call(self.proxy.wait_done, fifo, index)

    def check(self) -> None:
        self._call(self.proxy.check)

    def wait_idle(self, timeout_secs: Optional[float] = None) -> None:
        self._call(self.proxy.wait_idle, self.options["timeout_secs"] if timeout_secs is None else timeout_secs)

    def wait_signal(self, slot: int, expected: int, timeout_secs: Optional[float] = None) -> int:
        return self._call(self.proxy.wait_signal, slot, expected,
                          self.options["timeout_secs"] if timeout_secs is None else timeout_secs)

    def stats(self) -> list[dict]:
        return [self.proxy.stats(t) for t in range(self.num_threads)]

    def close(self, deliver: bool = True) -> None:
        """Stop the proxy. With ``deliver`` (default), first wait up to the CPU deadline until every pushed command
        was taken and every write it posted completed: stopping drops what the proxy still holds, and a peer waiting
        for those writes sees a clean close, not an error, so it would wait until its own deadline
        (docs/host-core.md, "Teardown"). A failed proxy stops at once; a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if deliver and not self.proxy.failed:
            try:
                self.proxy.wait_idle(self.options["timeout_secs"])
            except Exception as exc:  # noqa: BLE001 - teardown: say what is dropped, then stop anyway
                print(f"uccl-ep: rank {self.rank}: close: the proxy did not deliver every write: {exc}",
                      file=sys.stderr)
        self.proxy.stop()
        if self.copy_agent is not None:
            self.copy_agent.close()

    def __enter__(self) -> "HostComm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect_in_process(comms: Sequence[HostComm]) -> None:
    """Connect ranks that live in this process (tests, single-process emulation) and start them."""
    infos = [c.local_infos() for c in comms]
    for c in comms:
        c.connect_infos(infos)
    native.module().unlink_shared_host_memory_names()
    for c in comms:
        c.start()
