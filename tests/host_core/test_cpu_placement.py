"""Each rank of a host pins its proxy threads (and, over the loopback, its copy agent) to its own share of the host's
UCCL_EP_PROXY_CPUS (uccl_ep_train/cpu_placement.py): shares are contiguous, in host-local rank order, and disjoint;
a list too short for the host's ranks is refused on every rank; the threads that run land where the share says."""
import glob
import os
import time

import pytest

from uccl_ep_train import comm, native
from uccl_ep_train.loopback_copy_agent import CopyAgent
from uccl_ep_train.cpu_placement import cpu_share, host_local_slot, outside_affinity, shares_by_rank
from uccl_ep_train.settings import SettingsError, load_settings


def test_the_ranks_of_a_host_take_disjoint_contiguous_shares_that_cover_the_list():
    assert [cpu_share(range(16), i, 4) for i in range(4)] == [tuple(range(4 * i, 4 * i + 4)) for i in range(4)]
    uneven = [cpu_share([3, 5, 7, 9, 11, 13, 15, 17, 19, 21], i, 4) for i in range(4)]
    assert [len(s) for s in uneven] == [3, 3, 2, 2]  # sizes differ by one at most, the first ones larger
    assert sum(uneven, ()) == (3, 5, 7, 9, 11, 13, 15, 17, 19, 21)  # in order, every CPU once
    assert cpu_share((8, 9), 0, 1) == (8, 9)  # one rank on its host: the whole list, as before


def test_an_empty_list_pins_nothing_on_any_rank():
    assert [cpu_share((), i, 8) for i in range(8)] == [()] * 8


def test_the_ranks_of_each_host_are_numbered_in_rank_order():
    hosts = ["a", "b", "a", "b", "a"]
    assert [host_local_slot(hosts, r) for r in range(5)] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]


def test_each_host_splits_its_own_list_among_its_own_ranks():
    pools = [("a", (0, 1, 2, 3)), ("b", (10, 11, 12, 13, 14, 15)), ("a", (0, 1, 2, 3)), ("b", (10, 11, 12, 13, 14, 15))]
    assert shares_by_rank(pools) == [(0, 1), (10, 11, 12), (2, 3), (13, 14, 15)]


def test_a_list_shorter_than_its_host_s_ranks_is_refused_on_every_rank_naming_the_host():
    pools = [("a", (0, 1)), ("b", (7,)), ("a", (0, 1)), ("b", (7,))]
    with pytest.raises(SettingsError, match=r"host b: UCCL_EP_PROXY_CPUS lists 1 CPU\(s\) for the 2 ranks"):
        shares_by_rank(pools)
    with pytest.raises(ValueError, match="host-local index 2 is outside 2 ranks"):
        cpu_share((1, 2, 3), 2, 2)


def test_cpus_the_process_may_not_run_on_are_named_so_setup_can_warn_that_they_stay_unpinned():
    assert outside_affinity((4, 5, 6, 7), {0, 1, 2, 3, 4, 5}) == (6, 7)
    assert outside_affinity((4, 5), {4, 5, 9}) == ()
    assert outside_affinity((), set()) == ()


@pytest.mark.skipif(not native.available(), reason="native module not built")
def test_a_copy_agent_given_a_cpu_it_may_not_use_still_starts_and_runs_unpinned():
    allowed = os.sched_getaffinity(0)
    agent = CopyAgent(1, -1, cpus=(max(allowed) + 1000,))  # (no such CPU)
    try:
        assert agent.alive()
        assert set(_allowed(f"/proc/{agent.pid}").values()) == {_cpu_list_of(allowed)}
    finally:
        agent.close()


def _cpu_list_of(cpus) -> str:
    """The kernel's Cpus_allowed_list text for a set of CPUs ('0-3,8')."""
    from uccl_ep_train.topology import format_cpulist

    return format_cpulist(sorted(cpus))


def test_proxy_options_take_the_share_of_their_host_slot_and_refuse_a_short_list():
    s = load_settings({"UCCL_EP_PROXY_CPUS": "4-11"})
    assert comm.proxy_options(s, 0, 1).cpus == tuple(range(4, 12))
    assert comm.proxy_options(s, 1, 4, host_slot=(1, 4)).cpus == (6, 7)
    with pytest.raises(SettingsError, match="lists 8 CPU"):
        comm.proxy_options(s, 0, 16, host_slot=(0, 16))


def _allowed(pid_dir: str) -> dict:
    """{thread id: its Cpus_allowed_list} for every thread under /proc/<pid>/task."""
    out = {}
    for status in glob.glob(os.path.join(pid_dir, "task", "*", "status")):
        try:
            with open(status) as f:
                text = f.read()
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
        out[status.split("/")[-2]] = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                                          if line.startswith("Cpus_allowed_list"))
    return out


@pytest.mark.skipif(not native.available(), reason="native module not built")
def test_the_proxy_threads_and_the_copy_agent_run_on_their_rank_s_share_only():
    last = str(max(os.sched_getaffinity(0)))
    first = str(min(os.sched_getaffinity(0)))
    # this process's CPUs as a host's list shared by 2 ranks, the second of which we are: our share is its end
    env = {"UCCL_EP_PROXY_CPUS": f"{first},{last}" if first != last else last, "UCCL_EP_LOOPBACK_COPY_AGENT": "on"}
    slot = (1, 2) if first != last else (0, 1)
    before = set(_allowed("/proc/self"))
    c = comm.HostComm(1 << 16, 0, 1, settings=load_settings(env), num_signal_slots=64, num_threads=2,
                      fifos_per_thread=1, idle_backoff_us=20, timeout_secs=5.0, host_slot=slot)
    try:
        assert c.options["cpus"] == [int(last)]
        comm.connect_in_process([c])
        deadline = time.monotonic() + 5
        while True:  # the proxy's two threads, pinned as they start
            ours = {t: a for t, a in _allowed("/proc/self").items() if t not in before}
            if sum(a == last for a in ours.values()) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert sum(a == last for a in ours.values()) >= 2, ours
        agent = _allowed(f"/proc/{c.copy_agent.pid}")
        assert agent and set(agent.values()) == {last}, agent  # every thread of the agent, its lanes included
    finally:
        c.close()
