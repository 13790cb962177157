"""The survivors of a broken replica group step aside instead of failing the job.

When a member of an HSDP replica group (a mesh row, :mod:`resilient.fsdp.layout`) dies, the
row's other members cannot finish their step: their reduce-scatter lost a contribution and
their next all-gather a shard. The replicate groups already leave them out (every column
shows only whole rows), so the other replica groups finish the step without them. Here
such a member, at the end of its first op of an FSDP group that completes, fails or
starts after its row broke, *steps aside*: it says on stderr which row it belongs to, the
member that broke it and the step it stopped in, and exits with code 0; its lease goes with
the process, so the job's epochs shrink to the healthy replica groups and the job's status
stays a success. A partial reduce-scatter result (the row's survivors finished it without
the dead member) is never all-reduced: the check runs when the reduce-scatter completes,
before FSDP issues the replicate all-reduce.

It exits with ``os._exit(0)``: the op may complete on one of torch's threads, where
``SystemExit`` becomes a ``RuntimeError``, and nothing this process holds is needed by
anyone (the healthy replica groups hold every shard).

Failure behaviour: :meth:`Pauser.maybe_pause` returns (the caller goes on, re-raising the
op's own error if it had one) when no HSDP layout is registered or this member's row is
whole; it never raises itself.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

from resilient.fsdp.layout import ReplicaLayout

log = logging.getLogger(__name__)

__all__ = ["Pauser", "PAUSER"]


class Pauser:
    """The process's HSDP layout and its step-aside (one per process: :data:`PAUSER`)."""

    def __init__(self) -> None:
        self.layout: ReplicaLayout | None = None
        self.member_id: str | None = None
        #: ``current() -> the newest epoch's members`` (None: no epoch yet)
        self._current: Callable[[], tuple[str, ...] | None] | None = None
        self._lock = threading.Lock()
        #: optimizer steps completed (for the message)
        self.step: int = 0
        #: ``exit(code)``: how the process ends (tests replace it)
        self.exit: Callable[[int], None] = os._exit

    def register(self, layout: ReplicaLayout, member_id: str,
                 current: Callable[[], tuple[str, ...] | None]) -> None:
        with self._lock:
            self.layout, self.member_id, self._current = layout, member_id, current

    def row_broken(self) -> bool:
        """True when this member's replica group lacks a member in the newest epoch."""
        layout, me, current = self.layout, self.member_id, self._current
        if layout is None or me is None or current is None:
            return False
        row = layout.row_of(me)
        members = current()
        return row is not None and members is not None and row in layout.broken(members)

    def maybe_pause(self, cause: BaseException | None = None) -> None:
        """Step aside (the process ends) when this member's replica group is broken; else return."""
        if self.row_broken():
            self._pause(cause)

    def _pause(self, cause: BaseException | None) -> None:
        layout, me, current = self.layout, self.member_id, self._current
        assert layout is not None and me is not None and current is not None
        row = layout.row_of(me)
        assert row is not None
        members = current() or ()
        lost = [m for m in layout.rows[row] if m not in members]
        why = f" (its op: {type(cause).__name__}: {cause})" if cause is not None else ""
        from resilient.script_exit import deliberate

        try:
            deliberate(f"stepped aside: replica group {row} lost {', '.join(lost)}")
            sys.stdout.flush()
            print(f"[resilient] {me} steps aside: its replica group {row} lost {', '.join(lost)} in step "
                  f"{self.step}; the job goes on with the other replica groups (docs/fsdp.md); this worker "
                  f"exits with code 0{why}", file=sys.stderr, flush=True)
        finally:
            self.exit(0)


PAUSER = Pauser()
