"""The dispatch forward over NVLink (several GPUs per node): a forwarder copies each arrival to every local GPU that
needs it, as it lands or after the hop, and the node barrier that ends it (docs/internode.md, "Gated forward",
"The dispatch forward's node barrier")."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import numpy as np
import torch

from uccl_ep_train.internode.plan import InternodeError, RecordLayout, Counts, num_recv_rows


class NvlinkForward:
    """Forwards arrivals to the node's GPUs and ends the forward. A part of NativeInternodeBackend (backend.py), which
    composes these parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    def _scatter(self, dst: int, dst_stride: int, dst_idx: int, src: int, src_stride: int, src_idx: int, n: int,
                 row_bytes: int, dst_rows: int, phase: str) -> None:
        """scatter_rows on this rank's stream into our own area (the combine's own-node gather; the other GPUs' rows
        go through _forward_rows), with its range check, error word and stop flag (a failed rank forwards nothing)."""
        self._k.scatter_rows(dst, dst_stride, dst_idx, src, src_stride, src_idx, n, row_bytes, self._stream(),
                             dst_rows=dst_rows, err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                             stop_generation=self._cx.stop_generation, rank=self.rank, phase=self._phases[phase],
                             target=self.local)

    def _forward_rows(self, bases: torch.Tensor, bases_or: int, dst_stride: int, index: torch.Tensor, src: int,
                      src_stride: int, n: int, row_bytes: int, limits: torch.Tensor, phase: str) -> None:
        """forward_rows on this rank's stream (rows [0, n) at ``src`` to the local GPUs at ``bases`` that ``index``
        [n, G] names, within ``limits``), with its range check, error word and stop flag as _scatter's."""
        self._k.forward_rows(bases.data_ptr(), bases_or, dst_stride, index.data_ptr(), self.G, src, src_stride, n,
                             row_bytes, limits.data_ptr(), self._stream(), err=self._cx.error_word_ptr,
                             stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation,
                             rank=self.rank, phase=self._phases[phase])

    def _forward_arrivals(self, counts: Counts, shape: Any, layout: RecordLayout, A: int, recv_base: int,
                          first_row: int, gate: Any, ready_epoch: int = 0) -> torch.Tensor:
        """The dispatch forward over NVLink (G > 1): forward_arrivals on this rank's stream, every local GPU that
        needs an arrival getting its final row (one launch, each row read once), gated on ``gate`` (None: the hop is
        in); with ``ready_epoch``, each final row's ready word at its GPU then released to it. Returns the arrivals'
        final rows at each local GPU [A, G] (-1: none), which the kernel writes."""
        G = self.G
        fwd_dest = torch.empty((A, G), dtype=torch.int64, device=self.device)
        if not A:
            return fwd_dest
        if shape.forward_limits is None:
            shape.forward_limits = self._upload([num_recv_rows(counts, self.node * G + j) for j in range(G)])
        self._k.forward_arrivals(self._forward_targets.data_ptr(), self._forward_targets_or, layout.final_bytes, G,
                                 self._cx.rdma_ptr + recv_base, layout.stride, A, layout.final_bytes,
                                 shape.forward_limits.data_ptr(), shape.forward_bases.data_ptr(), self.N,
                                 layout.dest_rows_offset, layout.arrival_offset, fwd_dest.data_ptr(), self._stream(),
                                 gate=gate, first_row=first_row if 0 <= first_row < A else 0,
                                 err=self._cx.error_word_ptr, stop_flag=self._cx.stop_flag_ptr,
                                 stop_generation=self._cx.stop_generation, rank=self.rank,
                                 phase=self._phases["dispatch_forward"],
                                 ready_words=self._ready_targets.data_ptr() if ready_epoch else 0,
                                 ready_rows=self._ready_rows, ready_epoch=ready_epoch)
        return fwd_dest

    def _forward_bases_on_device(self, bases: torch.Tensor, staged: Optional[list] = None) -> torch.Tensor:
        """forward_block_bases' host table on the device. Every layout of a handle shares it (the same tensor, made
        once per Counts), so the last one uploaded is reused: one upload per forward pair, not one per layout (the
        forward dispatch's and the backward's). ``staged``: stage it (UploadStaging.stage) into the list instead of
        queuing its copy; a staged table is not reused, as its copy is queued later."""
        memo = self._forward_bases_memo
        if memo is not None and memo[0] is bases:
            return memo[1]
        if staged is not None:
            staged.append(self._staging.stage(bases.numpy(), np.int64))
            return staged[-1].out
        on_device = self._upload(bases)
        self._forward_bases_memo = (bases, on_device)
        return on_device

    def _close_unpack_beside(self) -> None:
        """The end of a forward whose rows were to be unpacked beside it (after that unpack's launch, or instead of it
        when the dispatch fails first): our stream takes the second stream's work in turn, and the node barrier at the
        forward's epoch orders the area's reuse, so that the node's other GPUs do not wait for our flag."""
        epoch, self._unpack_beside = self._unpack_beside, None
        if epoch is not None:
            self._cx.stream_wait(self._stream(), self._cx.side_stream)
            self._beside_keep = None  # (freed now: everything after it on our stream follows the forward)
            self._forwarded(epoch)

    def _forwarded(self, epoch: Optional[int] = None) -> None:
        """The end of the dispatch forward (several GPUs per node): every forwarder of our node has written its rows
        to our final rows. By default a node barrier over NVLink (docs/internode.md, "The dispatch forward's node
        barrier"): our flag raised in every local GPU's NVL region behind our forward on the stream, then a wait for
        every local GPU's flag in ours; with UCCL_EP_FORWARD_NODE_BARRIER=0 a group barrier through the proxies.
        ``epoch``: the forward's, taken already (its rows' ready words carry it: "The unpack beside the forward")."""
        if not self.forward_node_barrier:
            self._barrier("dispatch forward")
            return
        self._forward_epoch = epoch if epoch is not None else self._next_epoch(self._forward_epoch,
                                                                               "UCCL_EP_FORWARD_NODE_BARRIER")
        self._k.raise_flags(self._forward_flag_targets.data_ptr(), self.G, self._forward_epoch, self._stream(),
                            stop_flag=self._cx.stop_flag_ptr, stop_generation=self._cx.stop_generation)
        self._cx.wait_node_flags(self._cx.nvl_ptr + self._forward_flag_base, self.G, 1, self._forward_epoch,
                                   self._phases["dispatch_forward"], self._stream())
        self.forward_node_barriers += 1
        self._settle("dispatch forward")

    def _next_epoch(self, epoch: int, setting: str) -> int:
        """The epoch after ``epoch`` for a kind of NVLink flags (every rank counts its calls alike), refused before the
        int32 flags would wrap."""
        if epoch + 1 >= 2 ** 31:
            raise InternodeError(f"rank {self.rank}: 2^31 calls raised the int32 NVLink flags of {setting}; they would "
                                 f"wrap ({setting}=0 goes on without them)")
        return epoch + 1

    @contextlib.contextmanager
    def _spin_blocks_held(self, blocks: int):
        """The spinning grids launched inside (pack_and_push's packers, the gated readers: their gates take the cap
        when made) held to ``blocks`` (0: as they are), below any cap already set (ranks sharing a GPU), so that work
        on the second stream that they wait for finds room beside them."""
        cap = self._cx.spin_blocks
        if blocks:
            self._cx.spin_blocks = min(cap, blocks) if cap else blocks
        try:
            yield
        finally:
            self._cx.spin_blocks = cap
