"""Notify: every rank's counts on every rank, through the proxies (or gloo past the notify area), and the send plan
made from our own counts; with it, the records of the next dispatch packed and pushed while the counts are still
being exchanged (docs/internode.md, "Barriers and notify through the proxies", "Packing during notify", "Push during
notify")."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from uccl_ep_train.internode.diagnostics import timeout_hint
from uccl_ep_train.kernel_timeline import DISPATCH_DURING_NOTIFY
from uccl_ep_train.internode.plan import (InternodeError, RecordLayout, Counts, local_count_row, counts_from_rows,
                                          SendPlan, recv_counts, dispatch_waits, _align,
                                          dispatch_push_rows_before_counts, notify_area_turn)
from uccl_ep_train.internode.columns import _address, _dense, _column_args
from uccl_ep_train.internode.call_state import CountRows


class CountExchange:
    """The count exchange and the work that rides on it. A part of NativeInternodeBackend (backend.py), which composes
    these parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    def _notify(self, is_token_in_rank: torch.Tensor, tokens_per_expert: Optional[torch.Tensor],
                then: Optional[Callable[[torch.Tensor, CountRows], None]] = None,
                plan: Optional[SendPlan] = None, row_goes_with_then: bool = False,
                ahead: Optional[Callable[[CountRows], None]] = None, defer: bool = False) -> Any:
        """Every rank's counts on every rank. With the tokens per expert (up to NOTIFY_MAX_EXPERTS) in the rows, a
        receiver knows its per-expert counts from notify alone, and neither dispatch nor combine reads anything else
        back. Every rank makes the same choice: the same group and experts. ``then(row, rows)``: work for while the
        rows are exchanged, given our own count row on the device and where every row lands (through the proxies
        only); ``plan``: tables for T x N records that the count row's launch also fills with our send plan, counted
        from our own tokens, for ``then`` (count_row with send_plan: one launch fewer before a dispatch packed during
        notify). ``row_goes_with_then``:
        ``then`` launches a kernel that pushes our row itself (the rows' ``own_pushes``), so no launch pushes it
        before. ``ahead(rows)``: launches queued behind the rows' wait and the matrix's copy, that the host does not
        wait for before it reads the matrix (a reader launched before the count read; with ``then`` only).
        ``defer`` (through the proxies only): return, instead of the counts, a function that reads them later -- the
        host waits for nothing now (a sync-free dispatch that returns before the count read)."""
        carry = tokens_per_expert is not None and tokens_per_expert.numel() <= self.notify_max_experts
        shape = dict(num_experts=tokens_per_expert.numel() if carry else 0)
        width = self.R + self.N + shape["num_experts"]
        tpe = tokens_per_expert if carry else None
        self._notify_rows_at = None  # (set where the rows land on the device: _notify_through_proxies)
        if self._notify_via_proxies:
            row = self._notify_views(width, self._notify_turn())[0]
            self._count_row(row, is_token_in_rank, tpe, plan if then is not None else None)
            return self._notify_through_proxies(width, shape,
                                                (lambda rows: then(row, rows)) if then is not None else None,
                                                row_goes_with_then, ahead, defer)
        row = torch.empty(width, dtype=torch.int64, device=self.device)
        self._count_row(row, is_token_in_rank, tpe)
        self._drain("notify")  # bounded; the copy to the host below then never waits behind a stuck kernel
        row = row.cpu()
        out = [torch.empty_like(row) for _ in range(self.R)]
        try:
            dist.all_gather(out, row, group=self._gloo)
        except Exception as exc:
            perr = self._proxy_view()
            raise InternodeError(f"rank {self.rank}: notify (count exchange) failed within {self.cpu_timeout} s: "
                                 f"{exc}" + (f"; rank {self.rank} proxy: {perr}" if perr else "")
                                 + f"\n{timeout_hint()}") from exc
        self._check()
        return counts_from_rows(torch.stack(out), self.R, self.N, **shape)

    def _count_row(self, out: torch.Tensor, is_token_in_rank: torch.Tensor, tokens_per_expert: Optional[torch.Tensor],
                   plan: Optional[SendPlan] = None) -> None:
        """local_count_row into ``out`` (int64 on the device) in one launch (count_row kernel), which also writes our
        send plan into ``plan`` (node bases counted from the tokens); through torch, and the send plan by a launch of
        its own, when the row has more bins than the kernel's shared memory holds."""
        if self.R + self.N > self._k.COUNT_ROW_MAX_BINS:
            out.copy_(local_count_row(is_token_in_rank, self.G, tokens_per_expert))
            if plan is not None:
                self._send_plan_launch(is_token_in_rank, plan, 0)
            return
        itr = _dense(is_token_in_rank, torch.bool)
        tpe = None
        if tokens_per_expert is not None:
            tpe = tokens_per_expert if tokens_per_expert.device == self.device else tokens_per_expert.to(self.device)
            tpe = _dense(tpe, tpe.dtype if tpe.dtype in (torch.int32, torch.int64) else torch.int64)
        self._k.count_row(out.data_ptr(), itr.data_ptr(), itr.size(0), self.R, self.G,
                          _address(tpe), tpe is not None and tpe.dtype == torch.int64,
                          tpe.numel() if tpe is not None else 0, self._stream(),
                          send_plan=self._table_addresses(plan) if plan is not None else None)

    def _notify_turn(self) -> int:
        """The notify area (0 .. NOTIFY_AREAS - 1) the next count exchange through the proxies uses."""
        return notify_area_turn(self._notify_exchanges)

    def _notify_area(self, turn: int) -> int:
        """Offset in the RDMA region of notify area ``turn``."""
        return self._notify_base + turn * self._notify_area_bytes

    def _notify_views(self, words: int, turn: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """For count rows of ``words`` int64 in notify area ``turn``: (our row there, the area's R rows as bytes,
        their pinned host copy or None), made once per width and area: each view costs host time before the count
        row leaves."""
        views = self._notify_view_cache.get((words, turn))
        if views is None:
            R, base, row_bytes = self.R, self._notify_area(turn), _align(8 * words)
            own = base + self.rank * row_bytes
            views = self._notify_view_cache[words, turn] = (
                self._rdma[own:own + 8 * words].view(torch.int64), self._rdma[base:base + R * row_bytes],
                self._notify_host[:R * row_bytes] if self._notify_host is not None else None)
        return views

    def _notify_through_proxies(self, words: int, shape: dict, then: Optional[Callable[[CountRows], None]] = None,
                                row_goes_with_then: bool = False,
                                ahead: Optional[Callable[[CountRows], None]] = None, defer: bool = False) -> Any:
        """Count exchange in stream order: our row (``words`` int64, already in row ``rank`` of our notify area) goes
        into row ``rank`` of every rank's notify area (one write each, through the proxies), then we wait for every
        other rank's row and copy the matrix to the host. Receiving every row also proves that every rank finished
        its earlier work on the stream (each pushes behind it), so an uncached dispatch needs no entry barrier.
        Replaced a gloo all_gather (~1 ms with 4 processes).

        The rows sit back to back at the width this call uses (the same on every rank: same group, same number of
        experts), not at the area's widest row, so the matrix comes back in one contiguous copy: a strided one
        first gathered it on the device with a kernel of its own. ``then(rows)``: launched between our row's push and
        the wait for the others', told where the rows land and which counter value proves they did; with
        ``row_goes_with_then`` it pushes our row itself (``rows.own_pushes``: the push table), one launch fewer before
        the wire ("Push during notify"). ``ahead(rows)`` (with ``then``): launched behind the wait and the copy, and
        not waited for before the matrix is read ("Reading before the count read"). ``defer``: see _notify; the
        function it returns drains to the mark recorded behind the matrix's copy, then reads it."""
        # this exchange's area: the next one takes the other, since a peer may push its next row while we still read
        # these on the device (NOTIFY_AREAS)
        turn = self._notify_turn()
        self._notify_exchanges += 1
        R, base = self.R, self._notify_area(turn)
        row_bytes = _align(8 * words)
        own = base + self.rank * row_bytes
        self._lap("dispatch.notify_row")  # benchmarks: the count row's launches (and any wait they hide)
        rows = [[r, own, own, row_bytes, 1, self._notify_slot, 0] for r in range(R) if r != self.rank]
        _, area, host = self._notify_views(words, turn)
        later = after = None
        carried = then is not None and row_goes_with_then
        if then is not None:
            # the wait below adds the R - 1 rows to the counter's target after `then`
            landing = CountRows(self._notify_slot, self._expected[self._notify_slot] + R - 1,
                                self._cx.rdma_ptr + base, row_bytes // 8,
                                (self._fixed_table("notify", rows).data_ptr(), len(rows)) if carried else None)
            later = lambda: then(landing)  # noqa: E731
            after = (lambda: ahead(landing)) if ahead is not None else None  # noqa: E731
        self._push_and_wait([] if carried else rows, [(self._notify_slot, R - 1)], "notify", 1,
                            "notify (count exchange)",
                            fixed=True, drain=True,  # the host reads the rows right below (or, deferred, later)
                            then=later,
                            after_wait=(lambda: host.copy_(area, non_blocking=True)) if host is not None else None,
                            unawaited=after, hold=defer)
        self._notify_rows_at = CountRows(self._notify_slot, self._expected[self._notify_slot],
                                         self._cx.rdma_ptr + base, row_bytes // 8)
        self._lap("dispatch.notify_exchange")  # until every peer's row is here: the ranks' skew shows up here

        def read() -> Counts:
            if defer:  # the drain _push_and_wait held back: the GPU has passed the matrix's copy
                self._drain("notify (count exchange) of the sync-free dispatch before this call", marked=True)
            # a copy of the pinned rows: the next notify overwrites them, and the counts live on in the handle
            mat = (host.clone() if host is not None else area.cpu()).view(torch.int64).view(R, row_bytes // 8)
            return counts_from_rows(mat[:, :words], R, self.N, **shape)
        return read if defer else read()

    def _send_plan(self, is_token_in_rank: torch.Tensor, counts: Counts) -> SendPlan:
        """internode.plan.send_plan with its device tables made by one launch (send_plan kernel); the host part (how
        many records go to each node, where each node's run starts) comes from the counts."""
        node_send = [int(c) for c in counts.node_counts[self.rank].tolist()]
        node_base = self._upload([sum(node_send[:m]) for m in range(self.N)])  # each torch op costs ~5-10 us here
        plan = self._fresh_plan(is_token_in_rank.size(0), sum(node_send), node_send)
        self._send_plan_launch(is_token_in_rank, plan, node_base.data_ptr())
        return plan

    def _fresh_plan(self, T: int, records: int, node_send: List[int]) -> SendPlan:
        """A SendPlan over fresh tables (_send_tables) for T tokens and ``records`` send records, not written yet."""
        hop1_token, dest_rows, dest_row_all, row_of = self._send_tables(T, records)
        return SendPlan(hop1_token, node_send, dest_rows, dest_row_all, row_of)

    @staticmethod
    def _table_addresses(plan: SendPlan) -> Tuple[int, int, int, int]:
        """The send plan's tables as the kernels take them: (dest_row_all, hop1_token, dest_rows, row_of)."""
        return (plan.dest_row_all.data_ptr(), plan.hop1_token.data_ptr(), plan.dest_rows.data_ptr(),
                plan.row_of.data_ptr())

    def _send_plan_launch(self, is_token_in_rank: torch.Tensor, plan: SendPlan, node_base: int) -> None:
        """The send_plan kernel into ``plan``'s tables; ``node_base``: where each node's records start in the list
        (device int64 [N]; 0: counted from the tokens)."""
        itr = _dense(is_token_in_rank, torch.bool)
        self._k.send_plan(itr.data_ptr(), itr.size(0), self.R, self.G, node_base,
                          *self._table_addresses(plan), self._stream())

    def _send_tables(self, T: int, records: int) -> Tuple[torch.Tensor, ...]:
        """Fresh (hop1_token, dest_rows, dest_row_all, row_of) for T tokens and ``records`` send records: the spare
        set when it has this size (taken: no two plans share tables), else allocated now."""
        spare, self._spare_send_tables = self._spare_send_tables, None
        if spare is not None and spare[0] == (T, records):
            self.spare_send_tables_taken += 1
            return spare[1]
        return self._new_send_tables(T, records)

    def _new_send_tables(self, T: int, records: int) -> Tuple[torch.Tensor, ...]:
        dev = self.device
        return (torch.empty(records, dtype=torch.int64, device=dev),
                torch.empty((records, self.G), dtype=torch.int64, device=dev),
                torch.empty((T, self.R), dtype=torch.int64, device=dev),
                torch.empty((self.N, T), dtype=torch.int32, device=dev))

    def _spare_for_packing_during_notify(self, T: int) -> None:
        """Make the send-plan tables of the next dispatch's packing during notify (T x N records: any counts) now,
        while the host waits for a combine's hop: four allocations (~15-20 us of host time) fewer before that
        dispatch's wire starts. A dispatch of another size makes its own, and drops the spare set."""
        key = (T, T * self.N)
        if self._spare_send_tables is None or self._spare_send_tables[0] != key:
            self._spare_send_tables = (key, self._new_send_tables(*key))

    def _pack_during_notify(self, row: torch.Tensor, itr: torch.Tensor, rows: List[torch.Tensor],
                            layout: RecordLayout, send_top: int, early: dict, landing: CountRows, tables: SendPlan,
                            fused: Optional[torch.Tensor]) -> None:
        """Pack the records for the other nodes while notify exchanges the counts, where it is safe: the last call
        was a combine of the last dispatch's handle (the caller checks) and our records stay below ``send_top``,
        where that combine's partial sums start in our send half. Why that is enough: every node we sent that
        dispatch's records to sent us partial sums back for them in the combine, and pushed them only after its
        dispatch had received all of them; so nothing of ours below the partial sums is still on the wire (what
        notify would otherwise prove, docs/internode.md "Packing during notify").

        Only our own tokens per node are needed, and the host reads none of them: the count row's launch wrote our
        send plan into ``tables`` (sized for any counts; _count_row), and pack_records takes them from our count row
        ``row`` on the device. The records' dest rows count from our first token, as always (the forwarder adds the
        other sources' rows: forward_block_bases). The kernels pack nothing when our records would pass ``send_top``;
        the host learns which it was after notify (_packed_during_notify). ``rows``: the columns, contiguous
        (_dense), laid out as ``layout``. Fills ``early`` (layout, rows, tables, send_top), and pushes the records too
        (_push_during_notify; ``landing``: where the count rows land), adding ``push_launched``; with ``fused`` (the
        push table, _fused_table_during_notify) in one launch, which also pushes our count row."""
        G, N = self.G, self.N
        own_counts = row.data_ptr() + 8 * self.R  # our tokens per node: the row's node columns
        capacity = itr.size(0) * N  # a token is one record per node at most
        packed = _column_args(rows, layout)
        early.update(layout=layout, rows=rows, tables=tables, send_top=send_top)
        if fused is not None:
            self._pack_and_push_during_notify(fused, tables, layout, packed, capacity, landing, send_top)
            early["push_launched"] = True
            return
        table = self._push_table_during_notify(layout.stride) if self.push_during_notify else None
        self._k.pack_records(self._cx.rdma_ptr, 0, 0, 0, layout.stride, tables.hop1_token.data_ptr(),
                             tables.dest_rows.data_ptr(), G, capacity, packed, layout.src_idx_offset,
                             layout.dest_rows_offset, self._stream(), node_counts=own_counts, num_nodes=N,
                             skip_node=self.node, send_limit=send_top)
        self._lap("dispatch.pack_during_notify")
        if table is not None:
            self._push_during_notify(table, layout.stride, landing, send_top)
            early["push_launched"] = True

    def _push_table_during_notify(self, stride: int) -> Optional[torch.Tensor]:
        """The push table of a dispatch pushed during notify: a row for every other node, made before any count is
        known (dispatch_push_rows_before_counts), so the same for every call of a record size and uploaded once; the
        kernels take each row's records and block from our own count row. None with no other node."""
        key = ("dispatch during notify", stride)
        table = self._fixed_tables.get(key)
        if table is None:
            rows = dispatch_push_rows_before_counts(self.rank, self.G, self.N, stride, self.half_rdma, self.L)
            if not rows:
                return None
            table = self._fixed_tables[key] = self._push_table(rows)
        return table

    def _fused_table_during_notify(self, stride: int) -> Optional[torch.Tensor]:
        """The push table of a dispatch whose records are packed and pushed during notify in one launch
        (_pack_and_push_during_notify, which then pushes our count row too), or None where that takes two launches:
        UCCL_EP_PUSH_DURING_NOTIFY=0 or UCCL_EP_PACK_AND_PUSH=0, no other node, or more rows than the kernel takes.
        Asked before the count row's launch: the notify then pushes no row of its own."""
        if not (self.push_during_notify and self.pack_and_push):
            return None
        table = self._push_table_during_notify(stride)
        return table if table is not None and table.size(0) <= self._k.PACK_PUSH_MAX_ROWS else None

    def _push_during_notify(self, table: torch.Tensor, stride: int, landing: CountRows, send_top: int) -> None:
        """Push the records packed during notify at once, by a kernel that waits on the GPU for every count row
        (``landing``) and places each block from them (push_after_counts; docs/internode.md, "Push during notify"):
        the wire starts when the last row lands instead of after the host read the matrix and planned the hop. The
        destination's row also proves that its earlier calls are done with its receive area, as notify does for the
        push after it. The kernel takes each row of ``table`` (_push_table_during_notify) its records and block from
        our own row (rows_from_own_row) and pushes nothing when the pack did not pack (``send_top``). The writes are
        those of the hop plan made after notify (place_blocks = dispatch_push_rows), whose waits and gates the
        receivers use."""
        self._cx.push_after_counts(table.data_ptr(), table.size(0), self._per_chunk(stride), landing.slot,
                                   landing.target, landing.ptr, landing.row_words, self.G, self.half_rdma,
                                   self._phases["dispatch_network"], self._stream(), send_limit=send_top)
        self._lap("dispatch.push_during_notify")

    def _pack_and_push_during_notify(self, table: torch.Tensor, tables: SendPlan, layout: RecordLayout,
                                     columns: List[Tuple[int, int, int]], capacity: int, landing: CountRows,
                                     send_top: int) -> None:
        """The pack and the push during notify in one launch (pack_and_push_after_counts; docs/internode.md, "Push
        during notify"): the records counted from our own row are written, and each chunk leaves once its records
        are written and every count row is in, placed as push_after_counts places it. One launch fewer before the
        wire, which starts after the first chunks' records instead of after all of them. When the rows carry our
        row's pushes (``landing.own_pushes``) the launch makes them first: one launch fewer again."""
        stride, per = layout.stride, self._per_chunk(layout.stride)
        chunks = send_top // stride // per + table.size(0) + 1  # at most, whatever our counts are
        if self._chunk_ready is None or self._chunk_ready.numel() < chunks:
            self._chunk_ready = torch.zeros(max(chunks, 1024), dtype=torch.int32, device=self.device)
        own = landing.own_pushes or (0, 0)
        self._cx.pack_and_push_after_counts(
            table.data_ptr(), table.size(0), per, self._cx.rdma_ptr, stride, tables.hop1_token.data_ptr(),
            tables.dest_rows.data_ptr(), self.G, capacity, columns, layout.src_idx_offset, layout.dest_rows_offset,
            landing.slot, landing.target, landing.ptr, landing.row_words, self.half_rdma, send_top,
            self._chunk_ready.data_ptr(), self._phases["dispatch_network"], self._stream(),
            own_row_pushes=own[0], own_row_push_rows=own[1], own_row_push_phase=self._phases["notify"])
        self.packs_and_pushes_during_notify += 1
        self.count_rows_pushed_with_records += own[1] > 0
        if self.kernel_timeline is not None:
            self.kernel_timeline.note(DISPATCH_DURING_NOTIFY)
        self._lap("dispatch.pack_and_push_during_notify")

    def _packed_during_notify(self, early: dict, counts: Counts) -> Tuple[Optional[SendPlan], bool]:
        """After notify, what the kernels launched during it did, from the counts by their own rule: (the send plan
        when they packed, else None -- nothing was packed; whether they pushed)."""
        node_send = [int(c) for c in counts.node_counts[self.rank].tolist()]
        if not early or sum(node_send) * early["layout"].stride > early["send_top"]:
            return None, False
        self.packs_during_notify += 1
        t, S1 = early["tables"], sum(node_send)
        plan = SendPlan(t.hop1_token[:S1], node_send, t.dest_rows[:S1], t.dest_row_all, t.row_of)
        pushed = early.get("push_launched", False) and any(c for m, c in enumerate(node_send) if m != self.node)
        self.pushes_during_notify += pushed
        return plan, pushed

    def _await_pushed_during_notify(self, counts: Counts, stride: int) -> None:
        """A dispatch whose records were pushed during notify fails a check of the counts: before the error goes up,
        wait for the records the others pushed to us, so that none lands after it and the counters stay in step with
        their targets. push_after_counts sent them iff our arrivals fit our receive half (place_blocks)."""
        if sum(recv_counts(counts, self.rank, self.G)) * stride <= self.half_rdma:
            waits = dispatch_waits(counts, self.rank, self.G, self._per_chunk(stride), self.L)
            for slot, count in waits:
                self._expected[slot] += count
            self._wait_for_targets([slot for slot, _ in waits], "dispatch_network")
        self._drain("dispatch_network wait for the records pushed during notify")
