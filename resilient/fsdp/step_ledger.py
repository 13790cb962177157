"""Each optimizer step of HSDP averages every shard over one set of whole replica groups.

FSDP2's HSDP reduces a gradient in two stages: a reduce-scatter inside the replica group
(the mesh row) and an all-reduce down the replicate dimension (the mesh column), one pair
per FSDP parameter group. When a replica group breaks mid-step, the columns' all-reduces of
that step can end with different contributor sets (a column whose all-reduce ran before the
loss has the broken row's data, one after it has not), and FSDP's divide factors were
computed for the replica groups alive when the step began. Both would leave the shards
averaged over different sets. The ledger keeps, for every replicate all-reduce of the step,
its input (a copy of the reduce-scatter output: 1/S of the model's gradients), its output
tensor (FSDP's sharded gradients are views of it) and its contributors; at the step
boundary (a global optimizer step pre-hook) it settles the step:

1. each healthy row agrees, by one small ``MIN`` all-reduce over its shard group, on ``M``:
   the replica groups present in *every* replicate all-reduce of the step. The contributors
   of a column's all-reduce are the same on all its members, so every healthy row computes
   the same ``M``;
2. when ``M`` differs from ``M_prev`` (the set the step's factors were computed for: the
   previous settle's ``M``), every all-reduce of the step is redone from its saved input:
   scaled by ``old_pre / new_pre`` (both powers of two: exact), summed over the column
   (whose epoch by now shows only whole rows), divided by the factor for ``|M|`` and copied
   into FSDP's gradient buffer — bitwise what a step over ``M`` from the start would give;
3. ``M`` becomes ``M_prev``: the next step's factors (patched to read ``|M_prev|`` for the
   replicate size, see :mod:`resilient.fsdp.patches`) are right from the start.

The fault-free cost is the copy of each all-reduce input and one all-reduce of ``R`` int64
per step on the shard group.

Failure behaviour: a redo whose contributors differ from ``M`` (another replica group broke
during the settle) repeats with the new set, up to :data:`MAX_ROUNDS` times, then raises
:class:`~resilient.errors.CollectiveError` naming the sets; a gradient that is not a view of
the all-reduce output (mixed precision with a reduce dtype other than the parameter's, or
gradients accumulated over backward passes without an optimizer step) cannot be redone:
the settle logs an error naming the parameter group and leaves that gradient as it is.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from resilient.errors import CollectiveError
from resilient.fsdp.layout import ReplicaLayout

log = logging.getLogger(__name__)

__all__ = ["ReduceCall", "AllReduceRecord", "StepLedger", "LEDGER", "MAX_ROUNDS"]

MAX_ROUNDS = 3


@dataclasses.dataclass
class ReduceCall:
    """One ``foreach_reduce`` of FSDP in progress: its groups and the factors it got."""

    rs_group: Any
    ar_group: Any
    #: ``(pre, post, rs_op, ar_op)`` as ``_get_gradient_divide_factors`` returned them
    factors: tuple[Any, Any, Any, Any] | None = None
    #: ``factors_for(replicate_size) -> factors``: the same call with another replicate size
    factors_for: Callable[[int], tuple[Any, Any, Any, Any]] | None = None
    #: the sharded gradients FSDP will view out of the all-reduce output
    grads_of: Callable[[], list[torch.Tensor | None]] | None = None


@dataclasses.dataclass
class AllReduceRecord:
    call: ReduceCall
    saved: torch.Tensor
    output: torch.Tensor
    work: Any


class StepLedger:
    """The process's replicate all-reduces since the last step boundary (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.layout: ReplicaLayout | None = None
        self.rs_group: Any = None
        #: the replica groups the current step's factors assume
        self.m_prev: frozenset[int] = frozenset()
        self._records: list[AllReduceRecord] = []
        self._local = threading.local()
        #: steps whose replicate all-reduces were redone (``bench/fsdp.py`` reports it)
        self.steps_redone = 0
        self.steps = 0

    def register(self, layout: ReplicaLayout, rs_group: Any) -> None:
        with self._lock:
            if self.layout is None:
                self.layout, self.rs_group = layout, rs_group
                self.m_prev = frozenset(range(len(layout.rows)))

    @property
    def replicate_size(self) -> int:
        return len(self.m_prev)

    # -- capture (FSDP's reduce, on the thread that runs it) ---------------------------

    def begin(self, call: ReduceCall) -> None:
        self._local.call = call

    def end(self) -> None:
        self._local.call = None

    def current(self) -> ReduceCall | None:
        return getattr(self._local, "call", None)

    def before_allreduce(self, pg: Any, tensor: torch.Tensor) -> Callable[[Any], None] | None:
        """Called by the replicate group before an all-reduce starts: returns what to call
        with its Work (None: not FSDP's replicate all-reduce)."""
        call = self.current()
        if call is None or call.ar_group is not pg:
            return None
        saved = tensor.detach().clone()

        def issued(work: Any) -> None:
            with self._lock:
                self._records.append(AllReduceRecord(call, saved, tensor, work))
        return issued

    # -- the step boundary -------------------------------------------------------------

    def _rows_of(self, members: Sequence[str]) -> frozenset[int]:
        assert self.layout is not None
        return frozenset(r for r in (self.layout.row_of(m) for m in members) if r is not None)

    def settle(self) -> None:
        """Settle the step (module docstring); a no-op when no replicate all-reduce ran."""
        with self._lock:
            records, self._records = self._records, []
        self.steps += 1
        if not records or self.layout is None:
            return
        for rec in records:
            rec.work.wait()
        n_rows = len(self.layout.rows)
        agreed = self._agree(records, n_rows)
        for _ in range(MAX_ROUNDS):
            if agreed == self.m_prev:
                return
            got = self._redo(records, agreed)
            if got == agreed:
                self.m_prev = agreed
                self.steps_redone += 1
                log.warning("step %d: the replicate all-reduces were redone over replica groups %s",
                            self.steps, sorted(agreed))
                return
            agreed = got & agreed
        raise CollectiveError(f"HSDP step {self.steps}: the replica groups kept changing while the step was "
                              f"settled (last redo over {sorted(agreed)}); more than {MAX_ROUNDS} failures in one step")

    def _agree(self, records: list[AllReduceRecord], n_rows: int) -> frozenset[int]:
        present = frozenset(range(n_rows))
        for rec in records:
            present &= self._rows_of(rec.work.contributors)
        mask = torch.tensor([1 if r in present else 0 for r in range(n_rows)], dtype=torch.int64)
        dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=self.rs_group)
        return frozenset(r for r in range(n_rows) if int(mask[r]) == 1)

    def _redo(self, records: list[AllReduceRecord], rows: frozenset[int]) -> frozenset[int]:
        """Redo every record over ``rows``; returns the rows present in every redo."""
        got = frozenset(rows)
        for rec in records:
            call = rec.call
            assert call.factors is not None and call.factors_for is not None
            old_pre, _old_post, _rs_op, ar_op = call.factors
            new_pre, new_post, _nrs, new_ar_op = call.factors_for(len(rows))
            if not _is_view_of(call, rec.output):
                log.error("HSDP step %d: a gradient of an FSDP parameter group is not a view of its all-reduce "
                          "output (mixed precision or accumulated gradients); it keeps its contributor set",
                          self.steps)
                continue
            x = rec.saved
            if (old_pre or 1) != (new_pre or 1):
                x = x * (float(old_pre or 1) / float(new_pre or 1))
            else:
                x = x.clone()
            if new_ar_op != ar_op and _is_avg(new_ar_op) != _is_avg(ar_op):
                raise CollectiveError("HSDP: the replicate reduce op changed between sizes; cannot redo")
            work = dist.all_reduce(x, op=new_ar_op, group=call.ar_group, async_op=True)
            assert work is not None
            work.wait()
            got &= self._rows_of(getattr(work, "contributors", ()))
            if new_post is not None and new_post != 1:
                x.div_(new_post)
            rec.output.copy_(x)
        return got


def _is_avg(op: Any) -> bool:
    return bool(op == dist.ReduceOp.AVG)


def _is_view_of(call: ReduceCall, output: torch.Tensor) -> bool:
    """Whether FSDP's sharded gradients of ``call`` live in ``output``'s storage."""
    if call.grads_of is None:
        return False
    ptr = output.untyped_storage().data_ptr()
    grads = call.grads_of()
    return bool(grads) and all(g is not None and g.untyped_storage().data_ptr() == ptr for g in grads)


LEDGER = StepLedger()
