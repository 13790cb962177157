"""The planner: a pure function from members + topology labels to a ring and a tree.

* **Ring**: healthy members sorted by topology — labels in :data:`TOPOLOGY_LABELS` order
  (zone, rack, switch), then host, local rank, member id — so members of one host are
  adjacent (intra-host hops), hosts of one switch/rack are adjacent, and the result is
  deterministic whatever order the members arrive in. Demoted members (confirmed
  stragglers) come last, in the same order: the ring still includes them, but a
  tree-based algorithm never waits on them for anything but their own leaf.
* **Tree**: a binary heap over the healthy part of the ring (``parent[i] = (i-1)//2``) so
  tree neighbours are mostly ring-close; each demoted member hangs as a leaf under a
  healthy member (round-robin), never as an inner node.

O(N log N) (one sort); no I/O, no randomness, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Protocol

#: Label names, outermost first, that group members topologically.
TOPOLOGY_LABELS: tuple[str, ...] = ("zone", "rack", "switch")


class PlanMember(Protocol):
    member_id: str
    host: str
    local_rank: int
    labels: Mapping[str, str]


@dataclass(frozen=True)
class Plan:
    """``ring``: member ids in ring order; ``parent``: tree parent index into ``ring`` for
    each position (-1 for the root); ``host_groups``: ``(start, count)`` runs of one host in
    the ring; ``demoted``: demoted ids (they are the ring's tail)."""

    ring: tuple[str, ...]
    parent: tuple[int, ...]
    host_groups: tuple[tuple[int, int], ...]
    demoted: tuple[str, ...]

    def to_dict(self) -> dict:
        """JSON form stored in the epoch's ``plan`` (the ring itself is ``Epoch.members``)."""
        return {
            "tree_parent": list(self.parent),
            "host_groups": [list(g) for g in self.host_groups],
            "demoted": list(self.demoted),
            "topology_labels": list(TOPOLOGY_LABELS),
        }


def _sort_key(m: PlanMember) -> tuple:
    labels = m.labels
    return (
        labels.get("zone", ""), labels.get("rack", ""), labels.get("switch", ""),
        m.host, m.local_rank, m.member_id,
    )


def plan(members: Iterable[PlanMember], demoted: Collection[str] = ()) -> Plan:
    """Plan the ring and tree for ``members`` (anything with ``member_id``, ``host``,
    ``local_rank``, ``labels``). ``demoted``: ids moved to the ring's tail and the tree's
    leaves; ids not among ``members`` are ignored. Raises :class:`ValueError` on duplicate
    member ids (a caller bug: the keyspace cannot hold two)."""
    demoted_set = frozenset(demoted)
    keyed = [(_sort_key(m), m.member_id in demoted_set, m.host) for m in members]
    keyed.sort(key=lambda t: (t[1], t[0]))
    ring = tuple(k[0][-1] for k in keyed)
    if len(set(ring)) != len(ring):
        raise ValueError("duplicate member ids given to the planner")
    n = len(ring)
    healthy = sum(1 for k in keyed if not k[1])
    if healthy:
        parent = [-1] + [(i - 1) // 2 for i in range(1, healthy)] + [j % healthy for j in range(n - healthy)]
    else:  # everyone demoted: plain heap over all
        parent = [-1] + [(i - 1) // 2 for i in range(1, n)] if n else []
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or keyed[i][2] != keyed[start][2] or keyed[i][1] != keyed[start][1]:
            groups.append((start, i - start))
            start = i
    return Plan(ring=ring, parent=tuple(parent), host_groups=tuple(groups),
                demoted=tuple(k[0][-1] for k in keyed if k[1]))
