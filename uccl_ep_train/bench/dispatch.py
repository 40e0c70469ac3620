"""`uccl-ep-train bench dispatch`: our intranode dispatch/combine beside NCCL all_to_all_single (and DeepEP when it is
importable), in one process group. Launch with `torchrun --nproc-per-node N -m uccl_ep_train bench dispatch`.

Bytes: "logical" counts every received row's payload the way DeepEP does (copies to itself included); "nvlink" counts
only the rows that actually cross to another GPU. Bandwidths are per rank. The NCCL baseline moves the same rows
(one per (token, destination rank)) with uneven splits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

DEFAULT_TOKENS = [128, 512, 1024, 2048, 4096, 8192]


def add_parser(sub) -> None:
    _add_arguments(sub.add_parser("dispatch",
                                  help="intranode dispatch/combine vs NCCL all_to_all (run under torchrun)"))


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the headline row (DeepSeek-V3: 4096)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sweep", type=str, default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated token counts of the sweep ('' to skip)")
    p.add_argument("--num-sms", type=int, default=24, help="SMs of the kernels that move data between GPUs")
    p.add_argument("--local-sms", type=int, default=None,
                   help="SMs of the kernels that touch only the own GPU (receive copy, combine's reduce); 0: the "
                        "whole GPU (default: UCCL_EP_LOCAL_SMS, itself 0). Give --num-sms's value to hold every "
                        "kernel of a call to that many SMs, as DeepEP's figures are")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", type=str, default="", help="write the results here")
    p.add_argument("--plot", type=str, default="", help="write a PNG of bandwidth against tokens here")
    p.add_argument("--profile", type=str, default="",
                   help="profile 5 BF16 dispatches and 5 combines of the headline row with torch.profiler and write "
                        "rank 0's kernel table to this file (where the time goes, kernel by kernel)")
    p.add_argument("--emulate-nodes", type=int, default=0, metavar="N",
                   help="the local GPUs play N nodes: the internode path (CPU proxies, loopback transport with the "
                        "UCCL_EP_LOOPBACK_* NIC emulation) at the headline shape, run as `bench internode "
                        "--emulate-nodes N` with this command's --tokens, --hidden, --topk, --experts, --iters, "
                        "--warmup, --json and --profile (its other settings at their defaults); --sweep, --plot, "
                        "--num-sms and --local-sms do not apply. 0 (default): one node")
    p.add_argument("--share-gpu", action="store_true",
                   help="with --emulate-nodes only: passed on to `bench internode --share-gpu` (several ranks on one "
                        "GPU, e.g. a 1-GPU machine; a check that the path runs, its timings mean nothing)")
    p.set_defaults(func=run)


# What `--emulate-nodes` passes on to the internode bench: the rest of its arguments keep its defaults.
_SHARED_WITH_INTERNODE = ("tokens", "hidden", "topk", "experts", "iters", "warmup", "json", "profile", "share_gpu")
_INTRANODE_ONLY = ("sweep", "plot", "num_sms", "local_sms")


def _run_emulated_nodes(args: argparse.Namespace) -> int:
    """`--emulate-nodes N`: the internode bench at this command's shape. Options that only the intranode bench has
    are refused when set, rather than silently dropped."""
    from uccl_ep_train.bench import internode

    if args.emulate_nodes < 1:
        raise SystemExit(f"--emulate-nodes must be >= 1, got {args.emulate_nodes}")
    defaults = argparse.ArgumentParser(add_help=False)
    _add_arguments(defaults)
    default = vars(defaults.parse_args([]))
    set_here = [k for k in _INTRANODE_ONLY if getattr(args, k) != default[k]]
    if set_here:
        names = ", ".join("--" + k.replace("_", "-") for k in set_here)
        raise SystemExit(f"--emulate-nodes runs the internode bench, which has no {names}: leave them out (or run "
                         "`bench internode` for its own options)")
    return internode.run(internode.namespace(emulate_nodes=args.emulate_nodes,
                                             **{k: getattr(args, k) for k in _SHARED_WITH_INTERNODE}))


def _time(fn, iters: int, warmup: int) -> float:
    """Mean microseconds per call, both ranks started together."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def _other_receive(backend) -> str:
    """Suffix of the dispatch timings taken with the receive path the backend is not configured for."""
    return "kernel_recv" if backend.dispatch_copy_engine else "copy_engine_recv"


