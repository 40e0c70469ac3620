"""Small host tables on the device through pinned memory (docs/internode.md, "Host cost per call").

An internode call uploads a few small tables (push tables, gates, hop plans made ahead). From pageable memory the
driver first copies each into a staging buffer of its own, which may wait for the stream (CUDA's API
synchronization rules), and py-spy on 2x H200 put those copies at 16-20 % of a call's host work (session 24). Here the
values are written into a pinned area allocated once at setup -- a first pinned allocation may synchronize, which
must not happen while a kernel of ours spins -- and one asynchronous copy per table takes them to the device.

A slot may be written again only once the copy that read it has run. The backend drains its stream after every
wait, and every copy queued before a drain has run when the drain returns; so the area is reused from its start
after each drain (``drained``) and filled front to back in between. A full area, or uploads on more than one stream
since the last drain, fall back to the pageable copy: slower, never wrong.
"""
from __future__ import annotations

from typing import Any, Callable, Set

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_ALIGN = 64  # each table starts on its own cache line


class UploadStaging:
    """A pinned area of ``nbytes`` for the tables one rank uploads between two drains of its stream. ``copy(dst,
    src, nbytes, stream)`` queues a host-to-device copy (the native context's copy_to_device); ``pinned``: allocate
    the area pinned (False for the CPU stand-in, whose copies are synchronous)."""

    def __init__(self, device: torch.device, copy: Callable[[int, int, int, int], None], nbytes: int = 1 << 20,
                 pinned: bool = True) -> None:
        if nbytes < _ALIGN:
            raise ValueError(f"an upload staging area needs at least {_ALIGN} bytes, got {nbytes}")
        self.device = device
        self._copy = copy
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._bytes = self._host.numpy()
        self._base = self._host.data_ptr()
        self._used = 0
        self._streams: Set[int] = set()  # streams that read slots since the last drain that freed them
        self.staged = 0  # uploads through the area (tests, benchmarks)
        self.fallbacks = 0  # uploads that took the pageable copy

    def upload(self, values: Any, dtype: Any, stream: int) -> torch.Tensor:
        """``values`` (Python ints: a list, or a list of equal rows) as a ``dtype`` (np.int64 or np.int32) tensor on
        the device, copied on ``stream`` without a sync. Built through numpy: torch.tensor on a list costs 2-4x."""
        a = np.ascontiguousarray(values, dtype=dtype)
        out = torch.empty(a.shape, dtype=_TORCH_DTYPES[a.dtype], device=self.device)
        n = a.nbytes
        if n == 0:
            return out
        start = self._used
        if start + n > self._bytes.size or (self._streams and stream not in self._streams):
            self.fallbacks += 1
            return out.copy_(torch.from_numpy(a), non_blocking=True)
        self._bytes[start:start + n] = a.reshape(-1).view(np.uint8)
        self._copy(out.data_ptr(), self._base + start, n, stream)
        self._used = -(-(start + n) // _ALIGN) * _ALIGN
        self._streams.add(stream)
        self.staged += 1
        return out

    def drained(self, stream: int) -> None:
        """Everything queued on ``stream`` so far has run: its slots may be written again (unless another stream
        read slots too, whose copies that drain does not cover)."""
        if self._streams <= {stream}:
            self._used = 0
            self._streams.clear()
