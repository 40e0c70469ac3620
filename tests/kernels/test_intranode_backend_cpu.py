"""NativeIntranodeBackend's host path on CPU: the real backend (uccl_ep_train/intranode.py) over
fake_intranode_native, a stand-in for ``_C.kernels`` whose buffers are shared memory between the ranks' processes
(gloo for the handle exchange), against reference.py on the same inputs, on one node of 2 and 4 ranks.

Covered: the layout kernel, notify's counts and prefix matrix, direct placement (self-direct rows included), the
sync-free padding to num_worst_tokens, FP8 payload with scales, the expert-major receive with alignment and its
two-launch combine, cached dispatch, weighted and unweighted combine, and the error word (deadline, overflow).
Every output must equal the reference bit for bit.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.distributed import run_distributed
from tests.internode.internode_cases import ALL, compare_cases

import fake_intranode_native as fake

NVL = 8 << 20
ENV = {"UCCL_EP_GPU_TIMEOUT_SECS": "30"}


class _WithTraffic:
    """compare_cases compares ``last_traffic`` too; the intranode backend keeps no traffic report, so this derives
    one from what the native dispatch left in its handle (is_token_in_rank: rows sent; rank_prefix_matrix: rows
    received), i.e. the reference's one-node byte counts: a check of those two matrices, not a copy of the reference."""

    def __init__(self, nat) -> None:
        self.nat, self.last_traffic = nat, None

    def get_dispatch_layout(self, topk_idx, num_experts):
        return self.nat.get_dispatch_layout(topk_idx, num_experts)

    def _report(self, h, row_bytes, forward):
        from uccl_ep_train.reference import TrafficReport

        me, R = self.nat.rank, self.nat.num_ranks
        sent = h.is_token_in_rank.sum(0).tolist()
        col = h.rank_prefix_matrix[:, me].tolist()
        recv = [col[s] - (col[s - 1] if s else 0) for s in range(R)]
        other = sum(c for r, c in enumerate(sent if forward else recv) if r != me)
        return TrafficReport(other * row_bytes, 0, sum(recv) * row_bytes)

    def dispatch(self, args):
        r = self.nat.dispatch(args)
        row = args.x.shape[1] * args.x.element_size()
        if args.x_scales is not None:
            row += args.x_scales.shape[1] * 4
        self.last_traffic = self._report(r.handle, row, True)
        return r

    def combine(self, x, handle, topk_weights, config):
        out = self.nat.combine(x, handle, topk_weights, config)
        self.last_traffic = self._report(handle, x.shape[1] * x.element_size(), False)
        return out


def _backends(rank, world, nvl=NVL):
    import torch.distributed as dist

    from uccl_ep_train.backends import BackendContext
    from uccl_ep_train.intranode import NativeIntranodeBackend
    from uccl_ep_train.reference import ReferenceBackend
    from uccl_ep_train.settings import load_settings

    fake.install()
    import uccl_ep_train.intranode as intranode

    intranode.COPY_ENGINE_MIN_BYTES = 0  # the copy-engine receive at these small shapes too
    ctx = BackendContext(group=dist.group.WORLD, rank=rank, num_ranks=world, ranks_per_node=world,
                         device=torch.device("cpu"), num_nvl_bytes=nvl, num_rdma_bytes=0, settings=load_settings())
    return NativeIntranodeBackend(ctx), ReferenceBackend(ctx)


def _cases(rank, world, cases, iters):
    nat, ref = _backends(rank, world)
    try:
        done = compare_cases(_WithTraffic(nat), ref, torch.device("cpu"), rank, world, cases, iters, unweighted=True)
        return done, dict(nat._cx.launches), nat._cx.name
    finally:
        nat.destroy()


# (the third: many 16 KiB chunks, each with its flag)
@pytest.mark.parametrize("world,copy_engine,chunk,streams", [(2, "1", "4194304", "2"), (4, "1", "4194304", "2"),
                                                             (2, "1", "16384", "3"), (2, "0", "4194304", "2")])
def test_every_output_matches_reference_over_routings_fp8_worst_tokens_and_expert_major(world, copy_engine, chunk,
                                                                                       streams):
    out = run_distributed(_cases, world, ALL, 1, timeout=120,
                          env={**ENV, "UCCL_EP_COMBINE_COPY_ENGINE": copy_engine, "UCCL_EP_COPY_CHUNK_BYTES": chunk,
                               "UCCL_EP_COPY_STREAMS": streams, "UCCL_EP_DISPATCH_COPY_ENGINE": copy_engine})
    assert all(done == len(ALL) for done, _, _ in out)
    for _, launches, _ in out:  # every kernel of the backend ran through the stand-in
        assert {"notify", "dispatch_send", "dispatch_recv", "barrier", "expert_major", "expert_major_partials",
                "combine_send", "combine_reduce"} <= set(launches), launches
        # normal and cached handles combine through the copy engine unless it is off; sync-free ones never do
        assert ("combine_copy_engine" in launches) == (copy_engine == "1"), launches
        # and the peers' rows of normal and cached rank-major dispatches leave the receive area the same way
        assert ("dispatch_recv_copy_engine" in launches) == (copy_engine == "1"), launches
    left = [name for _, _, name in out if os.path.exists(os.path.join("/dev/shm", name))]
    assert not left, f"shared memory left behind after destroy: {left}"


