"""megatron_patch against the installed megatron-core (0.19.2, and 0.16.1 in CI's compatibility stage): flag, config
checks, MoELayer, EP overlap. What a version lacks is skipped with the missing piece named, never faked."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import pickle
import typing
import warnings
from pathlib import Path

import pytest

import megatron_patch
from megatron_patch import arguments as patch_arguments
from megatron_patch import config as patch_config
from megatron_patch import ep_overlap


def _training(name: str):
    """megatron.training.<name>, or a skip naming why it is absent. The megatron-core 0.16 wheel ships no
    megatron.training (Megatron-LM provides it); `megatron` is a namespace package, so a megatron.training of another
    install may be found beside it, and that one does not belong to this megatron.core."""
    import megatron.core

    core_root = Path(megatron.core.__file__).resolve().parents[1]
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"megatron-core {megatron_patch.megatron_version()} ships no megatron.training")
    training_root = Path(next(iter(spec.submodule_search_locations))).resolve().parent
    if training_root != core_root:
        pytest.skip(f"megatron-core {megatron_patch.megatron_version()} ({core_root / 'core'}) ships no "
                    f"megatron.training (the one at {training_root} belongs to another install)")
    return pytest.importorskip(f"megatron.training.{name}")


def _megatron_parser() -> argparse.ArgumentParser:
    arguments = _training("arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return arguments.add_megatron_arguments(parser)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=32, moe_token_dispatcher_type="uccl")
    values.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**values)


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------
def test_megatron_parser_accepts_uccl_dispatcher_after_apply(patched):
    args = _megatron_parser().parse_args(["--moe-token-dispatcher-type", "uccl"])
    assert args.moe_token_dispatcher_type == "uccl"


def test_megatron_parser_still_accepts_builtin_dispatchers(patched):
    parser = _megatron_parser()
    for name in ("allgather", "alltoall", "flex"):
        assert parser.parse_args(["--moe-token-dispatcher-type", name]).moe_token_dispatcher_type == name


def test_megatron_parser_rejects_misspelling_and_lists_every_choice(patched, capsys):
    with pytest.raises(SystemExit) as exc:
        _megatron_parser().parse_args(["--moe-token-dispatcher-type", "ucl"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'ucl'" in err
    for name in ("allgather", "alltoall", "flex", "uccl"):
        assert f"'{name}'" in err


def test_literal_annotation_lists_uccl_and_generates_the_choices(patched):
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    assert typing.get_origin(field.type) is typing.Literal
    assert typing.get_args(field.type).count("uccl") == 1
    assert {"allgather", "alltoall", "flex"} <= set(typing.get_args(field.type))
    factory_module = _training("argument_utils")
    kwargs = factory_module.ArgumentGroupFactory(TransformerConfig)._build_argparse_kwargs_from_field(field)
    assert "uccl" in kwargs["choices"]


def test_hand_listed_choices_of_older_megatron_are_extended_by_the_hook():
    # Megatron-LM before the generated arguments listed the choices by hand in _add_moe_args.
    def _add_moe_args(parser):
        group = parser.add_argument_group(title="moe")
        group.add_argument("--moe-token-dispatcher-type", type=str, choices=["allgather", "alltoall", "flex"],
                           default="allgather", help="dispatcher")
        return parser

    hook = patch_arguments._extending(_add_moe_args)
    parser = hook(argparse.ArgumentParser())
    assert patch_arguments.extend_choices(parser)  # a second pass must not duplicate
    action = next(a for a in parser._actions if a.dest == "moe_token_dispatcher_type")
    assert list(action.choices) == ["allgather", "alltoall", "flex", "uccl"]
    assert parser.parse_args(["--moe-token-dispatcher-type", "uccl"]).moe_token_dispatcher_type == "uccl"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-token-dispatcher-type", "ucl"])


def test_hook_fails_loudly_when_the_parser_has_no_dispatcher_flag():
    hook = patch_arguments._extending(lambda parser: parser)
    with pytest.raises(megatron_patch.UnsupportedMegatronVersion, match="--moe-token-dispatcher-type"):
        hook(argparse.ArgumentParser())


# ---------------------------------------------------------------------------------------------------------------
# TransformerConfig.__post_init__
# ---------------------------------------------------------------------------------------------------------------
def test_transformer_config_with_uccl_and_shared_expert_overlap_validates(patched):
    cfg = _config(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    assert cfg.moe_token_dispatcher_type == "uccl"
    assert cfg.moe_shared_expert_overlap


def test_shared_expert_overlap_is_still_refused_for_allgather(patched):
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        _config(moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=64,
                moe_shared_expert_overlap=True)


def test_transformer_config_with_uccl_and_ep_overlap_validates(patched):
    if not ep_overlap.supported():
        pytest.skip(f"EP overlap not patched on this Megatron: {ep_overlap.why_unsupported()}")
    cfg = _config(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True)
    assert cfg.overlap_moe_expert_parallel_comm and cfg.moe_token_dispatcher_type == "uccl"


def test_uccl_refuses_deepep_flag_and_capacity_padding_with_a_fix(patched):
    with pytest.raises(ValueError, match="drop --moe-enable-deepep"):
        _config(moe_enable_deepep=True)
    with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity"):
        _config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def test_megatron_rules_shared_with_alltoall_still_apply_to_uccl(patched):
    # Megatron's own check (validated as alltoall); the note says how to read the message.
    with pytest.raises((ValueError, AssertionError)) as exc:
        _config(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=1, bf16=True)
    assert "expert" in str(exc.value)
    assert any("uccl" in note for note in getattr(exc.value, "__notes__", []))


def test_uccl_config_survives_a_pickled_checkpoint_args_namespace(patched):
    import torch

    argument_utils = _training("argument_utils")
    args = _megatron_parser().parse_args(["--moe-token-dispatcher-type", "uccl", "--num-layers", "2",
                                          "--hidden-size", "64", "--num-attention-heads", "4",
                                          "--num-experts", "8", "--moe-router-topk", "2",
                                          "--no-rope-fusion", "--no-masked-softmax-fusion",
                                          "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion"])
    saved = pickle.loads(pickle.dumps(args))  # what a checkpoint's 'args' entry goes through
    assert saved.moe_token_dispatcher_type == "uccl"
    saved.params_dtype = torch.float32
    saved.num_moe_experts = saved.num_experts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = argument_utils.core_transformer_config_from_args(saved)
    assert cfg.moe_token_dispatcher_type == "uccl"


# ---------------------------------------------------------------------------------------------------------------
# Idempotence and unknown versions
# ---------------------------------------------------------------------------------------------------------------
def test_apply_twice_returns_the_same_report_and_wraps_once(patched):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    again = megatron_patch.apply()
    assert again is patched and megatron_patch.is_applied()
    for fn in (TransformerConfig.__post_init__, MoELayer.__init__):
        assert getattr(fn, "__uccl_patched__", False)
        assert not getattr(fn.__uccl_original__, "__uccl_patched__", False)
    assert patch_config.choices().count("uccl") == 1
    action = next(a for a in _megatron_parser()._actions if a.dest == "moe_token_dispatcher_type")
    assert list(action.choices).count("uccl") == 1


def test_apply_again_after_a_reset_does_not_double_wrap(patched, monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(megatron_patch, "_REPORT", None)
    before = TransformerConfig.__post_init__
    report = megatron_patch.apply()
    assert TransformerConfig.__post_init__ is before
    assert report.applied == patched.applied


def test_unknown_megatron_without_moe_layer_fails_loudly_naming_version_and_piece(patched, monkeypatch):
    from megatron.core import package_info
    from megatron.core.transformer.moe import moe_layer

    monkeypatch.setattr(megatron_patch, "_REPORT", None)
    monkeypatch.setattr(package_info, "__version__", "0.99.0rc0")
    monkeypatch.delattr(moe_layer, "MoELayer")
    with pytest.raises(megatron_patch.UnsupportedMegatronVersion) as exc:
        megatron_patch.apply()
    assert "0.99.0rc0" in str(exc.value) and "MoELayer" in str(exc.value)
    assert not megatron_patch.is_applied()


def test_unknown_megatron_without_literal_annotation_fails_loudly(patched, monkeypatch):
    from megatron.core import package_info
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(megatron_patch, "_REPORT", None)
    monkeypatch.setattr(package_info, "__version__", "1.0.0")
    monkeypatch.setattr(TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"], "type", str)
    with pytest.raises(megatron_patch.UnsupportedMegatronVersion, match=r"1\.0\.0.*moe_token_dispatcher_type"):
        megatron_patch.apply()


def test_unknown_megatron_without_stand_in_dispatcher_name_fails_loudly(patched, monkeypatch):
    from megatron.core.transformer.moe import moe_layer

    monkeypatch.setattr(megatron_patch, "_REPORT", None)
    monkeypatch.delattr(moe_layer, "MoEAlltoAllTokenDispatcher")
    with pytest.raises(megatron_patch.UnsupportedMegatronVersion, match="MoEAlltoAllTokenDispatcher"):
        megatron_patch.apply()


def test_postponed_string_annotation_is_extended_too():
    assert patch_config._with_uccl("Literal['allgather', 'alltoall', 'flex']") == \
        "Literal['allgather', 'alltoall', 'flex', 'uccl']"
    assert patch_config._with_uccl("typing.Literal['a']") == "Literal['a', 'uccl']"
    with pytest.raises(ValueError):
        patch_config._with_uccl("str")


# ---------------------------------------------------------------------------------------------------------------
# EP overlap: should_free_input
# ---------------------------------------------------------------------------------------------------------------
def test_ep_overlap_keeps_the_dispatch_input_of_uccl_alive(patched):
    if not ep_overlap.supported():
        pytest.skip(f"EP overlap not patched on this Megatron: {ep_overlap.why_unsupported()}")
    # 0.16 holds should_free_input in models.gpt.fine_grained_callables, 0.19 in models.common.utils: every module
    # present must be patched, and each answers for uccl.
    holders = []
    for name in ep_overlap.MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, ep_overlap.FUNCTION, None)):
            holders.append(module)
    assert holders, ep_overlap.MODULES
    for module in holders:
        assert getattr(getattr(module, ep_overlap.FUNCTION), "__uccl_patched__", False), module.__name__
        _check_should_free_input(getattr(module, ep_overlap.FUNCTION))


def _check_should_free_input(free):
    extra = (2,) if "num_local_experts" in free.__uccl_original__.__code__.co_varnames else ()
    uccl, alltoall = _config(), _config(moe_token_dispatcher_type="alltoall")
    # alltoall permutes before dispatch: its dispatch input is a fresh tensor, freed after forward.
    assert free("moe_dispatch", True, alltoall, *extra) is True
    # uccl only reshapes: the input is the layernorm output the router still needs, as with flex/DeepEP.
    assert free("moe_dispatch", True, uccl, *extra) is False
    assert free("moe_combine", True, uccl, *extra) is True
    expert_major = ep_overlap.flex_backend_like_uccl(uccl) == "hybridep"
    # expert-major receive feeds the grouped GEMM without a copy: its input must survive (HybridEP's rule).
    assert free("mlp", True, uccl, *extra) is (not expert_major)
    assert free("mlp", False, uccl, *extra) is False


def test_flex_view_answers_flex_for_uccl_and_is_read_only(patched):
    cfg = _config(moe_router_topk=3)
    view = ep_overlap.FlexView(cfg, "deepep")
    assert view.moe_token_dispatcher_type == "flex" and view.moe_flex_dispatcher_backend == "deepep"
    assert view.moe_router_topk == 3
    with pytest.raises(AttributeError):
        view.moe_router_topk = 4
    assert cfg.moe_token_dispatcher_type == "uccl"


def test_report_lists_every_applied_piece(patched):
    text = str(patched)
    for piece in ("Literal", "__post_init__", "MoELayer", "--moe-token-dispatcher-type"):
        assert piece in text
    # The parser piece is applied where megatron.training imports, and reported as skipped (with why) elsewhere.
    parser_lines = [line for line in patched.applied + patched.skipped if "--moe-token-dispatcher-type" in line]
    assert len(parser_lines) == 1
    if parser_lines[0] in patched.skipped:
        assert "megatron.training.arguments" in parser_lines[0]
    assert dataclasses.is_dataclass(patched)
