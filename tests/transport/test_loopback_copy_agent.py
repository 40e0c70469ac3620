"""The loopback's copy agent (csrc/transport/loopback_copy_agent.hpp): a process of each rank's own moves the bytes
of its loopback writes. On this machine the copies are host memory (memcpy in the agent); the GPU machine runs the
same protocol with device copies (tests/internode/test_internode_gpu.py, UCCL_EP_LOOPBACK_COPY_AGENT). Copy runs
through the agent: tests/transport/test_loopback_copies.py."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from uccl_ep_train import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

from uccl_ep_train import comm  # noqa: E402
from uccl_ep_train.loopback_copy_agent import CopyAgent, CopyAgentError  # noqa: E402
from uccl_ep_train.settings import load_settings  # noqa: E402

DATA = 1 << 16
HALF = DATA // 2
AGENT = {"UCCL_EP_LOOPBACK_COPY_AGENT": "on"}


def _comm(rank=0, world=1, env=AGENT, **kw):
    return comm.HostComm(DATA, rank, world, settings=load_settings(dict(env)), num_signal_slots=64, num_threads=1,
                         fifos_per_thread=1, idle_backoff_us=20, timeout_secs=5.0, **kw)


def _random_halves(c, seed):
    c.data()[:HALF] = np.random.default_rng(seed).integers(0, 256, HALF, dtype=np.uint8)
    c.data()[HALF:] = 0


def _gone(pid, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # (reaps it if it is our child: a zombie still answers kill(pid, 0))
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_two_ranks_with_an_agent_each_exchange_random_bytes_exactly_through_a_capped_reordering_wire():
    C = native.module()
    env = dict(AGENT, UCCL_EP_LOOPBACK_REORDER="4", UCCL_EP_LOOPBACK_BW_GBPS="2")
    comms = [_comm(r, 2, env=env) for r in range(2)]
    try:
        assert comms[0].copy_agent.pid != comms[1].copy_agent.pid
        for r, c in enumerate(comms):
            _random_halves(c, 100 + r)
        comm.connect_in_process(comms)
        rng = np.random.default_rng(5)
        sent = {0: [], 1: []}
        for r, c in enumerate(comms):
            offsets = np.sort(rng.choice(HALF // 64, size=40, replace=False)) * 64
            for k, off in enumerate(offsets):
                n = int(rng.integers(1, 4)) * 16
                c.push(0, C.command.write_signal(1 - r, n, int(off), HALF + int(off), 3, 1))
                sent[r].append((int(off), n))
        for r, c in enumerate(comms):
            c.wait_signal(3, len(sent[1 - r]), 10.0)
        for r, c in enumerate(comms):
            src = comms[1 - r].data()
            for off, n in sent[1 - r]:
                assert np.array_equal(c.data()[HALF + off:HALF + off + n], src[off:off + n])
    finally:
        for c in comms:
            c.close()


def test_a_killed_copy_agent_fails_the_proxy_with_an_error_naming_the_agent():
    C = native.module()
    c = _comm()
    try:
        c.connect_infos([c.local_infos()])
        C.unlink_shared_host_memory_names()
        c.start()
        pid = c.copy_agent.pid
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        c.proxy.push(0, C.command.write_signal(0, 256, 0, HALF, 0, 1))
        deadline = time.monotonic() + 10
        while not c.proxy.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.proxy.failed
        assert re.search(rf"copy agent \(pid {pid}\) of segment .* is gone with copies of lane 0 unfinished",
                         c.proxy.error), c.proxy.error
    finally:
        c.close(deliver=False)


def test_a_copy_agent_that_cannot_start_says_why():
    with pytest.raises(CopyAgentError, match=r"could not start: .*(cudaSetDevice\(4096\)|no CUDA)"):
        CopyAgent(1, 4096)


def test_a_lane_of_the_agent_serves_one_endpoint_only():
    agent = CopyAgent(1, -1)
    first = _comm(env={}, loopback_copy_agent=agent.name)
    try:
        with pytest.raises(native.module().ProxyError, match="lane 0 of .* is held by another endpoint"):
            _comm(env={}, loopback_copy_agent=agent.name)
    finally:
        first.close()
        agent.close()


def test_an_endpoint_without_an_agent_copies_itself_and_the_setting_is_checked():
    C = native.module()
    c = _comm(env={})  # auto: host memory is copied by the proxy threads
    try:
        assert c.copy_agent is None and c.options["loopback_copy_agent"] == ""
        _random_halves(c, 11)
        c.connect_infos([c.local_infos()])
        c.start()
        c.proxy.push(0, C.command.write_signal(0, 4096, 512, HALF + 1024, 2, 1))  # (to itself: one rank)
        c.wait_signal(2, 1, 10.0)
        assert np.array_equal(c.data()[HALF + 1024:HALF + 1024 + 4096], c.data()[512:512 + 4096])
        assert not c.data()[HALF:HALF + 1024].any() and not c.data()[HALF + 1024 + 4096:].any()
    finally:
        c.close()
    with pytest.raises(native.module().ProxyError, match="copy agent"):
        _comm(env={}, loopback_copy_agent="/uccl_ep.no-such-segment")


def test_the_agent_exits_on_its_own_when_its_client_process_dies():
    script = textwrap.dedent("""
        import sys, time
        from uccl_ep_train.loopback_copy_agent import CopyAgent
        a = CopyAgent(2, -1)
        print(a.pid, flush=True)
        time.sleep(60)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        agent_pid = int(client.stdout.readline())
        client.kill()
        client.wait(10)
        assert _gone(agent_pid), f"the copy agent {agent_pid} outlived its client"
    finally:
        if client.poll() is None:
            client.kill()
