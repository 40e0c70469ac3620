"""NativeIntranodeBackend: dispatch/combine between the GPUs of one node over IPC-mapped buffers (NVLink / xGMI).

Each rank allocates one buffer (``num_nvl_bytes`` of data after a small control region), exchanges its IPC handle
through ``torch.distributed.all_gather_object`` and maps every peer's. The kernels (csrc/kernels/intranode.cu) place
every token directly in its final row of the receiver's area; see docs/intranode.md for the protocol and the
trade-offs. Every call runs on the current CUDA stream (``Buffer`` makes its communication stream current).

The native module is torch-free: this file passes ``tensor.data_ptr()`` and the stream handle as integers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from uccl_ep_train import native
from uccl_ep_train.backends import BackendContext, DispatchArgs, DispatchResult, check_combine_element_size


def nvl_bytes_needed(num_max_tokens_per_rank: int, num_ranks: int, hidden: int, num_topk: int,
                     element_size: int = 2, num_worst_rows: int = 0, combine_element_size: int = 2) -> int:
    """num_nvl_bytes that lets any routing of up to ``num_max_tokens_per_rank`` tokens per rank go through.

    Direct placement sizes for the worst case, every token of every rank landing on one rank: the dispatch receive
    area (payload, FP8 scales, top-k ids and weights, source index per row) and the combine area share the buffer,
    so the larger of the two is needed. Combine copies cross the link in x's dtype: ``combine_element_size`` 2 for
    BF16 (the default since session 49; it was sized as float32 before, twice the combine area a BF16 step uses), 4
    for float32. ``num_worst_rows``: the sync-free row count a caller passes as num_worst_tokens, when it exceeds
    tokens x ranks (expert-major rows: one per token and selected local expert).
    """
    check_combine_element_size(combine_element_size)
    rows = max(num_max_tokens_per_rank * num_ranks, num_worst_rows)
    num_scales = (hidden + 127) // 128
    dispatch = rows * (hidden * element_size + 4 * num_scales + 12 * num_topk + 4) + 5 * 16
    combine = rows * (combine_element_size * hidden + 4 * num_topk) + 2 * 16  # (combine_bytes_needed's sum)
    return max(dispatch, combine)


# Below this many payload bytes a dispatch's receive copies rows with its kernel rather than the copy engine: the
# copy engine's fork, copies and join cost more host time than a small copy takes (on H200, bench dispatch at 128 to
# 1024 tokens), and with the whole GPU the kernel copies as fast as the engine.
COPY_ENGINE_MIN_BYTES = 8 << 20


class IntranodeError(RuntimeError):
    """A kernel reported a failure (timeout or a buffer too small); the message names rank, block and counters."""


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _stream(device: Optional[torch.device] = None) -> int:
    return native.stream_handle(device)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class IntranodeHandle:
    """What a dispatch leaves for cached dispatch and combine (the attributes ``Buffer`` reads come first)."""

    num_tokens: int
    num_recv_rows: int
    num_topk: int
    num_ranks: int
    expert_major: bool
    is_token_in_rank: torch.Tensor          # [T, R] bool
    num_recv_tokens_per_expert: torch.Tensor  # [L] int32, aligned
    rank_prefix_matrix: torch.Tensor        # [R, R] int32: inclusive prefix over sources of tokens per destination
    send_pos: torch.Tensor                  # [T, R] int32: row among this rank's tokens at each destination, -1
    recv_info: torch.Tensor                 # [2 + L] int32: num_recv, overflow (0), raw per-expert counts
    recv_src_idx: torch.Tensor              # [rank-major rows] int32: source token index of each received row
    num_rank_major_rows: int                # rows of the rank-major receive (padding included in sync-free mode)
    expert_alignment: int = 1
    # rows received from each source rank, on the host (normal and cached modes; None in sync-free mode, where the
    # counts never leave the device): the block sizes of the copy-engine combine
    rows_from: Optional[List[int]] = None
    # expert-major only
    expert_major_token: Optional[torch.Tensor] = None  # [num_recv_rows] int64
    expert_major_slot: Optional[torch.Tensor] = None   # [num_recv_rows] int64
    slot_of: Optional[torch.Tensor] = None             # [rank-major rows, K] int32: expert-major row of (row, k)
    extra: dict = field(default_factory=dict)


class NativeIntranodeBackend:
    """The ``Backend`` of uccl_ep_train.backends for one node, built on ``_C.kernels``."""

    name = "native-intranode"

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.num_ranks = ctx.num_ranks
        self.group = ctx.group
        # (a non-CUDA device: the CPU stand-in of the native module in tests, device index None)
        self.device = ctx.device if ctx.device.index is not None or ctx.device.type != "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        kernel_settings = ctx.settings.kernel
        self.num_sms = int(kernel_settings.num_sms)
        self.local_sms = int(kernel_settings.local_sms)  # 0: the whole GPU for the kernels that touch only our memory
        self.timeout_secs = float(kernel_settings.gpu_timeout_secs)
        self.combine_copy_engine = bool(kernel_settings.combine_copy_engine)
        self.dispatch_copy_engine = bool(kernel_settings.dispatch_copy_engine)
        self.copy_chunk_bytes = int(kernel_settings.copy_chunk_bytes)
        self.copy_streams = int(kernel_settings.copy_streams)
        self._k = native.module().kernels
        if self.num_ranks > self._k.max_ranks:
            raise ValueError(f"the intranode backend supports at most {self._k.max_ranks} ranks, got {self.num_ranks}")
        self.data_bytes = int(ctx.num_nvl_bytes)
        if self.data_bytes <= 0:
            raise ValueError("num_nvl_bytes must be > 0 for the native intranode backend "
                             "(size it with Buffer's Config hints, e.g. Config.get_nvl_buffer_size_hint)")
        self._cx = self._k.IntranodeContext(self.rank, self.num_ranks, self.data_bytes, self.device.index,
                                            self.timeout_secs)
        handles: List[Any] = [None] * self.num_ranks
        if self.num_ranks > 1:
            dist.all_gather_object(handles, self._cx.ipc_handle(), group=self.group)
        else:
            handles = [self._cx.ipc_handle()]
        self._cx.open_peers([bytes(h) for h in handles])
        self._destroyed = False

    # ---------------------------------------------------------------- helpers
    def _check_error(self) -> None:
        msg = self._cx.error_message()
        if msg:
            self._cx.clear_error()
            if "overflow" not in msg:  # a wait that ran past its deadline: say what to inspect next
                from uccl_ep_train.doctor import TIMEOUT_HINT

                msg = f"{msg}\n{TIMEOUT_HINT}"
            raise IntranodeError(msg)

    def _num_sms(self, config: Any) -> int:
        n = getattr(config, "num_sms", None) if config is not None else None
        return int(n) if n else self.num_sms

    def dispatch_bytes_needed(self, rows: int, hidden_bytes: int, num_scales: int, topk: int) -> int:
        """Smallest num_nvl_bytes whose receive area holds ``rows`` rows of this shape."""
        per_row = hidden_bytes + 4 * num_scales + 12 * topk + 4
        return rows * per_row + 5 * 16

    def combine_bytes_needed(self, num_tokens: int, hidden: int, topk: int) -> int:
        return num_tokens * self.num_ranks * (2 * hidden + 4 * topk) + 2 * 16

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        self._check_error()
        idx = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)
        idx = idx.contiguous()
        T, K = idx.shape
        R = self.num_ranks
        dev = idx.device
        per_rank = torch.empty(R, dtype=torch.int32, device=dev)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        in_rank = torch.empty((T, R), dtype=torch.bool, device=dev)
        rpn = self.ctx.ranks_per_node
        num_nodes = self.ctx.num_nodes
        per_node = torch.empty(num_nodes, dtype=torch.int32, device=dev) if num_nodes > 1 else None
        self._k.dispatch_layout(idx.data_ptr(), T, K, num_experts, R, rpn, per_rank.data_ptr(), _ptr(per_node),
                                per_expert.data_ptr(), in_rank.data_ptr(), _stream(self.device))
        return per_rank, per_node, per_expert, in_rank

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        self._check_error()
        x = args.x.contiguous()
        scales = args.x_scales.contiguous() if args.x_scales is not None else None
        if scales is not None and scales.dtype != torch.float32:
            scales = scales.float()
        T, H = x.shape
        hidden_bytes = H * x.element_size()
        if hidden_bytes % 16:
            raise ValueError(f"hidden size {H} of {x.dtype} is not a multiple of 16 bytes; pad it")
        num_scales = scales.shape[1] if scales is not None else 0
        R = self.num_ranks
        num_sms = self._num_sms(args.config)
        stream = _stream(self.device)
        dev = x.device
        h: Optional[IntranodeHandle] = args.handle
        cached = h is not None
        if cached:
            K = h.num_topk
        else:
            K = args.topk_idx.shape[1] if args.topk_idx is not None else 0
        cap = self._k.dispatch_rows_capacity(self.data_bytes, hidden_bytes, num_scales, K)
        worst = int(args.num_worst_tokens or 0) if not cached else int(h.extra["worst"])
        if worst > cap:
            raise ValueError(
                f"num_nvl_bytes={self.data_bytes} holds {cap} received rows of hidden {H} ({x.dtype}); "
                f"num_worst_tokens={worst} needs num_nvl_bytes >= "
                f"{self.dispatch_bytes_needed(worst, hidden_bytes, num_scales, K)}")

        topk_idx = topk_weights = None
        send_early = False

        def send(own_rows: int, self_x: Optional[torch.Tensor] = None, self_scales: Optional[torch.Tensor] = None,
                 self_rows: int = 0) -> None:
            self._cx.dispatch_send(x.data_ptr(), _ptr(scales), _ptr(topk_idx), _ptr(topk_weights),
                                   send_pos.data_ptr(), rank_prefix.data_ptr(), recv_info.data_ptr(), T, hidden_bytes,
                                   num_scales, K, num_experts, cap, own_rows, _ptr(self_x), _ptr(self_scales),
                                   self_rows, num_sms, stream)

        if cached:
            if h.num_tokens != T:
                raise ValueError(f"cached dispatch: x has {T} rows but the handle was made for {h.num_tokens}")
            rank_prefix, send_pos, recv_info = h.rank_prefix_matrix, h.send_pos, h.recv_info
            out_rows = h.num_rank_major_rows
            num_experts = h.extra["num_experts"]
            self._cx.barrier(stream)  # peers must be done reading their receive areas
        else:
            if args.topk_idx is not None:
                topk_idx = args.topk_idx if args.topk_idx.dtype == torch.int64 else args.topk_idx.to(torch.int64)
                topk_idx = topk_idx.contiguous()
                if args.topk_weights is not None:
                    topk_weights = args.topk_weights.to(torch.float32).contiguous()
            if args.num_tokens_per_expert is not None:
                per_expert = args.num_tokens_per_expert.to(torch.int32).contiguous()
            else:
                per_expert = torch.zeros(R, dtype=torch.int32, device=dev)
            num_experts = per_expert.numel()
            L = num_experts // R
            if num_experts > self._k.max_experts_in_control():
                raise ValueError(f"{num_experts} experts exceed the control region of the intranode buffer")
            in_rank = args.is_token_in_rank.contiguous()
            per_rank = (args.num_tokens_per_rank.to(torch.int32).contiguous() if args.num_tokens_per_rank is not None
                        else in_rank.sum(0, dtype=torch.int32))
            # Normal expert-major keeps every row in the receive area anyway, so its send needs nothing the host
            # sizes and goes right behind notify. Rank-major waits and stores its own rows straight into the output:
            # sending early into the area and copying all rows out after cost more than the host wait it hid
            # (docs/intranode.md, "Receive").
            send_early = worst == 0 and bool(args.expert_major)
            rank_prefix = torch.empty((R, R), dtype=torch.int32, device=dev)
            recv_info = torch.empty(2 + L, dtype=torch.int32, device=dev)
            send_pos = torch.empty((T, R), dtype=torch.int32, device=dev)
            if worst == 0:
                self._cx.reset_host_counts()
            self._cx.notify(per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(), T, num_experts, cap,
                            rank_prefix.data_ptr(), recv_info.data_ptr(), send_pos.data_ptr(), stream)
            per_expert_recv = rows_from = None
            if send_early:
                # The send goes behind notify, before the host has the counts: the GPU sends while the host waits
                # and sizes the outputs. The own rows wait in the receive area. The send skips when notify found an
                # area too small (on every rank) or timed out (on this rank, which then raises).
                own_rows = self._k.own_in_area
                send(own_rows)
            if worst == 0:
                try:
                    counts = self._cx.wait_host_counts(L)
                except RuntimeError as exc:
                    self._cx.clear_error()
                    raise IntranodeError(str(exc)) from None
                num_recv, overflow = counts[0], counts[1]
                per_expert_recv, rows_from = counts[2:2 + L], list(counts[2 + L:2 + L + R])
                if overflow > 0:
                    self._cx.clear_error()  # the kernel's overflow record; reported here instead
                    raise ValueError(
                        f"num_nvl_bytes={self.data_bytes} holds {cap} received rows of hidden {H} ({x.dtype}) but a "
                        f"rank receives {overflow}: use num_nvl_bytes >= "
                        f"{self.dispatch_bytes_needed(overflow, hidden_bytes, num_scales, K)}")
                # The notify kernel publishes its counts even when its barrier ran past the deadline (it records the
                # error word first): counts from such a call are stale, so fail this dispatch, not the next one.
                self._check_error()
                out_rows = num_recv
            else:
                out_rows = worst

        expert_major = h.expert_major if cached else bool(args.expert_major)
        # Expert-major reads the payload straight from the receive area: only metadata is copied out rank-major.
        recv_x = None if expert_major else torch.empty((out_rows, H), dtype=x.dtype, device=dev)
        recv_scales = (torch.empty((out_rows, num_scales), dtype=torch.float32, device=dev)
                       if scales is not None and not expert_major else None)
        if not send_early:
            # The output exists before the send (cached, sync-free, and normal rank-major, whose send waited for
            # the host to size it): rank-major own rows go straight into it (self-direct); expert-major reads them
            # from the receive area like every other row. (Launched before the metadata outputs are made: in normal
            # mode the GPU idles from notify's end until this launch.)
            own_rows = self._k.own_in_area if recv_x is None else self._k.own_in_output
            send(own_rows, recv_x, recv_scales, out_rows)
        recv_topk_idx = recv_topk_weights = recv_src_idx = None
        if not cached:
            if K > 0:
                recv_topk_idx = torch.empty((out_rows, K), dtype=torch.int64, device=dev)
                if topk_weights is not None:
                    recv_topk_weights = torch.empty((out_rows, K), dtype=torch.float32, device=dev)
            recv_src_idx = torch.empty(out_rows, dtype=torch.int32, device=dev)
        self._cx.barrier(stream)
        self._cx.dispatch_recv(_ptr(recv_x), _ptr(recv_scales), _ptr(recv_topk_idx), _ptr(recv_topk_weights),
                               _ptr(recv_src_idx), recv_info.data_ptr(), rank_prefix.data_ptr(), own_rows,
                               self._copy_engine_rows(recv_x, rows_from if not cached else h.rows_from, hidden_bytes,
                                                      scaled=recv_scales is not None),
                               out_rows, hidden_bytes, num_scales, K, cap, self.local_sms, stream)

        if cached:
            if h.expert_major:
                shape_x = torch.empty((0, H), dtype=x.dtype, device=dev)
                em_x, em_scales, _, _ = self._expert_major_rows(
                    h, shape_x, scales, h.extra["rank_major_topk_idx"], None, False, stream, update_handle=False,
                    cap=cap, hidden_bytes=hidden_bytes, num_scales=num_scales)
                return DispatchResult(em_x, em_scales, None, None, None, h)
            return DispatchResult(recv_x, recv_scales, None, None, None, h)

        align = max(1, int(args.expert_alignment or 1))
        aligned = ((recv_info[2:] + (align - 1)) // align * align).to(torch.int32)
        handle = IntranodeHandle(
            num_tokens=T, num_recv_rows=out_rows, num_topk=K, num_ranks=R, expert_major=expert_major,
            is_token_in_rank=in_rank, num_recv_tokens_per_expert=aligned, rank_prefix_matrix=rank_prefix,
            send_pos=send_pos, recv_info=recv_info, recv_src_idx=recv_src_idx, num_rank_major_rows=out_rows,
            expert_alignment=align, rows_from=rows_from, extra={"num_experts": num_experts, "worst": worst})
        if worst:
            per_expert_list: Optional[List[int]] = []
        else:
            per_expert_list = [_align(int(c), align) for c in per_expert_recv]
        if expert_major:
            if recv_topk_idx is None:
                raise ValueError("expert_major=True needs topk_idx")
            handle.num_recv_rows = worst if worst else sum(per_expert_list)
            handle.extra["rank_major_topk_idx"] = recv_topk_idx
            em_x, em_scales, em_expert, em_weights = self._expert_major_rows(
                handle, torch.empty((0, H), dtype=x.dtype, device=dev), scales, recv_topk_idx, recv_topk_weights,
                recv_topk_weights is not None, stream, update_handle=True, cap=cap, hidden_bytes=hidden_bytes,
                num_scales=num_scales)
            return DispatchResult(em_x, em_scales, em_expert, em_weights, per_expert_list, handle)
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle)

    def _copy_engine_rows(self, recv_x: Optional[torch.Tensor], rows_from: Optional[List[int]], hidden_bytes: int,
                          scaled: bool = False) -> List[int]:
        """dispatch_recv's rows_from: the rows per source when the copy engine should move the peers' payload out of
        the receive area (rank-major, whose own rows the send stored in the output; host-known counts; enough bytes;
        no FP8 scales), else [] (the receive kernel copies it). FP8 has half the bytes and needs a second copy per
        block for its scales, each costing ~5 us of idle engine: measured 20 us slower through the copy engine on 24
        SMs (docs/intranode.md)."""
        if not self.dispatch_copy_engine or recv_x is None or not rows_from or scaled:
            return []
        from_peers = sum(rows_from) - rows_from[self.rank]
        return rows_from if from_peers * hidden_bytes >= COPY_ENGINE_MIN_BYTES else []

    # ---------------------------------------------------------------- expert-major receive
    def _expert_major_rows(self, h: IntranodeHandle, recv_x: torch.Tensor, recv_scales, recv_topk_idx,
                           recv_topk_weights, want_weights: bool, stream: int, *, update_handle: bool, cap: int,
                           hidden_bytes: int, num_scales: int):
        """Expand the rank-major receive (read straight from the receive area) into reference.py's expert-major
        layout; fills the handle's expert-major fields. Returns (x, scales, expert of each row, weight of each row)."""
        dev = recv_topk_idx.device
        L = h.num_recv_tokens_per_expert.numel()
        rows = h.num_recv_rows
        H = recv_x.shape[1]
        x_off, s_off = self._k.dispatch_area_offsets(cap, hidden_bytes, num_scales, h.num_topk)
        base = self._cx.buffer_ptr
        out_x = torch.empty((rows, H), dtype=recv_x.dtype, device=dev)
        out_scales = (torch.empty((rows, num_scales), dtype=torch.float32, device=dev)
                      if recv_scales is not None else None)
        em_token = torch.empty(rows, dtype=torch.int64, device=dev)
        em_slot = torch.empty(rows, dtype=torch.int64, device=dev)
        em_expert = torch.empty(rows, dtype=torch.int64, device=dev)
        em_weights = torch.empty(rows, dtype=torch.float32, device=dev) if want_weights else None
        slot_of = torch.empty((h.num_rank_major_rows, h.num_topk), dtype=torch.int32, device=dev)
        self._cx.expert_major(base + x_off, (base + s_off) if recv_scales is not None else 0, recv_topk_idx.data_ptr(),
                              _ptr(recv_topk_weights if want_weights else None), h.recv_info.data_ptr(),
                              h.num_rank_major_rows, rows, L, h.expert_alignment, hidden_bytes, num_scales,
                              h.num_topk, out_x.data_ptr(), _ptr(out_scales), em_token.data_ptr(), em_slot.data_ptr(),
                              em_expert.data_ptr(), _ptr(em_weights), slot_of.data_ptr(), self.local_sms, stream)
        if update_handle:
            h.expert_major_token, h.expert_major_slot, h.slot_of = em_token, em_slot, slot_of
        return out_x, out_scales, em_expert, em_weights

    # ---------------------------------------------------------------- combine
    def _expert_major_partials(self, x: torch.Tensor, h: IntranodeHandle, weights: Optional[torch.Tensor],
                               stream: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Local half of an expert-major combine: one rank-major row per received token, the sum of its local
        experts' rows in top-k slot order in fp32, rounded once to x's dtype; and the rank-major weights [rows, K]
        (0 on slots that are not local). Rows from recv_info[0] on (sync-free padding) are left unwritten; combine_send
        never reads them. A kernel of its own on local_sms SMs (0: the whole GPU), not fused into the communication
        kernel that holds num_sms SMs: it reads every expert-major row and is bound by HBM, not NVLink
        (docs/intranode.md)."""
        if weights is not None and (weights.dim() != 1 or weights.numel() < h.num_recv_rows):
            raise ValueError(f"expert-major combine takes one weight per row ([{h.num_recv_rows}] float32), "
                             f"got {tuple(weights.shape)}")
        rows, H = h.num_rank_major_rows, x.shape[1]
        # torch.empty: the caching allocator (the graph's pool under capture), no host sync, no memset.
        partials = torch.empty((rows, H), dtype=x.dtype, device=x.device)
        rm_weights = (torch.empty((rows, h.num_topk), dtype=torch.float32, device=x.device) if weights is not None
                      else None)
        self._cx.expert_major_partials(x.data_ptr(), _ptr(weights), h.slot_of.data_ptr(), h.recv_info.data_ptr(),
                                       rows, H, x.element_size(), h.num_topk, partials.data_ptr(), _ptr(rm_weights),
                                       self.local_sms, stream)
        return partials, rm_weights

    def combine(self, x: torch.Tensor, handle: IntranodeHandle, topk_weights: Optional[torch.Tensor], config: Any
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self._check_error()
        h = handle
        x = x.contiguous()
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"native combine takes bfloat16 or float32 x, got {x.dtype}")
        rows, H = x.shape
        elem = x.element_size()
        if (H * elem) % 16:
            raise ValueError(f"combine: hidden {H} of {x.dtype} is not a multiple of 16 bytes")
        if h.expert_major and rows < h.num_recv_rows:  # slot_of indexes rows up to num_recv_rows
            raise ValueError(f"expert-major combine: x has {rows} rows, the handle's layout has {h.num_recv_rows}")
        K = h.num_topk
        T = h.num_tokens
        # The combine area counts rows in bf16 units (a float32 row is two). Expert-major rows are summed over their
        # local experts in fp32 and rounded once to x's dtype before they cross the link (docs/intranode.md).
        H_units = H * 2 if elem == 4 else H
        if K > self._k.max_topk:
            raise ValueError(f"native combine takes top-k <= {self._k.max_topk}, got {K}")
        cap = self._k.combine_tokens_capacity(self.data_bytes, self.num_ranks, H_units, K)
        if T > cap:
            raise ValueError(f"num_nvl_bytes={self.data_bytes} holds the combine copies of {cap} tokens of hidden {H}; "
                             f"{T} tokens need num_nvl_bytes >= {self.combine_bytes_needed(T, H_units, K)}")
        num_sms = self._num_sms(config)
        stream = _stream(self.device)
        weights = topk_weights.to(torch.float32).contiguous() if topk_weights is not None else None
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
        out_w = torch.empty((T, K), dtype=torch.float32, device=x.device) if weights is not None else None
        if h.expert_major:
            # Two launches on this stream: the local reduction to rank-major partials (whole GPU), then the ordinary
            # rank-major send of those. The local one goes before the barrier: it touches no shared buffer.
            x, weights = self._expert_major_partials(x, h, weights, stream)
            rows = h.num_rank_major_rows
        if self.combine_copy_engine and h.rows_from is not None:
            # The copies read whole source blocks of x (and of the weights): too few rows would read past them.
            need = sum(h.rows_from)
            short = [f"{name} has {n} rows" for name, n in (("x", rows), ("topk_weights",
                     weights.shape[0] if weights is not None else need)) if n < need]
            if short:
                raise ValueError(f"combine: {' and '.join(short)}; the handle's dispatch received {need}")
            self._cx.combine_copy_engine(x.data_ptr(), _ptr(weights), h.rows_from, h.is_token_in_rank.data_ptr(),
                                         h.send_pos.data_ptr(), T, H, elem, K, out.data_ptr(), _ptr(out_w), cap,
                                         self.copy_chunk_bytes, self.copy_streams, self.local_sms, stream)
            return out, out_w
        self._cx.barrier(stream)  # peers must be done reading their combine areas
        self._cx.combine_send(x.data_ptr(), _ptr(weights), h.recv_src_idx.data_ptr(), h.rank_prefix_matrix.data_ptr(),
                              h.recv_info.data_ptr(), rows, H, elem, K, cap, num_sms, stream)
        self._cx.barrier(stream)
        self._cx.combine_reduce(h.is_token_in_rank.data_ptr(), T, H, elem, K, out.data_ptr(), _ptr(out_w), cap,
                                self.local_sms, stream)
        return out, out_w

    # ---------------------------------------------------------------- teardown
    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if self.device.type == "cuda":  # the CPU stand-in is synchronous
            torch.cuda.synchronize(self.device)
        if self.num_ranks > 1 and dist.is_initialized():
            # No peer may still write into our buffer, nor we into theirs, when the mappings go away.
            dist.barrier(group=self.group)
        self._cx.destroy()
        if self.num_ranks > 1 and dist.is_initialized():
            dist.barrier(group=self.group)

    def __del__(self) -> None:  # best effort: the owner should call destroy()
        try:
            if not self._destroyed:
                self._cx.destroy()
        except Exception:
            pass
