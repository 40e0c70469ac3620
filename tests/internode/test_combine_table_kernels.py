"""The combine's per-handle tables in one call each (csrc/kernels/internode_plan.cu: gather_rows_by_arrival and
forward_sum_rows) against the torch forms they replaced (session 43), element for element: on the stand-in of the
native module always, and on the GPU where there is one. Sources of every size (skewed, and ranks that receive
nothing from some source), forwarders with no row of ours, and an arrival out of range (reported, not written)."""
from __future__ import annotations

import ctypes

import pytest
import torch

import fake_internode_native as fake
from uccl_ep_train import native
from uccl_ep_train.internode.plan import source_local_of_rows

IMPLS = ["stand-in"]
if torch.cuda.is_available() and native.available() and hasattr(native.module(), "internode"):
    IMPLS.append("cuda")


def _impl(name):
    """(module, device, stream) of one implementation."""
    if name == "cuda":
        return native.module().internode, torch.device("cuda", 0), torch.cuda.current_stream().cuda_stream
    return fake, torch.device("cpu"), 0


def _rows_case(R, G, rows_per_source, width, g):
    """A receiving rank's rows: ``rows_per_source`` rows from each of R sources in source order (their exclusive
    ends), and each row's arrival at its forwarder (local index s % G): distinct arrivals per forwarder, drawn from
    [0, width) as its other arrivals (another GPU's rows) fill the rest."""
    ends = torch.tensor(rows_per_source, dtype=torch.int64).cumsum(0)
    n = int(ends[-1]) if R else 0
    local = source_local_of_rows(ends, n, G)
    arrival = torch.empty(n, dtype=torch.int64)
    for f in range(G):
        mine = (local == f).nonzero().view(-1)
        assert mine.numel() <= width
        arrival[mine] = torch.randperm(width, generator=g)[:mine.numel()]
    return ends, arrival, n


def _by_arrival_torch(ends, arrival, n, G, width):
    """The torch form of the table (before session 43): -1, then our row index at (source's local, arrival)."""
    out = torch.full((G, width), -1, dtype=torch.int32)
    if n:
        out.index_put_((source_local_of_rows(ends, n, G), arrival), torch.arange(n, dtype=torch.int32))
    return out


CASES = [  # (R, G, rows from each source, arrivals per forwarder)
    (4, 2, [3, 0, 5, 2], 9),         # one source sends nothing
    (4, 2, [0, 0, 0, 0], 4),         # nothing received: every entry -1
    (16, 8, [7] * 15 + [40], 64),    # skewed: one source sends most
    (8, 1, [2, 9, 0, 1, 3, 0, 4, 5], 24),  # one GPU per node: a single forwarder
    (64, 8, list(range(64)), 600),   # 8 nodes x 8 GPUs
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R,G,rows,width", CASES)
def test_gather_rows_by_arrival_puts_each_row_at_its_forwarders_arrival_as_the_torch_index_put_did(
        impl, R, G, rows, width):
    k, dev, stream = _impl(impl)
    g = torch.Generator().manual_seed(R * 100 + width)
    ends, arrival, n = _rows_case(R, G, rows, width, g)
    want = _by_arrival_torch(ends, arrival, n, G, width)
    got = torch.randint(-5, 5, (G, width), dtype=torch.int32, generator=g).to(dev)  # stale values: all rewritten
    ends_d, arrival_d = ends.to(dev), arrival.to(dev)
    k.gather_rows_by_arrival(got.data_ptr(), G, width, ends_d.data_ptr(), R, arrival_d.data_ptr(), n, stream)
    assert torch.equal(got.cpu(), want)


def test_an_arrival_out_of_range_is_reported_with_its_row_and_nothing_is_written_for_it():
    # stand-in only: the error word is host memory here; on the GPU the same report() serves every kernel
    ends = torch.tensor([2, 4], dtype=torch.int64)  # sources 0 and 1 (locals 0 and 1), two rows each
    arrival = torch.tensor([0, 1, 7, 0], dtype=torch.int64)  # row 2's arrival 7 is past the 3 arrivals
    out = torch.zeros((2, 3), dtype=torch.int32)
    err = fake.ErrorWord()
    stop = torch.zeros(1, dtype=torch.int32)
    fake.gather_rows_by_arrival(out.data_ptr(), 2, 3, ends.data_ptr(), 2, arrival.data_ptr(), 4, 0,
                                err=ctypes.addressof(err), stop_flag=stop.data_ptr(), stop_generation=3, rank=5,
                                phase=2)
    assert out.tolist() == [[0, 1, -1], [3, -1, -1]]
    assert (err.code, err.rank, err.slot, err.aux, err.phase, err.observed, err.expected) == (
        fake.ERROR_CODES["scatter_range"], 5, 1, 2, 2, 7, 3)
    assert int(stop) == 3  # the kernels queued behind it stop


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_rows_by_arrival_refuses_rows_without_their_tables(impl):
    k, dev, stream = _impl(impl)
    out = torch.empty((2, 4), dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="null pointer"):
        k.gather_rows_by_arrival(out.data_ptr(), 2, 4, 0, 2, 0, 3, stream)
    with pytest.raises(ValueError, match="targets >= 1"):
        k.gather_rows_by_arrival(out.data_ptr(), 0, 4, 0, 0, 0, 0, stream)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("G,A,rows_per_block", [(2, 7, 9), (8, 300, 300), (1, 5, 6), (4, 0, 3)])
def test_forward_sum_rows_gives_each_local_gpus_gather_row_where_it_sent_a_copy_as_the_torch_where_did(
        impl, G, A, rows_per_block):
    k, dev, stream = _impl(impl)
    g = torch.Generator().manual_seed(G * 1000 + A)
    dest = torch.randint(-1, 50, (A, G), dtype=torch.int64, generator=g)  # -1: that GPU sent no copy
    dest[:, 0] = torch.where(torch.rand(A, generator=g) < 0.5, -1, dest[:, 0])  # plenty of -1
    rows = torch.arange(G * rows_per_block, dtype=torch.int32).view(G, rows_per_block)[:, :A]
    want = torch.where(dest.t() >= 0, rows, -1)
    got = torch.full((G, A), 77, dtype=torch.int32, device=dev)
    dest_d = dest.to(dev)
    k.forward_sum_rows(got.data_ptr(), G, A, rows_per_block, dest_d.data_ptr(), stream)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="rows_per_block"):
        k.forward_sum_rows(got.data_ptr(), G, rows_per_block + 1, rows_per_block, dest_d.data_ptr(), stream)
