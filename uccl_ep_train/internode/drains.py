"""When the host waits for its stream, and what it reports when a wait fails (docs/internode.md, "Drains").

A drain after a network wait keeps the caller's CUDA calls from queueing behind our spinning kernels where the
bytes they wait for are moved by this process's proxy threads (the loopback without its copy agent)."""
from __future__ import annotations

import time
from typing import Optional


from uccl_ep_train import native
from uccl_ep_train.internode.diagnostics import describe_fifo_states, timeout_hint
from uccl_ep_train.internode.plan import InternodeError, describe_gpu_error


def drain_after_waits(setting: str, transport: str = "loopback", copy_agent: bool = False) -> bool:
    """Whether the host waits for its stream after every network wait (UCCL_EP_DRAIN_AFTER_WAITS). ``never`` lets
    the host launch the next steps while a wait spins, and a sync-free dispatch return before the count read; a
    caller's CUDA call made meanwhile may then wait for our spinning kernel. That is harmless where the bytes the
    kernel waits for move beside the process -- over verbs, and over the loopback with its copy agent -- and stalls
    the loopback whose proxy threads copy: a pageable copy on the legacy default stream, a free or a module load
    holds the driver locks their copies need (sessions 33-35). ``auto`` (the default) is ``never`` for the former
    and ``always`` for the latter. docs/internode.md, "Drains" and "The copy agent"."""
    if setting == "auto":
        return not (transport == "verbs" or copy_agent)
    return setting == "always"


# The legacy default stream, as torch's default stream (0) and CUDA's explicit handle for it (cudaStreamLegacy, 1):
# the only streams whose waiting pageable copies hold the loopback's (blocking streams and the per-thread default
# stream do not; scripts/probe_blocking_calls.cu PROBE_LEGACY).
_LEGACY_STREAMS = (0, 1)


def check_stream_without_drains(drains: bool, transport: str, stream: int, rank: int,
                                copy_agent: bool = False) -> None:
    """Raise before any launch where a call would stall: without drains (UCCL_EP_DRAIN_AFTER_WAITS=never), over the
    loopback transport whose proxy threads copy (no copy agent), on the legacy default stream. There any pageable
    copy of the caller that queues behind our spinning wait would hold the proxies' copies until the GPU deadline
    (docs/internode.md, "Drains")."""
    if drains or transport != "loopback" or copy_agent or stream not in _LEGACY_STREAMS:
        return
    raise InternodeError(
        f"rank {rank}: UCCL_EP_DRAIN_AFTER_WAITS=never over the loopback transport needs the caller on a non-default "
        f"stream, and this call runs on the legacy default stream: a pageable copy there (.cpu(), .item()) while our "
        f"wait spins would hold the loopback's copies until the GPU deadline. Run the calls under "
        f"`with torch.cuda.stream(torch.cuda.Stream()):`, let the copy agent move the loopback's bytes "
        f"(UCCL_EP_LOOPBACK_COPY_AGENT=on), or leave UCCL_EP_DRAIN_AFTER_WAITS at auto or always "
        f"(docs/internode.md, \"Drains\")")