def _max_over_ranks(v: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([v], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _profile(path: str, dispatch, combine) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dispatch()
        for _ in range(5):
            combine()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write("5 BF16 dispatches then 5 combines\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                              max_name_column_width=70))


def _case(backend, T: int, H: int, K: int, E: int, iters: int, warmup: int, deep_ep_buffer=None,
          profile_path: str = "", copy_sweep: bool = False) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from uccl_ep_train.backends import DispatchArgs

    R, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    scores = torch.rand((T, E), device="cuda", generator=gen)
    topk_idx = scores.topk(K, dim=1).indices.to(torch.int64)
    topk_w = torch.rand((T, K), device="cuda", generator=gen)
    x = torch.randn((T, H), device="cuda", generator=gen).to(torch.bfloat16)
    x8 = x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
    x8_scales = torch.rand((T, H // 128), device="cuda", generator=gen) + 0.5
    per_rank, per_rdma, per_expert, in_rank = backend.get_dispatch_layout(topk_idx, E)

    def args(xx, ss=None, worst=0, handle=None):
        if handle is not None:
            return DispatchArgs(xx, ss, handle, None, None, None, None, None, None)
        return DispatchArgs(xx, ss, None, per_rank, per_rdma, in_rank, per_expert, topk_idx, topk_w,
                            num_worst_tokens=worst)

    res = backend.dispatch(args(x))
    recv_rows = res.recv_x.shape[0]
    recv_x = res.recv_x
    handle = res.handle
    row_bf16 = H * 2
    row_fp8 = H + 4 * (H // 128)
    sent_remote = int(per_rank.sum().item() - per_rank[rank].item())
    recv_remote = recv_rows - int(in_rank[:, rank].sum().item())
    out: Dict[str, Any] = {"tokens": T, "hidden": H, "topk": K, "experts": E, "ranks": R, "recv_rows": recv_rows}

    t_layout = _time(lambda: backend.get_dispatch_layout(topk_idx, E), iters, warmup)
    t_bf16 = _time(lambda: backend.dispatch(args(x)), iters, warmup)
    t_fp8 = _time(lambda: backend.dispatch(args(x8, x8_scales)), iters, warmup)
    t_cached = _time(lambda: backend.dispatch(args(x, handle=handle)), iters, warmup)
    worst = T * R
    t_syncfree = _time(lambda: backend.dispatch(args(x, worst=worst)), iters, warmup)
    # The BF16 dispatches with the other receive path (copy engine or the kernel), in the same run. (FP8 receives
    # always take the kernel.)
    dispatch_copy_engine = backend.dispatch_copy_engine
    backend.dispatch_copy_engine = not dispatch_copy_engine
    try:
        t_bf16_alt = _time(lambda: backend.dispatch(args(x)), iters, warmup)
        t_cached_alt = _time(lambda: backend.dispatch(args(x, handle=handle)), iters, warmup)
    finally:
        backend.dispatch_copy_engine = dispatch_copy_engine
    alt = _other_receive(backend)
    t_combine = _time(lambda: backend.combine(recv_x, handle, None, None), iters, warmup)
    # The same combine with its transfers as SM stores over NVLink (the path of sync-free handles), in the same run.
    copy_engine = backend.combine_copy_engine
    backend.combine_copy_engine = False
    try:
        t_combine_sm = _time(lambda: backend.combine(recv_x, handle, None, None), iters, warmup)
    finally:
        backend.combine_copy_engine = copy_engine
    if copy_sweep and copy_engine:  # the copy-engine combine's knobs, headline row only
        saved = backend.copy_streams, backend.copy_chunk_bytes
        out["combine_bf16_copy_sweep"] = sweep = []
        try:
            for streams in (1, 2, 8):
                for chunk_mib in (4, 8, 16):
                    backend.copy_streams, backend.copy_chunk_bytes = streams, chunk_mib << 20
                    us = _time(lambda: backend.combine(recv_x, handle, None, None), iters, warmup)
                    sweep.append({"copy_streams": streams, "chunk_MiB": chunk_mib, "us": _max_over_ranks(us)})
        finally:
            backend.copy_streams, backend.copy_chunk_bytes = saved
    if profile_path:
        _profile(profile_path, lambda: backend.dispatch(args(x)), lambda: backend.combine(recv_x, handle, None, None))

    # NCCL: the same rows, one per (token, destination rank), uneven splits.
    send_counts = per_rank.tolist()
    recv_counts = torch.empty_like(per_rank)
    dist.all_to_all_single(recv_counts, per_rank)
    recv_counts = recv_counts.tolist()
    order = torch.cat([in_rank[:, r].nonzero().squeeze(1) for r in range(R)])
    send_buf = x[order].contiguous()
    recv_buf = torch.empty((sum(recv_counts), H), dtype=x.dtype, device="cuda")
    t_nccl = _time(lambda: dist.all_to_all_single(recv_buf, send_buf, recv_counts, send_counts), iters, warmup)

    for name, us, row in (("dispatch_bf16", t_bf16, row_bf16), ("dispatch_fp8", t_fp8, row_fp8),
                          ("dispatch_bf16_cached", t_cached, row_bf16),
                          ("dispatch_bf16_syncfree", t_syncfree, row_bf16),
                          (f"dispatch_bf16_{alt}", t_bf16_alt, row_bf16),
                          (f"dispatch_bf16_cached_{alt}", t_cached_alt, row_bf16),
                          ("combine_bf16", t_combine, row_bf16), ("combine_bf16_sm_stores", t_combine_sm, row_bf16),
                          ("nccl_all_to_all_bf16", t_nccl, row_bf16)):
        us = _max_over_ranks(us)
        remote = recv_remote if name.startswith(("dispatch", "nccl")) else sent_remote
        if name.startswith("combine"):
            remote = recv_remote  # combine sends back what dispatch received
        out[name] = {"us": us, "logical_GBps": recv_rows * row / us / 1e3, "nvlink_GBps": remote * row / us / 1e3,
                     "logical_bytes": recv_rows * row, "nvlink_bytes": remote * row}
    out["layout_us"] = _max_over_ranks(t_layout)

    if deep_ep_buffer is not None:
        try:
            buf = deep_ep_buffer
            rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                             num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_w)
            t = _time(lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                           num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                           topk_weights=topk_w), iters, warmup)
            tc = _time(lambda: buf.combine(rx, h), iters, warmup)
            out["deepep_dispatch_bf16"] = {"us": _max_over_ranks(t)}
            out["deepep_combine_bf16"] = {"us": _max_over_ranks(tc)}
        except Exception as exc:  # DeepEP present but unusable here: say so, keep our numbers
            out["deepep_error"] = str(exc)
    return out


def run(args: argparse.Namespace) -> int:
    if getattr(args, "emulate_nodes", 0):
        return _run_emulated_nodes(args)
    if getattr(args, "share_gpu", False):
        raise SystemExit("--share-gpu needs --emulate-nodes: the intranode bench runs one rank per GPU")
    import torch
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext
    from uccl_ep_train.intranode import NativeIntranodeBackend
    from uccl_ep_train.settings import load_settings

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    R, rank = dist.get_world_size(), dist.get_rank()
    sweep = [int(s) for s in args.sweep.split(",") if s.strip()]
    t_max = max([args.tokens] + sweep)
    H, K, E = args.hidden, args.topk, args.experts
    row = H * 2 + 4 * (H // 128) + 12 * K + 4
    nvl_bytes = t_max * R * row + (1 << 20)
    settings = load_settings()
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=R, ranks_per_node=R,
                         device=torch.device("cuda", local), num_nvl_bytes=nvl_bytes, num_rdma_bytes=0,
                         settings=settings)
    backend = NativeIntranodeBackend(ctx)
    backend.num_sms = args.num_sms
    if args.local_sms is not None:
        if args.local_sms < 0:
            raise SystemExit(f"--local-sms must be >= 0, got {args.local_sms}")
        backend.local_sms = args.local_sms
    local_sms = backend.local_sms
    deep = None
    try:
        import deep_ep  # type: ignore

        deep_ep.Buffer.set_num_sms(args.num_sms)
        deep = deep_ep.Buffer(dist.group.WORLD, int(2e9), 0)
    except Exception:
        deep = None

    results: List[Dict[str, Any]] = []
    for T in [args.tokens] + [t for t in sweep if t != args.tokens]:
        results.append(_case(backend, T, H, K, E, args.iters, args.warmup, deep,
                             args.profile if T == args.tokens else "", copy_sweep=T == args.tokens))
    results.sort(key=lambda r: r["tokens"])

    if rank == 0:
        dev = torch.cuda.get_device_name()
        local_desc = f"{local_sms} SMs" if local_sms else "the whole GPU"
        alt = _other_receive(backend)
        print(f"# uccl-ep-train bench dispatch: {R} x {dev}, hidden {H}, top-{K} of {E}, {args.num_sms} SMs "
              f"moving data between GPUs, {local_desc} for the local kernels, combine_bf16 "
              f"{'by copy engine (no SM for the transfer)' if backend.combine_copy_engine else 'by SM stores'}, "
              f"dispatch's peer rows out of the receive area "
              f"{'by copy engine' if backend.dispatch_copy_engine else 'by the receive kernel'} (*_{alt}: the other "
              f"way), "
              f"{args.iters} iterations; times are the max over ranks; GB/s per rank")
        cols = ["dispatch_bf16", "dispatch_fp8", "dispatch_bf16_cached", "dispatch_bf16_syncfree",
                f"dispatch_bf16_{alt}", f"dispatch_bf16_cached_{alt}", "combine_bf16",
                "combine_bf16_sm_stores", "nccl_all_to_all_bf16"]
        print("| tokens | recv rows | " + " | ".join(f"{c} us (logical / nvlink GB/s)" for c in cols)
              + " | layout us |" + (" DeepEP dispatch / combine us |" if deep is not None else ""))
        print("|" + " --- |" * (len(cols) + 3 + (1 if deep is not None else 0)))
        for r in results:
            cells = [f"{r[c]['us']:.1f} ({r[c]['logical_GBps']:.0f} / {r[c]['nvlink_GBps']:.0f})" for c in cols]
            line = f"| {r['tokens']} | {r['recv_rows']} | " + " | ".join(cells) + f" | {r['layout_us']:.1f} |"
            if deep is not None:
                d = r.get("deepep_dispatch_bf16", {}).get("us", float("nan"))
                c = r.get("deepep_combine_bf16", {}).get("us", float("nan"))
                line += f" {d:.1f} / {c:.1f} |"
            print(line)
        for r in results:
            if r.get("combine_bf16_copy_sweep"):
                print(f"copy-engine combine at {r['tokens']} tokens, us by copy streams x chunk: " + ", ".join(
                    f"{c['copy_streams']} x {c['chunk_MiB']} MiB {c['us']:.1f}" for c in r["combine_bf16_copy_sweep"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": dev, "ranks": R, "num_sms": args.num_sms, "local_sms": local_sms,
                           "combine_copy_engine": backend.combine_copy_engine,
                           "dispatch_copy_engine": backend.dispatch_copy_engine,
                           "results": results}, f, indent=1)
        if args.plot:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                print("bench dispatch: matplotlib is not installed; no plot", file=sys.stderr)
            else:
                fig, ax = plt.subplots(figsize=(7, 4))
                toks = [r["tokens"] for r in results]
                for c in cols:
                    ax.plot(toks, [r[c]["logical_GBps"] for r in results], marker="o", label=c)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("tokens per rank")
                ax.set_ylabel("logical GB/s per rank")
                ax.set_title(f"{R} x {dev}, hidden {H}, top-{K}/{E}, {args.num_sms} SMs")
                ax.legend(fontsize=7)
                fig.tight_layout()
                fig.savefig(args.plot, dpi=120)
    backend.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    a = parser.parse_args()
    sys.exit(a.func(a))
