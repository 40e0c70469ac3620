"""Copy-engine probe between GPU 0 and GPU 1 of one process: a 58.7 MB copy within GPU 0, one 58.7 MB peer copy, the same in 4 MiB chunks, each
chunk followed by a one-element kernel or by an 8-byte peer copy (the flag of the copy-engine combine), and both
directions at once. Prints microseconds and GB/s. Usage: python scripts/probe_copy_engine.py"""
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
    src = [torch.empty(N, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    dst = [torch.empty(N, dtype=torch.uint8, device=f"cuda:{d}") for d in (1, 0)]
    flag0 = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    flag1 = torch.zeros(1, dtype=torch.int64, device="cuda:1")
    s0 = torch.cuda.Stream(device=0)
    chunks = range(0, N, CHUNK)

    def one():
        dst[0].copy_(src[0], non_blocking=True)

    def chunked(signal=None):
        def f():
            for c in chunks:
                dst[0][c:c + CHUNK].copy_(src[0][c:c + CHUNK], non_blocking=True)
                if signal == "kernel":
                    flag0.fill_(c)
                elif signal == "copy":
                    flag1.copy_(flag0, non_blocking=True)
        return f

    local = torch.empty(N, dtype=torch.uint8, device="cuda:0")

    def local_copy():  # a copy within GPU 0 (cudaMemcpyAsync device to device: a copy engine, no SM)
        local.copy_(src[0], non_blocking=True)

    for name, fn in (("local copy (same GPU)", local_copy), ("one copy", one), ("4 MiB chunks", chunked()), ("chunks + kernel", chunked("kernel")),
                     ("chunks + 8-byte copy", chunked("copy"))):
        us = timed(s0, fn)
        print(f"{name:24s} {us:8.1f} us {N / us / 1e3:6.1f} GB/s")
    # both directions at once, each from its own GPU's stream
    s1 = torch.cuda.Stream(device=1)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s0)
    s1.wait_event(a)
    for _ in range(10):
        with torch.cuda.stream(s0):
            dst[0].copy_(src[0], non_blocking=True)
        with torch.cuda.stream(s1):
            dst[1].copy_(src[1], non_blocking=True)
    done = torch.cuda.Event()
    done.record(s1)
    s0.wait_event(done)
    b.record(s0)
    torch.cuda.synchronize()
    us = a.elapsed_time(b) * 1000 / 10
    print(f"{'both directions':24s} {us:8.1f} us {N / us / 1e3:6.1f} GB/s each way")


if __name__ == "__main__":
    main()
