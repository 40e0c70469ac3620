"""`uccl-ep-train bench proxy`: command FIFO + proxy throughput and push-to-completion latency.

Throughput: every FIFO gets its own producer (a native CPU thread, or one GPU warp with ``--producer gpu``) pushing
16-byte write+signal commands to this rank over the loopback transport; commands/s counts until the closing quiet of
every FIFO completed. Latency: one write+signal at a time on FIFO 0, from the push until the signal it carries was
applied, by the same kind of producer (CPU: includes the Python call overhead of about a microsecond; GPU: a kernel
timing itself on the GPU clock). A FIFO is fed by host or by GPU producers, never both (the other kind is refused),
so the GPU latency run pushes from a kernel too. ``--push`` picks the device push variant (docs/host-core.md).

``--prefill`` (CPU producer) fills every FIFO before the proxy threads start (the FIFO depth grows to hold them), so
the rate is the proxy threads' alone: no producer thread competes for a core or bounces the ring's cache lines with
the proxy, which on a machine with few cores is most of what the plain CPU figure measures.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("proxy", help="command FIFO + CPU proxy: commands/s and push-to-completion latency")
    p.add_argument("--fifos", default="1,2,4", help="comma separated FIFO counts to measure (default 1,2,4)")
    p.add_argument("--threads", type=int, default=0, help="proxy threads (default: one per FIFO, at most 4)")
    p.add_argument("--commands", type=int, default=200_000, help="commands per FIFO in the throughput run")
    p.add_argument("--latency-samples", type=int, default=2000)
    p.add_argument("--producer", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--push", choices=PUSH_VARIANTS, default="writer-warp",
                   help="GPU push variant (--producer gpu): push = fifo_push per command, warp = one reservation per "
                        "warp, writer / writer-warp = the FIFO owned by one thread / warp (default writer-warp)")
    p.add_argument("--poll-warps", default="1",
                   help="GPU producer: comma separated counts of warps that watch the signal counter in the latency "
                        "run, their loads staggered over a PCIe round trip (default 1: one polling thread). Each "
                        "count also measures the GPU -> host -> GPU echo floor with the same watchers")
    p.add_argument("--depth", type=int, default=None, help="FIFO depth (default UCCL_EP_FIFO_DEPTH)")
    p.add_argument("--prefill", action="store_true",
                   help="CPU producer: push every command before the proxy starts and time the drain alone")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run)
    return p


PUSH_VARIANTS = ("push", "warp", "writer", "writer-warp")


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"max": float(a.max())}


def _measure(C: Any, settings: Any, nfifos: int, args: argparse.Namespace) -> dict[str, Any]:
    from uccl_ep_train import comm

    threads = args.threads or min(nfifos, 4)
    if nfifos % threads:
        raise SystemExit(f"--fifos {nfifos} is not a multiple of --threads {threads}")
    overrides: dict[str, Any] = {"num_threads": threads, "fifos_per_thread": nfifos // threads}
    if args.depth:
        overrides["fifo_depth"] = args.depth
    prefill = args.prefill
    if prefill:  # the whole run, closing quiet included, must fit in the ring
        overrides["fifo_depth"] = max(overrides.get("fifo_depth", 0), 1 << args.commands.bit_length())
    c = comm.HostComm(1 << 20, 0, 1, settings=settings, num_signal_slots=max(64, nfifos + 1), **overrides)
    if prefill:
        c.connect_infos([c.local_infos()])
        C.unlink_shared_host_memory_names()
    else:
        comm.connect_in_process([c])
    try:
        n = args.commands
        if args.producer == "gpu":
            if not hasattr(C, "fifo_bench_gpu"):
                raise SystemExit("--producer gpu needs a CUDA build of uccl_ep_train._C and a GPU")
            try:
                seconds = C.fifo_bench_gpu(c.proxy, 0, nfifos, n, 0, c.options["timeout_secs"], push=args.push)
            except C.ProxyError as exc:
                if "not device-mapped" in str(exc):
                    raise SystemExit(f"--producer gpu needs a GPU at run time: {exc}") from None
                raise
        else:
            cmds = []
            for f in range(nfifos):
                one = np.array(C.command.write_signal(0, 16, 16 * f, 16 * f, f, 1), dtype=np.uint64)
                cmds.append(np.vstack([np.tile(one, (n, 1)), np.array([C.command.quiet()], dtype=np.uint64)]))

            def produce(f: int) -> None:
                c.push_array(f, cmds[f])

            if prefill:
                for f in range(nfifos):
                    produce(f)
                t0 = time.perf_counter()
                c.start()
            else:
                ts = [threading.Thread(target=produce, args=(f,)) for f in range(nfifos)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            c.wait_idle()  # every FIFO drained, its closing quiet included, and nothing in flight
            seconds = time.perf_counter() - t0
        c.check()
        # latency: one command at a time on FIFO 0, pushed by the same kind of producer that fed it above
        slot = nfifos
        by_watchers: dict[str, Any] = {}
        if args.producer == "gpu":
            for w in _poll_warps(args):
                samples = C.fifo_latency_gpu(c.proxy, 0, slot, args.latency_samples, c.options["timeout_secs"],
                                             push=args.push, poll_warps=w)
                echo = C.pcie_echo_gpu(args.latency_samples, c.options["timeout_secs"], poll_warps=w)
                by_watchers[str(w)] = {"latency_us": _percentiles(samples), "echo_floor_us": _percentiles(echo)}
                lat = samples  # the row's headline: the last (most watchers) count given
        else:
            base = int(c.signals()[slot])
            cmd = C.command.write_signal(0, 16, 0, 4096, slot, 1)
            lat = []
            for i in range(args.latency_samples):
                t0 = time.perf_counter_ns()
                c.push(0, cmd)
                c.wait_signal(slot, base + i + 1)
                lat.append(time.perf_counter_ns() - t0)
        c.check()
        stats = c.stats()
        return {"fifos": nfifos, "proxy_threads": threads, "producer": args.producer,
                "push": args.push if args.producer == "gpu" else ("prefill" if prefill else "host"),
                "commands": n * nfifos,
                "seconds": seconds, "commands_per_s": n * nfifos / seconds,
                "latency_us": _percentiles(lat), "latency_by_poll_warps": by_watchers,
                "transport": c.proxy.caps["name"],
                "max_inflight_writes": max(s["max_inflight_writes"] for s in stats)}
    finally:
        c.close()


def _poll_warps(args: argparse.Namespace) -> list[int]:
    try:
        counts = [int(x) for x in str(args.poll_warps).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--poll-warps must be comma separated integers, got {args.poll_warps!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 32:
        raise SystemExit(f"--poll-warps counts must be 1..32 (warps of one block), got {args.poll_warps!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    from uccl_ep_train import native
    from uccl_ep_train.settings import load_settings

    C = native.module()
    settings = load_settings()
    counts = [int(x) for x in args.fifos.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--fifos needs positive counts, e.g. 1,2,4")
    results = []
    if args.latency_samples < 1:
        raise SystemExit("--latency-samples must be at least 1")
    if args.producer == "gpu":
        _poll_warps(args)  # reject a malformed list before any kernel runs
    if args.prefill and args.producer != "cpu":
        raise SystemExit("--prefill fills the FIFOs from the host: it needs --producer cpu")
    print(f"{'fifos':>5} {'threads':>7} {'producer':>8} {'push':>11} {'Mcmd/s':>8} {'p50 us':>8} {'p90 us':>8} "
          f"{'p99 us':>8}")
    for nf in counts:
        r = _measure(C, settings, nf, args)
        results.append(r)
        lat = r["latency_us"]
        print(f"{nf:>5} {r['proxy_threads']:>7} {r['producer']:>8} {r['push']:>11} {r['commands_per_s'] / 1e6:>8.2f} "
              f"{lat['p50']:>8.2f} {lat['p90']:>8.2f} {lat['p99']:>8.2f}", flush=True)
        for w, row in r["latency_by_poll_warps"].items():
            la, fl = row["latency_us"], row["echo_floor_us"]
            print(f"      {w:>2} watching warps: push-to-signal p50 {la['p50']:.2f} p99 {la['p99']:.2f} us; "
                  f"GPU->host->GPU echo floor p50 {fl['p50']:.2f} p99 {fl['p99']:.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "proxy", "settings": settings.to_env(), "results": results}, f, indent=2)
    return 0
