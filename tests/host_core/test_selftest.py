"""`_C.loopback_selftest()`: the in-process proxy + loopback check that `uccl-ep-train doctor` runs."""
from __future__ import annotations

import os

import pytest

from uccl_ep_train import doctor, native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")


def test_selftest_verifies_every_command_with_reordering_and_reports_rate():
    d = native.module().loopback_selftest_details(commands=3000, reorder=8, seed=5)
    assert d["commands"] == 6000 and d["bytes"] >= 6000 * 16
    assert d["signals"] > d["commands"]        # increments above 255 were split into extra immediates
    assert d["max_reorder_held"] > 0           # signals really arrived out of order and were held
    assert "6000 write+signal commands" in d["summary"] and "commands/s" in d["summary"]


def test_selftest_in_order_sends_one_immediate_per_command():
    d = native.module().loopback_selftest_details(commands=500, reorder=0)
    assert d["signals"] == d["commands"] == 1000 and d["max_reorder_held"] == 0


@pytest.mark.parametrize("fault,needle", [("byte", "received wrong bytes from rank 0"),
                                          ("signal", "signal slot 3 is")])
def test_selftest_raises_naming_the_damaged_byte_or_counter(fault, needle):
    with pytest.raises(native.module().ProxyError, match=needle):
        native.module().loopback_selftest_details(commands=400, inject_fault=fault)


def test_default_selftest_returns_a_one_line_summary():
    text = native.module().loopback_selftest()
    assert "\n" not in text and "8192 write+signal commands" in text and "verified" in text


def test_doctor_selftest_check_passes_with_the_summary():
    d = doctor.Doctor(os.path.join(FIXTURES, "no_rdma"), env={}, use_tools=False)
    d.check_selftest()
    (check,) = d.checks
    assert check.name == "loopback_selftest" and check.status == "pass", check
    assert "commands/s" in check.detail and "verified" in check.detail
