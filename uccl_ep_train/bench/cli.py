"""`uccl-ep-train bench <what>`: each benchmark lives in its own module with `add_parser(sub)`.

Benchmarks run on GPU machines beside their baselines in one process group (launch with torchrun); results are kept
in docs/benchmarks/ with the command that made them.
"""
from __future__ import annotations

import importlib

_BENCHES = {
    "proxy": "uccl_ep_train.bench.proxy",          # command FIFO + proxy throughput/latency
    "dispatch": "uccl_ep_train.bench.dispatch",    # dispatch/combine kernels vs NCCL all_to_all
    "internode": "uccl_ep_train.bench.internode",  # hierarchical path, one host's GPUs as several nodes
    "dispatcher": "uccl_ep_train.bench.dispatcher",  # Megatron dispatchers round trip
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (run on GPU machines, beside the baselines)")
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, module_name in _BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            stub = sub.add_parser(name, help=f"(unavailable: {exc})")
            stub.set_defaults(func=lambda args, name=name, exc=exc: _unavailable(name, exc))
            continue
        module.add_parser(sub)


def _unavailable(name: str, exc: Exception) -> int:
    print(f"uccl-ep-train bench {name}: cannot run here: {exc}")
    return 2
