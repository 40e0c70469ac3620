"""uccl_ep_train.Buffer (reference backend on CPU): DeepEP v1 tuples and semantics, events, configs, backend selection,
autograd, and the argument checks (each bad argument raises before any communication, naming the fix).

One gloo group per topology runs every check; each test asserts one named outcome on every rank.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.reference import ep_oracle as oracle
from tests.reference.check_group import checks_in, expect, outcomes_fixture, run_named, soft

TOPOLOGIES = {"1x4": (4, 4), "2x2": (4, 2)}
NUM_EXPERTS, NUM_TOPK, HIDDEN = 16, 3, 256


def _inputs(kind, rank, world, dtype=torch.bfloat16):
    return oracle.make_inputs(kind, rank, world, NUM_EXPERTS, NUM_TOPK, HIDDEN, dtype, 3, 31 * rank + 5)


def _buffer(g, **kwargs):
    from uccl_ep_train import Buffer
    return Buffer(None, ranks_per_node=g, **kwargs)


# ---------------------------------------------------------------------------------------------------------- checks

def check_deepep_tuples_and_results(rank, world, g):
    from uccl_ep_train import EventOverlap
    buf = _buffer(g)
    for kind in oracle.ROUTINGS:
        x, topk, w = _inputs(kind, rank, world)
        wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
        layout = buf.get_dispatch_layout(topk, NUM_EXPERTS)
        per_rank, per_node, per_expert, in_rank, ev = layout
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                           topk_weights=w, expert_alignment=2)
        recv_x, recv_topk, recv_w, counts, handle, ev2 = out
        combined, combined_w, ev3 = buf.combine(recv_x, handle, recv_w)
        x2 = x * 2
        cached = buf.dispatch(x2, handle=handle)
        with soft(kind):
            e_rank, e_node, e_expert, e_in_rank = oracle.expected_layout(wld, rank)
            assert len(layout) == 5 and isinstance(ev, EventOverlap)
            assert per_rank.tolist() == e_rank and per_expert.tolist() == e_expert
            assert torch.equal(in_rank, e_in_rank)
            assert (per_node is None) if world == g else per_node.tolist() == e_node
            assert len(out) == 6 and isinstance(ev2, EventOverlap) and isinstance(counts, list)
            exp = oracle.expected_receive(wld, rank)
            want = torch.stack(exp["x"]) if exp["x"] else x.new_zeros(0, HIDDEN)
            assert torch.equal(recv_x, want) and recv_topk.tolist() == exp["topk"]
            assert recv_w.tolist() == exp["weights"]
            per = [sum(ids.count(e) for ids in exp["topk"]) for e in range(NUM_EXPERTS // world)]
            assert counts == [-(-c // 2) * 2 for c in per]
            distinct = in_rank.sum(1, keepdim=True).double()
            assert torch.equal(combined, (x.double() * distinct).to(torch.bfloat16))
            assert torch.equal(combined_w, torch.where(topk >= 0, w, torch.zeros_like(w)))
            assert isinstance(ev3, EventOverlap)
            assert len(cached) == 6 and cached[1:5] == (None, None, None, None)
            assert torch.equal(cached[0], recv_x * 2)


def check_fp8_tuple_round_trips_through_buffer(rank, world, g):
    buf = _buffer(g)
    x, topk, w = _inputs("random", rank, world, dtype=torch.float32)
    x_fp8, scales = x.to(torch.float8_e4m3fn), torch.rand(x.size(0), HIDDEN // 128) + 1
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)
    (recv_fp8, recv_scales), recv_topk, recv_w, counts, handle, _ = buf.dispatch(
        (x_fp8, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk, topk_weights=w)
    (c_fp8, c_scales), *rest = buf.dispatch((x_fp8, scales), handle=handle)
    wld = oracle.gather_world(x_fp8, topk, w, NUM_EXPERTS, g, x_scales=scales)
    with soft():
        exp = oracle.expected_receive(wld, rank)
        assert recv_fp8.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert [r.view(torch.uint8).tolist() for r in recv_fp8] == [r.view(torch.uint8).tolist() for r in exp["x"]]
        assert torch.equal(recv_scales, torch.stack(exp["scales"]))
        assert torch.equal(c_fp8.view(torch.uint8), recv_fp8.view(torch.uint8)) and torch.equal(c_scales, recv_scales)
        assert rest[:4] == [None, None, None, None]


def check_expert_major_and_num_worst_tokens(rank, world, g):
    buf = _buffer(g)
    x, topk, w = _inputs("drops", rank, world, dtype=torch.float32)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)
    em_x, em_expert, em_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
        topk_weights=w, expert_alignment=4, expert_major=True)
    combined, combined_w, _ = buf.combine(em_x, handle, em_w)
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, num_worst_tokens=200)
    wld = oracle.gather_world(x, topk, w, NUM_EXPERTS, g)
    with soft():
        exp = oracle.expected_expert_major(wld, rank, 4)
        assert counts == exp["counts"] and em_expert.tolist() == exp["expert"] and em_w.tolist() == exp["weights"]
        assert em_x.size(0) == sum(counts) and em_expert.dim() == 1
        pairs = (topk >= 0).sum(1, keepdim=True).double()
        torch.testing.assert_close(combined.double(), x.double() * pairs, rtol=1e-6, atol=1e-5)
        assert torch.equal(combined_w, torch.where(topk >= 0, w, torch.zeros_like(w)))
        assert worst[0].size(0) == 200 and worst[3] == []


def check_autograd_through_buffer_matches_reference(rank, world, g):
    from uccl_ep_train import reference as ref
    buf = _buffer(g)
    for expert_major in (False, True):
        x, topk, w = _inputs("random", rank, world, dtype=torch.float32)
        cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
        grads = []
        for use_buffer in (True, False):
            xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            if use_buffer:
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)
                rx, _, rw, _, handle, _ = buf.dispatch(xl, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=topk,
                                                       topk_weights=wl, expert_major=expert_major)
                scale = rw[:, None] if expert_major else rw.sum(1, keepdim=True)
                out = buf.combine(rx * (scale + 1), handle)[0]
            else:
                res = ref.dispatch_with_grad(xl, topk, wl, num_experts=NUM_EXPERTS, ranks_per_node=g,
                                             expert_major=expert_major)
                rw = res.recv_topk_weights
                scale = rw[:, None] if expert_major else rw.sum(1, keepdim=True)
                out = ref.combine_with_grad(res.recv_x * (scale + 1), res.handle)[0]
            (out * cot).sum().backward()
            grads.append((xl.grad, wl.grad))
        with soft(f"expert_major={expert_major}"):
            assert grads[0][0] is not None and grads[0][1] is not None, "gradients must reach x and topk_weights"
            torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
            torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


def check_events_and_stream_arguments(rank, world, g):
    from uccl_ep_train import Buffer, EventOverlap
    buf = _buffer(g)
    x, topk, w = _inputs("random", rank, world)
    prev = Buffer.capture()
    per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(topk, NUM_EXPERTS, previous_event=prev,
                                                                   async_finish=True, allocate_on_comm_stream=True)
    recv_x, _, _, _, handle, ev2 = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=topk,
                                                previous_event=ev, async_finish=True)
    combined, _, ev3 = buf.combine(recv_x, handle, async_finish=True)
    with soft():
        for event in (prev, ev, ev2, ev3):
            assert isinstance(event, EventOverlap) and event.event is None  # CPU: already complete
            event.current_stream_wait()
            with event:
                pass
        assert torch.equal(combined, (x.double() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))


def check_backend_selection(rank, world, g):
    from uccl_ep_train.backends import BackendUnavailable
    with soft("auto"):
        assert _buffer(g).backend.name == "reference", "auto must pick the reference on CPU"
    with soft("forced reference"):
        assert _buffer(g, backend="reference").backend.name == "reference"
    with soft("forced native"):
        try:
            _buffer(g, backend="native")
        except BackendUnavailable as exc:
            assert "native backend" in str(exc) and "UCCL_EP_BACKEND=reference" in str(exc), str(exc)
        else:
            raise AssertionError("backend=native on CPU must raise BackendUnavailable")


def check_backend_setting_from_environment(rank, world, g):
    from uccl_ep_train.backends import BackendUnavailable
    with soft():
        try:
            _buffer(g)  # UCCL_EP_BACKEND=native is set for this group's processes
        except BackendUnavailable as exc:
            assert "UCCL_EP_BACKEND=reference" in str(exc)
        else:
            raise AssertionError("UCCL_EP_BACKEND=native must be honoured")


# Each case: (callable building the bad call, exception type, text the message must contain).
def _argument_cases(rank, world, g):
    from uccl_ep_train import Buffer, Config
    buf = _buffer(g)
    x, topk, w = _inputs("random", rank, world)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    ok = dict(layout, topk_idx=topk, topk_weights=w)
    handle = buf.dispatch(x, **ok)[4]
    small = _buffer(g, num_nvl_bytes=1 << 16)
    t = x.size(0)
    return {
        "payload_dtype": (lambda: buf.dispatch(x.half(), **ok), TypeError, "must be torch.bfloat16 or torch.float32"),
        "fp8_scales_dtype": (lambda: buf.dispatch((x.to(torch.float8_e4m3fn), torch.ones(t, 2, dtype=torch.float64)),
                                                  **ok), TypeError, "x[1] (FP8 scales) has dtype torch.float64"),
        "fp8_scales_shape": (lambda: buf.dispatch((x.to(torch.float8_e4m3fn), torch.ones(t, 3)), **ok), ValueError,
                             "dimension 1 must be 2"),
        "fp8_hidden_multiple": (lambda: buf.dispatch((x[:, :100].contiguous().to(torch.float8_e4m3fn),
                                                      torch.ones(t, 1)), **ok), ValueError, "multiple of 128"),
        "topk_idx_dtype": (lambda: buf.get_dispatch_layout(topk.int(), NUM_EXPERTS), TypeError,
                           "topk_idx has dtype torch.int32; it must be torch.int64"),
        "topk_weights_dtype": (lambda: buf.dispatch(x, **dict(ok, topk_weights=w.double())), TypeError,
                               "topk_weights has dtype torch.float64"),
        "x_not_2d": (lambda: buf.dispatch(x[0], **ok), ValueError, "x must be 2-D"),
        "topk_rows_mismatch": (lambda: buf.dispatch(x[:-1].contiguous(), **ok), ValueError,
                               f"topk_idx has {t} rows but x has {t - 1} tokens"),
        "topk_weights_shape": (lambda: buf.dispatch(x, **dict(ok, topk_weights=w[:, :2].contiguous())), ValueError,
                               "topk_weights has shape"),
        "device": (lambda: buf.dispatch(x.to("meta"), **ok), ValueError, "move it with .to('cpu')"),
        "contiguity": (lambda: buf.dispatch(x.t().contiguous().t(), **ok), ValueError, "x.contiguous()"),
        "expert_id_too_large": (lambda: buf.get_dispatch_layout(torch.full_like(topk, NUM_EXPERTS), NUM_EXPERTS),
                                ValueError, f"must be in [-1, {NUM_EXPERTS})"),
        "expert_id_below_minus_one": (lambda: buf.get_dispatch_layout(torch.full_like(topk, -2), NUM_EXPERTS),
                                      ValueError, "[-2, -2]"),
        "repeated_expert": (lambda: buf.get_dispatch_layout(torch.zeros_like(topk), NUM_EXPERTS), ValueError,
                            "same expert twice"),
        # layout checked these ids; dispatch checks them again because they changed in place since
        "expert_id_changed_after_layout": (lambda: _dispatch_after_in_place_change(buf, x, topk, w), ValueError,
                                           f"must be in [-1, {NUM_EXPERTS})"),
        "experts_not_divisible": (lambda: buf.get_dispatch_layout(topk, world * 4 + 1), ValueError,
                                  f"must be divisible by the number of ranks ({world})"),
        "hidden_exceeds_buffer": (lambda: small.dispatch(x, **ok), ValueError, "needs num_nvl_bytes >= "),
        "cached_handle_tokens": (lambda: buf.dispatch(x[:-1].contiguous(), handle=handle), ValueError,
                                 "the handle was made for"),
        "cached_with_topk": (lambda: buf.dispatch(x, handle=handle, topk_idx=topk), ValueError,
                             "pass topk_idx=None"),
        "combine_rows": (lambda: buf.combine(torch.zeros(handle.num_recv_rows + 1, HIDDEN, dtype=torch.bfloat16),
                                             handle), ValueError, "combine takes the rows dispatch returned"),
        "combine_without_handle": (lambda: buf.combine(x, None), ValueError, "needs the handle"),
        "missing_layout": (lambda: buf.dispatch(x, topk_idx=topk), ValueError,
                           "needs num_tokens_per_rank (from Buffer.get_dispatch_layout)"),
        "is_token_in_rank_shape": (lambda: buf.dispatch(x, **dict(ok, is_token_in_rank=in_rank[:, :1].contiguous())),
                                   ValueError, "is_token_in_rank has shape"),
        "allocate_on_comm_stream_needs_event": (
            lambda: buf.dispatch(x, **ok, allocate_on_comm_stream=True, async_finish=True), ValueError,
            "requires previous_event"),
        "previous_event_type": (lambda: buf.dispatch(x, **ok, previous_event=object()), TypeError,
                                "previous_event must be an EventOverlap"),
        "expert_alignment": (lambda: buf.dispatch(x, **ok, expert_alignment=0), ValueError,
                             "expert_alignment=0 must be an int >= 1"),
        "num_worst_tokens": (lambda: buf.dispatch(x, **ok, num_worst_tokens=-1), ValueError,
                             "num_worst_tokens=-1 must be an int >= 0"),
        "odd_num_sms": (lambda: Buffer.set_num_sms(7), ValueError, "must be an even int"),
        "config_chunks": (lambda: Config(24, 8, 8), ValueError, "num_max_nvl_chunked_send_tokens"),
        "low_latency_mode": (lambda: _buffer(g, low_latency_mode=True), NotImplementedError, "low_latency_mode"),
        "ranks_per_node_divides": (lambda: _buffer(3), ValueError, "ranks_per_node=3 must divide the group size"),
    }


def _dispatch_after_in_place_change(buf, x, topk, w):
    ids = topk.clone()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, NUM_EXPERTS)
    ids[0, 0] = NUM_EXPERTS
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=ids, topk_weights=w)


def check_argument_errors(rank, world, g):
    outcomes = {}
    for name, (call, exc_type, text) in _argument_cases(rank, world, g).items():
        try:
            call()
        except exc_type as exc:
            outcomes[name] = None if text in str(exc) else f"message {str(exc)!r} lacks {text!r}"
        except Exception as exc:  # noqa: BLE001 - the wrong type is the failure being reported
            outcomes[name] = f"raised {type(exc).__name__}: {exc} (expected {exc_type.__name__})"
        else:
            outcomes[name] = "did not raise"
    return outcomes


CHECKS = checks_in(globals(), leave_out=("check_argument_errors", "check_backend_setting_from_environment"))
ARGUMENT_CASES = ["payload_dtype", "fp8_scales_dtype", "fp8_scales_shape", "fp8_hidden_multiple", "topk_idx_dtype",
                  "topk_weights_dtype", "x_not_2d", "topk_rows_mismatch", "topk_weights_shape", "device", "contiguity",
                  "expert_id_too_large", "expert_id_below_minus_one", "repeated_expert",
                  "expert_id_changed_after_layout", "experts_not_divisible",
                  "hidden_exceeds_buffer", "cached_handle_tokens", "cached_with_topk", "combine_rows",
                  "combine_without_handle", "missing_layout", "is_token_in_rank_shape",
                  "allocate_on_comm_stream_needs_event", "previous_event_type", "expert_alignment",
                  "num_worst_tokens", "odd_num_sms", "config_chunks", "low_latency_mode", "ranks_per_node_divides"]


def run_checks(rank, world, g):
    outcomes = run_named(CHECKS, rank, world, g)
    arg = check_argument_errors(rank, world, g)
    outcomes.update({f"arg:{k}": v for k, v in arg.items()})
    return outcomes


def run_env_check(rank, world, g):
    return run_named({"env": check_backend_setting_from_environment}, rank, world, g)


outcomes = outcomes_fixture(run_checks, TOPOLOGIES)


def test_buffer_returns_deepep_tuples_matching_the_oracle(outcomes):
    expect(outcomes, "deepep_tuples_and_results")


def test_buffer_fp8_tuple_payload_passes_through_and_caches(outcomes):
    expect(outcomes, "fp8_tuple_round_trips_through_buffer")


def test_buffer_expert_major_receive_and_num_worst_tokens_padding_match_the_reference(outcomes):
    expect(outcomes, "expert_major_and_num_worst_tokens")


def test_buffer_dispatch_and_combine_are_differentiable_to_x_and_weights(outcomes):
    expect(outcomes, "autograd_through_buffer_matches_reference")


def test_events_are_noops_on_cpu_and_stream_arguments_are_accepted(outcomes):
    expect(outcomes, "events_and_stream_arguments")


def test_backend_auto_picks_reference_on_cpu_and_native_errors_clearly(outcomes):
    expect(outcomes, "backend_selection")


@pytest.mark.parametrize("case", ARGUMENT_CASES)
def test_bad_argument_raises_before_communication_saying_what_to_change(outcomes, case):
    expect(outcomes, f"arg:{case}")


def test_uccl_ep_backend_native_environment_forces_native_backend():
    results = run_distributed(run_env_check, 2, 2, timeout=60, env={"UCCL_EP_BACKEND": "native"})
    expect(results, "env")


def test_recommended_configs_use_the_buffers_sms_and_size_hints_grow_with_tokens_and_need_no_rdma_on_one_node():
    from uccl_ep_train import Buffer, Config
    for ranks in (1, 2, 3, 4, 8, 12, 16, 64, 256):
        for config in (Buffer.get_dispatch_config(ranks), Buffer.get_combine_config(ranks)):
            assert isinstance(config, Config) and config.num_sms == Buffer.num_sms
    config = Config(24, 6, 256, 6, 128)
    small, large = config.get_nvl_buffer_size_hint(2048, 8), config.get_nvl_buffer_size_hint(14336, 8)
    assert 0 < small < large and large % 128 == 0
    assert config.get_rdma_buffer_size_hint(14336, 8) == 0, "one node needs no network buffer"
    assert config.get_rdma_buffer_size_hint(14336, 16, ranks_per_node=8) > 0
    assert Config(24, 6, 256, 6, 100).num_max_rdma_chunked_recv_tokens == 102, "rounded up to whole chunks"


def test_set_num_sms_changes_recommended_configs():
    from uccl_ep_train import Buffer
    before = Buffer.num_sms, Buffer._num_sms_from_user
    try:
        Buffer.set_num_sms(32)
        assert Buffer.get_dispatch_config(2).num_sms == 32 and Buffer.get_combine_config(8).num_sms == 32
    finally:
        Buffer.num_sms, Buffer._num_sms_from_user = before