def _expert_major_details(rank, world):
    """The handle's expert-major fields and partial sums, which compare_cases does not look at."""
    from uccl_ep_train.backends import DispatchArgs

    nat, ref = _backends(rank, world)
    try:
        g = torch.Generator().manual_seed(11 + rank)
        T, H, K, E = 70 + 9 * rank, 128, 3, 4 * world
        idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
        idx[torch.rand((T, K), generator=g) < 0.2] = -1
        x = torch.randn((T, H), generator=g).to(torch.bfloat16)
        w = torch.rand((T, K), generator=g)
        res = []
        for worst in (0, T * world * K + (E // world) * 8):
            outs = []
            for b in (nat, ref):
                tpr, tpn, tpe, itr = b.get_dispatch_layout(idx, E)
                outs.append(b.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w, expert_alignment=8,
                                                    num_worst_tokens=worst, expert_major=True)))
            hn, hr = outs[0].handle, outs[1].handle
            assert hn.num_recv_rows == hr.num_recv_rows
            assert torch.equal(hn.num_recv_tokens_per_expert, hr.num_recv_tokens_per_expert.to(torch.int32))
            assert torch.equal(hn.expert_major_token, hr.expert_major_token)
            assert torch.equal(hn.expert_major_slot, hr.expert_major_slot)
            y = torch.randn((hn.num_recv_rows, H), generator=g)
            n = int(hn.recv_info[0])
            slot_of = hn.slot_of[:n].long()
            for dt in (torch.bfloat16, torch.float32):
                part, rm_w = nat._expert_major_partials(y.to(dt), hn, outs[0].recv_topk_weights, 0)
                acc = torch.zeros((n, H))
                for k in range(K):
                    sel = slot_of[:, k] >= 0
                    acc[sel] += y.to(dt)[slot_of[sel, k]].float()
                assert torch.equal(part[:n], acc.to(dt))
                assert torch.equal(rm_w[:n], torch.where(slot_of >= 0, outs[0].recv_topk_weights[slot_of.clamp(min=0)],
                                                         torch.zeros(())))
                # combine of fp32 expert-major rows: the same sum as the reference, rounded once
                cn = nat.combine(y.to(dt), hn, outs[0].recv_topk_weights, None)
                cr = ref.combine(y.to(dt), hr, outs[1].recv_topk_weights, None)
                assert torch.equal(cn[0], cr[0]) and torch.equal(cn[1], cr[1])
            res.append(hn.num_recv_rows)
        return res
    finally:
        nat.destroy()


def test_expert_major_handle_positions_partials_and_fp32_combine_equal_the_reference():
    out = run_distributed(_expert_major_details, 4, timeout=120, env=ENV)
    assert all(rows[0] > 0 and rows[1] >= rows[0] for rows in out), out


def _timed_error(call):
    """(seconds, message of the IntranodeError that ``call`` raised, or "no error")."""
    from uccl_ep_train.intranode import IntranodeError

    t0 = time.time()
    try:
        call()
        return time.time() - t0, "no error"
    except IntranodeError as exc:
        return time.time() - t0, str(exc)


def _absent_peer(rank, world):
    from uccl_ep_train.backends import DispatchArgs

    nat, _ = _backends(rank, world)
    try:
        if rank == world - 1:
            time.sleep(3)  # never joins the dispatch: to the others it is gone
            return None
        idx = torch.randint(0, 2 * world, (32, 2))
        x = torch.randn((32, 64)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 2 * world)
        area = nat._cx._data(rank)
        area.fill_(0x5A)
        # expert-major: its send is queued right behind notify, before the host sees the counts
        timed = _timed_error(lambda: nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None,
                                                               expert_major=True)))
        time.sleep(1)  # the other surviving rank has run its send (if it did) by now
        # notify's stale counts make that send skip, so no rank wrote a row into any receive area
        return timed, bool((area == 0x5A).all()), nat._cx.launches.get("dispatch_send", 0)
    finally:
        nat.destroy()


