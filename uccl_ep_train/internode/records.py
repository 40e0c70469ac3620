"""Records: packing the columns into records for the network hop and unpacking the final rows into the outputs
(docs/internode.md, "Dispatch" and "Gated arrivals")."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from uccl_ep_train.internode.plan import RecordLayout, SendPlan
from uccl_ep_train.internode.columns import _address, _column_args, _ranges_around


class Records:
    """Packs and unpacks records. A part of NativeInternodeBackend (backend.py), which composes these parts; the state
    they share is set up there (its __init__ and the setup steps it calls)."""

    def _record_ranges(self, plan: SendPlan) -> Tuple[List[Tuple[int, int]], Tuple[int, int]]:
        """(the other nodes' records, our own node's) as ranges of the record list, which runs by node."""
        own_first, own = sum(plan.node_send[:self.node]), plan.node_send[self.node]
        return _ranges_around(own_first, own, sum(plan.node_send)), (own_first, own_first + own)

    def _pack(self, rows: List[torch.Tensor], plan: SendPlan, layout: RecordLayout, own_offset: int,
              ranges: List[Tuple[int, int]]) -> None:
        """internode.plan.pack_records (pack_records kernel) into the send area, except the records of our own node,
        which go to ``own_offset`` of the RDMA region (their receive block). ``rows``: the columns, contiguous
        (_dense). ``ranges``: which records of the list (by node, see _record_ranges), a launch each."""
        own_first, own = sum(plan.node_send[:self.node]), plan.node_send[self.node]
        cols = _column_args(rows, layout)
        G, stride = self.G, layout.stride
        for lo, hi in ranges:
            if hi <= lo:
                continue
            # records [lo, hi) as a launch of their own: every table and the send area shifted to record lo
            self._k.pack_records(self._cx.rdma_ptr + lo * stride, self._cx.rdma_ptr + own_offset, own_first - lo,
                                 own, stride, plan.hop1_token.data_ptr() + 8 * lo,
                                 plan.dest_rows.data_ptr() + 8 * lo * G, G, hi - lo, cols, layout.src_idx_offset,
                                 layout.dest_rows_offset, self._stream())

    def _unpack(self, final: torch.Tensor, layout: RecordLayout, outs: List[torch.Tensor], out_rows: int = -1,
                ids: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None, ids_column: int = 0,
                expert_lo: int = 0, experts_per_rank: int = 0, src_idx: Optional[torch.Tensor] = None,
                arrival: Optional[torch.Tensor] = None, pending: Any = None,
                while_reading: Optional[Callable[[], None]] = None) -> None:
        """The final rows' columns into ``outs`` (column i into outs[i], padded with zero rows to ``out_rows``) in
        one launch (unpack_records kernel); with ``ids`` / ``weights``, column ``ids_column`` (global expert ids) and
        the next (weights) become local ids (-1 elsewhere and in padding rows) and the weights of local ids (0
        elsewhere); the src_idx and arrival fields into ``src_idx`` / ``arrival``. ``pending`` (from ``_move``): the
        rows are still landing; the unpack is gated on them and the hop is closed after it. ``while_reading``: host
        work that queues nothing on the stream, run right after the launch (while a gated reader spins: "Drains"), so
        that the reader reads the rows already in while the host makes the handle and, where the data is mostly in,
        the next calls' plans (that work had held the reader back)."""
        n = final.size(0)
        if self._unpack_beside is not None:  # docs/internode.md, "The unpack beside the forward": each row once marked
            ready = (self._cx.nvl_ptr + self._ready_base, self._unpack_beside)
            try:
                self._unpack_launch(final.data_ptr(), final.stride(0), n, n if out_rows < 0 else out_rows, layout,
                                    outs, ids, weights, ids_column, expert_lo, experts_per_rank, src_idx, arrival,
                                    stream=self._cx.side_stream, ready=ready)
            finally:
                self._close_unpack_beside()
            self.unpacks_beside_forward += 1
            self._while_reader(None, while_reading)
            return
        self._unpack_launch(final.data_ptr(), final.stride(0), n, n if out_rows < 0 else out_rows, layout, outs, ids,
                            weights, ids_column, expert_lo, experts_per_rank, src_idx, arrival,
                            gate=pending.gate if pending else None, first_row=pending.first_row if pending else 0,
                            own=pending.own if pending else None)
        self._while_reader(pending, while_reading)

    def _while_reader(self, pending: Any, while_reading: Optional[Callable[[], None]]) -> None:
        """After a dispatch reader's launch: ``while_reading`` (host work that queues nothing), then, with ``pending``
        (a gated reader), the hop closed: the reader is drained whatever the host work raised, so nothing is left
        spinning behind an error."""
        try:
            if while_reading is not None:
                self._lap("dispatch.unpack")
                while_reading()
        finally:
            if pending:
                self._gated_done("dispatch_network", pending.t0, "dispatch_network wait")
                self._lap("dispatch.network")

    def _unpack_launch(self, src: int, src_stride: int, n: int, out_rows: int, layout: RecordLayout,
                       outs: List[torch.Tensor], ids: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                       ids_column: int, expert_lo: int, experts_per_rank: int, src_idx: Optional[torch.Tensor],
                       arrival: Optional[torch.Tensor], gate: Any = None, first_row: int = 0,
                       stream: Optional[int] = None, ready: Optional[Tuple[int, int]] = None, **before: Any) -> None:
        """The unpack_records launch of _unpack (rows [0, n) at ``src``, ``src_stride`` bytes apart); ``before``: the
        arguments of a read before the counts (dims, pad) and of our own rows read from the columns (own);
        ``ready`` (our ready words, the forward's epoch): each row read once its word holds the epoch, on ``stream``
        (default: ours), the grid held to UCCL_EP_UNPACK_BESIDE_FORWARD_BLOCKS."""
        K = ids.size(1) if ids is not None else 0
        self._k.unpack_records(
            src, src_stride, n, out_rows,
            [(o.data_ptr(), layout.column_bytes[i], layout.column_offsets[i]) for i, o in enumerate(outs)],
            _address(ids), _address(weights), layout.column_offsets[ids_column] if K else 0,
            layout.column_offsets[ids_column + 1] if K else 0, K, expert_lo, experts_per_rank,
            layout.src_idx_offset, _address(src_idx), layout.arrival_offset if self.G > 1 else -1, _address(arrival),
            self._stream() if stream is None else stream, gate=gate, first_row=first_row, **before,
            **self._ready_args(ready))

    def _ready_args(self, ready: Optional[Tuple[int, int]]) -> dict:
        """A reader's arguments for ``ready`` (our ready words, the forward's epoch; "The unpack beside the forward"):
        its deadline, where it reports, and its grid held to UCCL_EP_UNPACK_BESIDE_FORWARD_BLOCKS; none for None."""
        if ready is None:
            return {}
        # where ranks share a GPU every spinning grid is held to their share (spin_blocks), and a reader that waits
        # for words is one: four such readers of 256 blocks left a 2 x 2 run on one H200 no room for the forwards
        # that release them (session 46)
        blocks = self.unpack_beside_forward_blocks
        if self._cx.spin_blocks:
            blocks = min(blocks, self._cx.spin_blocks)
        return dict(ready_words=ready[0], ready_epoch=ready[1], ready_timeout_secs=self.gpu_timeout,
                    ready_blocks=blocks, err=self._cx.error_word_ptr,
                    stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation, rank=self.rank,
                    phase=self._phases["dispatch_forward"])
