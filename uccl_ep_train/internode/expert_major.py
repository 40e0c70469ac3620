"""Expert-major receives: the received rows laid out by local expert, padded to the alignment, as Megatron's grouped
GEMM takes them (docs/internode.md, "Expert-major rows")."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from uccl_ep_train.internode.plan import InternodeError, RecordLayout
from uccl_ep_train.internode.columns import _address, _row_bytes
from uccl_ep_train.internode.handle import InternodeHandle
from uccl_ep_train.internode.call_state import ExpertMajorRows


def reads_expert_major_rows(mode: str, spin_blocks: int, starts_with_hop: bool) -> bool:
    """Whether an expert-major dispatch's reader writes the expert-major rows itself (UCCL_EP_EXPERT_MAJOR_IN_READER:
    auto, always, never). auto: always where the gated readers may take the whole GPU. Where ranks share one they are
    held to ``spin_blocks`` blocks, which copy slower than the full grid of the copy after the hop, so there only a
    reader that ``starts_with_hop`` does: a cached dispatch's, launched as its pack-and-push launch ends, and an
    uncached one's launched before the count read. Such a reader returned ~150-300 us (cached) and ~300-600 us
    (uncached) sooner than the copy after the hop. An uncached reader launched after the host read the counts and
    planned the receive starts, under MPS, only as the hop's last chunk lands; left to copy everything then, it
    returned ~200-400 us later than the copy (sessions 29-32, one H100 under MPS: docs/internode.md, "Expert-major
    rows in the reader")."""
    return mode == "always" or (mode == "auto" and (starts_with_hop or not spin_blocks))


class ExpertMajorReceive:
    """Plans and copies expert-major receives. A part of NativeInternodeBackend (backend.py), which composes these
    parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    def _expert_major_rows(self, nrecv: int, topk: int, raw: List[int], aligned: List[int], worst: int,
                           like: List[torch.Tensor], places_from: Optional[Tuple[int, int, int]] = None
                           ) -> ExpertMajorRows:
        """An expert-major receive's plan and payload outputs for these sizes (``raw``: received tokens per local
        expert; ``aligned``: padded to the alignment; ``like``: the payload columns), and the plan's sizes on the
        device; raises when the rows exceed num_worst_tokens (``worst``). ``places_from`` (the count rows on the
        device, their row words and the alignment): the reader's places and the plan's sizes are made there from
        notify's count rows, one launch (expert_major_places), instead of two uploads of the host's copy."""
        rows = sum(aligned)
        if worst:
            if rows > worst:
                raise InternodeError(f"rank {self.rank}: expert-major receive needs {rows} rows but num_worst_tokens="
                                     f"{worst}; raise num_worst_tokens")
            rows = worst
        em = self._expert_major_outputs(nrecv, topk, len(raw), rows, like, on_device=places_from is not None)
        if places_from is not None:
            count_rows, row_words, alignment = places_from
            self._k.expert_major_places(count_rows, row_words, self.R, self.N, self.rank, len(raw), alignment,
                                        em.places.data_ptr(), em.info.data_ptr(), self._stream())
            self.expert_major_places_on_device += 1
        else:
            em.info = self._upload([nrecv, 0] + [int(c) for c in raw], np.int32)  # the plan's sizes: recv_info's
        return em

    def _expert_major_outputs(self, nrecv: int, topk: int, L: int, rows: int, like: List[torch.Tensor],
                              on_device: bool) -> ExpertMajorRows:
        """An expert-major receive's outputs, uninitialised: ``rows`` expert-major rows (plan columns, and payload
        shaped as ``like``), slot_of for ``nrecv`` received rows and, where the device makes them (``on_device``;
        else the caller uploads them), the plan's sizes and the reader's places."""
        dev = self.device
        token, slot, expert = (torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(3))
        made = lambda n, dtype: torch.empty(n, dtype=dtype, device=dev) if on_device else None  # noqa: E731
        return ExpertMajorRows(rows, made(L + 2, torch.int32), token, slot, expert,
                               torch.empty(rows, dtype=torch.float32, device=dev),
                               torch.empty((nrecv, topk), dtype=torch.int32, device=dev),
                               [self._empty_rows(t, rows) for t in like],
                               made(self.R + 1 + 2 * self.R * L, torch.int64))

    def _expert_major_plan(self, h: InternodeHandle, recv_topk_idx: torch.Tensor, recv_w: torch.Tensor,
                           em: ExpertMajorRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """Where each (received token, local expert) pair goes in the expert-major rows -- experts in order, each
        segment padded to the alignment, tokens in receive order within it -- made on the device by the plan kernel
        (csrc/kernels/expert_major.hpp) into ``em`` and onto the handle; returns the rows' local experts and weights
        (-1 and 0 on padding). The sizes come from the host-side counts, so nothing here reads the device."""
        self._k.expert_major_layout(recv_topk_idx.data_ptr(), recv_w.data_ptr(), em.info.data_ptr(),
                                    h.num_recv_tokens, em.rows, em.info.numel() - 2, h.expert_alignment, h.num_topk,
                                    em.token.data_ptr(), em.slot.data_ptr(), em.expert.data_ptr(),
                                    em.weights.data_ptr(), em.slot_of.data_ptr(),
                                    # blocks clearing the rows after the last segment: only num_worst_tokens has any
                                    self._expert_major_grid("copy") if h.num_worst_tokens else 1, self._stream())
        return self._adopt_expert_major(h, em)

    @staticmethod
    def _adopt_expert_major(h: InternodeHandle, em: ExpertMajorRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """The plan in ``em`` onto the handle (its combine and cached dispatches use it); returns the rows' local
        experts and weights (-1 and 0 on padding)."""
        h.expert_major_token, h.expert_major_slot, h.slot_of = em.token, em.slot, em.slot_of
        h.expert_major_info = em.info
        h.num_recv_rows = em.rows
        return em.expert, em.weights

    def _pair_ranks(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The records' column for an expert-major receive made by the reader: per (token, slot) naming expert e,
        how many (token, slot) pairs before it name e (int32, -1 on dropped slots; docs/internode.md, "Expert-major
        rows in the reader": three short launches over chunks of pairs, one for more than 1024 experts)."""
        T, K = topk_idx.shape
        ranks = torch.empty((T, K), dtype=torch.int32, device=self.device)
        # the chunked launches' counts (0 bytes: the one-launch kernel). From the caching allocator on the stream the
        # launches use, so freeing it when this returns is stream-ordered behind them
        nbytes = self._k.expert_major_pair_ranks_workspace_bytes(T, K, num_experts)
        work = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if nbytes else None
        self._k.expert_major_pair_ranks(topk_idx.data_ptr(), T, K, num_experts, ranks.data_ptr(), self._stream(),
                                        workspace=_address(work), workspace_bytes=nbytes)
        return ranks

    def _expert_major_pad(self, info: torch.Tensor, alignment: int, rows: int, out: List[torch.Tensor],
                          em: Optional[ExpertMajorRows] = None, go: int = 0, stream: Optional[int] = None) -> None:
        """The expert-major rows no pair fills (segment padding, the tail up to ``rows``) zeroed in ``out``, and
        with ``em`` marked empty in its plan; one launch, before the reader, which writes only the other rows.
        ``go``: the device words of a reader launched before the count read (nothing done when they say no);
        ``stream``: the reader's (default: ours)."""
        self._k.expert_major_pad(info.data_ptr(), info.numel() - 2, alignment, rows, _row_bytes(out[0]),
                                 out[1][0].numel() if len(out) > 1 else 0, out[0].data_ptr(),
                                 _address(out[1]) if len(out) > 1 else 0, _address(em and em.token),
                                 _address(em and em.slot), _address(em and em.expert), _address(em and em.weights),
                                 self._expert_major_grid("copy"),
                                 self._stream() if stream is None else stream, go=go)

    def _expert_major_read(self, final: torch.Tensor, layout: RecordLayout, out: List[torch.Tensor], rows: int,
                           topk: int, slot_of: torch.Tensor, em: Optional[ExpertMajorRows] = None,
                           experts_per_rank: int = 0, src_idx: Optional[torch.Tensor] = None,
                           arrival: Optional[torch.Tensor] = None, pending: Any = None,
                           while_reading: Optional[Callable[[], None]] = None) -> None:
        """The final rows' payload straight into the expert-major rows ``out`` (``rows`` of them), one launch
        (expert_major_receive kernel). With ``em`` (uncached) each pair's row comes from its record (global id, pair
        rank) and ``em.places``, and the reader writes ``em``'s plan and ``slot_of``; without, from ``slot_of``
        (the handle's). src_idx, arrival, ``pending`` and ``while_reading`` as _unpack's."""
        self._expert_major_receive(final, layout, out, rows, topk, slot_of, em, experts_per_rank, src_idx, arrival,
                                   gate=pending.gate if pending else None,
                                   first_row=pending.first_row if pending else 0,
                                   own=pending.own if pending else None)
        self._while_reader(pending, while_reading)

    def _expert_major_receive(self, final: torch.Tensor, layout: RecordLayout, out: List[torch.Tensor], rows: int,
                              topk: int, slot_of: torch.Tensor, em: Optional[ExpertMajorRows], experts_per_rank: int,
                              src_idx: Optional[torch.Tensor], arrival: Optional[torch.Tensor], gate: Any = None,
                              first_row: int = 0, own: Optional[tuple] = None, dims: int = 0,
                              counted: bool = True, stream: Optional[int] = None,
                              ready: Optional[Tuple[int, int]] = None) -> None:
        """The expert_major_receive launch of _expert_major_read; ``dims``: read before the counts (the rows, first
        row and our own rows' place from those device words, ``own`` then giving only the tokens and columns), where
        the caller counts the receive once it knows that the reader reads (``counted`` False); ``stream`` and
        ``ready`` (beside the forward) as _unpack_launch's."""
        n = final.size(0)
        if counted:
            self.expert_major_reads["uncached" if em is not None else "cached"] += 1
        ids = len(out)  # the top-k ids' column, then the weights and the pair ranks
        scales = len(out) > 1
        places = em.places.data_ptr() if em is not None else 0
        self._k.expert_major_receive(
            final.data_ptr(), final.stride(0) * final.element_size(), n, layout.column_offsets[0],
            layout.column_bytes[0], layout.column_offsets[1] if scales else 0, out[1][0].numel() if scales else 0,
            out[0].data_ptr(), out[1].data_ptr() if scales else 0, rows, topk, em is None, slot_of.data_ptr(),
            layout.column_offsets[ids] if em else -1, layout.column_offsets[ids + 1] if em else -1,
            layout.column_offsets[ids + 2] if em else -1, self.rank * experts_per_rank, experts_per_rank, self.R,
            places, places + 8 * (self.R + 1) if em else 0, _address(em and em.token), _address(em and em.slot),
            _address(em and em.expert), _address(em and em.weights), layout.src_idx_offset, _address(src_idx),
            layout.arrival_offset if self.G > 1 else -1, _address(arrival),
            self._stream() if stream is None else stream,
            gate=gate, first_row=first_row, own=own, dims=dims, **self._ready_args(ready))

    def _expert_major_copy(self, h: InternodeHandle, sources: List[Tuple[int, int]], like: List[torch.Tensor],
                           out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """The payload columns (``sources``: each column's first row address and row stride in bytes, rank-major)
        in the handle's expert-major rows, into ``out`` (allocated here when None) shaped and typed as ``like`` (x,
        then the scales if any): one launch."""
        rows = h.num_recv_rows
        if out is None:
            out = [self._empty_rows(t, rows) for t in like]
        (x_at, x_stride), x_bytes = sources[0], _row_bytes(like[0])
        s_at, s_stride = sources[1] if len(like) > 1 else (0, 0)
        num_scales = like[1][0].numel() if len(like) > 1 else 0
        self._k.expert_major_copy(x_at, x_stride, s_at, s_stride, h.expert_major_info.data_ptr(), h.num_recv_tokens,
                                  rows, x_bytes, num_scales, h.num_topk, h.slot_of.data_ptr(),
                                  h.expert_major_token.data_ptr(), out[0].data_ptr(),
                                  out[1].data_ptr() if len(out) > 1 else 0, self._expert_major_grid("copy"),
                                  self._stream())
        return out

    def _expert_major_grid(self, kernel: str) -> int:
        """Blocks of an expert-major kernel that fill the GPU (asked once per kernel: the occupancy API)."""
        grid = self._em_grids.get(kernel)
        if grid is None:
            grid = self._em_grids[kernel] = self._k.expert_major_grid(kernel)
        return grid