class Drains:
    """How the host waits for its stream and turns a failed wait into an InternodeError. A part of
    NativeInternodeBackend (backend.py), which composes these parts; the state they share is set up there (its __init__
    and the setup steps it calls)."""

    def _stream(self) -> int:
        return native.stream_handle(self.device)  # 0 for the CPU stand-in: synchronous, no stream

    def check_caller_stream(self, stream: int) -> None:
        """check_stream_without_drains for the caller's stream where the calls run on another (Buffer's comm stream):
        the caller's stream then waits on ours, and a pageable copy queued there behind our spinning wait stalls the
        loopback just the same (docs/internode.md, "Drains")."""
        if self._check_stream:
            check_stream_without_drains(self._drain_after_waits, self.transport.name, stream, self.rank,
                                        copy_agent=self._copy_agent is not None)

    def _refuse_a_stall_without_drains(self) -> None:
        """check_stream_without_drains at a call's entry; the stream is looked up only where it can matter."""
        if self._check_stream:
            self.check_caller_stream(self._stream())

    def _check(self, what: str = "") -> None:
        """Raise InternodeError if a kernel of this rank recorded an error or its proxy failed. The message names
        the rank, the phase and kernel, the counter (slot) with what it counts and who feeds it, the value expected
        and the value seen, what the host sees in the same counter, and the proxy's own error."""
        fields = self._cx.error_fields()
        perr = self._cx.proxy_error()
        if not fields["code"] and not perr:
            return
        parts = []
        if fields["code"] and fields["code"] != self._codes["aborted"]:
            msg = self._cx.error_message() + describe_gpu_error(fields, self.rank, self.G, self.N, self._codes,
                                                                 self.L)
            if fields["code"] == self._codes["wait_timeout"]:
                slot = int(fields["slot"])
                msg += f" [the host reads signal[{slot}] = {self._cx.signal_value(slot)}]"
            parts.append(msg)
        if perr:
            parts.append(f"rank {self.rank} proxy: {perr}")
        elif fields["code"] == self._codes["aborted"]:
            parts.append(f"rank {self.rank}: GPU waits were aborted by the host")
        try:
            parts.append(f"proxy totals {self._cx.proxy_totals()}")
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
        try:
            parts.append(describe_fifo_states(self._cx.fifo_states(), self.rank))
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
        parts.append(self._proxy_threads())
        self._cx.clear_error()
        self._chunk_ready = None  # a failed pack_and_push may have left counts behind: the next one starts afresh
        raise InternodeError("; ".join(parts) + (f" (during {what})" if what else "") + "\n" + timeout_hint())

    def _proxy_threads(self) -> str:
        """What each proxy thread holds (operations queued, writes in flight, signals held back for order), for
        error messages."""
        try:
            return "proxy threads:\n" + self._cx.proxy_counters().rstrip("\n")
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"proxy threads: not readable ({exc})"

    def _mark_drain(self) -> bool:
        """Record the drain mark now, for a ``_drain(marked=True)`` that waits only for what is queued so far
        (False on the CPU stand-in, where everything has run)."""
        self._join_gather()  # (a drain covers the side stream's copies too)
        if self.device.type != "cuda":
            return False
        self._cx.record_drain_mark(self._stream())
        return True

    def _drain(self, what: str, marked: bool = False) -> None:
        """Wait for this rank's stream with a deadline, never an unbounded synchronize. Every GPU wait has its own
        deadline (UCCL_EP_GPU_TIMEOUT_SECS); a proxy that fails meanwhile aborts the GPU waits at once, so the
        error surfaces in milliseconds instead of after the GPU deadline. ``marked``: only up to the mark
        _mark_drain recorded (what was queued after it may still run)."""
        if not marked:
            self._join_gather()  # (a drain covers the side stream's copies too)
        if self.device.type != "cuda":  # CPU stand-in: every call has completed when it returns
            self._check(what)
            return
        stream = self._stream()
        if not marked:
            self._cx.record_drain_mark(stream)
        began = time.monotonic_ns()
        t0 = time.monotonic()
        limit = 2 * self.gpu_timeout + self.cpu_timeout
        aborted = False
        spins = 0
        while not self._cx.drain_mark_reached():
            spins += 1
            if spins % 16 == 0:
                if not aborted and self._cx.proxy_error():
                    self._cx.abort_waits()
                    aborted = True
                waited = time.monotonic() - t0
                if waited > limit:
                    self._chunk_ready = None  # a pack_and_push that never ended may have left counts behind
                    raise InternodeError(
                        f"rank {self.rank}: the GPU stream did not drain within {limit:.0f} s after {what} "
                        f"(2 x UCCL_EP_GPU_TIMEOUT_SECS + UCCL_EP_CPU_TIMEOUT_SECS); GPU error word "
                        f"{self._cx.error_fields()}; proxy error {self._cx.proxy_error()!r}; "
                        f"{self._proxy_threads()}\n{timeout_hint()}")
                time.sleep(0 if waited < 2e-3 else 1e-4)
        # (CLOCK_MONOTONIC: the clock of the emulated wire's log and the benchmark's call windows)
        self.last_drain_ns = (began, time.monotonic_ns())
        if self._staging is not None:  # every upload queued before the mark has run (none is queued after one)
            self._staging.drained(stream)
        self._check(what)

    def _settle(self, what: str, drain: Optional[bool] = None) -> None:
        """After a network wait, and at the edges of a call: drain the stream where the policy says so (default:
        ``_drain_after_waits``, see _push_and_wait), else only read the error word."""
        if self._drain_after_waits if drain is None else drain:
            self._drain(what)
        else:
            self._check(what)

    def _proxy_view(self, grace: float = 0.2) -> str:
        """The proxy's error, given it ``grace`` seconds to appear: when gloo fails because a peer died, the loopback
        names the dead rank and its pid within a few milliseconds (liveness check every 5 ms)."""
        t0 = time.monotonic()
        perr = self._cx.proxy_error()
        while not perr and time.monotonic() - t0 < grace:
            time.sleep(0.005)
            perr = self._cx.proxy_error()
        return perr
