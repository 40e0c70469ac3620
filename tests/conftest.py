"""Shared test setup: make the repository root importable so tests can use `from tests.distributed import ...`."""
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _under_torchrun_with_peers() -> bool:
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and int(os.environ.get("WORLD_SIZE", "1")) > 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under torchrun with peers (the GPU suites), a failed test ends its rank at once, after printing why.

    The ranks run the same tests in lockstep, so a rank that fails mid-test skips collectives its peers then wait
    for; pytest's -x alone ended the failing rank only after module teardown, itself a collective, and the whole
    run hung until its timeout with no traceback. Exiting makes torchrun stop the peers and keeps the reason."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _under_torchrun_with_peers():
        sys.stderr.write(f"\n{report.nodeid} failed on rank {os.environ.get('RANK', '?')}; ending this rank so its "
                         f"peers stop waiting for it:\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)
