"""``Buffer``: DeepEP v1's high-throughput API (get_dispatch_layout / dispatch / combine) over a pluggable backend.

Code written for ``deep_ep.Buffer`` runs unchanged: same constructor, argument names, return tuples, handle reuse
(cached mode), ``Config``, ``get_dispatch_config``/``get_combine_config``, ``set_num_sms``, ``EventOverlap``,
``previous_event``/``async_finish``/``allocate_on_comm_stream``. Additions, all keyword-only and off by default:

* ``dispatch(..., expert_major=True)``: receive in expert-major order (uccl_ep_train.reference documents the layout);
  ``combine`` then reads that layout from the handle.
* ``Buffer(..., ranks_per_node=G)``: the topology (default: UCCL_EP_RANKS_PER_NODE, else LOCAL_WORLD_SIZE, else one
  node); with G < group size the internode (hierarchical) path is used.
* ``Buffer(..., backend="auto"|"native"|"reference")`` overrides UCCL_EP_BACKEND.
* Autograd: when grad mode is on and ``x`` or ``topk_weights`` requires grad, dispatch and combine are differentiable
  (dispatch's backward is combine with the handle; combine's backward is a cached dispatch). DeepEP users who wrap
  the Buffer in their own autograd.Function are unaffected (grad mode is off inside Function.forward).

Every argument is checked before any communication; errors name the argument and say what to change. Value checks
that need the host to read device memory (expert ids in range, no repeated expert in a row) are skipped in the
sync-free mode (``num_worst_tokens`` > 0) and while a CUDA graph is being captured.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from uccl_ep_train.backends import Backend, BackendContext, DispatchArgs, select_backend
from uccl_ep_train.event import EventOverlap
from uccl_ep_train.reference import FP8_BLOCK, Communicator, differentiable_combine, differentiable_dispatch
from uccl_ep_train.settings import Settings, load_settings

PAYLOAD_DTYPES = (torch.bfloat16, torch.float32)
_MAX_TOPK = 128  # slots budgeted per token in the buffer size hints (as DeepEP)
_SOURCE_META_BYTES = 8  # per-token routing record of the internode path (source node + local-rank bitmask)


@dataclass(frozen=True)
class Config:
    """Performance knobs of the high-throughput kernels (DeepEP's positional order), and buffer size hints.

    ``num_max_*_chunked_send_tokens`` tokens move per step through rings of ``num_max_*_chunked_recv_tokens`` slots
    per (channel, peer); one channel uses two SMs.
    """

    num_sms: int = 24
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"Config.num_sms={self.num_sms} must be an even number >= 2 (SMs pair up per channel)")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config needs 0 < num_max_nvl_chunked_send_tokens "
                             f"({self.num_max_nvl_chunked_send_tokens})"
                             f" < num_max_nvl_chunked_recv_tokens ({self.num_max_nvl_chunked_recv_tokens})")
        send, recv = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        if send <= 0 or recv <= 0:
            raise ValueError("Config: the RDMA chunk sizes must be positive")
        recv = (recv + send - 1) // send * send  # the ring holds whole chunks
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", recv)
        if send > recv // 2:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens ({send}) must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens ({recv}) so senders always find room")

    def _per_token_bytes(self, hidden_bytes: int) -> int:
        return (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4
                + (hidden_bytes // FP8_BLOCK + 1) * 4)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, ranks_per_node: Optional[int] = None) -> int:
        """Bytes of NVLink buffer per rank for tokens of ``hidden_bytes`` (hidden * max(element size, 2))."""
        nvl_ranks = min(num_ranks, ranks_per_node or num_ranks)
        rdma_ranks = max(num_ranks // nvl_ranks, 1)
        channels = self.num_sms // 2
        size = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        size += channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens * self._per_token_bytes(hidden_bytes)
        return (size + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                  ranks_per_node: Optional[int] = None) -> int:
        """Bytes of registered (network) buffer per rank; 0 when all ranks share one node."""
        ranks_per_node = ranks_per_node or num_ranks
        if num_ranks <= ranks_per_node:
            return 0
        rdma_ranks = num_ranks // ranks_per_node
        channels = self.num_sms // 2
        size = channels * rdma_ranks * (ranks_per_node * 2 + 2) * 2 * 4
        size += channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * 2 * (
            self._per_token_bytes(hidden_bytes) + 16)
        return (size + 127) // 128 * 128


# Recommended chunk sizes by group size (DeepEP's tuned values where it has them); other sizes use the nearest.
_DISPATCH_CHUNKS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 64: (32, 288, 8, 128), 128: (20, 560, 12, 128)}
_COMBINE_CHUNKS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 8, 128), 128: (1, 560, 8, 128)}


def _nearest(table: dict, num_ranks: int) -> tuple:
    return table[min(table, key=lambda n: (abs(n - num_ranks), n))]


def _resolve_ranks_per_node(explicit: Optional[int], settings: Settings, num_ranks: int) -> int:
    # LOCAL_WORLD_SIZE is torchrun's, not ours: settings.py owns only UCCL_* names.
    value = explicit or settings.emulation.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    value = value or num_ranks
    value = min(value, num_ranks)
    if num_ranks % value:
        raise ValueError(f"ranks_per_node={value} must divide the group size {num_ranks} "
                         "(set UCCL_EP_RANKS_PER_NODE or Buffer(ranks_per_node=...))")
    return value


def _group_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend or "rccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_tensor(name: str, t: Any, *, dtypes: tuple, dim: int, device: torch.device,
                  shape: Optional[tuple] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; it must be {want} (convert with .to(...))")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; dimension {axis} must be {want} "
                                 f"(expected {tuple('*' if s is None else s for s in shape)})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the Buffer's group works on {device}; move it with "
                         f".to('{device}')")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")


def _host_checks_allowed(num_worst_tokens: int) -> bool:
    if num_worst_tokens > 0:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class _BufferCommunicator(Communicator):
    """Autograd's view of a Buffer: synchronous cached dispatch and combine on the Buffer's backend."""

    def __init__(self, buffer: "Buffer") -> None:
        self.buffer = buffer

    def dispatch_cached(self, x, handle):
        return self.buffer._dispatch_impl(x, None, handle=handle)[0]

    def combine(self, x, handle, topk_weights):
        out = self.buffer._combine_impl(x, handle, topk_weights)
        return out[0], out[1]


class Buffer:
    """DeepEP-v1-compatible expert-parallel communication buffer (high-throughput mode).

    Attributes: ``rank``, ``group_size``, ``group``, ``num_nvl_bytes``, ``num_rdma_bytes``, ``ranks_per_node``,
    ``num_nodes``, ``device``, ``backend`` (the object moving tokens; ``backend.name`` is "reference" or "native").
    """

    num_sms: int = 24
    _num_sms_from_user = False

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None, *,
                 ranks_per_node: Optional[int] = None, backend: Optional[str] = None,
                 device: Optional[torch.device] = None, settings: Optional[Settings] = None) -> None:
        """Create the buffer (collective over ``group``; default: the world group).

        ``num_nvl_bytes`` / ``num_rdma_bytes``: buffer sizes as in DeepEP (``Config.get_nvl_buffer_size_hint``);
        0 lets the backend size its own buffers. ``low_latency_mode`` is not supported (use the high-throughput
        mode); ``num_qps_per_rank``, ``allow_*``, ``enable_shrink`` and ``comm`` are accepted for compatibility.
        """
        if low_latency_mode:
            raise NotImplementedError("low_latency_mode=True is not supported by uccl-ep-train; use the "
                                      "high-throughput dispatch/combine (low_latency_mode=False)")
        if comm is not None and group is None:
            raise NotImplementedError("an mpi4py communicator is not supported; pass a torch.distributed group")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")
        self.settings = settings or load_settings()
        if not Buffer._num_sms_from_user:
            Buffer.num_sms = self.settings.kernel.num_sms
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._validated_topk: Optional[tuple] = None  # (weakref to topk_idx, its _version, num_experts)
        self.ranks_per_node = _resolve_ranks_per_node(ranks_per_node, self.settings, self.group_size)
        self.num_nodes = self.group_size // self.ranks_per_node
        self.device = torch.device(device) if device is not None else _group_device(self.group)
        self.explicitly_destroy = explicitly_destroy
        self._comm_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        ctx = BackendContext(group=self.group, rank=self.rank, num_ranks=self.group_size,
                             ranks_per_node=self.ranks_per_node, device=self.device, num_nvl_bytes=num_nvl_bytes,
                             num_rdma_bytes=num_rdma_bytes, settings=self.settings)
        self.backend: Backend = select_backend(ctx, backend)
        self._autograd = _BufferCommunicator(self)

    # ---------------------------------------------------------------------------------------------------- settings

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs used by the high-throughput kernels (even). Overrides UCCL_EP_NUM_SMS for every Buffer."""
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"set_num_sms({new_num_sms!r}): the SM count must be an even int >= 2")
        Buffer.num_sms = new_num_sms
        Buffer._num_sms_from_user = True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch Config for a group of ``num_ranks`` (any size is accepted)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        return Config(Buffer.num_sms, *_nearest(_DISPATCH_CHUNKS, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine Config for a group of ``num_ranks`` (any size is accepted)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        return Config(Buffer.num_sms, *_nearest(_COMBINE_CHUNKS, num_ranks))

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (a completed no-op event without CUDA), e.g. for ``previous_event``."""
        return EventOverlap.capture()

    def get_comm_stream(self):
        """The communication stream (None without CUDA)."""
        return self._comm_stream

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs Buffer(..., explicitly_destroy=True)")
        self.backend.destroy()

    # ------------------------------------------------------------------------------------------------------ checks

    def _check_events(self, previous_event, async_finish, allocate_on_comm_stream) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True requires previous_event (e.g. Buffer.capture()) and "
                             "async_finish=True, as in DeepEP")

    def _check_topk_idx(self, topk_idx, num_experts: int, num_worst_tokens: int = 0) -> None:
        _check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), dim=2, device=self.device)
        if not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"num_experts={num_experts!r} must be a positive int")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks "
                             f"({self.group_size}) so every rank owns the same number of experts")
        if topk_idx.numel() and _host_checks_allowed(num_worst_tokens):
            # get_dispatch_layout and dispatch usually see the same tensor: check it once (same object, unmodified).
            seen = self._validated_topk
            if seen is not None and seen[0]() is topk_idx and seen[1:] == (topk_idx._version, num_experts):
                return
            # One device-to-host copy for all three facts: each sync stalls the CPU until the GPU catches up.
            facts = [topk_idx.min(), topk_idx.max()]
            if topk_idx.size(1) > 1:
                ordered = topk_idx.sort(dim=1).values
                facts.append(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any().to(torch.int64))
            low, high, *dup = torch.stack(facts).tolist()
            if low < -1 or high >= num_experts:
                raise ValueError(f"topk_idx holds expert ids in [{low}, {high}]; they must be in [-1, {num_experts})"
                                 " (-1 = dropped)")
            if dup and dup[0]:
                raise ValueError("topk_idx names the same expert twice in one row; each token must select "
                                 "distinct experts (use -1 for unused slots)")
            self._validated_topk = (weakref.ref(topk_idx), topk_idx._version, num_experts)

    @staticmethod
    def get_nvl_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int,
                           element_size: int = 2, num_worst_tokens: int = 0, combine_element_size: int = 2) -> int:
        """num_nvl_bytes for the native intranode backend (direct placement sizes for the worst-case routing;
        ``num_worst_tokens``: the largest sync-free row count the caller will pass to dispatch;
        ``combine_element_size``: the combined x's, 2 for BF16, 4 for float32).

        DeepEP's ``Config.get_nvl_buffer_size_hint`` sizes ring buffers and is too small for this design; use the
        larger of the two when a Buffer may run either backend.
        """
        from uccl_ep_train.intranode import nvl_bytes_needed

        return nvl_bytes_needed(num_max_tokens_per_rank, num_ranks, hidden, num_topk, element_size,
                                num_worst_rows=num_worst_tokens, combine_element_size=combine_element_size)

    @staticmethod
    def get_internode_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int,
                                 ranks_per_node: int, element_size: int = 2,
                                 combine_element_size: int = 2) -> Tuple[int, int]:
        """(num_nvl_bytes, num_rdma_bytes) for the native internode backend when the group spans several nodes
        (its staged areas hold a whole call for the worst-case routing; docs/internode.md, "Buffers of one rank").
        ``element_size``: the dispatched payload's; ``combine_element_size``: the combined x's (2: BF16, 4: float32;
        a float32 combine needs twice the BF16 bytes)."""
        from uccl_ep_train.internode.plan import bytes_needed

        return bytes_needed(num_max_tokens_per_rank, hidden, num_topk, num_ranks, ranks_per_node, element_size,
                            combine_element_size)

    def _check_hidden_fits(self, hidden: int, element_size: int, config: Config) -> None:
        hidden_bytes = hidden * max(element_size, 2)
        if self.num_nvl_bytes:
            needed = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size, self.ranks_per_node)
            if needed > self.num_nvl_bytes:
                raise ValueError(f"hidden size {hidden} needs num_nvl_bytes >= {needed} with this Config "
                                 f"(Buffer has {self.num_nvl_bytes}); create the Buffer with "
                                 f"num_nvl_bytes=config.get_nvl_buffer_size_hint({hidden_bytes}, {self.group_size})")
        if self.num_rdma_bytes and self.num_nodes > 1:
            needed = config.get_rdma_buffer_size_hint(hidden_bytes, self.group_size, self.ranks_per_node)
            if needed > self.num_rdma_bytes:
                raise ValueError(f"hidden size {hidden} needs num_rdma_bytes >= {needed} with this Config "
                                 f"(Buffer has {self.num_rdma_bytes}); create the Buffer with "
                                 f"num_rdma_bytes=config.get_rdma_buffer_size_hint({hidden_bytes}, "
                                 f"{self.group_size})")

    def _split_x(self, x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError("x as a tuple must be (x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] float32)")
            x_fp8, scales = x
            _check_tensor("x[0] (FP8 payload)", x_fp8, dtypes=(torch.float8_e4m3fn,), dim=2, device=self.device)
            hidden = x_fp8.size(1)
            if hidden % FP8_BLOCK:
                raise ValueError(f"FP8 hidden size {hidden} must be a multiple of {FP8_BLOCK} (one scale per "
                                 f"{FP8_BLOCK} channels)")
            _check_tensor("x[1] (FP8 scales)", scales, dtypes=(torch.float32,), dim=2, device=self.device,
                          shape=(x_fp8.size(0), hidden // FP8_BLOCK))
            return x_fp8, scales
        _check_tensor("x", x, dtypes=PAYLOAD_DTYPES, dim=2, device=self.device)
        if x.size(1) == 0:
            raise ValueError("x has hidden size 0")
        return x, None

    # --------------------------------------------------------------------------------------------------- streams

    def _run(self, fn, inputs, previous_event, async_finish, allocate_on_comm_stream):
        """Run ``fn`` with DeepEP's stream semantics: on the comm stream after ``previous_event`` (or the current
        stream's work); the caller's stream waits unless ``async_finish``. Returns (fn's result, EventOverlap)."""
        if self._comm_stream is None:
            return fn(), EventOverlap(None)
        compute = torch.cuda.current_stream(self.device)
        comm = self._comm_stream
        # The backend runs on our comm stream, but the caller's stream waits on it: a backend with rules for the
        # caller's stream (internode without drains: never the legacy default one) checks that one too
        check = getattr(self.backend, "check_caller_stream", None)
        if check is not None:
            check(compute.cuda_stream)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            result = fn()
        tensors = [t for t in _flatten(result) + list(inputs) if isinstance(t, torch.Tensor) and t.is_cuda]
        for t in tensors:
            t.record_stream(comm)
            if not allocate_on_comm_stream:
                t.record_stream(compute)
        if async_finish:
            event = torch.cuda.Event()
            event.record(comm)
            return result, EventOverlap(event, tuple(tensors))
        compute.wait_stream(comm)
        return result, EventOverlap(None)

    # ---------------------------------------------------------------------------------------------------- layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Counts for a dispatch of ``topk_idx`` [T, K] int64 (-1 = dropped) over ``num_experts`` experts.

        Returns (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None on one node,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event).
        """
        self._check_events(previous_event, async_finish, allocate_on_comm_stream)
        self._check_topk_idx(topk_idx, num_experts)
        result, event = self._run(lambda: self.backend.get_dispatch_layout(topk_idx, num_experts), [topk_idx],
                                  previous_event, async_finish, allocate_on_comm_stream)
        return (*result, event)

    # -------------------------------------------------------------------------------------------------- dispatch

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Any] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, expert_major: bool = False
                 ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor],
                            Optional[torch.Tensor], Optional[List[int]], Any, EventOverlap]:
        """Send every token once to each rank that holds one of its experts.

        x: [T, H] bf16/fp32, or (x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] float32).
        Non-cached: num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert (from get_dispatch_layout),
        topk_idx [T, K] int64 and optional topk_weights [T, K] float32. Cached: pass ``handle`` from an earlier
        dispatch and no topk_idx/topk_weights; the routing is reused.

        Returns (recv_x (same form as x), recv_topk_idx [rows, K] local expert ids (-1 = not local / padding),
        recv_topk_weights [rows, K] (0 where not local), num_recv_tokens_per_expert_list (aligned to
        expert_alignment; [] when num_worst_tokens > 0), handle, event). With num_worst_tokens > 0 there are exactly
        that many rows. With expert_major=True, rows are (token, local expert) pairs grouped by expert and
        recv_topk_idx / recv_topk_weights are [rows] vectors. Cached mode returns (recv_x, None, None, None, None,
        event).
        """
        self._check_events(previous_event, async_finish, allocate_on_comm_stream)
        x_payload, x_scales = self._split_x(x)
        num_tokens = x_payload.size(0)
        for name, value, low in (("expert_alignment", expert_alignment, 1), ("num_worst_tokens", num_worst_tokens, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a uccl_ep_train.Config, got {type(config).__name__}")
        config = config or self.get_dispatch_config(self.group_size)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) reuses the routing: pass topk_idx=None and "
                                 "topk_weights=None")
            self._check_handle(handle, "dispatch")
            if num_tokens != handle.num_tokens:
                raise ValueError(f"x has {num_tokens} tokens but the handle was made for {handle.num_tokens}; "
                                 "cached dispatch needs the same tokens as the dispatch that made the handle")
        else:
            if topk_idx is None:
                raise ValueError("dispatch without a handle needs topk_idx [T, K] int64")
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f"dispatch without a handle needs {name} (from Buffer.get_dispatch_layout)")
            _check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32, torch.int64), dim=1,
                          device=self.device)
            num_experts = num_tokens_per_expert.size(0)
            self._check_topk_idx(topk_idx, num_experts, num_worst_tokens)
            if topk_idx.size(0) != num_tokens:
                raise ValueError(f"topk_idx has {topk_idx.size(0)} rows but x has {num_tokens} tokens")
            num_topk = topk_idx.size(1)
            if topk_weights is not None:
                _check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), dim=2, device=self.device,
                              shape=(num_tokens, num_topk))
            _check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32, torch.int64), dim=1,
                          device=self.device, shape=(self.group_size,))
            _check_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), dim=2, device=self.device,
                          shape=(num_tokens, self.group_size))
            if num_tokens_per_rdma_rank is not None:
                _check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtypes=(torch.int32, torch.int64),
                              dim=1, device=self.device, shape=(self.num_nodes,))
        self._check_hidden_fits(x_payload.size(1), x_payload.element_size(), config)

        args = DispatchArgs(x_payload, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                            num_worst_tokens, bool(expert_major), config)
        differentiable = torch.is_grad_enabled() and (
            x_payload.requires_grad or (topk_weights is not None and topk_weights.requires_grad))
        inputs = [t for t in (x_payload, x_scales, topk_idx, topk_weights, is_token_in_rank) if t is not None]

        def run():
            if not differentiable:
                return self.backend.dispatch(args)

            def forward(x_, w_):
                args.x, args.topk_weights = x_, w_
                return self.backend.dispatch(args)
            return differentiable_dispatch(self._autograd, forward, x_payload, topk_weights)

        result, event = self._run(run, inputs, previous_event, async_finish, allocate_on_comm_stream)
        recv_x = (result.recv_x, result.recv_x_scales) if x_scales is not None else result.recv_x
        if handle is not None:
            return recv_x, None, None, None, None, event
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                result.handle, event)

    def _dispatch_impl(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: Any):
        """Synchronous cached dispatch used by autograd (arguments already known to be consistent)."""
        with torch.no_grad():
            result = self.backend.dispatch(DispatchArgs(x, x_scales, handle, None, None, None, None, None, None))
        return result.recv_x, result.recv_x_scales

    # --------------------------------------------------------------------------------------------------- combine

    def _check_handle(self, handle: Any, op: str) -> None:
        for attr in ("num_tokens", "num_recv_rows", "num_topk", "expert_major", "is_token_in_rank"):
            if not hasattr(handle, attr):
                raise TypeError(f"{op}: handle must be the handle returned by Buffer.dispatch (missing {attr!r}), "
                                f"got {type(handle).__name__}")

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sum the copies of each token back on its source rank (no weighting: apply probs in the experts).

        x: [rows, H] bf16/fp32 in the layout of the handle's dispatch (rank-major or expert-major, padding rows
        ignored). topk_weights: rank-major [rows, K] / expert-major [rows] float32, summed the same way.
        bias: 0, 1 or 2 tensors [T, H] added to the result. Returns (combined_x [T, H], combined_topk_weights
        [T, K] float32 or None, event).
        """
        self._check_events(previous_event, async_finish, allocate_on_comm_stream)
        if handle is None:
            raise ValueError("combine needs the handle returned by the matching dispatch")
        self._check_handle(handle, "combine")
        _check_tensor("x", x, dtypes=PAYLOAD_DTYPES, dim=2, device=self.device)
        if x.size(0) != handle.num_recv_rows:
            raise ValueError(f"x has {x.size(0)} rows but the handle's dispatch produced {handle.num_recv_rows}; "
                             "combine takes the rows dispatch returned (same layout, padding included)")
        if topk_weights is not None:
            want = (handle.num_recv_rows,) if handle.expert_major else (handle.num_recv_rows, handle.num_topk)
            _check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), dim=len(want), device=self.device,
                          shape=want)
        biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise ValueError("bias must be a tensor or a tuple of at most 2 tensors")
        for i, b in enumerate(biases):
            _check_tensor(f"bias[{i}]", b, dtypes=(x.dtype,), dim=2, device=self.device,
                          shape=(handle.num_tokens, x.size(1)))
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a uccl_ep_train.Config, got {type(config).__name__}")
        config = config or self.get_combine_config(self.group_size)
        self._check_hidden_fits(x.size(1), x.element_size(), config)

        differentiable = torch.is_grad_enabled() and (
            x.requires_grad or (topk_weights is not None and topk_weights.requires_grad))

        def run():
            if differentiable:
                out_x, out_w = differentiable_combine(
                    self._autograd, lambda x_, w_: self.backend.combine(x_, handle, w_, config), handle, x,
                    topk_weights)
            else:
                out_x, out_w = self.backend.combine(x, handle, topk_weights, config)
            for b in biases:
                out_x = out_x + b
            return out_x, out_w

        inputs = [t for t in [x, topk_weights, *biases] if t is not None]
        (combined_x, combined_w), event = self._run(run, inputs, previous_event, async_finish,
                                                    allocate_on_comm_stream)
        return combined_x, combined_w, event

    def _combine_impl(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor]):
        with torch.no_grad():
            return self.backend.combine(x, handle, topk_weights, self.get_combine_config(self.group_size))


def _flatten(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _flatten(item)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in _flatten(getattr(obj, name))]
    return []
