"""UCCLTokenDispatcher's six hooks on the native internode backend on GPUs, without drains, over training steps.

2 emulated nodes x 1 rank (UCCL_EP_RANKS_PER_NODE=1), without drains (the default there: a copy agent moves the
loopback's bytes). In sync-free mode, from
the second step on, each step's forward dispatch follows the previous step's last combine (the backward of a
dispatch) and returns before the host reads the counts (docs/internode.md, "Sync-free dispatch: returning before the
count read"); the combine after it reads them. Every step's output and gradients must equal the communication-free
oracle (tests/megatron/hook_cases.py), with the experts' real rows and the padding counted in the last expert, and
the early returns must have happened. The CPU stand-in runs the same cases in CI
(tests/megatron/test_dispatcher_on_internode_cpu.py).

Needs 2 CUDA GPUs: the dispatcher's Buffer works where its group does, so the group is NCCL's, which takes one rank
per GPU (on one GPU, the CPU stand-in's cases cover the hooks).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron import hook_cases  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

TOL = 1e-4  # float32 on the GPU: the oracle and the experts sum in different orders
STEPS = 3
# The defaults with a GPU per rank: a copy agent moves the loopback's bytes, so the host does not drain, and the steps
# run on the legacy default stream as Megatron's do (without the agent the Buffer refuses that caller: a pageable copy
# there behind our spinning wait stalled the proxy threads' copies; docs/internode.md, "Drains", "The copy agent").
ENV = {"UCCL_EP_RANKS_PER_NODE": "1", "UCCL_EP_CPU_TIMEOUT_SECS": "60", "UCCL_EP_GPU_TIMEOUT_SECS": "60"}


def _cases():
    from uccl_ep_train.megatron.options import DispatcherOptions as O

    shape = dict(ep=2, etp=1, num_experts=8, topk=2, tokens=96, hidden=256, steps=STEPS, device="cuda")
    return {
        "sync_free_expert_major": ("hooks_case", dict(shape, options=O(sync_free=True, expert_major=True))),
        "sync_free_local_permute": ("hooks_case", dict(shape, options=O(sync_free=True, expert_major=False))),
        # a rank receiving nothing in every step
        "sync_free_skewed": ("hooks_case", dict(shape, kind="skewed", options=O(sync_free=True, expert_major=True))),
        # the host sizes the outputs from the counts: no early return
        "expert_major": ("hooks_case", dict(shape, options=O(expert_major=True))),
    }


@pytest.fixture(scope="module")
def two_ranks():
    if (torch.cuda.device_count() if torch.cuda.is_available() else 0) < 2:
        pytest.skip("needs 2 CUDA GPUs (an NCCL group: one rank per GPU)")
    return run_distributed(hook_cases.many_cases, 2, _cases(), timeout=420, backend="nccl", env=ENV)


@pytest.mark.parametrize("name", ["sync_free_expert_major", "sync_free_local_permute", "sync_free_skewed",
                                  "expert_major"])
def test_without_drains_every_training_step_matches_the_oracle_and_sync_free_dispatches_return_before_the_counts(
        two_ranks, name):
    for rank, results in enumerate(two_ranks):
        r = results[name]
        assert r["out"] < TOL and r["grad_x"] < TOL and r["grad_probs"] < TOL, (name, rank, r)
        assert len(r["received_per_step"]) == STEPS, r
        # each step's forward dispatch after the first (the backward's dispatch is cached)
        assert r["before_counts"] == (STEPS - 1 if name.startswith("sync_free") else 0), (name, rank, r)
