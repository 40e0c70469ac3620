"""CPU stand-ins for the expert-major kernels (csrc/kernels/expert_major.hpp), shared by the intranode and internode
fakes: the same arguments (device addresses as integers, here CPU memory), the same rows written, so the backends'
host paths run in CI without a GPU. Streams are ignored: everything runs when called."""
from __future__ import annotations

import ctypes

import torch

MAX_TOPK = 32


def _at(ptr: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A CPU tensor over raw memory: no copy, no ownership."""
    if nbytes <= 0 or not ptr:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)


def _strided_rows(ptr: int, n: int, stride: int, nbytes: int) -> torch.Tensor:
    """[n, nbytes] uint8 rows ``stride`` bytes apart."""
    if n == 0:
        return torch.empty((0, nbytes), dtype=torch.uint8)
    return _at(ptr, (n - 1) * stride + nbytes).as_strided((n, nbytes), (stride, 1))


def whole_gpu_grid(kernel: str) -> int:
    if kernel not in ("copy", "partials_bf16", "partials_f32"):
        raise ValueError(f"expert_major_grid: kernel is copy, partials_bf16 or partials_f32, not {kernel}")
    return 1


def layout(recv_topk_idx: int, recv_topk_weights: int, recv_info: int, out_rows: int, expert_rows: int,
           num_local_experts: int, alignment: int, topk: int, em_token: int, em_slot: int, em_expert: int,
           em_weights: int, slot_of: int, tail_blocks: int, stream: int) -> None:
    if topk > MAX_TOPK:
        raise ValueError(f"expert_major: top-k above {MAX_TOPK}")
    if alignment < 1:
        raise ValueError("expert_major: alignment must be >= 1")
    if not slot_of and out_rows > 0:
        raise ValueError("expert_major: slot_of is required")
    so = _at(slot_of, 4 * out_rows * topk, torch.int32).view(out_rows, topk)
    so.fill_(-1)  # cudaMemsetAsync(0xff)
    L, P = num_local_experts, expert_rows
    if L == 0 or P == 0:
        return
    info = _at(recv_info, 4 * (2 + L), torch.int32).tolist()
    num_recv = min(info[0], out_rows)
    idx = _at(recv_topk_idx, 8 * num_recv * topk, torch.int64).view(num_recv, topk)
    tok, slot, exp = (_at(p, 8 * P, torch.int64) for p in (em_token, em_slot, em_expert))
    wts = _at(em_weights, 4 * P, torch.float32) if em_weights else None
    rw = _at(recv_topk_weights, 4 * num_recv * topk, torch.float32).view(num_recv, topk) if em_weights else None
    begin = 0
    for e in range(L):
        count = info[2 + e]
        padded = (count + alignment - 1) // alignment * alignment
        match = idx == e
        rows = match.any(1).nonzero().flatten()
        hit_k = match.to(torch.int8).argmax(1)[rows]  # the first k with the expert
        p = begin + torch.arange(rows.numel())
        ok = p < P
        rows, hit_k, p = rows[ok], hit_k[ok], p[ok]
        so[rows, hit_k] = p.to(torch.int32)
        tok[p], slot[p], exp[p] = rows, hit_k, e
        if wts is not None:
            wts[p] = rw[rows, hit_k]
        lo, hi = min(begin + count, P), min(begin + padded, P)
        begin += padded
        for t in (tok[lo:hi], slot[lo:hi], exp[lo:hi]):
            t.fill_(-1)
        if wts is not None:
            wts[lo:hi] = 0
    lo = min(begin, P)  # the tail after the last segment
    for t in (tok[lo:], slot[lo:], exp[lo:]):
        t.fill_(-1)
    if wts is not None:
        wts[lo:] = 0


def copy(src_x: int, src_x_stride: int, src_scales: int, src_scales_stride: int, recv_info: int, out_rows: int,
         expert_rows: int, hidden_bytes: int, num_scales: int, topk: int, slot_of: int, em_token: int, out_x: int,
         out_scales: int, grid: int, stream: int) -> None:
    if topk > MAX_TOPK:
        raise ValueError(f"expert_major: top-k above {MAX_TOPK}")
    if hidden_bytes % 16 or src_x % 16 or src_x_stride % 16 or src_x_stride < hidden_bytes:
        raise ValueError("expert_major: payload rows must be 16-byte aligned, a stride of at least their bytes")
    if num_scales > 0 and src_scales and (src_scales % 4 or src_scales_stride % 4
                                          or src_scales_stride < 4 * num_scales):
        raise ValueError("expert_major: scale rows must be 4-byte aligned, a stride of at least their bytes")
    if expert_rows == 0:
        return
    num_recv = min(int(_at(recv_info, 4, torch.int32)[0]), out_rows)
    so = _at(slot_of, 4 * out_rows * topk, torch.int32).view(out_rows, topk)[:num_recv].to(torch.int64)
    ox = _at(out_x, expert_rows * hidden_bytes).view(expert_rows, hidden_bytes)
    sx = _strided_rows(src_x, num_recv, src_x_stride, hidden_bytes)
    os_ = _at(out_scales, 4 * expert_rows * num_scales, torch.float32).view(expert_rows, num_scales) \
        if out_scales and num_scales else None
    ss = _strided_rows(src_scales, num_recv, src_scales_stride, 4 * num_scales) if os_ is not None else None
    for k in range(topk):
        rows = (so[:, k] >= 0).nonzero().flatten()
        ox[so[rows, k]] = sx[rows]
        if os_ is not None:
            os_.view(torch.uint8)[so[rows, k]] = ss[rows]
    empty = (_at(em_token, 8 * expert_rows, torch.int64) < 0).nonzero().flatten()
    ox[empty] = 0
    if os_ is not None:
        os_[empty] = 0


def partials(x: int, topk_weights: int, slot_of: int, recv_info: int, num_rows: int, hidden: int, elem_size: int,
             topk: int, out: int, out_topk_weights: int, grid: int, stream: int) -> None:
    if hidden % 8:
        raise ValueError("expert_major_partials: hidden must be a multiple of 8")
    if elem_size not in (2, 4):
        raise ValueError("expert_major_partials: x must be bfloat16 or float32")
    if topk > MAX_TOPK:
        raise ValueError(f"expert_major_partials: top-k above {MAX_TOPK}")
    if (topk_weights == 0) != (out_topk_weights == 0):
        raise ValueError("expert_major_partials: give both topk_weights and out_topk_weights, or neither")
    if num_rows == 0:
        return
    dt = torch.float32 if elem_size == 4 else torch.bfloat16
    rows = min(num_rows, int(_at(recv_info, 4, torch.int32)[0]))
    so = _at(slot_of, 4 * num_rows * topk, torch.int32).view(num_rows, topk)[:rows].to(torch.int64)
    n_x = int(so.max()) + 1 if so.numel() else 0
    xs = _at(x, n_x * hidden * elem_size, dt).view(max(n_x, 0), hidden)
    acc = torch.zeros((rows, hidden), dtype=torch.float32)
    for k in range(topk):  # in k order, fp32 from 0, rounded once
        sel = (so[:, k] >= 0).nonzero().flatten()
        acc[sel] += xs[so[sel, k]].float()
    _at(out, num_rows * hidden * elem_size, dt).view(num_rows, hidden)[:rows] = acc.to(dt)
    if out_topk_weights:
        w = _at(topk_weights, 4 * max(n_x, 1), torch.float32)
        got = w[so.clamp(min=0)] if n_x else torch.zeros_like(so, dtype=torch.float32)
        _at(out_topk_weights, 4 * num_rows * topk, torch.float32).view(num_rows, topk)[:rows] = \
            torch.where(so >= 0, got, torch.zeros((), dtype=torch.float32))


CHUNK_PAIRS, CHUNK_MAX_EXPERTS = 256, 1024  # expert_major.cu's chunked pair ranks


def pair_ranks_workspace_bytes(num_tokens: int, topk: int, num_experts: int) -> int:
    """pair_ranks_workspace_bytes: the chunks' int32 counts per expert; 0 where the chunked launches do not apply."""
    if num_tokens < 0 or topk < 0 or not 1 <= num_experts <= CHUNK_MAX_EXPERTS:
        return 0
    return -(-num_tokens * topk // CHUNK_PAIRS) * num_experts * 4


def pair_ranks(topk_idx: int, num_tokens: int, topk: int, num_experts: int, ranks: int, stream: int,
               workspace: int = 0, workspace_bytes: int = 0) -> None:
    """pair_ranks_kernel (or the chunked launches, with a workspace): per (token, slot) naming expert e, the (token,
    slot) pairs before it naming e; -1 dropped."""
    if num_tokens < 0 or topk < 0 or num_experts < 1:
        raise ValueError("expert_major_pair_ranks: needs num_tokens >= 0, topk >= 0 and num_experts >= 1")
    pairs = num_tokens * topk
    if pairs == 0:
        return
    need = pair_ranks_workspace_bytes(num_tokens, topk, num_experts)
    if workspace and need and workspace_bytes < need:
        raise ValueError(f"expert_major_pair_ranks: the workspace has {workspace_bytes} bytes, the chunks' counts "
                         f"need {need} (pair_ranks_workspace_bytes)")
    ids = _at(topk_idx, 8 * pairs, torch.int64)
    out = _at(ranks, 4 * pairs, torch.int32)
    valid = (ids >= 0) & (ids < num_experts)
    hot = torch.nn.functional.one_hot(torch.where(valid, ids, 0), num_experts) * valid.unsqueeze(1)
    before = hot.cumsum(0) - hot  # pairs before each one, per expert
    out.copy_(torch.where(valid, before.gather(1, torch.where(valid, ids, 0).unsqueeze(1)).squeeze(1), -1))


def pad(recv_info: int, num_local_experts: int, alignment: int, expert_rows: int, hidden_bytes: int,
        num_scales: int, out_x: int, out_scales: int, em_token: int, em_slot: int, em_expert: int, em_weights: int,
        grid: int, stream: int, go: int = 0) -> None:
    """expert_major_pad_kernel: the rows no pair fills zeroed, the given plan columns -1 / 0 there; nothing when the
    int64 word at ``go`` (if given) holds 0."""
    if alignment < 1:
        raise ValueError("expert_major_pad: alignment must be >= 1")
    if not 0 <= num_local_experts <= 4096:
        raise ValueError(f"expert_major_pad: 0..4096 local experts, not {num_local_experts}")
    if hidden_bytes % 16 or out_x % 16:
        raise ValueError("expert_major_pad: payload rows must be 16-byte aligned")
    if expert_rows == 0:
        return
    if go and not int(torch.frombuffer((ctypes.c_char * 8).from_address(go), dtype=torch.int64)[0]):
        return
    P = expert_rows
    counts = _at(recv_info, 4 * (2 + num_local_experts), torch.int32).tolist()[2:]
    empty = torch.ones(P, dtype=torch.bool)
    begin = 0
    for c in counts:
        empty[begin:min(begin + c, P)] = False
        begin += (c + alignment - 1) // alignment * alignment
    rows = empty.nonzero().flatten()
    _at(out_x, P * hidden_bytes).view(P, hidden_bytes)[rows] = 0
    if out_scales and num_scales:
        _at(out_scales, 4 * P * num_scales, torch.float32).view(P, num_scales)[rows] = 0
    for col in (em_token, em_slot, em_expert):
        if col:
            _at(col, 8 * P, torch.int64)[rows] = -1
    if em_weights:
        _at(em_weights, 4 * P, torch.float32)[rows] = 0
