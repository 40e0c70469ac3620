"""GPT pretraining on megatron-core alone: model provider, datasets provider and forward step for
``megatron.training.pretrain``.

The megatron-core wheel (0.19) ships ``megatron.core`` and ``megatron.training`` but not the root of the
Megatron-LM repository (``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``). This module is our own
compact equivalent of those three files, written against the installed wheel, for GPT pretraining:

- :func:`model_provider`: a ``GPTModel`` whose layer spec follows Megatron's own choice (MoE block spec with
  dense/MoE layers from ``--moe-layer-freq``, MLA with ``--multi-latent-attention``, Transformer Engine or local
  modules from ``--transformer-impl``, ``--spec`` overrides, MTP block with ``--mtp-num-layers``);
- :func:`train_valid_test_datasets_provider`: ``BlendedMegatronDatasetBuilder`` over ``MockGPTDataset``
  (``--mock-data``) or ``GPTDataset`` (``--data-path``);
- :func:`forward_step` / :func:`loss_func`: the batch from TP rank 0 broadcast over TP and split over CP, the
  masked token-summed loss reported as ``lm loss`` (Megatron divides by the token count). MoE auxiliary losses
  (``--moe-aux-loss-coeff``, seq_aux_loss, z-loss) and the MTP loss are not added here: Megatron's router and
  ``GPTModel`` attach them to the activations (``MoEAuxLossAutoScaler``/``MTPLossAutoScaler``) and ``pretrain``
  logs them, exactly as with Megatron-LM's script.

What it does not do (use ``--megatron-lm DIR`` to run a checkout's ``pretrain_gpt.py`` for these): SFT, FIM data,
packed sequences / inter-document masking, hybrid context parallelism, heterogeneous layer configs, ModelOpt and
offline distillation. :func:`unsupported` names any of them found in the arguments.

:func:`main` parses Megatron's arguments (after :func:`megatron_patch.apply`, so ``uccl`` is a valid dispatcher),
turns off fused kernels that are not installed (:func:`kernel_fallbacks`) and calls ``pretrain``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
import warnings
from functools import partial
from typing import Any, Optional

import torch

# Keys of a GPT micro-batch, as MockGPTDataset / GPTDataset produce them (attention_mask only with
# --create-attention-mask-in-dataloader).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
SPIKY_LOSS_FACTOR = 10  # a loss 10x the largest seen so far is "spiky" (Megatron-LM's value)


# --------------------------------------------------------------------------------------------------- model


def _use_te(args) -> bool:
    return args.transformer_impl == "transformer_engine"


def _single_layer_spec(args, config):
    """The spec of one transformer layer (dense, or MoE when config.num_moe_experts) for TE or local modules."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if _use_te(args):
        return specs.get_gpt_layer_with_transformer_engine_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
            config.experimental_attention_variant, qk_l2_norm=config.qk_l2_norm, use_kitchen=config.use_kitchen,
            use_te_activation_func=config.use_te_activation_func,
            use_kitchen_attention=config.use_kitchen_attention,
            kitchen_attention_backend=config.kitchen_attention_backend,
            mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False),
            use_grouped_gemm_for_dense_mlp=config.use_grouped_gemm_for_dense_mlp)
    return specs.get_gpt_layer_local_spec(
        config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
        config.experimental_attention_variant, normalization=config.normalization, use_kitchen=config.use_kitchen,
        use_kitchen_attention=config.use_kitchen_attention, kitchen_attention_backend=config.kitchen_attention_backend)


def _mla_core_attention_class():
    """Megatron's local DotProductAttention, made to accept what MLA gives its core attention.

    ``MLASelfAttention`` builds its core attention with ``k_channels`` (qk_head_dim + qk_pos_emb_head_dim) and
    ``v_channels`` (v_head_dim); Transformer Engine's attention takes them, the local ``DotProductAttention`` of
    megatron-core 0.19 (and main) does not (TypeError at build), and sizes its output from ``--kv-channels``.
    This subclass takes both and sizes the output from ``v_channels``; the computation is Megatron's."""
    global _MLADotProductAttention
    if _MLADotProductAttention is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                         **kwargs):
                super().__init__(*args, **kwargs)
                if k_channels is not None:
                    self.hidden_size_per_attention_head = k_channels
                if v_channels is not None:
                    self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        _MLADotProductAttention = MLADotProductAttention
    return _MLADotProductAttention


