"""Combine: every node sums its rows' expert outputs at the forwarder (a node sum), one fp32 partial sum per token and
node crosses the network, and the source rank adds them in node order (docs/internode.md, "Combine",
"Pipelined combine gather")."""
from __future__ import annotations

import functools
import operator
from typing import Any, List, Optional, Tuple

import torch

from uccl_ep_train.internode.plan import (Counts, recv_counts, block_offsets, check_area, _align, recv_row_ends,
                                          source_local_of_rows, dispatch_nvlink_rows, combine_nvlink_rows, CombineAreas,
                                          combine_areas, combine_overlaps_dispatch, GATHER_MAX_TILES, gather_tile_rows)
from uccl_ep_train.internode.columns import _address, _dense, _ranges_around
from uccl_ep_train.internode.handle import InternodeHandle, HopPlan, CombineShape, PlannedAhead


class Combine:
    """Combines the experts' outputs back at their source ranks. A part of NativeInternodeBackend (backend.py), which
    composes these parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    def combine(self, x: torch.Tensor, handle: InternodeHandle, topk_weights: Optional[torch.Tensor], config: Any
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        from uccl_ep_train.reference import TrafficReport

        self._check("entry of combine")  # no drain: see dispatch
        self._refuse_a_stall_without_drains()
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        self._combined_send_base = None
        self._lap(None)
        h = handle
        G, dev = self.G, self.device
        nrecv, H = h.num_recv_tokens, x.size(1)
        if x.dtype not in (torch.bfloat16, torch.float32) or (H * x.element_size()) % 16:
            raise ValueError(f"combine: x must be bfloat16 or float32 with a hidden size of a multiple of 16 bytes, "
                             f"got {x.dtype} with hidden {H}")
        rows = w = ew = None
        if h.expert_major:
            if x.size(0) < h.num_recv_rows:
                raise ValueError(f"combine: x has {x.size(0)} rows but the expert-major handle has {h.num_recv_rows}")
            # one partial per (token, rank) in x's dtype, its local experts summed in slot order (as reference.combine):
            # by the pack itself where one launch packs and pushes (_expert_sums), else by a kernel first (_partials)
            x = _dense(x, x.dtype)
            ew = _dense(topk_weights, torch.float32) if topk_weights is not None else None
            kw = h.num_topk if ew is not None else 0
        else:  # (slices and conversions only where needed: each torch call costs host time before the wire)
            rows = _dense(x if x.size(0) == nrecv else x[:nrecv], x.dtype)
            if topk_weights is not None:
                w = _dense(topk_weights if topk_weights.size(0) == nrecv else topk_weights[:nrecv], torch.float32)
            kw = w.size(1) if w is not None else 0
        # A wire row: the payload in x's dtype, then the weights in fp32. Every copy a rank sends is a row of x (exact
        # in x's dtype), and a node partial crosses the network in x's dtype as in DeepEP (reference.combine rounds
        # it the same way): half the bytes of fp32 rows.
        pay = H * x.element_size()
        cstride = _align(pay + 4 * kw)
        shape = h.combine_shapes.get(cstride)
        if shape is None:
            shape = h.combine_shapes[cstride] = self._combine_shape(h.counts, cstride)
        recv_by_node, areas = shape.recv_by_node, shape.areas
        A = sum(recv_by_node)
        tot = h.counts.totals(G)
        c_send, c_recv = areas.send_base[self.rank], areas.recv_base[self.rank]
        self._lap("combine.prepare")
        if self._combine_needs_barrier(areas):
            self._barrier("entry of combine")  # every rank finished its previous use of the areas
        else:
            self.combine_barriers_skipped += 1
        self._synced_since_combine = False
        self._last_combine = (h.counts, areas)
        self._lap("combine.entry")
        # NVLink hop: each copy goes to its forwarder (same local index as the token's source), block = our local
        # index, row = the record's arrival. With one GPU per node we are every copy's forwarder and the only one:
        # the copies go straight into the send area (they are the partial sums), and stream order replaces the barrier.
        gbase = self.half_nvl
        # gather block j (copies from local GPU j) starts at a whole number of rows, so the forwarder's node sum
        # addresses every block's rows from one base
        rows_per_block = self.gather_block // cstride
        block = rows_per_block * cstride
        zero = self._zero_rows.get(pay)
        if zero is None:
            zero = self._zero_rows[pay] = torch.zeros(pay, dtype=torch.uint8, device=dev)
        back_offs = block_offsets(h.plan.node_send, cstride)  # at the source: records per node, in node order
        own_first = sum(recv_by_node[:self.node])
        own = recv_by_node[self.node]

        hop = self._hop_plan(h, ("combine", cstride), lambda: self._combine_hop(h.counts, cstride, areas))
        rest = fused = None
        sums_in_pack = h.expert_major and G == 1 and self.expert_sums_in_pack and self._packs_and_pushes(hop)
        if h.expert_major and not sums_in_pack:
            rows, w = self._partials(x, ew, h, nrecv)
        if G == 1 and self._packs_and_pushes(hop):
            # one launch writes the rows for the other nodes as records and pushes each chunk once it is written,
            # then writes our own node's rows where the sum reads them
            cols = [] if sums_in_pack else [(rows.data_ptr(), pay, 0)] + ([(w.data_ptr(), 4 * kw, pay)] if kw else [])
            sums = self._expert_sums(x, ew, h, pay) if sums_in_pack else None
            fused = lambda: self._pack_and_push(  # noqa: E731
                hop, "combine_network", self._cx.rdma_ptr + c_send, cstride, A, cols,
                (own_first, own, self._cx.rdma_ptr + c_recv + back_offs[self.node]), expert_sums=sums)
            self.expert_sums_in_packs += sums_in_pack
            self._lap("combine.gather")
        elif G == 1:
            # One GPU per node: the rows are the partial sums already, in arrival order (row = arrival). The other
            # nodes' go to their records in the send area and are pushed first (the head's, then the rest while the
            # head moves); our own node's go afterwards straight to where the sum reads them (their block of the
            # receive area), during the hop and without a copy.
            others = _ranges_around(own_first, own, A)

            def gather(ranges: List[Tuple[int, int]]) -> None:
                for lo, hi in ranges:
                    self._gather_rows(rows, w, lo, hi, c_send + lo * cstride, cstride)

            if hop.head_records:
                gather([(hop.head_first, hop.head_first + hop.head_records)])
                rest = lambda: gather(hop.rest_of(others))  # noqa: E731
            else:
                gather(others)
            self._lap("combine.gather")
        elif self.pipelined_gather:
            # docs/internode.md, "Pipelined combine gather": our copies go to the forwarders tile by tile, each tile
            # flagged over NVLink; our node sums are written and pushed by one launch, each record once its copies'
            # tiles are flagged, so the hop starts with the first tiles and no barrier sits before it
            epoch, tile = self._gather_in_tiles(h, shape, rows, w, nrecv, pay, kw, cstride, block)
            self.pipelined_gathers += 1
            self._lap("combine.gather")
            if A:
                sum_rows = self._forward_sum_rows(h, A, rows_per_block)
                if self._packs_and_pushes(hop):
                    node_sums = (self._cx.nvl_ptr + gbase, sum_rows.data_ptr(), G, pay, kw, x.dtype == torch.float32,
                                 self._cx.nvl_ptr + self._flag_base, tile, epoch)
                    fused = lambda: self._node_sum_push(  # noqa: E731
                        hop, cstride, A, (own_first, own, self._cx.rdma_ptr + c_recv + back_offs[self.node]),
                        self._cx.rdma_ptr + c_send, node_sums)
                else:  # no record for another node (or too many for one launch): wait for every tile, then sum
                    self._cx.wait_node_flags(self._cx.nvl_ptr + self._flag_base, G, -(-A // tile), epoch,
                                               self._phases["combine_gather"], self._stream())
                    self._join_gather()
                    self._node_sums(x, sum_rows, zero, A, pay, kw, cstride, gbase, c_send, c_recv, back_offs,
                                    own_first, own)
            else:
                self._join_gather()  # nothing of ours waits for the tiles: our stream takes the copies in turn
            self._lap("combine.node_sum")
        else:
            gather_index = self._gather_index(h, nrecv)
            if shape.gather is None or shape.gather[0] != pay:
                at = [self.peer_nvl[j] + gbase + self.local * block for j in range(G)]
                weights_at = [a + pay for a in at]
                limits = [tot.arrivals[self.node * G + j] for j in range(G)]
                shape.gather = (pay, self._upload([at, weights_at, limits]),
                                tuple(functools.reduce(operator.or_, b) for b in (at, weights_at)))
            _, table, bases_or = shape.gather
            if nrecv:  # one launch per column (payload, weights), each row to its forwarder's gather block
                for src, nbytes, i in ((rows, pay, 0), (w, 4 * kw, 1)):
                    if nbytes:
                        self._forward_rows(table[i], bases_or[i], cstride, gather_index, src.data_ptr(), nbytes,
                                           nrecv, nbytes, table[2], "combine_gather")
            self._barrier("combine gather")  # every copy of our arrivals is in our gather blocks
            self._lap("combine.gather")
            if A:
                self._node_sums(x, self._forward_sum_rows(h, A, rows_per_block), zero, A, pay, kw, cstride, gbase,
                                c_send, c_recv, back_offs, own_first, own)
            self._lap("combine.node_sum")

        pending = ahead = plan_ahead = None
        if h.later_guesses:  # the backward's plans, made while this hop runs
            ahead, later, h.later_guesses = PlannedAhead(), h.later_guesses, None
            plan_ahead = lambda upload=True: self._plan_ahead(  # noqa: E731
                h.counts, h.plan, later, ahead, "combine.plan_ahead", h.hop_plans, upload)
        if self.gated_arrivals:  # the sum below reads each token's partial sums as their chunks land
            pending = self._push_and_gate(hop, "combine_network", rest=rest, push=fused)
            self._lap("combine.push")
        else:
            self._push_and_wait(hop.rows, hop.waits, "combine_network", hop.per_chunk, hop=hop, rest=rest,
                                then=plan_ahead, push=fused)
            self._lap("combine.network")
        if G == 1 and own and fused is None:
            self._gather_rows(rows, w, own_first, own_first + own, c_recv + back_offs[self.node], cstride)
            self._lap("combine.node_sum")
        # the source adds each token's partial sums in node order, in fp32, and rounds once (one kernel)
        combined_x = torch.empty((h.num_tokens, H), dtype=x.dtype, device=dev)
        out_w = torch.empty((h.num_tokens, kw), dtype=torch.float32, device=dev) if kw else None
        eb = H * x.element_size()
        self.last_traffic = TrafficReport(shape.nvlink_rows * eb, shape.network_rows * eb, nrecv * eb)
        plan_first = pending is not None and plan_ahead is not None and self._plan_before_reader(pending)
        if plan_first:
            plan_ahead()
        self._k.sum_node_partials(combined_x.data_ptr(), out_w.data_ptr() if kw else 0, self._cx.rdma_ptr + c_recv,
                                  cstride, h.plan.row_of.data_ptr(), zero.data_ptr(), self.N, h.num_tokens, pay, kw,
                                  x.dtype == torch.float32, self._stream(), gate=pending.gate if pending else None)
        if h is self._last_dispatch_handle and self.pack_during_notify and self._notify_via_proxies:  # during the hop
            self._spare_for_packing_during_notify(h.num_tokens)
            self._spare_for_reading_before_counts()
        try:
            if pending and plan_ahead is not None and not plan_first:  # staged tables; copies after the drain
                plan_ahead(False)
        finally:  # drained whatever the planning raised
            if pending:
                self._gated_done("combine_network", pending.t0, "combine_network wait")
                self._lap("combine.network")
            else:
                self._settle("combine")
        if ahead is not None:
            self._adopt_plans(h, ahead)
        if h is self._last_dispatch_handle:  # the next uncached dispatch may pack during notify
            self._combined_send_base = areas.send_base[self.rank]
        self._lap("combine.finish")
        return combined_x, out_w

    def _partials(self, x: torch.Tensor, ew: Optional[torch.Tensor], h: InternodeHandle, nrecv: int
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine rows of expert-major ``x`` (its expert-major weights ``ew``): per received token its local
        experts' rows summed in slot order, and its top-k weights back in their slots (expert_major_partials, one
        launch over the whole GPU)."""
        rows = torch.empty((nrecv, x.size(1)), dtype=x.dtype, device=self.device)
        w = torch.empty((nrecv, h.num_topk), dtype=torch.float32, device=self.device) if ew is not None else None
        if nrecv:  # (a rank that received nothing may still hold num_worst_tokens padding rows)
            self._k.expert_major_partials(
                x.data_ptr(), _address(ew), h.slot_of.data_ptr(),
                h.expert_major_info.data_ptr(), nrecv, x.size(1), x.element_size(), h.num_topk, rows.data_ptr(),
                _address(w),
                self._expert_major_grid("partials_f32" if x.dtype == torch.float32 else "partials_bf16"),
                self._stream())
        return rows, w

    @staticmethod
    def _expert_sums(x: torch.Tensor, ew: Optional[torch.Tensor], h: InternodeHandle, pay: int) -> tuple:
        """pack_and_push's expert_sums (ExpertSums, csrc/kernels/internode.hpp): the records are the rows _partials
        makes, summed by the packers as they write each record, so the wire does not wait for a pass over every
        expert-major row first (docs/internode.md, "Expert-major sums in the pack")."""
        return (x.data_ptr(), pay, x.dtype == torch.float32, h.slot_of.data_ptr(), h.num_topk,
                _address(ew), pay)

    def _combine_shape(self, counts: Counts, cstride: int) -> CombineShape:
        """The CombineShape of a handle with these counts for wire rows of ``cstride`` bytes, after checking that
        every rank's areas hold them (the same answer on every rank: the counts are the same)."""
        G = self.G
        tot = counts.totals(G)
        check_area("combine gather (NVL, per local rank)", tot.arrivals, cstride, self.gather_block, "num_nvl_bytes")
        check_area("combine (RDMA)", tot.arrivals, cstride, self.half_rdma, "num_rdma_bytes")
        check_area("combine (RDMA)", tot.sends, cstride, self.half_rdma, "num_rdma_bytes")
        recv_by_node = recv_counts(counts, self.rank, G)
        return CombineShape(recv_by_node, combine_areas(counts, G, cstride, self.half_rdma),
                            combine_nvlink_rows(counts, self.rank, G),
                            sum(c for n, c in enumerate(recv_by_node) if n != self.node))

    def _combine_needs_barrier(self, areas: CombineAreas) -> bool:
        """Whether a rank may still use what this combine writes. Without a group sync since the last combine (two
        combines in a row), a peer may still read its received partial sums, or our proxy still send ours. After one
        (every dispatch starts with notify or a barrier, each pushed behind everything earlier on its rank's stream)
        only the last dispatch can still be in use -- its arrivals read in place, its records on the wire -- and the
        combine keeps clear of both while its rows fit above them on every rank (combine_overlaps_dispatch)."""
        return (not self._synced_since_combine or self._last_dispatch_extents is None
                or combine_overlaps_dispatch(areas, self._last_dispatch_extents, self.half_rdma))

    def _node_sums(self, x: torch.Tensor, sum_rows: torch.Tensor, zero: torch.Tensor, A: int, pay: int, kw: int,
                   cstride: int, gbase: int, c_send: int, c_recv: int, back_offs: List[int], own_first: int,
                   own: int) -> None:
        """The forwarder's node sums once every copy is in its gather blocks: each arrival's copies added in fp32 in
        ascending local rank and rounded once to x's dtype, straight into its send record (payload, then the fp32
        weights) in one kernel; then our own node's node sums from the send area to where the source's sum reads
        them."""
        self._k.sum_node_partials(self._cx.rdma_ptr + c_send, self._cx.rdma_ptr + c_send + pay if kw else 0,
                                  self._cx.nvl_ptr + gbase, cstride, sum_rows.data_ptr(), zero.data_ptr(), self.G, A,
                                  pay, kw, x.dtype == torch.float32, self._stream(), out_x_stride=cstride,
                                  out_w_stride=cstride)
        if own:
            dst, src = c_recv + back_offs[self.node], c_send + own_first * cstride
            self._rdma[dst:dst + own * cstride].copy_(self._rdma[src:src + own * cstride])

    def _node_sum_push(self, hop: HopPlan, cstride: int, A: int, own: Tuple[int, int, int], send: int,
                       node_sums: tuple) -> None:
        """The forwarder's node sums written and pushed by one pack_and_push launch, each record once its copies'
        tiles are flagged. With our own copies on the side stream (gather_beside_push) the launch runs beside them,
        held to gather_beside_push_blocks blocks so that the copies' blocks always find room on the GPU (its blocks
        wait for the copies' flags); then our stream waits for the copies before anything queued after it."""
        try:
            with self._spin_blocks_held(self.gather_beside_push_blocks if self._gather_to_join else 0):
                self._pack_and_push(hop, "combine_network", send, cstride, A, [], own, node_sums=node_sums)
        finally:
            self._join_gather()

    def _forward_sum_rows(self, h: InternodeHandle, A: int, rows_per_block: int) -> torch.Tensor:
        """int32 [G, A]: the gather row (counted from the first block) of local GPU j's copy of arrival a, -1 where
        GPU j sent none; made at the handle's first combine (and again for another gather block size)."""
        if h.forward_sum_rows is None or h.forward_sum_rows[0] != rows_per_block:
            # one launch (A <= rows_per_block: the combine's shape checked that every forwarder's arrivals fit its
            # gather block); as torch ops it took four, ~150 us of host time before the push (session 43)
            table = torch.empty((self.G, A), dtype=torch.int32, device=self.device)
            self._k.forward_sum_rows(table.data_ptr(), self.G, A, rows_per_block, h.fwd_dest_rows.data_ptr(),
                                     self._stream())
            h.forward_sum_rows = (rows_per_block, table)
        return h.forward_sum_rows[1]

    def _gather_index(self, h: InternodeHandle, nrecv: int) -> torch.Tensor:
        """int64 [nrecv, G]: each received row's arrival at its forwarder (the local GPU of its source) in that GPU's
        column, -1 in the others; the same in every combine of the handle, made at its first."""
        if h.gather_index is None:
            h.gather_index = torch.full((nrecv, self.G), -1, dtype=torch.int64, device=self.device)
            h.gather_index.scatter_(1, self._source_local(h, nrecv).unsqueeze(1), h.recv_arrival.unsqueeze(1))
        return h.gather_index

    def _source_local(self, h: InternodeHandle, nrecv: int) -> torch.Tensor:
        """int64 [nrecv] on the device: the local index of each received row's source (source_local_of_rows)."""
        return source_local_of_rows(self._upload(recv_row_ends(h.counts, self.rank)), nrecv, self.G)

    def _gather_rows(self, rows: torch.Tensor, w: Optional[torch.Tensor], lo: int, hi: int, dst_off: int,
                     cstride: int) -> None:
        """Rows [lo, hi) of the combine input (and of its fp32 weights) into consecutive wire rows of ``cstride``
        bytes at ``dst_off`` of our RDMA region: payload first, weights behind it."""
        n = hi - lo
        if n <= 0:
            return
        pay = rows.size(1) * rows.element_size()
        parts = [(rows, pay, 0)] + ([(w, 4 * w.size(1), pay)] if w is not None and w.size(1) else [])
        for src, nbytes, off in parts:
            self._scatter(self._cx.rdma_ptr + dst_off + off, cstride, 0, src.data_ptr() + lo * nbytes, nbytes, 0, n,
                          nbytes, n, "combine_gather")

    def _gather_in_tiles(self, h: InternodeHandle, shape: CombineShape, rows: torch.Tensor,
                         w: Optional[torch.Tensor], nrecv: int, pay: int, kw: int, cstride: int,
                         block: int) -> Tuple[int, int]:
        """The local side of the pipelined combine gather (docs/internode.md, "Pipelined combine gather"): our rows
        (and fp32 weights) to each forwarder's gather block for us, in its arrival order, a tile at a time, each tile
        then flagged in the forwarder's NVL region. Returns (the epoch the flags are raised to, arrivals per tile),
        which every rank of the node derives alike from the counts and its count of combines."""
        G = self.G
        self._gather_epoch = self._next_epoch(self._gather_epoch, "UCCL_EP_PIPELINED_COMBINE_GATHER")
        if shape.gather_tiles is None or shape.gather_tiles[0] != cstride:
            arrivals = [h.counts.totals(G).arrivals[self.node * G + f] for f in range(G)]
            at = [self.peer_nvl[f] + self.half_nvl + self.local * block for f in range(G)]
            flags = [self.peer_nvl[f] + self._flag_base + 4 * self.local * GATHER_MAX_TILES for f in range(G)]
            # each forwarder's arrivals from our own node, which its pack sums last: our copies go in its order
            by_node = [recv_counts(h.counts, self.node * G + f, G) for f in range(G)]
            own_first = [sum(n[:self.node]) for n in by_node]
            own_end = [first + n[self.node] for first, n in zip(own_first, by_node)]
            shape.gather_tiles = (cstride, self._upload([at, flags, arrivals, own_first, own_end]),
                                  gather_tile_rows(arrivals), max(max(arrivals), 1))
        _, table, tile, width = shape.gather_tiles
        by_arrival = h.gather_by_arrival
        if by_arrival is None:  # our row of each forwarder's arrival, -1 where it is another GPU's: one upload and
            # one call (torch took ~7 launches, ~200 us of host time before the push at 2 x 2: session 43)
            by_arrival = h.gather_by_arrival = torch.empty((G, width), dtype=torch.int32, device=self.device)
            ends = self._upload(recv_row_ends(h.counts, self.rank)) if nrecv else None
            self._k.gather_rows_by_arrival(
                by_arrival.data_ptr(), G, width, ends.data_ptr() if nrecv else 0, self.R,
                h.recv_arrival.data_ptr() if nrecv else 0, nrecv, self._stream(), err=self._cx.error_word_ptr,
                stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, rank=self.rank,
                phase=self._phases["combine_gather"])
        stream = self._stream()
        if self.gather_beside_push:  # beside our node sum and push (_node_sum_push), after everything before it
            self._cx.stream_wait(self._cx.side_stream, stream)
            stream, self._gather_to_join = self._cx.side_stream, True
            self.gathers_beside_push += 1
        self._k.gather_tiles(table[0].data_ptr(), table[1].data_ptr(), G, by_arrival.data_ptr(), by_arrival.size(1),
                             table[2].data_ptr(), tile, rows.data_ptr() if nrecv else 0, pay,
                             w.data_ptr() if kw and nrecv else 0, kw, nrecv, cstride, self._gather_epoch,
                             stream, err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                             stop_generation=self._cx.stop_generation, rank=self.rank,
                             phase=self._phases["combine_gather"], blocks=self.gather_blocks,
                             own_ranges=table[3].data_ptr())
        return self._gather_epoch, tile

    def _join_gather(self) -> None:
        """Our stream waits (on the GPU) for the copies launched on the side stream: whatever is queued after this
        -- the sum, the next call, the drain's mark -- comes after them, as on one stream."""
        if self._gather_to_join:
            self._gather_to_join = False
            self._cx.stream_wait(self._stream(), self._cx.side_stream)

    def _traffic_forward(self, h: InternodeHandle, row_bytes: int):
        from uccl_ep_train.reference import TrafficReport

        if h.dispatch_rows is None:  # from the counts alone: the same in every dispatch with this handle
            h.dispatch_rows = (dispatch_nvlink_rows(h.counts, self.rank, self.G),
                               sum(c for m, c in enumerate(h.plan.node_send) if m != self.node))
        nvlink, network = h.dispatch_rows
        return TrafficReport(nvlink * row_bytes, network * row_bytes, h.num_recv_tokens * row_bytes)
