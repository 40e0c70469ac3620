"""`uccl-ep-train doctor`: find the environment problems that break GPU-proxy expert parallelism before a job does.

Each check passes, warns or fails and says the fix. Exit codes (documented in docs/troubleshooting.md):
  0  no check failed (warnings may be present; --strict turns them into failures)
  1  at least one check failed
  2  doctor could not run (bad arguments, or --all-ranks outside a distributed job)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from uccl_ep_train import topology as topo_mod

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
JSON_VERSION = 1

# Appended to every timeout error in dispatch/combine and the proxies: what to look at, and where to start.
TIMEOUT_HINT = (
    "What to inspect: the rank/channel/counter named above and the value it waited for; whether every rank reached "
    "the same dispatch/combine call (a rank that crashed or skipped one stalls all others); the proxy threads' "
    "liveness (UCCL_EP_CPU_TIMEOUT_SECS, UCCL_EP_GPU_TIMEOUT_SECS). Then run `uccl-ep-train doctor` on every node "
    "(`torchrun ... -m uccl_ep_train doctor --all-ranks` shows what differs between nodes): a wrong GID index, "
    "missing peer-memory module or mismatched UCCL_IB_*/NCCL_IB_* settings are the usual causes. "
    "See docs/troubleshooting.md.")


def timeout_hint(what: str = "") -> str:
    """TIMEOUT_HINT, optionally prefixed with what timed out (for error messages built elsewhere)."""
    return f"{what}. {TIMEOUT_HINT}" if what else TIMEOUT_HINT


@dataclass
class Check:
    name: str
    status: str          # "pass", "warn", "fail"
    detail: str
    fix: str = ""


# ---------------------------------------------------------------------------------------------- host probes
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _module_loaded(sysfs_root: str, name: str) -> bool:
    return os.path.isdir(os.path.join(sysfs_root, "module", name))


def _kernel_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _native():
    try:
        from uccl_ep_train import native
        return native.module(), ""
    except Exception as exc:  # noqa: BLE001 - report whatever stops the import
        return None, str(exc)


def _cuda_arch_of_host() -> Optional[str]:
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return f"{major}{minor}"
    except Exception:  # noqa: BLE001
        return None
    return None


def kernels_run_on(archs: str, host_arch: str) -> bool:
    """Whether a build for ``archs`` (the module's list: "90", "90a;100") has code for a GPU of compute capability
    ``host_arch`` ("90"): an entry of that number, with or without its variant suffix -- sm_90a code is the 9.0 GPU's
    own, with the Hopper-only instructions (a build from TORCH_CUDA_ARCH_LIST="9.0a" on an H100 or H200)."""
    numbers = {re.match(r"\d*", a).group() for a in re.split(r"[;, ]+", archs) if a}
    return host_arch in numbers


# ---------------------------------------------------------------------------------------------- checks
class Doctor:
    def __init__(self, sysfs_root: str = "/sys", env: Optional[dict] = None, use_tools: Optional[bool] = None,
                 kernel: Optional[tuple[int, int]] = None):
        self.sysfs_root = sysfs_root
        self.env = dict(os.environ if env is None else env)
        self.real_host = os.path.realpath(sysfs_root) == "/sys"
        # (major, minor) of the kernel the checks judge: this host's for /sys; unknown (None) for a recorded sysfs tree
        # unless given, and then the kernel-dependent checks that need it are skipped.
        self.kernel = kernel if kernel is not None else (_kernel_version() if self.real_host else None)
        self.topo = topo_mod.discover(sysfs_root, use_tools)
        self.checks: list[Check] = []
        self.settings = None
        self.plans: list[topo_mod.GpuPlan] = []

    def add(self, name, status, detail, fix=""):
        self.checks.append(Check(name, status, detail, fix))

    def run(self) -> list[Check]:
        steps: list[Callable[[], None]] = [self.check_settings, self.check_gpus, self.check_nics, self.check_native,
                                           self.check_verbs_library, self.check_registration, self.check_fork_safety,
                                           self.check_gids,
                                           self.check_nccl_consistency, self.check_proxy_cpus, self.check_selftest,
                                           self.check_loopback_queues]
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the other checks
                self.add(step.__name__.replace("check_", ""), "fail", f"the check itself failed: {exc!r}",
                         "report this with the output of `uccl-ep-train doctor --json`")
        return self.checks

    def check_settings(self):
        from uccl_ep_train.settings import SettingsError, load_settings
        try:
            self.settings = load_settings(self.env)
        except SettingsError as exc:
            self.add("settings", "fail", str(exc), "fix or unset the variable named above")
            return
        changed = self.settings.to_env()
        self.add("settings", "pass", "UCCL_* settings valid" + (
            ": " + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) if changed else " (all defaults)"))

    def check_gpus(self):
        gpus = self.topo.gpus
        if not gpus:
            self.add("gpus", "warn", "no GPU found (PCI scan of NVIDIA/AMD display and accelerator devices"
                     f" under {self.sysfs_root}); dispatch/combine need one, the host core and tests do not",
                     "run on a GPU node, or check the GPU driver (nvidia-smi / rocm-smi)")
            return
        kinds = sorted({g.vendor for g in gpus})
        links = "NVLink/xGMI peers known" if any(g.peers for g in gpus) else "NVLink/xGMI not discovered"
        self.add("gpus", "pass", f"{len(gpus)} {'/'.join(kinds)} GPU(s) ({self.topo.sources['gpus']}); "
                 f"NUMA nodes {sorted({g.numa_node for g in gpus})}; {links}")

    def check_nics(self):
        nics = self.topo.nics
        transport = self.settings.transport.transport if self.settings else "auto"
        if not nics:
            status = "fail" if transport == "verbs" else "warn"
            self.add("rdma_nics", status, f"no RDMA device under {self.sysfs_root}/class/infiniband: only the "
                     "loopback transport (one host) can run",
                     "load the NIC's RDMA driver (mlx5_ib, bnxt_re, ionic_rdma, efa) or, for a single-host run, set "
                     "UCCL_EP_TRANSPORT=loopback" if status == "fail" else "")
            return
        down = [n.name for n in nics if not n.active]
        kinds = "EFA" if self.topo.has_efa else "/".join(sorted({p.link_layer for n in nics for p in n.ports}))
        detail = f"{len(nics)} RDMA device(s), {kinds}: " + ", ".join(
            f"{n.name} ({n.rate_gbps:g} Gb/s, NUMA {n.numa_node})" for n in nics)
        if down:
            self.add("rdma_nics", "warn", detail + f"; not ACTIVE: {', '.join(down)}",
                     "check cables/switch ports (`ibv_devinfo`), or exclude them with UCCL_IB_HCA=^name")
        else:
            self.add("rdma_nics", "pass", detail)
        hca = self.settings.transport.ib_hca if self.settings else ()
        try:
            self.plans = topo_mod.plan(self.topo, hca, -1)
        except ValueError:
            self.plans = []
        if self.topo.gpus:
            lines = [f"GPU{p.gpu} -> {','.join(p.nics) or 'none'}" for p in self.plans]
            self.add("gpu_nic_affinity", "pass" if all(p.nics for p in self.plans) else "warn",
                     "; ".join(lines) or "no GPU", "" if all(p.nics for p in self.plans) else
                     "UCCL_IB_HCA excludes every NIC near some GPU; widen it")

    def check_native(self):
        mod, why = _native()
        if mod is None:
            self.add("native_build", "fail", why, "pip install -e . (needs a C++17 compiler, CMake and pybind11)")
            return
        backend = getattr(mod, "gpu_backend", "NONE")
        archs = getattr(mod, "cuda_archs", "")
        with_verbs = getattr(mod, "with_verbs", False)
        with_efadv = getattr(mod, "with_efadv", False)
        desc = f"GPU backend {backend}{' sm_' + archs if archs else ''}, verbs {'on' if with_verbs else 'off'}, " \
               f"EFA {'on' if with_efadv else 'off'}"
        problems, fixes = [], []
        vendors = {g.vendor for g in self.topo.gpus}
        if "nvidia" in vendors and backend != "CUDA":
            problems.append("NVIDIA GPUs but no CUDA kernels")
            fixes.append("rebuild where nvcc is found (UCCL_EP_WITH_GPU=CUDA)")
        if "amd" in vendors and backend != "HIP":
            problems.append("AMD GPUs but no HIP kernels")
            fixes.append("rebuild with ROCm's hipcc (UCCL_EP_WITH_GPU=HIP)")
        host_arch = _cuda_arch_of_host() if self.real_host and backend == "CUDA" else None
        if host_arch and archs and not kernels_run_on(archs, host_arch):
            problems.append(f"this GPU is sm_{host_arch}, kernels are built for sm_{archs}")
            fixes.append(f"rebuild with UCCL_EP_CUDA_ARCHS={host_arch} (or TORCH_CUDA_ARCH_LIST)")
        if self.topo.nics and not with_verbs:
            problems.append("RDMA NICs present but the verbs transport was not built")
            fixes.append("apt install libibverbs-dev (rdma-core) and rebuild")
        if self.topo.has_efa and not with_efadv:
            problems.append("EFA NICs present but the build lacks EFA (efadv) support")
            fixes.append("install rdma-core's headers with efadv.h (libibverbs-dev >= 27 / the EFA installer) and "
                         "rebuild")
        if problems:
            self.add("native_build", "fail", desc + "; " + "; ".join(problems), "; ".join(fixes))
        else:
            self.add("native_build", "pass", desc)

    def check_verbs_library(self):
        if not self.topo.nics:
            return
        mod, _ = _native()
        verbs = getattr(mod, "verbs", None) if mod else None
        if verbs is None or not getattr(verbs, "available", False):
            return  # native_build already says why
        status = verbs.library_status() if self.real_host else {"libibverbs": True, "libefa": True, "error": ""}
        if not status["libibverbs"]:
            self.add("verbs_library", "fail", status["error"], "install rdma-core (libibverbs1 + ibverbs-providers)")
        elif self.topo.has_efa and not status["libefa"]:
            self.add("verbs_library", "fail", "libefa.so.1 not loadable on an EFA host",
                     "install the EFA provider (AWS EFA installer or ibverbs-providers)")
        else:
            self.add("verbs_library", "pass", "libibverbs" + (" and libefa" if status["libefa"] else "") +
                     " load")

    def check_registration(self):
        if not self.topo.nics or not self.topo.gpus:
            return
        vendors = {g.vendor for g in self.topo.gpus}
        modules = [m for m in ("nvidia_peermem", "nv_peer_mem", "efa_nv_peermem", "amdgpu") if
                   _module_loaded(self.sysfs_root, m)]
        peer = [m for m in modules if m != "amdgpu"] if "nvidia" in vendors else modules
        kernel = self.kernel or (0, 0)
        dmabuf = kernel >= (5, 12)
        if peer:
            self.add("gpu_registration", "pass", f"peer-memory module loaded: {', '.join(peer)}"
                     + ("; dmabuf also possible (kernel >= 5.12)" if dmabuf else ""))
        elif dmabuf:
            self.add("gpu_registration", "warn", f"no peer-memory module loaded; relying on dmabuf (kernel "
                     f"{kernel[0]}.{kernel[1]}), which also needs the NVIDIA open kernel modules or ROCm >= 5.6",
                     "if registration fails with 'Invalid argument': sudo modprobe "
                     + ("efa_nv_peermem" if self.topo.has_efa else "nvidia_peermem"))
        else:
            need = "efa_nv_peermem" if self.topo.has_efa else ("nvidia_peermem" if "nvidia" in vendors else
                                                               "amdgpu (with peer-memory support)")
            self.add("gpu_registration", "fail", "GPU memory cannot be registered with the NIC: no peer-memory "
                     "module loaded and no dmabuf support detected (ibv_reg_mr would fail with EINVAL)",
                     f"sudo modprobe {need} (or upgrade to Linux >= 5.12 with dmabuf-capable GPU drivers)")

    def check_fork_safety(self):
        """libibverbs without ibv_fork_init() (uccl-ep-train does not call it) on kernels before 5.13: after a fork()
        (DataLoader workers, subprocess, os.system) the parent's first write to a registered host page copies it
        (copy-on-write) while the NIC keeps using the old page, now the child's: RDMA writes and signals land in memory
        the parent no longer sees. From 5.13 the kernel copies pinned pages at fork (ibv_is_fork_initialized() ->
        IBV_FORK_UNNEEDED); before, RDMAV_FORK_SAFE / IBV_FORK_SAFE make libibverbs call ibv_fork_init() itself."""
        if not self.topo.nics or self.kernel is None:
            return
        if self.settings is not None and self.settings.transport.transport == "loopback":
            return
        named = [k for k in ("RDMAV_FORK_SAFE", "IBV_FORK_SAFE") if k in self.env]
        major, minor = self.kernel
        if named:
            self.add("fork_safety", "pass", f"{named[0]}={self.env[named[0]]} is set: libibverbs calls ibv_fork_init() "
                     "when it loads, so fork() (DataLoader workers) keeps registered memory intact")
        elif self.kernel >= (5, 13):
            self.add("fork_safety", "pass", f"kernel {major}.{minor} (>= 5.13) copies pinned DMA pages on fork(): "
                     "ibv_fork_init() is not needed")
        else:
            self.add("fork_safety", "warn", f"kernel {major}.{minor} is older than 5.13 and neither "
                     "RDMAV_FORK_SAFE nor IBV_FORK_SAFE is set: uccl-ep-train does not call ibv_fork_init(), so "
                     "after a fork() (DataLoader workers, subprocess) registered host memory (the proxies' signal "
                     "buffers) can be silently corrupted: the parent's next write moves the page while the NIC keeps "
                     "the old one",
                     "export RDMAV_FORK_SAFE=1 in the job's environment (libibverbs reads it when it loads, so set it "
                     "before the training process starts), or run on a kernel >= 5.13")

    def check_gids(self):
        if not self.topo.nics:
            return
        override = self.settings.transport.ib_gid_index if self.settings else -1
        hca = self.settings.transport.ib_hca if self.settings else ()
        names = {n for p in self.plans for n in p.nics} or {n.name for n in self.topo.nics}
        if hca:
            names &= set(topo_mod._hca_filter([n.name for n in self.topo.nics], hca)) or names
        bad, good = [], []
        for nic in self.topo.nics:
            if nic.name not in names:
                continue
            try:
                c = topo_mod.choose_gid_for(nic, override)
                good.append(f"{nic.name}: {c.reason}")
            except ValueError as exc:
                bad.append(str(exc))
        if bad:
            self.add("gid", "fail", "\n".join(bad), "set UCCL_IB_GID_INDEX to a routable entry (RoCE v2 preferred)"
                     " or give the NIC's netdev an address")
        else:
            self.add("gid", "pass", "; ".join(good))

    def check_nccl_consistency(self):
        env = self.env
        pairs = [("UCCL_IB_HCA", "NCCL_IB_HCA"), ("UCCL_IB_GID_INDEX", "NCCL_IB_GID_INDEX"),
                 ("UCCL_IB_SL", "NCCL_IB_SL"), ("UCCL_IB_TC", "NCCL_IB_TC"),
                 ("UCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
        diffs = []
        for ours, nccl in pairs:
            a, b = env.get(ours), env.get(nccl)
            if a is not None and b is not None and a.strip() != b.strip():
                diffs.append(f"{ours}={a} but {nccl}={b}")
            elif b is not None and a is None and ours in ("UCCL_IB_GID_INDEX", "UCCL_IB_HCA"):
                diffs.append(f"{nccl}={b} is set but {ours} is not (uccl-ep-train may pick a different "
                             f"{'GID' if 'GID' in ours else 'NIC set'})")
        if diffs:
            self.add("nccl_consistency", "warn", "; ".join(diffs),
                     "set the UCCL_IB_* variables to the values NCCL uses on this cluster (or explain why not)")
        else:
            self.add("nccl_consistency", "pass", "UCCL_IB_* and NCCL_IB_* agree (or only one side is set)")
        if self.topo.has_efa:
            if not env.get("NCCL_MAX_NCHANNELS"):
                self.add("nccl_efa_channels", "warn", "EFA host and NCCL_MAX_NCHANNELS unset: NCCL's collectives "
                         "open many channels and congest the NICs the EP proxies use",
                         "export NCCL_MAX_NCHANNELS=8 (or what your recipe measured)")
            else:
                self.add("nccl_efa_channels", "pass", f"NCCL_MAX_NCHANNELS={env['NCCL_MAX_NCHANNELS']}")

    def check_proxy_cpus(self):
        if not self.topo.gpus or not self.topo.nics or self.settings is None:
            return
        threads = self.settings.proxy.num_threads
        per_node: dict[int, int] = {}
        for p in self.plans or []:
            numa = next((n.numa_node for n in self.topo.nics if p.nics and n.name == p.nics[0]), -1)
            per_node[numa] = per_node.get(numa, 0) + threads
        pinned = set(self.settings.proxy.cpus)
        problems, suggest = [], []
        for numa, need in sorted(per_node.items()):
            cpus = self.topo.numa_cpus.get(numa, ())
            if not cpus:
                continue
            have = len(pinned & set(cpus)) if pinned else len(cpus)
            if have < need:
                problems.append(f"NUMA {numa} needs {need} proxy cores, "
                                f"{'UCCL_EP_PROXY_CPUS gives' if pinned else 'has'} {have}")
            suggest.append(topo_mod.format_cpulist(sorted(cpus)[-need:]))
        if problems:
            self.add("proxy_cpus", "warn", "; ".join(problems),
                     f"UCCL_EP_PROXY_CPUS={','.join(suggest)} (cores near each NIC; keep them free of dataloader "
                     "workers) or lower UCCL_EP_NUM_PROXY_THREADS")
        elif not pinned and suggest:
            self.add("proxy_cpus", "warn", f"proxy threads are not pinned ({threads} per GPU)",
                     f"UCCL_EP_PROXY_CPUS={','.join(suggest)} pins them next to the NICs")
        else:
            self.add("proxy_cpus", "pass", f"{threads} proxy threads per GPU; cores available near each NIC")

    def check_selftest(self):
        mod, _ = _native()
        selftest = None
        for name in ("loopback_selftest", "selftest"):
            selftest = getattr(mod, name, None) if mod is not None else None
            if selftest is not None:
                break
        if selftest is None:
            self.add("loopback_selftest", "warn", "the native module exposes no loopback self-test; skipped",
                     "rebuild a current uccl-ep-train to include it")
            return
        try:
            result = selftest()
        except Exception as exc:  # noqa: BLE001
            self.add("loopback_selftest", "fail", f"proxies + loopback transport failed: {exc}",
                     "see the error above; docs/troubleshooting.md")
            return
        self.add("loopback_selftest", "pass", f"proxies + loopback transport: {result}")

    def check_loopback_queues(self):
        """Enough CUDA hardware work queues for the loopback's copies (docs/internode.md, "Hardware work queues").
        Only runs over the loopback (one host playing nodes) need them; the driver is asked about MPS last, after
        the self-test's fork."""
        from uccl_ep_train.internode.transport import loopback_queue_shortfall, mps_enabled

        if not self.topo.gpus or self.settings is None:
            return
        mps = mps_enabled(0) if self.real_host else None
        have = (f"CUDA_DEVICE_MAX_CONNECTIONS={self.env['CUDA_DEVICE_MAX_CONNECTIONS']}"
                if "CUDA_DEVICE_MAX_CONNECTIONS" in self.env else "CUDA_DEVICE_MAX_CONNECTIONS unset (CUDA's 8)")
        have += {True: ", MPS on", False: ", MPS off", None: ", MPS unknown"}[mps]
        short = loopback_queue_shortfall(self.env.get("CUDA_DEVICE_MAX_CONNECTIONS"), mps,
                                         self.settings.proxy.num_threads)
        if short is None:
            self.add("loopback_queues", "pass", f"{have}: enough hardware work queues for the loopback's copies")
            return
        # Only the proxy threads' own copies share our queues; the copy agent makes them in a process of its own
        agent = self.settings.emulation.loopback_copy_agent
        if agent == "on":
            self.add("loopback_queues", "pass", f"{have}: {short[0]}, but UCCL_EP_LOOPBACK_COPY_AGENT=on: the copy "
                     "agent, not this process, makes the loopback's copies")
            return
        where = ("ranks that share a GPU, where UCCL_EP_LOOPBACK_COPY_AGENT=auto leaves the copies to the proxy "
                 "threads" if agent == "auto" else "UCCL_EP_LOOPBACK_COPY_AGENT=off")
        self.add("loopback_queues", "warn",
                 f"{have}: {short[0]}; a run over the loopback (one host playing nodes) with {where} may stall at "
                 "the GPU deadline with a copy queued behind a spinning kernel. The verbs transport is not affected",
                 f"CUDA_DEVICE_MAX_CONNECTIONS={short[1]} or more for emulated-node runs where the proxy threads "
                 "copy (docs/internode.md, \"Hardware work queues\")")

    # ------------------------------------------------------------------------------------------ output
    def host_summary(self) -> str:
        gpus = f"{len(self.topo.gpus)} GPU(s)" if self.topo.gpus else "no GPU"
        nics = (f"{len(self.topo.nics)} RDMA NIC(s)" + (" (EFA)" if self.topo.has_efa else "")) if self.topo.nics \
            else "no RDMA NIC"
        can = "internode dispatch/combine over verbs" if self.topo.gpus and self.topo.nics else \
            "intranode runs and the loopback transport" if self.topo.gpus else \
            "the host core and CPU tests only (no dispatch/combine kernels)"
        return f"{gpus}, {nics}: this host can run {can}"

    def report(self) -> dict:
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "warn", "fail")}
        return {
            "version": JSON_VERSION,
            "host": socket.gethostname(),
            "sysfs_root": self.sysfs_root,
            "host_summary": self.host_summary(),
            "summary": counts,
            "checks": [asdict(c) for c in self.checks],
            "topology": {
                "gpus": [{"index": g.index, "vendor": g.vendor, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node,
                          "peers": list(g.peers)} for g in self.topo.gpus],
                "nics": [{"name": n.name, "pci_bus_id": n.pci_bus_id, "numa_node": n.numa_node, "driver": n.driver,
                          "efa": n.is_efa, "rate_gbps": n.rate_gbps, "active": n.active,
                          "link_layer": n.ports[0].link_layer if n.ports else ""} for n in self.topo.nics],
                "plan": [asdict(p) | {"cpus": topo_mod.format_cpulist(p.cpus)} for p in self.plans],
            },
            "settings": self.settings.to_env() if self.settings else {},
        }


