"""Megatron's real MoELayer (megatron-core in the environment) built with uccl and with alltoall at EP=2 on GPUs:
same weights, same routing (same seed and input), outputs and gradients equal within bf16 tolerance.

Runs on a machine with 2+ CUDA GPUs (skipped elsewhere):
    python -m pytest tests/megatron/test_moelayer_gpu.py -q
"""
from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron import hook_cases  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

BF16_REL = 2e-2  # bf16 keeps 8 mantissa bits; sums over differently ordered copies differ by a few ulps


# One node of 2 GPUs (NVLink kernels), the same 2 GPUs playing 2 nodes of 1 (the internode path: proxies and the
# loopback transport carry every cross-"node" byte), and 4 GPUs playing 2 nodes of 2 (forwarders and the node-level
# combine too): (environment, backend, EP size).
TOPOLOGIES = {"1-node-x2": ({}, "native-intranode", 2),
              "2-emulated-nodes-x1": ({"UCCL_EP_RANKS_PER_NODE": "1"}, "native-internode", 2),
              "2-emulated-nodes-x2": ({"UCCL_EP_RANKS_PER_NODE": "2"}, "native-internode", 4)}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("grouped_gemm", [False], ids=["sequential-mlp"])
def test_moelayer_with_uccl_matches_alltoall_outputs_and_gradients_in_bf16(grouped_gemm, topology):
    env, backend, ep = TOPOLOGIES[topology]
    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} CUDA GPUs")
    results = run_distributed(functools.partial(hook_cases.moelayer_case, ep=ep, num_experts=8, topk=2, tokens=256,
                                                hidden=256, reference="alltoall", device="cuda", bf16=True,
                                                grouped_gemm=grouped_gemm), ep, backend="nccl", timeout=300,
                              env={"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60", **env})
    for rank, r in enumerate(results):
        assert r["uccl"] == "UCCLTokenDispatcher" and r["alltoall"] == "MoEAlltoAllTokenDispatcher"
        assert r["uccl_backend"] == [backend], (rank, r["uccl_backend"])
        assert r["out_norm"] > 0
        assert r["out_rel"] < BF16_REL, (rank, r)
        assert r["grad_x_rel"] < BF16_REL, (rank, r)
        assert r["grad_params_rel"] < BF16_REL, (rank, r)


def test_moelayer_in_sync_free_mode_without_drains_matches_alltoall_over_training_steps():
    # 2 emulated nodes x 1: from the second step on each forward dispatch returns before the host reads the counts,
    # and SequentialMLP takes the fixed-size rows (padding counted in the last expert). The defaults: a copy agent
    # moves the loopback's bytes, so no drains, on the legacy default stream (docs/internode.md, "The copy agent")
    steps = 3
    results = run_distributed(functools.partial(hook_cases.moelayer_case, ep=2, num_experts=8, topk=2, tokens=256,
                                                hidden=256, reference="alltoall", device="cuda", bf16=True,
                                                steps=steps, uccl_env={"UCCL_EP_SYNC_FREE": "1"}),
                              2, backend="nccl", timeout=300,
                              env={"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
                                   "UCCL_EP_RANKS_PER_NODE": "1"})
    for rank, r in enumerate(results):
        assert r["uccl_backend"] == ["native-internode"], (rank, r["uccl_backend"])
        assert r["out_rel"] < BF16_REL and r["grad_x_rel"] < BF16_REL and r["grad_params_rel"] < BF16_REL, (rank, r)
        assert r["uccl_before_counts"] == steps - 1, (rank, r)


def test_moelayer_in_sync_free_mode_with_an_expert_capacity_factor_receives_the_capacity_and_matches_alltoall():
    # Megatron's router drops tokens over capacity at factor 1.0 (ceil(256 x 2 / 8) = 64 per expert from each rank),
    # so each rank receives at most 4 local experts x 2 ranks x 64 = 512 expert-major rows, not the worst case's
    # 1024 (megatron/dispatcher.py, sync_free_rows); alltoall drops the same tokens, so the outputs still match
    results = run_distributed(functools.partial(hook_cases.moelayer_case, ep=2, num_experts=8, topk=2, tokens=256,
                                                hidden=256, reference="alltoall", device="cuda", bf16=True,
                                                steps=2, capacity_factor=1.0, uccl_env={"UCCL_EP_SYNC_FREE": "1"}),
                              2, backend="nccl", timeout=300,
                              env={"UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60",
                                   "UCCL_EP_RANKS_PER_NODE": "1"})
    for rank, r in enumerate(results):
        assert r["uccl_backend"] == ["native-internode"], (rank, r["uccl_backend"])
        assert r["uccl_num_worst_tokens"] == [512], (rank, r)
        assert r["out_rel"] < BF16_REL and r["grad_x_rel"] < BF16_REL and r["grad_params_rel"] < BF16_REL, (rank, r)
