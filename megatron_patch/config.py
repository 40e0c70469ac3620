"""TransformerConfig learns ``moe_token_dispatcher_type='uccl'``.

Two changes:

- the ``Literal[...]`` annotation of the field gains ``'uccl'``. Megatron (0.19 for one) generates the
  ``--moe-token-dispatcher-type`` argparse choices from it, and tools that validate configs against the annotation
  (Primus's schema checks, type checkers reading ``__annotations__``) see it too;
- ``__post_init__`` validates a ``uccl`` config with the rules it applies to ``alltoall``: the two dispatchers
  take the same inputs and support the same features (shared-expert overlap, EP communication overlap, padding
  for quantization, no capacity padding requirement), while the flex-only rules (DeepEP/HybridEP/NCCL-EP backend
  choices) do not concern ``uccl``. Only the comparison value changes during the check: Megatron's own code runs.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from typing import Any, Literal

from megatron_patch import DISPATCHER_TYPE, is_patched, mark_patched, missing

FIELD = "moe_token_dispatcher_type"
# The dispatcher whose validation rules uccl shares (see the module docstring).
VALIDATE_AS = "alltoall"


def _with_uccl(annotation: Any) -> Any:
    """``Literal['a', 'b']`` -> ``Literal['a', 'b', 'uccl']``; also for the string form of postponed annotations."""
    if isinstance(annotation, str):
        tree = ast.parse(annotation, mode="eval").body
        if not (isinstance(tree, ast.Subscript) and getattr(tree.value, "id", getattr(tree.value, "attr", None))
                == "Literal"):
            raise ValueError(annotation)
        values = tree.slice.elts if isinstance(tree.slice, ast.Tuple) else [tree.slice]
        choices = tuple(ast.literal_eval(v) for v in values)
        if DISPATCHER_TYPE in choices:
            return annotation
        return "Literal[" + ", ".join(repr(c) for c in choices + (DISPATCHER_TYPE,)) + "]"
    if typing.get_origin(annotation) is not Literal:
        raise ValueError(annotation)
    choices = typing.get_args(annotation)
    if DISPATCHER_TYPE in choices:
        return annotation
    return Literal[choices + (DISPATCHER_TYPE,)]  # type: ignore[valid-type]


def choices() -> tuple[str, ...]:
    """The dispatcher types the (patched or not) TransformerConfig annotation lists."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    annotation = TransformerConfig.__dataclass_fields__[FIELD].type
    if isinstance(annotation, str):
        tree = ast.parse(annotation, mode="eval").body
        values = tree.slice.elts if isinstance(tree.slice, ast.Tuple) else [tree.slice]
        return tuple(ast.literal_eval(v) for v in values)
    return tuple(typing.get_args(annotation))


class _Plan:
    def __init__(self, cls: type, fields: list[dataclasses.Field]):
        self.cls, self.fields = cls, fields

    def apply(self, report) -> None:
        for f in self.fields:
            f.type = _with_uccl(f.type)
        for klass in _with_subclasses(self.cls):
            ann = klass.__dict__.get("__annotations__")
            if ann and FIELD in ann:
                ann[FIELD] = _with_uccl(ann[FIELD])
        report.applied.append(f"TransformerConfig.{FIELD}: Literal now lists {choices()}")

        original = self.cls.__post_init__
        if not is_patched(original):
            self.cls.__post_init__ = _validating_uccl_as(original)
        report.applied.append(f"TransformerConfig.__post_init__: validates '{DISPATCHER_TYPE}' with the "
                              f"'{VALIDATE_AS}' rules plus uccl's own")


def _with_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        klass = todo.pop()
        out.append(klass)
        todo.extend(klass.__subclasses__())
    return out


def check_uccl_config(cfg: Any) -> None:
    """Rules of our own for a ``uccl`` config, with messages that say what to change."""
    if getattr(cfg, "moe_enable_deepep", False):
        raise ValueError("moe_enable_deepep=True selects the flex dispatcher over DeepEP and cannot be combined with "
                         "moe_token_dispatcher_type='uccl': drop --moe-enable-deepep")
    if getattr(cfg, "moe_pad_expert_input_to_capacity", False):
        raise ValueError("moe_token_dispatcher_type='uccl' does not pad expert inputs to capacity "
                         "(moe_pad_expert_input_to_capacity); drop it, or use the sync-free mode "
                         "(docs/megatron.md) for static shapes")
    if getattr(cfg, "overlap_moe_expert_parallel_comm", False):
        from megatron_patch import ep_overlap

        if not ep_overlap.supported():
            raise ValueError("overlap_moe_expert_parallel_comm with moe_token_dispatcher_type='uccl' needs the "
                             "EP-overlap patch, which this Megatron version did not accept "
                             f"({ep_overlap.why_unsupported()}); disable the overlap")


def _validating_uccl_as(original):
    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if getattr(self, FIELD, None) != DISPATCHER_TYPE:
            return original(self, *args, **kwargs)
        check_uccl_config(self)
        object.__setattr__(self, FIELD, VALIDATE_AS)
        try:
            return original(self, *args, **kwargs)
        except (ValueError, AssertionError) as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"(moe_token_dispatcher_type='{DISPATCHER_TYPE}' is validated with the rules of "
                             f"'{VALIDATE_AS}'; read '{VALIDATE_AS}' in the message above as '{DISPATCHER_TYPE}')")
            raise
        finally:
            object.__setattr__(self, FIELD, DISPATCHER_TYPE)

    return mark_patched(__post_init__, original)


def plan() -> _Plan:
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        raise missing("TransformerConfig", f"megatron.core.transformer.transformer_config ({exc})") from exc
    field_obj = getattr(TransformerConfig, "__dataclass_fields__", {}).get(FIELD)
    if field_obj is None:
        raise missing(f"dataclass field {FIELD}", "TransformerConfig")
    if not callable(getattr(TransformerConfig, "__post_init__", None)):
        raise missing("__post_init__", "TransformerConfig")
    fields = []
    for klass in _with_subclasses(TransformerConfig):
        f = getattr(klass, "__dataclass_fields__", {}).get(FIELD)
        if f is not None and all(f is not g for g in fields):
            try:
                _with_uccl(f.type)
            except (ValueError, SyntaxError):
                raise missing(f"a Literal annotation of {FIELD} (found {f.type!r})", klass.__qualname__) from None
            fields.append(f)
    return _Plan(TransformerConfig, fields)
