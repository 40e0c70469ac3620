"""Every recipe composes and validates; the validation errors say what to change."""
import os
import subprocess

import pytest

from conftest import SLURM_FILL
from uccl_ep_train.launchers.recipes import (GROUPS, RecipeError, available, compose, launch_dir, parse_env_file,
                                             recipes_dir)
from uccl_ep_train.launchers.validation import parse_layer_freq, parse_layout, validate

# (model, parallelism) pairs the recipes are sized for.
SIZED = [
    ("tiny_1gpu", "single_gpu"), ("tiny_1gpu", "ep2"),
    ("one_node_8gpu", "ep8_one_node"),
    ("multi_node_ep16_32", "ep16_two_nodes"), ("multi_node_ep16_32", "ep32_four_nodes"),
    ("deepseek_v3", "dsv3_pp16_ep16"),
]
SLURM_CLUSTERS = ["p5en_efa", "mi300x_thor2", "mi355x_pollara"]


def _matrix():
    for model, par in SIZED:
        multi_node = par in ("ep16_two_nodes", "ep32_four_nodes", "dsv3_pp16_ep16")
        for cluster in (SLURM_CLUSTERS if multi_node else ["local", *SLURM_CLUSTERS]):
            for disp in ("uccl", "alltoall", "flex_deepep"):
                if disp == "flex_deepep" and multi_node:
                    continue  # refused on these networks (test below)
                yield model, par, cluster, disp


MATRIX = list(_matrix())


@pytest.mark.parametrize("model,par,cluster,disp", MATRIX)
def test_every_sized_recipe_composes_and_validates(recipe, model, par, cluster, disp):
    fill = SLURM_FILL if cluster != "local" else []
    cfg, topo = recipe(f"model={model}", f"parallelism={par}", f"cluster={cluster}", f"dispatcher={disp}", *fill)
    assert cfg.training.global_batch_size % (cfg.training.micro_batch_size * topo.dp) == 0
    assert topo.world_size == topo.tp * topo.pp * topo.cp * topo.dp
    assert cfg.model.moe.num_experts % topo.ep == 0


def test_the_matrix_covers_every_option_of_every_group():
    used = {"model": set(), "parallelism": set(), "cluster": set(), "dispatcher": set()}
    for model, par, cluster, disp in MATRIX:
        used["model"].add(model), used["parallelism"].add(par), used["cluster"].add(cluster)
        used["dispatcher"].add(disp)
    for group, names in used.items():
        assert set(available(group)) == names, group
    assert set(available("training")) == set(available("model"))  # training follows the model by default
    assert set(GROUPS) >= set(used)


def test_default_recipe_is_the_tiny_model_on_one_local_gpu_with_uccl(recipe):
    cfg, topo = recipe()
    assert (cfg.model.name, cfg.dispatcher.megatron_type, cfg.cluster.name, cfg.data.kind) == \
        ("tiny_1gpu", "uccl", "local", "mock")
    assert topo.world_size == 1 and cfg.training.train_iters == 50


def test_training_follows_the_model_and_can_be_chosen_separately():
    assert compose(["model=deepseek_v3"]).training.global_batch_size == 4096
    assert compose(["model=deepseek_v3", "training=tiny_1gpu"]).training.global_batch_size == 16


def test_deepseek_v3_recipe_has_the_published_hyperparameters():
    m = compose(["model=deepseek_v3"]).model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (61, 7168, 18432, 128)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_head_dim, m.mla.qk_pos_emb_head_dim,
            m.mla.v_head_dim) == (1536, 512, 128, 64, 128)
    moe = m.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size, moe.shared_expert_intermediate_size) == \
        (256, 8, 2048, 2048)
    assert (moe.router_num_groups, moe.router_group_topk, moe.router_score_function) == (8, 4, "sigmoid")
    assert moe.router_enable_expert_bias and moe.router_topk_scaling_factor == 2.5
    assert parse_layer_freq(moe.layer_freq) == [0] * 3 + [1] * 58
    assert (m.rope.mscale, m.rope.mscale_all_dim, m.mtp.num_layers, m.vocab_size) == (1.0, 1.0, 1, 129280)


def test_indexed_data_needs_a_path_and_composes_with_one(recipe):
    with pytest.raises(RecipeError, match=r"data.path is not set: give the indexed dataset prefix"):
        recipe("data=indexed")
    cfg, _ = recipe("data=indexed", "data.path=/data/x_text_document")
    assert cfg.data.path == "/data/x_text_document"


def test_unknown_option_lists_the_choices():
    with pytest.raises(RecipeError, match=r"no cluster recipe named 'nope': choose one of local, mi300x_thor2"):
        compose(["cluster=nope"])


def test_user_config_dir_adds_a_cluster(tmp_path, recipe):
    (tmp_path / "cluster").mkdir()
    text = (recipes_dir() / "cluster" / "local.yaml").read_text()
    (tmp_path / "cluster" / "mybox.yaml").write_text(text.replace("name: local", "name: mybox"))
    cfg = compose(["cluster=mybox"], config_dir=tmp_path)
    validate(cfg)
    assert cfg.cluster.name == "mybox"
    assert "mybox" in available("cluster", tmp_path)


