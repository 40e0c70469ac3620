"""Hierarchical dispatch/combine across nodes through the CPU proxies (docs/internode.md).

A token crosses the network once per destination node, to the rail-aligned rank there (same local index), as part of
a per-node block of records that the GPU hands to the proxy as WRITE_SIGNAL commands; the forwarder waits on the
signal counters and copies every record over NVLink to the GPUs of its node that need it. Combine reduces within the
node at the forwarder and sends one fp32 partial sum per (token, node) back; the source adds them in node order.

What every rank must agree on before a byte moves (offsets, push tables, waits, limits) is pure planning in plan.py,
proven on CPU against reference.py. The rest of this package drives the native module (``_C.internode``), one module
per part of a call; NativeInternodeBackend (backend.py) composes them:

    backend.py         setup (regions, proxy bootstrap, agreed settings), teardown, benchmark probes
    dispatch.py        dispatch: uncached and cached, the two hops of per-token columns
    combine.py         combine: node sums at the forwarder, partial sums back, the gather
    notify.py          the count exchange, the send plan, packing and pushing during notify
    hops.py            push tables, signal waits, gates, hop plans
    records.py         packing columns into records, unpacking final rows
    forward.py         the dispatch forward over NVLink and its node barrier
    before_counts.py   readers (and forwards) launched before the count read; sync-free early return
    expert_major.py    expert-major receives
    planning_ahead.py  a call planning its handle's next calls during its hop
    drains.py          when the host waits for its stream; failed waits as errors
    handle.py, call_state.py, columns.py   the data the parts pass along

and beside them, used by the parts and by other layers:

    plan.py            the planning every rank agrees on (pure torch; the kernels' definitions)
    transport.py       the transport choice (loopback or verbs), alike on every rank
    diagnostics.py     what a rank reports about a failure (FIFOs, proxy threads, live state)
"""
from uccl_ep_train.internode.plan import InternodeError
from uccl_ep_train.internode.backend import NativeInternodeBackend, group_settings_disagree
from uccl_ep_train.internode.drains import check_stream_without_drains, drain_after_waits
from uccl_ep_train.internode.expert_major import reads_expert_major_rows
from uccl_ep_train.internode.handle import InternodeHandle

__all__ = ["InternodeError", "InternodeHandle", "NativeInternodeBackend", "check_stream_without_drains",
           "drain_after_waits", "group_settings_disagree", "reads_expert_major_rows"]
