"""Which torch calls, made by the main thread while a kernel runs, hold up a CUDA call that another host thread (the
loopback proxy) makes meanwhile. The kernel here is torch.cuda._sleep (3 s); a call that holds the other thread's
copy until the kernel ends would, behind one of our spinning waits, stall it until its deadline (docs/internode.md,
"Drains"). Each call is made once before it is timed, so lazy module loading is out of it. Run on a GPU machine:
python3 scripts/probe_blocking_torch_calls.py;
CUDA_MODULE_LOADING=EAGER python3 scripts/probe_blocking_torch_calls.py"""
import threading
import time

import numpy as np
import torch


def cycles_per_second() -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(100_000_000)
        b.record()
    b.synchronize()
    return 100_000_000 / (a.elapsed_time(b) / 1e3)


def main() -> None:
    dev = torch.device("cuda")
    spin_s, proxy_after_s = 3.0, 0.3
    cps = cycles_per_second()
    small = torch.arange(1024, device=dev)
    proxy_stream = torch.cuda.Stream()
    src, dst = torch.ones(1024, device=dev), torch.empty(1024, device=dev)
    blob = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    calls = {
        "nothing (poll the stream)": lambda: None,
        "x.cpu()": lambda: small.cpu(),
        "x.tolist()": lambda: small.tolist(),
        "x.sum().item()": lambda: small.sum().item(),
        "torch.nonzero(x)": lambda: torch.nonzero(small),
        "torch.empty 512 MiB (new segment)": lambda: torch.empty(512 << 20, dtype=torch.uint8, device=dev),
        "numpy -> .to(cuda, non_blocking=True)": lambda: torch.from_numpy(np.arange(4096)).to(dev, non_blocking=True),
        "torch.empty(pin_memory=True) 64 MiB": lambda: torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True),
        "cpu tensor .pin_memory()": lambda: torch.arange(4096).pin_memory(),
        "torch.cuda.Stream()": lambda: torch.cuda.Stream(),
        "torch.cuda.Event().record()": lambda: torch.cuda.Event().record(),
        "torch.cuda.empty_cache()": torch.cuda.empty_cache,
        "torch.cuda.synchronize()": torch.cuda.synchronize,
    }
    main_stream = torch.cuda.Stream()
    warm = threading.Thread(target=lambda: dst.copy_(src))  # the thread's first CUDA call sets its device up
    warm.start()
    warm.join(30)
    for name, call in calls.items():
        if name != "torch.cuda.empty_cache()":  # once before: a first launch loads its kernels' module (lazy loading)
            call()
        torch.cuda.synchronize()
        took = {}

        def proxy(took: dict = took) -> None:
            time.sleep(proxy_after_s)
            t = time.monotonic()
            with torch.cuda.stream(proxy_stream):
                dst.copy_(src, non_blocking=True)  # the proxy's "network write"
            took["call"] = time.monotonic() - t

        t0 = time.monotonic()
        with torch.cuda.stream(main_stream):
            torch.cuda._sleep(int(spin_s * cps))
            th = threading.Thread(target=proxy)
            th.start()
            time.sleep(proxy_after_s / 2)
            keep = call()  # (kept alive across the wait: a freed block would be reused, not returned)
            back = time.monotonic() - t0
        th.join(30)
        if th.is_alive():
            raise TimeoutError(f"{name}: the proxy thread's copy did not return within 30 s")
        torch.cuda.synchronize()
        stalled = took["call"] > 1.0
        print(f"{name:42s} main back at {back * 1e3:7.1f} ms; proxy's copy call took {took['call'] * 1e3:7.1f} ms"
              f"{'   <-- HOLDS OTHER THREADS' if stalled else ''}", flush=True)
        del keep
    del blob


if __name__ == "__main__":
    main()