# ------------------------------------------------------------------------------------ documented errors
INVALID = [
    (["parallelism=ep2", "parallelism.tp=3"], r"world size 2 .* is not divisible by TP\*PP\*CP = 3\*1\*1 = 3"),
    (["parallelism=ep2", "parallelism.etp=2"], r"EP\*ETP = 2\*2 = 4 must divide TP\*CP\*DP = 1\*1\*2 = 2"),
    (["parallelism=ep2", "parallelism.gpus_per_node=3", "parallelism.ep=3"],
     r"model.moe.num_experts=8 is not divisible by parallelism.ep=3"),
    (["parallelism=ep2", "training.global_batch_size=15"],
     r"training.global_batch_size=15 is not divisible by training.micro_batch_size \* DP = 4\*2 = 8"),
    (["model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "parallelism.layout='Et|(tt|)*29,mL'", *SLURM_FILL,
      "cluster=p5en_efa"], r"layout places 59 decoder layers \('t'\) but model.num_layers=61"),
    (["model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "parallelism.layout=null", *SLURM_FILL,
      "cluster=p5en_efa"], r"model.num_layers=61 is not divisible by parallelism.pp=16: give parallelism.layout"),
    (["parallelism=ep2", "parallelism.gpus_per_node=4", "parallelism.tp=2", "parallelism.sequence_parallel=false"],
     r"sequence_parallel=false with TP>1 and EP>1"),
    (["model.moe.layer_freq='([0]*1+[1]*4)'"], r"layer_freq has 5 entries but model.num_layers=4"),
    (["cluster=p5en_efa"], r"cluster.account is not set: give your Slurm account"),
    (["cluster=p5en_efa", "cluster.account=a"], r"cluster.container.image is not set"),
    (["cluster=p5en_efa", *SLURM_FILL, "+cluster.env.HSA_NO_SCRATCH_RECLAIM=1"],
     r"EFA settings \(.*FI_PROVIDER.*\) and Broadcom/AMD RoCE settings \(HSA_NO_SCRATCH_RECLAIM\) are mixed"),
    (["cluster=mi300x_thor2", *SLURM_FILL, "+run.env.FI_PROVIDER=efa"], r"EFA settings .* are mixed"),
    (["cluster=mi300x_thor2", *SLURM_FILL, "+cluster.env.UCCL_IB_MAX_INFLIGHT_NORMAL=8"],
     r"broadcom_thor2 NICs report transport retry errors above 1 write / 1572864 bytes"),
    (["cluster=mi355x_pollara", *SLURM_FILL, "+cluster.env.UCCL_IB_MAX_INFLIGHT_BYTES=8388608"],
     r"amd_pollara NICs report transport retry errors above 1 write / 4194304 bytes"),
    (["model=multi_node_ep16_32", "parallelism=ep16_two_nodes", "cluster=p5en_efa", *SLURM_FILL,
      "dispatcher=flex_deepep"], r"dispatcher=flex_deepep \(DeepEP\) needs NVSHMEM/IBGDA NICs"),
    (["model=multi_node_ep16_32", "parallelism=ep16_two_nodes"],
     r"cluster=local runs on this host only but parallelism.nodes=2"),
    (["dispatcher.settings.UCCL_EP_NUM_SMS=3"], r"UCCL_EP_NUM_SMS=3 must be even"),
    (["cluster=p5en_efa", *SLURM_FILL, "parallelism.gpus_per_node=16"],
     r"parallelism.gpus_per_node=16 exceeds the 8 GPUs of a p5en_efa node"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m[:40] for _, m in INVALID])
def test_invalid_overrides_produce_the_documented_error(overrides, message):
    cfg = compose(overrides)
    with pytest.raises(RecipeError, match=message):
        validate(cfg)


def test_several_problems_are_reported_together():
    cfg = compose(["parallelism=ep2", "parallelism.etp=2", "training.global_batch_size=15"])
    with pytest.raises(RecipeError) as err:
        validate(cfg)
    assert "EP*ETP" in str(err.value) and "global_batch_size=15" in str(err.value)


# ------------------------------------------------------------------------------------ parsers vs Megatron
def test_layout_parser_agrees_with_megatron():
    layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    for layout in ("Et|(tt|)*30,mL", "Ettt|(tt|)*29,m|L", "E|t*3|tL", "(Et|)*1tt|L"):
        ours = parse_layout(layout)
        theirs = layout_mod.PipelineParallelLayerLayout.parse_str_to_list(layout)
        assert [[c for c in stage] for stage in ours] == [[_symbol(x) for x in stage] for stage in theirs]


def _symbol(layer_type) -> str:
    return {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}[layer_type.name]


def test_layer_freq_parser_agrees_with_megatron():
    arguments = pytest.importorskip("megatron.training.arguments")
    for text in ("([0]*3+[1]*58)", "([0]*1+[1]*3)", "[1,0,1]"):
        assert parse_layer_freq(text) == arguments.moe_freq_type(text)
    with pytest.raises(ValueError):
        parse_layer_freq("__import__('os')")


# ------------------------------------------------------------------------------------ env files vs bash
@pytest.mark.parametrize("name", ["p5en_efa.sh", "mi300x_thor2.sh", "mi355x_pollara.sh"])
def test_env_file_parser_agrees_with_bash_and_caller_values_win(name):
    path = launch_dir() / "env" / name
    for environ in ({}, {"NCCL_DEBUG": "INFO", "UCCL_IB_GID_INDEX": "5"}):
        ours = parse_env_file(path, environ)
        script = f"set -euo pipefail; source {path}; " + "; ".join(f'printf "%s=%s\\n" {k} "${k}"' for k in ours)
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                             env={"PATH": os.environ["PATH"], **environ}).stdout
        bash = dict(line.split("=", 1) for line in out.splitlines())
        assert bash == ours
        for key, value in environ.items():
            if key in ours:
                assert ours[key] == value


def test_env_file_rejects_lines_bash_and_the_parser_could_read_differently(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text('export A="${B:-1}"\n')
    with pytest.raises(RecipeError, match=r"A defaults from \$\{B\}"):
        parse_env_file(bad)
    bad.write_text("if true; then export A=1; fi\n")
    with pytest.raises(RecipeError, match="only `export"):
        parse_env_file(bad)
