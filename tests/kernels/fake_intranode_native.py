"""A CPU stand-in for ``uccl_ep_train._C.kernels``, so NativeIntranodeBackend's host path runs in CI without a GPU.

What it emulates (csrc/kernels/intranode.cu, layout.cu, csrc/bindings/kernel_bindings.cpp), with the same names,
arguments and return values: an ``IntranodeContext`` per rank whose buffer (the 1 MiB control region, then the data
region) lives in POSIX shared memory (a file under /dev/shm), so the ranks' processes store into each other's buffer
as the kernels do over NVLink; the "IPC handle" is the file's name and ``open_peers`` maps every peer's file.
Every launch is a synchronous function over raw addresses (``tensor.data_ptr()`` as the backend passes them), with
the kernels' data layout: the control region's epoch, barrier flags and count matrices at the kernels' int offsets,
the receive area (``RecvArea``: payload, scales, top-k ids, weights, source index, structure of arrays over ``cap``
rows) and the combine area (``CombineArea``: row (token, from_rank), then weights) at the start of the data region,
rows placed by rank_prefix_matrix + send_pos exactly as dispatch_send_kernel places them (self-direct rows straight
into the output), the sync-free padding of dispatch_recv_kernel, expert_major_kernel's aligned segments, padding
rows and cleared tail, the fp32 sums in slot / rank order rounded once of expert_major_partials / combine_reduce,
the barrier with its deadline and error word (``report``: first failure wins), notify's host counts, overflow and
"num_worst_tokens too small" records, and ``error_message``'s text.

What it does not emulate: streams (stream order = program order: a launch is done when it returns), SMs and grids
(``num_sms`` / ``local_sms`` are ignored), CUDA-graph capture, and memory-ordering hazards between processes (x86
stores are seen in order; each barrier flag is written after the data it publishes).
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
import uuid
from types import SimpleNamespace
from typing import List, Optional

import torch

from tests import fake_expert_major
from tests.shared_memory_files import map_file, sweep_leftovers

max_ranks = 128
max_topk = 32
control_bytes = 1 << 20
own_in_area, own_in_output = 0, 1  # dispatch's own_rows (intranode.hpp, OwnRows)
_EPOCH, _FLAGS = 0, 64  # ints from the buffer start (intranode.cu's control region)
# [max_ranks] int64: end row of the last chunk each peer landed, cleared by the owner after its reduce
_COPY_FLAGS = _FLAGS + max_ranks
_COUNTS = _COPY_FLAGS + 2 * max_ranks
_EXPERT_COUNTS = _COUNTS + max_ranks * max_ranks
_MAX_EXPERT_COUNT_INTS = control_bytes // 4 - _EXPERT_COUNTS
_SHM, _PREFIX = "/dev/shm", "uccl-ep-fake-intranode"
_KINDS = ["", "GPU wait timed out", "receive buffer too small", "num_worst_tokens too small"]


def _at(ptr: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A CPU tensor over raw memory: no copy, no ownership."""
    if nbytes <= 0 or not ptr:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)


