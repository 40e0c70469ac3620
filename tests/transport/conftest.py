"""Fixtures for the verbs tests: a recording fake ibv table with simulated NICs (no RDMA hardware needed)."""
from __future__ import annotations

import gc

import pytest

from verbs_fake_support import Buffers, fake


@pytest.fixture
def buffers():
    return Buffers()


@pytest.fixture
def fake_nics():
    """install(devices, dmabuf=False) -> the fake module; uninstalled (after transports are collected) at teardown."""

    def install(devices, dmabuf=False):
        fake.install(devices, dmabuf)
        return fake

    yield install
    gc.collect()
    fake.uninstall()
