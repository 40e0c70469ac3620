"""What an internode rank says about itself when something fails: its command FIFOs, its proxy threads and the
signal counters it waits on (docs/internode.md, "Diagnostics"). Read-only, callable from any thread while kernels run.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence


def describe_fifo_states(states: Sequence[dict], rank: int) -> str:
    """One clause on this rank's command FIFOs for an error message. A FIFO whose kernels reserved more slots
    (device head) than its proxy took (tail) either still has commands queued (slots full from the tail on) or lost a
    push: the slot at the tail is empty, so the proxy waits there forever, and no watchdog fires because nothing is
    queued or in flight from its point of view. That is what the "last chunk of a lane never arrived" failures
    needed to tell apart (the cause was teardown: docs/internode.md, "Teardown")."""
    odd = []
    for f in states:
        head, tail, full = int(f["device_head"]), int(f["tail"]), int(f["full"])
        if head == tail and full == 0:
            continue
        if head < 0:
            kind = "head unreadable"
        elif head > tail and (full == 0 or int(f["first_full"]) != tail):
            kind = f"LOST PUSH: slot {tail} is empty, {head - tail} reserved past the tail, {full} full"
        elif head > tail:
            kind = f"{full} queued"
        else:
            kind = f"{full} full slots past the tail"
        odd.append(f"fifo {f['fifo']} head {head} tail {tail} ({kind})")
    if not odd:
        return f"rank {rank} FIFOs: every command kernels pushed was taken by the proxy ({len(states)} FIFOs)"
    return f"rank {rank} FIFOs: " + ", ".join(odd)


# Every backend of this process (NativeInternodeBackend registers itself through track), for live_state(): a test
# harness asks a rank that did not fail for its side of a failure (tests/distributed.py sends SIGUSR1 to the other
# ranks when one fails).
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(backend: Any) -> None:
    """Count ``backend`` in live_state() until it is destroyed or collected."""
    _LIVE.add(backend)


def live_state() -> str:
    """One line per live backend of this process: its FIFOs, its proxy's totals and error, and every signal counter
    that differs from what this rank has waited for so far. Read-only and safe while kernels run (host memory, and
    the FIFO heads through a stream of its own)."""
    lines = []
    for b in list(_LIVE):
        if b._destroyed:
            continue
        try:
            seen = [b._cx.signal_value(i) for i in range(len(b._expected))]  # one read per counter: they move
            off = [f"{i}={v}/{e}" for i, (v, e) in enumerate(zip(seen, b._expected)) if v != e]
            lines.append(f"rank {b.rank}: {describe_fifo_states(b._cx.fifo_states(), b.rank)}; proxy totals "
                         f"{b._cx.proxy_totals()}; proxy error {b._cx.proxy_error()!r}; signals differing from "
                         f"what was waited for (slot=value/expected): {', '.join(off) or 'none'}\n"
                         f"{b._cx.proxy_counters()}")
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            lines.append(f"rank {b.rank}: state not readable: {exc}")
    return "\n".join(lines) or "no live internode backend in this process"


def timeout_hint() -> str:
    """What every timeout message ends with: where to look next (`uccl-ep-train doctor`, the state to inspect)."""
    from uccl_ep_train.doctor import TIMEOUT_HINT

    return TIMEOUT_HINT
