"""`uccl-ep-train bench internode --emulate-nodes N`: hierarchical dispatch/combine through the CPU proxies (one host's
GPUs playing N nodes over the loopback transport) beside NCCL all_to_all_single, in one process group.

Launch: `torchrun --nproc-per-node G*N -m uccl_ep_train bench internode --emulate-nodes N`. Run it twice to compare
the NIC capped (UCCL_EP_LOOPBACK_BW_GBPS=50, one 400 Gb/s NIC per GPU) and uncapped.

Reported per rank (max over ranks of the time, bytes of rank 0): wall time per call (the staged path synchronises the
host, so events would hide nothing), logical bytes (DeepEP's way), physical bytes over the emulated network and over
NVLink, their bandwidths, proxy commands, and proxy CPU use (process CPU seconds per wall second over the timed loop,
which includes the Python driver: an upper bound). Also: the network hop alone (CUDA events from the push kernel to
the end of the last signal wait, median), the raw bandwidth of the same bytes copied straight into the peer GPU by
the copy engines (the uncapped ceiling; with UCCL_EP_LOOPBACK_BW_GBPS the cap is the ceiling), each figure's ratio
to its ceiling, and rank 0's host wall time per step of a call (where the staged path spends it).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Optional, Tuple


def add_parser(sub) -> None:
    _add_arguments(sub.add_parser("internode", help="internode (emulated nodes) dispatch/combine vs NCCL all_to_all"))


def namespace(**given) -> argparse.Namespace:
    """This bench's arguments: its defaults, with ``given`` (argument names as attributes) in their place; for
    `bench dispatch --emulate-nodes N`, which runs this bench at its own shape."""
    p = argparse.ArgumentParser(add_help=False)
    _add_arguments(p)
    args = p.parse_args([])
    unknown = sorted(set(given) - set(vars(args)))
    if unknown:
        raise ValueError(f"bench internode has no argument(s) {unknown}")
    for k, v in given.items():
        setattr(args, k, v)
    return args


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate-nodes", type=int, default=2, help="nodes the local GPUs play (must divide the world)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", action="store_true", help="dispatch FP8 payload + scales")
    p.add_argument("--expert-major", action="store_true",
                   help="receive grouped by local expert, as Megatron's dispatcher does (UCCL_EP_EXPERT_MAJOR)")
    p.add_argument("--sync-free", action="store_true",
                   help="uncached dispatches with num_worst_tokens (every token of every rank; expert-major: x min("
                        "top-k, local experts)): with UCCL_EP_DRAIN_AFTER_WAITS=never they return before the count "
                        "read (docs/internode.md, \"Sync-free dispatch\")")
    p.add_argument("--sync-free-rows", type=int, default=0, metavar="N",
                   help="with --sync-free: rows each rank receives (its num_worst_tokens), as UCCL_EP_NUM_WORST_TOKENS "
                        "or a capacity factor sets them in training; 0: the worst case above. Every row past the "
                        "received ones is zeroed each call, so the worst case costs expert-major receives ~470 MB "
                        "of stores per call at the default shape on 2 x 1. Fewer rows than a rank receives is an "
                        "error, raised by the next call")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rdma-bytes", type=int, default=2 << 30)
    p.add_argument("--nvl-bytes", type=int, default=2 << 30)
    p.add_argument("--layers", type=int, default=4,
                   help="MoE layers of the training steps timed in turn (training_step_* in the JSON): each layer's "
                        "handle is fresh, so every call pays what its first use of a handle costs")
    p.add_argument("--compute-us", type=float, default=500.0,
                   help="GPU work queued before every call of the training steps timed on the GPU (beside_compute_* "
                        "in the JSON), standing in for the attention and experts between the calls: the host "
                        "launches each call while it runs, as in training; 0 skips that loop")
    p.add_argument("--gc", choices=("auto", "manual"), default="auto",
                   help="Python's garbage collector during the run: auto, its default threshold collections (each "
                        "pause lands in whatever host step allocated last); manual, as Megatron's --manual-gc: the "
                        "objects made at setup frozen and threshold collections off until the run ends. Either way "
                        "the JSON reports the collections and their pauses (gc)")
    p.add_argument("--json", type=str, default="")
    p.add_argument("--profile", metavar="PATH", default="",
                   help="after timing, profile 5 forward pairs (dispatch, combine), 5 cached dispatches and 5 combines "
                        "on every rank and "
                        "write rank 0's tables to PATH: torch.profiler by self CPU and self CUDA time, then cProfile "
                        "by own time and, for this package's functions, by cumulative time (where the host steps go)")
    p.add_argument("--timeline", type=int, default=0, metavar="ROUNDS",
                   help="after timing, stamp every pack-and-push launch on the GPU over ROUNDS back-to-back forward "
                        "pairs, then ROUNDS backward pairs, and report per rank and kind of call the median us from "
                        "the launch's start to: every count row in, the first chunk written, the first and last "
                        "command pushed (docs/internode.md, 'Kernel timeline'); with a capped loopback also ROUNDS "
                        "of each pair timed call by call against the emulated wire's busy runs: per kind of call the "
                        "median us before its first byte, busy, idle and after its last byte (docs/internode.md, "
                        "'Wire timeline'); 0: off")
    p.add_argument("--share-gpu", action="store_true",
                   help="let several ranks share a GPU (e.g. 2 emulated nodes on a 1-GPU machine) to look at the host "
                        "side with --profile: time-sliced GPU timings mean nothing, and there are no baselines "
                        "(NCCL refuses two ranks on one GPU), so only rank 0's raw times and host steps are printed")
    p.set_defaults(func=run)


def check_sync_free_rows(args) -> None:
    """Stop the bench, before any process group, where --sync-free-rows cannot apply."""
    if args.sync_free_rows < 0:
        raise SystemExit(f"--sync-free-rows must be >= 0 (0: the worst case), got {args.sync_free_rows}")
    if args.sync_free_rows and not args.sync_free:
        raise SystemExit("--sync-free-rows needs --sync-free (it sets the sync-free dispatches' num_worst_tokens)")


def num_worst_tokens(args, world: int) -> int:
    """The num_worst_tokens of the bench's uncached dispatches: 0 without --sync-free; else --sync-free-rows, or
    where that is 0 the worst case, every token of every rank (expert-major: one row per (token, local expert), at
    most min(top-k, local experts) per token)."""
    from uccl_ep_train.reference import worst_case_rows

    check_sync_free_rows(args)
    if not args.sync_free:
        return 0
    return args.sync_free_rows or worst_case_rows(args.tokens, world, args.topk, args.experts // world,
                                                  args.expert_major)


# What the timings of ranks sharing a GPU mean, by whether the GPU is shared through MPS (None: unknown).
SHARED_GPU_NOTES = {
    False: "ranks share a GPU: time-sliced, not comparable with one GPU per rank",
    None: "ranks share a GPU (MPS unknown): not comparable with one GPU per rank",
    True: "ranks share a GPU through MPS: their kernels run at the same time, but the host steps are slower and the "
          "beside-compute timing does not hold; not comparable with one GPU per rank (docs/internode.md, "
          "\"Hardware work queues\")",
}


def _profile(path: str, forward, cached, combine) -> None:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    def calls():
        for fn in (forward, cached, combine):
            for _ in range(5):
                fn()
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        calls()
    dist.barrier()
    # ... and each kind of call in a profile of its own, so a kernel's time can be told apart by call: the forward
    # dispatch's pack-and-push is the forward pairs' minus the combines' (docs/internode.md: whether it waits for
    # the count rows longer than the cached dispatch's does)
    by_kind = {}
    for kind, fn in (("forward pairs", forward), ("cached dispatches", cached), ("combines", combine)):
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        by_kind[kind] = one.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                                 max_name_column_width=60)
    dist.barrier()
    py = cProfile.Profile()
    py.enable()
    calls()
    py.disable()
    if dist.get_rank() == 0:
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(40)
        # ... and by cumulative time, this package's functions only: which step of a call holds the host (session
        # 12 found torch.cuda.current_stream() and small uploads this way, ~10-18 us per call of each)
        text.write("\n== cProfile by cumulative time, uccl_ep_train only (us; pstats prints whole ms)\n")
        stats = pstats.Stats(py).stats  # {(file, line, function): (primitive calls, calls, own s, cumulative s, ..)}
        ours = sorted(((ct, nc, f"{os.path.basename(f)}:{line}({fn})") for (f, line, fn), (_, nc, _, ct, _)
                       in stats.items() if "uccl_ep_train" in f), reverse=True)[:40]
        text.write(f"{'calls':>6} {'cumulative us':>14} {'us per call':>12}  function\n")
        for ct, nc, name in ours:
            text.write(f"{nc:6d} {ct * 1e6:14.1f} {ct * 1e6 / max(nc, 1):12.1f}  {name}\n")
        with open(path, "w") as f:
            f.write("5 forward pairs (a dispatch, then a combine of its handle: the dispatches after the first pack "
                    "and push during notify), 5 cached dispatches, 5 combines (rank 0)\n\n"
                    "== torch.profiler by self CPU\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            f.write("\n== torch.profiler by self CUDA\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
            for kind, table in by_kind.items():
                f.write(f"\n== torch.profiler by self CUDA, 5 {kind} alone\n{table}")
            f.write("\n== cProfile by own time\n" + text.getvalue())


def _wall(fn, iters: int, warmup: int) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _warm(fns, warmup: int) -> None:
    """``warmup`` rounds of the functions in turn, then every rank synchronized and lined up."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    dist.barrier()