def exit_code(checks: list[Check], strict: bool = False) -> int:
    if any(c.status == "fail" for c in checks) or (strict and any(c.status == "warn" for c in checks)):
        return EXIT_FAIL
    return EXIT_OK


def format_text(report: dict) -> str:
    mark = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}
    lines = [f"uccl-ep-train doctor on {report['host']} (sysfs: {report['sysfs_root']})",
             report["host_summary"]]
    for c in report["checks"]:
        detail = c["detail"].replace("\n", "\n         ")
        lines.append(f"[{mark[c['status']]}] {c['name']}: {detail}")
        if c["fix"] and c["status"] != "pass":
            lines.append(f"         fix: {c['fix']}")
    s = report["summary"]
    lines.append(f"{s['pass']} passed, {s['warn']} warnings, {s['fail']} failed")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- --all-ranks
def _flatten(report: dict) -> dict[str, str]:
    flat = {f"check {c['name']}": f"{c['status']}: {c['detail']}" for c in report["checks"]}
    flat.update({f"env {k}": v for k, v in report["settings"].items()})
    flat["gpus"] = str(len(report["topology"]["gpus"]))
    flat["nics"] = ",".join(n["name"] for n in report["topology"]["nics"])
    return flat


def differences(reports: list[dict]) -> list[str]:
    """Lines describing every key whose value differs between ranks, grouped by value."""
    flats = [_flatten(r) for r in reports]
    keys = sorted(set().union(*flats))
    out = []
    for k in keys:
        groups: dict[str, list[int]] = {}
        for rank, f in enumerate(flats):
            groups.setdefault(f.get(k, "<absent>"), []).append(rank)
        if len(groups) > 1:
            out.append(f"{k}:")
            for value, ranks in groups.items():
                hosts = sorted({reports[r]["host"] for r in ranks})
                out.append(f"    ranks {topo_mod.format_cpulist(ranks)} ({', '.join(hosts)}): {value}")
    return out


