"""What this host has: GPUs, RDMA NICs, how they hang off the PCI tree, and which NIC and GID each GPU should use.

Everything reads a sysfs tree under ``sysfs_root`` (``/sys`` on a real host; ``tests/fixtures/sysfs/<host>`` in
tests), so the decisions the transports depend on — the NIC per GPU and the GID index per NIC — are tested against
recorded trees of p5en (EFA), MI300X + Broadcom Thor-2 and ConnectX-7 RoCE hosts. GPU enumeration prefers
nvidia-smi / rocm-smi when they exist and sysfs is the real root (their order is the CUDA/HIP device order), and
falls back to PCI class scanning.

The GID rule mirrors csrc/transport/gid.cpp (a test checks both agree on every fixture).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

NVIDIA_VENDOR = "0x10de"
AMD_VENDOR = "0x1002"
AMAZON_VENDOR = "0x1d0f"
# PCI classes of compute GPUs: VGA (0x0300), 3D controller (0x0302, H100/H200), display other (0x0380, MI250),
# processing accelerator (0x1200, MI300X).
_GPU_CLASSES = ("0x0300", "0x0302", "0x0380", "0x1200")

_ROCE_TYPES = {"RoCE v2": "RoCE v2", "IB/RoCE v1": "RoCE v1"}


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: str                  # sysfs form: 8 groups of 4 hex digits
    type: str                 # "IB", "RoCE v1", "RoCE v2" or "unknown"
    netdev: str = ""

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @property
    def is_zero(self) -> bool:
        return int(self.address) == 0

    @property
    def is_link_local(self) -> bool:
        return self.address in ipaddress.IPv6Network("fe80::/10")

    @property
    def is_ipv4_mapped(self) -> bool:
        return self.address.ipv4_mapped is not None


@dataclass(frozen=True)
class GidChoice:
    index: int
    reason: str


@dataclass
class RdmaPort:
    port: int
    link_layer: str           # InfiniBand, Ethernet, Unknown (EFA)
    state: str                # ACTIVE, DOWN, ...
    rate_gbps: float
    gids: list[GidEntry] = field(default_factory=list)


@dataclass
class RdmaDevice:
    name: str
    pci_bus_id: str
    pci_path: tuple[str, ...]  # bus ids from the root port down to the device
    numa_node: int
    driver: str
    vendor: str
    is_efa: bool
    ports: list[RdmaPort] = field(default_factory=list)

    @property
    def rate_gbps(self) -> float:
        return max((p.rate_gbps for p in self.ports), default=0.0)

    @property
    def active(self) -> bool:
        return any(p.state == "ACTIVE" for p in self.ports)


@dataclass
class Gpu:
    index: int                 # device order (CUDA/HIP ordinal when from a tool or torch; PCI order otherwise)
    vendor: str                # "nvidia" / "amd"
    pci_bus_id: str
    pci_path: tuple[str, ...]
    numa_node: int
    local_cpus: tuple[int, ...]
    name: str = ""
    peers: tuple[int, ...] = ()  # GPUs reachable over NVLink / xGMI (empty: unknown or none)


@dataclass
class Topology:
    sysfs_root: str
    gpus: list[Gpu]
    nics: list[RdmaDevice]
    numa_cpus: dict[int, tuple[int, ...]]
    sources: dict[str, str]    # what each part was discovered from

    @property
    def has_efa(self) -> bool:
        return any(n.is_efa for n in self.nics)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- small readers
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8) (the sysfs/taskset format)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _pci_path(sysfs_root: str, device_link: str) -> tuple[str, ...]:
    """Bus ids on the way from the root complex to the device (the symlink's target, inside sysfs_root)."""
    real = os.path.realpath(device_link)
    return tuple(p for p in real.split(os.sep) if _BDF.match(p))


def bdf(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs spelling of a PCI address, e.g. torch's device properties (pci_domain_id, pci_bus_id,
    pci_device_id) -> '0000:9c:00.0'."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def _normalize_bdf(bus_id: str) -> str:
    """'00000000:8A:00.0' (nvidia-smi) -> '0000:8a:00.0'."""
    bus_id = bus_id.strip().lower()
    dom, rest = bus_id.split(":", 1)
    return f"{int(dom, 16):04x}:{rest}"


def _pci_info(sysfs_root: str, bdf: str) -> tuple[tuple[str, ...], int, tuple[int, ...], str]:
    dev = os.path.join(sysfs_root, "bus/pci/devices", bdf)
    path = _pci_path(sysfs_root, dev) or (bdf,)
    numa = int(_read(os.path.join(dev, "numa_node")) or -1)
    cpus = parse_cpulist(_read(os.path.join(dev, "local_cpulist")) or "")
    driver = os.path.basename(os.path.realpath(os.path.join(dev, "driver"))) if os.path.exists(
        os.path.join(dev, "driver")) else ""
    return path, numa, cpus, driver


# ---------------------------------------------------------------------------------------------- GPUs
def _gpus_from_sysfs(sysfs_root: str) -> list[Gpu]:
    base = os.path.join(sysfs_root, "bus/pci/devices")
    found = []
    for bdf in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        vendor = _read(os.path.join(base, bdf, "vendor"))
        cls = (_read(os.path.join(base, bdf, "class")) or "")[:6]
        if vendor not in (NVIDIA_VENDOR, AMD_VENDOR) or cls not in _GPU_CLASSES:
            continue
        path, numa, cpus, _ = _pci_info(sysfs_root, bdf)
        found.append(Gpu(index=len(found), vendor="nvidia" if vendor == NVIDIA_VENDOR else "amd", pci_bus_id=bdf,
                         pci_path=path, numa_node=numa, local_cpus=cpus))
    # xGMI: GPUs reporting the same hive id are fully connected (MI300X has all 8 in one hive).
    hives: dict[str, list[int]] = {}
    for g in found:
        hive = _read(os.path.join(base, g.pci_bus_id, "xgmi_hive_info/xgmi_hive_id"))
        if hive and hive != "0":
            hives.setdefault(hive, []).append(g.index)
    for members in hives.values():
        for i in members:
            found[i].peers = tuple(m for m in members if m != i)
    return found


def _run(cmd: Sequence[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _gpus_from_nvidia_smi(sysfs_root: str) -> Optional[list[Gpu]]:
    out = _run(["nvidia-smi", "--query-gpu=index,pci.bus_id,name", "--format=csv,noheader"])
    if not out:
        return None
    gpus = []
    for line in out.strip().splitlines():
        idx, bus, name = (x.strip() for x in line.split(",", 2))
        bdf = _normalize_bdf(bus)
        path, numa, cpus, _ = _pci_info(sysfs_root, bdf)
        gpus.append(Gpu(index=int(idx), vendor="nvidia", pci_bus_id=bdf, pci_path=path, numa_node=numa,
                        local_cpus=cpus, name=name))
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo:
        _apply_nvlink_matrix(gpus, topo)
    return gpus


def _apply_nvlink_matrix(gpus: list[Gpu], text: str) -> None:
    """`nvidia-smi topo -m`: a cell 'NV<n>' between GPUi and GPUj means NVLink."""
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("GPU")]
    for row in rows:
        m = re.match(r"GPU(\d+)$", row[0])
        if not m or int(m.group(1)) >= len(gpus):
            continue
        i = int(m.group(1))
        cells = row[1:1 + len(gpus)]
        gpus[i].peers = tuple(j for j, c in enumerate(cells) if c.startswith("NV"))


def discover_gpus(sysfs_root: str = "/sys", use_tools: Optional[bool] = None) -> tuple[list[Gpu], str]:
    """GPUs and where they came from. Tools are consulted only for the real /sys (fixtures describe other hosts)."""
    if use_tools is None:
        use_tools = os.path.realpath(sysfs_root) == "/sys"
    if use_tools:
        gpus = _gpus_from_nvidia_smi(sysfs_root)
        if gpus:
            return gpus, "nvidia-smi"
    gpus = _gpus_from_sysfs(sysfs_root)
    return gpus, "sysfs"


# ---------------------------------------------------------------------------------------------- RDMA devices
def _rate_gbps(text: Optional[str]) -> float:
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else 0.0


def _gid_type(types_text: Optional[str], link_layer: str) -> str:
    if not types_text:
        return "IB" if link_layer != "Ethernet" else "unknown"
    if "RoCE v2" in types_text:
        return "RoCE v2"
    return "RoCE v1" if link_layer == "Ethernet" else "IB"


def read_gid_table(sysfs_root: str, device: str, port: int = 1) -> list[GidEntry]:
    base = os.path.join(sysfs_root, "class/infiniband", device, "ports", str(port))
    link_layer = _read(os.path.join(base, "link_layer")) or ""
    gids_dir = os.path.join(base, "gids")
    out = []
    names = os.listdir(gids_dir) if os.path.isdir(gids_dir) else []
    for idx in sorted(int(n) for n in names if n.isdigit()):
        text = _read(os.path.join(gids_dir, str(idx)))
        if not text:
            continue
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            continue
        types = _read(os.path.join(base, "gid_attrs/types", str(idx)))
        ndev = _read(os.path.join(base, "gid_attrs/ndevs", str(idx))) or ""
        out.append(GidEntry(idx, text, _gid_type(types, link_layer), ndev))
    return out


def discover_rdma(sysfs_root: str = "/sys") -> list[RdmaDevice]:
    base = os.path.join(sysfs_root, "class/infiniband")
    if not os.path.isdir(base):
        return []
    devs = []
    for name in sorted(os.listdir(base), key=_natural_key):
        dev_dir = os.path.join(base, name)
        link = os.path.join(dev_dir, "device")
        path = _pci_path(sysfs_root, link) if os.path.exists(link) else ()
        bdf = path[-1] if path else ""
        pci_dir = os.path.realpath(link) if os.path.exists(link) else ""
        numa = int(_read(os.path.join(pci_dir, "numa_node")) or -1) if pci_dir else -1
        driver = os.path.basename(os.path.realpath(os.path.join(pci_dir, "driver"))) if pci_dir and os.path.exists(
            os.path.join(pci_dir, "driver")) else ""
        vendor = (_read(os.path.join(pci_dir, "vendor")) if pci_dir else "") or ""
        ports = []
        ports_dir = os.path.join(dev_dir, "ports")
        for p in sorted(int(x) for x in os.listdir(ports_dir) if x.isdigit()) if os.path.isdir(ports_dir) else []:
            pd = os.path.join(ports_dir, str(p))
            state = (_read(os.path.join(pd, "state")) or "").split(":")[-1].strip()
            ports.append(RdmaPort(port=p, link_layer=_read(os.path.join(pd, "link_layer")) or "",
                                  state=state, rate_gbps=_rate_gbps(_read(os.path.join(pd, "rate"))),
                                  gids=read_gid_table(sysfs_root, name, p)))
        is_efa = driver == "efa" or vendor == AMAZON_VENDOR or name.startswith(("rdmap", "efa"))
        devs.append(RdmaDevice(name=name, pci_bus_id=bdf, pci_path=path, numa_node=numa, driver=driver,
                               vendor=vendor, is_efa=is_efa, ports=ports))
    return devs


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def discover(sysfs_root: str = "/sys", use_tools: Optional[bool] = None) -> Topology:
    gpus, gpu_source = discover_gpus(sysfs_root, use_tools)
    nics = discover_rdma(sysfs_root)
    numa_cpus: dict[int, tuple[int, ...]] = {}
    node_dir = os.path.join(sysfs_root, "devices/system/node")
    for n in sorted(os.listdir(node_dir)) if os.path.isdir(node_dir) else []:
        m = re.match(r"node(\d+)$", n)
        if m:
            numa_cpus[int(m.group(1))] = parse_cpulist(_read(os.path.join(node_dir, n, "cpulist")) or "")
    return Topology(sysfs_root=sysfs_root, gpus=gpus, nics=nics, numa_cpus=numa_cpus,
                    sources={"gpus": gpu_source, "nics": "sysfs"})


# ---------------------------------------------------------------------------------------------- decisions
def pci_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Smaller is closer: a deeper common ancestor (same PCIe switch) beats a shallower one (same root port), which
    beats none (another root complex or socket), like NCCL's PIX < PXB < PHB < SYS; hops break ties."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    hops = (len(a) - common) + (len(b) - common)
    return 100 * (16 - common) + hops if common else 10_000 + hops


def _hca_filter(names: Sequence[str], spec: Sequence[str]) -> list[str]:
    """UCCL_IB_HCA / NCCL_IB_HCA semantics: 'mlx5_0,mlx5_1' (prefix match), '=mlx5_0' (exact), '^mlx5_8' (exclude);
    ':port' suffixes are accepted and ignored here (port 1 is used)."""
    if not spec:
        return list(names)
    items = list(spec)
    exclude = items[0].startswith("^")
    exact = items[0].startswith("=")
    if exclude or exact:
        items[0] = items[0][1:]
    wanted = [s.split(":")[0] for s in items if s]

    def match(n: str) -> bool:
        return any(n == w if exact else n.startswith(w) for w in wanted)

    return [n for n in names if match(n) != exclude]


def nics_for_gpus(topo: Topology, hca: Sequence[str] = ()) -> dict[int, list[str]]:
    """For each GPU, the NICs its proxies should drive: the active ones nearest on the PCI tree. GPUs sharing the
    same nearest NICs split them (2 NICs, 2 GPUs: one each; 1 NIC, 2 GPUs: shared); p5en gets 2 EFA per GPU."""
    allowed = set(_hca_filter([n.name for n in topo.nics], hca))
    nics = [n for n in topo.nics if n.name in allowed and n.active] or [n for n in topo.nics if n.name in allowed]
    out: dict[int, list[str]] = {}
    if not nics:
        return {g.index: [] for g in topo.gpus}
    nearest: dict[int, tuple[str, ...]] = {}
    for g in topo.gpus:
        dist = {n.name: pci_distance(g.pci_path, n.pci_path) for n in nics}
        best = min(dist.values())
        nearest[g.index] = tuple(n.name for n in nics if dist[n.name] == best)
    groups: dict[tuple[str, ...], list[int]] = {}
    for gi, names in nearest.items():
        groups.setdefault(names, []).append(gi)
    for names, members in groups.items():
        members.sort()
        if len(names) >= len(members):
            per = len(names) // len(members)
            for k, gi in enumerate(members):
                out[gi] = list(names[k * per:(k + 1) * per])
        else:
            for k, gi in enumerate(members):
                out[gi] = [names[k % len(names)]]
    return out


def choose_gid(gids: Sequence[GidEntry], link_layer: str, override_index: int = -1, is_efa: bool = False,
               device: str = "", port: int = 1) -> GidChoice:
    """Same rule as csrc/transport/gid.cpp (see docs/transports.md "GID choice"). Raises ValueError."""
    where = f"{device} port {port}"
    table = "".join(f"\n  [{g.index}] {g.gid} {g.type}{' ' + g.netdev if g.netdev else ''}"
                    for g in gids if not g.is_zero) or " (no non-zero GID)"
    by_index = {g.index: g for g in gids}
    if override_index >= 0:
        g = by_index.get(override_index)
        if g is None or g.is_zero:
            raise ValueError(f"UCCL_IB_GID_INDEX={override_index} names no GID of {where}; its GIDs are:{table}\n"
                             "set UCCL_IB_GID_INDEX to one of them, or unset it to choose automatically")
        return GidChoice(override_index, f"UCCL_IB_GID_INDEX={override_index} ({g.gid}, {g.type})")
    if is_efa or link_layer == "InfiniBand":
        g = by_index.get(0)
        if g is None or g.is_zero:
            raise ValueError(f"{where} has no GID at index 0 (is the port up? `ibv_devinfo -v`)")
        return GidChoice(0, f"{'EFA' if is_efa else 'InfiniBand'} port: index 0 ({g.gid})")
    reasons = ["RoCE v2, IPv4-mapped", "RoCE v2, global IPv6 (no IPv4-mapped RoCE v2 GID)",
               "RoCE v1, IPv4-mapped (no RoCE v2 GID)", "RoCE v1, global IPv6 (no RoCE v2 GID)",
               "IPv4-mapped, type unknown", "global IPv6, type unknown"]
    best: Optional[tuple[int, int]] = None
    for g in gids:
        if g.is_zero or g.is_link_local:
            continue
        base = {"RoCE v2": 0, "RoCE v1": 2, "unknown": 4}.get(g.type)
        if base is None:
            continue
        rank = base + (0 if g.is_ipv4_mapped else 1)
        if best is None or (rank, g.index) < best:
            best = (rank, g.index)
    if best is None:
        raise ValueError(f"no routable GID on {where} (only zero or link-local fe80:: entries):{table}\n"
                         "assign an IPv4/IPv6 address to the NIC's netdev, or force one with UCCL_IB_GID_INDEX")
    g = by_index[best[1]]
    return GidChoice(g.index, f"{reasons[best[0]]}: index {g.index} ({g.gid}{' on ' + g.netdev if g.netdev else ''})")


def choose_gid_for(nic: RdmaDevice, override_index: int = -1, port: int = 1) -> GidChoice:
    p = next((x for x in nic.ports if x.port == port), None)
    if p is None:
        raise ValueError(f"{nic.name} has no port {port}")
    return choose_gid(p.gids, p.link_layer, override_index, nic.is_efa, nic.name, port)


@dataclass(frozen=True)
class GpuPlan:
    """What the transport of one GPU receives: device names, GID index per device (with why), proxy CPUs."""
    gpu: int
    nics: tuple[str, ...]
    gid_index: tuple[int, ...]
    gid_reason: tuple[str, ...]
    cpus: tuple[int, ...]


def plan(topo: Topology, hca: Sequence[str] = (), gid_index: int = -1) -> list[GpuPlan]:
    """NIC(s), GID(s) and candidate proxy CPUs (the NIC's NUMA node, else the GPU's) for every GPU. A GID that cannot
    be chosen raises ValueError with the table and the fix."""
    by_name = {n.name: n for n in topo.nics}
    assignment = nics_for_gpus(topo, hca)
    out = []
    for gpu in topo.gpus:
        names = assignment.get(gpu.index, [])
        choices = [choose_gid_for(by_name[n], gid_index) for n in names]
        numa = by_name[names[0]].numa_node if names else gpu.numa_node
        out.append(GpuPlan(gpu=gpu.index, nics=tuple(names), gid_index=tuple(c.index for c in choices),
                           gid_reason=tuple(c.reason for c in choices), cpus=topo.numa_cpus.get(numa, ())))
    return out
