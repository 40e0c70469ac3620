"""A CPU stand-in for ``uccl_ep_train._C.internode``, so NativeInternodeBackend's host path runs in CI without a GPU.

What it emulates (csrc/kernels/internode.cu, csrc/bindings/internode_bindings.cpp), with the same names, arguments
and return shapes: an ``InternodeContext`` per rank whose RDMA region, NVL region and signal counters live in POSIX
shared memory (files under /dev/shm), so the ranks' processes write into each other's memory as the loopback
transport does; the proxy bootstrap (``proxy_local_info`` / ``proxy_connect``: how a rank finds its peers' RDMA
regions and counters) and the NVL mapping (``nvl_ipc_handle`` / ``open_nvl_peers``); ``push_chunks`` cutting every
row of the push table into chunks exactly as push_chunks_kernel (lane = (hint + c) % num_fifos, the same command
format checks, the same ``encode`` error word), copying each chunk's bytes and THEN adding its record count to the
destination's slot + lane; ``wait_signals`` polling until every slot reaches its target, recording ``wait_timeout``
after the GPU deadline and returning early once the error word is set (``abort_waits``); ``scatter_rows`` with the
``scatter_range`` check; ``arrival_gate`` and the gated ``unpack_records`` / ``sum_node_partials``, which wait for
the counter of every row they read by the kernels' rule (internode.plan.gate_threshold) before reading it; the error
word at a raw address; diagnostics with the real keys.

A counter is one int64 per (slot, writer rank): only that writer adds to it and a slot's value is the sum over
writers, so counters stay exact with several writer processes and no atomics.

What it does not emulate: proxy threads, FIFOs and flow control (a push is done when push_chunks returns, so
``push_timeout`` never fires and FIFO heads always equal tails), reordering or delays of the transport, streams (all
work is synchronous: stream order is program order), CUDA's lazy module loading, and verbs.

``FAKE_JITTER_SECS`` (environment, default 0): before about a third of its writes and waits a rank sleeps up to that
long, at random, so that races between ranks' calls show up in a few runs instead of once in many (session 50: at
0.003 a count row overwritten by a peer one exchange ahead stalled 1 run in ~20 of the num_worst_tokens error test,
once in many CI runs without it).
"""
from __future__ import annotations

import ctypes
import functools
import json
import operator
import os
import random
import sys
import time
import uuid
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch

from tests import fake_expert_major
from tests.shared_memory_files import map_file, sweep_leftovers

from uccl_ep_train.internode.plan import (CMD_MAX_BYTES, CMD_MAX_RANKS, CMD_MAX_REGION, CMD_MAX_SLOTS, CMD_MAX_VALUE,
                                          CMD_UNIT, FORWARD_DIMS, GATE_FIXED_COLUMNS, READ_BLOCKS, READ_DIMS,
                                          READ_FIRST_ROW, READ_GO, READ_OWN_COUNT, READ_OWN_FIRST, READ_ROWS,
                                          SLOT_PAGE, Counts, RecordLayout, forward_before_counts, gate_lane_target,
                                          gate_threshold, local_count_row,
                                          pack_records as _pack_records, place_blocks, read_before_counts,
                                          rows_from_own_row, send_plan as _send_plan, source_local_of_rows,
                                          stamp_arrivals)

PUSH_COLUMNS = 7
# the expert-major kernels (csrc/kernels/expert_major.hpp), shared with the intranode stand-in
EXPERT_MAJOR_MAX_TOPK = fake_expert_major.MAX_TOPK
expert_major_grid = fake_expert_major.whole_gpu_grid
expert_major_layout = fake_expert_major.layout
expert_major_copy = fake_expert_major.copy
expert_major_partials = fake_expert_major.partials
expert_major_pair_ranks = fake_expert_major.pair_ranks
expert_major_pair_ranks_workspace_bytes = fake_expert_major.pair_ranks_workspace_bytes
expert_major_pad = fake_expert_major.pad
GATE_COLUMNS = GATE_FIXED_COLUMNS
COUNT_ROW_MAX_BINS = 12288
PHASES = {"dispatch_network": 1, "combine_network": 2, "dispatch_forward": 3, "combine_gather": 4, "barrier": 5,
          "notify": 6}
ERROR_CODES = {"wait_timeout": 1, "push_timeout": 2, "encode": 3, "scatter_range": 4, "aborted": 5,
               "records_unwritten": 6, "node_flag_timeout": 7, "row_not_ready": 8}
PACK_PUSH_MAX_ROWS = 256
GATHER_MAX_TILES = 1024
NODE_SUMS_MAX_RANKS_PER_NODE = 256
READ_MAX_COUNTERS = 128
_PHASE_NAMES = {1: "dispatch network hop (push_chunks / wait_signals)",
                2: "combine network hop (push_chunks / wait_signals)",
                3: "dispatch forward over NVLink (forward_rows)",
                4: "combine gather over NVLink (forward_rows, scatter_rows)",
                5: "group barrier through the proxies (push_chunks / wait_signals)",
                6: "notify: count exchange through the proxies (push_chunks / wait_signals)"}
_CMD_ERRORS = {2: "dst_rank out of range (0..4095)", 3: "signal slot out of range (0..16382)",
               4: "signal value out of range (0..262143)",
               5: "byte count out of range (16..268435440; 0 only with a signal)",
               6: "byte count not a multiple of 16", 7: "local offset out of range (< 4 GiB)",
               8: "local offset not a multiple of 16", 9: "remote offset out of range (< 4 GiB)",
               10: "remote offset not a multiple of 16"}
_MAX_OFFSET = CMD_MAX_REGION - CMD_UNIT
_SHM, _PREFIX = "/dev/shm", "uccl-ep-fake-internode"
_CTOR_ARGS = ("rank world device rdma_bytes nvl_bytes num_threads fifos_per_thread fifo_depth cpus idle_backoff_us "
              "timeout_secs max_inflight_writes max_inflight_bytes reorder_window num_signal_slots loopback_reorder "
              "loopback_delay_us loopback_bandwidth_gbps loopback_seed gpu_timeout_secs").split()
_CTOR_OPTIONAL = {"transport", "ib_devices", "ib_port", "gid_index", "sl", "tc", "dump_trigger", "loopback_copy_agent"}
_unlink_later: List[str] = []  # RDMA/counter files of this process: unlink_shared_host_memory_names() removes them


def phase_name(phase: int) -> str:
    return _PHASE_NAMES.get(phase, "unknown phase")


class ErrorWord(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("rank", ctypes.c_int32), ("slot", ctypes.c_int32), ("aux", ctypes.c_int32),
                ("phase", ctypes.c_int32), ("reserved", ctypes.c_int32), ("observed", ctypes.c_int64),
                ("expected", ctypes.c_int64)]


