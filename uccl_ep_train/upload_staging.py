"""Small host tables on the device through pinned memory (docs/internode.md, "Host cost per call").

An internode call uploads a few small tables (push tables, gates, hop plans made ahead). From pageable memory the
driver first copies each into a staging buffer of its own, which may wait for the stream (CUDA's API
synchronization rules), and py-spy on 2x H200 put those copies at 16-20 % of a call's host work (session 24). Here the
values are written into a pinned area allocated once at setup -- a first pinned allocation may synchronize, which
must not happen while a kernel of ours spins -- and one asynchronous copy per table takes them to the device.

A slot may be written again only once the copy that read it has run. Every copy queued before a drain of the stream
has run when the drain returns, so the backend calls ``drained`` after each of its drains (notify's, and after every
wait where drains are on: docs/internode.md, "Drains") and the area is reused from its start; in between it fills
front to back. A full area, or a second stream while the first
one's slots wait for a drain, fall back to the pageable copy: slower, never wrong.

An upload may also be split in two: ``stage`` writes the values and takes the device tensor from torch's cache (no
copy queued: for while a kernel of ours spins and nothing may be queued behind it), ``commit`` queues the copy later
(after the drain). No drain frees the area while a staged table waits for its commit.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Set

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_ALIGN = 64  # each table starts on its own cache line


class Staged(NamedTuple):
    """A table written but not copied yet (UploadStaging.stage): its device tensor, its slot of the pinned area
    (``src``, ``nbytes``; src 0: none, the area was full), and the values for a pageable copy where the slot is not
    used."""

    out: torch.Tensor
    src: int
    nbytes: int
    host: np.ndarray


class UploadStaging:
    """A pinned area of ``nbytes`` for the tables one rank uploads between two drains of its stream. ``copy(dst,
    src, nbytes, stream)`` queues a host-to-device copy (the native context's copy_to_device); ``pinned``: allocate
    the area pinned (False for tests on the CPU)."""

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
        self._uncommitted = 0  # staged tables whose copy is not queued yet: no drain may free the area
        self.staged = 0  # tables written into the area (tests, benchmarks)
        self.fallbacks = 0  # tables copied from pageable memory instead

    def upload(self, values: Any, dtype: Any, stream: int) -> torch.Tensor:
        """``values`` (Python ints: a list, or a list of equal rows; or a numpy array) as a ``dtype`` (np.int64 or
        np.int32) tensor on the device, copied on ``stream`` without a sync. Built through numpy: torch.tensor on a
        list costs 2-4x."""
        return self.commit(self.stage(values, dtype), stream)

    def stage(self, values: Any, dtype: Any) -> Staged:
        """The first half of ``upload``: the values written into the next slot, their device tensor allocated (from
        torch's cache); nothing queued on any stream. ``commit`` queues the copy."""
        a = np.ascontiguousarray(values, dtype=dtype)
        out = torch.empty(a.shape, dtype=_TORCH_DTYPES[a.dtype], device=self.device)
        n, start = a.nbytes, self._used
        if n == 0 or start + n > self._bytes.size:
            return Staged(out, 0, n, a)
        self._bytes[start:start + n] = a.reshape(-1).view(np.uint8)
        self._used = -(-(start + n) // _ALIGN) * _ALIGN
        self._uncommitted += 1
        self.staged += 1
        return Staged(out, self._base + start, n, a)

    def commit(self, staged: Staged, stream: int) -> torch.Tensor:
        """Queue a staged table's copy on ``stream``; returns its device tensor. From its slot when the slots read
        since the last drain are this stream's; else (a second stream, or no room at staging) a pageable copy."""
        out = staged.out
        if staged.src:
            self._uncommitted -= 1
        if staged.src and not (self._streams and stream not in self._streams):
            self._copy(out.data_ptr(), staged.src, staged.nbytes, stream)
            self._streams.add(stream)
        elif staged.nbytes:  # no slot, or another stream's slots wait for a drain (ours is then read by nobody)
            self.fallbacks += 1
            out.copy_(torch.from_numpy(staged.host), non_blocking=True)
        return out

    def drained(self, stream: int) -> None:
        """Everything queued on ``stream`` so far has run: its slots may be written again (unless another stream
        read slots too, whose copies that drain does not cover, or a staged table still waits for its commit)."""
        if self._streams <= {stream} and not self._uncommitted:
            self._used = 0
            self._streams.clear()
