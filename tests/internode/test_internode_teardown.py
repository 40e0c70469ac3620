"""NativeInternodeBackend.destroy() delivers this rank's outgoing writes before it stops the proxy.

A combine returns once this rank's incoming partial sums arrived; the partial sums it sends may still be in its
proxy. Stopping the proxy first dropped them, and the peer waited until its GPU deadline (docs/internode.md,
"Teardown"; the host-core side is tests/host_core/test_teardown.py)."""
from uccl_ep_train.internode import NativeInternodeBackend


class _Context:
    def __init__(self, calls, error=""):
        self.calls, self.error = calls, error

    def proxy_wait_idle(self, timeout_secs):
        self.calls.append(("proxy_wait_idle", timeout_secs))

    def proxy_error(self):
        return self.error

    def destroy(self):
        self.calls.append("destroy")


def _backend(calls, error=""):
    b = NativeInternodeBackend.__new__(NativeInternodeBackend)  # no GPU: only the teardown order is exercised
    b._destroyed, b._cx, b.cpu_timeout, b.rank = False, _Context(calls, error), 7.0, 0
    b._drain = lambda what: calls.append("drain")
    return b


def test_destroy_drains_the_stream_then_waits_for_its_proxy_to_deliver_then_frees():
    calls = []
    _backend(calls).destroy()
    assert calls == ["drain", ("proxy_wait_idle", 7.0), "destroy"]


def test_destroy_of_a_failed_proxy_frees_at_once_and_a_second_destroy_does_nothing():
    calls = []
    b = _backend(calls, error="peer rank 1 died")
    b.destroy()
    b.destroy()
    assert calls == ["drain", "destroy"]