def _at(ptr: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A CPU tensor over raw memory: no copy, no ownership."""
    if nbytes <= 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)


def _report(err: int, stop: tuple, code: int, rank: int, slot: int, aux: int, phase: int, observed: int,
            expected: int) -> None:
    """report() of the kernels: sets the stop flag (``stop``: flag address, generation); the first failure wins
    (``reserved``), the code is written last."""
    _set_stop(*stop)
    e = ErrorWord.from_address(err) if err else None
    if e is not None and e.reserved == 0:
        e.reserved, e.rank, e.slot, e.aux, e.phase = 1, rank, slot, aux, phase
        e.observed, e.expected, e.code = observed, expected, code


def _stopped(flag: int, generation: int) -> bool:
    """stopped() of the kernels: the rank's stop flag holds the generation the kernel was launched with."""
    return bool(flag) and ctypes.c_int32.from_address(flag).value == generation


def _set_stop(flag: int, generation: int) -> None:
    if flag:
        ctypes.c_int32.from_address(flag).value = generation


def _sweep_leftovers() -> None:
    sweep_leftovers(_PREFIX)


def _map(name: str, nbytes: int, create: bool) -> torch.Tensor:
    return map_file(name, nbytes, create)


def scatter_rows(dst: int, dst_stride: int, dst_idx: int, src: int, src_stride: int, src_idx: int, n: int,
                 row_bytes: int, stream: int, dst_rows: int = -1, err: int = 0, stop_flag: int = 0,
                 stop_generation: int = 0, rank: int = -1, phase: int = 0, target: int = -1) -> None:
    """scatter_rows_kernel: row i from src + s_i * src_stride to dst + d_i * dst_stride (index arrays: raw int64
    addresses, 0 = identity); a negative index skips the row; a d_i >= dst_rows (when >= 0) is reported, not written;
    nothing moves while the stop flag holds ``stop_generation``."""
    if n <= 0 or row_bytes <= 0 or _stopped(stop_flag, stop_generation):
        return
    if not dst or not src:
        raise ValueError("scatter_rows: null pointer")
    d = _at(dst_idx, 8 * n, torch.int64).clone() if dst_idx else torch.arange(n)
    s = _at(src_idx, 8 * n, torch.int64).clone() if src_idx else torch.arange(n)
    ok = (d >= 0) & (s >= 0)
    if dst_rows >= 0:
        bad = ok & (d >= dst_rows)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            _report(err, (stop_flag, stop_generation), ERROR_CODES["scatter_range"], rank, target, r, phase,
                    int(d[r]), dst_rows)
            ok &= ~bad
    d, s = d[ok], s[ok]
    if d.numel():
        rows = lambda p, st, k: _at(p, (k - 1) * st + row_bytes).as_strided((k, row_bytes), (st, 1))  # noqa: E731
        rows(dst, dst_stride, int(d.max()) + 1)[d] = rows(src, src_stride, int(s.max()) + 1)[s]


FORWARD_MAX_TARGETS = 1024


def forward_rows(dsts: int, dst_bases_or: int, dst_stride: int, dst_idx: int, targets: int, src: int,
                 src_stride: int, n: int, row_bytes: int, dst_rows: int, stream: int, err: int = 0, stop_flag: int = 0,
                 stop_generation: int = 0, rank: int = -1, phase: int = 0) -> None:
    """forward_rows_kernel: row r of src to every target j with dst_idx[r, j] >= 0, at that row of dsts[j]; an index
    >= dst_rows[j] is reported (target j, list position r), not written; nothing moves while the stop flag holds
    ``stop_generation``. ``dst_bases_or`` must be the OR of the dsts entries (the kernel's word size rests on it)."""
    if n <= 0 or row_bytes <= 0 or _stopped(stop_flag, stop_generation):
        return
    if not (dsts and dst_idx and src and dst_rows):
        raise ValueError("forward_rows: null pointer")
    if not 0 < targets <= FORWARD_MAX_TARGETS:
        raise ValueError(f"forward_rows: {targets} local GPUs; 1 to {FORWARD_MAX_TARGETS} are supported")
    bases = _at(dsts, 8 * targets, torch.int64).tolist()
    if functools.reduce(operator.or_, bases) != dst_bases_or:
        raise ValueError("forward_rows: dst_bases_or is not the OR of the destinations")
    index = _at(dst_idx, 8 * n * targets, torch.int64).view(n, targets).clone()
    limits = _at(dst_rows, 8 * targets, torch.int64).tolist()
    rows = lambda p, st, k: _at(p, (k - 1) * st + row_bytes).as_strided((k, row_bytes), (st, 1))  # noqa: E731
    source = rows(src, src_stride, n)
    for j in range(targets):  # (as the kernel: the stop flag is read once, at the start)
        d = index[:, j]
        bad = d >= limits[j]
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            _report(err, (stop_flag, stop_generation), ERROR_CODES["scatter_range"], rank, j, r, phase, int(d[r]),
                    limits[j])
        ok = (d >= 0) & ~bad
        if bool(ok.any()):
            rows(bases[j], dst_stride, int(d[ok].max()) + 1)[d[ok]] = source[ok]


def forward_arrivals(dsts: int, dst_bases_or: int, dst_stride: int, targets: int, src: int, src_stride: int, n: int,
                     row_bytes: int, dst_rows: int, blocks: int, num_blocks: int, dest_rows_offset: int,
                     arrival_offset: int, dst_idx_out: int, stream: int, gate: "ArrivalGate | None" = None,
                     first_row: int = 0,
                     err: int = 0, stop_flag: int = 0, stop_generation: int = 0, rank: int = -1,
                     phase: int = 0, ready_words: int = 0, ready_rows: int = 0, ready_epoch: int = 0,
                     dims: int = 0) -> None:
    """forward_arrivals_kernel: stamp_arrivals' rule (each arrival's index into its record, its final rows into
    dst_idx_out [n, targets], each with its block's bases: blocks [num_blocks, 1 + targets]), then forward_rows'
    copies; gated, every row waits for its chunk first. ``ready_words`` (int64 [targets]: each GPU's int32 words):
    then each final row d < ready_rows's word at its GPU set to ``ready_epoch``, after the copies. ``dims``
    (forward_from_count_rows' forward words): launched before the counts, ``n`` the capacity of dst_idx_out; the
    rows, first row and gate rows from the words, nothing done unless they say go."""
    if n <= 0:
        return
    if dims and first_row:
        raise ValueError("forward_arrivals: read before the counts (dims), n is the capacity and the first row comes "
                         "from the device")
    if not (dsts and src and dst_rows and blocks and dst_idx_out):
        raise ValueError("forward_arrivals: null pointer")
    if num_blocks <= 0:
        raise ValueError("forward_arrivals: the block table needs at least one block")
    if not 0 < targets <= FORWARD_MAX_TARGETS:
        raise ValueError(f"forward_arrivals: {targets} local GPUs; 1 to {FORWARD_MAX_TARGETS} are supported")
    if (row_bytes <= 0 or row_bytes > src_stride or arrival_offset % 4 or arrival_offset < 0
            or arrival_offset + 4 > row_bytes or dest_rows_offset % 4 or dest_rows_offset < 0
            or dest_rows_offset + 4 * targets > src_stride):
        raise ValueError("forward_arrivals: the record layout does not hold the arrival in the forwarded bytes and "
                         "the dest rows in the record")
    if not 0 <= first_row < n:
        raise ValueError("forward_arrivals: first_row outside the rows")
    if ready_words and (ready_rows < 0 or ready_epoch < 1):
        raise ValueError("forward_arrivals: ready words need rows >= 0 and an epoch >= 1")
    if _stopped(stop_flag, stop_generation):
        return
    if dims:
        words = _at(dims, 8 * READ_DIMS, torch.int64).tolist()
        if not words[READ_GO]:
            return
        n, first_row = words[READ_ROWS], words[READ_FIRST_ROW]
        if gate is not None:
            gate.blocks = words[READ_BLOCKS]
        if n <= 0:
            return
    if gate is not None and not gate.wait_rows(list(range(first_row, n)) + list(range(first_row))):
        return
    records = _at(src, n * src_stride).as_strided((n, src_stride), (src_stride, 1))
    out = _at(dst_idx_out, 8 * n * targets, torch.int64).view(n, targets)
    table = _at(blocks, 8 * num_blocks * (1 + targets), torch.int64).view(num_blocks, 1 + targets)
    # the kernel's block_of_arrival: the first block whose end passes the row (the last one past the table's end)
    which = torch.bucketize(torch.arange(n), table[:, 0].contiguous(), right=True).clamp(max=num_blocks - 1)
    out.copy_(stamp_arrivals(records, arrival_offset, dest_rows_offset, targets, table[which, 1:]))
    forward_rows(dsts, dst_bases_or, dst_stride, dst_idx_out, targets, src, src_stride, n, row_bytes, dst_rows,
                 stream, err, stop_flag, stop_generation, rank, phase)
    if ready_words and not _stopped(stop_flag, stop_generation):  # (a failed forward marks nothing)
        at = _at(ready_words, 8 * targets, torch.int64).tolist()
        for j in range(targets):
            d = out[:, j]
            d = d[(d >= 0) & (d < ready_rows)]
            if len(d):
                _at(at[j], 4 * ready_rows, torch.int32)[d] = ready_epoch


def sum_node_partials(out_x: int, out_w: int, src: int, src_stride: int, row_of: int, zero: int, num_nodes: int,
                      num_tokens: int, payload_bytes: int, num_weights: int, fp32: bool, stream: int,
                      out_x_stride: int = 0, out_w_stride: int = 0, gate: "ArrivalGate | None" = None) -> None:
    """sum_node_partials_kernel: per token, the payloads of rows row_of[m, t] (-1: the zero row) added in fp32 in
    ascending node m and rounded once to bf16 (fp32 with ``fp32``); the fp32 weights behind them summed the same way;
    output rows ``out_x_stride`` / ``out_w_stride`` bytes apart (0: back to back)."""
    if num_tokens <= 0:
        return
    if payload_bytes <= 0 or any(v % 16 for v in (payload_bytes, src_stride, src, out_x, zero)):
        raise ValueError("sum_node_partials: payload bytes, stride and pointers must be multiples of 16")
    dtype = torch.float32 if fp32 else torch.bfloat16
    H = payload_bytes // dtype.itemsize
    rows = _at(row_of, 4 * num_nodes * num_tokens, torch.int32).view(num_nodes, num_tokens).to(torch.int64)
    if gate is not None and not gate.wait_rows(rows[rows >= 0].tolist()):
        return  # reported; the kernel's tiles return without writing
    acc_x = torch.zeros((num_tokens, H))
    acc_w = torch.zeros((num_tokens, num_weights))
    n = int(rows.max()) + 1 if rows.numel() else 0
    if n > 0:
        width = payload_bytes + 4 * num_weights
        table = _at(src, (n - 1) * src_stride + width).as_strided((n, width), (src_stride, 1))
        for m in range(num_nodes):  # ascending node, as the kernel's warp_sum_rows
            have = (rows[m] >= 0).unsqueeze(1)
            vals = table[rows[m].clamp(min=0)]
            acc_x += torch.where(have, vals[:, :payload_bytes].contiguous().view(dtype).float(), 0.0)
            if num_weights:
                acc_w += torch.where(have, vals[:, payload_bytes:].contiguous().view(torch.float32), 0.0)
    xs = out_x_stride if out_x_stride > 0 else payload_bytes
    ws = out_w_stride if out_w_stride > 0 else 4 * num_weights
    _at(out_x, (num_tokens - 1) * xs + payload_bytes).as_strided((num_tokens, payload_bytes), (xs, 1)).copy_(
        acc_x.to(dtype).view(torch.uint8).view(num_tokens, payload_bytes))
    if num_weights:
        _at(out_w, (num_tokens - 1) * ws + 4 * num_weights).as_strided((num_tokens, 4 * num_weights), (ws, 1)).copy_(
            acc_w.view(torch.uint8).view(num_tokens, 4 * num_weights))


def gather_rows_by_arrival(out: int, targets: int, max_arrivals: int, row_ends: int, num_sources: int, arrival: int,
                           num_rows: int, stream: int, err: int = 0, stop_flag: int = 0, stop_generation: int = 0,
                           rank: int = -1, phase: int = 0) -> None:
    """gather_rows_by_arrival_kernel: out (int32 [targets, max_arrivals]) -1, then out[f, arrival[r]] = r with f the
    local index of row r's source (source_local_of_rows, the torch definition); an arrival out of range is reported
    and not written."""
    if targets < 1 or max_arrivals < 0 or num_rows < 0 or num_sources < 0:
        raise ValueError("gather_rows_by_arrival: needs targets >= 1 and no negative size")
    if not out or (num_rows > 0 and (not row_ends or not arrival or num_sources < 1)):
        raise ValueError("gather_rows_by_arrival: null pointer (or rows without sources)")
    table = _at(out, 4 * targets * max_arrivals, torch.int32).view(targets, max_arrivals) if max_arrivals else None
    if table is not None:
        table.fill_(-1)
    if num_rows == 0:
        return
    ends = _at(row_ends, 8 * num_sources, torch.int64)
    local = source_local_of_rows(ends, num_rows, targets)
    a = _at(arrival, 8 * num_rows, torch.int64)
    for r in range(num_rows):
        if r >= int(ends[-1]) or not 0 <= int(a[r]) < max_arrivals:  # (past every source's rows, or the arrivals)
            _report(err, (stop_flag, stop_generation), ERROR_CODES["scatter_range"], rank, int(local[r]), r, phase,
                    int(a[r]), max_arrivals)
            continue
        table[int(local[r]), int(a[r])] = r


def forward_sum_rows(out: int, targets: int, num_arrivals: int, rows_per_block: int, fwd_dest_rows: int,
                     stream: int) -> None:
    """forward_sum_rows_kernel: out (int32 [targets, A])[j, a] = j * rows_per_block + a where fwd_dest_rows (int64
    [A, targets])[a, j] >= 0, else -1 (the torch form the combine used before session 43)."""
    if targets < 1 or num_arrivals < 0 or num_arrivals > rows_per_block:
        raise ValueError("forward_sum_rows: needs targets >= 1 and 0 <= arrivals <= rows_per_block")
    if num_arrivals == 0:
        return
    if not out or not fwd_dest_rows:
        raise ValueError("forward_sum_rows: null pointer")
    dest = _at(fwd_dest_rows, 8 * num_arrivals * targets, torch.int64).view(num_arrivals, targets)
    rows = torch.arange(targets * rows_per_block, dtype=torch.int32).view(targets, rows_per_block)[:, :num_arrivals]
    _at(out, 4 * targets * num_arrivals, torch.int32).view(targets, num_arrivals).copy_(
        torch.where(dest.t() >= 0, rows, -1))


def gather_tiles(dsts: int, flags: int, targets: int, by_arrival: int, max_arrivals: int, arrivals: int,
                 tile_rows: int, x: int, payload_bytes: int, w: int, num_weights: int, num_rows: int, dst_stride: int,
                 epoch: int, stream: int, err: int = 0, stop_flag: int = 0, stop_generation: int = 0, rank: int = -1,
                 phase: int = 0, blocks: int = 0, own_ranges: int = 0) -> None:
    """gather_tiles_kernel: for each forwarder f, our rows by_arrival[f, a] of x (and the fp32 weights w) to row a of
    dsts[f], then flag t of flags[f] (int32) set to ``epoch`` for each of its tiles -- every copy of a forwarder lands
    before its flags, as the kernel's release orders them; an index >= num_rows is reported, not copied. ``blocks``
    (the grid) and ``own_ranges`` (the pack's order of the tiles) change only the order on a GPU."""
    if blocks < 0:
        raise ValueError("gather_tiles: blocks must be >= 0 (0: one per tile, up to 1024)")
    if max_arrivals <= 0 or targets <= 0:
        return
    if not (dsts and flags and by_arrival and arrivals) or (not x and num_rows > 0):
        raise ValueError("gather_tiles: null pointer")
    if tile_rows < 1 or -(-max_arrivals // tile_rows) > GATHER_MAX_TILES:
        raise ValueError(f"gather_tiles: {max_arrivals} arrivals in tiles of {tile_rows} rows need more than "
                         f"{GATHER_MAX_TILES} flags")
    if (payload_bytes <= 0 or payload_bytes % 4 or dst_stride % 16
            or dst_stride < payload_bytes + 4 * num_weights or (num_weights > 0 and num_rows > 0 and (not w or w % 4))):
        raise ValueError("gather_tiles: the payload (a multiple of 4 bytes) and the 4-byte aligned fp32 weights must "
                         "fit a row of dst_stride (a multiple of 16) bytes")
    if epoch < 1:
        raise ValueError("gather_tiles: epochs start at 1 (the flags start at 0)")
    if _stopped(stop_flag, stop_generation):
        return
    blocks = _at(dsts, 8 * targets, torch.int64).tolist()
    flag_rows = _at(flags, 8 * targets, torch.int64).tolist()
    counts = _at(arrivals, 8 * targets, torch.int64).tolist()
    index = _at(by_arrival, 4 * targets * max_arrivals, torch.int32).view(targets, max_arrivals).to(torch.int64)
    src_x = _at(x, num_rows * payload_bytes).view(num_rows, payload_bytes) if num_rows else None
    src_w = _at(w, 4 * num_rows * num_weights).view(num_rows, 4 * num_weights) if num_rows and num_weights else None
    for f in range(targets):
        n = counts[f]
        if n <= 0:
            continue
        r = index[f, :n]
        bad = r >= num_rows
        if bool(bad.any()):
            a = int(bad.nonzero()[0])
            _report(err, (stop_flag, stop_generation), ERROR_CODES["scatter_range"], rank, f, a, phase, int(r[a]),
                    num_rows)
        ok = (r >= 0) & ~bad
        if bool(ok.any()):
            at = ok.nonzero().squeeze(1)
            out = _at(blocks[f], (n - 1) * dst_stride + payload_bytes + 4 * num_weights).as_strided(
                (n, payload_bytes + 4 * num_weights), (dst_stride, 1))
            out[at, :payload_bytes] = src_x[r[at]]
            if src_w is not None:
                out[at, payload_bytes:] = src_w[r[at]]
        if _stopped(stop_flag, stop_generation):  # (a corrupt index above stopped the rank: no flag after it)
            return
        _at(flag_rows[f], 4 * -(-n // tile_rows), torch.int32).fill_(epoch)


def raise_flags(flags: int, n: int, epoch: int, stream: int, stop_flag: int = 0, stop_generation: int = 0,
                go: int = 0) -> None:
    """raise_flags_kernel: the int32 at each of the n addresses in flags set to ``epoch`` (after everything this
    process wrote before: program order), none while the stop flag holds ``stop_generation``, nor when the int64
    word at ``go`` (0: none) is 0."""
    if n <= 0:
        return
    if not flags or n > 1024 or epoch < 1:
        raise ValueError("raise_flags: 1..1024 flag addresses and an epoch >= 1")
    if _stopped(stop_flag, stop_generation) or (go and not int(_at(go, 8, torch.int64)[0])):
        return
    for at in _at(flags, 8 * n, torch.int64).tolist():
        ctypes.c_int32.from_address(at).value = epoch


def count_row(out: int, is_token_in_rank: int, num_tokens: int, num_ranks: int, ranks_per_node: int,
              tokens_per_expert: int, tpe_int64: bool, num_experts: int, stream: int,
              send_plan: Optional[Tuple[int, int, int, int]] = None) -> None:
    """count_row_kernel (csrc/kernels/internode_plan.cu): internode.plan.local_count_row written at ``out``; with
    ``send_plan`` (the four tables' addresses) also our send plan, as send_plan with node_base 0."""
    T, R = num_tokens, num_ranks
    itr = _at(is_token_in_rank, T * R, torch.bool).view(T, R)
    tpe = _at(tokens_per_expert, (8 if tpe_int64 else 4) * num_experts,
              torch.int64 if tpe_int64 else torch.int32) if num_experts else None
    row = local_count_row(itr, ranks_per_node, tpe)
    _at(out, 8 * row.numel(), torch.int64).copy_(row)
    if send_plan is not None:
        _write_send_plan(is_token_in_rank, T, R, ranks_per_node, 0, *send_plan)


def send_plan(is_token_in_rank: int, num_tokens: int, num_ranks: int, ranks_per_node: int, node_base: int,
              dest_row_all: int, hop1_token: int, dest_rows: int, row_of: int, stream: int) -> None:
    """send_plan_kernel: internode.plan.send_plan's device tables, from the node bases the host passes (0: counted
    from the tokens)."""
    _write_send_plan(is_token_in_rank, num_tokens, num_ranks, ranks_per_node, node_base, dest_row_all, hop1_token,
                     dest_rows, row_of)


def _write_send_plan(is_token_in_rank: int, num_tokens: int, num_ranks: int, ranks_per_node: int, node_base: int,
                     dest_row_all: int, hop1_token: int, dest_rows: int, row_of: int) -> None:
    """The tables of internode.plan.send_plan, from counts that give these node bases (this rank = 1)."""
    T, R, G = num_tokens, num_ranks, ranks_per_node
    N = R // G
    if T <= 0:
        return
    itr = _at(is_token_in_rank, T * R, torch.bool).view(T, R)
    node_send = itr.view(T, N, G).any(2).sum(0).to(torch.int64)
    counted = torch.cumsum(node_send, 0) - node_send
    if node_base and not torch.equal(_at(node_base, 8 * N, torch.int64), counted):
        raise ValueError("send_plan: node_base is not the running sum of the records per node")
    counts = Counts(torch.zeros((2, R), dtype=torch.int64),
                    torch.stack([torch.zeros(N, dtype=torch.int64), node_send]))
    plan = _send_plan(itr, counts, 1, G)
    S1 = plan.hop1_token.numel()
    _at(dest_row_all, 8 * T * R, torch.int64).copy_(plan.dest_row_all.reshape(-1))
    _at(hop1_token, 8 * S1, torch.int64).copy_(plan.hop1_token)
    _at(dest_rows, 8 * S1 * G, torch.int64).copy_(plan.dest_rows.reshape(-1))
    _at(row_of, 4 * N * T, torch.int32).copy_(plan.row_of.reshape(-1))


def pack_records(send: int, own_dst: int, own_first: int, own_count: int, stride: int, hop1_token: int,
                 dest_rows: int, ranks_per_node: int, num_records: int, columns: list, src_idx_offset: int,
                 dest_rows_offset: int, stream: int, node_counts: int = 0, num_nodes: int = 0, skip_node: int = -1,
                 send_limit: int = -1, own_dims: int = 0) -> None:
    """pack_records_kernel: internode.plan.pack_records, the records [own_first, own_first + own_count) at
    ``own_dst`` instead of ``send``; with ``node_counts``, the records counted from them (num_records: the tables'
    capacity), node ``skip_node``'s not written, and none when all pass ``send_limit`` bytes. With ``own_dims``
    (forward_from_count_rows' forward words): only our own node's records, their range from the words, to own_dst
    from the words' first row on, none unless the words say go."""
    n, G = num_records, ranks_per_node
    if own_dims:
        if node_counts or send or not own_dst or own_first or own_count:
            raise ValueError("pack_records: our own records placed from the words (own_dims) go to own_dst only, "
                             "their range from the words")
        words = _at(own_dims, 8 * READ_DIMS, torch.int64).tolist()
        if not words[READ_GO] or not words[READ_OWN_COUNT] or n <= 0:
            return
        lo, count = words[READ_OWN_FIRST], words[READ_OWN_COUNT]
        out = _packed(hop1_token, dest_rows, G, lo + count, columns, src_idx_offset, dest_rows_offset, stride)
        _at(own_dst + words[READ_FIRST_ROW] * stride, count * stride).view(count, stride).copy_(out[lo:])
        return
    if node_counts:
        if not 0 <= skip_node < num_nodes:
            raise ValueError("pack_records: skip_node must name one of the num_nodes nodes")
        if send_limit < 0:
            raise ValueError("pack_records: negative send_limit")
        if own_dst or own_first or own_count:
            raise ValueError("pack_records: records counted on the device skip our own node's (no own_dst)")
        if n <= 0:
            return
        c = _at(node_counts, 8 * num_nodes, torch.int64).tolist()
        if sum(c) * stride > send_limit:
            return
        own_first, own_count, n = sum(c[:skip_node]), c[skip_node], min(n, sum(c))
    if n <= 0:
        return
    out = _packed(hop1_token, dest_rows, G, n, columns, src_idx_offset, dest_rows_offset, stride)
    # as the kernel: record r is our own node's when own_first <= r < own_first + own_count, which may lie partly or
    # wholly outside [0, n) (a launch over a range of the records), and goes to own_dst + (r - own_first) * stride
    lo, hi = max(own_first, 0), min(own_first + own_count, n)
    keep = torch.ones(n, dtype=torch.bool)
    keep[lo:max(lo, hi)] = False
    rows = _at(send, n * stride).view(n, stride)
    rows[keep] = out[keep]
    if hi > lo and own_dst:  # without own_dst (counted on the device): not written
        _at(own_dst + (lo - own_first) * stride, (hi - lo) * stride).view(hi - lo, stride).copy_(out[lo:hi])


def _packed(hop1_token: int, dest_rows: int, G: int, n: int, columns: list, src_idx_offset: int,
            dest_rows_offset: int, stride: int) -> torch.Tensor:
    """Records 0..n-1 of the send plan at ``hop1_token`` / ``dest_rows`` as pack_records writes them (uint8 [n,
    stride])."""
    tokens = _at(hop1_token, 8 * n, torch.int64).clone()
    T = int(tokens.max()) + 1
    cols = [_at(src, T * nb).view(T, nb) for src, nb, _ in columns]
    layout = RecordLayout(tuple(off for _, _, off in columns), tuple(nb for _, nb, _ in columns), src_idx_offset,
                          src_idx_offset + 4, dest_rows_offset, 0, stride)
    plan = SimpleNamespace(hop1_token=tokens, dest_rows=_at(dest_rows, 8 * n * G, torch.int64).view(n, G).clone())
    out = torch.empty((n, stride), dtype=torch.uint8)
    _pack_records(out, cols, plan, layout)
    return out


def _rows_ready(ready_words: int, num_rows: int, epoch: int, timeout_secs: float, err: int, stop_flag: int,
                stop_generation: int, rank: int, phase: int) -> bool:
    """Whether every one of ``num_rows`` ready words (int32) reached ``epoch`` (a reader beside the dispatch
    forward); a word still short after ``timeout_secs`` is reported (``row_not_ready``: the row, its word, the epoch)
    and False returned, as when the rank stopped."""
    start = time.monotonic()
    while num_rows:
        words = _at(ready_words, 4 * num_rows, torch.int32)
        short = (words < epoch).nonzero()
        if not len(short):
            break
        if _stopped(stop_flag, stop_generation):
            return False
        if time.monotonic() - start > timeout_secs:
            r = int(short[0])
            _report(err, (stop_flag, stop_generation), ERROR_CODES["row_not_ready"], rank, -1, r, phase, int(words[r]),
                    epoch)
            return False
        time.sleep(1e-4)
    return True


def unpack_records(src: int, src_stride: int, num_rows: int, out_rows: int, columns: list, ids_out: int,
                   weights_out: int, ids_offset: int, weights_offset: int, num_topk: int, expert_lo: int,
                   experts_per_rank: int, src_idx_offset: int, src_idx_out: int, arrival_offset: int,
                   arrival_out: int, stream: int, gate: "ArrivalGate | None" = None, first_row: int = 0,
                   dims: int = 0, pad: bool = False, own: "tuple | None" = None, ready_words: int = 0,
                   ready_epoch: int = 0, ready_timeout_secs: float = 0.0, ready_blocks: int = 0, err: int = 0,
                   stop_flag: int = 0, stop_generation: int = 0, rank: int = -1, phase: int = 0) -> None:
    """unpack_records_kernel: the final rows' columns into their outputs (zero rows up to ``out_rows``); global
    expert ids made local (-1 elsewhere), the weights of foreign ids zeroed; the int32 src_idx / arrival fields
    widened to int64 (a negative arrival offset: the row index). ``first_row`` only orders the kernel's reads: checked
    here, then all rows are read at once. ``own`` (first row, count, first record, tokens, columns): our own rows,
    never packed, read from the columns (_with_own_rows). ``dims`` (gate_from_count_rows' words): read before the
    counts -- the rows, the gate's blocks and our own rows' place from the device, nothing done unless the words say
    go, padding only with ``pad``. ``ready_words`` (the unpack beside the dispatch forward): nothing is read before
    every row's word (int32, ours) holds ``ready_epoch``, which the forwarders release; a word still short after
    ``ready_timeout_secs`` is reported (``row_not_ready``: the row, its word, the epoch) and nothing is written."""
    if out_rows < num_rows:
        raise ValueError("unpack_records: fewer output rows than rows")
    if ready_words and (gate is not None or own is not None or ready_epoch < 1):
        raise ValueError("unpack_records: ready words (the unpack beside the dispatch forward) need an epoch >= 1, no "
                         "gate and no own rows from the columns")
    if ready_words and dims:  # (read before the counts: the rows from the words, nothing unless they say go)
        words = _at(dims, 8 * READ_DIMS, torch.int64).tolist()
        if not words[READ_GO]:
            return
        num_rows = words[READ_ROWS]
    if ready_words and not _rows_ready(ready_words, num_rows, ready_epoch, ready_timeout_secs, err, stop_flag,
                                       stop_generation, rank, phase):
        return
    if not 0 <= first_row <= num_rows:
        raise ValueError(f"unpack_records: first_row {first_row} outside 0..{num_rows}")
    if dims and (first_row or bool(own) == (arrival_offset >= 0)):
        raise ValueError("unpack_records: read before the counts takes no first_row (it comes from the device), and "
                         "our own rows' tokens with one GPU per node (arrival = row), none with several (the final "
                         "rows, after the forward)")
    n = num_rows
    if own is not None and not dims and own[0] + own[1] > num_rows:
        raise ValueError("unpack_records: our own rows end past the rows")
    if dims:
        words = _at(dims, 8 * READ_DIMS, torch.int64).tolist()
        if not words[READ_GO]:
            return
        n = words[READ_ROWS]
        out_rows = out_rows if pad else n
        if own is not None:
            own = (words[READ_FIRST_ROW], words[READ_OWN_COUNT], words[READ_OWN_FIRST]) + tuple(own[3:])
        if gate is not None:
            gate.blocks = words[READ_BLOCKS]
    if gate is not None and not gate.wait_rows(range(n)):
        return
    rows = _at(src, (n - 1) * src_stride + src_stride).as_strided((n, src_stride), (src_stride, 1)) if n else None
    fields = [(ids_offset, 8 * num_topk if ids_out else 0), (weights_offset, 4 * num_topk if weights_out else 0)]
    rows = _with_own_rows("unpack_records", rows, own, src_idx_offset, arrival_offset,
                          fields + [(off, nb) for _, nb, off in columns])

    def field(off: int, nb: int) -> torch.Tensor:
        return rows[:, off:off + nb].contiguous() if n else torch.empty((0, nb), dtype=torch.uint8)

    for dst, nb, off in columns:
        out = _at(dst, out_rows * nb).view(out_rows, nb)
        out[:n] = field(off, nb)
        out[n:] = 0
    K = num_topk
    if K and ids_out:
        g = field(ids_offset, 8 * K).view(torch.int64).view(n, K)
        local = (g >= expert_lo) & (g < expert_lo + experts_per_rank)
        ids = _at(ids_out, 8 * out_rows * K, torch.int64).view(out_rows, K)
        ids[:n] = torch.where(local, g - expert_lo, torch.full_like(g, -1))
        ids[n:] = -1
        if weights_out:
            w = field(weights_offset, 4 * K).view(torch.float32).view(n, K)
            ws = _at(weights_out, 4 * out_rows * K, torch.float32).view(out_rows, K)
            ws[:n] = torch.where(local, w, torch.zeros_like(w))
            ws[n:] = 0
    for off, out in ((src_idx_offset, src_idx_out), (arrival_offset, arrival_out)):
        if out and n:
            val = torch.arange(n) if off < 0 else field(off, 4).view(torch.int32).view(-1).to(torch.int64)
            _at(out, 8 * n, torch.int64).copy_(val)


def expert_major_places(count_rows: int, row_words: int, num_ranks: int, num_nodes: int, rank: int,
                        num_local_experts: int, alignment: int, places: int, info: int, stream: int, dims: int = 0,
                        capacity_rows: int = -1) -> None:
    """expert_major_places_kernel: from every rank's count row, internode.plan.expert_major_places' table and the
    plan's sizes (int32 [rows received, 0, pairs per local expert]), with the kernel's checks; with ``dims``, their go
    word cleared when the padded segments pass ``capacity_rows``."""
    if dims and capacity_rows < 0:
        raise ValueError("expert_major_places: give the expert-major outputs' capacity with dims")
    R, N, L = num_ranks, num_nodes, num_local_experts
    if not (R >= 1 and N >= 1 and 0 <= rank < R):
        raise ValueError("expert_major_places: rank outside the group")
    if not 1 <= L <= 4096 or alignment < 1:
        raise ValueError("expert_major_places: 1..4096 local experts and an alignment >= 1")
    if row_words < R + N + R * L:
        raise ValueError("expert_major_places: the count rows carry no per-expert counts for every rank's experts")
    rows = _at(count_rows, 8 * R * row_words, torch.int64).view(R, row_words)
    col = R + N + rank * L
    sent = rows[:, col:col + L].clone()  # [R, L]
    raw = sent.sum(0)
    aligned = (raw + alignment - 1) // alignment * alignment
    seg = torch.cumsum(aligned, 0) - aligned
    first = seg[None, :] + torch.cumsum(sent, 0) - sent
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(rows[:, rank], 0)])
    _at(places, 8 * (R + 1 + 2 * R * L), torch.int64).copy_(
        torch.cat([starts, torch.stack([first, sent], -1).reshape(-1)]))
    _at(info, 4 * (L + 2), torch.int32).copy_(torch.cat([starts[-1:], torch.zeros(1, dtype=torch.int64), raw]))
    if dims and int(aligned.sum()) > capacity_rows:
        _at(dims, 8 * READ_DIMS, torch.int64)[READ_GO] = 0


def _with_own_rows(what: str, rows: "torch.Tensor | None", own: "tuple | None", src_idx_offset: int,
                   arrival_offset: int, fields: list) -> "torch.Tensor | None":
    """The final rows as a reader given ``own`` (first row, count, first record, tokens, columns: internode_plan.hpp
    OwnRows) sees them: our own rows replaced by the records our columns make at their tokens (src_idx: the token),
    never read from the arrivals; checked as the kernels check: one GPU per node, every field taken (``fields``:
    (offset, bytes), 0 bytes: not taken) within one column."""
    if own is None:
        return rows
    first_row, count, first_record, tokens_at, columns = own
    if not tokens_at:
        raise ValueError("own rows: give the send list's tokens")
    if arrival_offset >= 0:
        raise ValueError(f"{what}: own rows from the columns only with one GPU per node (arrival = row)")
    for off, nb in fields:
        if nb > 0 and not any(ptr and c_off <= off and off + nb <= c_off + c_nb for ptr, c_nb, c_off in columns):
            raise ValueError(f"{what}: the record's field at byte {off} ({nb} bytes) lies in none of the own columns")
    if not count:
        return rows
    tokens = _at(tokens_at + 8 * first_record, 8 * count, torch.int64).clone()
    T = int(tokens.max()) + 1
    rows = rows.clone()
    rows[first_row:first_row + count] = 0xA5  # nothing of the arrivals' own block may reach an output
    for ptr, nb, off in columns:
        rows[first_row:first_row + count, off:off + nb] = _at(ptr, T * nb).view(T, nb)[tokens]
    rows[first_row:first_row + count, src_idx_offset:src_idx_offset + 4] = \
        tokens.to(torch.int32).view(-1, 1).view(torch.uint8)
    return rows


def expert_major_receive(src: int, src_stride: int, num_rows: int, x_offset: int, x_bytes: int, scales_offset: int,
                         num_scales: int, out_x: int, out_scales: int, expert_rows: int, topk: int,
                         slots_given: bool, slot_of: int, ids_offset: int, weights_offset: int, ranks_offset: int,
                         expert_lo: int, num_local_experts: int, num_sources: int, source_rows: int, places: int,
                         em_token: int, em_slot: int, em_expert: int, em_weights: int, src_idx_offset: int,
                         src_idx_out: int, arrival_offset: int, arrival_out: int, stream: int,
                         gate: "ArrivalGate | None" = None, first_row: int = 0, own: "tuple | None" = None,
                         dims: int = 0, ready_words: int = 0, ready_epoch: int = 0, ready_timeout_secs: float = 0.0,
                         ready_blocks: int = 0, err: int = 0, stop_flag: int = 0, stop_generation: int = 0,
                         rank: int = -1, phase: int = 0) -> None:
    """expert_major_receive_kernel: each final row's payload to the expert-major rows of its local experts, placed
    from the record's ids and pair ranks (the plan's columns and slot_of written), or from slot_of when given;
    src_idx / arrival, ``own``, ``dims`` and the ready words as unpack_records. Waits for every row first when gated
    or given ready words (``first_row`` only orders reads)."""
    def bad(what: str) -> None:
        raise ValueError(f"expert_major_receive: {what}")
    if not 0 <= topk <= fake_expert_major.MAX_TOPK:
        bad(f"top-k must be 0..{fake_expert_major.MAX_TOPK}")
    if not 0 <= first_row <= num_rows:
        bad(f"first_row {first_row} outside 0..{num_rows}")
    if x_bytes % 16 or x_offset % 16 or src_stride % 16 or src % 16 or out_x % 16:
        bad("payload rows must be a multiple of 16 bytes at 16-byte aligned addresses")
    if not slots_given:
        if ids_offset < 0 or ids_offset % 8 or ranks_offset < 0 or ranks_offset % 4 or \
                (em_weights and (weights_offset < 0 or weights_offset % 4)):
            bad("the records need the ids (8-byte aligned), the pair ranks and, with em_weights, the weights")
    if ready_words and (gate is not None or own is not None or ready_epoch < 1):
        bad("ready words (the receive beside the dispatch forward) need an epoch >= 1, no gate and no own rows from "
            "the columns")
    if dims and (first_row or slots_given or bool(own) == (arrival_offset >= 0)):
        bad("read before the counts takes no first_row (it comes from the device) and no slots, and our own rows' "
            "tokens with one GPU per node (arrival = row), none with several (the final rows, after the forward)")
    n, P, K = num_rows, expert_rows, topk
    if n <= 0:
        return  # (a rank that receives nothing has empty, null, outputs)
    if dims:
        words = _at(dims, 8 * READ_DIMS, torch.int64).tolist()
        if not words[READ_GO]:
            return
        n = words[READ_ROWS]
        if own is not None:
            own = (words[READ_FIRST_ROW], words[READ_OWN_COUNT], words[READ_OWN_FIRST]) + tuple(own[3:])
        if gate is not None:
            gate.blocks = words[READ_BLOCKS]
        if n == 0:
            return
    if not slots_given:
        if num_sources < 1 or num_local_experts < 1 or not source_rows or not places:
            bad("give the sources' first rows and the places of their pairs")
        if not (em_token and em_slot and em_expert):
            bad("give em_token, em_slot and em_expert")
    if own is not None and own[0] + own[1] > n:
        bad("our own rows end past the rows")
    if gate is not None and not gate.wait_rows(range(n)):
        return
    if ready_words and not _rows_ready(ready_words, n, ready_epoch, ready_timeout_secs, err, stop_flag,
                                       stop_generation, rank, phase):
        return
    rows = _at(src, (n - 1) * src_stride + src_stride).as_strided((n, src_stride), (src_stride, 1))
    fields = [(x_offset, x_bytes), (scales_offset, 4 * num_scales if out_scales else 0)]
    if not slots_given:
        fields += [(ids_offset, 8 * K), (ranks_offset, 4 * K), (weights_offset, 4 * K if em_weights else 0)]
    rows = _with_own_rows("expert_major_receive", rows, own, src_idx_offset, arrival_offset, fields)
    so = _at(slot_of, 4 * n * K, torch.int32).view(n, K)
    if not slots_given:
        ids = rows[:, ids_offset:ids_offset + 8 * K].contiguous().view(torch.int64) - expert_lo
        ranks = rows[:, ranks_offset:ranks_offset + 4 * K].contiguous().view(torch.int32).to(torch.int64)
        starts = _at(source_rows, 8 * (num_sources + 1), torch.int64)
        L = num_local_experts
        table = _at(places, 16 * num_sources * L, torch.int64).view(num_sources, L, 2)
        source = torch.searchsorted(starts, torch.arange(n), right=True) - 1
        local = (ids >= 0) & (ids < L)
        e = ids.clamp(0, L - 1)
        first, count = table[source.unsqueeze(1), e, 0], table[source.unsqueeze(1), e, 1]
        p = first + ranks
        ok = local & (ranks >= 0) & (ranks < count) & (p < P)
        so.copy_(torch.where(ok, p, -1).to(torch.int32))
        r, k = ok.nonzero(as_tuple=True)
        q = p[r, k]
        _at(em_token, 8 * P, torch.int64)[q] = r
        _at(em_slot, 8 * P, torch.int64)[q] = k
        _at(em_expert, 8 * P, torch.int64)[q] = e[r, k]
        if em_weights:
            w = rows[:, weights_offset:weights_offset + 4 * K].contiguous().view(torch.float32)
            _at(em_weights, 4 * P, torch.float32)[q] = w[r, k]
    slots = so.to(torch.int64)
    r, k = (slots >= 0).nonzero(as_tuple=True)
    q = slots[r, k]
    _at(out_x, P * x_bytes).view(P, x_bytes)[q] = rows[r, x_offset:x_offset + x_bytes]
    if out_scales and num_scales:
        _at(out_scales, 4 * P * num_scales).view(P, 4 * num_scales)[q] = \
            rows[r, scales_offset:scales_offset + 4 * num_scales]
    for off, out in ((src_idx_offset, src_idx_out), (arrival_offset, arrival_out)):
        if out:
            val = torch.arange(n) if off < 0 else rows[:, off:off + 4].contiguous().view(torch.int32).view(-1)
            _at(out, 8 * n, torch.int64).copy_(val.to(torch.int64))


def _read_bases(what: str, counter_bases: list, table: int, want: int, sources: str) -> list:
    """read_bases (internode_plan.cu): ``want`` counter bases by value (at most READ_MAX_COUNTERS) or, with
    ``counter_bases`` empty, from the device table at ``table`` (read when the kernel runs)."""
    if table:
        if counter_bases:
            raise ValueError(f"{what}: give the counter bases by value or in counter_bases_table, not both")
        return _at(table, 8 * want, torch.int64).tolist()
    if len(counter_bases) != want or len(counter_bases) > READ_MAX_COUNTERS:
        raise ValueError(f"{what}: give {sources} x lanes counter bases, at most {READ_MAX_COUNTERS} by value (more: "
                         f"counter_bases_table), got {len(counter_bases)}")
    return list(counter_bases)


def gate_from_count_rows(count_rows: int, row_words: int, num_ranks: int, rank: int, num_lanes: int,
                         counter_bases: list, stride: int, send_limit: int, receive_bytes: int, capacity_rows: int,
                         table_out: int, dims_out: int, stream: int, counter_bases_table: int = 0) -> None:
    """gate_from_count_rows_kernel: internode.plan.read_before_counts on the count rows at ``count_rows``; the gate
    table to ``table_out``, the words to ``dims_out``."""
    if num_ranks < 1 or not 0 <= rank < num_ranks or num_lanes < 1:
        raise ValueError(f"gate_from_count_rows: rank outside 0..{num_ranks - 1} or no lane")
    if row_words < 2 * num_ranks:
        raise ValueError("gate_from_count_rows: a count row has at least ranks + nodes words (one GPU per node: "
                         "2 x ranks)")
    if not (count_rows and table_out and dims_out):
        raise ValueError("gate_from_count_rows: null count rows, table or dims")
    counter_bases = _read_bases("gate_from_count_rows", counter_bases, counter_bases_table, num_ranks * num_lanes,
                                "ranks")
    if stride <= 0 or capacity_rows < 0:
        raise ValueError("gate_from_count_rows: bad stride or capacity")
    R = num_ranks
    rows = _at(count_rows, 8 * R * row_words, torch.int64).view(R, row_words)
    table, dims = read_before_counts(rows[:, :R].clone(), rows[:, R:2 * R].clone(), rank, num_lanes,
                                     [int(b) for b in counter_bases], stride,
                                     send_limit, receive_bytes, capacity_rows)
    _at(dims_out, 8 * READ_DIMS, torch.int64).copy_(torch.tensor(dims, dtype=torch.int64))
    if table:
        _at(table_out, 8 * len(table) * len(table[0]), torch.int64).copy_(torch.tensor(table).view(-1))


def forward_from_count_rows(count_rows: int, row_words: int, num_ranks: int, ranks_per_node: int, rank: int,
                            num_lanes: int, counter_bases: list, stride: int, final_bytes: int, send_limit: int,
                            receive_bytes: int, final_limit: int, capacity_rows: int, ready_rows: int, table_out: int,
                            blocks_out: int, limits_out: int, dims_out: int, stream: int,
                            counter_bases_table: int = 0) -> None:
    """forward_from_count_rows_kernel: internode.plan.forward_before_counts on the count rows at ``count_rows``; the
    gate table, block table, final rows per local GPU and words to their outputs."""
    G = ranks_per_node
    if G < 2 or num_ranks % G or not 0 <= rank < num_ranks or num_lanes < 1:
        raise ValueError(f"forward_from_count_rows: several GPUs per node dividing the ranks, a rank in "
                         f"0..{num_ranks - 1} and a lane")
    R, N = num_ranks, num_ranks // G
    if row_words < R + N:
        raise ValueError("forward_from_count_rows: a count row has at least ranks + nodes words")
    if not (count_rows and table_out and blocks_out and limits_out and dims_out):
        raise ValueError("forward_from_count_rows: null count rows, table, blocks, limits or dims")
    counter_bases = _read_bases("forward_from_count_rows", counter_bases, counter_bases_table, N * num_lanes, "nodes")
    if stride <= 0 or final_bytes <= 0 or capacity_rows < 0 or ready_rows < 0:
        raise ValueError("forward_from_count_rows: bad stride, final row bytes, capacity or ready rows")
    rows = _at(count_rows, 8 * R * row_words, torch.int64).view(R, row_words)
    table, blocks, limits, words = forward_before_counts(
        rows[:, :R].clone(), rows[:, R:R + N].clone(), rank, G, num_lanes, [int(b) for b in counter_bases], stride,
        final_bytes, send_limit, receive_bytes, final_limit, capacity_rows, ready_rows)
    _at(dims_out, 8 * FORWARD_DIMS, torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
    _at(blocks_out, 8 * N * (1 + G), torch.int64).copy_(torch.tensor(blocks, dtype=torch.int64).view(-1))
    _at(limits_out, 8 * G, torch.int64).copy_(torch.tensor(limits, dtype=torch.int64))
    if table:
        _at(table_out, 8 * len(table) * len(table[0]), torch.int64).copy_(torch.tensor(table).view(-1))


def _encode_error(dst: int, nbytes: int, local: int, remote: int, slot: int, value: int) -> int:
    """encode_write_signal's checks on the kernel's unsigned casts: 0 or the command error (command.hpp)."""
    u64 = (1 << 64) - 1
    dst, slot, value = dst & 0xFFFFFFFF, slot & 0xFFFFFFFF, value & 0xFFFFFFFF
    nbytes, local, remote = nbytes & u64, local & u64, remote & u64
    checks = [(dst >= CMD_MAX_RANKS, 2), (nbytes % CMD_UNIT, 6), (nbytes > CMD_MAX_BYTES, 5), (local % CMD_UNIT, 8),
              (local > _MAX_OFFSET, 7), (remote % CMD_UNIT, 10), (remote > _MAX_OFFSET, 9),
              (slot >= CMD_MAX_SLOTS, 3), (value > CMD_MAX_VALUE, 4)]
    return next((e for bad, e in checks if bad), 0)


class ArrivalGate:
    """InternodeContext.arrival_gate: the counters behind every row of this call's arrivals. The table (device int64
    [blocks][GATE_COLUMNS + lanes]) is read when a gated kernel runs, as on the GPU."""

    def __init__(self, ctx: "InternodeContext", table: int, blocks: int, per_chunk: int, phase: int) -> None:
        if blocks < 0 or per_chunk < 1 or (blocks and not table):
            raise ValueError(f"arrival_gate: malformed arrival gate ({blocks} blocks, {per_chunk} records per chunk)")
        self._ctx, self._table, self._phase = ctx, table, phase
        self.blocks, self.lanes, self.per_chunk = blocks, ctx.num_fifos, per_chunk

    def wait_rows(self, rows) -> bool:
        """Wait until every row in ``rows`` has landed; False: a wait failed (reported) and nothing may be read."""
        width = GATE_COLUMNS + self.lanes
        table = _at(self._table, 8 * width * self.blocks, torch.int64).view(self.blocks, width).tolist() \
            if self.blocks else []
        need: dict = {}
        for r in rows:
            t = gate_threshold(int(r), table, self.per_chunk, self.lanes)
            if t is not None:
                need[t[0]] = max(need.get(t[0], 0), t[1])
        # a timeout names what the GPU's watcher waits for: the lane's last chunk (gate_lane_target)
        lane_target = {row[2] + f: gate_lane_target(row, f, self.per_chunk, self.lanes)
                       for row in table for f in range(self.lanes)}
        return self._ctx._wait_for(sorted(need.items()), self._phase, lane_target)


class InternodeContext:
    """One rank's regions, counters, error word and (synchronous) proxy. Same keyword arguments as the binding."""

    side_stream = 1  # the second stream's handle (every launch here runs at once: only the order of calls shows)

    def stream_wait(self, waiter: int, signaller: int) -> None:
        self.stream_waits.append((waiter, signaller))

    def __init__(self, **kw) -> None:
        missing, unknown = set(_CTOR_ARGS) - set(kw), set(kw) - set(_CTOR_ARGS) - _CTOR_OPTIONAL
        if missing or unknown:
            raise TypeError(f"InternodeContext: missing {sorted(missing)}, unknown {sorted(unknown)}")
        self.rank, self.world = int(kw["rank"]), int(kw["world"])
        self.cpus = [int(c) for c in kw["cpus"]]  # where the proxy threads would be pinned (no threads here)
        self.rdma_bytes, self.nvl_bytes = int(kw["rdma_bytes"]), int(kw["nvl_bytes"])
        self.num_signal_slots, self.num_threads = int(kw["num_signal_slots"]), int(kw["num_threads"])
        self.num_fifos = self.num_threads * int(kw["fifos_per_thread"])
        self.max_write_bytes = int(os.environ.get("FAKE_MAX_WRITE_BYTES", 1 << 30))  # the transport's write limit
        self._jitter = float(os.environ.get("FAKE_JITTER_SECS", 0))  # (the module docstring)
        self._jitter_draw = random.Random(f"{self.rank}-{os.getpid()}-{time.time_ns()}").random
        self.spin_blocks = 0  # no grid here; the backend sets it only for ranks that share a GPU
        self.stream_waits: list = []  # (waiter, signaller) of each stream_wait, in order
        self._timeout = float(kw["gpu_timeout_secs"])
        if self.rdma_bytes <= 0 or self.rdma_bytes % CMD_UNIT or self.rdma_bytes > CMD_MAX_REGION:
            raise ValueError(f"internode: RDMA region of {self.rdma_bytes} bytes must be a positive multiple of 16 "
                             "and at most 4 GiB (28-bit offsets in 16-byte units)")
        if self.nvl_bytes <= 0:
            raise ValueError("internode: NVL region must be > 0 bytes")
        if self.num_signal_slots % SLOT_PAGE:
            raise ValueError("internode: num_signal_slots must be a multiple of 512 (whole pages of counters)")
        self.transport_name, self.transport_in_order = str(kw.get("transport", "loopback")), True
        _sweep_leftovers()
        tag = f"{_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._names = {k: f"{tag}-{k}" for k in ("rdma", "sig", "nvl")}
        self._sig_bytes = 8 * self.num_signal_slots * self.world
        self._rdma = _map(self._names["rdma"], self.rdma_bytes, True)
        self._sig = _map(self._names["sig"], self._sig_bytes, True).view(torch.int64).view(-1, self.world)
        self._nvl = _map(self._names["nvl"], self.nvl_bytes, True)
        _unlink_later.extend([self._names["rdma"], self._names["sig"]])
        self._err = ErrorWord()
        self._stop, self._generation = ctypes.c_int32(0), 1  # the kernels' stop flag (device memory there)
        self._peers: list = []  # rank -> (RDMA region, counters [slots, writer]) once connected
        self._opened: list = []
        self._lane_cmds = [0] * self.num_fifos
        self._totals = dict(commands=0, writes_posted=0, signals_applied=0, max_inflight_writes=0,
                            max_inflight_bytes=0, max_reorder_held=0)
        self._perr, self._started, self._destroyed = "", False, False

    rdma_ptr = property(lambda self: self._rdma.data_ptr())
    nvl_ptr = property(lambda self: self._nvl.data_ptr())
    error_word_ptr = property(lambda self: ctypes.addressof(self._err))
    stop_flag_ptr = property(lambda self: ctypes.addressof(self._stop))
    stop_generation = property(lambda self: self._generation)

    # ---- bootstrap
    def nvl_ipc_handle(self) -> bytes:
        return self._names["nvl"].encode()

    def open_nvl_peers(self, handles: List[bytes], own_index: int) -> List[int]:
        out = []
        for i, h in enumerate(handles):
            if i == own_index:
                out.append(self.nvl_ptr)
                continue
            self._opened.append(_map(bytes(h).decode(), self.nvl_bytes, False))
            out.append(self._opened[-1].data_ptr())
        return out

    def proxy_local_info(self, thread: int) -> bytes:
        return json.dumps({"rank": self.rank, "thread": thread, "rdma": self._names["rdma"], "sig": self._names["sig"],
                           "rdma_bytes": self.rdma_bytes}).encode()

    def proxy_connect(self, infos: List[List[bytes]]) -> None:
        if len(infos) != self.num_threads or any(len(per) != self.world for per in infos):
            raise ValueError(f"proxy_connect: want infos[{self.num_threads}][{self.world}]")
        for r, raw in enumerate(infos[0]):
            p = json.loads(bytes(raw))
            if r == self.rank:
                self._peers.append((self._rdma, self._sig))
            else:
                sig = _map(p["sig"], self._sig_bytes, False).view(torch.int64).view(-1, self.world)
                self._peers.append((_map(p["rdma"], p["rdma_bytes"], False), sig))

    def proxy_start(self) -> None:
        self._started = True

    def proxy_stop(self) -> None:
        pass

    def proxy_wait_idle(self, timeout_secs: float) -> None:
        if self._perr:  # Proxy::wait_idle raises the proxy's error; otherwise every write was done when pushed
            raise RuntimeError(self._perr)

    # ---- the kernels, synchronous
    def push_chunks(self, table: int, n: int, chunk_records: int, phase: int, stream: int) -> None:
        if n <= 0:
            return
        self._check_push(chunk_records)
        if _stopped(self.stop_flag_ptr, self._generation):
            return
        self._push_rows(_at(table, 8 * PUSH_COLUMNS * n, torch.int64).view(n, PUSH_COLUMNS).tolist(), chunk_records,
                        phase)

    def push_after_counts(self, table: int, n: int, chunk_records: int, slot: int, expected: int, count_rows: int,
                          row_words: int, ranks_per_node: int, receive_bytes: int, phase: int, stream: int,
                          send_limit: int = -1) -> None:
        """push_chunks_kernel with CountRowShift: wait (as wait_counter, with the GPU deadline) until every count row is
        in, then push each row where place_blocks puts it (a destination whose arrivals exceed receive_bytes gets
        nothing); with ``send_limit`` >= 0 each row's records and block first come from our own row
        (rows_from_own_row)."""
        if not 0 <= slot < self.num_signal_slots:
            raise ValueError(f"push_after_counts: slot {slot} outside 0..{self.num_signal_slots - 1}")
        if ranks_per_node < 1 or self.world % ranks_per_node:
            raise ValueError(f"push_after_counts: ranks_per_node must divide the {self.world} ranks")
        if row_words < self.world + self.world // ranks_per_node:
            raise ValueError("push_after_counts: a count row has at least ranks + nodes words")
        off = count_rows - self.rdma_ptr
        if not count_rows or off < 0 or off % 8 or off + 8 * self.world * row_words > self.rdma_bytes:
            raise ValueError("push_after_counts: the count rows must lie in this rank's RDMA region")
        if n <= 0:
            return
        self._check_push(chunk_records)
        if _stopped(self.stop_flag_ptr, self._generation) or not self._wait_for([(slot, expected)], phase):
            return
        rows = _at(table, 8 * PUSH_COLUMNS * n, torch.int64).view(n, PUSH_COLUMNS).tolist()
        counts = _at(count_rows, 8 * self.world * row_words, torch.int64).view(self.world, row_words)
        if send_limit >= 0:
            own = counts[self.rank, self.world:self.world + self.world // ranks_per_node].tolist()
            rows = rows_from_own_row(own, rows, ranks_per_node, send_limit)
        self._push_rows(place_blocks(counts, rows, self.rank, ranks_per_node, receive_bytes), chunk_records, phase)

    def pack_and_push_after_counts(self, table: int, n: int, chunk_records: int, send: int, stride: int,
                                   hop1_token: int, dest_rows: int, ranks_per_node: int, capacity: int, columns: list,
                                   src_idx_offset: int, dest_rows_offset: int, slot: int, expected: int,
                                   count_rows: int, row_words: int, receive_bytes: int, send_limit: int, ready: int,
                                   phase: int, stream: int, own_row_pushes: int = 0, own_row_push_rows: int = 0,
                                   own_row_push_phase: int = 0) -> None:
        """pack_and_push_kernel counting on the device (a CountRowShift with a send limit): our own count row's
        pushes first when given (own_row_pushes: a table of own_row_push_rows one-record rows, as push_chunks takes
        it), then the writes of pack_records counting from our own count row (our own node's records not written,
        none past send_limit), then of push_after_counts with the same table and limit. The chunk counters must be
        zero at launch and are left zero, as pack_and_push's."""
        if send_limit < 0:
            raise ValueError("pack_and_push_after_counts: give send_limit (the records are counted from our row)")
        if own_row_push_rows < 0 or (own_row_push_rows > 0 and not own_row_pushes):
            raise ValueError("pack_and_push_after_counts: own_row_push_rows must be >= 0, with a table when > 0")
        if capacity <= 0:  # no launch; the row still leaves (push_chunks)
            self.push_chunks(own_row_pushes, own_row_push_rows, 1, own_row_push_phase, stream)
            return
        if not 0 < n <= PACK_PUSH_MAX_ROWS:
            raise ValueError(f"pack_and_push: 1..{PACK_PUSH_MAX_ROWS} push table rows, got {n}")
        if not 0 <= send - self.rdma_ptr <= self.rdma_bytes - send_limit:
            raise ValueError("pack_and_push: the records do not lie in this rank's RDMA region")
        G = ranks_per_node
        own = count_rows + 8 * (self.rank * row_words + self.world)
        if int(_at(ready, 4 * (send_limit // stride // chunk_records + n + 1), torch.int32).count_nonzero()):
            raise RuntimeError("pack_and_push: chunk counters not zero at launch (the kernel would push early)")
        if _stopped(self.stop_flag_ptr, self._generation):
            return
        self.push_chunks(own_row_pushes, own_row_push_rows, 1, own_row_push_phase, stream)
        pack_records(send, 0, 0, 0, stride, hop1_token, dest_rows, G, capacity, columns, src_idx_offset,
                     dest_rows_offset, stream, node_counts=own, num_nodes=self.world // G, skip_node=self.rank // G,
                     send_limit=send_limit)
        self.push_after_counts(table, n, chunk_records, slot, expected, count_rows, row_words, G, receive_bytes,
                               phase, stream, send_limit=send_limit)

    def _check_push(self, chunk_records: int) -> None:
        if chunk_records < 1 or chunk_records > CMD_MAX_VALUE:
            raise ValueError(f"push_chunks: chunk_records must be 1..{CMD_MAX_VALUE} (18-bit signal value)")
        if not self._started:
            raise RuntimeError("push_chunks before proxy_start (the fake has no FIFO to queue into)")

    def _push_rows(self, rows: list, chunk_records: int, phase: int) -> None:
        """push_lane for every (row, lane): chunk c of row i through lane (hint + c) % num_fifos."""
        for i, (dst, loff, roff, stride, records, slot, fifo) in enumerate(rows):
            hint = i if fifo < 0 else fifo
            for c, first in enumerate(range(0, records, chunk_records)):  # records <= 0: nothing
                lane = (hint + c) % self.num_fifos
                count = min(chunk_records, records - first)
                cmd = (dst, count * stride, loff + first * stride, roff + first * stride, slot + lane, count)
                e = _encode_error(*cmd)
                if e:
                    _report(self.error_word_ptr, self._stop_now(), ERROR_CODES["encode"], self.rank, dst, e, phase,
                            first, records)
                    break
                if not self._write(*cmd):
                    return
                self._lane_cmds[lane] += 1

    def pack_and_push(self, table: int, n: int, chunk_records: int, send: int, own_dst: int, own_first: int,
                      own_count: int, stride: int, hop1_token: int, dest_rows: int, ranks_per_node: int,
                      num_records: int, columns: list, src_idx_offset: int, dest_rows_offset: int, ready: int,
                      phase: int, stream: int, expert_sums: Optional[tuple] = None,
                      node_sums: Optional[tuple] = None) -> None:
        """pack_and_push_kernel: the records written (record r carries row hop1_token[r], or r when hop1_token is 0;
        index fields only where src_idx_offset >= 0; our own node's at own_dst), then push_chunks over the table --
        every write the kernel makes, in an order it may make them (a chunk leaves only once its records are in). The
        kernel's chunk counters must be zero at launch and are left zero: checked here. A chunk some of whose records
        no packer writes fails as the kernel's pusher does at the GPU deadline (``records_unwritten``); here nothing
        is pushed then, while the kernel has pushed the chunks before it. ``expert_sums`` (ExpertSums): record r is
        combine row r, its local experts' expert-major rows summed as expert_major_partials sums them. ``node_sums``
        (NodeSums): record r is arrival r's node sum, summed as sum_node_partials sums it once every local GPU's flag
        of its tile reaches the epoch; a flag still short at the GPU deadline is reported (``node_flag_timeout``), and
        nothing is written or pushed then."""
        if num_records <= 0:
            return
        if expert_sums is not None:  # the rows the packers sum, made first (the kernel sums them record by record)
            columns, keep_alive = self._expert_sum_columns(expert_sums, num_records, stride, send, own_dst, columns,
                                                           hop1_token, ranks_per_node, src_idx_offset)
        if node_sums is not None:
            if expert_sums is not None or columns or hop1_token or ranks_per_node or src_idx_offset >= 0:
                raise ValueError("pack_and_push: node sums take no columns, expert sums, tokens, final rows or index "
                                 "fields (record r is arrival r's node sum)")
            columns, keep_alive = self._node_sum_columns(node_sums, num_records, stride, send, own_dst, phase)
            if columns is None:
                return
        if not 0 < n <= PACK_PUSH_MAX_ROWS:
            raise ValueError(f"pack_and_push: 1..{PACK_PUSH_MAX_ROWS} push table rows, got {n}")
        if not 0 <= own_first <= own_first + own_count <= num_records:
            raise ValueError("pack_and_push: our own node's records must lie within the records")
        if not 0 <= send - self.rdma_ptr <= self.rdma_bytes - num_records * stride:
            raise ValueError("pack_and_push: the records do not lie in this rank's RDMA region")
        rows = _at(table, 8 * PUSH_COLUMNS * n, torch.int64).view(n, PUSH_COLUMNS)
        chunks = int(sum(-(-r // chunk_records) for r in rows[:, 4].tolist() if r > 0))
        if int(_at(ready, 4 * chunks, torch.int32).count_nonzero()):
            raise RuntimeError("pack_and_push: chunk counters not zero at launch (the kernel would push early)")
        if _stopped(self.stop_flag_ptr, self._generation):
            return
        R, G = num_records, ranks_per_node
        tokens = _at(hop1_token, 8 * R, torch.int64).clone() if hop1_token else torch.arange(R)
        out = torch.zeros((R, stride), dtype=torch.uint8)
        T = int(tokens.max()) + 1
        for src, nb, off in columns:
            out[:, off:off + nb] = _at(src, T * nb).view(T, nb)[tokens]
        if src_idx_offset >= 0:
            out[:, src_idx_offset:src_idx_offset + 4] = tokens.to(torch.int32).view(-1, 1).view(torch.uint8)
        if G > 0:
            out[:, dest_rows_offset:dest_rows_offset + 4 * G] = \
                _at(dest_rows, 8 * R * G, torch.int64).view(R, G).to(torch.int32).view(torch.uint8)
        keep = torch.ones(R, dtype=torch.bool)
        keep[own_first:own_first + own_count] = False
        _at(send, R * stride).view(R, stride)[keep] = out[keep]
        if own_count and own_dst:  # (no own_dst: not written, the reader takes them from the columns)
            _at(own_dst, own_count * stride).view(own_count, stride).copy_(out[own_first:own_first + own_count])
        # the pusher's wait, chunk by chunk: the records the packers count into each chunk (by their place in the
        # region, as the kernel finds it); a chunk some of whose records no packer writes times out
        at = send - self.rdma_ptr + torch.arange(R)[keep] * stride
        first_chunk = 0
        for dst, loff, _, rstride, records, _, _ in rows.tolist():
            chunks = -(-max(records, 0) // chunk_records)
            inside = at[(at >= loff) & (at < loff + max(records, 0) * rstride)]
            seen = torch.bincount((inside - loff) // (chunk_records * rstride), minlength=chunks).tolist()
            for c in range(chunks):
                count = min(chunk_records, records - c * chunk_records)
                if seen[c] < count:
                    time.sleep(self._timeout)
                    _report(self.error_word_ptr, self._stop_now(), ERROR_CODES["records_unwritten"], self.rank,
                            first_chunk + c, dst, phase, seen[c], count)
                    return
            first_chunk += chunks
        self.push_chunks(table, n, chunk_records, phase, stream)

    @staticmethod
    def _expert_sum_columns(expert_sums: tuple, num_records: int, stride: int, send: int, own_dst: int,
                            columns: list, hop1_token: int, ranks_per_node: int, src_idx_offset: int
                            ) -> Tuple[list, list]:
        """pack_and_push's checks of ExpertSums, then the columns it amounts to: the summed rows (and weights) as
        tensors of their own (returned too, to keep them alive while the records are written)."""
        x, row_bytes, f32, slot_of, topk, weights, weights_offset = expert_sums
        if columns or hop1_token or ranks_per_node or src_idx_offset >= 0:
            raise ValueError("pack_and_push: expert sums take no columns, tokens, final rows or index fields "
                             "(record r is combine row r)")
        if row_bytes <= 0 or (x | row_bytes | send | own_dst | stride) % 16 or row_bytes > stride:
            raise ValueError("pack_and_push: expert sums need rows of a multiple of 16 bytes within the record, and "
                             "16-byte aligned rows and records")
        if not 1 <= topk <= EXPERT_MAJOR_MAX_TOPK or not slot_of:
            raise ValueError(f"pack_and_push: expert sums need slot_of and a top-k of 1..{EXPERT_MAJOR_MAX_TOPK}, "
                             f"got {topk}")
        if weights and (weights_offset < row_bytes or weights_offset % 4 or weights_offset + 4 * topk > stride):
            raise ValueError("pack_and_push: the expert sums' weights must lie in the record behind the payload")
        elem = 4 if f32 else 2
        rows = torch.empty((num_records, row_bytes // elem), dtype=torch.float32 if f32 else torch.bfloat16)
        w = torch.empty((num_records, topk), dtype=torch.float32) if weights else None
        info = torch.tensor([num_records], dtype=torch.int32)
        fake_expert_major.partials(x, weights, slot_of, info.data_ptr(), num_records, row_bytes // elem, elem, topk,
                                   rows.data_ptr(), w.data_ptr() if w is not None else 0, 1, 0)
        cols = [(rows.data_ptr(), row_bytes, 0)] + ([(w.data_ptr(), 4 * topk, weights_offset)] if weights else [])
        return cols, [rows, w, info]

    def _node_sum_columns(self, node_sums: tuple, num_records: int, stride: int, send: int, own_dst: int,
                          phase: int) -> Tuple[Optional[list], list]:
        """pack_and_push's checks of NodeSums, its packers' waits for the tile flags, then the column the records
        amount to: the node sums, one row of ``stride`` bytes per record (None: a flag did not come, reported)."""
        gather, rows_of, G, payload_bytes, num_weights, f32, flags, tile_rows, epoch = node_sums
        if payload_bytes <= 0 or (gather | payload_bytes | send | own_dst | stride) % 16 or num_weights < 0 \
                or payload_bytes + 4 * num_weights > stride:
            raise ValueError("pack_and_push: node sums need a payload of a multiple of 16 bytes and the fp32 weights "
                             "within the record, and 16-byte aligned rows and records")
        if not 1 <= G <= NODE_SUMS_MAX_RANKS_PER_NODE or not rows_of or not flags:
            raise ValueError(f"pack_and_push: node sums need rows_of, flags and 1..{NODE_SUMS_MAX_RANKS_PER_NODE} GPUs "
                             "per node")
        if tile_rows < 1 or -(-num_records // tile_rows) > GATHER_MAX_TILES or epoch < 1:
            raise ValueError(f"pack_and_push: node sums' tiles must cover the records with at most {GATHER_MAX_TILES} "
                             "flags, at an epoch >= 1")
        tiles = -(-num_records // tile_rows)
        wanted = [(j, t) for t in range(tiles) for j in range(G)]  # every GPU's flag of every tile, in record order
        start = time.monotonic()
        while wanted:
            seen = _at(flags, 4 * G * GATHER_MAX_TILES, torch.int32).view(G, GATHER_MAX_TILES)
            wanted = [(j, t) for j, t in wanted if int(seen[j, t]) < epoch]
            if not wanted:
                break
            if _stopped(*self._stop_now()):
                return None, []
            if time.monotonic() - start > self._timeout:
                j, t = wanted[0]
                _report(self.error_word_ptr, self._stop_now(), ERROR_CODES["node_flag_timeout"], self.rank, j, t,
                        phase, int(seen[j, t]), epoch)
                return None, []
            time.sleep(1e-4)
        sums = torch.zeros((num_records, stride), dtype=torch.uint8)
        zero = torch.zeros(payload_bytes, dtype=torch.uint8)
        sum_node_partials(sums.data_ptr(), sums.data_ptr() + payload_bytes if num_weights else 0, gather, stride,
                          rows_of, zero.data_ptr(), G, num_records, payload_bytes, num_weights, f32, 0,
                          out_x_stride=stride, out_w_stride=stride)
        return [(sums.data_ptr(), stride, 0)], [sums, zero]

    def wait_node_flags(self, flags: int, ranks_per_node: int, tiles: int, epoch: int, phase: int,
                          stream: int, go: int = 0) -> None:
        """Context::wait_node_flags: GPU j's flag of every tile t < tiles at ``epoch``, for every j; no wait when
        the int64 word at ``go`` (0: none) is 0."""
        if tiles <= 0 or ranks_per_node <= 0:
            return
        if not flags or tiles > GATHER_MAX_TILES or epoch < 1:
            raise ValueError(f"wait_node_flags: flags, 1..{GATHER_MAX_TILES} tiles and an epoch >= 1")
        if go and not int(_at(go, 8, torch.int64)[0]):
            return
        start = time.monotonic()
        while True:
            seen = _at(flags, 4 * ranks_per_node * GATHER_MAX_TILES, torch.int32).view(ranks_per_node,
                                                                                      GATHER_MAX_TILES)[:, :tiles]
            late = (seen < epoch).nonzero().tolist()
            if not late:
                return
            if _stopped(*self._stop_now()):
                return
            if time.monotonic() - start > self._timeout:
                j, t = late[0]
                _report(self.error_word_ptr, self._stop_now(), ERROR_CODES["node_flag_timeout"], self.rank, j, t,
                        phase, int(seen[j, t]), epoch)
                return
            time.sleep(1e-4)

    def _maybe_delay(self) -> None:
        if self._jitter and self._jitter_draw() < 0.3:
            time.sleep(self._jitter * self._jitter_draw())

    def _write(self, dst: int, nbytes: int, local: int, remote: int, slot: int, value: int) -> bool:
        """What the proxy and transport do with one WRITE_SIGNAL: the bytes land, then the counter moves."""
        self._maybe_delay()
        if self._perr:
            return False
        if dst >= len(self._peers):
            self._perr = f"rank {self.rank}: command for rank {dst}, the group has {len(self._peers)} connected ranks"
        elif local + nbytes > self.rdma_bytes or remote + nbytes > self._peers[dst][0].numel():
            self._perr = (f"rank {self.rank}: write of {nbytes} bytes from {local} to rank {dst} at {remote} leaves "
                          "a region")
        elif slot >= self.num_signal_slots:
            self._perr = f"rank {self.rank}: signal slot {slot} >= {self.num_signal_slots}"
        elif nbytes > self.max_write_bytes:  # what a NIC refuses (EFA: efadv max_rdma_size)
            self._perr = f"rank {self.rank}: write of {nbytes} bytes exceeds the transport's {self.max_write_bytes}"
        if self._perr:
            return False
        region, counters = self._peers[dst]
        if nbytes:
            region[remote:remote + nbytes].copy_(self._rdma[local:local + nbytes])
        counters[slot, self.rank] += value  # ours alone: x86 stores are seen in order, so bytes land first
        t = self._totals  # one write at a time, applied by this rank on the destination
        t.update(commands=t["commands"] + 1, writes_posted=t["writes_posted"] + 1, max_inflight_writes=1,
                 signals_applied=t["signals_applied"] + 1, max_inflight_bytes=max(t["max_inflight_bytes"], nbytes))
        return True

    def wait_signals(self, targets: list, phase: int, stream: int) -> None:
        pairs = [(int(s), int(e)) for s, e in targets]
        if not pairs:
            return
        if any(not 0 <= s < self.num_signal_slots for s, _ in pairs):
            raise ValueError(f"wait_signals: slot outside 0..{self.num_signal_slots - 1}: {pairs}")
        self._wait_for(pairs, phase)

    def arrival_gate(self, table: int, blocks: int, chunk_records: int, phase: int) -> ArrivalGate:
        return ArrivalGate(self, table, blocks, chunk_records, phase)

    def _wait_for(self, pairs: list, phase: int, reported: "dict | None" = None) -> bool:
        """wait_counter (csrc/kernels/gpu_wait.cuh) for each (slot, target): True when all were reached. A timeout
        reports the first late slot with ``reported[slot]`` as the value expected, when given."""
        if not pairs:
            return True
        self._maybe_delay()
        slots = torch.tensor([s for s, _ in pairs])
        start, nap = time.monotonic(), 2e-5
        while True:
            seen = self._sig[slots].sum(1).tolist()
            late = [(s, v, e) for (s, e), v in zip(pairs, seen) if v < e]
            if not late:
                return True
            if time.monotonic() - start > self._timeout:
                s, v, e = late[0]
                e = (reported or {}).get(s) or e
                _report(self.error_word_ptr, self._stop_now(), ERROR_CODES["wait_timeout"], self.rank, s, 0, phase,
                        v, e)
                return False
            if self._err.code:  # another failed wait of this rank, or abort_waits()
                _set_stop(*self._stop_now())
                return False
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    # ---- errors and diagnostics
    def error_fields(self) -> dict:
        e = self._err
        names = ("code", "rank", "slot", "aux", "phase", "observed", "expected")
        return {k: (getattr(e, k) if e.code else 0) for k in names}

    def error_message(self) -> str:
        e = self._err
        if not e.code:
            return ""
        secs, who = f"{self._timeout:.6f}", f"rank {e.rank}, {phase_name(e.phase)}: "
        return who + {
            1: f"wait_signals: GPU waited {secs} s (UCCL_EP_GPU_TIMEOUT_SECS) for signal slot {e.slot} to reach "
               f"{e.expected}, saw {e.observed} (a peer rank or its proxy stopped sending)",
            2: f"push_chunks: GPU could not push into FIFO {e.slot} for {secs} s (ring full: is the proxy thread "
               f"running?); block for rank {e.aux}, record {e.observed} of {e.expected}",
            3: f"push_chunks: a command to rank {e.slot} does not encode: {_CMD_ERRORS.get(e.aux, 'unknown error')}",
            4: f"forward_rows / scatter_rows: destination row {e.observed} (list position {e.aux}, target local GPU "
               f"{e.slot}) is outside the {e.expected} rows of the area; the row was not written (a record arrived "
               "corrupt, or was read before its bytes landed)",
            5: "GPU waits aborted by the host (the proxy failed)",
            6: f"pack_and_push: the records of chunk {e.slot} (for rank {e.aux}) were not all written within {secs} s: "
               f"{e.observed} of {e.expected} (a packer block never ran?)",
            7: f"NVLink flags: local GPU {e.slot} did not raise flag {e.aux} (a tile of our combine arrivals, or 0: "
               f"its dispatch forward) within {secs} s: the flag is at {e.observed}, waited for epoch {e.expected} "
               "(that rank stopped, or never reached this call)",
        }.get(e.code, f"unknown GPU error code {e.code}")

    def _stop_now(self) -> tuple:
        return self.stop_flag_ptr, self._generation

    def clear_error(self) -> None:
        ctypes.memset(ctypes.addressof(self._err), 0, ctypes.sizeof(self._err))
        self._generation += 1

    def abort_waits(self) -> None:
        if self._err.reserved == 0:
            self._err.reserved, self._err.rank, self._err.phase = 1, self.rank, 0
            self._err.code = ERROR_CODES["aborted"]
        _set_stop(*self._stop_now())

    def proxy_error(self) -> str:
        return self._perr

    def proxy_totals(self) -> dict:
        return dict(self._totals)

    def signals_short(self, targets: list) -> int:
        """Context::signals_short: sum over (slot, target) of max(0, target - signal[slot])."""
        return sum(max(0, int(target) - self.signal_value(int(slot))) for slot, target in targets)

    def signal_value(self, slot: int) -> int:
        if not 0 <= slot < self.num_signal_slots:
            raise ValueError("signal_value: slot out of range")
        if self._destroyed:
            raise RuntimeError("signal_value: the internode context was destroyed")
        return int(self._sig[slot].sum())

    def fifo_states(self) -> List[dict]:
        return [] if self._destroyed else [dict(fifo=i, device_head=c, tail=c, full=0, first_full=-1, last_full=-1)
                                           for i, c in enumerate(self._lane_cmds)]

    def proxy_counters(self) -> str:
        return "proxy stopped" if self._destroyed else f"fake proxy (synchronous): commands per FIFO {self._lane_cmds}"

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._peers, self._opened = [], []
        for name in self._names.values():
            try:
                os.unlink(os.path.join(_SHM, name))
            except FileNotFoundError:
                pass  # unlink_shared_host_memory_names() was first


def unlink_shared_host_memory_names() -> None:
    """_C.unlink_shared_host_memory_names: every peer has mapped our RDMA region and counters by now."""
    while _unlink_later:
        try:
            os.unlink(os.path.join(_SHM, _unlink_later.pop()))
        except FileNotFoundError:
            pass


#: What ``uccl_ep_train.native.module()`` returns once install() ran: the parts of ``_C`` the backend touches.
NATIVE = SimpleNamespace(internode=sys.modules[__name__], verbs=SimpleNamespace(available=False),
                         unlink_shared_host_memory_names=unlink_shared_host_memory_names, gpu_backend="NONE")


def install() -> None:
    """Make ``native.module()`` return this stand-in in this process (a test's child process)."""
    from uccl_ep_train import native

    native.module = lambda: NATIVE