def _per_call(fns, iters: int, warmup: int):
    """Wall time (seconds) of each call of each function, the functions called in turn (as a training step calls
    them: dispatch, then combine), each call timed to the end of its GPU work (a synchronize after each, so none
    absorbs another's tail). One list per function. For means and for medians, which one slow call (a host hiccup:
    the lent machines showed calls twice as slow as their neighbours) moves less."""
    import torch

    _warm(fns, warmup)
    out = [[] for _ in fns]
    for _ in range(iters):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return out


def _in_turn(fns, iters: int, warmup: int):
    """Wall time (seconds) of each call, the functions called back to back in turn with nothing between them -- no
    synchronize, as a training step calls them -- each call's time running from the previous call's return to its
    own. A call returns once its network hop and the kernel reading the arrivals are done (it drains after them:
    docs/internode.md, "Drains"), so the work it leaves on the stream is its short tail, which the next call's launches
    overlap as they would in training; the last call's tail is added to it. One list per function."""
    import torch

    _warm(fns, warmup)
    out = [[] for _ in fns]
    t = time.perf_counter()
    for _ in range(iters):
        for fn, times in zip(fns, out):
            fn()
            now = time.perf_counter()
            times.append(now - t)
            t = now
    torch.cuda.synchronize()
    out[-1][-1] += time.perf_counter() - t
    return out


def _training_order(dispatch, combine, cached, layers: int):
    """The calls of one training step of ``layers`` MoE layers, in order, and each one's kind: the forward pass makes
    each layer's dispatch (a fresh handle: every layer routes on its own) then its combine; the backward pass takes
    the layers in reverse, each a cached dispatch with the layer's handle (the combine's backward) then a combine with
    the top-k weights (the dispatch's backward). ``dispatch()`` returns a DispatchResult; ``combine(result,
    weighted)``; ``cached(result)``. Returns (functions, kinds)."""
    results = [None] * layers
    fns, kinds = [], []

    def keep(i):
        results[i] = dispatch()

    for i in range(layers):
        fns += [lambda i=i: keep(i), lambda i=i: combine(results[i], False)]
        kinds += ["forward_dispatch", "forward_combine"]
    for i in reversed(range(layers)):
        fns += [lambda i=i: cached(results[i]), lambda i=i: combine(results[i], True)]
        kinds += ["backward_cached_dispatch", "backward_combine"]
    return fns, kinds


def _by_kind(kinds, times) -> dict:
    out = {k: [] for k in kinds}
    for kind, t in zip(kinds, times):
        out[kind] += t
    return out


