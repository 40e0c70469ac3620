"""What each host step of an internode forward pair issues, counted on the CPU stand-in of the native module.

On a GPU each torch op that allocates or launches, each upload and each native launch costs the host 5-30 us, so the
count per step (`bench internode`'s host steps: dispatch.pack, combine.gather, ...) says which steps are calls into
CUDA and which are Python. The stand-in runs the backend's own Python; its uploads go through an upload staging area
as on a GPU. Views (view, slice, select, t, ...) are not counted, nor what the stand-in's kernels do inside.

    python3 scripts/count_host_ops.py [--world 4] [--ranks-per-node 2] [--sync-free] [--ops]

Prints rank 0's counts for one forward pair (an uncached dispatch, then a combine of its handle) after two warm-up
pairs: per step, torch ops, native calls (kernels and context) and uploads; with --ops, which torch ops and native
calls they were.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "internode")]

import torch  # noqa: E402

from tests.distributed import run_distributed  # noqa: E402

VIEWS = {"detach", "view", "slice", "select", "alias", "t", "as_strided", "lift_fresh", "_local_scalar_dense",
         "unsqueeze", "expand"}


def _count(rank, world, G, T=1024, H=256, E=64, K=8, sync_free=False, ops=False):
    from torch.utils._python_dispatch import TorchDispatchMode

    import test_internode_backend_cpu as stand_in
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.upload_staging import UploadStaging

    stand_in.NVL = 64 << 20
    nat, _ = stand_in._backends(rank, world, G, rdma=64 << 20)
    step: collections.Counter = collections.Counter()
    inside = [0]  # inside a native call: what the stand-in does there is the kernel's, not the host's

    def wrap(obj):
        for name in dir(obj):
            f = getattr(obj, name)
            if name.startswith("_") or not callable(f) or isinstance(f, type):
                continue

            def counted(*a, _f=f, _name=name, **k):
                if not inside[0]:
                    step["native"] += 1
                    if ops:
                        step[f"  {_name}"] += 1
                inside[0] += 1
                try:
                    return _f(*a, **k)
                finally:
                    inside[0] -= 1
            setattr(obj, name, counted)

    wrap(nat._k)
    wrap(nat._cx)
    nat._staging = UploadStaging(torch.device("cpu"), lambda d, s, n, st: (step.update(["uploads"]),
                                                                           ctypes.memmove(d, s, n)), pinned=False)
    by_step: dict = {}
    lap = nat._lap

    def counting_lap(name):
        if name is not None:
            by_step.setdefault(name, collections.Counter()).update(step)
        step.clear()
        return lap(name)
    nat._lap = counting_lap
    nat.host_timing = {}  # (laps run only while the backend times its steps)

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and func.overloadpacket.__name__ not in VIEWS:
                step["torch ops"] += 1
                if ops:
                    step[f"  aten.{func.overloadpacket.__name__}"] += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(rank)
    idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    x, w = torch.randn((T, H), generator=g).to(torch.bfloat16), torch.rand((T, K), generator=g)
    tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)

    def pair():
        r = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w,
                                      num_worst_tokens=T * world if sync_free else 0))
        nat.combine(r.recv_x, r.handle, None, None)
    try:
        pair()
        pair()
        by_step.clear()
        with TorchOps():
            pair()
    finally:
        nat.destroy()
    return {name: dict(c) for name, c in by_step.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sync-free", action="store_true")
    p.add_argument("--ops", action="store_true", help="also name each step's torch ops and native calls")
    a = p.parse_args(argv)
    env = {"UCCL_EP_NUM_PROXY_THREADS": "2", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
           "UCCL_EP_RANKS_PER_NODE": str(a.ranks_per_node)}
    out = run_distributed(functools.partial(_count, G=a.ranks_per_node, sync_free=a.sync_free, ops=a.ops), a.world,
                          backend="gloo", timeout=600, env=env)
    for name, c in out[0].items():
        totals = {k: v for k, v in c.items() if not k.startswith("  ")}
        print(f"{name:40s} " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
        for k, v in sorted(c.items()):
            if k.startswith("  "):
                print(f"{'':40s} {k.strip()} x{v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
