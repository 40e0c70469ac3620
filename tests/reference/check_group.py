"""Named checks run together in one process group per topology (start-up is the expensive part); each test then
asserts the outcome of one named check on every rank.

A failed assertion must not skip the next collective (the group would fall out of step), so a check asserts inside
`soft(...)` after its collectives; `run_named` records what failed, per check, and `expect` raises it in the test.
"""
from __future__ import annotations

import contextlib
import traceback

import pytest

from tests.distributed import run_distributed

_ERRORS: list = []


@contextlib.contextmanager
def soft(what: str = ""):
    """Record a failure without skipping the collectives that follow."""
    try:
        yield
    except Exception:
        _ERRORS.append(f"[{what}] {traceback.format_exc()}")


def checks_in(namespace: dict, leave_out=()) -> dict:
    """The module's `check_*` functions, by name without the prefix."""
    return {name[len("check_"):]: fn for name, fn in namespace.items()
            if name.startswith("check_") and name not in leave_out}


def run_named(checks: dict, rank, world, g) -> dict:
    """Run every check on this rank; name -> the failures it recorded, or None."""
    outcomes = {}
    for name, fn in checks.items():
        _ERRORS.clear()
        with soft(name):
            fn(rank, world, g)
        outcomes[name] = "\n".join(_ERRORS) or None
    return outcomes


def outcomes_fixture(run_checks, topologies: dict, timeout: float = 150):
    """A module fixture, one group per topology (name -> (ranks, ranks per node)): every rank's outcomes of
    ``run_checks(rank, world, ranks_per_node)`` (a module-level function, so the ranks can import it)."""
    @pytest.fixture(scope="module", params=list(topologies))
    def outcomes(request):
        world, g = topologies[request.param]
        return run_distributed(run_checks, world, g, timeout=timeout)
    return outcomes


def expect(outcomes, name):
    failures = [f"rank {r}:\n{o[name]}" for r, o in enumerate(outcomes) if o[name]]
    assert not failures, "\n".join(failures)
