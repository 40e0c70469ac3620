"""Copy-engine probe on GPUs 0 and 1 of one process (58.7 MB, the peer payload of one DeepSeek-V3 combine at EP=2):
a copy within GPU 0, one peer copy, the same in 4 MiB chunks, and the chunks each followed by a one-element kernel or
by an 8-byte peer copy (flag candidates of the copy-engine combine). Prints microseconds and GB/s.
Usage: python scripts/probe_copy_engine.py

Torch's cross-device copies also synchronize with the other device's current stream, so the chunked lines carry
that cost too. Both directions at once are measured where it matters, inside `bench dispatch --profile` (the
combine's `Memcpy PtoP` rows), not here."""
import torch

N = 4096 * 7168 * 2
CHUNK = 4 << 20


def timed(stream, fn, iters=10):
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    with torch.cuda.stream(stream):
        for _ in range(iters):
            fn()
    b.record(stream)
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def main():
    torch.cuda.set_device(0)
    src = torch.empty(N, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(N, dtype=torch.uint8, device="cuda:1")
    flag0 = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    flag1 = torch.zeros(1, dtype=torch.int64, device="cuda:1")
    s0 = torch.cuda.Stream(device=0)
    chunks = range(0, N, CHUNK)

    def one():
        dst.copy_(src, non_blocking=True)

    def chunked(signal=None):
        def f():
            for c in chunks:
                dst[c:c + CHUNK].copy_(src[c:c + CHUNK], non_blocking=True)
                if signal == "kernel":
                    flag0.fill_(c)
                elif signal == "copy":
                    flag1.copy_(flag0, non_blocking=True)
        return f

    local = torch.empty(N, dtype=torch.uint8, device="cuda:0")

    def local_copy():  # a copy within GPU 0 (cudaMemcpyAsync device to device: a copy engine, no SM)
        local.copy_(src, non_blocking=True)

    for name, fn in (("local copy (same GPU)", local_copy), ("one copy", one), ("4 MiB chunks", chunked()),
                     ("chunks + kernel", chunked("kernel")), ("chunks + 8-byte copy", chunked("copy"))):
        us = timed(s0, fn)
        print(f"{name:24s} {us:8.1f} us {N / us / 1e3:6.1f} GB/s")


if __name__ == "__main__":
    main()
