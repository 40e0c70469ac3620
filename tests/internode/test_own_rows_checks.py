"""The native readers' checks on our own rows read from the columns (internode_plan.hpp OwnRows; docs/internode.md,
"Own rows from the columns"): what a reader would take from a column that does not hold it, at an address its loads
may not use, or with several GPUs per node is refused with a ValueError before any launch. These run the compiled
module's host code only: every case fails before a kernel could start, so no GPU is needed."""
import pytest

from uccl_ep_train import native

H_BYTES, K = 512, 4
X, IDS, W, RANKS = 0, 512, 544, 560  # the record: payload, top-k ids (int64), weights (fp32), pair ranks (int32)
SRC_IDX = 576
BASE = 1 << 20  # a 16-byte aligned address; nothing is dereferenced


def _internode():
    if not native.available() or not hasattr(native.module(), "internode"):
        pytest.skip("the native module is not built with its internode kernels")
    return native.module().internode


def _own(columns, first_row=0, count=2):
    return (first_row, count, 0, BASE, columns)


ALL_COLUMNS = [(BASE, H_BYTES, X), (BASE + 4096, 8 * K, IDS), (BASE + 8192, 4 * K, W), (BASE + 12288, 4 * K, RANKS)]


def _receive(k, own, arrival_offset=-1, x_column_at=BASE, slots_given=False):
    k.expert_major_receive(
        BASE, 1024, 4, X, H_BYTES, 0, 0, BASE, 0, 16, K, slots_given, BASE, IDS, W, RANKS, 0, 4, 2, BASE, BASE,
        BASE, BASE, BASE, BASE, SRC_IDX, BASE, arrival_offset, BASE, 0,
        own=own if x_column_at == BASE else _own([(x_column_at, H_BYTES, X)] + ALL_COLUMNS[1:]))


def _unpack(k, own, arrival_offset=-1):
    k.unpack_records(BASE, 1024, 4, 4, [(BASE, H_BYTES, X)], BASE, BASE, IDS, W, K, 0, 4, SRC_IDX, BASE,
                     arrival_offset, BASE, 0, own=own)


def test_the_expert_major_reader_refuses_own_rows_whose_fields_no_column_holds_before_any_launch():
    k = _internode()
    with pytest.raises(ValueError, match="lies in none of the own columns"):  # the pair ranks' column left out
        _receive(k, _own(ALL_COLUMNS[:3]))
    with pytest.raises(ValueError, match="lies in none of the own columns"):  # the payload's column left out
        _receive(k, _own(ALL_COLUMNS[1:]), slots_given=True)


def test_the_expert_major_reader_refuses_a_payload_column_its_16_byte_loads_cannot_read():
    with pytest.raises(ValueError, match="16-byte aligned"):
        _receive(_internode(), None, x_column_at=BASE + 8)


def test_own_rows_from_the_columns_are_refused_with_several_gpus_per_node_or_past_the_rows():
    k = _internode()
    with pytest.raises(ValueError, match="one GPU per node"):
        _receive(k, _own(ALL_COLUMNS), arrival_offset=580)
    with pytest.raises(ValueError, match="one GPU per node"):
        _unpack(k, _own(ALL_COLUMNS), arrival_offset=580)
    with pytest.raises(ValueError, match="end past the rows"):
        _receive(k, _own(ALL_COLUMNS, first_row=3, count=2))
    with pytest.raises(ValueError, match="end past the rows"):
        _unpack(k, _own(ALL_COLUMNS, first_row=3, count=2))


def test_the_rank_major_reader_refuses_own_rows_whose_weights_no_column_holds_and_own_rows_without_tokens():
    k = _internode()
    with pytest.raises(ValueError, match="lies in none of the own columns"):
        _unpack(k, _own(ALL_COLUMNS[:2]))
    with pytest.raises(ValueError, match="tokens"):
        _unpack(k, (0, 2, 0, 0, ALL_COLUMNS))