def _gather(report: dict) -> Optional[list[dict]]:
    import torch.distributed as dist
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        created = True
    try:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, report)
        return out if dist.get_rank() == 0 else None
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    doctor = Doctor(args.sysfs_root)
    checks = doctor.run()
    report = doctor.report()
    code = exit_code(checks, args.strict)
    report["exit_code"] = code
    if args.all_ranks:
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            print("uccl-ep-train doctor --all-ranks must run inside torchrun/srun (RANK and WORLD_SIZE unset)",
                  file=sys.stderr)
            return EXIT_USAGE
        reports = _gather(report)
        if reports is None:
            return code
        diff = differences(reports)
        if args.json:
            print(json.dumps({"version": JSON_VERSION, "ranks": reports, "differences": diff}, indent=2))
        else:
            print(format_text(report))
            print(f"\nacross {len(reports)} ranks: " + ("identical" if not diff else "these differ:"))
            for line in diff:
                print(line)
        return max(r["exit_code"] for r in reports)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return code


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check GPUs, NICs, GIDs, registration and settings; print fixes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument("--all-ranks", action="store_true",
                   help="inside torchrun/srun: gather every rank's report and print what differs between nodes")
    p.add_argument("--strict", action="store_true", help="warnings count as failures (exit code 1)")
    p.add_argument("--sysfs-root", default="/sys", help="read this sysfs tree instead of /sys (tests, offline triage)")
    p.set_defaults(func=run)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="uccl-ep-train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
