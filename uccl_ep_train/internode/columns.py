"""Payload columns and native memory as the kernels take them: raw views of the native module's regions, device
addresses, byte rows, the record layout's columns, and small uploads that never synchronize the stream."""
from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from uccl_ep_train.internode.plan import RecordLayout, record_layout


class _DeviceView:
    """Exposes raw device memory to torch (``__cuda_array_interface__``) without copying or owning it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


def _raw_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 tensor over a region of the native module, without copying or owning it."""
    if device.type == "cuda":
        return torch.as_tensor(_DeviceView(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)  # CPU stand-in (tests)


def _upload_values(values: Any, dtype: Any, device: torch.device) -> torch.Tensor:
    """Python ints (a list, or a list of equal rows) as a tensor on ``device``, without a stream sync: a pageable
    non-blocking copy is staged by the driver at once, so the host memory may go right away (a blocking .to()
    synchronizes the stream). Built through numpy: torch.tensor on a list costs 2-4x the host time."""
    return torch.from_numpy(np.asarray(values, dtype=dtype)).to(device, non_blocking=True)


def _address(t: Optional[torch.Tensor]) -> int:
    """A tensor's device address for a native call, 0 for none."""
    return t.data_ptr() if t is not None else 0


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype``, with no torch call when it is one already: each no-op ``.to()``,
    ``.contiguous()`` or byte view cost ~3-13 us of host time on a lent host whose proxies keep the driver busy
    (session 17 profile), and a dispatch made a dozen of them before its wire could start. The kernels take a
    column's rows as its address and row bytes (_row_bytes), so a byte view (_bytes_of) is not needed."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _row_bytes(t: torch.Tensor) -> int:
    """The bytes of one row of ``t`` as _bytes_of lays it out, without making the view."""
    return t.element_size() * math.prod(t.shape[1:])


def _empty_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised output of ``rows`` rows shaped and typed like ``like``'s rows."""
    return torch.empty((rows,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)


@functools.lru_cache(maxsize=64)
def _record_layout(column_bytes: Tuple[int, ...], ranks_per_node: int) -> RecordLayout:
    """record_layout, kept: every cached dispatch asks it for the same few column widths."""
    return record_layout(column_bytes, ranks_per_node)


def _column_args(rows: List[torch.Tensor], layout: RecordLayout) -> List[Tuple[int, int, int]]:
    """The columns (contiguous byte rows, _dense) as the record kernels take them: (rows, row bytes, offset in the
    record), empty columns left out."""
    return [(r.data_ptr(), nb, off) for r, nb, off in zip(rows, layout.column_bytes, layout.column_offsets) if nb]


def _record_columns(final: torch.Tensor, layout: RecordLayout, n: int) -> List[Tuple[int, int]]:
    """The first n columns of the records in ``final`` (the final rows: [rows, bytes], the record stride with one GPU
    per node, the shorter final row with several), as (first row's address, row stride in bytes)."""
    stride = final.stride(0) * final.element_size()
    return [(final.data_ptr() + layout.column_offsets[i], stride) for i in range(n)]


def _aligned_counts(raw: torch.Tensor, alignment: int) -> torch.Tensor:
    """Counts per expert rounded up to ``alignment``, as int32 (device ops: nothing is read back)."""
    raw = raw.to(torch.int64)
    return ((raw + alignment - 1) // alignment * alignment).to(torch.int32)


def _ranges_around(first: int, count: int, total: int) -> List[Tuple[int, int]]:
    """The non-empty ranges of [0, total) before and after [first, first + count): the other nodes' rows around our
    own node's block, in a list that runs by node."""
    return [r for r in ((0, first), (first + count, total)) if r[1] > r[0]]
