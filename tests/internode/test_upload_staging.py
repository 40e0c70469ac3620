"""UploadStaging: small tables go to the device through a pinned area reused after each drain. On the CPU, with a
copy that is queued and run later as a stream runs it, so a slot written again too early would show."""
import ctypes

import numpy as np
import pytest
import torch

from uccl_ep_train.upload_staging import UploadStaging


class _Streams:
    """Copies queued per stream and run in order on run(stream), as cudaMemcpyAsync would."""

    def __init__(self):
        self.queued = {}

    def copy(self, dst, src, nbytes, stream):
        self.queued.setdefault(stream, []).append((dst, src, nbytes))

    def run(self, stream):
        for dst, src, nbytes in self.queued.pop(stream, []):
            ctypes.memmove(dst, src, nbytes)


def _staging(nbytes=4096):
    streams = _Streams()
    return UploadStaging(torch.device("cpu"), streams.copy, nbytes=nbytes, pinned=False), streams


def test_tables_land_exactly_with_their_dtype_and_shape_once_the_stream_ran_the_copies():
    st, streams = _staging()
    rows = [[1, -2, 3, 1 << 40, 5, 6, 7], [8, 9, 10, 11, -(1 << 50), 13, 14]]
    a = st.upload(rows, np.int64, stream=1)
    b = st.upload([3, 1, 4, 1, 5], np.int32, stream=1)
    empty = st.upload([], np.int64, stream=1)
    streams.run(1)
    assert a.dtype == torch.int64 and a.tolist() == rows
    assert b.dtype == torch.int32 and b.tolist() == [3, 1, 4, 1, 5]
    assert empty.numel() == 0 and st.staged == 2 and st.fallbacks == 0


def test_tables_uploaded_between_two_drains_never_share_a_slot():
    st, streams = _staging()
    first = [st.upload([i] * 9, np.int64, stream=1) for i in range(20)]  # none of these copies has run yet
    streams.run(1)
    assert [t.tolist() for t in first] == [[i] * 9 for i in range(20)]


def test_the_area_is_reused_from_its_start_after_a_drain_of_the_stream_that_read_it():
    st, streams = _staging(nbytes=256)
    # (the tables stay referenced until their copies ran, as the backend keeps them)
    held = [st.upload(list(range(16)), np.int64, stream=1) for _ in range(2)]  # 128 bytes each: full
    streams.run(1)
    assert [t.tolist() for t in held] == [list(range(16))] * 2
    st.drained(1)
    again = st.upload([7] * 16, np.int64, stream=1)
    streams.run(1)
    assert again.tolist() == [7] * 16 and st.staged == 3 and st.fallbacks == 0


def test_a_full_area_falls_back_to_the_pageable_copy_and_nothing_is_lost():
    st, streams = _staging(nbytes=128)
    kept = st.upload(list(range(16)), np.int64, stream=1)  # fills it
    extra = st.upload([5, 6, 7], np.int64, stream=1)  # no room before a drain
    assert st.fallbacks == 1 and extra.tolist() == [5, 6, 7]  # the pageable copy lands at once
    streams.run(1)
    assert kept.tolist() == list(range(16))


def test_slots_read_by_one_stream_are_not_freed_by_a_drain_of_another():
    st, streams = _staging()
    a = st.upload([1] * 8, np.int64, stream=1)
    st.drained(2)  # stream 1's copy has not run
    b = st.upload([2] * 8, np.int64, stream=2)  # another stream while stream 1 holds slots: the pageable copy
    assert st.fallbacks == 1 and b.tolist() == [2] * 8
    c = st.upload([3] * 8, np.int64, stream=1)
    streams.run(1)
    assert a.tolist() == [1] * 8 and c.tolist() == [3] * 8


def test_an_area_too_small_for_one_cache_line_is_refused():
    with pytest.raises(ValueError, match="at least 64 bytes"):
        UploadStaging(torch.device("cpu"), lambda *a: None, nbytes=32, pinned=False)


def test_a_table_staged_while_nothing_may_be_queued_survives_the_drain_before_its_commit_and_lands():
    # staged during a kernel's spin: written, allocated, nothing queued; the drain comes; then the copy is queued
    st, streams = _staging(nbytes=256)
    first = st.upload([1] * 8, np.int64, stream=1)  # 64 bytes, its copy queued (every table stays referenced)
    staged = st.stage([[5, 6], [7, 8]], np.int64)
    assert streams.queued[1] == [streams.queued[1][0]], "staging queued a copy"
    streams.run(1)
    st.drained(1)  # must not free the staged slot: its copy is not even queued
    other = st.upload([9] * 8, np.int64, stream=1)  # lands past the staged slot, not on it
    out = st.commit(staged, stream=1)
    streams.run(1)
    assert out.tolist() == [[5, 6], [7, 8]] and other.tolist() == [9] * 8 and first.tolist() == [1] * 8
    st.drained(1)  # committed and run: the area is free again
    again = st.upload([4] * 32, np.int64, stream=1)  # 256 bytes: fits only from the start
    streams.run(1)
    assert again.tolist() == [4] * 32 and st.fallbacks == 0


def test_a_table_staged_into_a_full_area_is_copied_from_pageable_memory_at_its_commit():
    st, streams = _staging(nbytes=128)
    held = st.upload(list(range(16)), np.int64, stream=1)  # fills it
    staged = st.stage([3, 2, 1], np.int64)
    assert staged.src == 0 and streams.queued[1][1:] == []
    out = st.commit(staged, stream=1)
    streams.run(1)
    assert out.tolist() == [3, 2, 1] and held.tolist() == list(range(16)) and st.fallbacks == 1
