"""What one call carries from one of its steps to the next: a hop pushed but not awaited (Pending), where notify's
count rows land (CountRows), a reader launched before the count read (ReadingBeforeCounts), an uncached
dispatch between notify and its count read (UncachedDispatch), and an expert-major receive's outputs
(ExpertMajorRows)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from uccl_ep_train.internode.plan import RecordLayout


class Pending(NamedTuple):
    """A hop pushed but not awaited (_push_and_gate): its reader launches gated on ``gate`` and closes the hop."""

    gate: Any  # the native ArrivalGate
    t0: Any  # timing start (_hop_started)
    slots: List[int]  # the counters the hop's waits name
    first_row: int = 0  # where the reader starts: the first of the rows already in (unpack_records' first_row)
    records: int = 0  # what the hop's waits add up to: its records (chunks' signal values) to land
    # our own node's rows, never packed, for the reader to take from the columns (docs/internode.md, "Own rows from
    # the columns"): (first row, count, first record, tokens, columns) as unpack_records' `own`; None: packed
    own: Optional[tuple] = None
    own_columns: Any = None  # the columns' tensors, alive until the reader's launch


@dataclass(frozen=True)
class CountRows:
    """Where notify's count rows land on this rank, and what proves they did: for a kernel that waits for them on the
    GPU (push_after_counts, "Push during notify")."""

    slot: int
    target: int  # signal[slot] >= target: every other rank's row is in
    ptr: int  # device address of rank 0's row; rank r's at ptr + 8 * r * row_words
    row_words: int
    # our own row's pushes to the others (device push table, rows), left to the kernel that waits for theirs when the
    # caller asked (_notify's row_goes_with_then); None: pushed already
    own_pushes: Optional[Tuple[int, int]] = None


@dataclass
class ReadingBeforeCounts:
    """A dispatch whose reader is launched before the host reads the count matrix (docs/internode.md, "Reading before
    the count read"): its outputs, allocated for ``rows`` rows before any count is known, what the reader needs
    besides, and, once launched, its hop's timing start. The reader reads only when the count rows say it may
    (read_before_counts); the host learns which from the same counts after notify."""

    # the outputs' (rows, (dtype, row shape) of each payload column, top-k) (_read_spec); rows: num_worst_tokens,
    # or a guess from the last dispatch of this size
    spec: tuple
    pad: bool  # padded to the rows (num_worst_tokens), else cut at the rows received
    layout: RecordLayout
    experts_per_rank: int
    own_columns: List[Tuple[int, int, int]]  # our columns, as pack_records takes them (_column_args)
    own_tokens: int  # device address of the send plan's tokens (hop1_token)
    # taken from the spare made during the last combine's hop, or made at the launch (_launch_reader_before_counts)
    outs: List[torch.Tensor] = field(default_factory=list)
    topk_idx: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    src_idx: Optional[torch.Tensor] = None
    arrival: Optional[torch.Tensor] = None
    t0: Any = None
    # an expert-major receive written by its reader (docs/internode.md, "Expert-major rows in the reader"): the
    # expert-major rows allocated before the counts (num_worst_tokens, or a guess as for the rows), 0: rank-major;
    # the outputs, made at the launch (_launch_reader_before_counts)
    expert_rows: int = 0
    alignment: int = 1
    em: Optional["ExpertMajorRows"] = None
    # several GPUs per node (docs/internode.md, "The forward before the count read"): the send plan's dest rows (our
    # own records are packed into our arrivals from them), the tokens (the pack's grid), the forward's final rows at
    # each local GPU for as many arrivals as the receive area holds (made before notify), and its node barrier's epoch
    own_dest_rows: int = 0
    tokens: int = 0
    fwd_dest: Optional[torch.Tensor] = None
    epoch: int = 0
    # the counters' bases for the kernel that reads the count rows: by value, or (more than READ_MAX_COUNTERS) a
    # device table uploaded before notify (_counter_bases)
    bases: List[int] = field(default_factory=list)
    bases_table: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.spec[0]


@dataclass
class UncachedDispatch:
    """An uncached dispatch as notify leaves it, for the steps that follow from the counts (_after_counts): right
    away, or, where it returned before the count read (``returned_early``), at the next call's entry."""

    args: Any  # DispatchArgs
    combined_send_base: Optional[int]
    itr: torch.Tensor
    in_reader: bool
    cols: List[torch.Tensor]
    early: dict  # what packing during notify did
    reading: Optional[ReadingBeforeCounts]
    returned_early: bool


@dataclass
class ExpertMajorRows:
    """An expert-major receive's plan and payload outputs, allocated -- and the plan's sizes uploaded -- before the
    reader's launch, where an allocation may still call into CUDA ("Drains"), so that after the drain only the plan
    and copy launches are left (~200-300 us of host steps there under MPS in session 27). Sizes from the counts."""

    rows: int  # expert-major rows: the aligned counts' sum, or num_worst_tokens
    info: torch.Tensor  # int32 [received rows, 0, raw count per local expert]: recv_info's layout
    token: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    weights: torch.Tensor
    slot_of: torch.Tensor
    out: List[torch.Tensor]  # the payload columns (x, then the scales if any)
    # written by the reader itself (expert_major_places): where each source's rows and pairs go
    places: Optional[torch.Tensor] = None
