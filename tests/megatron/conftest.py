"""Shared fixtures of the Megatron integration tests (CPU; megatron-core from the environment)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.fixture(scope="session")
def patched():
    """megatron_patch applied once for the session (apply() is idempotent and process-wide)."""
    import megatron_patch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return megatron_patch.apply()