def _training_steps(dispatch, combine, cached, layers: int, iters: int, warmup: int) -> dict:
    """Seconds per call of ``iters`` training steps (_training_order), timed as _in_turn times its calls (back to
    back, no synchronize). Unlike the in-turn loops, which reuse one handle, every call here is the first of its kind
    on its handle, as in training. One list per kind."""
    fns, kinds = _training_order(dispatch, combine, cached, layers)
    return _by_kind(kinds, _in_turn(fns, iters, warmup))


def _gpu_spans(fns, iters: int, warmup: int, compute):
    """Seconds each call occupies the GPU's stream when ``compute()`` (GPU work, as the attention or the experts of a
    training step) runs before it: an event recorded before the call and one after it, so a call's span starts when
    the compute before it ends and stops when its last kernel does. The host launches the call while the compute
    runs, as it does in training; a call whose host steps outlast the compute leaves the GPU idle, and that idle time
    is in its span. One list per function."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        for fn in fns:
            compute()
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    marks = []
    for _ in range(iters):
        for fn in fns:
            compute()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
    torch.cuda.synchronize()
    out = [[] for _ in fns]
    for i, (start, end) in enumerate(marks):
        out[i % len(fns)].append(start.elapsed_time(end) / 1e3)
    return out


def _training_steps_beside_compute(dispatch, combine, cached, layers: int, iters: int, warmup: int,
                                   compute) -> dict:
    """_training_steps with ``compute()`` before every call, each call timed by _gpu_spans. One list per kind."""
    fns, kinds = _training_order(dispatch, combine, cached, layers)
    return _by_kind(kinds, _gpu_spans(fns, iters, warmup, compute))


def _compute_spacer(us: float):
    """(a function that queues ``us`` microseconds of GPU work on the current stream, the microseconds it takes): a
    spinning kernel (torch.cuda._sleep) of a cycle count calibrated here, standing in for the compute between two
    calls of a training step. One block: it leaves the GPU's other SMs and its memory to the previous call's tail."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # the kernel's first launch loads it
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = max(1, int(us * 1_000_000 / (start.elapsed_time(end) * 1e3)))
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return (lambda: torch.cuda._sleep(cycles)), start.elapsed_time(end) * 1e3


def _host_held_by_dispatch(dispatch, combine, iters: int, warmup: int, compute=None, backend=None) -> dict:
    """How long an uncached dispatch holds the host, from its call to its return (median, us, this rank), each
    right after the combine of the one before (as in a forward pass) and the GPU idle before it ("alone"), and
    queued behind ``compute`` (the bench's spacer, _compute_spacer), as in training ("behind_compute"). A dispatch
    that waits for its count read holds the host until the GPU has run that work and the count exchange; one that
    returns before it (sync-free, no drains) only for its launches. What the host can queue behind it (the experts)
    waits as long. With ``backend``, also its host laps over the measured calls (``<name>_steps``, us per call:
    where the hold goes, dispatch and combine steps both)."""
    import torch
    import torch.distributed as dist

    spacers = {"alone": None}
    if compute is not None:
        spacers["behind_compute"] = compute
    out = {}
    for name, spacer in spacers.items():
        r = dispatch()
        held = []
        for i in range(warmup + iters):
            if i == warmup and backend is not None:
                backend.host_timing = {}
            combine(r)
            torch.cuda.synchronize()
            dist.barrier()
            if spacer is not None:
                spacer()
            t0 = time.perf_counter()
            r = dispatch()
            if i >= warmup:
                held.append(time.perf_counter() - t0)
        combine(r)
        torch.cuda.synchronize()
        out[name] = statistics.median(held) * 1e6
        if backend is not None:
            out[f"{name}_steps"] = _host_steps(backend)
            backend.host_timing = None
    return out


def _pair_figures(times: dict, pair_bytes: int, reduce=lambda v: v) -> dict:
    """Network GB/s of the training-order pairs from seconds per call by kind (forward_dispatch, forward_combine,
    backward_cached_dispatch, backward_combine): each pair's bytes (``pair_bytes``: a dispatch's and a combine's) over
    its mean time, and a layer's -- both pairs, all four calls. Where calls return before their GPU work ends (no
    drains, sync-free), a later call's time holds an earlier one's work: the pairs then read high or low, and only
    the layer still means what it says. ``reduce``: applied to each mean time (the bench: the max over ranks)."""
    pairs = {}
    for name in ("forward", "backward"):
        pairs[name] = [a + b for a, b in zip(*(v for k, v in times.items() if k.startswith(name)))]
    out = {f"{name}_pair": pair_bytes / (reduce(statistics.mean(p)) * 1e9) for name, p in pairs.items()}
    layer = [f + b for f, b in zip(pairs["forward"], pairs["backward"])]
    out["layer"] = 2 * pair_bytes / (reduce(statistics.mean(layer)) * 1e9)
    return out


def _pairs_vs(row: dict, rate: float, name: str) -> dict:
    """The training-order pairs' network GB/s (the figures to quote) over ``rate`` (GB/s):
    {"in_turn_pairs_vs_<name>": {"forward_pair": ..., "backward_pair": ..., "layer": ...}, "training_step_...": ...}
    (layer: both pairs together, loop_figures)."""
    return {f"{loop}_pairs_vs_{name}": {p: row[f"{loop}_network_GBps"][p] / rate
                                        for p in ("forward_pair", "backward_pair", "layer")}
            for loop in ("in_turn", "training_step", "beside_compute") if f"{loop}_network_GBps" in row}


def _kernel_timeline(nat, loops, rounds: int) -> list:
    """--timeline: the pack-and-push launches' GPU stamps over ``rounds`` back-to-back rounds of each loop (name,
    calls), every rank's medians by kind of call (kernel_timeline.summarize), in rank order, each kind with
    median_start_lag_us: how long after the earliest rank's start of the same launch this rank's began
    (kernel_timeline.start_lags; one clock only where the ranks share a GPU or their timers agree)."""
    import torch
    import torch.distributed as dist

    from uccl_ep_train.kernel_timeline import start_lags, summarize

    torch.cuda.synchronize()
    dist.barrier()
    nat.start_kernel_timeline(rounds * sum(len(fns) for _, fns in loops))  # one launch per call at most
    for _, fns in loops:
        for _ in range(rounds):
            for fn in fns:
                fn()
    launches_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(launches_by_rank, nat.stop_kernel_timeline())
    out = []
    for launches, lags in zip(launches_by_rank, start_lags(launches_by_rank)):
        by_kind = summarize(launches)
        for kind, row in by_kind.items():
            row["median_start_lag_us"] = lags.get(kind)
        out.append(by_kind)
    return out


