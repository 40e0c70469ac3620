"""Planning ahead: a call plans its handle's next calls (shapes, hop plans, their uploads) while its own hop moves
(docs/internode.md, "Planning ahead")."""
from __future__ import annotations

from typing import Any, Tuple


from uccl_ep_train.internode.plan import InternodeError, Counts, SendPlan, _align
from uccl_ep_train.internode.columns import _record_layout
from uccl_ep_train.internode.handle import InternodeHandle, PlannedAhead


class PlanningAhead:
    """Plans a handle's next calls during the current call's hop. A part of NativeInternodeBackend (backend.py), which
    composes these parts; the state they share is set up there (its __init__ and the setup steps it calls)."""

    @staticmethod
    def _guesses(payload_bytes: Tuple[int, ...], hidden: int, num_topk: int) -> Tuple[list, list]:
        """What an uncached dispatch's handle is likely used for next, as (kind, record bytes) guesses: (the next
        call's, the backward pass's). Next, a combine of bf16 rows without weights (the forward's); in the backward,
        a cached dispatch of the same payload columns (x and its scales) and of one bf16 column of the same hidden
        size (the gradient), and a combine of bf16 rows with the top-k weights."""
        later = [("dispatch", cols) for cols in dict.fromkeys((payload_bytes, (2 * hidden,)))]
        later += [("combine", _align(2 * hidden + 4 * num_topk))] if num_topk else []
        return [("combine", _align(2 * hidden))], later

    def _plan_ahead(self, counts: Counts, plan: SendPlan, guesses: list, ahead: PlannedAhead, step: str,
                    have: Any = (), upload: bool = True) -> None:
        """Make the shapes and hop plans of the ``guesses`` (see _guesses; none whose hop key is in ``have``) and
        upload their tables, between a hop's push and the launch of what waits for it: the wire is busy then, while
        each of those calls made them at its first use with the GPU idle behind it (~100-200 us of a forward
        combine's host steps on 2x H200). An uncached dispatch plans its handle's next call; the handle's first
        combine the backward's. Before the reader or wait spins, as the call's other uploads there: nothing may be
        launched after it ("Drains"). A guess whose areas do not fit is skipped: the call that needs it raises.
        ``upload`` False: for while a gated reader spins, when nothing may be queued behind it ("Drains"): the
        tables are staged (written into the pinned area, allocated from torch's cache) and their copies are queued
        at the next call's entry (_commit_staged_plans)."""
        G = self.G
        for kind, size in guesses:
            try:
                if kind == "dispatch":
                    layout = _record_layout(size, G)
                    key = ("dispatch", layout.stride)
                    if key in have:
                        continue
                    ahead.dispatch_shapes[layout] = self._dispatch_shape(counts, plan, layout, upload)
                    if key not in ahead.hop_plans:  # another guess's layout may share the record size
                        ahead.hop_plans[key] = self._dispatch_hop(counts, plan, layout.stride)
                else:
                    key = ("combine", size)
                    if key in have:
                        continue
                    shape = ahead.combine_shapes[size] = self._combine_shape(counts, size)
                    ahead.hop_plans[key] = self._combine_hop(counts, size, shape.areas)
            except InternodeError:
                continue
        # while a reader spins: written and allocated now, the copies queued at the next call's entry
        self._upload_plans_ahead(ahead, stage=not upload and self._staging is not None)
        self._lap(step)

    def _commit_staged_plans(self) -> None:
        """Queue the copies of the plan tables an earlier call staged (handed over by _adopt_plans), before any launch
        of this call: a handle's next call may read them."""
        if self._staged_plans:
            stream = self._stream()
            for st in self._staged_plans:
                self._staging.commit(st, stream)
            self._staged_plans = []

    def _upload_plans_ahead(self, ahead: PlannedAhead, stage: bool = False) -> None:
        """The device tables of plans made ahead that are still on the host -- the hop plans' in one upload, the
        forward row bases of the dispatch shapes (several GPUs per node); ``stage``: only staged (UploadStaging.stage,
        into ``ahead.staged``, whose copies the next call's entry queues: _commit_staged_plans), nothing queued."""
        staged = ahead.staged if stage else None
        self._upload_hop_plans([p for p in ahead.hop_plans.values() if p.rows and p.table is None], staged)
        for shape in ahead.dispatch_shapes.values():
            if shape.forward_bases is not None and shape.forward_bases.device != self.device:
                shape.forward_bases = self._forward_bases_on_device(shape.forward_bases, staged)

    def _adopt_plans(self, h: InternodeHandle, ahead: PlannedAhead) -> None:
        """The plans made ahead onto the handle, with their device tables. Tables staged while a reader spun are
        copied at the next call's entry (_commit_staged_plans), the first point where a kernel may read them: after
        the drain the GPU is idle behind every host step, while at the next call's entry it still runs the caller's
        work in between (the experts, in training); one driver call each, 20-70 us of a forward dispatch's return
        on 2x H200 in session 26."""
        self._staged_plans += ahead.staged
        ahead.staged = []
        self._upload_plans_ahead(ahead)
        h.dispatch_shapes.update(ahead.dispatch_shapes)
        h.combine_shapes.update(ahead.combine_shapes)
        h.hop_plans.update(ahead.hop_plans)
        self.plans_made_ahead += len(ahead.hop_plans)
