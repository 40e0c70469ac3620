"""Run a function on every rank of a fresh multi-process torch.distributed group (gloo on 127.0.0.1 by default).

    from tests.distributed import run_distributed
    results = run_distributed(check_something, 4, arg1, arg2, timeout=60)  # check_something(rank, world, arg1, arg2)

``fn`` must be a module-level (picklable) function. It runs in each child after ``init_process_group`` and its return
values (picklable) come back as a list indexed by rank. Any exception in a child, a child dying, or the deadline
passing raises in the caller with the failing rank's traceback; the other children are terminated, so a test never
hangs. Children are forked from a forkserver that has imported torch once, which keeps the start-up cheap.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        # Importing these once in the forkserver saves seconds per child (DTensor pulls in sympy on first use).
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch.testing"])
    return _CONTEXT


def _child(call: bytes, rank: int, world_size: int, port: int, backend: str, timeout: float,
           env: Dict[str, str], sys_path: List[str], results) -> None:
    try:
        import faulthandler

        faulthandler.enable(all_threads=True)  # a child that crashes in native code leaves its Python stack in the log
        _answer_state_requests(rank, results)
        sys.path[:] = sys_path
        os.environ.update(env)
        # Unpickled only now: importing fn's module may initialize CUDA (torch.cuda.device_count() at module level
        # does), and settings CUDA reads once at initialization (CUDA_MODULE_LOADING) must come from ``env``.
        fn, args = pickle.loads(call)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # CI machines have 2 cores shared by every rank
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            with _side_stream_if_asked(rank):
                value = fn(rank, world_size, *args)
        except BaseException:
            # Report (with the time) before tearing the group down: the teardown makes the peers fail as well.
            results.put((rank, False, traceback.format_exc(), time.time()))
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
        results.put((rank, True, value, time.time()))
    except BaseException:  # report everything, including assertion failures and KeyboardInterrupt
        results.put((rank, False, traceback.format_exc(), time.time()))


def _side_stream_if_asked(rank: int):
    """UCCL_EP_TEST_SIDE_STREAM=1: the rank's work runs on a non-blocking stream of torch's pool on GPU
    rank % device_count (the tests' placement), not on the legacy default stream; the suite's cases without drains
    need that over the loopback (docs/internode.md, "Drains")."""
    import contextlib

    if os.environ.get("UCCL_EP_TEST_SIDE_STREAM") != "1":
        return contextlib.nullcontext()
    import torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return torch.cuda.stream(torch.cuda.Stream(dev))


def _answer_state_requests(rank: int, results) -> None:
    """SIGUSR1 makes this rank report _live_state() to the parent. A thread of its own waits for the signal (blocked
    in every other thread, including those started later, which inherit the mask): the main thread may be stuck in a
    native call, e.g. a gloo collective waiting for the rank that failed, where a Python signal handler never runs."""
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    def serve() -> None:
        while True:
            signal.sigwait({signal.SIGUSR1})
            try:
                state = _live_state()
            except BaseException as exc:  # noqa: BLE001 - report whatever happened
                state = f"state not readable: {exc!r}"
            results.put((rank, "state", state, time.time()))

    threading.Thread(target=serve, name="state-requests", daemon=True).start()


def _live_state() -> str:
    """What this rank's communication objects say about themselves (the parent asks when another rank failed)."""
    diagnostics = sys.modules.get("uccl_ep_train.internode.diagnostics")
    return diagnostics.live_state() if diagnostics is not None else "no internode backend imported"


def _killed(procs) -> set:
    """Ranks whose process ended by a signal (multiprocessing reports -signum)."""
    return {r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0}


def _signal_name(signum: int) -> str:
    try:
        return f"{signum} ({signal.Signals(signum).name})"
    except ValueError:
        return str(signum)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    backend: str = "gloo", env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one process group; return the results by
    rank. Raises RuntimeError naming the first failing rank (with its traceback) or TimeoutError after ``timeout``
    seconds; every child is gone when this returns or raises."""
    import torch.distributed as dist

    ctx = _context()
    # The parent hosts the rendezvous store on a port the OS picks, so concurrent test runs never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    call = pickle.dumps((fn, args))
    procs = [ctx.Process(target=_child, args=(call, rank, world_size, store.port, backend, timeout,
                                              dict(env or {}), list(sys.path), results), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    values: Dict[int, Any] = {}
    failures: List[tuple] = []  # (time, rank, traceback)
    failure: Optional[str] = None
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value, when = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # let a traceback that is on its way arrive first
                    try:
                        rank, ok, value, when = results.get_nowait()
                    except queue.Empty:
                        failure = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} and no traceback"
                        break
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in values]
                    raise TimeoutError(f"run_distributed({getattr(fn, '__name__', fn)}): ranks {missing} did not "
                                       f"finish within {timeout:.0f} s")
                else:
                    continue
            if ok == "state":
                continue
            if ok:
                values[rank] = value
                continue
            # The first rank to fail makes its peers fail too (connection reset); collect those for a moment and
            # lead with the earliest, which is the cause. The ranks still running are asked for their own state
            # (SIGUSR1): the failing rank only sees its side, e.g. a counter that never reached its target, while the
            # rank that should have fed it knows whether it ever pushed or sent the command.
            failures.append((when, rank, value))
            states: List[tuple] = []
            asked = set()
            for r, p in enumerate(procs):
                if r != rank and r not in values and p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGUSR1)
                        asked.add(r)
                    except OSError:
                        pass
            # ... and every proxy thread of every rank prints its own state to stderr (UCCL_EP_PROXY_DUMP_FILE): it
            # needs neither the GIL nor CUDA, so it also answers from a rank whose Python is blocked.
            dump_file = (env or {}).get("UCCL_EP_PROXY_DUMP_FILE")
            if dump_file:
                with open(dump_file, "a"):
                    os.utime(dump_file)
            # until every rank is accounted for and every rank asked has answered (a peer's own failure often
            # arrives before its answer), or the grace period ends
            grace = time.monotonic() + 3.0
            while time.monotonic() < grace and (len(failures) + len(values) < world_size
                                                or asked - {r for r, _ in states} - _killed(procs)):
                try:
                    rank, ok, value, when = results.get(timeout=0.1)
                except queue.Empty:
                    continue
                if ok == "state":
                    states.append((rank, value))
                elif not ok:
                    failures.append((when, rank, value))
            failures.sort()
            name = getattr(fn, "__name__", fn)
            failure = "\n".join(f"rank {r} of {world_size} failed{' first' if i == 0 else ''} in {name}:\n{tb}"
                                 for i, (_, r, tb) in enumerate(failures))
            failure += "".join(f"\nstate of rank {r} when asked after the failure:\n{st}" for r, st in sorted(states))
            # A rank killed by a signal (a crash in native code, e.g. while answering the state request) leaves no
            # traceback: say so, or the crash would pass unnoticed behind the first failure.
            failure += "".join(f"\nrank {r} died of signal {_signal_name(-procs[r].exitcode)} after the failure"
                               for r in sorted(_killed(procs)))
    finally:
        for p in procs:
            if p.is_alive() and (failure is not None or len(values) < world_size):
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del store
    if failure is not None:
        raise RuntimeError(failure)
    return [values[r] for r in range(world_size)]