_MLADotProductAttention = None


def local_mla_spec(spec):
    """``spec`` (a block spec, a layer spec or a list of layer specs) with the local core attention of every MLA
    layer replaced by :func:`_mla_core_attention_class`'s; anything else is returned unchanged (not mutated)."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    if isinstance(spec, list):
        return [local_mla_spec(s) for s in spec]
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        return dataclasses.replace(spec, layer_specs=[local_mla_spec(s) for s in spec.layer_specs])
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    sub = getattr(attention, "submodules", None)
    if isinstance(sub, MLASelfAttentionSubmodules) and sub.core_attention is DotProductAttention:
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(sub, core_attention=_mla_core_attention_class()))
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
    return spec


def transformer_layer_spec(args, config, vp_stage: Optional[int] = None):
    """The decoder spec Megatron-LM's gpt_builder picks for these arguments: ``--spec`` if given, the block spec of
    an experimental attention variant, the MoE block spec (dense and MoE layers per ``--moe-layer-freq``, only the
    layers of this pipeline stage), else one layer spec repeated."""
    from megatron.core.transformer.spec_utils import import_module

    if args.spec is not None:
        return import_module(args.spec)
    spec = _megatron_layer_spec(args, config, vp_stage)
    if _use_te(args):
        return spec
    return _torch_final_rmsnorm(local_mla_spec(spec), config)


def _torch_final_rmsnorm(spec, config):
    """With Apex installed, Megatron's local MoE block spec ends in Apex's FusedLayerNorm, which refuses RMSNorm
    (the layers' own norms are already torch's): use torch's norm there too."""
    import dataclasses

    layer_norm = getattr(spec, "layer_norm", None)
    if config.normalization == "RMSNorm" and getattr(layer_norm, "__name__", "") == "FusedLayerNorm":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return dataclasses.replace(spec, layer_norm=WrappedTorchNorm)
    return spec


def _megatron_layer_spec(args, config, vp_stage):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if config.experimental_attention_variant is not None:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config=config, vp_stage=vp_stage)
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=_use_te(args),
                                          normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                          vp_stage=vp_stage)
    return _single_layer_spec(args, config)


