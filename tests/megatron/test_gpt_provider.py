"""megatron_patch.gpt_provider (the self-contained GPT pretraining driver) on CPU, with the exact Megatron argv of the
tiny recipe (`uccl-ep-train train model=tiny_1gpu dispatcher=uccl cluster=local [parallelism=ep2]`).

Parsed with megatron-core's own parser after megatron_patch.apply(); the model is built by our provider in gloo
process groups (1 rank, and 2 ranks with EP=2) with --use-cpu-initialization, and a forward/backward runs on batches
of the mock dataset our datasets provider builds.

What cannot run on CPU, and what the children do about it (test-only, nothing in the product):
- megatron-core allocates a few buffers on ``torch.cuda.current_device()`` whatever --use-cpu-initialization says
  (MLA's RoPE inverse frequencies with --rope-type rope, the router's expert bias): the children point it at the CPU;
- the model-parallel RNG tracker keeps CUDA generator states: the children use Megatron's inference tracker (its
  fork() is a no-op; dropout is 0 in the recipe anyway);
- ``pretrain()`` itself (initialize_megatron asserts CUDA) is replaced by a recorder in the entry-point test;
- torch.compile (Megatron's jit_fuser) is disabled (TORCHDYNAMO_DISABLE=1) to keep the test fast; it runs on GPU.
Forward passes use the recipe's model but 2 x 128-token slices of the mock samples (1024 tokens x 4 is slow on CPU).
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings

import pytest

from tests.distributed import run_distributed

pytest.importorskip("megatron.training.arguments")

CHILD_ENV = {"TORCHDYNAMO_DISABLE": "1"}
SLICE = 128  # tokens per sample in the CPU forward passes


def recipe_argv(*overrides: str) -> list[str]:
    """The Megatron argv `uccl-ep-train train model=tiny_1gpu dispatcher=uccl cluster=local <overrides> --dry-run`
    prints (same composition, validation and argv builder)."""
    from uccl_ep_train.launchers import argv as argv_mod
    from uccl_ep_train.launchers.recipes import compose
    from uccl_ep_train.launchers.validation import validate

    cfg = compose(["model=tiny_1gpu", "dispatcher=uccl", "cluster=local", *overrides])
    inv = argv_mod.build(cfg, validate(cfg), "/tmp/uccl-ep-train-test-run")
    assert inv.module == "megatron_patch.pretrain_gpt"
    return inv.argv


def parse(argv: list[str], monkeypatch) -> argparse.Namespace:
    """Megatron's parse_args + validate_args on ``argv`` (no global state set)."""
    import megatron_patch
    from megatron.training.arguments import parse_args, validate_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_patch.apply()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt"] + argv)
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("RANK", "0")
        args = parse_args()
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


# ------------------------------------------------------------------------------------------ arguments (in process)


@pytest.mark.parametrize("parallelism", ["single_gpu", "ep2"])
def test_recipe_argv_parses_into_a_valid_config_for_torch_and_megatron_core_alone(parallelism, monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_patch import gpt_provider

    args = parse(recipe_argv(f"parallelism={parallelism}"), monkeypatch)
    # The recipe already carries every flag a machine without Apex and Transformer Engine needs.
    assert gpt_provider.kernel_fallbacks(args, importable=lambda name: False) == []
    assert gpt_provider.unsupported(args) == []
    config = core_transformer_config_from_args(args)  # TransformerConfig.__post_init__ validates
    assert config.moe_token_dispatcher_type == "uccl"
    assert config.multi_latent_attention and type(config).__name__ == "MLATransformerConfig"
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.num_moe_experts == 8 and config.moe_router_topk == 2
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_shared_expert_intermediate_size == 256 and not config.moe_grouped_gemm
    assert config.bf16 and config.transformer_impl == "local" and config.normalization == "RMSNorm"
    assert not (config.gradient_accumulation_fusion or config.masked_softmax_fusion or config.persist_layer_norm
                or config.apply_rope_fusion)
    assert config.expert_model_parallel_size == (2 if parallelism == "ep2" else 1)
    assert args.mock_data and args.tokenizer_type == "NullTokenizer" and args.vocab_size == 129280
    assert args.log_throughput


def test_kernel_fallbacks_turn_off_what_is_not_installed_and_nothing_else(monkeypatch):
    from megatron_patch import gpt_provider

    argv = [a for a in recipe_argv() if a not in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                                                   "--no-persist-layer-norm", "--no-rope-fusion")]
    args = parse(argv, monkeypatch)
    notes = gpt_provider.kernel_fallbacks(args, importable=lambda name: False)
    assert [n.split()[0] for n in notes] == ["--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                                             "--no-masked-softmax-fusion", "--no-rope-fusion"]
    assert not args.gradient_accumulation_fusion and args.no_persist_layer_norm and not args.masked_softmax_fusion
    assert not args.apply_rope_fusion

    args = parse(argv + ["--normalization", "LayerNorm", "--rope-type", "yarn"], monkeypatch)
    notes = gpt_provider.kernel_fallbacks(args, importable=lambda name: True)  # Apex and TE present
    assert notes == [] and args.gradient_accumulation_fusion and args.masked_softmax_fusion and args.apply_rope_fusion

    args = parse(argv + ["--transformer-impl", "transformer_engine"], monkeypatch)
    with pytest.raises(SystemExit, match="--transformer-impl local"):
        gpt_provider.kernel_fallbacks(args, importable=lambda name: name != "transformer_engine")


def test_features_of_megatron_lms_script_we_do_not_implement_are_named(monkeypatch):
    from megatron_patch import gpt_provider

    args = parse(recipe_argv() + ["--sft", "--dataloader-inter-document-masking"], monkeypatch)
    assert gpt_provider.unsupported(args) == ["--sft", "--dataloader-inter-document-masking"]


# ------------------------------------------------------------------------------------------ model and data (children)


def _cpu_only_setup(rank: int, argv: list[str]):
    """Megatron's global state for ``argv`` on CPU in this child (see the module docstring)."""
    import torch

    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: torch.device("cpu")
    import megatron_patch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.arguments import parse_and_validate_args

    from megatron_patch import gpt_provider

    megatron_patch.apply()
    sys.argv = ["pretrain_gpt"] + argv + ["--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert gpt_provider.kernel_fallbacks(args) == []
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             expert_model_parallel_size=args.expert_model_parallel_size)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1234 + rank)
    return args