def _rows(ptr: int, n: int, row_bytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """[n, row_bytes / itemsize] over raw memory."""
    item = torch.empty(0, dtype=dtype).element_size()
    return _at(ptr, n * row_bytes, dtype).view(n, row_bytes // item)


def _align16(x: int) -> int:
    return (x + 15) & ~15


class RecvArea:
    def __init__(self, cap: int, hidden_bytes: int, num_scales: int, topk: int) -> None:
        self.x = 0
        self.scales = _align16(cap * hidden_bytes)
        self.idx = self.scales + _align16(cap * num_scales * 4)
        self.weights = self.idx + _align16(cap * topk * 8)
        self.src = self.weights + _align16(cap * topk * 4)
        self.end = self.src + _align16(cap * 4)


class CombineArea:
    def __init__(self, cap: int, num_ranks: int, hidden: int, topk: int) -> None:  # hidden in bf16 units
        self.x = 0
        self.weights = _align16(cap * num_ranks * hidden * 2)
        self.end = self.weights + _align16(cap * num_ranks * topk * 4)


# ---------------------------------------------------------------- module functions
def dispatch_rows_capacity(data_bytes: int, hidden_bytes: int, num_scales: int, topk: int) -> int:
    per_row = hidden_bytes + 4 * num_scales + 12 * topk + 4
    cap = (data_bytes - 5 * 16) // per_row
    while cap > 0 and RecvArea(cap, hidden_bytes, num_scales, topk).end > data_bytes:
        cap -= 1
    return max(cap, 0)


def combine_tokens_capacity(data_bytes: int, num_ranks: int, hidden: int, topk: int) -> int:
    per_token = num_ranks * (2 * hidden + 4 * topk)
    cap = (data_bytes - 2 * 16) // per_token
    while cap > 0 and CombineArea(cap, num_ranks, hidden, topk).end > data_bytes:
        cap -= 1
    return max(cap, 0)


def max_experts_in_control() -> int:
    return _MAX_EXPERT_COUNT_INTS


def dispatch_area_offsets(rows_capacity: int, hidden_bytes: int, num_scales: int, topk: int) -> List[int]:
    a = RecvArea(rows_capacity, hidden_bytes, num_scales, topk)
    return [control_bytes + a.x, control_bytes + a.scales]


def dispatch_layout(topk_idx: int, num_tokens: int, topk: int, num_experts: int, num_ranks: int, ranks_per_node: int,
                    num_tokens_per_rank: int, num_tokens_per_node: int, num_tokens_per_expert: int,
                    is_token_in_rank: int, stream: int) -> None:
    """layout_kernel: ids outside [0, num_experts) are skipped; a token counts once per rank / node it visits."""
    if num_ranks <= 0 or num_experts % num_ranks:
        raise ValueError("dispatch_layout: num_experts must be a positive multiple of num_ranks")
    num_nodes = (num_ranks + ranks_per_node - 1) // ranks_per_node if num_tokens_per_node else 0
    per_rank = _at(num_tokens_per_rank, 4 * num_ranks, torch.int32)
    per_expert = _at(num_tokens_per_expert, 4 * num_experts, torch.int32)
    per_rank.zero_()
    per_expert.zero_()
    if num_nodes:
        _at(num_tokens_per_node, 4 * num_nodes, torch.int32).zero_()
    if num_tokens == 0:
        return
    idx = _at(topk_idx, 8 * num_tokens * topk, torch.int64).view(num_tokens, topk)
    valid = (idx >= 0) & (idx < num_experts)
    per_expert += torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, idx // (num_experts // num_ranks), torch.full_like(idx, num_ranks))
    hits = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool)
    hits.scatter_(1, rank_of, True)
    in_rank = _at(is_token_in_rank, num_tokens * num_ranks, torch.bool).view(num_tokens, num_ranks)
    in_rank.copy_(hits[:, :num_ranks])
    per_rank += in_rank.sum(0, dtype=torch.int32)
    if num_nodes:
        pad = num_nodes * ranks_per_node - num_ranks
        by_node = torch.nn.functional.pad(in_rank, (0, pad)).view(num_tokens, num_nodes, ranks_per_node).any(2)
        _at(num_tokens_per_node, 4 * num_nodes, torch.int32).add_(by_node.sum(0, dtype=torch.int32))


# ---------------------------------------------------------------- the context
class _ErrorWord:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.code = self.rank = self.channel = self.peer = self.observed = self.expected = 0
        self.what = ""


def _sweep_leftovers() -> None:
    sweep_leftovers(_PREFIX)


def _map(name: str, nbytes: int, create: bool) -> torch.Tensor:
    return map_file(name, nbytes, create)


def _check_combine_shape(hidden: int, elem_size: int, topk: int) -> None:
    """The argument checks the combine launchers share (intranode.cu)."""
    if hidden % 8:
        raise ValueError("combine: hidden must be a multiple of 8")
    if elem_size not in (2, 4):
        raise ValueError("combine: x must be bfloat16 or float32")
    if topk > max_topk:
        raise ValueError(f"combine: top-k above {max_topk}")


class IntranodeContext:
    """One rank's buffer (control region + data region in shared memory), error word and host counts."""

    def __init__(self, rank: int, num_ranks: int, num_bytes: int, device: Optional[int], timeout_secs: float) -> None:
        if num_ranks < 1 or num_ranks > max_ranks:
            raise ValueError(f"intranode: num_ranks must be in [1, {max_ranks}]")
        if rank < 0 or rank >= num_ranks:
            raise ValueError("intranode: rank out of range")
        if num_bytes < 0:
            raise ValueError("intranode: num_bytes must be >= 0")
        self._rank, self._num_ranks, self._num_bytes = rank, num_ranks, int(num_bytes)
        self._timeout = float(timeout_secs)
        _sweep_leftovers()
        self.name = f"{_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._local = _map(self.name, control_bytes + self._num_bytes, True)
        self._peers: List[Optional[torch.Tensor]] = [None] * num_ranks
        self._peers[rank] = self._local
        self._err = _ErrorWord()
        self._host = {"ready": 0, "num_recv": 0, "overflow": 0, "per_expert": [], "rows_from": []}
        self._host_seq = 0
        self._opened = False
        self.launches = {}  # kernel name -> calls (for tests)

    rank = property(lambda self: self._rank)
    num_ranks = property(lambda self: self._num_ranks)
    data_bytes = property(lambda self: self._num_bytes)
    buffer_ptr = property(lambda self: 0 if self._local is None else self._local.data_ptr())

    def _count(self, what: str) -> None:
        self.launches[what] = self.launches.get(what, 0) + 1

    # ---- IPC
    def ipc_handle(self) -> bytes:
        return self.name.encode()

    def open_peers(self, handles: List[bytes]) -> None:
        if len(handles) != self._num_ranks:
            raise ValueError("open_peers: expected one handle per rank")
        for r, h in enumerate(handles):
            if r != self._rank:
                self._peers[r] = _map(bytes(h).decode(), control_bytes + self._num_bytes, False)
        self._opened = True

    def destroy(self) -> None:
        if self._local is None:
            return
        self._peers, self._local = [], None
        try:
            os.unlink(os.path.join(_SHM, self.name))
        except FileNotFoundError:
            pass

    # ---- memory of the kernels
    def _ctrl(self, r: int) -> torch.Tensor:
        return self._peers[r][:control_bytes].view(torch.int32)

    def _data(self, r: int) -> torch.Tensor:
        return self._peers[r][control_bytes:]

    def _copy_flags(self, r: int) -> torch.Tensor:
        """Rank r's copy-engine combine flags, one int64 per sender."""
        return self._ctrl(r).view(torch.int64)[_COPY_FLAGS // 2:_COPY_FLAGS // 2 + max_ranks]

    def _combine_blocks(self, r: int, area: "CombineArea", cap: int, row_bytes: int, topk: int):
        """Rank r's combine area as per-sender blocks: rows [R, cap, row_bytes] bytes and weights [R, cap, topk]."""
        R, d = self._num_ranks, self._data(r)
        rows = d[area.x:area.x + R * cap * row_bytes].view(R, cap, row_bytes)
        weights = d[area.weights:area.weights + R * cap * topk * 4].view(torch.float32).view(R, cap, topk)
        return rows, weights

    # ---- errors
    def _report(self, code: int, channel: int, peer: int, observed: int, expected: int, what: str) -> None:
        e = self._err
        if e.code == 0:  # atomicCAS(&code, 0, code): the first failure wins
            e.code, e.rank, e.channel, e.peer, e.observed, e.expected = code, self._rank, channel, peer, observed, \
                expected
            e.what = what[:31]
        print(f"uccl-ep: rank {self._rank} block {channel}: {what}: waited for peer {peer}, counter {observed}, "
              f"expected {expected}", file=sys.stderr)

    def error_message(self) -> str:
        e = self._err
        if e.code == 0:
            return ""
        kind = _KINDS[e.code if 0 <= e.code <= 3 else 0]
        return (f"uccl-ep intranode: {kind} on rank {e.rank} (block {e.channel}, {e.what}): peer {e.peer}, "
                f"counter {e.observed}, expected {e.expected}")

    def clear_error(self) -> None:
        self._err.clear()

    # ---- host counts
    def reset_host_counts(self) -> None:
        self._host["ready"] = 0

    def wait_host_counts(self, num_local_experts: int) -> List[int]:
        deadline = time.monotonic() + self._timeout
        while self._host["ready"] != self._host_seq:  # notify is synchronous: ready unless reset after it
            if self._err.code not in (0, 2):
                raise RuntimeError(self.error_message())
            if time.monotonic() > deadline:
                raise RuntimeError(f"uccl-ep intranode: rank {self._rank} timed out waiting for notify's counts on the "
                                   f"host (counter ready={self._host['ready']}, expected {self._host_seq})")
            time.sleep(1e-4)
        h = self._host
        return ([h["num_recv"], h["overflow"]] + [int(c) for c in h["per_expert"][:num_local_experts]]
                + [int(c) for c in h["rows_from"]])

    # ---- barrier
    def _barrier_block(self, what: str) -> bool:
        """barrier_block: bump our epoch, store it into flags[rank] of every peer, wait for every flag of ours."""
        R, me = self._num_ranks, self._rank
        own = self._ctrl(me)
        e = int(own[_EPOCH]) + 1
        own[_EPOCH] = e
        for r in range(R):
            self._ctrl(r)[_FLAGS + me] = e
        flags = own[_FLAGS:_FLAGS + R]
        deadline, nap = time.monotonic() + self._timeout, 2e-5
        while True:
            seen = flags.tolist()
            late = [r for r in range(R) if seen[r] - e < 0]
            if not late:
                return True
            if time.monotonic() > deadline:
                for r in late:  # every waiting thread reports; the first one is kept
                    self._report(1, 0, r, seen[r], e, what)
                return False
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def barrier(self, stream: int) -> None:
        self._count("barrier")
        self._barrier_block("barrier")

    # ---- notify
    def notify(self, num_tokens_per_rank: int, num_tokens_per_expert: int, is_token_in_rank: int, num_tokens: int,
               num_experts: int, rows_capacity: int, rank_prefix_matrix: int, recv_info: int, send_pos: int,
               stream: int) -> None:
        if num_experts > _MAX_EXPERT_COUNT_INTS:
            raise ValueError("notify: too many experts for the control region")
        self._count("notify")
        self._host_seq += 1
        R, me, L = self._num_ranks, self._rank, num_experts // self._num_ranks
        per_rank = _at(num_tokens_per_rank, 4 * R, torch.int32)
        per_expert = _at(num_tokens_per_expert, 4 * num_experts, torch.int32)
        # block 0: our counts into every destination's control region, the barrier, then read ours
        for dst in range(R):
            c = self._ctrl(dst)
            c[_COUNTS + me * R:_COUNTS + (me + 1) * R] = per_rank
            if L:
                c[_EXPERT_COUNTS + me * L:_EXPERT_COUNTS + (me + 1) * L] = per_expert[dst * L:(dst + 1) * L]
        # The kernel goes on after a timeout, publishing stale counts, but tells the send to skip (recv_info[1]).
        synced = self._barrier_block("notify barrier")
        own = self._ctrl(me)
        counts = own[_COUNTS:_COUNTS + R * R].view(R, R).clone()
        prefix = counts.cumsum(0, dtype=torch.int32)
        _at(rank_prefix_matrix, 4 * R * R, torch.int32).copy_(prefix.view(-1))
        over = prefix[-1]
        overflow = int(over.max()) if bool((over > rows_capacity).any()) else 0
        info = _at(recv_info, 4 * (2 + L), torch.int32)
        per_expert_recv = (own[_EXPERT_COUNTS:_EXPERT_COUNTS + R * L].view(R, L).sum(0, dtype=torch.int32) if L
                           else torch.zeros(0, dtype=torch.int32))
        info[2:] = per_expert_recv
        num_recv = int(counts[:, me].sum())
        info[0], info[1] = num_recv, overflow if synced else 2**31 - 1
        self._host.update(num_recv=num_recv, overflow=overflow, per_expert=per_expert_recv.tolist(),
                          rows_from=counts[:, me].tolist(), ready=self._host_seq)
        if overflow > 0:
            self._report(2, 0, me, overflow, rows_capacity, "receive area overflow")
        # blocks 1..R: send_pos[t][dst] = position of t among this rank's tokens for dst, -1 when not sent
        if num_tokens:
            in_rank = _at(is_token_in_rank, num_tokens * R, torch.bool).view(num_tokens, R)
            pos = in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
            _at(send_pos, 4 * num_tokens * R, torch.int32).view(num_tokens, R).copy_(
                torch.where(in_rank, pos, torch.full_like(pos, -1)))

    # ---- dispatch
    def dispatch_send(self, x: int, x_scales: int, topk_idx: int, topk_weights: int, send_pos: int,
                      rank_prefix_matrix: int, recv_info: int, num_tokens: int, hidden_bytes: int, num_scales: int,
                      topk: int, num_experts: int, rows_capacity: int, own_rows: int, self_x: int, self_scales: int,
                      self_rows: int, num_sms: int, stream: int) -> None:
        if hidden_bytes % 16:
            raise ValueError("dispatch: hidden bytes must be a multiple of 16")
        if own_rows not in (own_in_area, own_in_output):
            raise ValueError("dispatch_send: bad own_rows")
        if own_rows == own_in_output and not self_x and self_rows > 0:
            raise ValueError("dispatch_send: own rows into the output need self_x")
        if num_tokens == 0:
            return
        self._count("dispatch_send")
        R, me, T = self._num_ranks, self._rank, num_tokens
        if int(_at(recv_info, 8, torch.int32)[1]) > 0:
            return  # an area too small (every rank skips) or this rank's counts are stale (the host raises)
        prefix = _at(rank_prefix_matrix, 4 * R * R, torch.int32).view(R, R)
        base = torch.zeros(R, dtype=torch.int64) if me == 0 else prefix[me - 1].to(torch.int64)
        pos = _at(send_pos, 4 * T * R, torch.int32).view(T, R)
        area = RecvArea(rows_capacity, hidden_bytes, num_scales, topk)
        src_x = _rows(x, T, hidden_bytes)
        src_s = _rows(x_scales, T, 4 * num_scales, torch.float32) if x_scales and num_scales else None
        L = num_experts // R
        idx = _at(topk_idx, 8 * T * topk, torch.int64).view(T, topk) if topk_idx and topk else None
        w = (_at(topk_weights, 4 * T * topk, torch.float32).view(T, topk) if topk_weights and topk
             else (torch.zeros((T, topk), dtype=torch.float32) if idx is not None else None))
        for r in range(R):
            tokens = (pos[:, r] >= 0).nonzero().flatten()
            slots = base[r] + pos[tokens, r].to(torch.int64)
            direct = r == me and own_rows == own_in_output and self_x != 0
            if direct:  # past the output's end only when num_worst_tokens is too small: the receive kernel reports
                keep = slots < self_rows
                tokens, slots = tokens[keep], slots[keep]
            if tokens.numel() == 0:
                continue
            d = self._data(r)
            if direct:
                _rows(self_x, self_rows, hidden_bytes)[slots] = src_x[tokens]
            else:
                d[area.x:area.x + rows_capacity * hidden_bytes].view(rows_capacity, hidden_bytes)[slots] = \
                    src_x[tokens]
            if src_s is not None:
                if direct and self_scales:
                    _rows(self_scales, self_rows, 4 * num_scales, torch.float32)[slots] = src_s[tokens]
                else:
                    d[area.scales:area.scales + rows_capacity * num_scales * 4].view(torch.float32).view(
                        rows_capacity, num_scales)[slots] = src_s[tokens]
            if idx is not None:
                e, lo = idx[tokens], r * L
                local = (e >= lo) & (e < lo + L)
                d[area.idx:area.idx + rows_capacity * topk * 8].view(torch.int64).view(rows_capacity, topk)[slots] = \
                    torch.where(local, e - lo, torch.full_like(e, -1))
                d[area.weights:area.weights + rows_capacity * topk * 4].view(torch.float32).view(
                    rows_capacity, topk)[slots] = torch.where(local, w[tokens], torch.zeros_like(w[tokens]))
            d[area.src:area.src + rows_capacity * 4].view(torch.int32)[slots] = tokens.to(torch.int32)

    def dispatch_recv(self, recv_x: int, recv_scales: int, recv_topk_idx: int, recv_topk_weights: int,
                      recv_src_idx: int, recv_info: int, rank_prefix_matrix: int, own_rows: int, rows_from: List[int],
                      out_rows: int, hidden_bytes: int, num_scales: int, topk: int, rows_capacity: int,
                      local_sms: int, stream: int) -> None:
        if own_rows not in (own_in_area, own_in_output):
            raise ValueError("dispatch_recv: bad own_rows")
        if out_rows == 0:
            return
        R, me = self._num_ranks, self._rank
        copy_engine = bool(rows_from) and bool(recv_x)
        if copy_engine:  # the launcher's checks; the copies themselves are the same rows the kernel would copy
            if own_rows != own_in_output:
                raise ValueError("dispatch_recv: the copy engine copies the peers' rows of a self-direct receive only")
            if len(rows_from) != R:
                raise ValueError("dispatch_recv: rows_from needs one count per rank")
            if any(n < 0 for n in rows_from):
                raise ValueError("dispatch_recv: negative rows_from")
            if sum(rows_from) > min(out_rows, rows_capacity):
                raise ValueError(f"dispatch_recv: rows_from adds up to {sum(rows_from)} rows, more than the output's "
                                 f"{out_rows} or the area's {rows_capacity}")
            self._count("dispatch_recv_copy_engine")
        self._count("dispatch_recv")
        area = RecvArea(rows_capacity, hidden_bytes, num_scales, topk)
        d = self._data(me)
        num_recv = int(_at(recv_info, 4, torch.int32)[0])
        if num_recv > out_rows:
            self._report(3, 0, me, num_recv, out_rows, "num_worst_tokens too small")
            num_recv = out_rows
        prefix = _at(rank_prefix_matrix, 4 * R * R, torch.int32).view(R, R)
        direct = own_rows == own_in_output
        self_begin = (0 if me == 0 else int(prefix[me - 1, me])) if direct else 0
        self_end = int(prefix[me, me]) if direct else 0
        n = num_recv
        rows = torch.arange(n)
        peer_rows = rows[(rows < self_begin) | (rows >= self_end)]
        if recv_x:
            out = _rows(recv_x, out_rows, hidden_bytes)
            out[peer_rows] = d[area.x:area.x + n * hidden_bytes].view(n, hidden_bytes)[peer_rows] if n else out[:0]
            out[n:] = 0
        if recv_scales and num_scales:
            out = _rows(recv_scales, out_rows, 4 * num_scales, torch.float32)
            src = d[area.scales:area.scales + n * num_scales * 4].view(torch.float32).view(n, num_scales)
            out[peer_rows] = src[peer_rows] if n else out[:0]
            out[n:] = 0
        if recv_topk_idx and topk:
            _rows(recv_topk_idx, out_rows, 8 * topk, torch.int64)[:n] = \
                d[area.idx:area.idx + n * topk * 8].view(torch.int64).view(n, topk)
            _rows(recv_topk_idx, out_rows, 8 * topk, torch.int64)[n:] = -1
            if recv_topk_weights:
                _rows(recv_topk_weights, out_rows, 4 * topk, torch.float32)[:n] = \
                    d[area.weights:area.weights + n * topk * 4].view(torch.float32).view(n, topk)
                _rows(recv_topk_weights, out_rows, 4 * topk, torch.float32)[n:] = 0
        if recv_src_idx:
            out = _at(recv_src_idx, 4 * out_rows, torch.int32)
            out[:n] = d[area.src:area.src + n * 4].view(torch.int32)
            out[n:] = -1

    def expert_major(self, src_x: int, src_scales: int, recv_topk_idx: int, recv_topk_weights: int, recv_info: int,
                     out_rows: int, expert_rows: int, num_local_experts: int, alignment: int, hidden_bytes: int,
                     num_scales: int, topk: int, out_x: int, out_scales: int, em_token: int, em_slot: int,
                     em_expert: int, em_weights: int, slot_of: int, local_sms: int, stream: int) -> None:
        # as Context::expert_major: the plan, then the copy from the dense receive area
        fake_expert_major.layout(recv_topk_idx, recv_topk_weights, recv_info, out_rows, expert_rows,
                                 num_local_experts, alignment, topk, em_token, em_slot, em_expert, em_weights,
                                 slot_of, 1, stream)
        if num_local_experts == 0 or expert_rows == 0:
            return
        self._count("expert_major")
        fake_expert_major.copy(src_x, hidden_bytes, src_scales, 4 * num_scales, recv_info, out_rows, expert_rows,
                               hidden_bytes, num_scales, topk, slot_of, em_token, out_x, out_scales, 1, stream)

    # ---- combine
    def expert_major_partials(self, x: int, topk_weights: int, slot_of: int, recv_info: int, num_rows: int,
                              hidden: int, elem_size: int, topk: int, partials: int, out_topk_weights: int,
                              local_sms: int, stream: int) -> None:
        _check_combine_shape(hidden, elem_size, topk)
        fake_expert_major.partials(x, topk_weights, slot_of, recv_info, num_rows, hidden, elem_size, topk, partials,
                                   out_topk_weights, 1, stream)
        if num_rows:
            self._count("expert_major_partials")

    def combine_send(self, x: int, topk_weights: int, recv_src_idx: int, rank_prefix_matrix: int, recv_info: int,
                     num_rows: int, hidden: int, elem_size: int, topk: int, max_src_tokens: int, num_sms: int,
                     stream: int) -> None:
        if hidden % 8:
            raise ValueError("combine: hidden must be a multiple of 8")
        if elem_size not in (2, 4):
            raise ValueError("combine: x must be bfloat16 or float32")
        if num_rows == 0:
            return
        self._count("combine_send")
        R, me = self._num_ranks, self._rank
        rows = min(num_rows, int(_at(recv_info, 4, torch.int32)[0]))
        area = CombineArea(max_src_tokens, R, hidden * (2 if elem_size == 4 else 1), topk)
        row_bytes = hidden * elem_size
        prefix = _at(rank_prefix_matrix, 4 * R * R, torch.int32).view(R, R)[:, me].tolist()
        src_idx = _at(recv_src_idx, 4 * max(rows, 1), torch.int32)[:rows].to(torch.int64)
        xs = _rows(x, max(rows, 1), row_bytes)
        ws = _rows(topk_weights, max(rows, 1), 4 * topk, torch.float32) if topk_weights else None
        start = 0
        for s in range(R):  # rows [prefix[s-1], prefix[s]) came from rank s (the last rank takes what is left)
            end = rows if s == R - 1 else min(max(prefix[s], start), rows)
            if end > start:
                out_row = src_idx[start:end] * R + me
                d = self._data(s)
                d[area.x:area.x + max_src_tokens * R * row_bytes].view(-1, row_bytes)[out_row] = xs[start:end]
                if ws is not None:
                    d[area.weights:area.weights + max_src_tokens * R * topk * 4].view(torch.float32).view(
                        -1, topk)[out_row] = ws[start:end]
            start = max(start, end)

    def combine_reduce(self, is_token_in_rank: int, num_tokens: int, hidden: int, elem_size: int, topk: int,
                       out_x: int, out_topk_weights: int, max_src_tokens: int, local_sms: int, stream: int) -> None:
        if num_tokens == 0:
            return
        self._count("combine_reduce")
        R, T = self._num_ranks, num_tokens
        dt = torch.float32 if elem_size == 4 else torch.bfloat16
        area = CombineArea(max_src_tokens, R, hidden * (2 if elem_size == 4 else 1), topk)
        d = self._data(self._rank)
        rows = d[area.x:area.x + T * R * hidden * elem_size].view(dt).view(T, R, hidden)
        mask = _at(is_token_in_rank, T * R, torch.bool).view(T, R)
        acc = torch.zeros((T, hidden), dtype=torch.float32)
        for r in range(R):  # rank order, fp32 from 0, rounded once
            sel = mask[:, r].nonzero().flatten()
            acc[sel] += rows[sel, r].float()
        _rows(out_x, T, hidden * elem_size, dt).copy_(acc.to(dt))
        if out_topk_weights:
            w = d[area.weights:area.weights + T * R * topk * 4].view(torch.float32).view(T, R, topk)
            accw = torch.zeros((T, topk), dtype=torch.float32)
            for r in range(R):
                sel = mask[:, r].nonzero().flatten()
                accw[sel] += w[sel, r]
            _rows(out_topk_weights, T, 4 * topk, torch.float32).copy_(accw)

    def combine_copy_engine(self, x: int, topk_weights: int, rows_from: List[int], is_token_in_rank: int,
                            send_pos: int, num_tokens: int, hidden: int, elem_size: int, topk: int, out_x: int,
                            out_topk_weights: int, max_src_tokens: int, chunk_bytes: int, num_streams: int,
                            local_sms: int, stream: int) -> None:
        """The barrier, each peer's block copied chunk by chunk with its flag after each chunk, then the sum in rank
        order (own rows straight from x), waiting per token for the flags that cover its rows."""
        _check_combine_shape(hidden, elem_size, topk)
        R, me = self._num_ranks, self._rank
        if len(rows_from) != R:
            raise ValueError("combine_copy_engine: rows_from needs one count per rank")
        if chunk_bytes <= 0:
            raise ValueError("combine_copy_engine: chunk_bytes must be > 0")
        for r, n in enumerate(rows_from):
            if n < 0 or n > max_src_tokens:
                raise ValueError(f"combine_copy_engine: {n} rows for rank {r} exceed its combine area of "
                                 f"{max_src_tokens} tokens")
        self._count("combine_copy_engine")
        self._barrier_block("barrier")
        area = CombineArea(max_src_tokens, R, hidden * (2 if elem_size == 4 else 1), topk)
        row_bytes = hidden * elem_size
        start = [0]
        for n in rows_from:
            start.append(start[-1] + n)
        total = start[-1]
        # (a rank that received nothing may pass empty tensors, whose address is 0)
        xs = _rows(x, total, row_bytes) if total else torch.empty((0, row_bytes), dtype=torch.uint8)
        ws = (_rows(topk_weights, total, 4 * topk, torch.float32) if total else torch.empty((0, topk))) \
            if topk_weights else None
        chunk_rows = max(1, chunk_bytes // row_bytes)  # (streams: only the order of the real copies; here serial)
        for r in range(R):
            n = rows_from[r]
            if r == me or n == 0:
                continue
            blocks, wblocks = self._combine_blocks(r, area, max_src_tokens, row_bytes, topk)
            block = blocks[me]
            if ws is not None:
                wblocks[me, :n] = ws[start[r]:start[r] + n]
            flags = self._copy_flags(r)
            for c0 in range(0, n, chunk_rows):
                c1 = min(n, c0 + chunk_rows)
                block[c0:c1] = xs[start[r] + c0:start[r] + c1]
                flags[me] = c1
        try:
            self._reduce_blocks(xs, ws, start, rows_from, is_token_in_rank, send_pos, num_tokens, hidden, elem_size,
                                topk, out_x, out_topk_weights, area, max_src_tokens)
        finally:  # every flag a peer writes this call has been read: clear them before the next barrier
            self._copy_flags(me).zero_()

    def _reduce_blocks(self, xs, ws, start, rows_from, is_token_in_rank, send_pos, num_tokens, hidden, elem_size,
                       topk, out_x, out_topk_weights, area, max_src_tokens) -> None:
        """combine_reduce_blocks_kernel: per peer, wait for the flag that covers the rows we read, then sum each
        token's copies in rank order (own rows from x)."""
        if num_tokens == 0:
            return
        R, me = self._num_ranks, self._rank
        row_bytes = hidden * elem_size
        T, dt = num_tokens, (torch.float32 if elem_size == 4 else torch.bfloat16)
        mask = _at(is_token_in_rank, T * R, torch.bool).view(T, R)
        pos = _at(send_pos, 4 * T * R, torch.int32).view(T, R).to(torch.int64)
        flags = self._copy_flags(me)
        deadline = time.monotonic() + self._timeout
        for r in range(R):  # per peer: one more than the last position we read from its block
            if r == me or not bool(mask[:, r].any()):
                continue
            need = int(pos[mask[:, r], r].max() + 1)
            while int(flags[r]) < need:
                if time.monotonic() > deadline:
                    self._report(1, 0, r, int(flags[r]), need, "copy-engine combine rows")
                    return
                time.sleep(1e-4)
        raw, wblocks = self._combine_blocks(me, area, max_src_tokens, row_bytes, topk)
        blocks = raw.view(dt).view(R, max_src_tokens, hidden)
        own_x = xs[start[me]:start[me + 1]].view(dt).view(-1, hidden)
        acc = torch.zeros((T, hidden), dtype=torch.float32)
        accw = torch.zeros((T, topk), dtype=torch.float32)
        for r in range(R):  # rank order, fp32 from 0, rounded once
            sel = mask[:, r].nonzero().flatten()
            if sel.numel() == 0:
                continue
            p = pos[sel, r]
            acc[sel] += (own_x[p] if r == me else blocks[r, p]).float()
            if out_topk_weights:
                accw[sel] += ws[start[me]:start[me + 1]][p] if r == me else wblocks[r, p]
        _rows(out_x, T, hidden * elem_size, dt).copy_(acc.to(dt))
        if out_topk_weights:
            _rows(out_topk_weights, T, 4 * topk, torch.float32).copy_(accw)


#: What ``uccl_ep_train.native.module()`` returns once install() ran: the parts of ``_C`` intranode.py touches.
NATIVE = SimpleNamespace(kernels=sys.modules[__name__], gpu_backend="NONE")


def install() -> None:
    """Make ``native.module()`` return this stand-in in this process (a test's child process)."""
    from uccl_ep_train import native

    native.module = lambda: NATIVE