def mtp_block_spec(args, config, layer_spec, vp_stage: Optional[int] = None):
    """The multi-token-prediction block (``--mtp-num-layers``): its layers are the decoder's last layer, or None."""
    if args.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    if hasattr(layer_spec, "layer_specs") and len(layer_spec.layer_specs) == 0:
        # A pipeline stage without decoder layers (block spec with MoE): the plain layer spec.
        last = _single_layer_spec(args, config)
    elif config.experimental_attention_variant is not None:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_layer_with_experimental_attention_variant_spec,
        )

        last = get_transformer_layer_with_experimental_attention_variant_spec(config=config)[-1]
    else:
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=_use_te(args),
                                           normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                           vp_stage=vp_stage)[-1]
    return get_gpt_mtp_block_spec(config, local_mla_spec(last), use_transformer_engine=_use_te(args),
                                  vp_stage=vp_stage)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None):
    """Build this rank's GPTModel stage (called by ``megatron.training.get_model``; CPU unless
    ``--use-cpu-initialization`` is off, Megatron moves it to the GPU and wraps it afterwards)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args, print_rank_0

    args = get_args()
    if args.record_memory_history:
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100000,
                                                 trace_alloc_record_context=True)
    print_rank_0("building GPT model (megatron_patch.gpt_provider) ...")
    if config is None:
        if args.yaml_cfg is not None:
            from megatron.training.yaml_arguments import core_transformer_config_from_yaml

            config = core_transformer_config_from_yaml(args, "language_model")
        else:
            from megatron.training.arguments import core_transformer_config_from_args

            config = core_transformer_config_from_args(args)
    layer_spec = transformer_layer_spec(args, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=mtp_block_spec(args, config, layer_spec, vp_stage),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding word embeddings: the first stage, the last one when input and output embeddings are tied,
    and the stages with MTP layers (which embed their shifted inputs)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args

    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, _transformer_config(args)))
    return sorted(ranks)


# --------------------------------------------------------------------------------------------------- step


_CONFIGS: dict[int, Any] = {}


def _transformer_config(args):
    """The TransformerConfig of ``args``, built once per args object (get_batch asks at every micro-batch)."""
    if id(args) not in _CONFIGS:
        from megatron.training.arguments import core_transformer_config_from_args

        _CONFIGS.clear()
        _CONFIGS[id(args)] = core_transformer_config_from_args(args)
    return _CONFIGS[id(args)]


def _mtp_on_this_rank(args, vp_stage: Optional[int]) -> bool:
    if not args.mtp_num_layers:
        return False
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    config = _transformer_config(args)  # the layout as an object (args hold its string)
    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                            ignore_virtual=False, vp_stage=vp_stage)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(data_iterator, vp_stage: Optional[int] = None) -> dict[str, Optional[torch.Tensor]]:
    """This rank's micro-batch: TP rank 0 reads it, the other TP ranks receive it, then each CP rank keeps its
    (zigzag) share of the sequence. Stages that neither embed nor compute the loss get all-None."""
    from megatron.core import mpu
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    mtp_here = _mtp_on_this_rank(args, vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return {key: None for key in BATCH_KEYS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        device = _device()
        batch = {key: sample[key].to(device, non_blocking=True) if sample.get(key) is not None else None
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())
    return {key: batch.get(key) for key in BATCH_KEYS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """(sum of the masked per-token losses, number of unmasked tokens, {'lm loss': [sum, tokens]}).

    Megatron's schedule divides by the token count (summed over micro-batches and DP ranks) and logs
    ``lm loss`` the same way. NaN/Inf (``--check-for-nan-in-loss-and-grad``, on by default) and spiky losses
    (``--check-for-spiky-loss``) go through the rerun state machine, as in Megatron-LM's script."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    rerun = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        rerun.validate_result(result=loss, message="Spiky loss", tolerance=0.0, fatal=False,
                              rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                     context="loss"))
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: (output tensor = per-token losses, the loss function to apply to it).

    With ``--overlap-moe-expert-parallel-comm`` Megatron asks for the schedule plan instead of the output."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args, get_timers

    args, timers = get_args(), get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    tokens, position_ids, attention_mask = batch["tokens"], batch["position_ids"], batch["attention_mask"]
    labels, loss_mask = batch["labels"], batch["loss_mask"]
    if return_schedule_plan:
        assert args.overlap_moe_expert_parallel_comm, \
            "the schedule plan is only built with --overlap-moe-expert-parallel-comm"
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask, model=model)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, model=model)


# --------------------------------------------------------------------------------------------------- data


