"""The internode expert_major_receive kernel alone on one GPU at the 2 x 2 bench's shape (per rank ~14.7k final rows of
14 KB, top-8 of 256 experts, 64 local, 4 sources): its time by grid and mode, beside a torch gather of the same rows
and a plain copy of the same bytes (the roofline). Run on a GPU machine: `python3 scripts/bench_expert_major_receive.py`
(docs/benchmarks/internode-2xh200.md, "Session 46"); a check of its outputs comes first."""
import torch

from uccl_ep_train import native
from uccl_ep_train.bench.dispatcher import _time

k = native.module().internode
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
g = torch.Generator(device=dev).manual_seed(1)
n, K, L, R, E, xb = 14700, 8, 64, 4, 256, 14336
ids_off, w_off, rk_off, si_off = xb, xb + 64, xb + 96, xb + 128
stride = xb + 144
scores = torch.rand(n, E, device=dev, generator=g)
ids = scores.topk(K, dim=1).indices  # global ids; ours are 0..63
none = ~(ids < L).any(1)
ids[none, 0] = torch.randint(0, L, (int(none.sum()),), device=dev, generator=g)
src_of = torch.arange(n, device=dev) * R // n  # 4 sources in row order
source_rows = torch.tensor([(s * n + R - 1) // R for s in range(R)] + [n], device=dev, dtype=torch.int64)
src_of = torch.searchsorted(source_rows, torch.arange(n, device=dev), right=True) - 1
local = ids < L
key = torch.where(local, src_of[:, None] * L + ids, -1).flatten()  # pairs in (row, k) order
ranks = torch.full_like(key, -1)
valid = key >= 0
kv = key[valid]
order = torch.sort(kv, stable=True).indices
counts = torch.bincount(kv, minlength=R * L)
start = torch.cumsum(counts, 0) - counts
pos = torch.empty_like(kv)
pos[order] = torch.arange(kv.numel(), device=dev) - start[kv[order]]
ranks[valid] = pos
ranks = ranks.view(n, K).to(torch.int32)
per_e = counts.view(R, L)
seg = torch.cumsum(per_e.sum(0), 0) - per_e.sum(0)
first = seg[None, :] + torch.cumsum(per_e, 0) - per_e
places = torch.stack([first, per_e], -1).contiguous().to(torch.int64)  # [R, L, 2]
P = int(per_e.sum())
rec = torch.randint(0, 255, (n, stride), dtype=torch.uint8, device=dev, generator=g)
rec[:, ids_off:ids_off + 64] = ids.to(torch.int64).contiguous().view(torch.uint8).view(n, 64)
rec[:, rk_off:rk_off + 32] = ranks.contiguous().view(torch.uint8).view(n, 32)
out = torch.empty(P, xb, dtype=torch.uint8, device=dev)
slot_of = torch.empty(n, K, dtype=torch.int32, device=dev)
tok, slot, exp = (torch.empty(P, dtype=torch.int64, device=dev) for _ in range(3))
wts = torch.empty(P, dtype=torch.float32, device=dev)
src_idx = torch.empty(n, dtype=torch.int64, device=dev)
words = torch.full((n,), 5, dtype=torch.int32, device=dev)
s = torch.cuda.current_stream().cuda_stream
print(f"rows {n}, expert-major rows {P}, bytes read {n * xb / 1e6:.0f} MB, written {P * xb / 1e6:.0f} MB", flush=True)


def receive(ready_blocks=0):
    kw = {}
    if ready_blocks:
        kw = dict(ready_words=words.data_ptr(), ready_epoch=5, ready_timeout_secs=5.0, ready_blocks=ready_blocks)
    k.expert_major_receive(rec.data_ptr(), stride, n, 0, xb, 0, 0, out.data_ptr(), 0, P, K, False, slot_of.data_ptr(),
                           ids_off, w_off, rk_off, 0, L, R, source_rows.data_ptr(), places.data_ptr(), tok.data_ptr(),
                           slot.data_ptr(), exp.data_ptr(), wts.data_ptr(), si_off, src_idx.data_ptr(), -1, 0, s, **kw)


def cached():
    k.expert_major_receive(rec.data_ptr(), stride, n, 0, xb, 0, 0, out.data_ptr(), 0, P, K, True, slot_of.data_ptr(),
                           -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, si_off, 0, -1, 0, s)


def timed(fn):
    return _time(torch, fn, 1, 20)  # us a call


receive()
torch.cuda.synchronize()
# check: every pair's row holds its payload
r_, k_ = (slot_of >= 0).nonzero(as_tuple=True)
if r_.numel() != P or not torch.equal(out[slot_of[r_, k_].long()], rec[r_, :xb]):
    raise SystemExit("expert_major_receive: a pair's row does not hold its payload")
print("uncached receive correct: every one of", P, "pairs' rows holds its payload", flush=True)
print(f"uncached, full grid (4 warps a row): {timed(receive):.0f} us", flush=True)
print(f"cached (slots given), full grid: {timed(cached):.0f} us", flush=True)
for rb in (64, 128, 256, 512, 1024, 4096):
    print(f"uncached, ready words, ready_blocks {rb} ({max(1, rb // 4)} blocks of 1024, 1 warp a row): "
          f"{timed(lambda: receive(rb)):.0f} us", flush=True)
rows_idx = r_
dst_idx = slot_of[r_, k_].long()
print(f"torch gather out[dst] = rec[r, :xb]: {timed(lambda: out.index_copy_(0, dst_idx, rec[rows_idx, :xb])):.0f} us")
big_src = torch.empty(P * xb, dtype=torch.uint8, device=dev)
big_dst = torch.empty_like(big_src)
print(f"plain copy of the written bytes: {timed(lambda: big_dst.copy_(big_src)):.0f} us")
