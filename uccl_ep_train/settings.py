"""Every user-tunable knob of uccl-ep-train, its environment name, default and validation, in one place.

The UCCL_* names match UCCL-EP's so that cluster settings carry over unchanged; names of our own start with
UCCL_EP_. Nothing else in the package reads os.environ for these: call :func:`load_settings` and pass the
resulting dataclasses down (the native module receives plain integers and strings).

docs/settings.md lists the same table for users; `uccl-ep-train doctor` prints the resolved values.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional


class SettingsError(ValueError):
    """A UCCL_* environment variable holds a value we cannot use. The message names the variable and the fix."""


def _meta(env: str, doc: str, parse: Callable[[str], Any] | None = None) -> dict:
    return {"env": env, "doc": doc, "parse": parse}


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip(), 0)
        if lo is not None and value < lo:
            raise ValueError(f"must be >= {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"must be <= {hi}")
        return value

    return parse


def _float(lo: float | None = None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if value != value:
            raise ValueError("must be a number, not NaN")
        if lo is not None and value < lo:
            raise ValueError(f"must be >= {lo}")
        return value

    return parse


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _auto_or_bool(text: str) -> str:
    """'auto', or a boolean word as 'on' / 'off' (so that 1/0 keep working where a boolean setting gained 'auto')."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if _bool(text) else "off"
    except ValueError:
        raise ValueError("must be auto or one of 1/0, true/false, yes/no, on/off") from None


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11), the format of taskset and /sys/devices/system/cpu/*/cpulist."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"range {part!r} is backwards")
            cpus.extend(range(lo, hi + 1))
        else:
            cpus.append(int(part))
    if any(c < 0 for c in cpus):
        raise ValueError("CPU ids must be >= 0")
    return tuple(cpus)


def _name_list(text: str) -> tuple[str, ...]:
    """'mlx5_0,mlx5_1' or 'mlx5_0:1,mlx5_1:1' (NCCL_IB_HCA style; a leading '=' or '^' is kept on the first name)."""
    return tuple(filter(None, (p.strip() for p in text.split(","))))


@dataclass(frozen=True)
class TransportSettings:
    """How proxies reach remote GPUs: which transport, which NIC, and the NIC-level flow control."""

    transport: str = field(default="auto", metadata=_meta(
        "UCCL_EP_TRANSPORT", "auto, verbs, or loopback (one host only). auto: internode backend: loopback when "
        "every rank is on one host, else verbs; standalone proxies: verbs when an RDMA NIC is usable, else loopback",
        _choice("auto", "verbs", "loopback")))
    socket_ifname: Optional[str] = field(default=None, metadata=_meta(
        "UCCL_SOCKET_IFNAME", "network interface for bootstrap traffic (as NCCL_SOCKET_IFNAME)", str.strip))
    ib_hca: tuple[str, ...] = field(default=(), metadata=_meta(
        "UCCL_IB_HCA", "RDMA devices to use, comma separated (mlx5_0,mlx5_1 or rdmap0s31:1); empty: all, nearest first",
        _name_list))
    ib_gid_index: int = field(default=-1, metadata=_meta(
        "UCCL_IB_GID_INDEX", "GID index; -1 picks one the way NCCL does (RoCE v2, IPv4-mapped, else global IPv6)",
        _int(-1, 255)))
    ib_sl: Optional[int] = field(default=None, metadata=_meta(
        "UCCL_IB_SL", "InfiniBand service level (unset: 3 on IB/RoCE, 8 on EFA)", _int(0, 15)))
    ib_tc: Optional[int] = field(default=None, metadata=_meta(
        "UCCL_IB_TC", "RoCE traffic class (unset: 104 on IB/RoCE, 0 on EFA)", _int(0, 255)))
    ib_max_inflight_bytes: Optional[int] = field(default=None, metadata=_meta(
        "UCCL_IB_MAX_INFLIGHT_BYTES",
        "bytes in flight per proxy thread (unset: 2 MiB IB/RoCE, 8 MiB EFA; Broadcom Thor-2 wants ~1.5 MiB)",
        _int(1)))
    write_bytes: Optional[int] = field(default=None, metadata=_meta(
        "UCCL_EP_WRITE_BYTES",
        "bytes per RDMA write (chunk) of an internode hop (unset: a quarter of UCCL_IB_MAX_INFLIGHT_BYTES, the whole "
        "cap below 256 KiB); the group uses its ranks' smallest, and no write exceeds a transport's limit", _int(16)))
    ib_max_inflight_normal: int = field(default=8, metadata=_meta(
        "UCCL_IB_MAX_INFLIGHT_NORMAL", "writes in flight per proxy thread in normal (HT) mode; Thor-2/Pollara: 1",
        _int(1)))
    ib_max_inflight_low_latency: int = field(default=32, metadata=_meta(
        "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY", "writes in flight per proxy thread in low-latency mode", _int(1)))
    reorder_window: int = field(default=256, metadata=_meta(
        "UCCL_EP_REORDER_WINDOW",
        "sequence numbers a receiving proxy holds while waiting for an earlier one (unordered NICs); "
        "must exceed the writes in flight", _int(2, 1 << 15)))


@dataclass(frozen=True)
class ProxySettings:
    """The CPU proxy threads that drain the GPU's command FIFOs."""

    num_threads: int = field(default=4, metadata=_meta(
        "UCCL_EP_NUM_PROXY_THREADS", "proxy threads per GPU", _int(1, 64)))
    fifos_per_thread: int = field(default=8, metadata=_meta(
        "UCCL_EP_FIFOS_PER_THREAD", "command FIFOs each proxy thread drains", _int(1, 64)))
    fifo_depth: int = field(default=2048, metadata=_meta(
        "UCCL_EP_FIFO_DEPTH", "commands per FIFO ring (power of two)", _int(2, 1 << 20)))
    cpus: tuple[int, ...] = field(default=(), metadata=_meta(
        "UCCL_EP_PROXY_CPUS", "CPUs of this host to pin proxy threads (and the loopback's copy agent) to, e.g. "
        "0-31; each rank of the host takes its own contiguous share, in local-rank order (empty: no pinning; doctor "
        "suggests cores near the NIC)", _cpu_list))
    idle_backoff_us: int = field(default=0, metadata=_meta(
        "UCCL_EP_PROXY_IDLE_BACKOFF_US", "sleep this long after an idle poll round (0: busy-poll)", _int(0, 1_000_000)))
    dump_file: Optional[str] = field(default=None, metadata=_meta(
        "UCCL_EP_PROXY_DUMP_FILE", "a path; touching that file makes every proxy thread print its state to stderr "
        "(FIFO positions, queued and in-flight writes, the transport's state): for a stuck job", str.strip))
    timeout_secs: float = field(default=100.0, metadata=_meta(
        "UCCL_EP_CPU_TIMEOUT_SECS", "deadline for any host-side wait (proxy poll, host sync) before it raises",
        _float(0.001)))


@dataclass(frozen=True)
class KernelSettings:
    """GPU-side knobs of dispatch/combine."""

    backend: str = field(default="auto", metadata=_meta(
        "UCCL_EP_BACKEND", "auto (native kernels when built for this device, else reference), native, reference",
        _choice("auto", "native", "reference")))
    num_sms: int = field(default=24, metadata=_meta(
        "UCCL_EP_NUM_SMS", "SMs used by the dispatch/combine kernels that move data between GPUs (even number)",
        _int(2, 1024)))
    local_sms: int = field(default=0, metadata=_meta(
        "UCCL_EP_LOCAL_SMS", "SMs for the kernels of a call that touch only this GPU's memory (dispatch's receive "
        "copy, combine's reduce, the expert-major sum); 0: the whole GPU. Set it to UCCL_EP_NUM_SMS to hold a whole "
        "call to that many SMs", _int(0, 1024)))
    combine_copy_engine: bool = field(default=True, metadata=_meta(
        "UCCL_EP_COMBINE_COPY_ENGINE", "intranode combine moves rows between GPUs with copy engines (cudaMemcpyAsync, "
        "no SM) and sums them as they land; 0: SM stores over NVLink. Used where the row counts are on the host "
        "(handles of normal and cached dispatch); sync-free handles always use SM stores", _bool))
    dispatch_copy_engine: bool = field(default=True, metadata=_meta(
        "UCCL_EP_DISPATCH_COPY_ENGINE", "intranode rank-major dispatch copies the peers' rows from its receive area "
        "to the output with the copy engine (no SM) while its kernel copies the metadata; 0: the kernel copies "
        "everything. Used where the row counts are on the host (normal and cached dispatch) and the rows hold at "
        "least 8 MiB, not for FP8; it frees the SMs (24-SM calls gain), the whole GPU copies as fast "
        "(docs/intranode.md)",
        _bool))
    copy_chunk_bytes: int = field(default=8 << 20, metadata=_meta(
        "UCCL_EP_COPY_CHUNK_BYTES", "bytes per copy-engine transfer of that combine; a flag follows each, so smaller "
        "chunks start the sum sooner, but each transfer costs ~5 us of idle engine on H200 (docs/intranode.md)",
        _int(16384)))
    copy_streams: int = field(default=2, metadata=_meta(
        "UCCL_EP_COPY_STREAMS", "copy streams of that combine, one copy engine each: the peer at distance k (mod "
        "ranks) uses stream (k - 1) mod n, so up to n peers are sent to at once (on 4x H200, 2 beat 1 and 3)",
        _int(1, 8)))
    gpu_timeout_secs: float = field(default=100.0, metadata=_meta(
        "UCCL_EP_GPU_TIMEOUT_SECS", "deadline for any GPU spin wait before the kernel reports and traps",
        _float(0.001)))
    gated_arrivals: bool = field(default=True, metadata=_meta(
        "UCCL_EP_GATED_ARRIVALS", "internode: the kernel that reads a hop's arrivals (dispatch's unpack with one GPU "
        "per node, the dispatch forward over NVLink with several, combine's sum of partial sums) starts with the hop "
        "and reads each chunk as its counter shows it landed; 0: it starts after the whole hop (docs/internode.md, "
        "Gated arrivals, Gated forward)", _bool))
    skip_dispatch_barrier: bool = field(default=True, metadata=_meta(
        "UCCL_EP_SKIP_DISPATCH_BARRIER", "internode: a cached dispatch right after a combine skips its entry barrier "
        "when that combine's traffic proves every rank is done with the areas (docs/internode.md, Areas and entry "
        "barriers); 0: always keep it", _bool))
    push_head: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PUSH_HEAD", "internode: a hop's sender writes the first 1/16 of its first block's chunks, pushes "
        "them, then writes and pushes the rest, so the network starts before every record is written "
        "(docs/internode.md, Push head); 0: write every record, then push", _bool))
    pack_and_push: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PACK_AND_PUSH", "internode: a hop's sender writes its records and pushes their chunks in one "
        "launch, each chunk as soon as its records are written (docs/internode.md, Pack and push); 0: separate "
        "launches (the push head, UCCL_EP_PUSH_HEAD, then applies)", _bool))
    pipelined_combine_gather: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PIPELINED_COMBINE_GATHER", "internode, several GPUs per node: a combine's local GPUs copy their rows "
        "to the forwarders in tiles and flag each tile over NVLink; each forwarder sums and pushes a chunk once its "
        "tiles are flagged, so the hop starts with the first tiles (docs/internode.md, Pipelined combine gather); 0: "
        "the whole gather, a group barrier, the node sum, then the hop", _bool))
    gather_beside_push: bool = field(default=True, metadata=_meta(
        "UCCL_EP_GATHER_BESIDE_PUSH", "internode, pipelined combine gather: the local GPU's copies to the forwarders "
        "run on a second stream beside its own node sum and push, which then start with the first flagged tiles "
        "instead of after the whole copy (docs/internode.md, Pipelined combine gather); 0: one stream, in turn", _bool))
    gather_beside_push_blocks: int = field(default=64, metadata=_meta(
        "UCCL_EP_GATHER_BESIDE_PUSH_BLOCKS", "with UCCL_EP_GATHER_BESIDE_PUSH: most blocks of the node sum and push "
        "launch, whose blocks wait for the copies' tiles: the copies must always find room on the GPU beside them",
        _int(1, 4096)))
    gather_blocks: int = field(default=64, metadata=_meta(
        "UCCL_EP_GATHER_BLOCKS", "internode, pipelined combine gather: blocks of the local GPU's copies to the "
        "forwarders, which take the tiles in order so that the first are flagged early (docs/internode.md, Pipelined "
        "combine gather); 0: a block per tile, every tile at once (each flagged near the end of the copy)",
        _int(0, 4096)))
    unpack_beside_forward: bool = field(default=False, metadata=_meta(
        "UCCL_EP_UNPACK_BESIDE_FORWARD", "internode, several GPUs per node, rank-major receives and expert-major ones "
        "read before the count read: each forwarder marks every final row it writes ready, and each GPU reads its rows "
        "on a second stream as they are marked, "
        "during the hop, instead of after a node barrier behind every forwarder's whole forward (docs/internode.md, "
        "The unpack beside the forward; off: each call alone was slower on 4x H200); 0: the barrier, then the unpack",
        _bool))
    unpack_beside_forward_blocks: int = field(default=256, metadata=_meta(
        "UCCL_EP_UNPACK_BESIDE_FORWARD_BLOCKS", "with UCCL_EP_UNPACK_BESIDE_FORWARD: most blocks of the unpack, and "
        "of the forward beside it, so that both always find room on the GPU (the unpack's rows wait for the forward)",
        _int(1, 2048)))
    forward_node_barrier: bool = field(default=True, metadata=_meta(
        "UCCL_EP_FORWARD_NODE_BARRIER", "internode, several GPUs per node: after the dispatch forward each forwarder "
        "raises a flag in every local GPU's NVL region, and each GPU waits for its node's flags before reading its "
        "rows (docs/internode.md, The dispatch forward's node barrier); 0: a group barrier through the proxies", _bool))
    expert_sums_in_pack: bool = field(default=True, metadata=_meta(
        "UCCL_EP_EXPERT_SUMS_IN_PACK", "internode, one GPU per node: an expert-major combine's pack sums each "
        "token's local expert rows as it writes the token's record, so each chunk leaves once its rows are summed "
        "(docs/internode.md, Expert-major sums in the pack); 0: a kernel sums every row before the pack starts",
        _bool))
    pack_during_notify: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PACK_DURING_NOTIFY", "internode: an uncached dispatch right after a combine of the last dispatch's "
        "handle packs its records for the other nodes while notify exchanges the counts (docs/internode.md, Packing "
        "during notify); 0: after notify", _bool))
    push_during_notify: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PUSH_DURING_NOTIFY", "internode: the records packed during notify are pushed "
        "then too, by a kernel that waits on the GPU for every count row and places each block from them "
        "(docs/internode.md, Push during notify); 0: the push waits for the host's plan after notify", _bool))
    read_before_counts: bool = field(default=True, metadata=_meta(
        "UCCL_EP_READ_BEFORE_COUNTS", "internode: a dispatch pushed during notify launches its reader before the "
        "host reads the count matrix, taking its rows and gate from the count rows on the device, into outputs sized "
        "from num_worst_tokens or the last dispatch of that size (docs/internode.md, Reading before the count read); "
        "with several GPUs per node (rank-major receives) the forward, node barrier and unpack go there too (The "
        "forward before the count read); 0: the reader follows the host's plan", _bool))
    own_rows_from_columns: bool = field(default=True, metadata=_meta(
        "UCCL_EP_OWN_ROWS_FROM_COLUMNS", "internode, one GPU per node: a dispatch's gated reader takes our own "
        "node's rows straight from the input columns, so the sender never packs them (docs/internode.md, Own rows "
        "from the columns); 0: they are packed into the receive area and read from there", _bool))
    read_before_counts_slack: float = field(default=0.0625, metadata=_meta(
        "UCCL_EP_READ_BEFORE_COUNTS_SLACK", "internode: without num_worst_tokens, the rows allocated for a reader "
        "launched before the count read are the last dispatch's received rows times 1 + this (capped by the "
        "receive area); a dispatch that receives more is read after notify instead. Spare rows are memory held with "
        "the outputs", _float(0.0)))
    plan_ahead: str = field(default="auto", metadata=_meta(
        "UCCL_EP_PLAN_AHEAD", "internode: during its network hop an uncached dispatch plans its handle's combine, "
        "and that combine the backward pass's calls (a cached dispatch of a bf16 gradient and of the same columns, a "
        "combine with the top-k weights), so that each starts sooner (docs/internode.md, Planning ahead); 0: each "
        "call plans at its first use; auto: ahead with one GPU per node, at first use with several (where the "
        "dispatch's planning sat between its count read and its return)", _auto_or_bool))
    expert_major_in_reader: str = field(default="auto", metadata=_meta(
        "UCCL_EP_EXPERT_MAJOR_IN_READER", "internode: an expert-major dispatch's reader writes each row straight to "
        "its experts' rows as it lands, the sender having ranked each (token, expert) pair (docs/internode.md, "
        "Expert-major rows in the reader). auto: where the readers have the whole GPU; where ranks share one (their "
        "spinning grids are held to a few blocks) only where the reader starts with the hop: cached dispatches, and "
        "uncached ones that read before the count read; always; never: rank-major rows first, then the expert-major "
        "plan and copy after the hop",
        _choice("auto", "always", "never")))
    pinned_uploads: bool = field(default=True, metadata=_meta(
        "UCCL_EP_PINNED_UPLOADS", "internode: small tables (push tables, gates, plans) go to the device from a pinned "
        "area allocated at setup (docs/internode.md, Host cost per call); 0: from pageable memory, as before session "
        "25 (for an A/B)", _bool))
    drain_after_waits: str = field(default="auto", metadata=_meta(
        "UCCL_EP_DRAIN_AFTER_WAITS", "internode: always: after every network wait the host waits for its stream. "
        "never: launch on while the wait spins, and sync-free dispatches (num_worst_tokens) may return before the "
        "host reads the counts (docs/internode.md, Sync-free dispatch). auto: never where the proxies make no CUDA "
        "call after setup (verbs, and the loopback with its copy agent: UCCL_EP_LOOPBACK_COPY_AGENT), always where "
        "the proxy threads copy (docs/internode.md, Drains). Over the loopback without the agent, never is correct "
        "only from a non-default stream, and refused on the legacy default stream", _choice("auto", "always", "never")))


@dataclass(frozen=True)
class EmulationSettings:
    """Make one host's GPUs play several nodes, and make the loopback transport behave like a NIC."""

    ranks_per_node: int = field(default=0, metadata=_meta(
        "UCCL_EP_RANKS_PER_NODE", "ranks per (emulated) node; 0: LOCAL_WORLD_SIZE, i.e. real nodes", _int(0)))
    loopback_bandwidth_gbps: float = field(default=0.0, metadata=_meta(
        "UCCL_EP_LOOPBACK_BW_GBPS", "loopback bandwidth cap per GPU in GB/s (0: uncapped)", _float(0.0)))
    loopback_reorder: int = field(default=0, metadata=_meta(
        "UCCL_EP_LOOPBACK_REORDER", "deliver loopback writes shuffled within windows of this many (0/1: in order)",
        _int(0, 1 << 15)))
    loopback_delay_us: int = field(default=0, metadata=_meta(
        "UCCL_EP_LOOPBACK_DELAY_US", "extra delivery delay of each loopback write in microseconds", _int(0)))
    loopback_seed: int = field(default=0, metadata=_meta(
        "UCCL_EP_LOOPBACK_SEED", "seed of the loopback reordering", _int(0)))
    loopback_copy_agent: str = field(default="auto", metadata=_meta(
        "UCCL_EP_LOOPBACK_COPY_AGENT", "who moves the loopback's bytes. on: a process of each rank's own, the copy "
        "agent, as a NIC's DMA engine moves them: nothing the training process does (a free, a module load, a "
        "pageable copy) can hold a write back, and the proxy threads make no CUDA call after setup "
        "(docs/internode.md, The copy agent). off: the proxy threads, with CUDA copies in the training process. "
        "auto: the agent for the internode backend where each rank has a GPU of its own; the proxy threads where "
        "ranks share a GPU and for host memory (HostComm)", _choice("auto", "on", "off")))


@dataclass(frozen=True)
class DispatcherSettings:
    """How UCCLTokenDispatcher drives the Buffer inside Megatron (uccl_ep_train.megatron.options reads these)."""

    async_comm: bool = field(default=True, metadata=_meta(
        "UCCL_EP_ASYNC_COMM", "dispatch/combine on the Buffer's communication stream, ordered by events (CUDA)",
        _bool))
    fp8_dispatch: bool = field(default=False, metadata=_meta(
        "UCCL_EP_DISPATCH_FP8", "send tokens as FP8 e4m3 with per-128-channel scales (combine stays BF16)", _bool))
    sync_free: bool = field(default=False, metadata=_meta(
        "UCCL_EP_SYNC_FREE", "no host sync: fixed-size outputs, token counts stay on the device (CUDA graphs)",
        _bool))
    num_worst_tokens: int = field(default=0, metadata=_meta(
        "UCCL_EP_NUM_WORST_TOKENS", "rows received per rank in sync-free mode (0: the worst case, tokens x ranks, x "
        "min(top-k, local experts) with the expert-major receive; in Megatron with moe_expert_capacity_factor at "
        "most local experts x ranks x the router's expert capacity)", _int(0)))
    expert_major: bool = field(default=True, metadata=_meta(
        "UCCL_EP_EXPERT_MAJOR", "receive tokens grouped by local expert, skipping permute/unpermute", _bool))


@dataclass(frozen=True)
class Settings:
    transport: TransportSettings = field(default_factory=TransportSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    kernel: KernelSettings = field(default_factory=KernelSettings)
    emulation: EmulationSettings = field(default_factory=EmulationSettings)
    dispatcher: DispatcherSettings = field(default_factory=DispatcherSettings)

    def validate(self) -> "Settings":
        """Cross-field rules. Raises SettingsError saying which variables conflict and what to change."""
        depth = self.proxy.fifo_depth
        if depth & (depth - 1):
            raise SettingsError(f"UCCL_EP_FIFO_DEPTH={depth} must be a power of two (e.g. {1 << depth.bit_length()})")
        inflight = max(self.transport.ib_max_inflight_normal, self.transport.ib_max_inflight_low_latency)
        if self.transport.reorder_window <= inflight:
            raise SettingsError(
                f"UCCL_EP_REORDER_WINDOW={self.transport.reorder_window} must exceed the writes in flight "
                f"({inflight}, from UCCL_IB_MAX_INFLIGHT_*): raise the window or lower the caps")
        if self.emulation.loopback_reorder > self.transport.reorder_window:
            raise SettingsError(
                f"UCCL_EP_LOOPBACK_REORDER={self.emulation.loopback_reorder} exceeds UCCL_EP_REORDER_WINDOW="
                f"{self.transport.reorder_window}: the receiver could not restore order; lower the first")
        if self.dispatcher.num_worst_tokens and not self.dispatcher.sync_free:
            raise SettingsError(f"UCCL_EP_NUM_WORST_TOKENS={self.dispatcher.num_worst_tokens} only applies with "
                                "UCCL_EP_SYNC_FREE=1: set both, or unset the first")
        if self.kernel.num_sms % 2:
            raise SettingsError(f"UCCL_EP_NUM_SMS={self.kernel.num_sms} must be even (SMs pair up as send/receive)")
        return self

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings (for launchers and for logging a run)."""
        out: dict[str, str] = {}
        for group, meta, value in _walk(self):
            if value is None or value == () or value == group.__dataclass_fields__[meta.name].default:
                continue
            if isinstance(value, tuple):
                value = ",".join(str(v) for v in value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            out[meta.metadata["env"]] = str(value)
        return out


def _walk(settings: Settings):
    for group_field in dataclasses.fields(settings):
        group = getattr(settings, group_field.name)
        for f in dataclasses.fields(group):
            yield group, f, getattr(group, f.name)


def describe() -> list[tuple[str, str, str]]:
    """(environment name, default, description) for every setting: the table docs/settings.md shows."""
    rows = []
    for _, f, value in _walk(Settings()):
        rows.append((f.metadata["env"], "" if value in (None, ()) else str(value), f.metadata["doc"]))
    return rows


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every UCCL_* setting from ``env`` (default os.environ), validate, and return them.

    An unset or empty variable keeps its default; a malformed one raises SettingsError naming it.
    """
    env = os.environ if env is None else env
    groups = {}
    for group_field in dataclasses.fields(Settings):
        cls = group_field.default_factory  # type: ignore[misc]
        values = {}
        for f in dataclasses.fields(cls):
            name, parse = f.metadata["env"], f.metadata["parse"]
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[f.name] = parse(raw)
            except ValueError as exc:
                raise SettingsError(f"{name}={raw!r}: {exc} ({f.metadata['doc']})") from None
        groups[group_field.name] = cls(**values)
    return Settings(**groups).validate()
