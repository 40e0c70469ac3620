"""`uccl-ep-train bench dispatcher`: Megatron's token dispatchers side by side, one torchrun, same routing.

    torchrun --nproc-per-node 2 -m uccl_ep_train bench dispatcher [--tokens 4096 --hidden 7168 --topk 8
        --experts 256] [--dispatchers alltoall,allgather,flex,uccl] [--json out.json]

For each dispatcher: the forward round trip (dispatch_preprocess -> token_dispatch -> dispatch_postprocess ->
identity experts (tokens x probs) -> combine_preprocess -> token_combine -> combine_postprocess) and the forward +
backward round trip, timed with CUDA events over ``--iters`` after ``--warmup``, the maximum over ranks of each
rank's mean. Every dispatcher sees the same hidden states and routing (seeded). ``flex`` runs only when DeepEP is
importable. ``uccl-sync-free`` is ``uccl`` in sync-free mode (UCCL_EP_SYNC_FREE: worst-case row counts, no host read
of the token counts; not in the default list; ``--sync-free-rows N`` receives N rows per rank instead of the worst
case, as UCCL_EP_NUM_WORST_TOKENS does in training). The default shape is DeepSeek-V3's: 4096 tokens per rank,
hidden 7168, top-8 of 256 experts.
The identity experts are timed alone too (``stand_in_experts``, over the rows the first dispatcher produced), so the
dispatcher's own share of a round trip is the round trip minus that.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_DISPATCHERS = "alltoall,allgather,flex,uccl"
KNOWN_DISPATCHERS = DEFAULT_DISPATCHERS + ",uccl-sync-free"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("dispatcher", help="time Megatron's MoE token dispatchers (alltoall, allgather, flex, uccl)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="number of routed experts (default 256)")
    p.add_argument("--dispatchers", default=DEFAULT_DISPATCHERS,
                   help=f"comma-separated subset of {KNOWN_DISPATCHERS} (default: {DEFAULT_DISPATCHERS})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--sync-free-rows", type=int, default=0, metavar="N",
                   help="uccl-sync-free: rows each rank receives (its num_worst_tokens; 0: the worst case, tokens x "
                        "ranks x min(top-k, local experts)). Fewer rows than a rank really receives is an error")
    p.add_argument("--profile", metavar="DIR",
                   help="after timing, profile 3 forward+backward round trips per dispatcher with torch.profiler and "
                        "write rank 0's op table (by CUDA time, then by CPU time) to DIR/<dispatcher>.txt")
    p.set_defaults(func=run)
    return p


def register(sub) -> argparse.ArgumentParser:
    """Same as add_parser (the name uccl_ep_train.cli uses for its subcommand modules)."""
    return add_parser(sub)


def _routing(torch, tokens: int, experts: int, topk: int, seed: int, rank: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
    logits = torch.randn(tokens, experts, generator=g)
    top = logits.topk(topk, dim=1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros(tokens, experts).scatter_(1, top.indices, torch.softmax(top.values, dim=1))
    return routing_map.to(device), probs.to(device)


def _build(name: str, cfg, num_local: int, local: list, sync_free_rows: int = 0):
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    pg = get_default_pg_collection()
    if name in ("uccl", "uccl-sync-free"):
        import dataclasses

        from uccl_ep_train.megatron.dispatcher import UCCLTokenDispatcher
        from uccl_ep_train.megatron.options import load_options

        options = load_options()
        if name == "uccl-sync-free":
            options = dataclasses.replace(options, sync_free=True, num_worst_tokens=sync_free_rows)
        return UCCLTokenDispatcher(num_local, local, cfg, pg_collection=pg, options=options)
    cls = {"alltoall": td.MoEAlltoAllTokenDispatcher, "allgather": td.MoEAllGatherTokenDispatcher,
           "flex": td.MoEFlexTokenDispatcher}[name]
    return cls(num_local, local, config=cfg, pg_collection=pg)


def _round_trip(torch, dispatcher, hidden, routing_map, probs, backward: bool):
    h, p = (hidden.detach().requires_grad_(backward), probs.detach().requires_grad_(backward))
    x, q = dispatcher.dispatch_preprocess(h, routing_map, p)
    x, q = dispatcher.token_dispatch(x, q)
    tokens, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(x, q)
    out = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)
    out = dispatcher.combine_preprocess(out)
    out = dispatcher.token_combine(out)
    out = dispatcher.combine_postprocess(out)
    if backward:
        out.backward(torch.ones_like(out))
    return out, tokens.shape[0]


def _stand_in(torch, rows: int, hidden: int, dtype, backward: bool, gen):
    """The round trip's stand-in experts alone, over as many rows as the dispatcher handed them: what part of the
    round trip is not the dispatcher's."""
    tokens = torch.randn((rows, hidden), generator=gen, device="cuda").to(dtype)
    probs = torch.rand(rows, generator=gen, device="cuda")

    def step():
        # fresh leaves per step, as _round_trip makes them: reused ones would add each step's gradients into .grad
        t, p = tokens.detach().requires_grad_(backward), probs.detach().requires_grad_(backward)
        out = t * p.unsqueeze(-1).to(t.dtype)
        if backward:
            out.backward(torch.ones_like(out))
    return step


