"""The loopback transport's copy agent: a process of its own that moves the bytes of a rank's loopback writes.

A NIC moves a write's bytes with its own DMA engine, whatever the host does meanwhile. The loopback emulates that
with CUDA copies, and made in the training process those copies take the CUDA driver's process-wide locks: a caller
that frees memory, loads a module or makes a pageable copy on the legacy default stream while our wait kernel spins
holds them, and the copy the wait needs never starts (docs/internode.md, "Drains" and "The copy agent"). Made by
this process instead, the copies take none of the caller's locks, and the proxy threads make no CUDA call after
setup, as over verbs. The protocol is csrc/transport/loopback_copy_agent.hpp; this module starts and stops the
process, and is its entry point (``python -m uccl_ep_train.loopback_copy_agent SEGMENT``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional, Sequence

from uccl_ep_train import native

#: How long the agent may take to start (import the native module, create its CUDA context, streams).
START_TIMEOUT_SECS = 120.0
#: How long it may take to finish its copies and exit once asked to.
CLOSE_TIMEOUT_SECS = 30.0


class CopyAgentError(RuntimeError):
    """The copy agent could not start, or failed."""


class CopyAgent:
    """One rank's copy agent: the shared segment (``name`` goes to the loopback endpoints: ``loopback_copy_agent``)
    and the process serving it, for ``lanes`` proxy threads of the rank whose device is ``device`` (-1: host memory
    only), its threads confined to ``cpus`` when given (the rank's share of UCCL_EP_PROXY_CPUS: cpu_placement.py).
    Raises CopyAgentError, with the agent's own message, when it does not come up."""

    def __init__(self, lanes: int, device: int, start_timeout_secs: float = START_TIMEOUT_SECS,
                 cpus: Sequence[int] = ()):
        self.segment = native.module().CopyAgentSegment.create(lanes, device)
        self.name: str = self.segment.name
        # (the child imports this package as we do: our sys.path, which a launcher may have extended, goes with it)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        pin = ["--cpus", ",".join(str(int(c)) for c in cpus)] if cpus else []
        self._process: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-m", "uccl_ep_train.loopback_copy_agent", self.name, *pin], stdin=subprocess.DEVNULL,
            env=env)
        try:
            self._wait_ready(start_timeout_secs)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else -1

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = self.segment.state
            if state == "ready":
                return
            if state == "failed":
                raise CopyAgentError(f"the loopback copy agent (pid {self.pid}) could not start: "
                                     f"{self.segment.agent_message}")
            code = self._process.poll()
            if code is not None:
                raise CopyAgentError(f"the loopback copy agent (pid {self.pid}) exited with {code} before it was "
                                     f"ready (its error is on stderr); set UCCL_EP_LOOPBACK_COPY_AGENT=off to copy in "
                                     f"the training process instead")
            if time.monotonic() > deadline:
                raise CopyAgentError(f"the loopback copy agent (pid {self.pid}) was not ready within {timeout:.0f} s "
                                     f"(state {state!r})")
            time.sleep(0.005)

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def close(self, timeout_secs: float = CLOSE_TIMEOUT_SECS) -> None:
        """Ask the agent to finish its copies and exit; killed if it does not within the timeout. Call after the
        endpoints that use it are gone (they wait for their copies). Idempotent."""
        proc, self._process = self._process, None
        if proc is None:
            return
        self.segment.request_close()
        try:
            proc.wait(timeout=timeout_secs)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __del__(self) -> None:  # (a process that forgot close: the agent also exits once its client is gone)
        try:
            self.close(timeout_secs=1.0)
        except Exception:
            pass


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--cpus"):
        print("usage: python -m uccl_ep_train.loopback_copy_agent SEGMENT [--cpus 0,1,...]", file=sys.stderr)
        return 2
    if len(args) == 3:  # before the native module starts its lane threads, which inherit it
        try:
            os.sched_setaffinity(0, [int(c) for c in args[2].split(",")])
        except (OSError, ValueError) as exc:  # best effort, as the proxy threads' pinning: it still copies
            print(f"uccl-ep copy agent: not pinned to CPUs {args[2]} ({exc}); running unpinned", file=sys.stderr)
    return int(native.module().run_copy_agent(args[0]))


if __name__ == "__main__":
    sys.exit(main())