def test_a_rank_that_never_joins_makes_the_others_raise_a_timeout_naming_the_notify_barrier_and_the_peer():
    env = dict(ENV, UCCL_EP_GPU_TIMEOUT_SECS="0.5")
    out = run_distributed(_absent_peer, 3, timeout=60, env=env)
    for rank in range(2):
        (elapsed, err), area_untouched, sends = out[rank]
        assert sends == 1, f"rank {rank}: the send was not queued behind notify ({sends} launches)"
        assert area_untouched, f"rank {rank}: a send behind the timed-out notify wrote into the receive area"
        # the dispatch that timed out raises itself: the notify kernel publishes (stale) counts after its barrier
        # timed out, so the host reads the error word right after the counts instead of at the next call
        assert "GPU wait timed out" in err and "notify barrier" in err and "peer 2" in err, err
        assert elapsed < 3, elapsed


def _silent_copy_engine_peer(rank, world):
    """Rank 1 joins the copy-engine combine's barrier but copies nothing to rank 0 (its handle claims it holds no
    rows from rank 0), so rank 0's reduce waits for rows that never land."""
    from uccl_ep_train.backends import DispatchArgs

    nat, _ = _backends(rank, world)
    try:
        idx = torch.tensor([[0, 2]] * 16)  # every token to both ranks
        x = torch.randn((16, 64)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 2 * world)
        res = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, None))
        if rank == 1:  # claims rank 0 sent it nothing: it copies nothing back (its own sums are then wrong)
            res.handle.rows_from = [0] + res.handle.rows_from[1:]
        # the kernel reports into the error word; the host raises it
        return _timed_error(lambda: (nat.combine(res.recv_x, res.handle, None, None), nat._check_error()))
    finally:
        nat.destroy()


def test_copy_engine_combine_waiting_for_rows_that_never_land_raises_naming_the_peer_and_the_row_count():
    out = run_distributed(_silent_copy_engine_peer, 2, timeout=60,
                          env=dict(ENV, UCCL_EP_GPU_TIMEOUT_SECS="0.5", UCCL_EP_COMBINE_COPY_ENGINE="1"))
    elapsed, err = out[0]
    # rank 0 waited for row 16 of rank 1's block: the flag stayed 0
    assert "GPU wait timed out" in err and "copy-engine combine rows" in err and "peer 1" in err, err
    assert "counter 0, expected 16" in err, err
    assert elapsed < 3, elapsed
    assert out[1][1] == "no error", out[1]  # rank 1 needs nothing from rank 0 that it did not get


def _short_combine_input(rank, world):
    """Every rank passes one row fewer than its dispatch received: refused before the barrier, so nobody waits."""
    from uccl_ep_train.backends import DispatchArgs

    nat, _ = _backends(rank, world)
    try:
        idx = torch.tensor([[0, 2]] * 8)
        x = torch.randn((8, 64)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 2 * world)
        res = nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, torch.rand((8, 2))))
        before = dict(nat._cx.launches)
        try:
            nat.combine(res.recv_x[:-1], res.handle, res.recv_topk_weights, None)
        except ValueError as exc:
            return str(exc), nat._cx.launches == before
        return "no error", False
    finally:
        nat.destroy()


def test_copy_engine_combine_refuses_fewer_rows_than_dispatch_received_before_any_launch():
    out = run_distributed(_short_combine_input, 2, timeout=60, env=dict(ENV, UCCL_EP_COMBINE_COPY_ENGINE="1"))
    for msg, nothing_launched in out:
        assert "x has 15 rows" in msg and "received 16" in msg, msg
        assert nothing_launched  # no barrier, no copy: the peer is not left waiting


def _too_small(rank, world):
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.intranode import nvl_bytes_needed

    T, H = 40, 128
    nat, _ = _backends(rank, world, nvl=nvl_bytes_needed(T, world, H, world) // 2)
    try:
        idx = (torch.arange(world) * 2).expand(T, world).contiguous()  # every token to every rank
        x = torch.randn((T, H)).to(torch.bfloat16)
        tpr, tpn, tpe, itr = nat.get_dispatch_layout(idx, 2 * world)
        try:
            nat.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, torch.rand((T, world))))
        except ValueError as exc:
            ok = nat._cx.error_message() == ""  # the overflow record was cleared, reported as a ValueError instead
            return str(exc), ok
        return "no error", False
    finally:
        nat.destroy()


def test_half_the_hinted_buffer_refuses_the_worst_routing_with_the_size_needed_on_every_rank():
    out = run_distributed(_too_small, 2, timeout=60, env=ENV)
    for msg, cleared in out:
        assert "a rank receives 80" in msg and "use num_nvl_bytes >=" in msg and cleared, msg


