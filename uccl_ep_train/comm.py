"""The host communication core from Python: build a rank's proxy from the settings and connect it to its peers.

The native objects (`uccl_ep_train._C.Proxy`, `HostBuffer`) do the work; this module only translates
:class:`uccl_ep_train.settings.Settings` into their arguments and runs the connection bootstrap through
torch.distributed (``all_gather_object``; gloo on CPU is enough). See docs/host-core.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from uccl_ep_train import native
from uccl_ep_train.settings import Settings, SettingsError, load_settings

#: Default in-flight byte cap when UCCL_IB_MAX_INFLIGHT_BYTES is unset (the verbs transport picks per-NIC defaults).
DEFAULT_INFLIGHT_BYTES = 2 << 20


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

    def kwargs(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["cpus"] = list(self.cpus)
        return d


def proxy_options(settings: Settings, rank: int, world: int, *, num_signal_slots: int = 1024,
                  low_latency: bool = False) -> ProxyOptions:
    """Translate settings into proxy arguments; raises SettingsError for combinations the host core cannot run."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    if not 1 <= num_signal_slots <= 16383:
        raise ValueError(f"num_signal_slots={num_signal_slots} must be in 1..16383")
    t, p, e = settings.transport, settings.proxy, settings.emulation
    transport = t.transport
    if transport == "auto":
        transport = "loopback"  # the verbs transport is chosen here once its binding offers a proxy factory
    if transport != "loopback":
        raise SettingsError(f"UCCL_EP_TRANSPORT={t.transport}: the host proxy currently runs over loopback only; "
                            "set UCCL_EP_TRANSPORT=loopback")
    writes = t.ib_max_inflight_low_latency if low_latency else t.ib_max_inflight_normal
    return ProxyOptions(
        rank=rank, world=world, num_threads=p.num_threads, fifos_per_thread=p.fifos_per_thread,
        fifo_depth=p.fifo_depth, cpus=tuple(p.cpus), idle_backoff_us=p.idle_backoff_us, timeout_secs=p.timeout_secs,
        max_inflight_writes=writes,
        max_inflight_bytes=t.ib_max_inflight_bytes if t.ib_max_inflight_bytes is not None else DEFAULT_INFLIGHT_BYTES,
        reorder_window=t.reorder_window, num_signal_slots=num_signal_slots, transport=transport,
        loopback_reorder=e.loopback_reorder, loopback_delay_us=e.loopback_delay_us,
        loopback_bandwidth_gbps=e.loopback_bandwidth_gbps, loopback_seed=e.loopback_seed)


class HostComm:
    """One rank's data buffer, signal counters, command FIFOs and proxy threads.

    Create one per rank, then call :meth:`connect` (through torch.distributed) or :func:`connect_in_process`.
    Errors of the proxy threads surface as ``uccl_ep_train._C.ProxyError`` from :meth:`check`, :meth:`wait_idle`,
    :meth:`wait_signal` and the push methods; deadlines raise ``TimeoutError``.
    """

    def __init__(self, data_bytes: int, rank: int, world: int, *, settings: Optional[Settings] = None,
                 num_signal_slots: int = 1024, low_latency: bool = False, **overrides: Any):
        if data_bytes <= 0:
            raise ValueError(f"data_bytes={data_bytes} must be positive")
        _C = native.module()
        self.settings = settings if settings is not None else load_settings()
        opts = proxy_options(self.settings, rank, world, num_signal_slots=num_signal_slots, low_latency=low_latency)
        kwargs = opts.kwargs()
        unknown = set(overrides) - set(kwargs)
        if unknown:
            raise TypeError(f"unknown proxy option(s): {sorted(unknown)}")
        kwargs.update(overrides)
        if kwargs["transport"] == "loopback" and kwargs["loopback_reorder"] > 1 and \
                kwargs["max_inflight_writes"] >= kwargs["reorder_window"]:
            raise SettingsError(f"the reorder window ({kwargs['reorder_window']}) must exceed the writes in flight "
                                f"({kwargs['max_inflight_writes']}); raise UCCL_EP_REORDER_WINDOW")
        self.options = kwargs
        self.rank, self.world = rank, world
        self.buffer = _C.HostBuffer(data_bytes)
        self.proxy = _C.Proxy(self.buffer, **kwargs)
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

    def push(self, fifo: int, command: tuple[int, int]) -> int:
        return self.proxy.push(fifo, command)

    def push_array(self, fifo: int, commands) -> None:
        self.proxy.push_array(fifo, commands)

    def check(self) -> None:
        self.proxy.check()

    def wait_idle(self, timeout_secs: Optional[float] = None) -> None:
        self.proxy.wait_idle(self.options["timeout_secs"] if timeout_secs is None else timeout_secs)

    def wait_signal(self, slot: int, expected: int, timeout_secs: Optional[float] = None) -> int:
        return self.proxy.wait_signal(slot, expected,
                                      self.options["timeout_secs"] if timeout_secs is None else timeout_secs)

    def stats(self) -> list[dict]:
        return [self.proxy.stats(t) for t in range(self.num_threads)]

    def close(self) -> None:
        self.proxy.stop()

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
