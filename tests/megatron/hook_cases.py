"""Per-rank bodies of the UCCLTokenDispatcher tests (module level, so tests.distributed can run them in children).

The oracle is a formulation with no communication at all: every rank builds every expert's weights from the same
seed and computes ``out[t] = sum_k probs[t, e_k] * expert_{e_k}(x[t])`` for its own tokens. The dispatcher path
runs the six hooks with the experts living only on their owner rank (and, with expert TP, split column/row-wise
over the TP ranks, each producing a partial sum as Megatron's experts do).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import torch

HIDDEN_DEFAULT = 16


def hook_cases(ep: int) -> dict:
    """The dispatcher-hook cases every backend must pass on ``ep`` ranks (expert TP 1): name -> (case function,
    kwargs). The small cases have two experts per rank; the expert-major and permute ones eight experts in all."""
    from uccl_ep_train.megatron.options import DispatcherOptions as O

    few = 2 * ep
    return {
        "identity": ("hooks_case", dict(ep=ep, etp=1, num_experts=few, topk=2, tokens=12, identity=True)),
        "expert_major": ("hooks_case", dict(ep=ep, etp=1, num_experts=8, topk=3, tokens=16,
                                            options=O(expert_major=True))),
        "local_permute": ("hooks_case", dict(ep=ep, etp=1, num_experts=8, topk=3, tokens=16,
                                             options=O(expert_major=False))),
        "sync_free_expert_major": ("hooks_case", dict(ep=ep, etp=1, num_experts=few, topk=2, tokens=8, kind="skewed",
                                                      options=O(sync_free=True, expert_major=True))),
        "sync_free_local_permute": ("hooks_case", dict(ep=ep, etp=1, num_experts=few, topk=2, tokens=8,
                                                       kind="skewed", options=O(sync_free=True, expert_major=False))),
        "fp8": ("hooks_case", dict(ep=ep, etp=1, num_experts=few, topk=2, tokens=8, hidden=128,
                                   options=O(fp8_dispatch=True))),
        # Megatron's router dropped tokens over capacity (factor 0.5: 2 per expert from each rank, 8 tokens x top-2
        # over 4 experts), so sync-free receives are sized by the capacity, not the worst case; "skewed" routing
        # fills the first rank's experts to it
        "sync_free_capacity_expert_major": ("hooks_case", dict(
            ep=ep, etp=1, num_experts=few, topk=2, tokens=8, kind="skewed", capacity_factor=0.5,
            options=O(sync_free=True, expert_major=True))),
        "sync_free_capacity_local_permute": ("hooks_case", dict(
            ep=ep, etp=1, num_experts=few, topk=2, tokens=8, kind="skewed", capacity_factor=0.5,
            options=O(sync_free=True, expert_major=False))),
    }


def capacity_bound_rows(kw: dict, world: int) -> int:
    """Rows each rank hands its experts in a sync-free capacity case of hook_cases (``kw``, on ``world`` ranks), as
    Megatron's router bounds them: each expert takes at most ceil(tokens x top-k / experts x factor) tokens from a
    rank, so a rank receives at most local experts x ranks x that; the local permute then expands each row over
    the top-k slots."""
    E, K, T = kw["num_experts"], kw["topk"], kw["tokens"]
    capacity = min(T, -(-T * K * kw["capacity_factor"] // E))
    rows = (E // world) * world * int(capacity)
    return rows if kw["options"].expert_major else rows * K


def four_rank_cases() -> dict:
    """The cases that need 4 ranks: dropped experts on EP 4, and expert TP 2 x EP 2."""
    return {
        "dropped": ("hooks_case", dict(ep=4, etp=1, num_experts=8, topk=2, tokens=10, kind="dropped")),
        "expert_tp": ("hooks_case", dict(ep=2, etp=2, num_experts=4, topk=2, tokens=8)),
    }


def init_megatron(ep: int, etp: int = 1) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)


def make_config(num_experts: int, topk: int, hidden: int, **extra):
    import megatron_patch
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_patch.apply()
    values = dict(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=num_experts,
                  moe_router_topk=topk, moe_ffn_hidden_size=hidden, moe_token_dispatcher_type="uccl",
                  use_cpu_initialization=True, add_bias_linear=False)
    values.update(extra)
    return TransformerConfig(**values)


def expert_weights(expert: int, hidden: int, ffn: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + expert)
    return torch.randn(hidden, ffn, generator=g) / hidden ** 0.5, torch.randn(ffn, hidden, generator=g) / ffn ** 0.5


def expert_fn(x, a, b):
    return torch.tanh(x @ a) @ b


def routing(num_tokens: int, num_experts: int, topk: int, seed: int, kind: str):
    """(routing_map [T, E] bool, probs [T, E] float32 summing to 1 over each token's experts, 0 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if kind == "skewed":  # everything on the first EP rank's experts: the other ranks receive nothing
        logits[:, num_experts // 2:] -= 100.0
    chosen = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True)
    if kind == "dropped":  # the router dropped some slots (capacity): fewer than topk experts for those tokens
        drop = torch.rand(num_tokens, generator=g) < 0.3
        routing_map[drop, chosen[drop, 0]] = False
        routing_map[0] = False  # a token with no expert at all
    probs = torch.where(routing_map, torch.softmax(logits, dim=1), torch.zeros(()))
    probs = probs / probs.sum(1, keepdim=True).clamp(min=1e-9)
    return routing_map, probs


def run_local_experts(tokens, tokens_per_expert, probs, weights):
    counts = [int(c) for c in tokens_per_expert.tolist()]
    outs, start = [], 0
    for (a, b), count in zip(weights, counts):
        seg = tokens[start:start + count]
        outs.append(expert_fn(seg, a, b) * probs[start:start + count].unsqueeze(-1).to(seg.dtype))
        start += count
    outs.append(tokens[start:] * 0)  # sync-free padding rows (and nothing otherwise)
    return torch.cat(outs)


def run_identity_experts(tokens, tokens_per_expert, probs):
    return tokens * probs.unsqueeze(-1).to(tokens.dtype)


def hooks_case(rank: int, world: int, *, ep: int, etp: int, num_experts: int, topk: int, tokens: int,
               hidden: int = HIDDEN_DEFAULT, kind: str = "random", identity: bool = False, options=None,
               seed: int = 7, atol: float = 1e-5, steps: int = 1, device: str = "cpu",
               capacity_factor: Optional[float] = None):
    """Run the six hooks forward and backward ``steps`` times on one dispatcher (fresh inputs and routing each step
    after the first); return the max errors against the oracle over the steps (asserted by the caller). With
    ``device="cuda"`` the tokens, routing and experts live on this rank's GPU (several ranks may share one).
    ``capacity_factor``: the config's moe_expert_capacity_factor, and every routing goes through Megatron's own
    token dropping at that factor first, as its router does."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_megatron(ep, etp)
    from megatron.core import parallel_state
    from uccl_ep_train.megatron.dispatcher import UCCLTokenDispatcher, release_buffers
    from uccl_ep_train.megatron.options import DispatcherOptions
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    cfg = make_config(num_experts, topk, hidden,
                      **({} if capacity_factor is None else dict(moe_expert_capacity_factor=capacity_factor)))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    nle = num_experts // ep
    local = list(range(ep_rank * nle, (ep_rank + 1) * nle))
    dispatcher = UCCLTokenDispatcher(nle, local, cfg, pg_collection=get_default_pg_collection(),
                                     options=options or DispatcherOptions())
    ffn = 2 * hidden * etp
    full = [tuple(w.to(device) for w in expert_weights(e, hidden, ffn, seed)) for e in range(num_experts)]
    shard = ffn // etp
    mine = [(a[:, etp_rank * shard:(etp_rank + 1) * shard], b[etp_rank * shard:(etp_rank + 1) * shard])
            for a, b in (full[e] for e in local)]
    sync_free = bool(options is not None and options.sync_free)

    def one_step(step: int) -> dict:
        # step 0 keeps the seeds every single-step caller was written against
        g = torch.Generator().manual_seed(seed * 31 + rank + 7919 * step)
        x = torch.randn(tokens, 1, hidden, generator=g).to(device)
        routing_map, probs = (t.to(device) for t in routing(tokens, num_experts, topk, seed * 17 + rank + 7919 * step,
                                                              kind))
        if capacity_factor is not None:
            from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

            probs, routing_map = apply_router_token_dropping(probs, routing_map, router_topk=topk,
                                                             capacity_factor=capacity_factor)
        grad_out = torch.randn(tokens, 1, hidden, generator=g).to(device)

        # Dispatcher path.
        x1, p1 = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        h, tp = dispatcher.dispatch_preprocess(x1, routing_map, p1)
        h, tp = dispatcher.token_dispatch(h, tp)
        tokens_in, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(h, tp)
        assert tokens_per_expert.dtype == torch.int64
        if not sync_free:
            assert tokens_per_expert.device.type == "cpu"
            assert int(tokens_per_expert.sum()) == tokens_in.shape[0]
        out = (run_identity_experts(tokens_in, tokens_per_expert, permuted_probs) if identity
               else run_local_experts(tokens_in, tokens_per_expert, permuted_probs, mine))
        out = dispatcher.combine_preprocess(out)
        out = dispatcher.token_combine(out)
        out = dispatcher.combine_postprocess(out)
        assert out.shape == x.shape
        (out * grad_out).sum().backward()

        # Oracle path.
        x2, p2 = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        flat = x2.view(tokens, hidden)
        ref = torch.zeros_like(flat)
        for e in range(num_experts):
            sel = routing_map[:, e]
            if sel.any():
                y = flat[sel] if identity else expert_fn(flat[sel], *full[e])
                ref = ref.index_add(0, sel.nonzero().squeeze(1), y * p2[sel, e].unsqueeze(-1))
        ref = ref.view_as(x2)
        (ref * grad_out).sum().backward()
        return {
            "out_rel": float((out - ref).norm() / ref.norm().clamp(min=1e-12)),
            "grad_probs_rel": float((p1.grad - p2.grad).norm() / p2.grad.norm().clamp(min=1e-12)),
            "out": float((out - ref).abs().max()),
            "grad_x": float((x1.grad - x2.grad).abs().max()),
            "grad_probs": float((p1.grad - p2.grad).abs().max()),
            "identity_err": float((out - x).abs()[routing_map.any(1)].max()) if identity else 0.0,
            "received": int(tokens_in.shape[0]),
        }

    per_step = [one_step(step) for step in range(steps)]
    from uccl_ep_train.megatron import dispatcher as uccl_dispatcher

    # sync-free dispatches that returned before the host read the counts (internode backend, without drains)
    before_counts = sum(int(getattr(b.backend, "dispatches_before_counts", 0))
                        for b in uccl_dispatcher._BUFFERS.values())
    release_buffers()
    parallel_state.destroy_model_parallel()
    result = {key: max(r[key] for r in per_step) for key in per_step[0] if key != "received"}
    result["received"] = per_step[0]["received"]
    result["received_per_step"] = [r["received"] for r in per_step]
    result["expert_major"] = dispatcher.expert_major
    result["before_counts"] = before_counts
    return result


def moelayer_case(rank: int, world: int, *, ep: int, num_experts: int, topk: int, tokens: int, hidden: int,
                  seed: int = 3, reference: str = "allgather", device: str = "cpu", bf16: bool = False,
                  grouped_gemm: bool = False, steps: int = 1, uccl_env: Optional[dict] = None,
                  capacity_factor: Optional[float] = None):
    """Megatron's real MoELayer: uccl against another dispatcher, same weights (same seed), same inputs, ``steps``
    forward and backward passes on one layer (the parameters' gradients accumulate over them in both). ``uccl_env``:
    settings in effect while the uccl layer is built and run (e.g. UCCL_EP_SYNC_FREE=1). ``capacity_factor``: both
    layers' moe_expert_capacity_factor (Megatron's router drops tokens over it)."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        # Megatron's router moves CPU weights to torch.cuda.current_device() (and the allgather dispatcher's global
        # buffer lives there): in this CPU-only child that device is the CPU.
        torch.cuda.current_device = lambda: "cpu"
    init_megatron(ep)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.x binds te_general_gemm only when Transformer Engine imports, yet its router reads the
        # name unconditionally (NameError without TE; later versions set it to None). CPU children have no TE.
        moe_utils.te_general_gemm = None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from uccl_ep_train.megatron import dispatcher as uccl_dispatcher
    from uccl_ep_train.megatron.dispatcher import UCCLTokenDispatcher, release_buffers

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    dtype = torch.bfloat16 if bf16 else torch.float32
    results, outputs = {}, {}
    for dispatcher_type in ("uccl", reference):
        with _environment(uccl_env if dispatcher_type == "uccl" else None):
            extra = dict(moe_token_dispatcher_type=dispatcher_type, moe_router_load_balancing_type="none",
                         use_cpu_initialization=device == "cpu", moe_router_dtype="fp32")
            if capacity_factor is not None:
                extra.update(moe_expert_capacity_factor=capacity_factor)
            if bf16:
                extra.update(bf16=True, params_dtype=torch.bfloat16)
            cfg = make_config(num_experts, topk, hidden, **extra)
            torch.manual_seed(seed)
            if device == "cuda":
                model_parallel_cuda_manual_seed(seed)
            layer = spec.submodules.mlp(config=cfg)
            if device == "cuda":
                layer = layer.cuda()
            results[dispatcher_type] = type(layer.token_dispatcher).__name__
            if dispatcher_type == "uccl":
                assert isinstance(layer.token_dispatcher, UCCLTokenDispatcher)
                worst_rows = _record_sync_free_rows(layer.token_dispatcher)
            g = torch.Generator().manual_seed(seed * 13 + rank)
            outs, grads_x = [], []
            for _ in range(steps):
                x = torch.randn(tokens, 1, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
                out, _ = layer(x)
                if dispatcher_type == "uccl":  # which Buffer backend carried it (intranode, internode, reference)
                    results["uccl_backend"] = [b.backend.name for b in uccl_dispatcher._BUFFERS.values()]
                g_out = torch.randn(out.shape, generator=g).to(device=device, dtype=out.dtype)
                (out.float() * g_out.float()).sum().backward()
                outs.append(out.detach().float().cpu())
                grads_x.append(x.grad.float().cpu())
            if dispatcher_type == "uccl":  # sync-free dispatches that returned before the host read the counts
                results["uccl_before_counts"] = sum(int(getattr(b.backend, "dispatches_before_counts", 0))
                                                    for b in uccl_dispatcher._BUFFERS.values())
                results["uccl_num_worst_tokens"] = sorted(set(worst_rows))  # each forward's (0: not sync-free)
            outputs[dispatcher_type] = (torch.cat(outs), torch.cat(grads_x),
                                        [p.grad.float().cpu().clone() for p in layer.parameters()])
    u, a = outputs["uccl"], outputs[reference]
    results["out_norm"] = float(u[0].norm())
    results["out"] = float((u[0] - a[0]).abs().max())
    results["out_rel"] = float((u[0] - a[0]).norm() / a[0].norm().clamp(min=1e-12))
    results["grad_x"] = float((u[1] - a[1]).abs().max())
    results["grad_x_rel"] = float((u[1] - a[1]).norm() / a[1].norm().clamp(min=1e-12))
    results["grad_params"] = max(float((gu - ga).abs().max()) for gu, ga in zip(u[2], a[2]))
    results["grad_params_rel"] = max(float((gu - ga).norm() / ga.norm().clamp(min=1e-12))
                                     for gu, ga in zip(u[2], a[2]))
    release_buffers()
    parallel_state.destroy_model_parallel()
    return results


def _record_sync_free_rows(dispatcher) -> list:
    """The num_worst_tokens each dispatch_preprocess of ``dispatcher`` chose (the list grows as it runs)."""
    seen: list = []
    preprocess = dispatcher.dispatch_preprocess

    def recording(*args, **kwargs):
        out = preprocess(*args, **kwargs)
        seen.append(int(dispatcher._route.num_worst_tokens))
        return out

    dispatcher.dispatch_preprocess = recording
    return seen


@contextlib.contextmanager
def _environment(values: Optional[dict]):
    """os.environ with ``values`` set inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values or {}}
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def many_cases(rank: int, world: int, cases: dict):
    """Run several named cases in one process group (each child imports Megatron once: CI time)."""
    out = {}
    for name, (fn_name, kwargs) in cases.items():
        out[name] = globals()[fn_name](rank, world, **kwargs)
    return out