def _worst_in_exactly_the_hint(rank, world, combine_element_size, combine_dtype):
    """Every token to every rank in a buffer of exactly Buffer.get_nvl_bytes_hint for combines of
    ``combine_element_size``, the combine's x in ``combine_dtype``: (the combined x equals the reference's, or the
    refusal's message, and whether nothing was launched for the refused combine)."""
    from uccl_ep_train.backends import DispatchArgs
    from uccl_ep_train.buffer import Buffer

    T, H = 40, 1024  # (a float32 combine row is then wider than the dispatch row that sets the BF16 hint)
    nat, ref = _backends(rank, world, nvl=Buffer.get_nvl_bytes_hint(T, H, world, world,
                                                                    combine_element_size=combine_element_size))
    try:
        g = torch.Generator().manual_seed(5 + rank)
        idx = (torch.arange(world) * 2).expand(T, world).contiguous()
        x, w = torch.randn((T, H), generator=g).to(torch.bfloat16), torch.rand((T, world), generator=g)
        out = []
        for b in (ref, nat):
            tpr, tpn, tpe, itr = b.get_dispatch_layout(idx, 2 * world)
            r = b.dispatch(DispatchArgs(x, None, None, tpr, tpn, itr, tpe, idx, w))
            before = dict(nat._cx.launches)
            try:
                out.append(b.combine(r.recv_x.to(getattr(torch, combine_dtype)), r.handle, r.recv_topk_weights,
                                     None)[0])
            except ValueError as exc:
                return str(exc), nat._cx.launches == before
        return torch.equal(out[0], out[1]), True
    finally:
        nat.destroy()


def test_the_worst_routing_combines_in_exactly_the_hint_and_a_float32_combine_needs_the_float32_hint():
    """The hint sizes combines in BF16 by default (a float32 combine area is twice as large and set the hint for
    every caller until session 49); a float32 combine in it is refused with the size it needs before any launch, and
    fits the hint asked with combine_element_size=4."""
    from uccl_ep_train.buffer import Buffer

    assert run_distributed(_worst_in_exactly_the_hint, 2, 2, "bfloat16", timeout=60, env=ENV) == [(True, True)] * 2
    for msg, nothing_launched in run_distributed(_worst_in_exactly_the_hint, 2, 2, "float32", timeout=60, env=ENV):
        assert "need num_nvl_bytes >= " in msg and nothing_launched, msg
    assert run_distributed(_worst_in_exactly_the_hint, 2, 4, "float32", timeout=60, env=ENV) == [(True, True)] * 2
    with pytest.raises(ValueError, match="combine_element_size must be 2"):
        Buffer.get_nvl_bytes_hint(40, 256, 2, 2, combine_element_size=8)


def test_stand_in_layout_kernel_counts_each_token_once_per_rank_and_node_and_skips_dropped_ids():
    idx = torch.tensor([[0, 1, 5], [-1, 7, 6], [2, -1, 9]], dtype=torch.int64)  # 8 experts: 9 is out of range
    per_rank, per_node = torch.empty(4, dtype=torch.int32), torch.empty(2, dtype=torch.int32)
    per_expert, in_rank = torch.empty(8, dtype=torch.int32), torch.empty((3, 4), dtype=torch.bool)
    fake.dispatch_layout(idx.data_ptr(), 3, 3, 8, 4, 2, per_rank.data_ptr(), per_node.data_ptr(),
                         per_expert.data_ptr(), in_rank.data_ptr(), 0)
    assert per_expert.tolist() == [1, 1, 1, 0, 0, 1, 1, 1]
    assert in_rank.tolist() == [[True, False, True, False], [False, False, False, True], [False, True, False, False]]
    assert per_rank.tolist() == [1, 1, 1, 1] and per_node.tolist() == [2, 2]
    assert fake.dispatch_rows_capacity(1 << 20, 256, 2, 4) * (256 + 8 + 48 + 4) <= 1 << 20


def test_dispatch_receive_takes_the_copy_engine_only_for_host_known_rank_major_rows_of_enough_bytes():
    from types import SimpleNamespace

    from uccl_ep_train.intranode import COPY_ENGINE_MIN_BYTES, NativeIntranodeBackend

    be = SimpleNamespace(dispatch_copy_engine=True, rank=1, _k=fake)
    pick = NativeIntranodeBackend._copy_engine_rows
    x = torch.empty(0)
    row = 4096
    big = COPY_ENGINE_MIN_BYTES // row  # rows from each peer that just reach the threshold
    assert pick(be, x, [big, 5, 0], row) == [big, 5, 0]
    # the own rows already sit in the output: only the peers' bytes count
    assert pick(be, x, [big - 1, 10 ** 6, 0], row) == []
    assert pick(be, None, [0, big, 0], row) == []  # expert-major: no rank-major payload
    assert pick(be, x, None, row) == []  # sync-free: counts never reach the host
    assert pick(be, x, [big, 5, 0], row, scaled=True) == []  # FP8: the kernel copies it
    be.dispatch_copy_engine = False
    assert pick(be, x, [big, 5, 0], row) == []
