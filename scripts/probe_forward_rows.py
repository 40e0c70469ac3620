"""Probe: the dispatch forward's kernel on one GPU, one launch for every local GPU (forward_rows) against a
scatter_rows launch per local GPU as the code did until session 32 (with each GPU's index column copied out first).

The destinations are areas in this GPU's own memory: one GPU has no NVLink peers, so this times the launches and
the reads of each arrival (once, against once per GPU that needs it), not the NVLink writes, which both ways make
alike. Shape by default: a forwarder of 2 nodes x 8 GPUs at DeepSeek-V3 shape (about 4000 arrivals of 14464-byte
final rows; a token's top-8 of 256 experts reach ~3.3 of the node's 8 GPUs, so each GPU needs ~40% of the rows).

    python scripts/probe_forward_rows.py [--arrivals 4000] [--row-bytes 14464] [--gpus 8] [--density 0.4]
"""

import argparse
import functools
import json
import operator
import statistics

import torch

from uccl_ep_train import native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arrivals", type=int, default=4000)
    p.add_argument("--row-bytes", type=int, default=14464)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--density", type=float, default=0.4, help="share of the arrivals each GPU needs")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    A, B, G = args.arrivals, args.row_bytes, args.gpus
    k = native.module().internode
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev).cuda_stream
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (A, B), dtype=torch.uint8, generator=gen).to(dev)
    idx = torch.stack([torch.where(torch.rand(A, generator=gen) < args.density, torch.randperm(A, generator=gen),
                                   torch.tensor(-1)) for _ in range(G)], 1).to(dev)
    limits = torch.full((G,), A, dtype=torch.int64, device=dev)

    def areas():
        return [torch.zeros((A, B), dtype=torch.uint8, device=dev) for _ in range(G)]

    fused_out, split_out = areas(), areas()
    targets = torch.tensor([d.data_ptr() for d in fused_out], dtype=torch.int64, device=dev)
    bases_or = functools.reduce(operator.or_, (d.data_ptr() for d in fused_out))

    def fused():
        k.forward_rows(targets.data_ptr(), bases_or, B, idx.data_ptr(), G, src.data_ptr(), B, A, B, limits.data_ptr(),
                       stream)

    def per_gpu():  # as _move did: each GPU's index column copied out, then its scatter
        for j in range(G):
            col = idx[:, j].contiguous()
            k.scatter_rows(split_out[j].data_ptr(), B, col.data_ptr(), src.data_ptr(), B, 0, A, B, stream,
                           dst_rows=A)

    fused()
    per_gpu()
    torch.cuda.synchronize(dev)
    same = all(torch.equal(a, b) for a, b in zip(fused_out, split_out))

    def timed(fn):
        times = []
        for _ in range(args.iters):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) * 1e3)
        return statistics.median(times)

    nnz = int((idx >= 0).sum())
    needed = int((idx >= 0).any(1).sum())  # rows some GPU needs: the others are not read
    fused_us, per_gpu_us = timed(fused), timed(per_gpu)
    print(json.dumps({
        "device": torch.cuda.get_device_name(dev), "arrivals": A, "row_bytes": B, "gpus": G,
        "rows_written": nnz, "outputs_equal": same,
        "forward_rows_us": round(fused_us, 1), "scatter_per_gpu_us": round(per_gpu_us, 1),
        "forward_rows_bytes_read": needed * B, "scatter_per_gpu_bytes_read": nnz * B, "bytes_written": nnz * B,
        "forward_rows_launches": 1, "scatter_per_gpu_launches": 2 * G}, indent=1))
    if not same:
        raise SystemExit("forward_rows and the scatters per GPU wrote different rows")


if __name__ == "__main__":
    main()
