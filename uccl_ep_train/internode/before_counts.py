"""Reading before the count read: a dispatch's reader (and with several GPUs per node its forward) launched before the
host reads the count matrix, and the sync-free dispatch that returns before it (docs/internode.md, "Reading
before the count read", "The forward before the count read", "Sync-free dispatch: returning before the
count read")."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from uccl_ep_train.backends import DispatchArgs, DispatchResult
from uccl_ep_train.internode.plan import (InternodeError, RecordLayout, Counts, SendPlan, recv_counts, num_recv_rows,
                                          dispatch_waits, READ_DIMS, READ_GO, read_before_counts, forward_before_counts)
from uccl_ep_train.internode.columns import _raw_bytes, _address, _column_args, _aligned_counts
from uccl_ep_train.internode.handle import InternodeHandle
from uccl_ep_train.internode.call_state import CountRows, ReadingBeforeCounts, UncachedDispatch


class BeforeCounts:
    """Launches the readers that go before the count read, and returns before it. A part of NativeInternodeBackend
    (backend.py), which composes these parts; the state they share is set up there (its __init__ and the setup steps it
    calls)."""

    def _reading_before_counts(self, args: DispatchArgs, T: int, layout: RecordLayout, pushed_in_one_launch: bool,
                               dense: List[torch.Tensor], tables: SendPlan, em_in_reader: bool = False
                               ) -> Optional[ReadingBeforeCounts]:
        """Whether this uncached dispatch launches its reader before the host reads the count matrix (docs/internode.md,
        "Reading before the count read"; with several GPUs per node the forwarder's receive, "The forward before the
        count read"), and for how many rows: a gated reader, the records packed and pushed during notify by one
        launch (``pushed_in_one_launch``), and a row count known
        before the counts -- num_worst_tokens, or the rows the last dispatch of T tokens received plus
        UCCL_EP_READ_BEFORE_COUNTS_SLACK (capped by the receive area). None: the reader follows the host's plan.
        An expert-major receive only where its reader writes the expert-major rows (``em_in_reader``): the copy after
        the hop reads the final rows, where our own rows are not (docs/internode.md, "Reading before the count
        read"); its expert-major rows are guessed as the received rows are.
        ``dense``: the columns, contiguous, from which our own node's rows are read (never packed); ``tables``: the
        send plan the count row's launch writes."""
        spare, self._spare_read_outputs = self._spare_read_outputs, None  # taken here or dropped
        if not (self.read_before_counts and pushed_in_one_launch and self.gated_arrivals
                and (em_in_reader or not args.expert_major)):
            return None
        payload = [args.x] + ([args.x_scales] if args.x_scales is not None else [])
        K = args.topk_idx.size(1) if args.topk_idx is not None else 0
        # the rows the area the outputs are read from holds: the arrivals (one GPU per node), else the final rows
        area_rows = self.half_rdma // layout.stride if self.G == 1 else self.half_nvl // layout.final_bytes
        if args.expert_major:  # (no spare outputs: an expert-major receive's are its expert-major rows)
            self._next_read = None
            spec = self._read_spec(T, args.num_worst_tokens, area_rows,
                                   tuple((c.dtype, tuple(c.shape[1:])) for c in payload), K)
            seen = self._expert_rows_seen.get(T)
            expert_rows = args.num_worst_tokens or (math.ceil(seen * (1 + self.read_slack)) if seen else 0)
            if spec is None or not spec[0] or not expert_rows:  # (nothing received last time: no guess)
                return None
            return self._before_notify(ReadingBeforeCounts(
                spec, bool(args.num_worst_tokens), layout, args.num_tokens_per_expert.numel() // self.R,
                _column_args(dense, layout), tables.hop1_token.data_ptr(), expert_rows=expert_rows,
                alignment=args.expert_alignment, own_dest_rows=tables.dest_rows.data_ptr(), tokens=T))
        # what the combine of this dispatch's handle makes the next dispatch's outputs for (_spare_read_outputs)
        self._next_read = (T, args.num_worst_tokens, area_rows,
                           tuple((c.dtype, tuple(c.shape[1:])) for c in payload), K)
        spec = self._read_spec(*self._next_read)
        if spec is None:
            return None
        reading = self._before_notify(ReadingBeforeCounts(
            spec, bool(args.num_worst_tokens), layout, args.num_tokens_per_expert.numel() // self.R,
            _column_args(dense, layout), tables.hop1_token.data_ptr(), own_dest_rows=tables.dest_rows.data_ptr(),
            tokens=T))
        if spare is not None and spare[0] == spec:  # made during the last combine's hop
            self.spare_read_outputs_taken += 1
            reading.outs, reading.topk_idx, reading.weights, reading.src_idx, reading.arrival = spare[1]
        return reading

    def _before_notify(self, reading: ReadingBeforeCounts) -> ReadingBeforeCounts:
        """What the kernels launched behind notify's wait take that must exist before it is queued: the counters'
        bases (this call's: the counters move only after the count read), and with several GPUs per node the
        forward's output for as many arrivals as the receive half holds (once notify's wait is queued, an allocation
        that reaches cudaMalloc may wait on it)."""
        reading.bases, reading.bases_table = self._counter_bases(self._expected[:self.N * self.L])
        if self.G > 1:
            reading.fwd_dest = torch.empty((self.half_rdma // reading.layout.stride, self.G), dtype=torch.int64,
                                           device=self.device)
        return reading

    def _counter_bases(self, values: List[int]) -> Tuple[List[int], Optional[torch.Tensor]]:
        """Counter bases for gate_from_count_rows / forward_from_count_rows: as kernel arguments while they fit
        (READ_MAX_COUNTERS, nodes x lanes: 4 nodes at the default 32 lanes), else in a device table uploaded now.
        Called before notify's wait is queued, so the drain after the matrix's copy covers the upload (staged uploads
        may be reused only after a drain that follows them: upload_staging.py)."""
        if len(values) <= self._k.READ_MAX_COUNTERS:
            return list(values), None
        return [], self._upload(np.asarray(values, dtype=np.int64))

    def _read_spec(self, T: int, worst: int, area_rows: int, payload: tuple, K: int) -> Optional[tuple]:
        """(rows, payload dtypes and row shapes, top-k) of the outputs of a read before the counts: num_worst_tokens
        rows, else the rows the last dispatch of T tokens received plus the slack, capped by the ``area_rows`` the
        area they are read from holds; None before any dispatch of T tokens."""
        if worst:
            return worst, payload, K
        seen = self._recv_rows_seen.get(T)
        if seen is None:
            return None
        return min(math.ceil(seen * (1 + self.read_slack)), area_rows), payload, K

    def _new_read_outputs(self, spec: tuple) -> tuple:
        """(payload outputs, top-k ids, weights, src_idx, arrival) of ``spec`` (_read_spec), uninitialised."""
        rows, payload, K = spec
        dev = self.device
        outs = [torch.empty((rows,) + shape, dtype=dtype, device=dev) for dtype, shape in payload]
        ids = torch.empty((rows, K), dtype=torch.int64, device=dev) if K else None
        w = torch.empty((rows, K), dtype=torch.float32, device=dev) if K else None
        return (outs, ids, w, torch.empty(rows, dtype=torch.int64, device=dev),
                torch.empty(rows, dtype=torch.int64, device=dev))

    def _spare_for_reading_before_counts(self) -> None:
        """Make the outputs of the next dispatch read before the counts now, while the host waits for a combine's
        hop, shaped as the last such dispatch's (_next_read): the call's largest allocations, which may reach
        cudaMalloc, kept out of the steps between notify's wait and that reader's launch. Taken by the next uncached
        dispatch if it matches, dropped by it otherwise (and by a cached dispatch)."""
        spec = self._read_spec(*self._next_read) if self._next_read is not None else None
        if spec is not None and (self._spare_read_outputs is None or self._spare_read_outputs[0] != spec):
            self._spare_read_outputs = (spec, self._new_read_outputs(spec))

    def _launch_reader_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, send_top: int) -> None:
        """Behind notify's wait (every count row is in) and the matrix's copy: the outputs, then the gate table and
        the words from the count rows on the device (gate_from_count_rows), then the gated reader taking them
        (unpack_records with dims), which reads our own node's rows straight from our columns at their tokens (the
        send plan's, written with the count row): they are never packed. Queues no upload (the drain before the count
        read does not wait for these launches)."""
        rows = reading.rows
        self._lap("dispatch.notify_wait_before_counts")
        if reading.expert_rows:
            self._launch_expert_major_reader_before_counts(reading, rows_at, send_top)
            return
        if reading.src_idx is None:  # no spare made during the last combine's hop
            reading.outs, reading.topk_idx, reading.weights, reading.src_idx, reading.arrival = \
                self._new_read_outputs(reading.spec)
        self._lap("dispatch.outputs_before_counts")
        reading.t0 = self._hop_started()
        if self.G > 1:
            self._launch_forward_before_counts(reading, rows_at, send_top)
            return
        stride = reading.layout.stride
        self._k.gate_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, self.rank, self.L, reading.bases, stride,
                                     send_top, self.half_rdma, rows, self._read_gate.data_ptr(),
                                     self._read_dims.data_ptr(), self._stream(),
                                     counter_bases_table=_address(reading.bases_table))
        gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                     self._phases["dispatch_network"])
        experts = reading.experts_per_rank
        self._unpack_launch(self._cx.rdma_ptr + self.half_rdma, stride, rows, rows, reading.layout, reading.outs,
                            reading.topk_idx, reading.weights, len(reading.outs), self.rank * experts, experts,
                            reading.src_idx, reading.arrival, gate, dims=self._read_dims.data_ptr(), pad=reading.pad,
                            own=(0, 0, 0, reading.own_tokens, reading.own_columns))
        self._lap("dispatch.reader_before_counts")

    def _launch_forward_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, send_top: int) -> None:
        """_launch_reader_before_counts with several GPUs per node (docs/internode.md, "The forward before the count
        read"), behind notify's wait and the matrix's copy: from the count rows on the device (forward_from_count_rows)
        the gate, the forward's tables and the words; our own node's records packed into their block among our
        arrivals (pack_records from the words); the gated forward (forward_arrivals from the words) and the node
        barrier, its flag raised and its wait made only when the forward went (else the host's forward after the
        count read raises it); then the read of our final rows from the unpack's words (unpack_records, or for an
        expert-major receive expert_major_places, the padding and expert_major_receive). With
        UCCL_EP_UNPACK_BESIDE_FORWARD that read runs on the second stream beside the forward, each row read once its
        ready word is released ("The unpack beside the forward"), and the barrier follows it. Queues no upload."""
        layout, G = reading.layout, self.G
        stride, dims = layout.stride, self._fwd_dims.data_ptr()
        recv = self._cx.rdma_ptr + self.half_rdma
        beside = self.unpack_beside_forward and self._ready_rows > 0
        self._k.forward_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, G, self.rank, self.L, reading.bases,
                                        stride, layout.final_bytes, send_top, self.half_rdma, self.half_nvl,
                                        reading.rows, self._ready_rows if beside else 0, self._read_gate.data_ptr(),
                                        self._fwd_blocks.data_ptr(), self._fwd_limits.data_ptr(), dims,
                                        self._stream(), counter_bases_table=_address(reading.bases_table))
        self._k.pack_records(0, recv, 0, 0, stride, reading.own_tokens, reading.own_dest_rows, G, reading.tokens,
                             reading.own_columns, layout.src_idx_offset, layout.dest_rows_offset, self._stream(),
                             own_dims=dims)
        # the epoch the host's forward would take (the ready words and the barrier carry it); kept only when the
        # forward went (_adopt_before_counts)
        reading.epoch = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
        if beside:  # the read goes on the second stream, after the words and everything else before the forward
            self._cx.stream_wait(self._cx.side_stream, self._stream())
        with self._spin_blocks_held(self.unpack_beside_forward_blocks if beside else 0):
            gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                         self._phases["dispatch_network"])
        self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes, G,
                                 recv, stride, reading.fwd_dest.size(0), layout.final_bytes,
                                 self._fwd_limits.data_ptr(), self._fwd_blocks.data_ptr(), self.N,
                                 layout.dest_rows_offset, layout.arrival_offset, reading.fwd_dest.data_ptr(),
                                 self._stream(), gate=gate, err=self._cx.error_word_ptr,
                                 stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation,
                                 rank=self.rank, phase=self._phases["dispatch_forward"], dims=dims,
                                 ready_words=self._ready_targets.data_ptr() if beside else 0,
                                 ready_rows=self._ready_rows, ready_epoch=reading.epoch if beside else 0)
        experts = reading.experts_per_rank
        unpack = lambda **where: self._unpack_launch(  # noqa: E731
            self._cx.nvl_ptr, layout.final_bytes, reading.rows, reading.rows, layout, reading.outs, reading.topk_idx,
            reading.weights, len(reading.outs), self.rank * experts, experts, reading.src_idx, reading.arrival,
            dims=dims + 8 * READ_DIMS, pad=reading.pad, **where)
        # an expert-major receive of our final rows, from the unpack's words
        final = lambda: _raw_bytes(  # noqa: E731
            self._cx.nvl_ptr, reading.rows * layout.final_bytes, self.device).view(reading.rows, layout.final_bytes)
        receive = lambda **where: self._expert_major_receive_before_counts(  # noqa: E731
            reading, rows_at, dims + 8 * READ_DIMS, final(), None, None, **where)
        read = receive if reading.expert_rows else unpack
        if beside:
            read(stream=self._cx.side_stream, ready=(self._cx.nvl_ptr + self._ready_base, reading.epoch))
            self._cx.stream_wait(self._stream(), self._cx.side_stream)
            self.unpacks_beside_forward += 1
            self.expert_major_receives_beside_forward += bool(reading.expert_rows)
        self._k.raise_flags(self._forward_flag_targets.data_ptr(), G, reading.epoch, self._stream(),
                            stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, go=dims)
        self._cx.wait_node_flags(self._cx.nvl_ptr + self._forward_flag_base, G, 1, reading.epoch,
                                 self._phases["dispatch_forward"], self._stream(), go=dims)
        if not beside:
            read()
        self._lap("dispatch.reader_before_counts")

    def _before_counts_words(self, reading: ReadingBeforeCounts, counts: Counts, send_top: int) -> List[int]:
        """After notify: the words the kernels launched before the count read took from the count rows, by their own
        rule on the same counts (read_before_counts, or forward_before_counts with several GPUs per node)."""
        layout = reading.layout
        if self.G == 1:
            return read_before_counts(counts.rank_counts, counts.node_counts, self.rank, self.L, self._expected,
                                      layout.stride, send_top, self.half_rdma, reading.rows)[1]
        ready_rows = self._ready_rows if self.unpack_beside_forward else 0
        return forward_before_counts(counts.rank_counts, counts.node_counts, self.rank, self.G, self.L,
                                     self._expected, layout.stride, layout.final_bytes, send_top, self.half_rdma,
                                     self.half_nvl, reading.rows, ready_rows)[3]

    def _adopt_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan) -> None:
        """After notify, kernels launched before the count read whose hop went: what the host's path would have left
        -- the counters' targets (first: they move whatever follows), with several GPUs per node the forward's node
        barrier epoch, and the extents (their check may raise: the caller ends the hop whatever happens)."""
        for slot, count in dispatch_waits(counts, self.rank, self.G, self._per_chunk(reading.layout.stride), self.L):
            self._expected[slot] += count
        if self.G > 1:
            self._forward_epoch = reading.epoch
            self.forwards_before_counts += 1
            self.forwards_during_hop += 1
            self.forward_node_barriers += 1
        self._last_dispatch_extents = self._dispatch_shape(counts, plan, reading.layout, upload=False).extents

    def _forward_dest_before_counts(self, reading: ReadingBeforeCounts, counts: Counts) -> Optional[torch.Tensor]:
        """The forward's final rows of our arrivals at each local GPU [A, G], which a forward before the count read
        wrote (None with one GPU per node: nothing is forwarded)."""
        if self.G == 1:
            return None
        return reading.fwd_dest[:sum(recv_counts(counts, self.rank, self.G))]

    def _forwarded_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan
                                 ) -> Tuple[torch.Tensor, RecordLayout, torch.Tensor, None]:
        """After notify, a forward before the count read that went while its unpack did not (our final rows passed
        the outputs allocated before the counts): _move's results without moving anything -- (our final rows, the
        layout, the forward's dest rows, no pending hop) -- for the unpack after the count read."""
        try:
            self._adopt_before_counts(reading, counts, plan)
        finally:
            self._gated_done("dispatch_network", reading.t0, "dispatch_network wait")
            self._lap("dispatch.network")
        layout, nrecv = reading.layout, num_recv_rows(counts, self.rank)
        final = self._nvl[:nrecv * layout.final_bytes].view(nrecv, layout.final_bytes)
        return final, layout, self._forward_dest_before_counts(reading, counts), None

    def _launch_expert_major_reader_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows,
                                                  send_top: int) -> None:
        """_launch_reader_before_counts for an expert-major receive written by its reader: the outputs (expert-major
        rows for ``reading.expert_rows``), the gate and words from the count rows (gate_from_count_rows), then from
        the same rows the reader's places and the plan's sizes (expert_major_places, which says no when the
        expert-major rows pass the outputs), the padding, and the gated reader taking its rows, first row and our
        own rows' place from the words (expert_major_receive with dims). With several GPUs per node the forward
        before the count read goes first, and the receive reads the final rows after its barrier. Queues no upload."""
        rows, stride, L = reading.rows, reading.layout.stride, reading.experts_per_rank
        (_, payload, K) = reading.spec
        like = [torch.empty((0,) + shape, dtype=dtype, device=self.device) for dtype, shape in payload]
        reading.em = self._expert_major_outputs(rows, K, L, reading.expert_rows, like, on_device=True)
        reading.src_idx = torch.empty(rows, dtype=torch.int64, device=self.device)
        reading.arrival = torch.empty(rows, dtype=torch.int64, device=self.device)
        self._lap("dispatch.outputs_before_counts")
        reading.t0 = self._hop_started()
        if self.G > 1:
            self._launch_forward_before_counts(reading, rows_at, send_top)
            return
        dims = self._read_dims.data_ptr()
        self._k.gate_from_count_rows(rows_at.ptr, rows_at.row_words, self.R, self.rank, self.L, reading.bases, stride,
                                     send_top, self.half_rdma, rows, self._read_gate.data_ptr(), dims, self._stream(),
                                     counter_bases_table=_address(reading.bases_table))
        gate = self._cx.arrival_gate(self._read_gate.data_ptr(), self.N - 1, self._per_chunk(stride),
                                     self._phases["dispatch_network"])
        final = _raw_bytes(self._cx.rdma_ptr + self.half_rdma, rows * stride, self.device).view(rows, stride)
        self._expert_major_receive_before_counts(reading, rows_at, dims, final, gate,
                                                 own=(0, 0, 0, reading.own_tokens, reading.own_columns))
        self._lap("dispatch.reader_before_counts")

    def _expert_major_receive_before_counts(self, reading: ReadingBeforeCounts, rows_at: CountRows, dims: int,
                                            final: torch.Tensor, gate: Any, own: Optional[tuple],
                                            stream: Optional[int] = None,
                                            ready: Optional[Tuple[int, int]] = None) -> None:
        """From the count rows the reader's places and the plan's sizes (expert_major_places, which clears the go word
        at ``dims`` when the expert-major rows pass the outputs), the padding, then the receive of ``final`` taking
        its rows from the words (expert_major_receive with dims); ``stream`` and ``ready`` as _unpack_launch's."""
        em, L, K = reading.em, reading.experts_per_rank, reading.spec[2]
        on = self._stream() if stream is None else stream
        self._k.expert_major_places(rows_at.ptr, rows_at.row_words, self.R, self.N, self.rank, L, reading.alignment,
                                    em.places.data_ptr(), em.info.data_ptr(), on, dims=dims, capacity_rows=em.rows)
        self._expert_major_pad(em.info, reading.alignment, em.rows, em.out, em, go=dims, stream=on)
        self._expert_major_receive(final, reading.layout, em.out, em.rows, K, em.slot_of, em, L, reading.src_idx,
                                   reading.arrival, gate=gate, dims=dims, own=own, counted=False, stream=on,
                                   ready=ready)

    def _reader_read(self, reading: ReadingBeforeCounts, words: List[int], expert_rows: Optional[int] = None) -> bool:
        """After notify: whether the reader launched before the count read reads, by its own rule on the same counts
        (``words``: _before_counts_words; for an expert-major receive its rows, ``expert_rows``, within the
        outputs'); else it did nothing."""
        read = words[READ_GO] if self.G == 1 else words[READ_DIMS + READ_GO]  # (several GPUs per node: the unpack's)
        return bool(read) and (not reading.expert_rows or expert_rows <= reading.expert_rows)

    def _while_reader_before_counts(self, reading: ReadingBeforeCounts, counts: Counts, plan: SendPlan,
                                    host_work: Callable[[], None]) -> None:
        """The host's part of a dispatch read before the count read, while its reader spins: the counters' targets
        (first: they move whatever follows), the area checks, ``host_work``; then the drain, also when those raise.
        With several GPUs per node, what the forward before it leaves too (_adopt_before_counts)."""
        try:
            self._adopt_before_counts(reading, counts, plan)
            self.reads_before_counts += 1
            self._lap("dispatch.unpack")
            host_work()
        finally:
            self._gated_done("dispatch_network", reading.t0, "dispatch_network wait")
            self._lap("dispatch.network")

    # ------------------------------------------------------- sync-free dispatch: returning before the count read
    def _returns_before_counts(self, args: DispatchArgs, reading: Optional[ReadingBeforeCounts]) -> bool:
        """Whether this uncached dispatch returns before the host reads the counts (docs/internode.md, "Sync-free
        dispatch: returning before the count read"): sync-free (num_worst_tokens: the outputs' rows are known), no
        drains (the host would wait for the reader anyway), its reader launched before the count read (so nothing
        on the GPU waits for the host's plan), and the tokens per expert in the count rows (the handle's device
        counts come from them, or from the reader's expert-major plan)."""
        return (reading is not None and args.num_worst_tokens > 0 and self._sync_free_returns_early
                and args.num_tokens_per_expert.numel() <= self.notify_max_experts)

    def _return_before_counts(self, call: "UncachedDispatch", read_counts: Callable[[], Counts]) -> DispatchResult:
        """The outputs of a dispatch whose reader was launched before the count read, returned without reading the
        counts: num_worst_tokens rows each, written by that reader; a handle whose count-derived fields the next
        call's entry fills in (_finish_dispatch_before_counts, which runs _after_counts), and whose tokens per
        expert meanwhile come from the device."""
        args, reading = call.args, call.reading
        worst, align, L = args.num_worst_tokens, args.expert_alignment, reading.experts_per_rank
        h = InternodeHandle(num_tokens=args.x.size(0), num_recv_rows=worst,
                            num_topk=args.topk_idx.size(1) if args.topk_idx is not None else 0, num_ranks=self.R,
                            expert_major=args.expert_major, is_token_in_rank=call.itr, recv_tokens_per_expert=None,
                            device=self.device, counts=None, plan=None, expert_alignment=align,
                            num_worst_tokens=worst)
        if reading.expert_rows:
            em = reading.em
            recv_topk_idx, recv_w = self._adopt_expert_major(h, em)
            outs = em.out
            info = em.info
            raw = lambda: info[2:2 + L]  # noqa: E731  (the plan's raw counts per local expert, from the count rows)
        else:
            outs, recv_topk_idx, recv_w = reading.outs, reading.topk_idx, reading.weights
            rows_at = self._notify_rows_at  # every source's tokens per expert, until the next notify
            rows = _raw_bytes(rows_at.ptr, 8 * self.R * rows_at.row_words, self.device).view(torch.int64)
            first = self.R + self.N + self.rank * L
            per_source = rows.view(self.R, rows_at.row_words)[:, first:first + L]
            raw = lambda: per_source.sum(0)  # noqa: E731
        # made when first asked for, on the caller's stream (behind this call's launches): before the next call,
        # which fills in the host list (the next notify may overwrite the rows only after that)
        h.device_counts = lambda: _aligned_counts(raw(), align)
        self._deferred_dispatch = (h, lambda: self._after_counts(call, read_counts()))
        self.dispatches_before_counts += 1
        self._last_dispatch_handle = h
        self._lap("dispatch.returned_before_counts")
        return DispatchResult(outs[0], outs[1] if args.x_scales is not None else None, recv_topk_idx,
                              recv_w if args.topk_weights is not None else None, [], h, None)

    def _finish_dispatch_before_counts(self) -> None:
        """At a call's entry, before anything else: the host half of the sync-free dispatch before it, if that
        returned before the count read -- the counts read (draining to the mark behind their copy, so the host waits
        only for the GPU to pass that dispatch's notify), then everything _after_counts does with them: the counters'
        targets, the checks, the handle's fields, the plans made ahead. An error it finds (too few num_worst_tokens
        rows) is raised here, after the records landed, naming that dispatch."""
        if self._deferred_dispatch is None:
            return
        h, finish = self._deferred_dispatch
        self._deferred_dispatch = None
        self._lap(None)  # (benchmarks: its laps start here, not at the end of the call before, outside the backend)
        try:
            made = finish().handle
        except InternodeError as exc:
            raise InternodeError(f"the sync-free dispatch before this call failed (it returned before the counts, "
                                 f"so its error is raised here): {exc}") from exc
        on_device = h._recv_tokens_per_expert_dev
        h.__dict__.update(made.__dict__)  # the same object stays the caller's handle, and the last dispatch's
        if on_device is not None:  # (made from the device before; equal to the host list's)
            h._recv_tokens_per_expert_dev = on_device
        self._last_dispatch_handle = h
