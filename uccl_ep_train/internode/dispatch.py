"""Dispatch: the entry point and its two kinds, uncached (notify, then the hops) and cached (a handle's counts and
plans reused), and the two hops that move per-token columns (_move)."""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from uccl_ep_train.backends import DispatchArgs, DispatchResult
from uccl_ep_train.internode.plan import (InternodeError, RecordLayout, Counts, SendPlan, recv_counts, block_offsets,
                                          num_recv_rows, forward_block_bases, check_area, _align, expert_major_places,
                                          recv_expert_counts, dispatch_extents, dispatch_may_skip_entry_barrier,
                                          READ_GO)
from uccl_ep_train.internode.columns import _dense, _row_bytes, _record_layout, _column_args, _record_columns
from uccl_ep_train.internode.handle import InternodeHandle, DispatchShape, PlannedAhead
from uccl_ep_train.internode.call_state import CountRows, UncachedDispatch, ExpertMajorRows


def _chain(*steps: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """The steps given (not None), one after the other, as one step; None when none is given."""
    given = [s for s in steps if s is not None]

    def run() -> None:
        for step in given:
            step()

    return run if given else None


class Dispatch:
    """Dispatches tokens to their experts' ranks. A part of NativeInternodeBackend (backend.py), which composes these
    parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        from uccl_ep_train.reference import get_dispatch_layout

        return get_dispatch_layout(topk_idx, num_experts, self.R, self.G)

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        self._lap(None)
        x, scales = args.x, args.x_scales
        if args.handle is None and args.num_tokens_per_expert is None:  # before any traffic: peers would hang
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) when no handle is given")
        # No drain here: the previous call's waits are over (the host drained after each, _push_and_wait), and what
        # it queued after its last wait (unpack, the partial sums) may still run while this call's first launches
        # queue behind it; a drain cost ~100 us per call on 2x H200 (session 8).
        self._check("entry of dispatch")
        self._refuse_a_stall_without_drains()
        self._finish_dispatch_before_counts()
        self._commit_staged_plans()
        combined_send_base, self._combined_send_base = self._combined_send_base, None
        if args.handle is not None:  # every rank finished its previous use of the areas ...
            self._spare_read_outputs = None  # (held no longer: only an uncached dispatch takes it)
            if self._cached_dispatch_needs_barrier(args.handle, [x] + ([scales] if scales is not None else [])):
                self._barrier("entry of dispatch")
            else:  # ... as the last combine's traffic proves
                self.dispatch_barriers_skipped += 1
        # ... which, without a handle, notify proves: a rank's row leaves behind everything earlier on its stream
        self._synced_since_combine = True
        self._last_combine = None
        self._lap("dispatch.entry")
        if args.handle is not None:
            return self._cached_dispatch(args)
        return self._uncached_dispatch(args, combined_send_base)

    def _cached_dispatch(self, args: DispatchArgs) -> DispatchResult:
        """A dispatch with the handle of an earlier one: its plan, hop and receive layout are the handle's."""
        from uccl_ep_train.reference import _payload_bytes

        x, scales = args.x, args.x_scales
        h: InternodeHandle = args.handle
        cols = [x] + ([scales] if scales is not None else [])
        em_out: List[torch.Tensor] = []  # expert-major: allocated between the push and the wait, not after it
        alloc = (lambda: em_out.extend(self._empty_rows(c, h.num_recv_rows) for c in cols)) if h.expert_major else None
        in_reader = h.expert_major and self.expert_major_in_reader["cached"]  # the reader writes the handle's slots
        reads_all = in_reader or not h.expert_major  # (the copy after the hop reads the final rows instead)
        final, layout, _, _, pending = self._move(cols, h.counts, h.plan, gate_ok=reads_all, h=h,
                                                  plan_ahead=alloc, own_from_columns=reads_all,
                                                  unpacked_next=not h.expert_major)
        self.last_traffic = self._traffic_forward(h, _payload_bytes(x, scales))  # before a gated unpack spins
        if in_reader:
            if not em_out:  # (gated: _move left the allocation to us, before the reader's launch)
                alloc()
            self._expert_major_pad(h.expert_major_info, h.expert_alignment, h.num_recv_rows, em_out)
            self._expert_major_read(final, layout, em_out, h.num_recv_rows, h.num_topk, h.slot_of,
                                    pending=pending)
            parts = em_out
        elif h.expert_major:
            parts = self._expert_major_copy(h, _record_columns(final, layout, len(cols)), cols, em_out or None)
        else:
            parts = [self._empty_rows(c, h.num_recv_rows) for c in cols]
            self._unpack(final, layout, parts, h.num_recv_rows, pending=pending)
        self._last_dispatch_handle = h
        self._lap("dispatch.finish")
        return DispatchResult(parts[0], parts[1] if scales is not None else None, None, None, None, h,
                              self.last_traffic)

    def _uncached_expert_major_reader(self, args: DispatchArgs, T: int, combined_send_base: Optional[int]
                                      ) -> Tuple[bool, bool]:
        """(whether the records carry each pair's rank among ours of its expert, whether this rank's reader writes
        the expert-major rows from them) for an uncached dispatch (docs/internode.md, "Expert-major rows in the
        reader"; the receiver's per-source counts come with notify, up to NOTIFY_MAX_EXPERTS experts).
        The column is in every sender's layout, so it is shipped by a rule every rank applies alike: wherever some
        receiver's reader may write the rows. Whether ours does is our own choice; with `auto` where ranks share a
        GPU, only if it may launch before the count read (_reading_before_counts decides: a size seen before, right
        after a combine)."""
        E = args.num_tokens_per_expert.numel()
        if not (args.expert_major and args.topk_idx is not None and E <= self.notify_max_experts):
            return False, False
        choice = self.expert_major_in_reader
        if not (choice["uncached"] or (self._reads_before_counts_at_all and choice["uncached early"])):
            return False, False
        may_read_early = (self._reads_before_counts_at_all and combined_send_base is not None
                          and bool(args.num_worst_tokens or self._expert_rows_seen.get(T)))
        return True, choice["uncached early" if may_read_early else "uncached"]

    def _uncached_dispatch(self, args: DispatchArgs, combined_send_base: Optional[int]) -> DispatchResult:
        """A dispatch without a handle: notify exchanges the counts, and the receive is planned from them (or, read
        before the count read, from the count rows on the device). ``combined_send_base``: where the last combine's
        partial sums start in our send half, when that combine proves the rest of it free (packing during notify).
        A sync-free dispatch without drains returns before the count read (_returns_before_counts); the rest of this
        method, _after_counts, then runs at the next call's entry."""
        x, scales = args.x, args.x_scales
        itr = args.is_token_in_rank
        topk_idx, weights = args.topk_idx, args.topk_weights
        if args.expert_major and topk_idx is None:
            raise ValueError("expert_major=True needs topk_idx")
        if itr is None:
            itr = self.get_dispatch_layout(topk_idx, args.num_tokens_per_expert.numel())[3]
        T = x.size(0)
        E = args.num_tokens_per_expert.numel()
        ranks_pairs, in_reader = self._uncached_expert_major_reader(args, T, combined_send_base)
        cols = [x] + ([scales] if scales is not None else [])
        if topk_idx is not None:
            cols.append(_dense(topk_idx, torch.int64))
            cols.append(_dense(weights, torch.float32) if weights is not None else
                        torch.zeros(topk_idx.shape, dtype=torch.float32, device=x.device))
            if ranks_pairs:
                cols.append(self._pair_ranks(cols[-2], E))
        early: dict = {}
        during = tables = fused = reading = None
        # (`then` of _notify runs only when the counts go through the proxies: no tables for nothing otherwise)
        if combined_send_base is not None and self.pack_during_notify and self._notify_via_proxies:
            tables = self._fresh_plan(T, T * self.N, [])  # written with the count row
            dense = [_dense(c, c.dtype) for c in cols]
            layout = _record_layout(tuple(_row_bytes(r) for r in dense), self.G)
            fused = self._fused_table_during_notify(layout.stride)
            reading = self._reading_before_counts(args, T, layout, fused is not None, dense, tables, in_reader)

            def during(row: torch.Tensor, landing: CountRows) -> None:
                self._pack_during_notify(row, itr, dense, layout, combined_send_base, early, landing, tables, fused)
        early_return = self._returns_before_counts(args, reading)
        counts = self._notify(itr, args.num_tokens_per_expert, then=during, plan=tables,
                              row_goes_with_then=fused is not None,
                              ahead=(lambda rows: self._launch_reader_before_counts(reading, rows, combined_send_base))
                              if reading is not None else None, defer=early_return)
        self._lap("dispatch.notify")
        call = UncachedDispatch(args, combined_send_base, itr, in_reader, cols, early, reading, early_return)
        if early_return:
            return self._return_before_counts(call, counts)
        return self._after_counts(call, counts)

    def _after_counts(self, call: "UncachedDispatch", counts: Counts) -> DispatchResult:
        """An uncached dispatch from the counts on: the receive planned from them (or the reader launched before the
        count read confirmed by them), the outputs, the handle and the next calls' plans."""
        from uccl_ep_train.reference import _payload_bytes

        args, combined_send_base, itr = call.args, call.combined_send_base, call.itr
        in_reader, cols, early, reading = call.in_reader, call.cols, call.early, call.reading
        x, scales, topk_idx, weights = args.x, args.x_scales, args.topk_idx, args.topk_weights
        T, E = x.size(0), args.num_tokens_per_expert.numel()
        plan, pushed = self._packed_during_notify(early, counts)
        expert_rows = None  # an expert-major receive's rows, for the reader before the counts
        if reading is not None and reading.expert_rows:
            expert_rows = sum(_align(int(c), args.expert_alignment)
                              for c in recv_expert_counts(counts, self.rank, reading.experts_per_rank))
        words = self._before_counts_words(reading, counts, combined_send_base) if reading is not None else None
        declined = reading is not None and not self._reader_read(reading, words, expert_rows)
        forwarded = None  # several GPUs per node: a forward before the count read that went, its unpack did not
        if declined:
            if self.G > 1 and words[READ_GO]:
                forwarded = reading
            reading = None  # the reader did nothing: the host plans and reads after notify, as below
            self.reads_before_counts_declined += 1
        packed = early["rows"] if plan is not None else None
        if plan is None:
            plan = self._send_plan(itr, counts)
        self._lap("dispatch.plan")
        ahead = plan_ahead = later = None
        if self.plan_ahead:
            ahead = PlannedAhead()
            now, later = self._guesses(tuple(_row_bytes(c) for c in cols[:2 if scales is not None else 1]),
                                       x.size(1), topk_idx.size(1) if topk_idx is not None else 0)
            plan_ahead = lambda upload=True: self._plan_ahead(  # noqa: E731
                counts, plan, now, ahead, "dispatch.plan_ahead", upload=upload)
        worst = args.num_worst_tokens
        L = E // self.R
        payload = cols[:2 if scales is not None else 1]
        made: dict = {}
        em: Optional[ExpertMajorRows] = None

        @functools.cache  # asked by the expert-major outputs before the reader, and by the handle during it
        def expert_sizes() -> Tuple[Optional[List[int]], Optional[List[int]]]:
            """Raw and aligned received tokens per local expert, from the counts (None: more experts than a notify
            row holds; counted from the received ids below)."""
            if counts.expert_counts is None:
                return None, None
            raw = recv_expert_counts(counts, self.rank, L)
            return raw, [_align(int(c), args.expert_alignment) for c in raw]
        if reading is not None and reading.expert_rows:  # the reader writes the expert-major rows (and their plan)
            nrecv = num_recv_rows(counts, self.rank)
            rows = nrecv
            layout, pending, final, outs = reading.layout, None, None, []
            fwd_dest = self._forward_dest_before_counts(reading, counts)
            recv_topk_idx = recv_w = None
            src_idx, arrival = reading.src_idx[:nrecv], reading.arrival[:nrecv]
            em, cut = reading.em, worst or expert_rows  # (padded to num_worst_tokens, else cut at the rows filled)
            em = ExpertMajorRows(cut, em.info, em.token[:cut], em.slot[:cut], em.expert[:cut], em.weights[:cut],
                                 em.slot_of[:nrecv], [o[:cut] for o in em.out], em.places)
            self._expert_rows_seen[T] = expert_rows
            self.expert_major_reads_before_counts += 1
            self.expert_major_reads["uncached"] += 1
            self.expert_major_places_on_device += 1
        elif reading is not None:
            nrecv = num_recv_rows(counts, self.rank)
            rows = worst or nrecv
            layout, fwd_dest, pending = reading.layout, self._forward_dest_before_counts(reading, counts), None
            final = None  # (an expert-major receive read before the counts is the branch above)
            outs = [o[:rows] for o in reading.outs]
            recv_topk_idx = reading.topk_idx[:rows] if reading.topk_idx is not None else None
            recv_w = reading.weights[:rows] if reading.weights is not None else None
            src_idx, arrival = reading.src_idx[:nrecv], reading.arrival[:nrecv]
        else:
            # (an expert-major copy after the hop reads the final rows: our own among them)
            if forwarded is not None:  # the rows are forwarded already: only their unpack is left
                final, layout, fwd_dest, pending = self._forwarded_before_counts(forwarded, counts, plan)
            else:
                final, layout, fwd_dest, _, pending = self._move(cols, counts, plan, gate_ok=True, packed=packed,
                                                                 pushed=pushed, plan_ahead=plan_ahead,
                                                                 own_from_columns=in_reader or not args.expert_major,
                                                                 unpacked_next=not args.expert_major)
            nrecv = final.size(0)
            rows = nrecv
            if worst and not args.expert_major:
                if nrecv > worst:
                    self._await_pending(pending, "dispatch_network")  # the peers' records land before we give up
                    self._close_unpack_beside()
                    raise InternodeError(f"rank {self.rank}: received {nrecv} tokens but num_worst_tokens={worst}; "
                                         "raise num_worst_tokens")
                rows = worst
            # one launch takes every column out of the final rows (padded to num_worst_tokens); expert-major gathers
            # the payload straight from the final rows below instead (one copy)
            outs = [] if args.expert_major else [self._empty_rows(c, rows) for c in payload]
            recv_topk_idx = recv_w = None
            if topk_idx is not None and not in_reader:  # (the reader writes the expert-major plan instead)
                recv_topk_idx = torch.empty((rows, topk_idx.size(1)), dtype=torch.int64, device=self.device)
                recv_w = torch.empty((rows, topk_idx.size(1)), dtype=torch.float32, device=self.device)
            src_idx = torch.empty(nrecv, dtype=torch.int64, device=self.device)
            arrival = torch.empty(nrecv, dtype=torch.int64, device=self.device)
            self._lap("dispatch.outputs")
            if args.expert_major and counts.expert_counts is not None:
                # the reader's table from the count rows where they are on the device (this call's: the next
                # notify overwrites them only after every rank's combine of this receive)
                places_from = ((self._notify_rows_at.ptr, self._notify_rows_at.row_words, args.expert_alignment)
                               if in_reader and self._notify_rows_at is not None else None)
                try:
                    em = self._expert_major_rows(nrecv, topk_idx.size(1), *expert_sizes(), worst, payload,
                                                 places_from)
                except InternodeError:
                    self._await_pending(pending, "dispatch_network")  # the peers' records land before we give up
                    raise
                if in_reader:  # the reader's table, and the rows it leaves empty done before it
                    if em.places is None:
                        em.places = self._upload(expert_major_places(counts, self.rank, L, expert_sizes()[1]))
                    self._expert_major_pad(em.info, args.expert_alignment, em.rows, em.out, em)
                self._expert_rows_seen[T] = sum(expert_sizes()[1])  # (the next dispatch of T tokens guesses from it)
        self._recv_rows_seen[T] = nrecv
        # Everything that follows from the counts alone is made while the hop runs, not after the drain (~100 us per
        # call there, session 10): the outputs before the reader's launch (an allocation may call into CUDA), the
        # handle and the next calls' plans right after it, while the reader reads the rows already in (host_work:
        # with one GPU per node the reader is gated and spins, and nothing may call into CUDA then: "Drains").
        # The combine's gather table is made by the combine that needs it.
        plan_first = pending is not None and plan_ahead is not None and self._plan_before_reader(pending)
        if plan_first:
            self._lap("dispatch.outputs")
            plan_ahead()
        # An expert-major receive's reader moves no payload (the copy after the drain does), so it ends soon after the
        # last chunk lands, while planning during it held the drain back (~150-200 us under MPS, session 28): its
        # plans are made after the copy's launch instead, while the GPU copies.
        plan_after_copy = (args.expert_major and not in_reader and pending is not None and plan_ahead is not None
                           and not plan_first)

        def host_work() -> None:  # while the reader runs (spins, when gated): nothing queued on the stream
            raw, aligned = expert_sizes()
            h = InternodeHandle(num_tokens=T, num_recv_rows=nrecv,
                                num_topk=topk_idx.size(1) if topk_idx is not None else 0, num_ranks=self.R,
                                expert_major=args.expert_major, is_token_in_rank=itr, recv_tokens_per_expert=aligned,
                                device=self.device, counts=counts, plan=plan, num_recv_tokens=nrecv,
                                recv_src_idx=src_idx, recv_arrival=arrival, fwd_dest_rows=fwd_dest,
                                expert_alignment=args.expert_alignment, num_worst_tokens=args.num_worst_tokens)
            self.last_traffic = self._traffic_forward(h, _payload_bytes(x, scales))
            made.update(h=h, raw=raw, aligned=aligned)
            if (pending or reading is not None) and plan_ahead is not None and not plan_first and not plan_after_copy:
                plan_ahead(False)  # (no pending: made in _move, before the wait)

        if reading is not None:
            self._while_reader_before_counts(reading, counts, plan, host_work)
        elif in_reader:
            self._expert_major_read(final, layout, em.out, em.rows, topk_idx.size(1), em.slot_of, em, L, src_idx,
                                    arrival, pending, while_reading=host_work)
        else:
            self._unpack(final, layout, outs, rows, recv_topk_idx, recv_w, len(payload), self.rank * L, L, src_idx,
                         arrival, pending, while_reading=host_work)
        h, raw, aligned = made["h"], made["raw"], made["aligned"]
        recv_x = outs[0] if outs else None
        recv_scales = outs[1] if scales is not None and outs else None
        if raw is None:
            if topk_idx is not None:  # more experts than a notify row holds: count the received ids (a host sync)
                # non-local slots count into a spare bin L: no boolean indexing
                ids = recv_topk_idx[:nrecv]
                raw = torch.bincount(torch.where(ids >= 0, ids, L).view(-1), minlength=L + 1)[:L].tolist()
            else:  # no top-k: the per-expert counts come from every source's num_tokens_per_expert
                mine = args.num_tokens_per_expert.to(torch.int64).cpu()
                every = [torch.empty_like(mine) for _ in range(self.R)]
                dist.all_gather(every, mine, group=self._gloo)
                raw = torch.stack(every).view(self.R, self.R, L)[:, self.rank].sum(0).tolist()
            aligned = [_align(int(c), args.expert_alignment) for c in raw]
            h.recv_tokens_per_expert = aligned
        if in_reader:
            recv_topk_idx, recv_w = self._adopt_expert_major(h, em)
            recv_x = em.out[0]
            recv_scales = em.out[1] if scales is not None else None
        elif args.expert_major:
            sources = _record_columns(final, layout, len(payload))  # straight from the final rows: one copy
            if em is None:  # sized from the received ids counted above
                em = self._expert_major_rows(nrecv, topk_idx.size(1), raw, aligned, worst, payload)
            # (expert-major is never read before the counts: its top-k outputs have the received rows, no padding)
            recv_topk_idx, recv_w = self._expert_major_plan(h, recv_topk_idx, recv_w, em)
            out = self._expert_major_copy(h, sources, payload, em.out)
            recv_x = out[0]
            recv_scales = out[1] if scales is not None else None
            if plan_after_copy:
                plan_ahead()
        else:
            h.num_recv_rows = rows
        if ahead is not None:
            self._lap("dispatch.handle")
            self._adopt_plans(h, ahead)
            h.later_guesses = later
            self._lap("dispatch.adopt_plans")
        if weights is None:
            recv_w = None
        if declined and call.returned_early:  # the outputs it returned were never written (the host's read went
            # into outputs of its own above, which nobody holds)
            raise InternodeError(
                f"rank {self.rank}: its reader did not read before the counts, so the outputs it returned were not "
                f"written: the records it sent passed its send area below the last combine's partial sums (raise "
                f"num_rdma_bytes); every record has landed and the next calls run")
        self._last_dispatch_handle = h
        self._lap("dispatch.finish")
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_w, [] if worst else aligned, h,
                              self.last_traffic)

    def _move(self, columns: List[torch.Tensor], counts: Counts, plan: SendPlan, gate_ok: bool = False,
              h: Optional[InternodeHandle] = None, packed: Optional[List[torch.Tensor]] = None,
              pushed: bool = False, plan_ahead: Optional[Callable[[], None]] = None, own_from_columns: bool = False,
              unpacked_next: bool = False
              ) -> Tuple[torch.Tensor, RecordLayout, Optional[torch.Tensor], int, Any]:
        """Run the two hops for per-token columns; returns (final rows uint8 [num_recv, final_bytes] view, layout,
        forwarder dest rows [A, G] (None with one GPU per node: nothing is forwarded), A, pending). ``gate_ok``: the
        caller reads every final row with one gated unpack next; then, with one GPU per node (the final rows are the
        arrivals), the hop is not awaited here and ``pending`` (Pending) is for ``_unpack`` and ``_gated_done``;
        otherwise pending is None and the rows are in. ``h``: the handle of a cached dispatch,
        which keeps the hop's plan. ``packed``: the columns (contiguous), whose records for the other nodes are packed
        already (_pack_during_notify); ``pushed``: and pushed too (_push_during_notify). ``plan_ahead``: host work
        and uploads for between the push and the wait when the hop is awaited here (when pending is returned, the
        caller runs it before it launches the gated reader). ``own_from_columns``: the gated reader can take our own
        node's rows from the columns (pending.own): then, where it is gated, they are not packed. ``unpacked_next``:
        the caller's next launch is ``_unpack`` of the final rows (a rank-major receive), which may then run beside the
        forward (several GPUs per node: "The unpack beside the forward"), and the node barrier after it."""
        G = self.G
        # contiguous byte rows, alive until the pack launches below
        rows = packed if packed is not None else [_dense(c, c.dtype) for c in columns]
        layout = _record_layout(tuple(_row_bytes(r) for r in rows), G)
        stride = layout.stride
        shape = h.dispatch_shapes.get(layout) if h is not None else None
        if shape is None:
            try:
                shape = self._dispatch_shape(counts, plan, layout)
            except InternodeError:
                if pushed:
                    self._await_pushed_during_notify(counts, stride)
                raise
            if h is not None:
                h.dispatch_shapes[layout] = shape
        self._last_dispatch_extents = shape.extents
        recv_base = self.half_rdma
        # The own node's records never cross the network: they are packed straight into their receive block, and
        # after the push, so that the push waits only for the records it sends (at 2 nodes, half the packing).
        own_block = shape.own_block
        gated = G == 1 and gate_ok and self.gated_arrivals
        # docs/internode.md, "Own rows from the columns": the gated reader takes our own rows from the columns instead
        own_unpacked = gated and own_from_columns and self.own_rows_from_columns and self._own_readable(rows, layout)

        hop = self._hop_plan(h, ("dispatch", stride), lambda: self._dispatch_hop(counts, plan, stride),
                             on_device=not pushed)
        others, own_range = self._record_ranges(plan)
        pack = lambda ranges: self._pack(rows, plan, layout, own_block, ranges)  # noqa: E731
        # What the push needs written before it starts: nothing when one launch writes the records and pushes them
        # (`fused`), or when they were packed during notify; the head's records when the plan has a head (the rest
        # is packed while the head moves: `rest`); else every other node's.
        rest = fused = None
        if packed is None and shape.sends_remote and self._packs_and_pushes(hop):
            cols = _column_args(rows, layout)
            own_first, own_end = own_range
            fused = lambda: self._pack_and_push(  # noqa: E731
                hop, "dispatch_network", self._cx.rdma_ptr, stride, int(sum(plan.node_send)), cols,
                (own_first, own_end - own_first, 0 if own_unpacked else self._cx.rdma_ptr + own_block),
                plan.hop1_token.data_ptr(),
                plan.dest_rows.data_ptr(), G, layout.src_idx_offset, layout.dest_rows_offset)
        elif not shape.sends_remote:  # every record is our own node's: nothing crosses the network
            if not own_unpacked:
                pack([own_range])
        elif packed is None and hop.head_records:
            pack([(hop.head_first, hop.head_first + hop.head_records)])
            rest = lambda: pack(hop.rest_of(others))  # noqa: E731
        elif packed is None:
            pack(others)
        self._lap("dispatch.pack")
        own_after_push = ((lambda: pack([own_range])) if shape.sends_remote and fused is None and not own_unpacked
                          else None)
        push = (lambda: None) if pushed else fused  # pushed during notify: only the waits and gates are left
        arrivals = shape.arrivals
        A = arrivals.size(0)
        if gated:
            pending = self._push_and_gate(hop, "dispatch_network", then=own_after_push, rest=rest, push=push)
            self._lap("dispatch.push")
            # the reader starts with our own node's records, which are in before any other node's: read in row
            # order they would wait behind the blocks of the nodes before ours until those had landed, and then
            # still be left to read after the wire's last byte
            own_row = (own_block - recv_base) // stride
            if own_unpacked:
                self.own_rows_read_from_columns += 1
                own = (own_row, own_range[1] - own_range[0], own_range[0], plan.hop1_token.data_ptr(),
                       _column_args(rows, layout))
                pending = pending._replace(own=own, own_columns=rows)
            return arrivals[:, :layout.final_bytes], layout, None, A, pending._replace(first_row=own_row)
        # The forward marks its rows ready wherever a read of the node may go beside it: our unpack next, or -- an
        # expert-major receive forwarded after the count read -- a local GPU's receive launched before it, whose
        # words said go by the same rule on the same counts (a node whose forwarders split)
        marks = (G > 1 and self.unpack_beside_forward
                 and max(counts.totals(G).final_rows[self.node * G:(self.node + 1) * G]) <= self._ready_rows)
        beside = marks and unpacked_next
        marked = 0  # the epoch of the rows' ready words when they are marked but unpacked after the barrier
        if G > 1 and self.gated_arrivals:
            # docs/internode.md, "Gated forward": the forwarder reads each arrival as its chunk lands and forwards it
            # over NVLink during the hop, starting with our own node's block, which is in before the hop starts
            # (the forward's grid comes with its gate) held beside an unpack so that both find room: both grids
            # together stay below what an H100/H200 holds at once (unpack_records takes ~40 registers)
            with self._spin_blocks_held(self.unpack_beside_forward_blocks if beside else 0):
                pending = self._push_and_gate(hop, "dispatch_network", then=own_after_push, rest=rest, push=push)
            if plan_ahead is not None:
                plan_ahead()
            self._lap("dispatch.push")
            own_row = (own_block - recv_base) // stride
            if beside:  # the unpack goes on the second stream, after everything before the forward (_unpack)
                self._forward_epoch = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
                self._unpack_beside = self._forward_epoch
                self._cx.stream_wait(self._cx.side_stream, self._stream())
            elif marks:
                marked = self._next_epoch(self._forward_epoch, "UCCL_EP_FORWARD_NODE_BARRIER")
            fwd_dest = self._forward_arrivals(counts, shape, layout, A, recv_base, own_row, pending.gate,
                                              ready_epoch=self._unpack_beside if beside else marked)
            if beside:
                # the forward writes fwd_dest on our stream after the second stream's wait, so its memory must not go
                # back to the allocator (a cached dispatch drops it) while the unpack's outputs, allocated next and
                # written on the second stream, could be given it: session 45's first GPU run, cached recv_x differed
                self._beside_keep = fwd_dest
            self.forwards_during_hop += 1
            self._gated_done("dispatch_network", pending.t0, "dispatch_network wait")
            self._lap("dispatch.network")
        else:
            self._push_and_wait(hop.rows, hop.waits, "dispatch_network", hop.per_chunk, hop=hop, rest=rest,
                                then=_chain(own_after_push, plan_ahead), push=push)
            self._lap("dispatch.network")
            if G == 1:
                # One GPU per node: the arrivals are the final rows already, in their order (blocks by source node =
                # source rank, tokens in order within each), so they are read in place instead of copied to the NVL
                # area, and a row's arrival is its index (not stamped: unpack writes it); nobody forwards, so no dest
                # rows.
                self._lap("dispatch.forward")
                return arrivals[:, :layout.final_bytes], layout, None, A, None
            fwd_dest = self._forward_arrivals(counts, shape, layout, A, recv_base, 0, None)
        if not beside:
            self._forwarded(marked or None)  # every forwarder's rows are in our NVL area
        self._lap("dispatch.forward")
        nrecv = num_recv_rows(counts, self.rank)
        final = self._nvl[:nrecv * layout.final_bytes].view(nrecv, layout.final_bytes)
        return final, layout, fwd_dest, A, None

    @staticmethod
    def _own_readable(rows: List[torch.Tensor], layout: RecordLayout) -> bool:
        """Whether a reader can take our own rows from these columns (contiguous, _dense; the payload first): each at
        an address its loads may use at every row -- the payload's 16-byte words, the others' elements -- as the
        records' fields are; a sliced input may not be, and its own rows are packed as before."""
        need = [16] + [r.element_size() for r in rows[1:]]
        return all(r.data_ptr() % a == 0 and b % a == 0 for r, b, a in zip(rows, layout.column_bytes, need))

    def _dispatch_shape(self, counts: Counts, plan: SendPlan, layout: RecordLayout, upload: bool = True
                        ) -> DispatchShape:
        """The DispatchShape of these counts and layout, after checking that every rank's areas hold the dispatch
        (the same answer on every rank: the counts are the same). ``upload`` False: the forward row bases stay on
        the host (_upload_plans_ahead takes them to the device)."""
        G, stride = self.G, layout.stride
        tot = counts.totals(G)
        check_area("dispatch send (RDMA)", tot.sends, stride, self.half_rdma, "num_rdma_bytes")
        check_area("dispatch receive (RDMA)", tot.arrivals, stride, self.half_rdma, "num_rdma_bytes")
        check_area("dispatch final rows (NVL)", tot.final_rows, layout.final_bytes, self.half_nvl, "num_nvl_bytes")
        recv_by_node = recv_counts(counts, self.rank, G)
        recv_base, A = self.half_rdma, sum(recv_by_node)
        bases = forward_block_bases(counts, self.rank, G) if G > 1 else None
        if bases is not None and upload:
            bases = self._forward_bases_on_device(bases)
        return DispatchShape(recv_base + block_offsets(recv_by_node, stride)[self.node],
                             int(plan.hop1_token.numel()) > plan.node_send[self.node],
                             dispatch_extents(counts, G, stride),
                             self._rdma[recv_base:recv_base + A * stride].view(A, stride), bases)

    def _cached_dispatch_needs_barrier(self, h: InternodeHandle, cols: List[torch.Tensor]) -> bool:
        """Unless the last call was a combine whose traffic proves what the barrier would (docs/internode.md, "Areas
        and entry barriers"). UCCL_EP_SKIP_DISPATCH_BARRIER=0 keeps the barrier always. The answer for the same
        combine (the same counts and areas objects, held by the memo so that they stay the same) and record size is
        kept on the handle."""
        if self._last_combine is None or not self.skip_dispatch_barrier:
            return True
        stride = _record_layout(tuple(_row_bytes(c) for c in cols), self.G).stride
        counts, areas = self._last_combine
        memo = h.skip_decision
        if memo is not None and memo[0] is counts and memo[1] is areas and memo[2] == stride:
            return not memo[3]
        skip = dispatch_may_skip_entry_barrier(h.counts, counts, areas, self.G, stride, self.half_rdma)
        h.skip_decision = (counts, areas, stride, skip)
        return not skip
