"""An independent statement of dispatch/combine, for tests: gather every rank's inputs and compute each rank's expected
outputs with plain Python loops over tokens (no shared code with uccl_ep_train.reference).

Also builds the routings the tests use (random, skewed, empty, drops) and their inputs deterministically from
(seed, rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

ROUTINGS = ("random", "skewed", "empty", "drops")


def make_routing(kind: str, rank: int, num_ranks: int, num_experts: int, num_topk: int, seed: int = 0):
    """(num_tokens, topk_idx [T, K] int64) for one rank. Rows never repeat an expert."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num_tokens = 5 + 2 * rank
    per_rank = num_experts // num_ranks
    if kind == "empty" and rank == 1:
        num_tokens = 0  # a rank that sends nothing
    if kind == "skewed":  # every token picks the same experts, all owned by rank 0: the others receive nothing
        row = torch.arange(num_topk) % per_rank
        if num_topk > per_rank:
            row = torch.cat([torch.arange(per_rank), torch.full((num_topk - per_rank,), -1)])
        return num_tokens, row.repeat(num_tokens, 1).to(torch.int64)
    pool = torch.arange(num_experts)
    if kind == "empty":  # the last rank owns no selected expert, so it receives nothing
        pool = pool[: (num_ranks - 1) * per_rank]
    rows = [pool[torch.randperm(pool.numel(), generator=gen)[:num_topk]] for _ in range(num_tokens)]
    topk = torch.stack(rows).to(torch.int64) if rows else torch.empty(0, num_topk, dtype=torch.int64)
    if kind == "drops":
        drop = torch.rand(topk.shape, generator=gen) < 0.4
        if num_tokens:
            drop[0] = True  # a token with every slot dropped goes nowhere
        topk[drop] = -1
    return num_tokens, topk


def make_inputs(kind: str, rank: int, num_ranks: int, num_experts: int, num_topk: int, hidden: int, dtype,
                routing_seed: int, payload_seed: int):
    """(x [T, hidden] in dtype, topk_idx, topk_weights [T, K]) for one rank: fresh random payload (offset by the rank,
    so rows from different ranks differ) and weights, on the routing ``kind``."""
    num_tokens, topk = make_routing(kind, rank, num_ranks, num_experts, num_topk, routing_seed)
    gen = torch.Generator().manual_seed(payload_seed)
    x = (torch.randn(num_tokens, hidden, generator=gen) + rank).to(dtype)
    return x, topk, torch.rand(num_tokens, num_topk, generator=gen)


