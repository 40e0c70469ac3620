"""EventOverlap: DeepEP v1's handle on "communication finished" events, usable with or without CUDA.

On CUDA the wrapped object is a ``torch.cuda.Event`` recorded on the Buffer's communication stream; waiting makes the
caller's current stream wait for it (no host block). Without CUDA (gloo on CPU) every operation has already finished
when it returns, so the event is ``None`` and waiting is a no-op: code written for GPUs runs unchanged on CPU.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch


class EventOverlap:
    """A recorded event plus the tensors that must stay alive until it completes.

    Attributes:
        event: ``torch.cuda.Event`` or None (already complete: CPU, or a synchronous call).
        extra_tensors: tensors kept referenced until the event is waited on (``record_stream`` without breaking
            CUDA graph capture, as in DeepEP).
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_on_exit = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    @staticmethod
    def capture() -> "EventOverlap":
        """An event recorded now on the current CUDA stream, or a completed (no-op) event without CUDA."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            return EventOverlap(event)
        return EventOverlap(None)

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event (no-op when the event is None, i.e. already complete)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap; wait on it first")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True): ...`` drops the event after the wait at the end of the block."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        # Work inside the `with` block overlaps the communication; leaving it joins the two streams.
        self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False

    def __repr__(self) -> str:
        return f"EventOverlap(event={'pending CUDA event' if self.event is not None else 'complete'})"