def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Datasets are read on TP rank 0 of the stages that need tokens or labels (first, last, MTP)."""
    from megatron.core import mpu
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_on_this_rank(get_args(), vp_stage)


def _tokenizer(args):
    from megatron.training import global_vars

    tokenizer = getattr(global_vars, "_GLOBAL_TOKENIZER", None)  # built by parse_and_validate_args
    if tokenizer is None:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args)
    return tokenizer


def dataset_config_from_args(args):
    """GPTDatasetConfig for these arguments (mock when neither --data-path nor per-split paths are given)."""
    import json

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage: Optional[int] = None):
    """(train, valid, test) datasets of the requested sizes: MockGPTDataset with --mock-data, else GPTDataset."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    config = dataset_config_from_args(args)
    cls = MockGPTDataset if args.mock_data or config.mock else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({cls.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples,
                                             partial(is_dataset_built_on_rank, vp_stage=vp_stage), config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron builds the datasets on every rank that needs them and lets this provider decide (core datasets).
train_valid_test_datasets_provider.is_distributed = True


# --------------------------------------------------------------------------------------------------- driver

# Features of Megatron-LM's pretrain_gpt.py that this compact driver does not implement: (args attribute, flag).
_UNSUPPORTED = (("sft", "--sft"), ("fim_data", "--fim-data"),
                ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
                ("hybrid_context_parallel", "--hybrid-context-parallel"),
                ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                ("logits_load_dir", "--logits-load-dir"))


def unsupported(args) -> list[str]:
    """The flags in ``args`` that need Megatron-LM's own pretrain_gpt.py (``--megatron-lm DIR``)."""
    found = [flag for attr, flag in _UNSUPPORTED if getattr(args, attr, None) not in (None, False)]
    if getattr(args, "transformer_impl", None) == "inference_optimized":
        found.append("--transformer-impl inference_optimized")
    return found


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def kernel_fallbacks(args, importable=_importable) -> list[str]:
    """Turn off, in ``args``, fusions whose kernels are not installed, before any config is built from them.

    Megatron's defaults assume Apex and Transformer Engine (NGC containers); with torch + megatron-core alone
    they fail at model build or first forward. Returns one line per change (printed by :func:`main`); changes
    nothing that works. Raises SystemExit for ``--transformer-impl transformer_engine`` without TE."""
    notes = []
    has_te = importable("transformer_engine")
    if _use_te(args) and not has_te:
        raise SystemExit("--transformer-impl transformer_engine needs Transformer Engine, which is not installed; "
                         "pass --transformer-impl local (megatron-core modules only)")
    if args.gradient_accumulation_fusion and not importable("fused_weight_gradient_mlp_cuda"):
        # megatron.core.tensor_parallel.layers refuses to build ColumnParallelLinear (the output layer with TE too).
        args.gradient_accumulation_fusion = False
        notes.append("--no-gradient-accumulation-fusion (Apex's fused_weight_gradient_mlp_cuda is not installed)")
    if not _use_te(args) and not args.no_persist_layer_norm and (
            args.normalization == "RMSNorm" or not importable("apex")):
        # The local spec's norm is then torch's (WrappedTorchNorm), which asserts persist_layer_norm is off.
        args.no_persist_layer_norm = True
        notes.append("--no-persist-layer-norm (the local norm is torch's: persistent fused LayerNorm is Apex's)")
    if args.masked_softmax_fusion and not _use_te(args) and not (
            importable("scaled_upper_triang_masked_softmax_cuda") and importable("scaled_masked_softmax_cuda")):
        # The local DotProductAttention's FusedScaleMaskSoftmax imports these at the first bf16 forward.
        args.masked_softmax_fusion = False
        notes.append("--no-masked-softmax-fusion (Apex's fused softmax kernels are not installed)")
    if args.apply_rope_fusion and args.multi_latent_attention and args.rope_type != "yarn":
        # TransformerConfig: "apply_rope_fusion for MLA only works with YARN RoPE."
        args.apply_rope_fusion = False
        notes.append(f"--no-rope-fusion (fused RoPE with MLA needs --rope-type yarn, not {args.rope_type})")
    elif args.apply_rope_fusion and not has_te:
        args.apply_rope_fusion = False
        notes.append("--no-rope-fusion (the fused RoPE kernels come with Transformer Engine, not installed)")
    return notes


def use_prebuilt_dataset_helpers() -> bool:
    """Skip Megatron's `make` of the dataset index helpers when the wheel already ships them compiled.

    megatron.training's initialisation always runs ``make`` in megatron/core/datasets; the megatron-core wheel ships
    ``helpers_cpp`` prebuilt but no Makefile, so the make fails and Megatron exits. Returns True when it patched.
    """
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401  (prebuilt in the wheel)
    except ImportError:
        return False  # a source checkout: let Megatron compile them as usual
    if getattr(dataset_utils.compile_helpers, "_uccl_prebuilt", False):
        return True

    def compile_helpers() -> None:
        """The helpers are prebuilt (megatron.core.datasets.helpers_cpp imports): nothing to compile."""

    compile_helpers._uccl_prebuilt = True  # type: ignore[attr-defined]
    dataset_utils.compile_helpers = compile_helpers
    return True


def main(argv: Optional[list[str]] = None) -> None:
    """Parse Megatron's arguments (``argv`` or sys.argv[1:]) and run ``megatron.training.pretrain`` with this
    module's providers. :func:`megatron_patch.apply` must have run (megatron_patch.pretrain_gpt does it)."""
    program_start = time.time()
    if int(os.environ.get("RANK", "0")) != 0:
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, print_rank_0, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    set_startup_timestamps(program_start=program_start, main_entry=time.time())
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    missing = unsupported(args)
    if missing:
        raise SystemExit(f"megatron_patch.pretrain_gpt: {', '.join(missing)} need Megatron-LM's own pretrain_gpt.py; "
                         "pass --megatron-lm DIR (a Megatron-LM checkout matching megatron-core)")
    for note in kernel_fallbacks(args):
        print_rank_0(f"megatron_patch.gpt_provider: {note}")
    use_prebuilt_dataset_helpers()
    with warnings.catch_warnings():  # "use a ModelConfig instead of a model provider": we pass a provider
        warnings.simplefilter("ignore")
        cfg = pretrain_cfg_container_from_args(args, None)
    run(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
        model_provider=model_provider, store=store, get_embedding_ranks=get_embedding_ranks)
