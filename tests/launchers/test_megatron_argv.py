"""The recipe -> Megatron argv function: exact flags for full DeepSeek-V3 on both cluster kinds, and every argv
parses with megatron-core's own argument parser."""
import argparse
import shlex
import subprocess

import pytest

from conftest import SLURM_FILL
from uccl_ep_train.launchers import argv as argv_mod
from uccl_ep_train.launchers.recipes import launch_dir
from uccl_ep_train.launchers.validation import cluster_environment

RUN_DIR = "/shared/runs/dsv3"


@pytest.fixture(scope="module")
def megatron_parser():
    """megatron-core's parser, with `uccl` among the dispatcher choices as megatron_patch makes it."""
    arguments = pytest.importorskip("megatron.training.arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    for action in parser._actions:
        if "--moe-token-dispatcher-type" in action.option_strings:
            action.choices = [*action.choices, "uccl"]
    return parser


def _pairs(argv):
    """--flag value / --flag (True) as a dict, asserting no flag appears twice."""
    out, i = {}, 0
    while i < len(argv):
        key = argv[i]
        assert key.startswith("--"), argv[i]
        assert key not in out, f"{key} given twice"
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key], i = argv[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


DSV3_EXPECTED = {
    "--num-layers": "61", "--hidden-size": "7168", "--ffn-hidden-size": "18432", "--num-attention-heads": "128",
    "--multi-latent-attention": True, "--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128",
    "--qk-pos-emb-head-dim": "64", "--v-head-dim": "128", "--qk-layernorm": True, "--rope-type": "yarn",
    "--mscale": "1.0", "--mscale-all-dim": "1.0", "--rotary-scaling-factor": "40",
    "--num-experts": "256", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "2048",
    "--moe-shared-expert-intermediate-size": "2048", "--moe-layer-freq": "([0]*3+[1]*58)",
    "--moe-router-num-groups": "8", "--moe-router-group-topk": "4", "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": True, "--moe-router-topk-scaling-factor": "2.5", "--mtp-num-layers": "1",
    "--moe-grouped-gemm": True, "--normalization": "RMSNorm", "--swiglu": True,
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "16", "--context-parallel-size": "1",
    "--expert-model-parallel-size": "16", "--expert-tensor-parallel-size": "1",
    "--pipeline-model-parallel-layout": "Et|(tt|)*30,mL", "--use-distributed-optimizer": True,
    "--moe-token-dispatcher-type": "uccl", "--bf16": True, "--seq-length": "4096", "--micro-batch-size": "1",
    "--global-batch-size": "4096", "--mock-data": True, "--tokenizer-type": "NullTokenizer",
    "--vocab-size": "129280", "--log-throughput": True, "--save": f"{RUN_DIR}/checkpoints",
    "--tensorboard-dir": f"{RUN_DIR}/tensorboard",
}


@pytest.mark.parametrize("cluster", ["p5en_efa", "mi300x_thor2"])
def test_full_deepseek_v3_argv_has_the_expected_flags(recipe, megatron_parser, cluster):
    cfg, topo = recipe("model=deepseek_v3", "parallelism=dsv3_pp16_ep16", f"cluster={cluster}", *SLURM_FILL)
    inv = argv_mod.build(cfg, topo, RUN_DIR)
    flags = _pairs(inv.argv)
    for key, value in DSV3_EXPECTED.items():
        assert flags.get(key) == value, key
    for absent in ("--sequence-parallel", "--load", "--num-virtual-stages-per-pipeline-rank", "--data-path"):
        assert absent not in flags
    assert inv.module == "megatron_patch.pretrain_gpt"
    assert inv.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and inv.env["UCCL_EP_NUM_SMS"] == "24"

    ns = megatron_parser.parse_args(inv.argv)
    assert (ns.num_layers, ns.num_experts, ns.expert_model_parallel_size, ns.moe_router_topk) == (61, 256, 16, 8)
    assert ns.moe_layer_freq == [0] * 3 + [1] * 58 and ns.add_bias_linear is False
    assert ns.moe_token_dispatcher_type == "uccl" and ns.log_throughput and ns.mock_data


def test_cluster_environment_of_each_kind_carries_its_nic_settings(recipe):
    efa, _ = recipe("cluster=p5en_efa", *SLURM_FILL)
    env = cluster_environment(efa)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert 8 <= int(env["NCCL_MAX_NCHANNELS"]) <= 32
    assert not any(k.startswith(("HSA_", "RCCL_")) for k in env)

    thor2, _ = recipe("cluster=mi300x_thor2", *SLURM_FILL)
    env = cluster_environment(thor2)
    assert (env["UCCL_IB_MAX_INFLIGHT_NORMAL"], env["UCCL_IB_MAX_INFLIGHT_BYTES"]) == ("1", str(3 << 19))
    assert env["HSA_NO_SCRATCH_RECLAIM"] == "1" and env["NCCL_IB_GID_INDEX"] == env["UCCL_IB_GID_INDEX"]
    assert "bnxt_re0" in env["UCCL_IB_HCA"] and not any(k.startswith("FI_") for k in env)

    pollara, _ = recipe("cluster=mi355x_pollara", *SLURM_FILL)
    env = cluster_environment(pollara)
    assert (env["UCCL_IB_MAX_INFLIGHT_NORMAL"], env["UCCL_IB_MAX_INFLIGHT_BYTES"]) == ("1", str(4 << 20))


@pytest.mark.parametrize("overrides", [
    [], ["parallelism=ep2"], ["dispatcher=alltoall"], ["parallelism=ep2", "dispatcher=flex_deepep"],
    ["model=one_node_8gpu", "parallelism=ep8_one_node"], ["data=indexed", "data.path=/d/a_text_document"],
    ["parallelism=ep2", "parallelism.gpus_per_node=4", "parallelism.tp=2", "parallelism.recompute=full"],
    ["model=multi_node_ep16_32", "parallelism=ep16_two_nodes", "cluster=mi355x_pollara", *SLURM_FILL],
])
def test_every_argv_parses_with_megatrons_parser(recipe, megatron_parser, overrides):
    cfg, topo = recipe(*overrides)
    inv = argv_mod.build(cfg, topo, "/tmp/run")
    ns = megatron_parser.parse_args(inv.argv)
    assert ns.expert_model_parallel_size == topo.ep and ns.num_experts == cfg.model.moe.num_experts
    assert ns.moe_token_dispatcher_type == cfg.dispatcher.megatron_type
    assert ns.sequence_parallel == (topo.tp > 1)


def test_comparison_dispatchers_differ_only_in_the_dispatcher_flags(recipe):
    argvs = {}
    for disp in ("uccl", "alltoall", "flex_deepep"):
        cfg, topo = recipe("parallelism=ep2", f"dispatcher={disp}")
        argvs[disp] = _pairs(argv_mod.build(cfg, topo, "/tmp/run").argv)
    assert argvs["alltoall"]["--moe-token-dispatcher-type"] == "alltoall"
    assert argvs["flex_deepep"]["--moe-flex-dispatcher-backend"] == "deepep"
    strip = {"--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"}
    common = [{k: v for k, v in a.items() if k not in strip} for a in argvs.values()]
    assert common[0] == common[1] == common[2]


def test_resume_loads_the_run_directory_checkpoints(recipe):
    cfg, topo = recipe()
    flags = _pairs(argv_mod.build(cfg, topo, "/r/x", resume=True).argv)
    assert flags["--load"] == flags["--save"] == "/r/x/checkpoints"
    assert flags["--exit-on-missing-checkpoint"] is True


def test_extra_args_come_last_and_env_layers_in_order(recipe):
    cfg, topo = recipe("run.extra_args=[--manual-gc]", "+cluster.env.A=cluster", "+run.env.A=run",
                       "dispatcher.settings.UCCL_EP_NUM_SMS=32")
    inv = argv_mod.build(cfg, topo, "/tmp/run")
    assert inv.argv[-1] == "--manual-gc"
    assert inv.env["A"] == "run" and inv.env["UCCL_EP_NUM_SMS"] == "32"


def test_ready_sbatch_scripts_use_the_deepseek_v3_recipe_flags(recipe):
    """launch/deepseek_v3_args.sh is for users without Python; it must not drift from the recipe."""
    cfg, _ = recipe("model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "cluster=p5en_efa", *SLURM_FILL)
    path = launch_dir() / "deepseek_v3_args.sh"
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(str(path))}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == argv_mod.model_args(cfg.model)