def _clock_offset(nat) -> Optional[Tuple[int, int]]:
    """(GPU timer - steady clock, error) in ns for this rank's GPU, or None where the native module lacks the probe
    (an older tree in an A/B run)."""
    probe = getattr(nat._k, "gpu_timer_minus_steady_ns", None)
    return tuple(probe(nat.device.index)) if probe is not None else None


def _wire_timeline(nat, loops, rounds: int) -> Optional[list]:
    """--timeline with a capped loopback: ``rounds`` of each loop (name, (first, second)), every call timed to the end
    of its GPU work on the wire's clock, against this rank's wire runs, and its hop's gated reader (kernel timeline)
    put on the same clock by the GPU timer's offset, probed before and after the calls; every rank's
    wire_timeline.summarize, in rank order, the kinds named "<loop> <call>", with "clock" (the offsets and their
    error, ns). None where the transport has no emulated wire (verbs)."""
    import torch
    import torch.distributed as dist

    from uccl_ep_train import native
    from uccl_ep_train.wire_timeline import CallWindow, readers_in_calls, runs_from_log, summarize

    clock = native.module().steady_clock_ns
    names = {"forward": ("dispatch", "combine"), "backward": ("cached dispatch", "combine")}
    torch.cuda.synchronize()
    dist.barrier()
    # a call's writes run back to back unless the senders starve the wire: a few runs per call, room for many more
    try:
        nat.start_wire_log(rounds * 64 * sum(len(fns) for _, fns in loops) + 1024)
    except ValueError:  # the same answer on every rank: one transport for all
        return None
    before = _clock_offset(nat)
    n_calls = rounds * sum(len(fns) for _, fns in loops)
    if before is not None:
        nat.start_kernel_timeline(n_calls)  # one pack-and-push launch per call at most
    calls = []
    for loop, fns in loops:
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                t0 = clock()
                fn()
                returned = clock()
                torch.cuda.synchronize()
                calls.append(CallWindow(f"{loop} {names.get(loop, ('first', 'second'))[i]}", t0, clock(),
                                        returned, getattr(nat, "last_drain_ns", None)))
    runs = runs_from_log(nat.stop_wire_log())
    readers = None
    clock_info = None
    if before is not None:
        launches = nat.stop_kernel_timeline()
        after = _clock_offset(nat)
        offset = (before[0] + after[0]) // 2
        readers = readers_in_calls(calls, launches, offset)
        clock_info = {"gpu_minus_host_ns_before": before[0], "gpu_minus_host_ns_after": after[0],
                      "error_ns": max(before[1], after[1])}
    summary = summarize(calls, runs, readers)
    if clock_info is not None:
        summary["clock"] = clock_info
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, summary)
    return by_rank


def _host_steps(nat) -> dict:
    """The backend's host wall time per call and step so far (us), from its host_timing laps."""
    return {k: round(v[0] / max(v[1], 1) * 1e6, 1) for k, v in nat.host_timing.items()}


def _host_op_us(dev, reps: int = 400) -> dict:
    """Host microseconds (median) of the kinds of call a host step is made of, on an idle GPU: a torch op on a small
    device tensor (one kernel launch through the dispatcher), a small pinned host-to-device copy, and a stream handle
    read. Taken before the backend exists and again with its proxy threads and copy agent running idle: if the second
    is much higher, what runs beside the main thread (not the steps' own work) makes the host steps slow."""
    import torch

    from uccl_ep_train.native import stream_handle

    t = torch.zeros(1024, device=dev)
    src = torch.ones(256, dtype=torch.int32).pin_memory()
    dst = torch.empty(256, dtype=torch.int32, device=dev)
    probes = {"torch_op": lambda: t.add_(1), "pinned_upload_1KiB": lambda: dst.copy_(src, non_blocking=True),
              "stream_handle": lambda: stream_handle(dev)}
    out = {}
    for name, fn in probes.items():
        fn()
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize(dev)
        out[name] = round(statistics.median(times) * 1e6, 2)
    return out


class GcPauses:
    """Python's garbage collections from start() on, by generation, and the wall time they paused the thread for (a
    collection of the oldest generation walks every tracked object of the process: torch, and Megatron's in training).
    Installed as a gc callback, so it sees every collection, threshold or explicit."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = 0.0
        self._t0 = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt, g = time.perf_counter() - self._t0, info["generation"]
            self.collections[g] += 1
            self.pause_s[g] += dt
            self.max_pause_s = max(self.max_pause_s, dt)
            self._t0 = None

    def start(self) -> "GcPauses":
        import gc

        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> dict:
        import gc

        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return {"collections": list(self.collections), "pause_ms": [round(t * 1e3, 3) for t in self.pause_s],
                "max_pause_ms": round(self.max_pause_s * 1e3, 3)}


def _thread_usage() -> dict:
    """The calling thread's resource usage so far (Linux RUSAGE_THREAD; the process's elsewhere): CPU seconds, context
    switches it made itself (a wait that slept) and ones forced on it (preempted by another runnable thread), and
    page faults (minor: mapped without I/O)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    return {"cpu_s": r.ru_utime + r.ru_stime, "voluntary_switches": r.ru_nvcsw, "involuntary_switches": r.ru_nivcsw,
            "minor_faults": r.ru_minflt, "major_faults": r.ru_majflt}


