"""GPU stamps of each hop's pack-and-push launch and of its gated reader (docs/internode.md, "Kernel timeline").

Where a hop's time goes before its wire -- waiting for the count rows, writing the first chunk's records, pushing --
and after it -- the last chunk landing, the reader finishing its rows -- is read from the GPU's global timer here
instead of inferred from the host's laps or a profiler's kernel totals. The kernels write the stamps
(csrc/kernels/timeline.hpp, TimelineField); this module starts and stops that, labels each launch with the kind of
call that made it, and turns the stamps into microseconds after the launch's start. A diagnostic of
`bench internode --timeline`: off otherwise, when the kernels pay one test of a null pointer.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

import torch

#: Kinds of launch, by the call that made it.
DISPATCH_DURING_NOTIFY = "dispatch during notify"  # an uncached dispatch's records, pushed once the count rows are in
DISPATCH = "dispatch"  # a cached dispatch, or an uncached one pushed after notify
COMBINE = "combine"

#: Fields that hold the earliest stamp of the launch's threads: they start at UINT64_MAX (-1 as int64).
EARLIEST = ("start", "first_ready", "first_push", "reader_start")
#: Fields reported in microseconds after the launch's start: the pack-and-push launch's, then its hop's gated reader's
#: (its start, the watcher seeing the hop's last chunk land, its last block done).
TIMES = ("rows_in", "first_ready", "first_push", "last_push", "packers_done", "reader_start", "all_in", "reader_end")


class KernelTimeline:
    """Stamps the next ``capacity`` pack_and_push launches of one rank's context ``cx`` (the native module's
    InternodeContext; ``k``: that module, for the field names). Call note(kind) after every launch that may have
    stamped a row, and stop() once, after the GPU ran them."""

    def __init__(self, cx: Any, k: Any, device: torch.device, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a kernel timeline needs room for at least one launch, got capacity {capacity}")
        self._cx = cx
        self.fields: Sequence[str] = tuple(k.TIMELINE_FIELDS)
        self._stamps = torch.zeros((capacity, int(k.TIMELINE_WIDTH)), dtype=torch.int64, device=device)
        for name in EARLIEST:
            if name in self.fields:  # (an older module of an A/B run stamps fewer)
                self._stamps[:, self.fields.index(name)] = -1
        self.kinds: List[str] = []
        cx.set_timeline(self._stamps.data_ptr(), capacity)

    def note(self, kind: str) -> None:
        """Label the rows stamped since the last note (none when the launch wrote no record, or the rows ran out)."""
        used = int(self._cx.timeline_launches())
        self.kinds += [kind] * (used - len(self.kinds))

    def stop(self) -> List[Dict[str, Any]]:
        """Stop stamping; every labelled launch as launch_record makes it. The caller has synchronized the device."""
        self._cx.set_timeline(0, 0)
        rows = self._stamps[:len(self.kinds)].cpu().tolist()
        return [launch_record(kind, row, self.fields) for kind, row in zip(self.kinds, rows)]


def launch_record(kind: str, row: Sequence[int], fields: Sequence[str]) -> Dict[str, Any]:
    """One launch's stamps: its kind, its start (global timer, ns), the commands it pushed, and each of TIMES in us
    after its start (None: it never happened -- no count row waited for, no chunk ready, nothing pushed)."""
    at = dict(zip(fields, row))
    start = at["start"]
    out: Dict[str, Any] = {"kind": kind, "start_ns": start if start >= 0 else None, "chunks": at["chunks"]}
    for name in TIMES:
        v = at.get(name, 0)
        out[f"{name}_us"] = (v - start) / 1e3 if start >= 0 and v > 0 else None
    return out


def on_host_clock(launch: Dict[str, Any], name: str, gpu_minus_host_ns: int) -> Optional[int]:
    """When field ``name`` of ``launch`` (launch_record) happened on the host's steady clock, given the GPU timer's
    offset from it (the native gpu_timer_minus_steady_ns); None where the launch never stamped it."""
    if launch["start_ns"] is None:
        return None
    if name == "start":
        return launch["start_ns"] - gpu_minus_host_ns
    us = launch.get(f"{name}_us")
    return None if us is None else launch["start_ns"] + round(us * 1e3) - gpu_minus_host_ns


def waited_for_rows_us(launch: Dict[str, Any]) -> Optional[float]:
    """How long a launch pushed during notify held a ready chunk back for the count rows: the rows' arrival after its
    first chunk was ready (0 when they were in first); None when it waited for no row or had no chunk."""
    rows, ready = launch["rows_in_us"], launch["first_ready_us"]
    if rows is None or ready is None:
        return None
    return max(0.0, rows - ready)


def summarize(launches: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per kind of launch: how many, and the median of each time (us after the launch's start) over the launches that
    have it, with waited_for_rows_us."""
    out: Dict[str, Dict[str, Any]] = {}
    for kind in dict.fromkeys(launch["kind"] for launch in launches):
        mine = [launch for launch in launches if launch["kind"] == kind]
        row: Dict[str, Any] = {"launches": len(mine)}
        for name in [f"{t}_us" for t in TIMES] + ["waited_for_rows_us"]:
            values = [v for v in (waited_for_rows_us(m) if name == "waited_for_rows_us" else m[name] for m in mine)
                      if v is not None]
            row[f"median_{name}"] = statistics.median(values) if values else None
        out[kind] = row
    return out


def start_lags(launches_by_rank: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Optional[float]]]:
    """Per rank and kind of launch, the median of how long after the earliest rank's start of the same launch (the
    same call on every rank: the ranks make the same calls) this rank's began, in us. The late rank is the one whose
    count row the others' pushes during notify wait for. Only meaningful on one clock: ranks that share a GPU, or GPUs
    whose global timers agree (on separate GPUs an offset between them shows as a constant lag). None where a launch
    is missing on some rank or its kinds differ between ranks."""
    count = min((len(launches) for launches in launches_by_rank), default=0)
    lags: List[Dict[str, List[float]]] = [{} for _ in launches_by_rank]
    for j in range(count):
        same = [launches[j] for launches in launches_by_rank]
        if len({m["kind"] for m in same}) != 1 or any(m["start_ns"] is None for m in same):
            continue
        first = min(m["start_ns"] for m in same)
        for r, m in enumerate(same):
            lags[r].setdefault(m["kind"], []).append((m["start_ns"] - first) / 1e3)
    kinds = dict.fromkeys(m["kind"] for launches in launches_by_rank for m in launches)
    return [{kind: statistics.median(mine[kind]) if kind in mine else None for kind in kinds} for mine in lags]