def _sliced_batches(dataset, micro_batch_size: int, tokens: int):
    """Micro-batches of ``dataset`` cut to their first ``tokens`` positions (mask cut to match)."""
    import torch

    def collate(samples):
        batch = torch.utils.data.default_collate(samples)
        cut = {k: v[:, :tokens].contiguous() for k, v in batch.items() if k != "attention_mask"}
        cut["attention_mask"] = batch["attention_mask"][:, :, :tokens, :tokens].contiguous()
        return cut

    return iter(torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate))


def model_and_data_case(rank: int, world: int, argv: list[str]) -> dict:
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_patch import gpt_provider
    from uccl_ep_train.megatron.dispatcher import UCCLTokenDispatcher

    from megatron.core.process_groups_config import ProcessGroupCollection

    _cpu_only_setup(rank, argv)
    # As megatron.training.get_model calls it.
    model = gpt_provider.model_provider(pre_process=True, post_process=True, config=None,
                                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    facts = {"vocab": model.output_layer.weight.shape[0], "embedding": model.embedding.word_embeddings.weight.shape[0],
             "params_dtype": str(next(model.parameters()).dtype), "mtp": getattr(model, "mtp", None) is not None}
    layers = []
    for layer in model.decoder.layers:
        mlp, attention = layer.mlp, layer.self_attention
        entry = {"attention": type(attention).__name__, "mla": isinstance(attention, MLASelfAttention),
                 "core_attention": type(attention.core_attention).__name__, "mlp": type(mlp).__name__}
        if isinstance(mlp, MoELayer):
            entry.update(dispatcher=type(mlp.token_dispatcher).__name__,
                         is_uccl=isinstance(mlp.token_dispatcher, UCCLTokenDispatcher),
                         local_experts=len(mlp.experts.local_experts), shared=mlp.shared_experts is not None,
                         expert_bias=getattr(mlp.router, "expert_bias", None) is not None,
                         score=mlp.router.score_function)
        layers.append(entry)
    facts["layers"] = layers
    # What the torch_dist checkpoint at the end of the run saves (metadata only, no I/O).
    facts["sharded_keys"] = len(model.sharded_state_dict())

    train, valid, test = gpt_provider.train_valid_test_datasets_provider([64, 0, 0])
    sample = train[0]
    facts["dataset"] = type(train).__name__
    facts["sample"] = {k: (tuple(v.shape), str(v.dtype)) for k, v in sample.items()}

    batches = _sliced_batches(train, 2, SLICE)
    model.train()
    output, loss_fn = gpt_provider.forward_step(batches, model)
    loss, num_tokens, report = loss_fn(output)
    (loss / num_tokens).backward()
    facts["output_shape"] = tuple(output.shape)
    facts["loss_per_token"] = float(loss / num_tokens)
    facts["report"] = [float(x) for x in report["lm loss"]]
    facts["num_tokens"] = int(num_tokens)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    facts["grads_finite"] = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
    experts = [p for n, p in model.named_parameters() if "local_experts" in n]
    facts["expert_grads"] = sum(int(p.grad is not None and bool(p.grad.abs().sum() > 0)) for p in experts)
    facts["router_grads"] = all(p.grad is not None for n, p in model.named_parameters() if "router.weight" in n)
    return facts


def _check_model_and_data(facts: dict, local_experts: int) -> None:
    assert facts["vocab"] == facts["embedding"] == 129280  # NullTokenizer's 129280, already a multiple of 128
    assert facts["params_dtype"] == "torch.bfloat16" and not facts["mtp"] and facts["sharded_keys"] > 0
    layers = facts["layers"]
    assert len(layers) == 4
    assert all(layer["mla"] and layer["attention"] == "MLASelfAttention" for layer in layers)
    assert all(layer["core_attention"] == "MLADotProductAttention" for layer in layers)  # local impl, MLA-capable
    assert layers[0]["mlp"] == "MLP" and "dispatcher" not in layers[0]  # --moe-layer-freq ([0]*1+[1]*3)
    for moe in layers[1:]:
        assert moe["mlp"] == "MoELayer" and moe["is_uccl"] and moe["dispatcher"] == "UCCLTokenDispatcher"
        assert moe["local_experts"] == local_experts and moe["shared"] and moe["expert_bias"]
        assert moe["score"] == "sigmoid"
    assert facts["dataset"] == "MockGPTDataset"
    assert facts["sample"] == {"tokens": ((1024,), "torch.int64"), "labels": ((1024,), "torch.int64"),
                               "loss_mask": ((1024,), "torch.float32"), "position_ids": ((1024,), "torch.int64"),
                               "attention_mask": ((1, 1024, 1024), "torch.bool")}
    assert facts["output_shape"] == (2, SLICE)  # per-token losses
    assert facts["num_tokens"] == 2 * SLICE and facts["report"][1] == 2 * SLICE
    assert math.isfinite(facts["loss_per_token"])
    assert abs(facts["loss_per_token"] - math.log(129280)) < 1.0  # an untrained model: about uniform
    assert facts["grads_finite"] and facts["router_grads"] and facts["expert_grads"] > 0


def test_provider_builds_the_tiny_model_and_trains_a_step_on_mock_data_on_one_rank():
    (facts,) = run_distributed(model_and_data_case, 1, recipe_argv(), timeout=300, env=CHILD_ENV)
    _check_model_and_data(facts, local_experts=8)


def test_provider_with_ep2_splits_the_experts_and_dispatches_through_uccl_on_two_ranks():
    facts = run_distributed(model_and_data_case, 2, recipe_argv("parallelism=ep2"), timeout=300, env=CHILD_ENV)
    for rank_facts in facts:
        _check_model_and_data(rank_facts, local_experts=4)


# ------------------------------------------------------------------------------------------ entry point (child)


def entry_point_case(rank: int, world: int, argv: list[str]) -> dict:
    """megatron_patch.pretrain_gpt's default path up to pretrain(), which is recorded instead of run."""
    import megatron.training

    from megatron_patch import gpt_provider, pretrain_gpt

    warnings.filterwarnings("ignore")
    calls = []
    megatron.training.pretrain = lambda *a, **k: calls.append((a, k))
    pretrain_gpt.main(argv)
    (positional, keywords), = calls
    cfg, datasets, model_type, step = positional
    ours = gpt_provider
    return {"cfg": type(cfg).__name__, "model_cfg": cfg.model,
            "datasets": datasets is ours.train_valid_test_datasets_provider,
            "distributed": getattr(datasets, "is_distributed", False), "model_type": model_type.name,
            "step": step is ours.forward_step, "provider": keywords["model_provider"] is ours.model_provider,
            "embedding_ranks": keywords["get_embedding_ranks"] is ours.get_embedding_ranks,
            "train_iters": cfg.train.train_iters}


def test_entry_point_default_runs_megatron_pretrain_with_our_providers_without_a_checkout(monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    (facts,) = run_distributed(entry_point_case, 1, recipe_argv(), timeout=300,
                               env={**CHILD_ENV, "MEGATRON_LM_PATH": ""})
    assert facts == {"cfg": "PretrainConfigContainer", "model_cfg": None, "datasets": True, "distributed": True,
                     "model_type": "encoder_or_decoder", "step": True, "provider": True, "embedding_ranks": True,
                     "train_iters": 50}


def test_prebuilt_dataset_helpers_replace_megatrons_make_step():
    """The wheel ships helpers_cpp compiled but no Makefile: training must not try (and fail) to run make."""
    import megatron.core.datasets.utils as dataset_utils

    from megatron_patch import gpt_provider

    original = dataset_utils.compile_helpers
    try:
        assert gpt_provider.use_prebuilt_dataset_helpers() is True
        assert dataset_utils.compile_helpers is not original
        dataset_utils.compile_helpers()  # must be a no-op, not a failing `make`
        assert gpt_provider.use_prebuilt_dataset_helpers() is True  # idempotent
    finally:
        dataset_utils.compile_helpers = original