def _time(torch, fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters  # microseconds


def _profile(torch, fn, path: str) -> None:
    """Where the round trip's time goes: the ops sorted by device time and by host time (rank 0 writes)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages()
    with open(path, "w") as f:
        f.write("3 forward+backward round trips\n\n== by device time\n")
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        f.write("\n\n== by host time\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def run(args) -> int:
    if "WORLD_SIZE" not in os.environ:
        print("bench dispatcher runs under torchrun, one process per GPU, e.g.\n"
              "  torchrun --nproc-per-node 2 -m uccl_ep_train bench dispatcher", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("bench dispatcher needs CUDA GPUs", file=sys.stderr)
        return 2
    import megatron_patch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    megatron_patch.apply()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the {world} ranks")
    names = [n.strip() for n in args.dispatchers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(KNOWN_DISPATCHERS.split(",")))
    if unknown:
        raise SystemExit(f"unknown dispatchers {unknown}; choose from {KNOWN_DISPATCHERS}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device("cuda", local_rank)
    routing_map, probs = _routing(torch, args.tokens, args.experts, args.topk, args.seed, rank, device)
    g = torch.Generator(device="cpu").manual_seed(args.seed + rank)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device=device, dtype=dtype)
    num_local = args.experts // world
    local = list(range(rank * num_local, (rank + 1) * num_local))

    rows = []
    for name in names:
        row = {"dispatcher": name}
        try:
            cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                                    num_moe_experts=args.experts, moe_router_topk=args.topk,
                                    moe_ffn_hidden_size=args.hidden,
                                    moe_token_dispatcher_type="uccl" if name.startswith("uccl") else name,
                                    expert_model_parallel_size=world, bf16=dtype == torch.bfloat16,
                                    params_dtype=dtype, moe_router_dtype="fp32",
                                    **({"moe_flex_dispatcher_backend": "deepep"} if name == "flex" else {}))
            dispatcher = _build(name, cfg, num_local, local, args.sync_free_rows)
            row["forward_us"] = _time(torch, lambda: _round_trip(torch, dispatcher, hidden, routing_map, probs,
                                                                 False), args.warmup, args.iters)
            row["forward_backward_us"] = _time(torch, lambda: _round_trip(torch, dispatcher, hidden, routing_map,
                                                                          probs, True), args.warmup, args.iters)
            if args.profile and rank == 0:
                os.makedirs(args.profile, exist_ok=True)
                _profile(torch, lambda: _round_trip(torch, dispatcher, hidden, routing_map, probs, True),
                         os.path.join(args.profile, f"{name}.txt"))
            elif args.profile:
                for _ in range(4):  # the peer's collectives must match rank 0's profiled calls
                    _round_trip(torch, dispatcher, hidden, routing_map, probs, True)
            row["expert_rows"] = _round_trip(torch, dispatcher, hidden, routing_map, probs, False)[1]
            if name.startswith("uccl"):
                from uccl_ep_train.megatron import dispatcher as uccl_dispatcher

                buffers = list(uccl_dispatcher._BUFFERS.values())
                row["backend"] = buffers[0].backend.name if buffers else "?"
        except Exception as exc:  # noqa: BLE001 - one dispatcher failing (e.g. no DeepEP) must not hide the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        dist.barrier()

    # The stand-in experts alone, over the rows the first dispatcher that ran handed them on this rank.
    stand_in = {}
    expert_rows = next((r["expert_rows"] for r in rows if "expert_rows" in r), 0)
    if expert_rows:
        g_cuda = torch.Generator(device="cuda").manual_seed(args.seed)
        for key, backward in (("forward_us", False), ("forward_backward_us", True)):
            stand_in[key] = _time(torch, _stand_in(torch, expert_rows, args.hidden, dtype, backward, g_cuda),
                                  args.warmup, args.iters)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    stand_ins = [None] * world
    dist.all_gather_object(stand_ins, stand_in)
    result = {"shape": {"tokens_per_rank": args.tokens, "hidden": args.hidden, "topk": args.topk,
                        "experts": args.experts, "ranks": world, "dtype": args.dtype},
              "iters": args.iters, "results": []}
    if all(stand_ins):
        # the max over ranks of the stand-in's mean, like the round trips'
        result["stand_in_experts"] = {k: max(si[k] for si in stand_ins) for k in ("forward_us", "forward_backward_us")}
    for i, name in enumerate(names):
        per_rank = [g[i] for g in gathered]
        errors = [r["error"] for r in per_rank if "error" in r]
        entry = {"dispatcher": name}
        if errors:
            entry["error"] = errors[0]
        else:
            entry["forward_us"] = max(r["forward_us"] for r in per_rank)
            entry["forward_backward_us"] = max(r["forward_backward_us"] for r in per_rank)
            if "backend" in per_rank[0]:
                entry["backend"] = per_rank[0]["backend"]
        result["results"].append(entry)
    if rank == 0:
        shape = result["shape"]
        print(f"MoE dispatcher round trip, {shape['ranks']} ranks, {shape['tokens_per_rank']} tokens/rank, hidden "
              f"{shape['hidden']}, top-{shape['topk']} of {shape['experts']} experts, {args.dtype}, max over ranks of "
              f"the mean of {args.iters} iterations")
        print(f"{'dispatcher':<12}{'forward (us)':>16}{'fwd+bwd (us)':>16}  note")
        for e in result["results"]:
            if "error" in e:
                print(f"{e['dispatcher']:<12}{'-':>16}{'-':>16}  {e['error']}")
            else:
                print(f"{e['dispatcher']:<12}{e['forward_us']:>16.0f}{e['forward_backward_us']:>16.0f}  "
                      f"{('backend ' + e['backend']) if 'backend' in e else ''}")
        si = result.get("stand_in_experts")
        if si:
            print(f"{'stand-in':<12}{si['forward_us']:>16.0f}{si['forward_backward_us']:>16.0f}  the identity experts "
                  f"alone (tokens x probs over the dispatched rows); every round trip above includes them")
        if args.json:
            text = json.dumps(result, indent=2)
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0
