"""Where a rank's spinning host threads run: its proxy threads and, over the loopback, its copy agent.

``UCCL_EP_PROXY_CPUS`` lists the CPUs of a host that proxy threads may be pinned to. A launcher gives every rank of a
host the same environment, so the list is the host's pool, and each rank takes a share of its own: contiguous, in
host-local rank order, sizes differing by at most one. Given whole to every rank, as before, thread i of every rank
was pinned to the list's i-th CPU, so the eight ranks of a node spun their proxy threads on the same four cores.

A rank's threads wrap within its share when it has fewer CPUs than threads (``proxy.cpp``: thread i takes CPU
i mod share). The loopback's copy agent, a process of the rank's own that spins while a hop runs, is confined to the
same share, so neither kind of spinning thread lands on a core the training process's main thread runs on unless
the list includes it (docs/host-core.md, "Proxy CPUs").
"""
from __future__ import annotations

import os
import socket
import warnings
from typing import Any, List, Sequence, Set, Tuple

from uccl_ep_train.settings import SettingsError

ENV = "UCCL_EP_PROXY_CPUS"


def host_local_slot(hosts: Sequence[str], rank: int) -> Tuple[int, int]:
    """(``rank``'s index among the ranks on its host, how many ranks that host runs), from every rank's host name in
    rank order: the ranks of a host are numbered in rank order, as launchers number local ranks."""
    mine = hosts[rank]
    return sum(1 for h in hosts[:rank] if h == mine), sum(1 for h in hosts if h == mine)


def cpu_share(pool: Sequence[int], index: int, count: int) -> Tuple[int, ...]:
    """The ``index``-th of ``count`` contiguous shares of ``pool`` (the first ``len(pool) % count`` one CPU larger);
    () for an empty pool (nothing pinned). Raises SettingsError when the pool cannot give every rank a CPU of its own
    (ValueError for an index outside the ranks: a caller's mistake, not a setting's)."""
    if not 0 <= index < count:
        raise ValueError(f"host-local index {index} is outside {count} ranks")
    if not pool:
        return ()
    if len(pool) < count:
        raise SettingsError(f"{ENV} lists {len(pool)} CPU(s) for the {count} ranks of this host: each rank needs "
                            f"one of its own (list at least {count}, ideally {count} x UCCL_EP_NUM_PROXY_THREADS, or "
                            f"leave it empty: no pinning)")
    size, extra = divmod(len(pool), count)
    start = index * size + min(index, extra)
    return tuple(pool[start:start + size + (index < extra)])


def shares_by_rank(pools: Sequence[Tuple[str, Tuple[int, ...]]]) -> List[Tuple[int, ...]]:
    """Every rank's share from every rank's (host name, pool), in rank order; raises SettingsError, naming the host,
    where a host's pool cannot give each of its ranks a CPU. Every rank computes the same answer, so a bad list on one
    host makes every rank raise at setup instead of leaving the other hosts to time out."""
    hosts = [h for h, _ in pools]
    out = []
    for rank, (host, pool) in enumerate(pools):
        index, count = host_local_slot(hosts, rank)
        try:
            out.append(cpu_share(pool, index, count))
        except SettingsError as exc:
            raise SettingsError(f"rank {rank} on host {host}: {exc}") from None
    return out


def rank_cpus(pool: Sequence[int], rank: int, group: Any) -> Tuple[int, ...]:
    """This rank's share of its host's ``pool`` (settings.proxy.cpus), found with one all_gather over ``group`` (a
    gloo group of every rank). Every rank must call it; the gather runs even where this rank's pool is empty, since
    another host's may not be."""
    import torch.distributed as dist

    every: List[Any] = [None] * dist.get_world_size(group)
    mine: Tuple[str, Tuple[int, ...]] = (socket.gethostname(), tuple(int(c) for c in pool))
    dist.all_gather_object(every, mine, group=group)
    share = shares_by_rank(every)[rank]
    outside = outside_affinity(share, os.sched_getaffinity(0))
    if outside:
        warnings.warn(f"rank {rank}: its share of {ENV} ({', '.join(map(str, share))}) names CPU(s) "
                      f"{', '.join(map(str, outside))} that this process may not run on (its affinity, or the machine, "
                      f"lacks them): the threads given those stay unpinned", RuntimeWarning, stacklevel=2)
    return share


def outside_affinity(share: Sequence[int], allowed: Set[int]) -> Tuple[int, ...]:
    """The CPUs of ``share`` outside ``allowed`` (os.sched_getaffinity: what a launcher or cgroup lets the process
    use). A thread pinned to one of them is left unpinned (proxy.cpp pins best effort, as the copy agent does), which a
    list meant for another machine or container would do silently."""
    return tuple(c for c in share if c not in allowed)

