"""Helpers of the verbs tests: simulated NIC descriptions for the recording fake ibv table (no RDMA hardware)."""
from __future__ import annotations

import ctypes

try:
    from uccl_ep_train import _C  # type: ignore[attr-defined]
except ImportError:
    _C = None

# None when the module is not built, or built without rdma-core headers: the test modules skip themselves.
verbs = _C.verbs if _C is not None and getattr(_C, "verbs", None) and _C.verbs.available else None
fake = verbs.fake if verbs else None
K = fake.consts if fake else {}
SKIP_REASON = "uccl_ep_train._C not built with the verbs transport (install libibverbs-dev and rebuild)"


def cx7(name: str, idx: int = 0) -> dict:
    """A ConnectX-7 RoCE port: link-local at 0/1, IPv4-mapped RoCE v1 at 2 and RoCE v2 at 3."""
    ll = f"fe80:0000:0000:0000:a288:c2ff:fe00:{idx:04x}"
    v4 = f"0000:0000:0000:0000:0000:ffff:0a00:{idx + 1:04x}"
    return {"name": name, "link_layer": "Ethernet", "vendor_id": 0x15b3, "atomics": True,
            "gids": [{"index": 0, "gid": ll, "type": "IB/RoCE v1", "netdev": "ens1np0"},
                     {"index": 1, "gid": ll, "type": "RoCE v2", "netdev": "ens1np0"},
                     {"index": 2, "gid": v4, "type": "IB/RoCE v1", "netdev": "ens1np0"},
                     {"index": 3, "gid": v4, "type": "RoCE v2", "netdev": "ens1np0"}]}


def efa(name: str, idx: int = 0) -> dict:
    return {"name": name, "link_layer": "Unknown", "vendor_id": 0x1d0f, "atomics": False,
            "gids": [{"index": 0, "gid": f"fe80:0000:0000:0000:0401:27ff:fe00:{idx:04x}", "type": "IB/RoCE v1"}]}


class Buffers:
    """Host buffers that stay alive for the test (the fake never touches them; addresses must be real)."""

    def __init__(self):
        self._keep = []

    def new(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        self._keep.append(buf)
        return ctypes.addressof(buf)


def connect_all(transports):
    infos = [t.local_info() for t in transports]
    for t in transports:
        t.connect(infos)


def calls(fn=None):
    return [c for c in fake.calls() if fn is None or c["fn"] == fn]
