"""The 16-byte command: every field's range round-trips, and anything that does not fit is rejected."""
import random

import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")


@pytest.fixture(scope="module")
def cmd():
    return native.module().command


def test_write_signal_fields_round_trip_at_every_range_edge(cmd):
    rng = random.Random(5)
    edges = {
        "dst_rank": [0, 1, cmd.MAX_RANKS - 1],
        "bytes": [0, 16, cmd.MAX_BYTES],
        "local_offset": [0, 16, cmd.MAX_OFFSET],
        "remote_offset": [0, 16, cmd.MAX_OFFSET],
        "slot": [0, 1, cmd.MAX_SLOTS - 1],
        "value": [0, 1, cmd.MAX_VALUE],
    }
    cases = [{k: v[i % 3] for k, v in edges.items()} for i in range(3)]
    cases += [{k: rng.choice(v) for k, v in edges.items()} for _ in range(200)]
    for f in cases:
        lo, hi = cmd.write_signal(f["dst_rank"], f["bytes"], f["local_offset"], f["remote_offset"], f["slot"],
                                  f["value"])
        d = cmd.decode(lo, hi)
        assert d["type"] == cmd.WRITE_SIGNAL
        for k, v in f.items():
            assert d[k] == v, (k, f)


def test_random_fields_round_trip_and_do_not_bleed_into_neighbours(cmd):
    rng = random.Random(9)
    for _ in range(2000):
        f = (rng.randrange(cmd.MAX_RANKS), 16 * rng.randrange(cmd.MAX_BYTES // 16 + 1),
             16 * rng.randrange(cmd.MAX_OFFSET // 16 + 1), 16 * rng.randrange(cmd.MAX_OFFSET // 16 + 1),
             rng.randrange(cmd.MAX_SLOTS), rng.randrange(cmd.MAX_VALUE + 1))
        d = cmd.decode(*cmd.write_signal(*f))
        assert (d["dst_rank"], d["bytes"], d["local_offset"], d["remote_offset"], d["slot"], d["value"]) == f
        w = cmd.decode(*cmd.write(f[0], max(16, f[1]), f[2], f[3]))
        assert w["type"] == cmd.WRITE and w["slot"] == 0 and w["value"] == 0 and w["bytes"] == max(16, f[1])


@pytest.mark.parametrize("add", [0, 1, -1, 123456789, -987654321, (1 << 41) - 1, -(1 << 41)])
def test_atomic_addend_keeps_its_sign_across_42_bits(cmd, add):
    d = cmd.decode(*cmd.atomic(7, 100, add))
    assert d["type"] == cmd.ATOMIC and d["atomic_add"] == add and d["dst_rank"] == 7 and d["slot"] == 100
    assert cmd.MAX_ATOMIC == (1 << 41) - 1 and cmd.MIN_ATOMIC == -(1 << 41)


def test_quiet_and_barrier_are_valid_nonzero_commands(cmd):
    assert cmd.decode(*cmd.quiet())["type"] == cmd.QUIET
    assert cmd.decode(*cmd.barrier())["type"] == cmd.BARRIER
    assert cmd.try_control(cmd.WRITE)[0] != 0


REJECT = [
    ("rank", lambda c: c.try_write_signal(c.MAX_RANKS, 16, 0, 0, 0, 0), "dst_rank"),
    ("bytes too big", lambda c: c.try_write_signal(0, c.MAX_BYTES + 16, 0, 0, 0, 0), "byte count out of range"),
    ("bytes unaligned", lambda c: c.try_write_signal(0, 24, 0, 0, 0, 0), "not a multiple of 16"),
    ("plain write of nothing", lambda c: c.try_write(0, 0, 0, 0), "byte count"),
    ("local offset too big", lambda c: c.try_write(0, 16, c.MAX_OFFSET + 16, 0), "local offset out of range"),
    ("local offset unaligned", lambda c: c.try_write(0, 16, 8, 0), "local offset not a multiple"),
    ("remote offset too big", lambda c: c.try_write(0, 16, 0, c.MAX_OFFSET + 16), "remote offset out of range"),
    ("remote offset unaligned", lambda c: c.try_write(0, 16, 0, 4), "remote offset not a multiple"),
    ("slot", lambda c: c.try_write_signal(0, 16, 0, 0, c.MAX_SLOTS, 1), "slot"),
    ("value", lambda c: c.try_write_signal(0, 16, 0, 0, 0, c.MAX_VALUE + 1), "signal value"),
    ("atomic too big", lambda c: c.try_atomic(0, 0, c.MAX_ATOMIC + 1), "atomic"),
    ("atomic too small", lambda c: c.try_atomic(0, 0, c.MIN_ATOMIC - 1), "atomic"),
    ("atomic slot", lambda c: c.try_atomic(0, c.MAX_SLOTS, 1), "slot"),
    ("atomic rank", lambda c: c.try_atomic(c.MAX_RANKS, 0, 1), "dst_rank"),
]


@pytest.mark.parametrize("name,make,needle", REJECT, ids=[r[0] for r in REJECT])
def test_encoder_rejects_fields_that_do_not_fit(cmd, name, make, needle):
    err, words = make(cmd)
    assert err != 0 and words == (0, 0)
    assert needle in cmd.error_name(err)


def test_raising_encoders_name_the_field(cmd):
    with pytest.raises(ValueError, match="signal value"):
        cmd.write_signal(0, 16, 0, 0, 0, cmd.MAX_VALUE + 1)
    with pytest.raises(ValueError, match="entry 1"):
        import numpy as np
        z = np.zeros(2, dtype=np.uint64)
        cmd.encode_writes(z, np.array([16, 20], dtype=np.uint64), z, z, z, np.zeros(2, dtype=np.int64))


def test_empty_slot_is_all_zero_and_every_valid_command_has_a_nonzero_type(cmd):
    assert cmd.decode(0, 0)["type"] == cmd.EMPTY
    for words in (cmd.write(0, 16, 0, 0), cmd.write_signal(0, 0, 0, 0, 0, 0), cmd.atomic(0, 0, 0),
                  cmd.quiet(), cmd.barrier()):
        assert words[0] & 0xF != 0
