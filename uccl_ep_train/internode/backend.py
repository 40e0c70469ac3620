"""NativeInternodeBackend: setup (regions, proxies, transport, the settings every rank must share), teardown, and the
benchmarks' probes. The calls themselves are composed from the parts in this package, one module each."""
from __future__ import annotations

import functools
import operator
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from uccl_ep_train import native
from uccl_ep_train.backends import BackendContext, DispatchResult
from uccl_ep_train.internode.diagnostics import track
from uccl_ep_train.kernel_timeline import KernelTimeline
from uccl_ep_train.internode.plan import (InternodeError, NOTIFY_AREAS, NOTIFY_MAX_EXPERTS, CMD_UNIT, CMD_MAX_BYTES,
                                          CMD_MAX_REGION, check_topology, Counts, chunk_bytes, _align, notify_row_words,
                                          CombineAreas,
                                          READ_DIMS, READ_GO, FORWARD_DIMS, GATE_FIXED_COLUMNS as GATE_FIXED,
                                          GATHER_MAX_TILES, GATHER_MIN_TILE_ROWS, node_flag_bytes, ready_word_rows,
                                          ready_word_bytes)
from uccl_ep_train.internode.transport import (shared_gpu_warning, device_pci_address, loopback_queue_hazard,
                                               mps_enabled, other_nodes_on_this_gpu, select_internode_transport,
                                               shared_gpu_spin_blocks, use_copy_agent)
from uccl_ep_train.cpu_placement import rank_cpus
from uccl_ep_train.upload_staging import UploadStaging
from uccl_ep_train.internode.columns import (_empty_rows, _raw_bytes, _address, _dense, _row_bytes, _record_layout,
                                             _column_args)
from uccl_ep_train.internode.handle import InternodeHandle
from uccl_ep_train.internode.call_state import CountRows
from uccl_ep_train.internode.drains import drain_after_waits, Drains
from uccl_ep_train.internode.records import Records
from uccl_ep_train.internode.notify import CountExchange
from uccl_ep_train.internode.hops import NetworkHops
from uccl_ep_train.internode.planning_ahead import PlanningAhead
from uccl_ep_train.internode.forward import NvlinkForward
from uccl_ep_train.internode.before_counts import BeforeCounts
from uccl_ep_train.internode.expert_major import reads_expert_major_rows, ExpertMajorReceive
from uccl_ep_train.internode.dispatch import Dispatch
from uccl_ep_train.internode.combine import Combine


# Settings that choose how the ranks synchronize with each other: a rank that took the other way would wait for flags
# or signals its peers never send, until the GPU deadline. Checked alike at setup (environment name -> field).
_GROUP_SETTINGS = {"UCCL_EP_PIPELINED_COMBINE_GATHER": "pipelined_combine_gather",
                   "UCCL_EP_FORWARD_NODE_BARRIER": "forward_node_barrier",
                   "UCCL_EP_PACK_AND_PUSH": "pack_and_push",
                   "UCCL_EP_UNPACK_BESIDE_FORWARD": "unpack_beside_forward",
                   # the unpack beside the forward waits for ready words that only a gated forwarder writes
                   "UCCL_EP_GATED_ARRIVALS": "gated_arrivals"}


def group_settings_disagree(per_rank: List[Tuple[Any, ...]], names: Tuple[str, ...]) -> Optional[str]:
    """None when every rank holds the same values of the settings ``names`` (``per_rank[r]``: rank r's values in
    that order), else what differs and on which ranks, with what to do."""
    for i, name in enumerate(names):
        values = [v[i] for v in per_rank]
        if len(set(values)) > 1:
            by_value: dict = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            seen = "; ".join(f"{v} on ranks {rs}" for v, rs in by_value.items())
            return (f"{name} differs between the ranks ({seen}); every rank must use the same value (they would "
                    "wait for each other's flags or barriers in vain)")
    return None


