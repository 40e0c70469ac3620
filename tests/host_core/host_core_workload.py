"""Multi-process workload for the host-core tests: ranks in separate processes, connected over loopback through a
gloo process group, pushing random write+signal commands from native producer threads, checked against a
sequential model. Spawned by test_multiprocess.py (kept importable for `spawn`)."""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import numpy as np

SEND_BYTES = 256 << 10       # each rank's source area (random bytes)
CHUNK = 256                  # largest write; a stream owns CHUNKS chunks in every destination
CHUNKS = 64
SLOTS_PER_STREAM = 4


def layout(world: int, fifos: int) -> dict:
    streams = world * fifos
    return {"recv_base": SEND_BYTES, "stream_bytes": CHUNKS * CHUNK,
            "data_bytes": SEND_BYTES + streams * CHUNKS * CHUNK, "streams": streams}


def send_area(seed: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, rank, 7]).integers(0, 256, SEND_BYTES, dtype=np.uint8)


def stream_plan(seed: int, world: int, fifos: int, src: int, fifo: int, n: int, epoch: int) -> dict:
    """The commands one FIFO pushes, as arrays. Within an epoch every (dst, chunk) is written at most once; a quiet
    closes each epoch, so the final bytes of a chunk are fixed by command order even on an unordered transport."""
    rng = np.random.default_rng([seed, src, fifo, 11])
    lay = layout(world, fifos)
    stream = src * fifos + fifo
    epochs = -(-n // epoch)
    pairs = np.argsort(rng.random((epochs, world * CHUNKS)), axis=1)[:, :epoch].reshape(-1)[:n]
    dst, chunk = pairs // CHUNKS, pairs % CHUNKS
    nbytes = 16 * rng.integers(1, CHUNK // 16 + 1, n)
    local = 16 * ((rng.integers(0, SEND_BYTES // 16, n)) % ((SEND_BYTES - nbytes) // 16 + 1))
    remote = lay["recv_base"] + stream * lay["stream_bytes"] + chunk * CHUNK
    slot = stream * SLOTS_PER_STREAM + rng.integers(0, SLOTS_PER_STREAM, n)
    value = rng.integers(0, 8, n)
    big = rng.random(n) < 0.002
    value[big] = rng.integers(256, 4096, int(big.sum()))
    value[rng.integers(0, n, 2)] = (1 << 18) - 1           # the largest increment: many split immediates
    atomic = rng.random(n) < 0.01                           # signed atomics on the same slots
    atomic_add = rng.integers(-1000, 1000, n)
    return {"dst": dst, "bytes": nbytes, "local": local, "remote": remote, "slot": slot, "value": value,
            "atomic": atomic, "atomic_add": atomic_add, "epoch": epoch}


def encode_plan(C, plan: dict) -> np.ndarray:
    n = len(plan["dst"])
    writes = C.command.encode_writes(plan["dst"].astype(np.uint64), plan["bytes"].astype(np.uint64),
                                     plan["local"].astype(np.uint64), plan["remote"].astype(np.uint64),
                                     plan["slot"].astype(np.uint64), plan["value"].astype(np.int64))
    for i in np.nonzero(plan["atomic"])[0]:
        writes[i] = C.command.atomic(int(plan["dst"][i]), int(plan["slot"][i]), int(plan["atomic_add"][i]))
    epoch = plan["epoch"]
    epochs = -(-n // epoch)
    out = np.zeros((n + epochs, 2), dtype=np.uint64)
    pos = np.arange(n) + np.arange(n) // epoch                      # leave a gap after every epoch
    out[pos] = writes
    quiet = C.command.quiet()
    out[np.arange(1, epochs + 1) * (epoch + 1) - 1 if n % epoch == 0 else
        np.append(np.arange(1, epochs) * (epoch + 1) - 1, n + epochs - 1)] = quiet
    return out


def expected_state(seed: int, world: int, fifos: int, me: int, n: int, epoch: int, num_slots: int):
    """Sequential model of this rank's data buffer (receive area) and signal counters."""
    lay = layout(world, fifos)
    data = np.zeros(lay["data_bytes"], dtype=np.uint8)
    counters = np.zeros(num_slots, dtype=np.int64)
    for src in range(world):
        send = send_area(seed, src)
        for f in range(fifos):
            p = stream_plan(seed, world, fifos, src, f, n, epoch)
            mine = p["dst"] == me
            add = np.where(p["atomic"], p["atomic_add"], p["value"])
            np.add.at(counters, p["slot"][mine], add[mine])
            w = mine & ~p["atomic"]
            for lo, ro, b in zip(p["local"][w].tolist(), p["remote"][w].tolist(), p["bytes"][w].tolist()):
                data[ro:ro + b] = send[lo:lo + b]
    return data, counters


def _init(rank: int, world: int, port: int):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=120))
    return dist


def run_exact(rank: int, world: int, port: int, cfg: dict, out) -> None:
    """Push cfg['n'] commands per FIFO, then check every byte and counter of this rank against the model."""
    try:
        from uccl_ep_train import _C, comm
        from uccl_ep_train.settings import load_settings

        dist = _init(rank, world, port)
        fifos = cfg["num_threads"] * cfg["fifos_per_thread"]
        lay = layout(world, fifos)
        s = load_settings(cfg["env"])
        c = comm.HostComm(lay["data_bytes"], rank, world, settings=s, num_signal_slots=cfg["num_signal_slots"],
                          num_threads=cfg["num_threads"], fifos_per_thread=cfg["fifos_per_thread"])
        c.data()[:SEND_BYTES] = send_area(cfg["seed"], rank)
        c.connect()
        cmds = [encode_plan(_C, stream_plan(cfg["seed"], world, fifos, rank, f, cfg["n"], cfg["epoch"]))
                for f in range(fifos)]
        dist.barrier()
        t0 = time.time()
        errors: list[BaseException] = []

        def produce(f: int) -> None:
            try:
                if cfg.get("producer") == "device":  # slot by slot, as a kernel writes them (Fifo.push_as_device)
                    for cmd in cmds[f]:
                        c.proxy.fifo_push_as_device(f, (int(cmd[0]), int(cmd[1])))
                    last = c.proxy.fifo_push_as_device(f, _C.command.quiet())
                else:
                    c.push_array(f, cmds[f])
                    last = c.push(f, _C.command.quiet())
                c.proxy.wait_done(f, last)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                errors.append(e)

        threads = [threading.Thread(target=produce, args=(f,)) for f in range(fifos)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        push_secs = time.time() - t0
        dist.barrier()  # every rank's writes completed locally, i.e. landed
        want_data, want_counters = expected_state(cfg["seed"], world, fifos, rank, cfg["n"], cfg["epoch"],
                                                  cfg["num_signal_slots"])
        deadline = time.time() + 60
        while not np.array_equal(c.signals(), want_counters):
            c.check()
            if time.time() > deadline:
                bad = np.nonzero(c.signals() != want_counters)[0][:5]
                raise AssertionError(f"rank {rank}: counters {bad.tolist()} are {c.signals()[bad].tolist()}, "
                                     f"expected {want_counters[bad].tolist()}")
            time.sleep(0.001)
        got = c.data()[SEND_BYTES:]
        want = want_data[SEND_BYTES:]
        mismatch = np.nonzero(got != want)[0]
        c.check()
        stats = c.stats()
        dist.barrier()
        c.close()
        out.put({"rank": rank, "ok": True, "mismatch": int(mismatch.size),
                 "first_mismatch": int(mismatch[0]) + SEND_BYTES if mismatch.size else -1,
                 "stats": stats, "push_secs": push_secs, "caps": c.proxy.caps,
                 "options": {k: c.options[k] for k in ("max_inflight_writes", "max_inflight_bytes")}})
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        out.put({"rank": rank, "ok": False, "error": traceback.format_exc()})


def run_killed_peer(rank: int, world: int, port: int, cfg: dict, out) -> None:
    """Rank cfg['victim'] SIGKILLs itself mid-stream; every other rank must raise (not hang) within the deadline."""

    def report_and_exit(msg: dict, code: int = 0) -> None:
        out.put(msg)
        out.close()
        out.join_thread()  # os._exit would drop a message still in the queue's feeder thread
        os._exit(code)  # skip gloo teardown: a member is dead

    try:
        from uccl_ep_train import _C, comm
        from uccl_ep_train.settings import load_settings

        dist = _init(rank, world, port)
        fifos = cfg["num_threads"] * cfg["fifos_per_thread"]
        lay = layout(world, fifos)
        c = comm.HostComm(lay["data_bytes"], rank, world, settings=load_settings(cfg["env"]),
                          num_signal_slots=cfg["num_signal_slots"], num_threads=cfg["num_threads"],
                          fifos_per_thread=cfg["fifos_per_thread"])
        c.connect()
        cmds = encode_plan(_C, stream_plan(cfg["seed"], world, fifos, rank, 0, cfg["n"], cfg["epoch"]))
        dist.barrier()
        if rank == cfg["victim"]:
            c.push_array(0, cmds[: len(cmds) // 4])
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.time()
        try:
            while True:  # keep streaming until the proxy reports the dead peer
                c.push_array(0, cmds)
                if time.time() - t0 > cfg["give_up_secs"]:
                    report_and_exit({"rank": rank, "ok": False, "error": "no error raised before give_up_secs"})
        except Exception as e:  # noqa: BLE001
            report_and_exit({"rank": rank, "ok": True, "type": type(e).__name__, "message": str(e),
                             "secs": time.time() - t0})
    except BaseException:  # noqa: BLE001
        report_and_exit({"rank": rank, "ok": False, "error": traceback.format_exc()}, 1)
