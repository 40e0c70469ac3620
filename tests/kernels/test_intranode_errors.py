"""Errors the intranode kernels report reach Python as exceptions that say what to inspect next."""
import pytest

from uccl_ep_train.doctor import TIMEOUT_HINT
from uccl_ep_train.intranode import IntranodeError, NativeIntranodeBackend


class _ReportingContext:
    def __init__(self, message):
        self.message = message

    def error_message(self):
        return self.message

    def clear_error(self):
        self.message = ""


def _backend_with(message):
    backend = object.__new__(NativeIntranodeBackend)
    backend._cx = _ReportingContext(message)
    return backend


def test_gpu_wait_past_its_deadline_raises_with_rank_counter_and_the_doctor_hint():
    backend = _backend_with("rank 1 block 3: notify barrier timed out waiting for peer 0: flag 6, expected 7")
    with pytest.raises(IntranodeError) as exc:
        backend._check_error()
    text = str(exc.value)
    assert "rank 1 block 3" in text and "expected 7" in text and TIMEOUT_HINT in text
    backend._check_error()  # the error was cleared: the next call goes on


def test_receive_area_overflow_names_the_size_problem_without_the_timeout_hint():
    backend = _backend_with("rank 0 block 0: receive area overflow, counter 8169, expected 6950")
    with pytest.raises(IntranodeError) as exc:
        backend._check_error()
    assert "overflow" in str(exc.value) and TIMEOUT_HINT not in str(exc.value)
