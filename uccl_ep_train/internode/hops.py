"""Network hops: push tables handed to the proxies as commands, the waits on the signal counters, gates for the
readers that start before a hop ends, and the hop plans cut into a head and a tail (docs/internode.md,
"Push head", "Pack and push", "Transport ordering")."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from uccl_ep_train.kernel_timeline import COMBINE, DISPATCH
from uccl_ep_train.internode.plan import (InternodeError, Counts, SendPlan, chunk_records, dispatch_push_rows,
                                          dispatch_waits, combine_push_rows, combine_waits, CombineAreas,
                                          dispatch_gate_blocks, combine_gate_blocks, gate_rows, split_push_head)
from uccl_ep_train.internode.columns import _upload_values, _address
from uccl_ep_train.internode.handle import InternodeHandle, HopPlan
from uccl_ep_train.internode.call_state import Pending


class NetworkHops:
    """Pushes records through the proxies and waits for the other nodes' records. A part of NativeInternodeBackend
    (backend.py), which composes these parts; the state they share is set up there (its __init__ and the setup steps it
    calls)."""

    def _barrier(self, what: str) -> None:
        """Group barrier in stream order, through the proxies: every rank pushes a zero-byte signal to every other
        rank behind all its earlier work on the stream, then waits (GPU, with the GPU deadline) for one from each;
        the host drains after it where drains are on (_settle). Work queued after it runs once every rank's earlier
        kernels -- its reads of its areas, its stores into peers' NVL areas -- are complete. The network writes they
        pushed on other lanes may still be in flight (the proxy threads are not ordered with each other): the
        receivers' own counter waits cover those. It replaced a gloo barrier over TCP (~1 ms per barrier with 4
        processes; docs/internode.md)."""
        rows = [[r, 0, 0, 0, 1, self._barrier_slot, 0] for r in range(self.R) if r != self.rank]
        self._push_and_wait(rows, [(self._barrier_slot, self.R - 1)], "barrier", 1, what, fixed=True)

    def _per_chunk(self, stride: int) -> int:
        """Records per write; every rank derives the same number (same settings, the group's smallest transport
        write limit), so receivers know the lanes."""
        return chunk_records(stride, self.write_bytes)

    def _upload(self, rows: Any, dtype: Any = np.int64) -> torch.Tensor:
        """A small host table (int64, or np.int32) on the device without a stream sync: through the pinned staging
        area (upload_staging.py), on the CPU stand-in as _upload_values."""
        if isinstance(rows, torch.Tensor):
            if rows.device.type != "cpu" or self._staging is None:
                return rows.to(self.device, non_blocking=True)
            rows = rows.numpy()
        if self._staging is not None:
            return self._staging.upload(rows, dtype, self._stream())
        return _upload_values(rows, dtype, self.device)

    def _push_and_wait(self, rows: List[List[int]], waits: List[Tuple[int, int]], phase: str, per_chunk: int,
                       what: str = "", fixed: bool = False, drain: Optional[bool] = None,
                       then: Optional[Callable[[], None]] = None, hop: Optional[HopPlan] = None,
                       rest: Optional[Callable[[], None]] = None,
                       after_wait: Optional[Callable[[], None]] = None,
                       push: Optional[Callable[[], None]] = None,
                       unawaited: Optional[Callable[[], None]] = None, hold: bool = False) -> None:
        """Push the table's chunks, wait for the signals, then drain if ``drain`` (default: the drain policy,
        ``_drain_after_waits``). ``fixed``: the rows are the same in every call of this phase (barrier, notify),
        so their device copy is made once and reused. ``then``: launches of kernels already loaded (never a first
        launch: see "Drains") that go between the push and the wait. ``hop`` (then ``rows`` are its own), ``rest``
        and ``push``: see _push_hop. ``after_wait``: copies (never a kernel) queued behind the wait, done when the
        drain returns. ``unawaited``: launches of kernels already loaded queued behind those, which the drain does
        not wait for (it waits for a mark recorded before them); they must queue no upload. ``hold``: record that
        mark and return without the drain, which the caller makes later (``_drain(marked=True)``, before any other
        mark: a sync-free dispatch's count read at the next call's entry)."""
        t0 = self._hop_started()
        if hop is not None:
            self._push_hop(hop, phase, rest, push)
        else:
            self._push(rows, phase, per_chunk, fixed)
        if then is not None:
            then()
        for slot, count in waits:
            self._expected[slot] += count
        self._wait_for_targets([slot for slot, _ in waits], phase)
        if after_wait is not None:
            after_wait()
        self._hop_ended(phase, t0)
        if hold or (unawaited is not None and (self._drain_after_waits if drain is None else drain)):
            marked = self._mark_drain()
            if unawaited is not None:
                unawaited()
            if hold:
                self._check(what or f"{phase} wait")
            else:
                self._drain(what or f"{phase} wait", marked=marked)
            return
        # Nothing else is launched while wait_signals spins (docs/internode.md, "Drains"): the host drains the
        # stream here, polling an event and aborting the waits as soon as the proxy reports a failure.
        self._settle(what or f"{phase} wait", drain)

    def _push_and_gate(self, hop: HopPlan, phase: str, then: Optional[Callable[[], None]] = None,
                       rest: Optional[Callable[[], None]] = None, push: Optional[Callable[[], None]] = None
                       ) -> Pending:
        """Push the table's chunks and return what its reader needs (Pending) instead of waiting: the kernel that reads
        the arrivals takes the gate and waits chunk by chunk (UCCL_EP_GATED_ARRIVALS), so it runs during the hop. The
        caller launches it, then calls ``_gated_done``, which drains as ``_push_and_wait`` does (the gated kernel
        spins as wait_signals did). The hop's gate blocks (dispatch_gate_blocks / combine_gate_blocks) name the
        same counters as its waits, whose targets advance here. ``rest``, ``push``: see _push_hop."""
        t0 = self._hop_started()
        self._push_hop(hop, phase, rest, push)
        if then is not None:  # as in _push_and_wait
            then()
        table = gate_rows(hop.gate_blocks, self.node, self.L, self._expected)
        for slot, count in hop.waits:
            self._expected[slot] += count
        t = self._upload(table) if table else None
        self._keep_w = t  # alive until the gated launch has run (the drain in _gated_done)
        return Pending(self._cx.arrival_gate(_address(t), len(table), hop.per_chunk,
                                             self._phases[phase]), t0, [slot for slot, _ in hop.waits],
                       records=sum(count for _, count in hop.waits))

    def _plan_before_reader(self, pending: Any) -> bool:
        """Where a call's planning for the next calls goes ("Planning ahead"): before its gated reader's launch, with
        its upload, while at least half of the hop's records are still to land -- the wire is busy for a while yet,
        so the planning costs nothing there; else after the launch, while the reader reads what is in (its tables
        staged, their copies queued at the next call's entry). One read of the hop's counters."""
        if not pending or not pending.records:
            return False
        left = self._cx.signals_short([(slot, self._expected[slot]) for slot in pending.slots])
        return 2 * left >= pending.records

    def _gated_done(self, phase: str, t0: Any, what: str) -> None:
        self._hop_ended(phase, t0)
        self._settle(what)

    def _await_pending(self, pending: Any, phase: str) -> None:
        """A gated hop whose reader will not run (the call fails after the push): wait for every counter's target
        instead, so nothing is still landing when the error reaches the caller."""
        if not pending:
            return
        self._wait_for_targets(pending.slots, phase)
        self._gated_done(phase, pending.t0, f"{phase} wait")

    def _wait_for_targets(self, slots: List[int], phase: str) -> None:
        """wait_signals on this rank's stream until each slot reaches its running target (``_expected``)."""
        if slots:
            self._cx.wait_signals([(slot, self._expected[slot]) for slot in slots], self._phases[phase],
                                  self._stream())

    def _push(self, rows: List[List[int]], phase: str, per_chunk: int, fixed: bool = False, at: int = 0) -> None:
        """push_chunks over ``rows``; ``at``: the device address of their copy when the caller has one (a HopPlan,
        which holds it)."""
        if not rows:
            return
        if not at:
            table = self._fixed_table(phase, rows) if fixed else self._push_table(rows)
            self._keep = table
            at = table.data_ptr()
        self._cx.push_chunks(at, len(rows), per_chunk, self._phases[phase], self._stream())

    def _fixed_table(self, phase: str, rows: List[List[int]]) -> torch.Tensor:
        """The device push table of rows that are the same in every call of this phase (barrier, notify), made once."""
        key = (phase, rows[0][3], rows[0][1])  # notify rows change width with the experts, and place with the area
        table = self._fixed_tables.get(key)
        if table is None:
            table = self._fixed_tables[key] = self._push_table(rows)
        return table

    def _push_hop(self, hop: HopPlan, phase: str, rest: Optional[Callable[[], None]],
                  push: Optional[Callable[[], None]] = None) -> None:
        """Push a hop's writes: with ``push`` (the one launch that writes the records and pushes them, _pack_and_push)
        that; else the whole table (the caller wrote every record it sends), or, with ``rest`` (given only for a hop
        cut in two: the launches that write the records after the head's), the head, then ``rest``, then the tail."""
        self._keep = hop.table  # a plan made without a handle lives until the call has drained
        if push is not None:
            push()
            return
        if rest is None:
            self._push(hop.rows, phase, hop.per_chunk, at=hop.rows_at)
            return
        self._push(hop.head_rows, phase, hop.per_chunk, at=hop.head_at)
        rest()
        self._push(hop.tail_rows, phase, hop.per_chunk, at=hop.tail_at)

    def _push_table(self, rows: List[List[int]]) -> Optional[torch.Tensor]:
        if not rows:
            return None
        self._check_push_columns(rows)
        return self._upload(rows)

    def _check_push_columns(self, rows: List[List[int]]) -> None:
        if len(rows[0]) != self._k.PUSH_COLUMNS:
            raise InternodeError(f"push table has {len(rows[0])} columns, the module expects "
                                 f"{self._k.PUSH_COLUMNS} (rebuild _C)")

    def _packs_and_pushes(self, hop: HopPlan) -> bool:
        """Whether the hop's records are written and pushed in one launch (_pack_and_push): the setting, and a table
        the kernel takes."""
        return self.pack_and_push and 0 < len(hop.rows) <= self._k.PACK_PUSH_MAX_ROWS

    def _pack_and_push(self, hop: HopPlan, phase: str, send: int, stride: int, num_records: int,
                       columns: List[Tuple[int, int, int]], own: Tuple[int, int, int], hop1_token: int = 0,
                       dest_rows: int = 0, G: int = 0, src_idx_offset: int = -1, dest_rows_offset: int = 0,
                       expert_sums: Optional[tuple] = None, node_sums: Optional[tuple] = None) -> None:
        """The pack_and_push kernel (docs/internode.md, "Pack and push"): the records -- record r at ``send`` + r x
        ``stride``, carrying row ``hop1_token[r]`` (0: row r) of every column (address, row bytes, offset in the
        record), or with ``expert_sums`` (_expert_sums) combine row r summed from expert-major rows, or with
        ``node_sums`` (_gather_in_tiles) arrival r's node sum once its copies' tiles are flagged, our own node's
        (``own`` = (first record, records, where they go)) elsewhere -- written, and each of the hop's chunks pushed
        once its records are."""
        chunks = sum(-(-records // hop.per_chunk) for _, _, _, _, records, _, _ in hop.rows if records > 0)
        if self._chunk_ready is None or self._chunk_ready.numel() < chunks:
            self._chunk_ready = torch.zeros(max(chunks, 1024), dtype=torch.int32, device=self.device)
        own_first, own_count, own_dst = own
        self._cx.pack_and_push(hop.rows_at, len(hop.rows), hop.per_chunk, send, own_dst, own_first, own_count, stride,
                               hop1_token, dest_rows, G, num_records, columns, src_idx_offset, dest_rows_offset,
                               self._chunk_ready.data_ptr(), self._phases[phase], self._stream(),
                               expert_sums=expert_sums, node_sums=node_sums)
        self.packs_and_pushes[phase] += 1
        if self.kernel_timeline is not None:
            self.kernel_timeline.note(COMBINE if phase == "combine_network" else DISPATCH)

    def _hop_plan(self, h: Optional[InternodeHandle], key: Tuple[str, int], make: Callable[[], HopPlan],
                  on_device: bool = True) -> HopPlan:
        """The handle's plan for this hop (made once per handle and record size, or ahead: _plan_ahead), or a fresh
        one without a handle; on the device either way, except a fresh one whose push already ran (``on_device``
        False: only its waits and gates are used, and the upload would cost ~15-40 us of host time for nothing)."""
        plan = h.hop_plans.get(key) if h is not None else None
        if plan is None:
            plan = make()
            if on_device or h is not None:  # a handle's plan serves its cached calls' pushes later
                self._upload_hop_plans([plan])
            if h is not None:
                h.hop_plans[key] = plan
        return plan

    def _cut_hop_plan(self, plan: HopPlan, local_base: Optional[int]) -> HopPlan:
        """``plan`` cut into a head and a tail (split_push_head) where ``local_base`` -- where the sent records start in
        our RDMA region -- is given, unless UCCL_EP_PUSH_HEAD=0; host work only."""
        if local_base is not None and self.push_head:
            first, n, head, tail = split_push_head(plan.rows, local_base, plan.per_chunk)
            if n:
                plan.head_first, plan.head_records, plan.head_rows, plan.tail_rows = first, n, head, tail
        return plan

    def _upload_hop_plans(self, plans: List[HopPlan], staged: Optional[list] = None) -> None:
        """The plans' tables (each whole, and its head and tail) to the device in one upload: each upload costs ~10-18
        us of host time. ``staged``: only written and allocated (UploadStaging.stage: no copy queued, for while a
        reader spins), the Staged appended to the list, committed at the next call's entry."""
        rows: List[List[int]] = []
        for p in plans:
            rows += p.rows + p.head_rows + p.tail_rows
        if staged is not None and rows:
            self._check_push_columns(rows)
            st = self._staging.stage(rows, np.int64)
            staged.append(st)
            table = st.out
        else:
            table = self._push_table(rows)
        if table is None:
            return
        row_bytes, at = 8 * self._k.PUSH_COLUMNS, table.data_ptr()
        for p in plans:
            p.table = table
            p.rows_at = at
            p.head_at = at + row_bytes * len(p.rows)
            p.tail_at = p.head_at + row_bytes * len(p.head_rows)
            at = p.tail_at + row_bytes * len(p.tail_rows)

    def _hop_started(self) -> Any:
        """Benchmarks: a CUDA event at the push (None when not timing, and on the CPU stand-in)."""
        if self.network_timing is None or self.device.type != "cuda":
            return None
        t0 = torch.cuda.Event(enable_timing=True)
        t0.record()
        return t0

    def _hop_ended(self, phase: str, t0: Any) -> None:
        """... and one when the arrivals are in (after the wait, or after the gated kernel that read them)."""
        if t0 is None:
            return
        t1 = torch.cuda.Event(enable_timing=True)
        t1.record()
        self.network_timing.setdefault(phase, []).append((t0, t1))

    def _dispatch_hop(self, counts: Counts, plan: SendPlan, stride: int) -> HopPlan:
        """The network hop of a dispatch of records of ``stride`` bytes, cut into a head and a tail (the records are
        packed at the start of the send half); no device table yet (_upload_hop_plans)."""
        per = self._per_chunk(stride)
        return self._cut_hop_plan(
            HopPlan(dispatch_push_rows(counts, plan, self.rank, self.G, stride, self.half_rdma, self.L), None,
                    dispatch_waits(counts, self.rank, self.G, per, self.L),
                    dispatch_gate_blocks(counts, self.rank, self.G, self.L), per), 0)

    def _combine_hop(self, counts: Counts, cstride: int, areas: CombineAreas) -> HopPlan:
        """The network hop of a combine of wire rows of ``cstride`` bytes; no device table yet. Cut into a head and a
        tail with one GPU per node only: then each row pushed is written by one copy (with several, by the forwarder's
        node sum after a barrier)."""
        per = self._per_chunk(cstride)
        return self._cut_hop_plan(
            HopPlan(combine_push_rows(counts, self.rank, self.G, cstride, areas, self.L), None,
                    combine_waits(counts, self.rank, self.G, per, self.L),
                    combine_gate_blocks(counts, self.rank, self.G, self.L), per),
            areas.send_base[self.rank] if self.G == 1 else None)