class NativeInternodeBackend(Dispatch, Combine, BeforeCounts, ExpertMajorReceive, CountExchange, PlanningAhead,
                              NvlinkForward, Records, NetworkHops, Drains):
    """The ``Backend`` of uccl_ep_train.backends when the group spans several (possibly emulated) nodes. Its calls are
    composed from one class per part (the package's modules); no two parts define the same method, and the state they
    share is set here."""

    name = "native-internode"
    #: The process that moves this rank's loopback bytes (loopback_copy_agent.CopyAgent), or None: the proxy threads
    #: copy (over verbs there is nothing to copy).
    _copy_agent: Optional[Any] = None
    #: The most experts whose counts notify's rows carry (internode.plan.NOTIFY_MAX_EXPERTS; tests lower it to take the
    #: other way: the receiver counts the received ids).
    notify_max_experts: int = NOTIFY_MAX_EXPERTS
    #: How every output of a call is allocated (tests poison the rows, so that a row nobody writes cannot pass).
    _empty_rows = staticmethod(_empty_rows)

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.rank, self.R, self.G = ctx.rank, ctx.num_ranks, ctx.ranks_per_node
        self.N = self.R // self.G
        self.node, self.local = divmod(self.rank, self.G)
        s = ctx.settings
        self.L = int(s.proxy.num_threads) * int(s.proxy.fifos_per_thread)  # lanes: every proxy FIFO carries chunks
        slots = check_topology(self.R, self.G, self.L)
        _C = native.module()
        if not hasattr(_C, "internode"):
            raise InternodeError("uccl_ep_train._C has no `internode` submodule (built without CUDA, or module.cpp "
                                 "does not call bind_internode)")
        self._k = _C.internode
        if self.G > self._k.FORWARD_MAX_TARGETS:  # (its destinations sit in one block's shared memory)
            raise InternodeError(f"{self.G} GPUs per node: the dispatch forward (forward_arrivals) takes at most "
                                 f"{self._k.FORWARD_MAX_TARGETS}")
        # a CPU device means the CPU stand-in of _C.internode (tests/internode/fake_internode_native.py)
        self.device = ctx.device if ctx.device.index is not None or ctx.device.type != "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        self.cpu_timeout = float(s.proxy.timeout_secs)
        self.gpu_timeout = float(s.kernel.gpu_timeout_secs)
        self.rdma_bytes = _align(int(ctx.num_rdma_bytes) or (1 << 28))
        self.nvl_bytes = _align(int(ctx.num_nvl_bytes) or (1 << 28))
        if self.rdma_bytes > CMD_MAX_REGION:
            raise ValueError(f"num_rdma_bytes={self.rdma_bytes} exceeds the 4 GiB a command can address "
                             "(28-bit offsets in 16-byte units)")
        gathered = self._start_proxies(s, slots)
        self._lay_out_regions(s, gathered)
        self._choose_ways(s)
        self._first_launches()
        self._destroyed = False
        track(self)
        self.last_traffic = None
        # Benchmarks set this to time the network hop alone (push -> last signal) with CUDA events: phase -> [ms]
        self.network_timing: Optional[dict] = None
        # ... and this to split the host's wall time of each call into its steps: step -> [seconds, calls]
        self.host_timing: Optional[dict] = None
        self._lap_t = 0.0
        # ... and this to read the pack-and-push launches' GPU stamps (start_kernel_timeline)
        self.kernel_timeline: Optional[KernelTimeline] = None

    def _start_proxies(self, s: Any, slots: int) -> List[Any]:
        """Setup, step 1: the transport chosen alike on every rank, who moves the loopback's bytes, the native context
        with its proxies, and what every rank tells the others (proxy endpoints, NVL IPC handle, write limits, GPU,
        the settings they must share); returns that, by rank. The proxies are connected, not yet started."""
        t, p, e = s.transport, s.proxy, s.emulation
        ranks = dist.get_process_group_ranks(self.ctx.group) if self.ctx.group is not None else list(range(self.R))
        self._gloo = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self.cpu_timeout))
        from uccl_ep_train import comm

        self.transport = select_internode_transport(
            t.transport, self.rank, self.R, self._gloo,
            lambda: comm.gpu_nics(s, self.local, pci_address=device_pci_address(self.device)),
            verbs_built=bool(getattr(getattr(native.module(), "verbs", None), "available", False)))
        default_bytes = comm.DEFAULT_INFLIGHT_BYTES_EFA if self.transport.efa else comm.DEFAULT_INFLIGHT_BYTES
        self.inflight_bytes = t.ib_max_inflight_bytes if t.ib_max_inflight_bytes is not None else default_bytes
        # whether this GPU is shared through MPS (None: unknown, or not asked): what the loopback's copies need of
        # CUDA's queues and of the SMs beside our spinning kernels depends on it
        loopback_on_gpu = self.device.type == "cuda" and self.transport.name == "loopback"
        mps = mps_enabled(self.device.index) if loopback_on_gpu else None
        if self.device.type == "cuda":  # no CUDA on the CPU stand-in
            torch.cuda.set_device(self.device)
        # our share of the host's UCCL_EP_PROXY_CPUS, for the proxy threads and the copy agent (cpu_placement.py)
        self.proxy_cpus = rank_cpus(p.cpus, self.rank, self._gloo)
        # who moves the loopback's bytes: a process of our own (the copy agent) or the proxy threads
        self._copy_agent = None
        if loopback_on_gpu:
            gpus: List[Any] = [None] * self.R
            dist.all_gather_object(gpus, device_pci_address(self.device), group=self._gloo)
            if use_copy_agent(e.loopback_copy_agent, shares_gpu=gpus.count(gpus[self.rank]) > 1):
                from uccl_ep_train.loopback_copy_agent import CopyAgent

                # (stopped by destroy(); if this setup raises, by its __del__, or by itself once we are gone)
                self._copy_agent = CopyAgent(p.num_threads, self.device.index, cpus=self.proxy_cpus)
            else:  # the proxy threads' copies share this process's hardware work queues with our kernels
                hazard = loopback_queue_hazard(self.rank, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), mps,
                                               p.num_threads)
                if hazard:
                    warnings.warn(hazard, RuntimeWarning, stacklevel=2)
        self._cx = self._k.InternodeContext(
            rank=self.rank, world=self.R, device=self.device.index, rdma_bytes=self.rdma_bytes,
            nvl_bytes=self.nvl_bytes, num_threads=p.num_threads, fifos_per_thread=p.fifos_per_thread,
            fifo_depth=p.fifo_depth, cpus=list(self.proxy_cpus), idle_backoff_us=p.idle_backoff_us,
            timeout_secs=self.cpu_timeout, max_inflight_writes=t.ib_max_inflight_normal,
            max_inflight_bytes=self.inflight_bytes, reorder_window=t.reorder_window, num_signal_slots=slots,
            loopback_reorder=e.loopback_reorder, loopback_delay_us=e.loopback_delay_us,
            loopback_bandwidth_gbps=e.loopback_bandwidth_gbps, loopback_seed=e.loopback_seed,
            gpu_timeout_secs=float(s.kernel.gpu_timeout_secs), transport=self.transport.name,
            ib_devices=list(self.transport.devices), gid_index=list(self.transport.gid_index),
            sl=-1 if t.ib_sl is None else t.ib_sl, tc=-1 if t.ib_tc is None else t.ib_tc,
            dump_trigger=p.dump_file or "",
            loopback_copy_agent=self._copy_agent.name if self._copy_agent is not None else "")
        infos = [self._cx.proxy_local_info(i) for i in range(p.num_threads)]
        gathered: List[Any] = [None] * self.R
        gpu = device_pci_address(self.device)
        agreed = tuple(getattr(s.kernel, field) for field in _GROUP_SETTINGS.values())
        dist.all_gather_object(gathered, (infos, self._cx.nvl_ipc_handle(), int(self._cx.max_write_bytes),
                                          chunk_bytes(self.inflight_bytes, t.write_bytes), gpu, agreed),
                               group=self._gloo)
        disagreement = group_settings_disagree([g[5] for g in gathered], tuple(_GROUP_SETTINGS))
        if disagreement:  # (every rank sees the same values, so every rank raises here)
            raise InternodeError(f"rank {self.rank}: {disagreement}")
        others = other_nodes_on_this_gpu([g[4] for g in gathered], self.rank, self.G)
        if others and self.transport.name == "loopback":
            # the copies of those ranks' writes are kernels on this GPU: leave them room beside our spinning grids
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            on_gpu = sum(1 for g in gathered if g[4] == gpu)
            self._cx.spin_blocks = shared_gpu_spin_blocks(sms, on_gpu, mps)
            warnings.warn(shared_gpu_warning(self.rank, gpu, others, self._cx.spin_blocks, on_gpu, mps,
                                             copy_agent=self._copy_agent is not None), RuntimeWarning, stacklevel=2)
        # Every rank cuts chunks the same way (receivers derive their lanes from it), so the smallest largest write
        # of any rank's transport bounds them all (EFA devices may take less than a chunk: efadv max_rdma_size), and
        # so does the smallest chunk any rank's settings ask for.
        self.max_write_bytes = min(int(g[2]) for g in gathered) or CMD_MAX_BYTES
        self.write_bytes = min(min(int(g[3]) for g in gathered), self.max_write_bytes)
        self._cx.proxy_connect([[gathered[r][0][i] for r in range(self.R)] for i in range(p.num_threads)])
        return gathered

    def _lay_out_regions(self, s: Any, gathered: List[Any]) -> None:
        """Setup, step 2: where everything sits in the NVL and RDMA regions (final rows, gather blocks, flags, ready
        words; the receive and send halves, the notify area), the node's peers' NVL regions opened, and the proxies
        started once every rank is connected."""
        # the NVL region: final rows below half_nvl, the combine's gather blocks above, the flags among the node's GPUs
        # at the end (several GPUs per node: the gather's tile flags, then the forward's), which start below every
        # epoch on every rank before the barrier
        self._flag_base = self.nvl_bytes - node_flag_bytes(self.G)
        self._forward_flag_base = self._flag_base + 4 * self.G * GATHER_MAX_TILES
        # ... and below the flags, with UCCL_EP_UNPACK_BESIDE_FORWARD, a ready word per final row (the same on every
        # rank: the setting is agreed and every NVL region has the same size)
        self._ready_rows = ready_word_rows(self._flag_base, self.G, bool(s.kernel.unpack_beside_forward))
        self._ready_base = self._flag_base - ready_word_bytes(self._ready_rows)
        if self._ready_base < self.nvl_bytes:
            _raw_bytes(self._cx.nvl_ptr + self._ready_base, self.nvl_bytes - self._ready_base, self.device).zero_()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        dist.barrier(group=self._gloo)
        native.module().unlink_shared_host_memory_names()
        self._cx.proxy_start()
        node_ranks = range(self.node * self.G, (self.node + 1) * self.G)
        self.peer_nvl = self._cx.open_nvl_peers([bytes(gathered[r][1]) for r in node_ranks], self.local)
        # the dispatch forward's destinations, on the device for its one launch (forward_rows)
        self._forward_targets = torch.tensor(self.peer_nvl, dtype=torch.int64).to(self.device)
        # ... and where each one's ready words are (UCCL_EP_UNPACK_BESIDE_FORWARD)
        self._ready_targets = torch.tensor([p + self._ready_base for p in self.peer_nvl],
                                           dtype=torch.int64).to(self.device)
        self._forward_targets_or = functools.reduce(operator.or_, self.peer_nvl)
        self._rdma = _raw_bytes(self._cx.rdma_ptr, self.rdma_bytes, self.device)
        self._nvl = _raw_bytes(self._cx.nvl_ptr, self.nvl_bytes, self.device)
        # The notify areas (one count row per rank each, at the end of the RDMA region) are the count exchange through
        # the proxies, taken in turns (NOTIFY_AREAS); with very many ranks they would eat the region, and notify
        # falls back to a gloo all_gather. A row: [tokens per rank | per node | per expert, up to
        # NOTIFY_MAX_EXPERTS]; an area holds R of the widest (a call packs its rows at the width it uses).
        self._notify_row = _align(8 * notify_row_words(self.R, self.N))
        self._notify_area_bytes = self.R * self._notify_row
        self._notify_exchanges = 0  # count exchanges through the proxies so far: their turn of the areas
        notify_bytes = NOTIFY_AREAS * self._notify_area_bytes
        self._notify_via_proxies = notify_bytes <= self.rdma_bytes // 16
        usable = self.rdma_bytes - (notify_bytes if self._notify_via_proxies else 0)
        self.half_rdma = usable // 2 // CMD_UNIT * CMD_UNIT
        self._notify_base = 2 * self.half_rdma
        # where the matrix lands on the host: copied on the stream behind the notify wait, so the drain that follows
        # the wait also brings it home (a read-back after the drain was one more synchronous copy per dispatch). The
        # CPU stand-in copies there too, at the wait: read from the area later, a peer's next count row could be
        # there already (a peer whose dispatch needs nothing more of ours -- a forward before the count read -- may
        # start its next notify before we read this one)
        self._notify_host = (torch.empty(self._notify_area_bytes, dtype=torch.uint8,
                                         pin_memory=self.device.type == "cuda")
                             if self._notify_via_proxies else None)
        self._notify_view_cache: dict = {}  # _notify_views
        # small tables go to the device from pinned memory allocated now (a first pinned allocation may synchronize)
        self._staging = (UploadStaging(self.device, self._cx.copy_to_device)
                         if self.device.type == "cuda" and s.kernel.pinned_uploads else None)
        self.half_nvl = self._ready_base // 2 // CMD_UNIT * CMD_UNIT
        self.gather_block = self.half_nvl // self.G // CMD_UNIT * CMD_UNIT
        if self._cx.num_fifos != self.L:
            raise InternodeError(f"the proxy has {self._cx.num_fifos} FIFOs, planning assumed {self.L}")
        self._barrier_slot = 2 * self.N * self.L
        self._notify_slot = self._barrier_slot + 1
        self._fixed_tables: dict = {}  # (phase, row bytes) -> device push table that never changes (barrier, notify)
        self._zero_rows: dict = {}  # payload bytes -> zero row (combine: a node without a partial sum adds it)

    def _choose_ways(self, s: Any) -> None:
        """Setup, step 3: the ways the calls take (the kernel settings, resolved for this topology and transport), the
        state each way keeps between calls, and the counters tests and benchmarks read."""
        drains = drain_after_waits(s.kernel.drain_after_waits, self.transport.name, self._copy_agent is not None)
        self._drain_after_waits = self.device.type == "cuda" and drains
        # sync-free dispatches return before the count read only without drains (the CPU stand-in, which never
        # drains, follows the setting too: its tests see the GPU's behaviour)
        self._sync_free_returns_early = not drains
        # without drains, the loopback's calls must come from a non-default stream unless the copy agent moves its
        # bytes (check_stream_without_drains, the one rule; this only spares the stream lookup where it cannot refuse)
        self._check_stream = self.device.type == "cuda" and not self._drain_after_waits
        self.gated_arrivals = bool(s.kernel.gated_arrivals)  # docs/internode.md, "Gated arrivals"
        self.skip_dispatch_barrier = bool(s.kernel.skip_dispatch_barrier)
        self.push_head = bool(s.kernel.push_head)
        self.pack_and_push = bool(s.kernel.pack_and_push)
        self.expert_sums_in_pack = bool(s.kernel.expert_sums_in_pack)
        # docs/internode.md, "Pipelined combine gather": every rank of the group takes the same way (the forwarders
        # wait for flags only the pipelined gather raises), so nothing of one rank's hop decides it
        self.pipelined_gather = (bool(s.kernel.pipelined_combine_gather) and self.G > 1 and self.pack_and_push
                                 and self.G <= self._k.NODE_SUMS_MAX_RANKS_PER_NODE)
        if self.G > 1 and self._k.GATHER_MAX_TILES != GATHER_MAX_TILES:
            raise InternodeError(f"the module has {self._k.GATHER_MAX_TILES} gather tile flags, planning assumed "
                                 f"{GATHER_MAX_TILES} (rebuild _C)")
        # ... and its copies beside the node sum and push, on the context's second stream (the same on every rank)
        self.gather_beside_push = self.pipelined_gather and bool(s.kernel.gather_beside_push)
        self.gather_beside_push_blocks = int(s.kernel.gather_beside_push_blocks)
        self.gather_blocks = int(s.kernel.gather_blocks)
        self._gather_to_join = False  # a gather launched on the side stream that our stream has not waited for yet
        self.gathers_beside_push = 0  # (tests, benchmarks)
        self._gather_epoch = 0  # pipelined combines so far: the value their tile flags are raised to (the same count
        # on every rank of the group)
        self.pipelined_gathers = 0  # (tests, benchmarks)
        # docs/internode.md, "The dispatch forward's node barrier": likewise the same on every rank
        self.forward_node_barrier = bool(s.kernel.forward_node_barrier) and self.G > 1
        # docs/internode.md, "The unpack beside the forward": likewise agreed (a forwarder marks the rows its GPUs wait
        # for); each GPU's own unpack on the second stream, beside its forward
        self.unpack_beside_forward = bool(s.kernel.unpack_beside_forward) and self.G > 1 and self.gated_arrivals
        self.unpack_beside_forward_blocks = int(s.kernel.unpack_beside_forward_blocks)
        self._unpack_beside: Optional[int] = None  # the forward's epoch, while its rows are to be unpacked beside it
        self._beside_keep: Optional[torch.Tensor] = None  # the forward's output, held until that unpack's end
        self.unpacks_beside_forward = 0  # (tests, benchmarks) reads launched beside: unpacks, expert-major receives
        self.expert_major_receives_beside_forward = 0  # ... those of expert-major receives
        self._forward_epoch = 0  # dispatch forwards ended with it so far: their flags' value
        # our flag row in each local GPU's NVL region (column 0 of the forward's block)
        self._forward_flag_targets = torch.tensor(
            [self.peer_nvl[j] + self._forward_flag_base + 4 * self.local * GATHER_MAX_TILES for j in range(self.G)],
            dtype=torch.int64).to(self.device) if self.G > 1 else None
        self.expert_sums_in_packs = 0  # expert-major combines whose pack summed the rows (tests, benchmarks)
        # hops whose records were written and pushed in one launch, by phase (tests, benchmarks)
        self.packs_and_pushes = {"dispatch_network": 0, "combine_network": 0}
        self._chunk_ready: Optional[torch.Tensor] = None  # pack_and_push's per-chunk counters, zero between launches
        self.pack_during_notify = bool(s.kernel.pack_during_notify)
        self.push_during_notify = bool(s.kernel.push_during_notify)
        # docs/internode.md, "Planning ahead": with several GPUs per node the dispatch's planning sits between its
        # count read and its return, with the GPU waiting behind it; at first use it hides behind the caller's work
        self.plan_ahead = s.kernel.plan_ahead == "on" or (s.kernel.plan_ahead == "auto" and self.G == 1)
        # docs/internode.md, "Reading before the count read": the setting, where it can apply (with several GPUs per
        # node, "The forward before the count read", the forward ends with the node barrier over NVLink, which the GPU
        # raises and waits for without the host)
        self.read_before_counts = (bool(s.kernel.read_before_counts)
                                   and (self.G == 1 or bool(s.kernel.forward_node_barrier)))
        self.read_slack = float(s.kernel.read_before_counts_slack)
        # ... and every other condition of it fixed at setup (pack and push during notify: _reading_before_counts)
        self._reads_before_counts_at_all = (self.read_before_counts and self.gated_arrivals and self.pack_during_notify
                                            and self._notify_via_proxies)
        self.own_rows_from_columns = bool(s.kernel.own_rows_from_columns)  # docs/internode.md, "Own rows from ..."
        self.own_rows_read_from_columns = 0  # gated readers that did (tests, benchmarks)
        # docs/internode.md, "Expert-major rows in the reader" (where notify carries the per-expert counts): by
        # default every one, except, where ranks share a GPU (their readers are held to spin_blocks), uncached ones
        # that read after the count read
        self.expert_major_in_reader = {  # by kind of dispatch
            kind: reads_expert_major_rows(s.kernel.expert_major_in_reader, self._cx.spin_blocks, kind != "uncached")
            for kind in ("uncached", "uncached early", "cached")}  # early: launched before the count read
        self.expert_major_reads = {"uncached": 0, "cached": 0}  # receives the reader wrote (tests, benchmarks)
        self.expert_major_places_on_device = 0  # ... whose places were made from the count rows (tests, benchmarks)
        self._notify_rows_at: Optional[CountRows] = None  # where the last notify's rows are on the device (or None)
        self._recv_rows_seen: dict = {}  # tokens -> rows the last uncached dispatch of that size received
        self._expert_rows_seen: dict = {}  # ... and the expert-major rows it filled (an expert-major receive)
        # the gate table and words a reader before the counts takes from the device (gate_from_count_rows)
        self._read_gate = torch.zeros((self.N, GATE_FIXED + self.L), dtype=torch.int64, device=self.device)
        self._read_dims = torch.zeros(READ_DIMS, dtype=torch.int64, device=self.device)
        # ... and with several GPUs per node the forward's block table, final rows per local GPU and words, then the
        # unpack's words (forward_from_count_rows)
        self._fwd_blocks = torch.zeros((self.N, 1 + self.G), dtype=torch.int64, device=self.device)
        self._fwd_limits = torch.zeros(self.G, dtype=torch.int64, device=self.device)
        self._fwd_dims = torch.zeros(FORWARD_DIMS, dtype=torch.int64, device=self.device)
        self.forwards_before_counts = 0  # forwards launched before the count read that forwarded (tests, benchmarks)
        self.reads_before_counts = 0  # readers launched before the count read that read (tests, benchmarks)
        self.reads_before_counts_declined = 0  # ... that the counts sent back to the reader after notify
        # sync-free dispatches that returned before the count read (tests, benchmarks), and the last one's handle with
        # the rest of its host work, which the next call's entry does (_finish_dispatch_before_counts)
        self.dispatches_before_counts = 0
        self._deferred_dispatch: Optional[Tuple[InternodeHandle, Callable[[], DispatchResult]]] = None
        self.expert_major_reads_before_counts = 0  # ... of expert-major receives, whose reader wrote the rows
        # the outputs of the next such reader, made during a combine's hop: (spec, tensors) (_spare_read_outputs)
        self._next_read: Optional[tuple] = None
        self._spare_read_outputs: Optional[tuple] = None
        self.spare_read_outputs_taken = 0  # (tests, benchmarks)
        self._staged_plans: list = []  # plan tables staged during a reader's spin, copied at the next call's entry
        # (forward_block_bases host table, its device copy): the last one uploaded, shared by every layout of a handle
        self._forward_bases_memo: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.plans_made_ahead = 0  # hop plans made for a handle's next calls (_plan_ahead; tests, benchmarks)
        self.last_drain_ns: Optional[Tuple[int, int]] = None  # the last drain's start and end (wire timeline)
        self._em_grids: dict = {}  # expert-major kernels' grids (_expert_major_grid)
        self._expected = [0] * (2 * self.N * self.L + 2)  # running targets of the monotone signal counters
        # Entry barrier of combine (docs/internode.md, "Areas"): a combine may skip it when every rank synchronized
        # (notify or barrier) since the last combine and its rows stay clear of what the last dispatch filled, whose
        # per-rank extents are kept here. Every rank holds the same values (same calls, same counts).
        self._synced_since_combine = False
        self._last_dispatch_extents: Optional[Tuple[List[int], List[int]]] = None
        self.combine_barriers_skipped = 0  # benchmarks and tests
        # ... and a cached dispatch right after a combine may skip its own (dispatch_may_skip_entry_barrier): the
        # counts and areas of the last call when it was a combine
        self._last_combine: Optional[Tuple[Counts, CombineAreas]] = None
        # the handle of the last dispatch that completed, and -- while the last call was a combine of that handle that
        # completed -- where that combine's partial sums start in our send half: what lets the next uncached dispatch
        # pack its records while notify is still exchanging the counts (_pack_during_notify)
        self._last_dispatch_handle: Optional[InternodeHandle] = None
        self._combined_send_base: Optional[int] = None
        # send-plan tables made while the last combine's hop ran, for the next dispatch's packing during notify:
        # ((tokens, records), the tables), taken by the first send plan of that size (_send_tables)
        self._spare_send_tables: Optional[Tuple[Tuple[int, int], Tuple[torch.Tensor, ...]]] = None
        self.spare_send_tables_taken = 0  # (tests, benchmarks)
        self.packs_during_notify = 0  # uncached dispatches that did (tests, benchmarks)
        self.pushes_during_notify = 0  # ... and that pushed them during notify too
        self.packs_and_pushes_during_notify = 0  # launches that did both (_pack_and_push_during_notify)
        self.count_rows_pushed_with_records = 0  # ... and pushed our count row too (no push_chunks for it)
        self.dispatch_barriers_skipped = 0
        self.forwards_during_hop = 0  # dispatches whose forwarders read their arrivals as they landed (G > 1)
        self.forward_node_barriers = 0  # dispatch forwards that ended with the node barrier over NVLink (G > 1)
        self._phases = dict(self._k.PHASES)
        self._codes = dict(self._k.ERROR_CODES)

    def _first_launches(self) -> None:
        """Setup, step 4: each kernel a call launches behind a spinning wait, launched once now with nothing spinning
        (a lazy module load at its first real launch could wait for that wait: docs/internode.md, "Drains")."""
        if self.read_before_counts and self.G == 1:
            # its kernel's first launch now, with nothing spinning: the first real one queues behind notify's spinning
            # wait, where a lazy module load might wait for that wait ("Drains"); the zero rows make words only
            zeros = torch.zeros((self.R, 2 * self.R), dtype=torch.int64, device=self.device)
            bases, table = self._counter_bases([0] * (self.N * self.L))
            self._k.gate_from_count_rows(zeros.data_ptr(), 2 * self.R, self.R, self.rank, self.L, bases, 16, 0, 0, 0,
                                         self._read_gate.data_ptr(), self._read_dims.data_ptr(), self._stream(),
                                         counter_bases_table=_address(table))
            self._drain("setup: the reader-before-counts kernel's first launch")
        elif self.read_before_counts:
            self._first_launches_before_counts()
        if self.G > 1:
            self._first_forward_launches()
        if self.pipelined_gather:
            self._first_gather_launches()

    def _first_forward_launches(self) -> None:
        """The forwarder's reader's first launches (gated and not), with nothing spinning: the first real one queues
        behind the push, whose kernel may spin for FIFO room that the proxies make ("Drains": a lazy module load then
        waits for it). One record whose dest rows are all -1: nothing leaves it."""
        layout = _record_layout((16,), self.G)
        record = torch.full((1, layout.stride), 255, dtype=torch.uint8, device=self.device)
        zeros = torch.zeros((1, 1 + self.G), dtype=torch.int64, device=self.device)  # (limits; one block, bases 0)
        out = torch.empty((1, self.G), dtype=torch.int64, device=self.device)
        for gate in (None, self._cx.arrival_gate(0, 0, 1, self._phases["dispatch_network"])):
            self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes,
                                     self.G, record.data_ptr(), layout.stride, 1, layout.final_bytes,
                                     zeros.data_ptr(), zeros.data_ptr(), 1, layout.dest_rows_offset,
                                     layout.arrival_offset, out.data_ptr(), self._stream(), gate=gate)
        flags = torch.zeros(self.G, dtype=torch.int32, device=self.device)  # the node barrier's kernels too
        at = (flags.data_ptr() + 4 * torch.arange(self.G, dtype=torch.int64)).to(self.device)
        self._k.raise_flags(at.data_ptr(), self.G, 1, self._stream())
        raised = torch.ones((self.G, GATHER_MAX_TILES), dtype=torch.int32, device=self.device)
        self._cx.wait_node_flags(raised.data_ptr(), self.G, 1, 1, self._phases["dispatch_forward"], self._stream())
        self._drain("setup: the dispatch forward's first launches")
        if bool((out != -1).any()) or bool((flags != 1).any()):
            raise InternodeError(f"rank {self.rank}: the dispatch forward kernel misread a record whose dest rows are "
                                 f"all -1 (got {out.tolist()}), or raise_flags missed a flag ({flags.tolist()}); "
                                 "rebuild _C")

    def _first_launches_before_counts(self) -> None:
        """The first launches of the kernels a forward before the count read queues behind notify's spinning wait, as
        _first_forward_launches does for the forward's: forward_from_count_rows on zero rows with a send limit that
        refuses (the words say no), then the pack of our own records and the unpack taking those words (nothing
        written)."""
        dev, G = self.device, self.G
        zeros = torch.zeros((self.R, 2 * self.R), dtype=torch.int64, device=dev)
        dims = self._fwd_dims.data_ptr()
        bases, table = self._counter_bases([0] * (self.N * self.L))
        self._k.forward_from_count_rows(zeros.data_ptr(), 2 * self.R, self.R, G, self.rank, self.L, bases, 16, 16, -1,
                                        0, 0, 0, 0, self._read_gate.data_ptr(), self._fwd_blocks.data_ptr(),
                                        self._fwd_limits.data_ptr(), dims, self._stream(),
                                        counter_bases_table=_address(table))
        layout = _record_layout((16,), G)
        column = torch.zeros((1, 16), dtype=torch.uint8, device=dev)
        plan = torch.zeros(1 + G, dtype=torch.int64, device=dev)  # token 0, its dest rows
        self._k.pack_records(0, self._cx.rdma_ptr + self.half_rdma, 0, 0, layout.stride, plan.data_ptr(),
                             plan.data_ptr() + 8, G, 1, _column_args([column], layout), layout.src_idx_offset,
                             layout.dest_rows_offset, self._stream(), own_dims=dims)
        out = torch.empty((1, 16), dtype=torch.uint8, device=dev)
        self._unpack_launch(self._cx.nvl_ptr, layout.final_bytes, 1, 1, layout, [out], None, None, 1, 0, 0, None,
                            None, dims=dims + 8 * READ_DIMS, pad=False)
        self._drain("setup: the forward-before-counts kernels' first launches")
        if int(self._fwd_dims[READ_GO]) or int(self._fwd_dims[READ_DIMS + READ_GO]):
            raise InternodeError(f"rank {self.rank}: forward_from_count_rows let a refused forward go "
                                 f"({self._fwd_dims.tolist()}); rebuild _C")

    def _first_gather_launches(self) -> None:
        """The pipelined combine gather's kernels' first launches, with nothing spinning, as _first_forward_launches
        does for the forward (which also launches wait_node_flags first): gather_tiles with no arrivals (nothing
        copied or flagged), and pack_and_push with node sums over one record of our own node whose copies nobody
        holds (written as zeros to a scratch row, nothing pushed)."""
        dev, G, k = self.device, self.G, self._k
        targets = torch.zeros((3, G), dtype=torch.int64, device=dev)  # no gather block, no flag row, no arrivals
        by_arrival = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.gather_rows_by_arrival(by_arrival.data_ptr(), G, 1, 0, 0, 0, 0, self._stream())  # (memset only: -1)
        k.gather_tiles(targets[0].data_ptr(), targets[1].data_ptr(), G, by_arrival.data_ptr(), 1,
                       targets[2].data_ptr(), GATHER_MIN_TILE_ROWS, 0, 16, 0, 0, 0, 16, 1, self._stream(),
                       blocks=self.gather_blocks)
        # the per-handle tables' kernels with one row each: a row of source 0 at arrival 0, an arrival with no copy
        ends, arrival = torch.ones(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
        row_table = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.gather_rows_by_arrival(row_table.data_ptr(), G, 1, ends.data_ptr(), 1, arrival.data_ptr(), 1,
                                 self._stream())
        no_copy = torch.full((1, G), -1, dtype=torch.int64, device=dev)
        sum_rows = torch.empty((G, 1), dtype=torch.int32, device=dev)
        k.forward_sum_rows(sum_rows.data_ptr(), G, 1, 1, no_copy.data_ptr(), self._stream())
        flags = torch.ones((G, GATHER_MAX_TILES), dtype=torch.int32, device=dev)  # (already at the epoch)
        scratch = torch.full((2, 16), 255, dtype=torch.uint8, device=dev)
        table = torch.tensor([[self.rank, 0, 0, 16, 0, self._barrier_slot, 0]], dtype=torch.int64, device=dev)
        ready = torch.zeros(1, dtype=torch.int32, device=dev)
        rows_of = torch.full((G, 1), -1, dtype=torch.int32, device=dev)
        node_sums = (scratch[1].data_ptr(), rows_of.data_ptr(), G, 16, 0, False, flags.data_ptr(),
                     GATHER_MIN_TILE_ROWS, 1)
        self._cx.pack_and_push(table.data_ptr(), 1, 1, self._cx.rdma_ptr, scratch[0].data_ptr(), 0, 1, 16, 0, 0, 0, 1,
                               [], -1, 0, ready.data_ptr(), self._phases["combine_network"], self._stream(),
                               node_sums=node_sums)
        self._drain("setup: the pipelined combine gather's first launches")
        if bool((scratch[0] != 0).any()):
            raise InternodeError(f"rank {self.rank}: the node sum of a record nobody holds a copy of is not zero (got "
                                 f"{scratch[0].tolist()}); rebuild _C")
        if row_table.view(-1).tolist() != [0] + [-1] * (G - 1) or bool((sum_rows != -1).any()):
            raise InternodeError(f"rank {self.rank}: the combine's table kernels misread one row (by arrival "
                                 f"{row_table.view(-1).tolist()}, node-sum rows {sum_rows.view(-1).tolist()}); "
                                 "rebuild _C")

    def _lap(self, step: Optional[str]) -> None:
        """Benchmarks: add the host wall time since the previous lap to ``step`` (None: start a call)."""
        if self.host_timing is None:
            return
        now = time.perf_counter()
        if step is not None:
            acc = self.host_timing.setdefault(step, [0.0, 0])
            acc[0] += now - self._lap_t
            acc[1] += 1
        self._lap_t = now

    def start_kernel_timeline(self, launches: int) -> None:
        """Stamp the next ``launches`` pack_and_push launches on the GPU (docs/internode.md, "Kernel timeline")."""
        self.kernel_timeline = KernelTimeline(self._cx, self._k, self.device, launches)

    def stop_kernel_timeline(self) -> List[dict]:
        """Every launch stamped since start_kernel_timeline (kernel_timeline.launch_record), once the stream that ran
        them drained (with the backend's deadline, not a bare synchronize)."""
        timeline, self.kernel_timeline = self.kernel_timeline, None
        if timeline is None:
            return []
        self._drain("the kernel timeline's launches")
        return timeline.stop()

    def start_wire_log(self, capacity: int) -> None:
        """Record the emulated wire's busy runs (docs/internode.md, "Wire timeline"): the loopback with a bandwidth
        cap only (ValueError otherwise)."""
        if not hasattr(self._cx, "start_wire_log"):
            raise ValueError("the wire log needs the native module (the CPU stand-in has no emulated wire)")
        try:
            self._cx.start_wire_log(int(capacity))
        except (RuntimeError, ValueError) as e:  # the binding's std::invalid_argument
            raise ValueError(f"rank {self.rank}: {e}") from None

    def stop_wire_log(self) -> dict:
        """The runs recorded since start_wire_log: {'runs': [(start_ns, end_ns, bytes, writes)], 'dropped': n}."""
        return self._cx.stop_wire_log()

    def raw_dispatch_hop(self, handle: InternodeHandle, columns: List[torch.Tensor]) -> None:
        """Benchmarks: the transport alone on a cached dispatch's bytes. The handle's dispatch hop for these columns
        is pushed as it is -- the same chunks, lanes, commands and waits, of whatever the send area holds -- and
        awaited, with no packing, no reading of the arrivals and no host planning: what the transport takes to move
        this call's network bytes, for the benchmark's ratio of each call to it. Every rank calls it together; an
        entry barrier first (the receive areas get stale bytes, which the next dispatch overwrites). Timed like
        the calls' hops when ``network_timing`` is set (phase dispatch_network)."""
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        rows = [_dense(c, c.dtype) for c in columns]
        layout = _record_layout(tuple(_row_bytes(r) for r in rows), self.G)
        h: InternodeHandle = handle
        shape = h.dispatch_shapes.get(layout)
        if shape is None:  # made and checked once per handle and layout, as a cached dispatch keeps it (_move)
            shape = h.dispatch_shapes[layout] = self._dispatch_shape(h.counts, h.plan, layout)
        hop = self._hop_plan(h, ("dispatch", layout.stride),
                             lambda: self._dispatch_hop(h.counts, h.plan, layout.stride))
        self._barrier("entry of the raw dispatch hop")
        # the areas it used are a cached dispatch's: the next calls' barrier rules take it for one
        self._combined_send_base, self._last_combine, self._synced_since_combine = None, None, True
        self._last_dispatch_extents = shape.extents
        self._push_and_wait(hop.rows, hop.waits, "dispatch_network", hop.per_chunk, "raw dispatch hop", hop=hop)

    def proxy_stats(self) -> dict:
        return dict(self._cx.proxy_totals())

    def upload_counts(self) -> Optional[dict]:
        """Benchmarks: the small tables uploaded through the pinned staging area since setup, and those that fell back
        to a pageable copy (upload_staging.py); None without the area (the CPU stand-in, UCCL_EP_PINNED_UPLOADS=0)."""
        if self._staging is None:
            return None
        return {"staged": self._staging.staged, "fallbacks": self._staging.fallbacks}

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._deferred_dispatch = None  # (its reader ends with its arrivals: the drain below waits for it)
        try:
            self._drain("destroy")  # bounded: no kernel may still use the regions when they are freed
            # A call returns once *its incoming* data arrived; its own outgoing writes (e.g. the last combine chunks
            # to a slower peer) may still be queued or in flight in our proxy. Stopping the proxy now would drop
            # them, and the peer -- which sees a clean close, not an error -- would wait until its GPU deadline with
            # all but the last chunk(s) of a lane (the intermittent 2 x 2 reorder + cap-1 failure). Deliver first.
            if not self._cx.proxy_error():
                try:
                    self._cx.proxy_wait_idle(self.cpu_timeout)
                except Exception as exc:  # noqa: BLE001 - teardown: report, then free anyway
                    print(f"uccl-ep: rank {self.rank}: destroy: the proxy did not deliver every write within "
                          f"{self.cpu_timeout:.0f} s (peers waiting for them will time out): {exc}", file=sys.stderr)
        except InternodeError as exc:
            # _check clears the error word when it raises, so what is found here no call has reported (e.g. a wait
            # of the last call that failed after the call returned), or it is the proxy's standing error. Say it.
            print(f"uccl-ep: rank {self.rank}: destroy found an error: {exc}", file=sys.stderr)
        finally:
            self._cx.destroy()
            if self._copy_agent is not None:  # (after the endpoints, which wait for their copies)
                self._copy_agent.close()