@dataclass
class World:
    xs: List[torch.Tensor]
    scales: List[Optional[torch.Tensor]]
    topks: List[torch.Tensor]
    weights: List[torch.Tensor]
    num_ranks: int
    ranks_per_node: int
    num_experts: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def dest_ranks(self, s: int, t: int) -> List[int]:
        return sorted({int(e) // self.experts_per_rank for e in self.topks[s][t].tolist() if e >= 0})


def gather_world(x, topk_idx, topk_weights, num_experts, ranks_per_node, x_scales=None, group=None) -> World:
    num_ranks = dist.get_world_size(group)
    items = [None] * num_ranks
    # float8 tensors do not pickle: ship their bytes and restore the dtype.
    raw = x.cpu().view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.cpu()
    dist.all_gather_object(items, (raw, None if x_scales is None else x_scales.cpu(), topk_idx.cpu(),
                                   topk_weights.cpu()), group=group)
    xs = [i[0].view(x.dtype) for i in items]
    return World(xs, [i[1] for i in items], [i[2] for i in items], [i[3] for i in items],
                 num_ranks, ranks_per_node, num_experts)


def expected_layout(w: World, rank: int):
    topk = w.topks[rank]
    per_rank = [0] * w.num_ranks
    per_expert = [0] * w.num_experts
    per_node = [0] * (w.num_ranks // w.ranks_per_node)
    in_rank = torch.zeros(topk.size(0), w.num_ranks, dtype=torch.bool)
    for t in range(topk.size(0)):
        for e in topk[t].tolist():
            if e >= 0:
                per_expert[e] += 1
        dests = w.dest_ranks(rank, t)
        for d in dests:
            per_rank[d] += 1
            in_rank[t, d] = True
        for n in sorted({d // w.ranks_per_node for d in dests}):
            per_node[n] += 1
    return per_rank, per_node, per_expert, in_rank


def expected_receive(w: World, rank: int) -> dict:
    """Rank-major rows, by source rank then source token: x, scales, local topk ids, masked weights, sources."""
    lo, per = rank * w.experts_per_rank, w.experts_per_rank
    rows = {"x": [], "scales": [], "topk": [], "weights": [], "src": []}
    for s in range(w.num_ranks):
        for t in range(w.xs[s].size(0)):
            if rank not in w.dest_ranks(s, t):
                continue
            ids = [e - lo if lo <= e < lo + per else -1 for e in w.topks[s][t].tolist()]
            rows["x"].append(w.xs[s][t])
            if w.scales[s] is not None:
                rows["scales"].append(w.scales[s][t])
            rows["topk"].append(ids)
            rows["weights"].append([float(v) if i >= 0 else 0.0 for v, i in zip(w.weights[s][t].tolist(), ids)])
            rows["src"].append((s, t))
    return rows


def expected_expert_major(w: World, rank: int, alignment: int) -> dict:
    """Expert-major rows: per local expert, the received rows that selected it (received order), zero-padded."""
    recv = expected_receive(w, rank)
    hidden = w.xs[0].size(1)
    out = {"x": [], "expert": [], "weights": [], "counts": []}
    for e in range(w.experts_per_rank):
        n = 0
        for i, ids in enumerate(recv["topk"]):
            if e in ids:
                out["x"].append(recv["x"][i])
                out["expert"].append(e)
                out["weights"].append(recv["weights"][i][ids.index(e)])
                n += 1
        padded = -(-n // alignment) * alignment
        for _ in range(padded - n):
            out["x"].append(torch.zeros(hidden, dtype=w.xs[0].dtype))
            out["expert"].append(-1)
            out["weights"].append(0.0)
        out["counts"].append(padded)
    return out


def expected_combine(w: World, rank: int, copy_scale: Callable[[int, int], float], expert_major: bool = False):
    """combined[t] = sum over copies of x[t] * scale; a copy is (destination d) or, expert-major, (d, local expert e).
    copy_scale(d, e) with e = -1 for rank-major. Also the combined weights (sum of the local slots' weights)."""
    x = w.xs[rank].double()
    out = torch.zeros_like(x)
    weights = torch.zeros(w.topks[rank].shape, dtype=torch.float64)
    for t in range(x.size(0)):
        for d in w.dest_ranks(rank, t):
            if expert_major:
                for e in w.topks[rank][t].tolist():
                    if e >= 0 and e // w.experts_per_rank == d:
                        out[t] += x[t] * copy_scale(d, e % w.experts_per_rank)
            else:
                out[t] += x[t] * copy_scale(d, -1)
        for k, e in enumerate(w.topks[rank][t].tolist()):
            if e >= 0:
                weights[t, k] = float(w.weights[rank][t, k])
    return out, weights


def expected_traffic(w: World, rank: int, dispatch_row_bytes: int, combine_row_bytes: int) -> dict:
    """Bytes rank `rank` sends in hierarchical dispatch and combine, from first principles:
    source -> rail-aligned forwarder of each other node (network), forwarder -> other ranks of its node (NVLink);
    combine: holder -> forwarder (NVLink), forwarder -> source of another node (network)."""
    g = w.ranks_per_node
    node, local = divmod(rank, g)
    d_net = d_nvl = c_net = c_nvl = logical = 0
    for s in range(w.num_ranks):
        s_node, s_local = divmod(s, g)
        for t in range(w.xs[s].size(0)):
            dests = w.dest_ranks(s, t)
            if rank in dests:
                logical += 1
            for n in sorted({d // g for d in dests}):
                forwarder = n * g + s_local
                in_node = [d for d in dests if d // g == n]
                if s == rank and n != s_node:
                    d_net += 1
                if forwarder == rank:
                    d_nvl += sum(1 for d in in_node if d != rank)
                    if n != s_node:
                        c_net += 1
                if rank in in_node and rank != forwarder:
                    c_nvl += 1
    return {"dispatch": (d_nvl * dispatch_row_bytes, d_net * dispatch_row_bytes, logical * dispatch_row_bytes),
            "combine": (c_nvl * combine_row_bytes, c_net * combine_row_bytes, logical * combine_row_bytes)}
