"""The emulated NIC's wire beside the calls that used it (docs/internode.md, "Wire timeline").

Under the loopback's bandwidth cap a call can take no less than its bytes over the cap; what it takes beyond that
was spent before its first byte went out, with the wire idle in between (the senders fed it late), or after its last
byte landed. The wire records when it was busy (LoopbackWire, csrc/transport/loopback.hpp: runs of back-to-back
writes on the steady clock); the benchmark records each call's host window on the same clock; this module splits
each call's time into those parts. A diagnostic of `bench internode --timeline` with a capped loopback: the wire
takes a mutex per write while it records, and nothing otherwise.

With the kernel timeline put on the same clock (kernel_timeline.on_host_clock), the time after a call's last byte
splits further: until its reader saw the hop's last chunk land (the others' last bytes, and the proxies' signals),
until the reader finished its rows, and until the host returned (its drain and the rest of the call).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: The parts of a call, in us, as call_on_wire reports them, and the bytes it put on the wire.
PARTS = ("call_us", "carried_in_us", "wire_start_us", "wire_busy_us", "wire_idle_us", "wire_end_us", "after_wire_us",
         "wire_bytes", "longest_idle_us", "longest_idle_at_us", "bytes_before_longest_idle")
#: ... and with the call's reader on the same clock (None without one): after_wire_us split in three.
READER_PARTS = ("all_in_after_wire_us", "reader_after_all_in_us", "return_after_reader_us",
                "call_returned_after_reader_us", "synchronized_after_return_us",
                "drain_began_after_reader_us", "drained_after_reader_us", "returned_after_drain_us")


@dataclass(frozen=True)
class WireRun:
    """A stretch the wire was busy without a pause: [start_ns, end_ns) on the steady clock, and what crossed it."""

    start_ns: int
    end_ns: int
    bytes: int
    writes: int


@dataclass(frozen=True)
class CallWindow:
    """One call as the host saw it: from its start to the end of its GPU work, on the wire's clock; ``returned_ns``:
    when the call itself returned, before the benchmark synchronized; ``drain_ns``: when the call's last drain of its
    stream began and when it saw its mark (the backend's last_drain_ns; None: not recorded)."""

    kind: str
    start_ns: int
    end_ns: int
    returned_ns: Optional[int] = None
    drain_ns: Optional[Tuple[int, int]] = None


@dataclass(frozen=True)
class ReaderStamps:
    """A call's gated reader on the steady clock: when its watcher saw the hop's last chunk land, and when its last
    block finished (kernel_timeline fields all_in and reader_end)."""

    all_in_ns: int
    end_ns: int


def readers_in_calls(calls: Sequence[CallWindow], launches: Sequence[Dict[str, Any]],
                     gpu_minus_host_ns: int) -> List[Optional[ReaderStamps]]:
    """For each call, the reader stamps of the kernel-timeline launch (kernel_timeline.launch_record) that began within
    the call's window, the GPU timer mapped to the steady clock with ``gpu_minus_host_ns``; None for a call with no
    such launch, or whose hop had no gated reader."""
    from uccl_ep_train.kernel_timeline import on_host_clock

    placed = []
    for m in launches:
        start = on_host_clock(m, "start", gpu_minus_host_ns)
        all_in = on_host_clock(m, "all_in", gpu_minus_host_ns)
        end = on_host_clock(m, "reader_end", gpu_minus_host_ns)
        if start is not None and all_in is not None and end is not None:
            placed.append((start, ReaderStamps(all_in, end)))
    out: List[Optional[ReaderStamps]] = []
    for c in calls:
        inside = [r for start, r in placed if c.start_ns <= start < c.end_ns]
        out.append(inside[0] if inside else None)
    return out


def runs_from_log(log: Dict[str, Any]) -> List[WireRun]:
    """The runs of a stop_wire_log() answer, in time order. A log that dropped runs ran out of room: it would
    misreport the calls after the gap, so it is refused (start again with a larger capacity)."""
    if log.get("dropped"):
        raise ValueError(f"the wire log dropped {log['dropped']} runs: start it with a larger capacity")
    runs = [WireRun(*map(int, r)) for r in log["runs"]]
    for a, b in zip(runs, runs[1:]):
        if b.start_ns < a.end_ns:
            raise ValueError(f"wire runs overlap or are out of order: {a} then {b}")
    return runs


def call_on_wire(call: CallWindow, runs: Sequence[WireRun], reader: Optional[ReaderStamps] = None
                 ) -> Dict[str, Any]:
    """Where ``call``'s time went on this rank's wire, in us after its start (``runs`` in time order):
    carried_in_us, the wire still busy with what was posted before the call; wire_start_us, the first byte the call
    itself put on the wire; wire_busy_us and wire_idle_us, from then to wire_end_us, the wire busy and idle (idle: no
    write posted, so nothing to carry); after_wire_us, from the last byte to the call's end (negative where the call
    returned before its own last byte left: it ends when the others' bytes are in); wire_bytes, what the runs
    that began within the call carried (a run that began before it, and whatever joined it without a pause, counts as
    carried in); longest_idle_us, the longest of the idle stretches, longest_idle_at_us where it began and
    bytes_before_longest_idle what the call had put on the wire by then (a few KiB: the wire waited after the count
    row for the first records; most of the call: the senders fell behind near the end). A call that put nothing on
    the wire of its own has None for the wire's times.

    With the call's ``reader`` (readers_in_calls), READER_PARTS: all_in_after_wire_us, from the call's last byte on
    its own wire until its reader saw the hop's last chunk land (the other ranks' last bytes; negative when they were
    in first); reader_after_all_in_us, until the reader's last block finished; return_after_reader_us, until the
    window's end (the host's drain, what the call does after it, and the synchronize after it), split where the
    call's return was recorded into call_returned_after_reader_us and synchronized_after_return_us (the device's
    other work: the proxies' copy streams, copies queued after the drain). The first of those splits again at the
    call's last drain: drain_began_after_reader_us (negative: the host waited for the reader), drained_after_reader_us
    (when the drain saw its mark: the host's latency to notice the stream's end) and returned_after_drain_us (what the
    call does after its drain). None without a reader."""
    if call.end_ns < call.start_ns:
        raise ValueError(f"call window ends before it starts: {call}")
    s, e = call.start_ns, call.end_ns
    inside: List[Tuple[int, int]] = []
    sizes: List[int] = []  # bytes of each run in `inside`
    carried = nbytes = 0
    for r in runs:
        if r.end_ns <= s or r.start_ns >= e:
            continue
        if r.start_ns < s:  # the part posted before the call runs on into it
            carried += min(r.end_ns, e) - s
            continue
        # whole, also past the call's end: a rank's call ends when the others' bytes have landed, and its own may
        # still be on its wire then (after_wire_us < 0)
        inside.append((r.start_ns, r.end_ns))
        sizes.append(r.bytes)
        nbytes += r.bytes
    us = 1e-3
    out: Dict[str, Any] = {"call_us": (e - s) * us, "carried_in_us": carried * us, "wire_bytes": nbytes}
    out.update(dict.fromkeys(READER_PARTS))
    if reader is not None:
        out.update(reader_after_all_in_us=(reader.end_ns - reader.all_in_ns) * us,
                   return_after_reader_us=(e - reader.end_ns) * us)
        if call.returned_ns is not None:
            out.update(call_returned_after_reader_us=(call.returned_ns - reader.end_ns) * us,
                       synchronized_after_return_us=(e - call.returned_ns) * us)
        if call.drain_ns is not None and s <= call.drain_ns[0] <= call.drain_ns[1] <= e:  # (a drain of this call)
            out.update(drain_began_after_reader_us=(call.drain_ns[0] - reader.end_ns) * us,
                       drained_after_reader_us=(call.drain_ns[1] - reader.end_ns) * us)
            if call.returned_ns is not None:
                out["returned_after_drain_us"] = (call.returned_ns - call.drain_ns[1]) * us
        if inside:
            out["all_in_after_wire_us"] = (reader.all_in_ns - inside[-1][1]) * us
    if not inside:
        out.update(wire_start_us=None, wire_busy_us=0.0, wire_idle_us=None, wire_end_us=None, after_wire_us=None,
                   longest_idle_us=None, longest_idle_at_us=None, bytes_before_longest_idle=None)
        return out
    first, last = inside[0][0], inside[-1][1]
    busy = sum(hi - lo for lo, hi in inside)
    gap, gap_at, before = 0, None, 0
    for i in range(1, len(inside)):
        if inside[i][0] - inside[i - 1][1] > gap:
            gap, gap_at, before = inside[i][0] - inside[i - 1][1], inside[i - 1][1], sum(sizes[:i])
    out.update(wire_start_us=(first - s) * us, wire_busy_us=busy * us, wire_idle_us=(last - first - busy) * us,
               wire_end_us=(last - s) * us, after_wire_us=(e - last) * us, longest_idle_us=gap * us,
               longest_idle_at_us=(gap_at - s) * us if gap_at is not None else None,
               bytes_before_longest_idle=before if gap_at is not None else None)
    return out


def summarize(calls: Sequence[CallWindow], runs: Sequence[WireRun],
              readers: Optional[Sequence[Optional[ReaderStamps]]] = None) -> Dict[str, Dict[str, Any]]:
    """Per kind of call: how many, and the median of each of PARTS and READER_PARTS over them (None where no call of
    the kind has it). ``readers``: one per call (readers_in_calls), or None. Medians, so that one call slowed by the
    host does not move the picture."""
    if readers is not None and len(readers) != len(calls):
        raise ValueError(f"{len(readers)} readers for {len(calls)} calls")
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for i, c in enumerate(calls):
        by_kind.setdefault(c.kind, []).append(call_on_wire(c, runs, readers[i] if readers is not None else None))
    out: Dict[str, Dict[str, Any]] = {}
    for kind, rows in by_kind.items():
        row: Dict[str, Any] = {"calls": len(rows)}
        for part in PARTS + READER_PARTS:
            vals = [r[part] for r in rows if r[part] is not None]
            row[f"median_{part}"] = round(statistics.median(vals), 1) if vals else None
        out[kind] = row
    return out