def _per_pair(after: dict, before: dict, pairs: int) -> dict:
    """(after - before) / pairs per field of _thread_usage, CPU seconds as microseconds."""
    out = {k: (after[k] - before[k]) / max(pairs, 1) for k in after}
    out["cpu_us"] = round(out.pop("cpu_s") * 1e6, 1)
    return {k: round(v, 2) for k, v in out.items()}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(args) -> int:
    import torch
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext, DispatchArgs
    from uccl_ep_train.internode import NativeInternodeBackend
    from uccl_ep_train.internode.transport import use_copy_agent
    from uccl_ep_train.settings import load_settings

    check_sync_free_rows(args)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.share_gpu:
        local %= torch.cuda.device_count()
    elif local >= torch.cuda.device_count():
        raise SystemExit(f"bench internode: LOCAL_RANK {local} but {torch.cuda.device_count()} GPUs: run one process "
                         "per GPU (the NCCL baseline needs it, and two processes per GPU are time-sliced, so their "
                         "timings mean nothing; docs/internode.md, 'Two processes per GPU')")
    torch.cuda.set_device(local)
    if args.share_gpu:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.emulate_nodes:
        raise SystemExit(f"--emulate-nodes {args.emulate_nodes} must divide the world size {world}")
    G = world // args.emulate_nodes
    dev = torch.device("cuda", local)
    settings = load_settings()
    if settings.kernel.drain_after_waits == "never" and \
            not use_copy_agent(settings.emulation.loopback_copy_agent, shares_gpu=args.share_gpu):
        # without drains, over a loopback whose proxy threads copy, the calls must come from a non-default stream
        # (docs/internode.md, "Drains"): every launch, copy and timing of this run goes to one side stream
        torch.cuda.set_stream(torch.cuda.Stream(dev))
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=G, device=dev,
                         num_nvl_bytes=args.nvl_bytes, num_rdma_bytes=args.rdma_bytes, settings=settings)
    host_ops_before = _host_op_us(dev)
    nat = NativeInternodeBackend(ctx)
    host_ops_with_proxies = _host_op_us(dev)
    if args.gc == "manual":  # (Megatron's --manual-gc: what setup made is frozen, no threshold collection)
        import gc
        gc.collect()
        gc.freeze()
        gc.disable()
    gc_pauses = GcPauses().start()
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    g = torch.Generator(device=dev).manual_seed(rank)
    idx = torch.rand((T, E), device=dev, generator=g).topk(K, dim=1).indices
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    scales = None
    if args.fp8:
        x = x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
        scales = torch.rand((T, H // 128), device=dev, generator=g) + 0.5
    w = torch.rand((T, K), device=dev, generator=g)
    tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, E)
    worst = num_worst_tokens(args, world)

    def fresh():  # the arguments of an uncached dispatch
        return DispatchArgs(x, scales, None, tpr, tpn, itr, tpe, idx, w, expert_major=args.expert_major,
                            num_worst_tokens=worst)

    res = nat.dispatch(fresh())
    handle, disp_traffic = res.handle, nat.last_traffic
    y = res.recv_x.to(torch.bfloat16) if not args.fp8 else torch.randn_like(res.recv_x, dtype=torch.bfloat16)
    nat.combine(y, handle, None, None)
    comb_traffic = nat.last_traffic

    def dispatch():
        return nat.dispatch(fresh())

    def cached():
        return nat.dispatch(DispatchArgs(x, scales, handle, None, None, None, None, None, None))

    def combine():
        return nat.combine(y, handle, None, None)

    nat.host_timing = {}  # the host's wall time per step (where the staged path spends a call): perf_counter only
    cpu0, wall0 = _cpu(), time.perf_counter()
    t_disp = _wall(dispatch, args.iters, args.warmup)
    t_cached = _wall(cached, args.iters, args.warmup)
    t_comb = _wall(combine, args.iters, args.warmup)
    cpu_frac = (_cpu() - cpu0) / (time.perf_counter() - wall0)
    host_steps = _host_steps(nat)
    nat.host_timing = None
    # The network hop alone (push -> last signal), CUDA events, in calls of their own: the two timing events per hop
    # cost host time (~25 us per hop beside busy proxy threads), which the wall times above do not carry.
    nat.network_timing = {}
    for fn in (dispatch, cached, combine):
        _wall(fn, args.iters, 0)
    torch.cuda.synchronize()
    hop_ms = {ph: [a.elapsed_time(b) for a, b in ev] for ph, ev in nat.network_timing.items()}
    # The transport alone on a cached dispatch's bytes (raw_dispatch_hop: its hop pushed as it is, with no packing,
    # reading or host planning), timed as the hops above: the "loopback transport's raw bandwidth", at the
    # same write size and lanes as the calls (the raw copy below is one copy of all the bytes, the hardware's).
    raw_transport_us = float("nan")  # (an older backend in an A/B run lacks the raw hop)
    if hasattr(nat, "raw_dispatch_hop"):
        nat.network_timing = {}
        for _ in range(args.warmup + args.iters):
            nat.raw_dispatch_hop(handle, [x] + ([scales] if scales is not None else []))
        torch.cuda.synchronize()
        raw_hop_ms = [a.elapsed_time(b) for a, b in nat.network_timing.get("dispatch_network", [])][args.warmup:]
        nat.network_timing = None
        raw_transport_us = statistics.median(raw_hop_ms) * 1e3
    steps_by_rank = [None] * world  # a step one rank spends waiting for the others shows as skew between ranks
    dist.all_gather_object(steps_by_rank, host_steps)

    # As a training step calls them: each combine right after its own dispatch, where it may skip its entry barrier
    # (docs/internode.md, "Areas and entry barriers"); the loops above repeat one kind of call, so their combines
    # follow combines and keep it.
    def step():
        r = nat.dispatch(fresh())
        nat.combine(y, r.handle, None, None)

    skipped0 = nat.combine_barriers_skipped
    t_step = _wall(step, args.iters, args.warmup)
    step_skips = nat.combine_barriers_skipped - skipped0
    # the same pairs timed call by call; then a backward pass's pairs: the cached dispatch (combine's backward) right
    # after a combine, where it may skip its entry barrier, then the combine (dispatch's backward)
    fwd = {}

    def fwd_dispatch():
        fwd["h"] = nat.dispatch(fresh()).handle

    calls = {}  # seconds per call, by what was timed
    calls["step_dispatch"], calls["step_combine"] = _per_call(
        (fwd_dispatch, lambda: nat.combine(y, fwd["h"], None, None)), args.iters, args.warmup)
    skipped0, dskipped0 = nat.combine_barriers_skipped, nat.dispatch_barriers_skipped
    calls["backward_cached_dispatch"], calls["backward_combine"] = _per_call((cached, combine), args.iters,
                                                                              args.warmup)
    back_skips = (nat.dispatch_barriers_skipped - dskipped0, nat.combine_barriers_skipped - skipped0)
    for name, fn in (("dispatch", dispatch), ("cached_dispatch", cached), ("combine", combine)):
        calls[name], = _per_call((fn,), args.iters, args.warmup)
    # ... and back to back in training order, no synchronize between the calls: a forward pass's pairs (dispatch,
    # combine) and a backward pass's (cached dispatch, combine), with the host steps of each loop
    in_turn, in_turn_steps, in_turn_thread = {}, {}, {}
    for name, fns in (("forward", (fwd_dispatch, lambda: nat.combine(y, fwd["h"], None, None))),
                      ("backward", (cached, combine))):
        nat.host_timing = {}
        before = _thread_usage()
        first, second = _in_turn(fns, args.iters, args.warmup)
        in_turn_thread[name] = _per_pair(_thread_usage(), before, args.iters + args.warmup)
        in_turn[f"{name}_{'dispatch' if name == 'forward' else 'cached_dispatch'}"] = first
        in_turn[f"{name}_combine"] = second
        in_turn_steps[name] = _host_steps(nat)
        nat.host_timing = None
    in_turn_steps_by_rank = [None] * world
    dist.all_gather_object(in_turn_steps_by_rank, in_turn_steps)
    in_turn_thread_by_rank = [None] * world
    dist.all_gather_object(in_turn_thread_by_rank, in_turn_thread)
    # training steps over several layers: a fresh handle per layer, a backward of bf16 gradients
    grad = x if x.dtype == torch.bfloat16 else torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    nat.host_timing = {}
    ahead0 = getattr(nat, "plans_made_ahead", 0)  # (older revisions in A/B runs lack it)
    training = _training_steps(
        lambda: nat.dispatch(fresh()),
        lambda r, weighted: nat.combine(y, r.handle, r.recv_topk_weights if weighted else None, None),
        lambda r: nat.dispatch(DispatchArgs(grad, None, r.handle, None, None, None, None, None, None)),
        args.layers, args.iters, args.warmup)
    training_steps = _host_steps(nat)
    nat.host_timing = None
    beside = compute = None
    if args.compute_us > 0:
        compute, compute_us = _compute_spacer(args.compute_us)
        beside = _training_steps_beside_compute(
            lambda: nat.dispatch(fresh()),
            lambda r, weighted: nat.combine(y, r.handle, r.recv_topk_weights if weighted else None, None),
            lambda r: nat.dispatch(DispatchArgs(grad, None, r.handle, None, None, None, None, None, None)),
            args.layers, args.iters, args.warmup, compute)
    plans_ahead = getattr(nat, "plans_made_ahead", 0) - ahead0
    held = _host_held_by_dispatch(lambda: nat.dispatch(fresh()), lambda r: nat.combine(y, r.handle, None, None),
                                  args.iters, args.warmup, compute, backend=nat)
    training_steps_by_rank = [None] * world
    dist.all_gather_object(training_steps_by_rank, training_steps)
    t_fd, t_fc, t_bd, t_bc = (statistics.mean(calls[k]) for k in
                              ("step_dispatch", "step_combine", "backward_cached_dispatch", "backward_combine"))

    if args.profile:
        _profile(args.profile, step, cached, combine)
    timeline = wire = None
    if args.timeline > 0:
        loops = (("forward", (fwd_dispatch, lambda: nat.combine(y, fwd["h"], None, None))),
                 ("backward", (cached, combine)))
        timeline = _kernel_timeline(nat, loops, args.timeline)
        if settings.emulation.loopback_bandwidth_gbps:  # None over verbs: no emulated wire
            wire = _wire_timeline(nat, loops, args.timeline)

    if args.share_gpu:
        if rank == 0:
            from uccl_ep_train.internode.transport import mps_enabled

            mps = mps_enabled(torch.cuda.current_device())
            shared = {"shared_gpu": True, "world": world, "nodes": args.emulate_nodes, "mps": mps,
                      "expert_major": args.expert_major, "note": SHARED_GPU_NOTES[mps],
                      "sync_free": args.sync_free, "drain_after_waits": nat._drain_after_waits,
                      "dispatch_host_held_us": held,
                      "dispatches_before_counts": getattr(nat, "dispatches_before_counts", None),
                      "dispatch_us": t_disp * 1e6, "cached_dispatch_us": t_cached * 1e6,
                      "combine_us": t_comb * 1e6, "raw_transport_hop_us": raw_transport_us,
                      "host_step_us_by_rank": steps_by_rank,
                      "beside_compute_us": {k: statistics.mean(v) * 1e6 for k, v in (beside or {}).items()},
                      **{k: getattr(nat, k, None) for k in ("packs_and_pushes_during_notify", "reads_before_counts",
                                                            "reads_before_counts_declined",
                                                            "spare_read_outputs_taken", "forwards_during_hop",
                                                            "pipelined_gathers")}}
            if timeline is not None:
                shared["kernel_timeline_by_rank"] = timeline
            if wire is not None:
                shared["wire_timeline_by_rank"] = wire
            print(json.dumps(shared, indent=1))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(shared, f, indent=1)
        nat.destroy()
        dist.destroy_process_group()
        return 0

    # NCCL baseline: the same rows (one per (token, destination rank)), uneven splits
    send_counts = itr.sum(0).tolist()
    recv_counts = torch.empty(world, dtype=torch.int64, device=dev)
    dist.all_to_all_single(recv_counts, itr.sum(0).to(torch.int64))
    recv_counts = recv_counts.tolist()
    order = itr.t().nonzero(as_tuple=True)[1]
    xs = x.view(torch.uint8)[order] if args.fp8 else x[order]
    out = xs.new_empty((sum(recv_counts),) + tuple(xs.shape[1:]))
    t_nccl = _wall(lambda: dist.all_to_all_single(out, xs, recv_counts, send_counts), args.iters, args.warmup)

    # Raw loopback bandwidth: the same bytes each rank sends over the emulated network, copied by the copy engines
    # straight into the GPU of its rail peer on the next node (what one loopback write does, without commands,
    # proxies or signals), every rank at once. The uncapped goal is >= 0.8 of it.
    ngpu = torch.cuda.device_count()
    peer = torch.device("cuda", (local + G) % ngpu) if ngpu > 1 else dev
    nbytes = max(1, disp_traffic.network_bytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    t_raw = _wall(lambda: dst.copy_(src, non_blocking=True), args.iters, args.warmup)
    src = dst = None  # free the copy buffers (the lambda above is done with them)

    def mx(v):
        t = torch.tensor([v], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    row = {
        "world": world, "ranks_per_node": G, "nodes": args.emulate_nodes, "tokens": T, "hidden": H, "topk": K,
        "fp8": args.fp8, "expert_major": args.expert_major, "sync_free": args.sync_free, "num_worst_tokens": worst,
        "loopback_bw_gbps": settings.emulation.loopback_bandwidth_gbps,
        # how long an uncached dispatch holds the host (call to return), queued behind the compute spacer and alone
        # (_host_held_by_dispatch); sync-free without drains it returns before the count read
        "dispatch_host_held_us": held,
        "dispatches_before_counts": getattr(nat, "dispatches_before_counts", None),
        "dispatch_us": mx(t_disp) * 1e6, "cached_dispatch_us": mx(t_cached) * 1e6, "combine_us": mx(t_comb) * 1e6,
        "nccl_all_to_all_us": mx(t_nccl) * 1e6, "raw_copy_us": mx(t_raw) * 1e6,
        "dispatch_logical_bytes": disp_traffic.logical_bytes, "dispatch_network_bytes": disp_traffic.network_bytes,
        "dispatch_nvlink_bytes": disp_traffic.nvlink_bytes, "combine_logical_bytes": comb_traffic.logical_bytes,
        # partial sums cross in x's dtype since session 7 (before: fp32, twice these bytes on the wire)
        "combine_network_bytes": comb_traffic.network_bytes,
        "proxy": nat.proxy_stats(), "process_cpu_per_wall_s": cpu_frac,
        # whether the host waited for its stream after each network wait (internode.drain_after_waits): without the
        # drains the host steps below are launch times and the GPU runs the steps back to back
        "drain_after_waits": nat._drain_after_waits,
        # whether a copy agent process moved the loopback's bytes (UCCL_EP_LOOPBACK_COPY_AGENT), not the proxy threads
        "loopback_copy_agent": nat._copy_agent is not None,
        # whether the readers of each hop's arrivals (unpack with one GPU per node, the source's sum) ran during the
        # hop, gated chunk by chunk (UCCL_EP_GATED_ARRIVALS); the hop figures then end when the reader is done
        "gated_arrivals": nat.gated_arrivals,
        # per rank: mean host wall time per call and step (uncached and cached together); earlier runs' JSON had
        # rank 0's alone as host_step_us_rank0
        "host_step_us_by_rank": steps_by_rank,
        # median over the timed calls (dispatch: uncached and cached calls together), max over ranks
        "dispatch_network_hop_us": mx(statistics.median(hop_ms.get("dispatch_network", [0.0])) * 1e3),
        "raw_transport_hop_us": mx(raw_transport_us),
        "combine_network_hop_us": mx(statistics.median(hop_ms.get("combine_network", [0.0])) * 1e3),
        # uncached dispatch then combine, as in a training step; the combine's share is the difference from the
        # dispatch loop (max over ranks of each); how many of those combines skipped their entry barrier (rank 0)
        "dispatch_then_combine_us": mx(t_step) * 1e6,
        "combine_barriers_skipped_in_steps": step_skips,
        # call by call in turn (each to the end of its GPU work), max over ranks: the forward pair, then the backward
        # pair (cached dispatch after a combine, then combine) and how many entry barriers those skipped (rank 0)
        "step_dispatch_us": mx(t_fd) * 1e6, "step_combine_us": mx(t_fc) * 1e6,
        "backward_cached_dispatch_us": mx(t_bd) * 1e6, "backward_combine_us": mx(t_bc) * 1e6,
        "backward_barriers_skipped": {"dispatch": back_skips[0], "combine": back_skips[1],
                                      "calls_each": args.iters + args.warmup},
        # uncached dispatches (of every loop) that packed their records during notify, right after a combine (rank 0)
        "packs_during_notify": getattr(nat, "packs_during_notify", None),  # (older revisions in A/B runs lack it)
        # ... of which took send-plan tables made during the combine's hop before them
        "spare_send_tables_taken": getattr(nat, "spare_send_tables_taken", None),
        # hops whose records were written and pushed in one launch, by phase (rank 0, the whole run)
        "packs_and_pushes": getattr(nat, "packs_and_pushes", None),
        # ... and of the uncached dispatches packed and pushed during notify, those whose launch pushed the count row
        "count_rows_pushed_with_records": getattr(nat, "count_rows_pushed_with_records", None),
        # ... and of those, the ones whose reader went before the host read the counts, and the ones it handed back
        "reads_before_counts": getattr(nat, "reads_before_counts", None),
        "reads_before_counts_declined": getattr(nat, "reads_before_counts_declined", None),
        "spare_read_outputs_taken": getattr(nat, "spare_read_outputs_taken", None),
        # dispatches whose forwarder read and forwarded its arrivals during the hop (several GPUs per node; rank 0)
        "forwards_during_hop": getattr(nat, "forwards_during_hop", None),
        # combines whose local GPUs gathered in flagged tiles, each forwarder pushing as they were flagged (rank 0)
        "pipelined_gathers": getattr(nat, "pipelined_gathers", None),
        # small tables uploaded through the pinned staging area, and those that fell back to a pageable copy (the
        # area full or read by another stream since the last drain: a copy that may wait for the stream; rank 0,
        # every call of the run; None without the area, as on the CPU stand-in)
        "upload_staging": nat.upload_counts() if hasattr(nat, "upload_counts") else None,
        # host microseconds per small torch op, pinned upload and stream read on an idle GPU, before the backend and
        # with its proxies and copy agent idle (_host_op_us): rank 0
        "host_op_us": {"before_backend": host_ops_before, "with_proxies_idle": host_ops_with_proxies},
        # Python's garbage collections on rank 0 from setup to here (every loop above), and their pauses (GcPauses)
        "gc": {"mode": args.gc, **gc_pauses.stop()},
    }
    # medians of the calls timed one by one (the means above are of back-to-back loops): max over ranks
    row["median_us"] = {k: mx(statistics.median(v)) * 1e6 for k, v in calls.items()}
    row["median_network_GBps"] = {
        k: row["combine_network_bytes" if k.endswith("combine") else "dispatch_network_bytes"] / (us * 1e3)
        for k, us in row["median_us"].items()}
    # Training order, back to back (_in_turn): mean and median per call, max over ranks; network GB/s of the means,
    # and of each pair as a whole (both calls' network bytes over the pair's time)
    pair_bytes = row["dispatch_network_bytes"] + row["combine_network_bytes"]

    def loop_figures(loop: str, times: dict) -> None:
        """row[loop_us], [loop_median_us], [loop_network_GBps] (with the forward and backward pairs) from seconds
        per call by kind."""
        row[f"{loop}_us"] = {k: mx(statistics.mean(v)) * 1e6 for k, v in times.items()}
        row[f"{loop}_median_us"] = {k: mx(statistics.median(v)) * 1e6 for k, v in times.items()}
        row[f"{loop}_network_GBps"] = {
            k: row["combine_network_bytes" if k.endswith("combine") else "dispatch_network_bytes"] / (us * 1e3)
            for k, us in row[f"{loop}_us"].items()}
        row[f"{loop}_network_GBps"].update(_pair_figures(times, pair_bytes, mx))

    loop_figures("in_turn", in_turn)
    row["in_turn_host_step_us_by_rank"] = in_turn_steps_by_rank
    # the main thread per pair of those loops (_thread_usage): CPU seconds, switches it made (waits that slept) and
    # ones forced on it (preempted), page faults; per rank
    row["in_turn_main_thread_per_pair_by_rank"] = in_turn_thread_by_rank
    # Training steps of --layers layers, fresh handles (_training_steps): the same figures; the backward's cached
    # dispatch moves a bf16 gradient (with --fp8 more bytes than the forward's dispatch: its GB/s reads low)
    row["layers"] = args.layers
    loop_figures("training_step", training)
    row["training_step_host_step_us_by_rank"] = training_steps_by_rank
    if beside is not None:
        # The same training steps with GPU work before every call (--compute-us; the measured length beside it), each
        # call timed on the GPU from the end of that work to the end of its own (_gpu_spans): what a call costs the
        # step when its host steps overlap the compute before it. The back-to-back figures above are the stricter.
        row["beside_compute"] = {"compute_us": args.compute_us, "measured_compute_us": compute_us}
        loop_figures("beside_compute", beside)
    row["plans_made_ahead"] = plans_ahead  # hop plans the steps' calls made for their handles' next calls (rank 0)
    # A difference of two loops' means: it can read above the NIC cap (the dispatch's tail overlaps the combine's
    # host steps, and each loop has its own noise: 57.6 GB/s under a 50 GB/s cap in session 12). step_combine_us and
    # median_us["step_combine"] time the same combine call by call.
    row["combine_after_dispatch_us"] = row["dispatch_then_combine_us"] - row["dispatch_us"]
    row["dispatch_network_GBps"] = row["dispatch_network_bytes"] / (row["dispatch_us"] * 1e3)
    row["cached_dispatch_network_GBps"] = row["dispatch_network_bytes"] / (row["cached_dispatch_us"] * 1e3)
    row["dispatch_logical_GBps"] = row["dispatch_logical_bytes"] / (row["dispatch_us"] * 1e3)
    row["combine_network_GBps"] = row["combine_network_bytes"] / (row["combine_us"] * 1e3)
    row["combine_after_dispatch_network_GBps"] = row["combine_network_bytes"] / max(
        row["combine_after_dispatch_us"] * 1e3, 1e-9)
    for k in ("step_dispatch", "step_combine", "backward_cached_dispatch", "backward_combine"):
        kind = "combine" if k.endswith("combine") else "dispatch"
        row[f"{k}_network_GBps"] = row[f"{kind}_network_bytes"] / (row[f"{k}_us"] * 1e3)
    row["dispatch_network_hop_GBps"] = row["dispatch_network_bytes"] / max(row["dispatch_network_hop_us"] * 1e3, 1e-9)
    row["combine_network_hop_GBps"] = row["combine_network_bytes"] / max(row["combine_network_hop_us"] * 1e3, 1e-9)
    row["raw_copy_GBps"] = row["dispatch_network_bytes"] / (row["raw_copy_us"] * 1e3)
    # what the goal compares with: the NIC cap when one is emulated, else the raw copy bandwidth
    ceiling = row["loopback_bw_gbps"] or row["raw_copy_GBps"]
    row["dispatch_network_vs_ceiling"] = row["dispatch_network_GBps"] / ceiling
    row["cached_dispatch_network_vs_ceiling"] = row["cached_dispatch_network_GBps"] / ceiling
    row["combine_network_vs_ceiling"] = row["combine_network_GBps"] / ceiling
    row["dispatch_network_hop_vs_ceiling"] = row["dispatch_network_hop_GBps"] / ceiling
    row["combine_network_hop_vs_ceiling"] = row["combine_network_hop_GBps"] / ceiling
    row.update(_pairs_vs(row, ceiling, "ceiling"))
    # ... and over the transport's own rate on the same bytes: what the EP layer (kernels, host steps, gating) keeps
    row["raw_transport_GBps"] = row["dispatch_network_bytes"] / (row["raw_transport_hop_us"] * 1e3)
    row.update(_pairs_vs(row, row["raw_transport_GBps"], "raw_transport"))
    if timeline is not None:
        row["kernel_timeline_by_rank"] = timeline
    if wire is not None:
        row["wire_timeline_by_rank"] = wire
    if rank == 0:
        print(json.dumps(row, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    nat.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="uccl-ep-train bench")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args()
    raise SystemExit(a.func(a))
