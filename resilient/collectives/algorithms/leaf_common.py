"""What the leaf path's two modes share (:mod:`.leaf` lossless, :mod:`.leaf_deadline`):
the route of one op (:class:`LeafRoute`), the stream's units (:func:`items_of`) and the
ledger the inner algorithm runs on (:class:`ActiveLedger`).

Pure data and ledger bookkeeping: nothing here blocks or does I/O; a mask update is
mirrored into the op's ledger before the ``pump`` hook runs, so the op's masks are exact
whenever a hook (or an abort) looks at them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from resilient.collectives.algorithms.base import Algorithm
from resilient.collectives.ledger import Ledger


@dataclass
class LeafRoute:
    """Who is a leaf of whom in one op: ``leaves`` maps each leaf to its parent,
    ``actives`` the members that run ``inner`` (built for ``len(actives)`` members);
    ``deadline_s`` not None turns on the deadline mode."""

    inner: Algorithm
    leaves: dict[str, str]
    actives: list[str]
    deadline_s: float | None = None
    SUB_BYTES: ClassVar[int] = 32 << 10


def items_of(pieces: Sequence[tuple[int, int]], elem_bytes: int, sub_bytes: int) -> list[tuple[int, int, int]]:
    """The leaf stream's units: every ledger piece cut into sub-slices of about
    ``sub_bytes`` (fine grain keeps the pipeline tail short), as ``(piece, start, end)``."""
    out = []
    per = max(1, sub_bytes // max(1, elem_bytes))
    for q, (s, e) in enumerate(pieces):
        k = max(1, -(-(e - s) // per))
        base, extra = divmod(e - s, k)
        a = s
        for i in range(k):
            b = a + base + (1 if i < extra else 0)
            out.append((q, a, b))
            a = b
    return out


class ActiveLedger(Ledger):
    """The ledger as the inner algorithm sees it: members = the active members; every
    ``set`` is mirrored into the op's ledger (active ``k`` -> its bit in the op's member
    order) and then runs ``pump`` (forwarding leaf data that arrived meanwhile)."""

    outer: Ledger
    bits: list[int]
    pump: Callable[[], None]
    final: Callable[[int], None] | None = None   # deadline mode: piece p holds the actives' result

    def set(self, p: int, mask: int) -> None:
        super().set(p, mask)
        outer = 0
        for k, b in enumerate(self.bits):
            if mask >> k & 1:
                outer |= b
        self.outer.set(p, outer)
        if self.final is not None and mask == self.full:
            self.final(p)
        self.pump()
