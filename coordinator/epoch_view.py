"""The current epoch as a health policy reads it, by lookup: ring neighbours and
positions, the demoted members and their tree parents, the plan extras.

A straggler policy runs on every reconcile pass; handing it a full :class:`~.epoch.Epoch`
at 100,000 members means running the planner once per epoch (O(N log N)) and walking
every member per pass. :class:`EpochView` is what it needs instead, in two forms:

* :class:`StateView` over the coordinator's :class:`~.delta.EpochState` (delta epochs):
  the ring is the state's :class:`~.ring.IncrementalRing`, kept by bisection as deltas
  apply, so each lookup is O(log N) and building the view is O(1). The planner's tree
  hangs the ``j``-th demoted member under the ``j mod healthy``-th ring member, which
  :meth:`StateView.leaf_parent` computes from the ring position. Avoided links
  (``extras["avoid"]``) reorder the ring by the planner's greedy swaps, which
  :func:`.ring.separate` computes on the incremental ring as a few sparse moves.
* :class:`EpochIndex` over a full :class:`~.epoch.Epoch` (small jobs, tests): one O(N)
  index, then the same lookups.

Property-tested against the planner (``tests/test_scale_straggler.py``). Pure: no I/O.
Failure behaviour: lookups of an id not in the ring return ``None`` (``position``
raises :class:`KeyError`); nothing else raises.
"""
from __future__ import annotations

from collections.abc import KeysView, Mapping, Set
from typing import Protocol

from resilient.coordinator.delta import EpochState
from resilient.coordinator.epoch import Epoch
from resilient.coordinator.ring import IncrementalRing
from resilient.coordinator.straggler import ListRing, RingNeighbours


class EpochView(RingNeighbours, Protocol):
    """The current epoch for a health policy (see the module docstring)."""

    @property
    def number(self) -> int:
        """The epoch's number."""
        ...

    @property
    def extras(self) -> Mapping[str, object]:
        """The plan extras (``avoid``, ``evicted``, ``leaf_deadline_ms``)."""
        ...

    def demoted(self) -> Set[str]:
        """The members with role ``demoted`` (the ring's tail)."""
        ...

    def leaf_parent(self, member: str) -> str | None:
        """The tree parent of a demoted member (None: not demoted, or not in the ring)."""
        ...


class EpochIndex(ListRing):
    """:class:`EpochView` of a full :class:`~.epoch.Epoch` (indexed once: O(N))."""

    def __init__(self, epoch: Epoch) -> None:
        super().__init__(epoch.members)
        self._epoch = epoch
        self._demoted = frozenset(m for m, r in epoch.roles.items() if r == "demoted" and m in self)
        tree = epoch.plan.get("tree_parent") or []
        self._tree: list[int] = [int(p) for p in tree] if isinstance(tree, list) else []

    @property
    def number(self) -> int:
        return self._epoch.number

    @property
    def extras(self) -> Mapping[str, object]:
        return self._epoch.plan

    def demoted(self) -> Set[str]:
        return self._demoted

    def leaf_parent(self, member: str) -> str | None:
        if member not in self._demoted:
            return None
        i = self.position(member)
        p = self._tree[i] if i < len(self._tree) else -1
        return self.at(p) if 0 <= p < len(self) else None


class StateView:
    """:class:`EpochView` of the coordinator's delta :class:`~.delta.EpochState`: its
    incremental ring with the planner's link separation applied as sparse moves
    (:meth:`~.delta.EpochState.avoid_moves`), O(log N) per lookup (see the module
    docstring)."""

    def __init__(self, state: EpochState, number: int) -> None:
        self._state = state
        self._number = number
        self._ring: IncrementalRing = state.ring_index()
        self._src = state.avoid_moves()                     # final position -> sorted position
        self._dst = {b: f for f, b in self._src.items()}    # sorted position -> final position

    @property
    def number(self) -> int:
        return self._number

    @property
    def extras(self) -> Mapping[str, object]:
        return self._state.extras

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, member: object) -> bool:
        return member in self._ring

    def member_ids(self) -> KeysView[str]:
        """The ring's ids as a set (for set arithmetic in C)."""
        return self._ring.member_ids()

    def _at(self, i: int) -> str:
        return self._ring.at(self._src.get(i, i))

    def position(self, member: str) -> int:
        p = self._ring.position(member)
        return self._dst.get(p, p)

    def successor(self, member: str) -> str | None:
        if member not in self._ring:
            return None
        return self._at((self.position(member) + 1) % len(self._ring))

    def predecessor(self, member: str) -> str | None:
        if member not in self._ring:
            return None
        return self._at((self.position(member) - 1) % len(self._ring))

    def demoted(self) -> Set[str]:
        return self._state.demoted()

    def leaf_parent(self, member: str) -> str | None:
        if self._state.roles.get(member) != "demoted" or member not in self._ring:
            return None
        n = len(self._ring)
        healthy = n - self._ring.demoted_count
        i = self.position(member)
        if healthy == 0:   # everyone demoted: the planner's plain heap over all
            return None if i == 0 else self._at((i - 1) >> 1)
        return self._at((i - healthy) % healthy)


def view_of(epoch: Epoch | EpochView) -> EpochView:
    """``epoch`` as an :class:`EpochView` (a full :class:`~.epoch.Epoch` is indexed)."""
    return EpochIndex(epoch) if isinstance(epoch, Epoch) else epoch

