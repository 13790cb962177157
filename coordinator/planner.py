"""The planner: a pure function from members + topology labels to a ring and a tree.

* **Ring**: healthy members sorted by topology — labels in :data:`TOPOLOGY_LABELS` order
  (zone, rack, switch), then host, local rank, member id — so members of one host are
  adjacent (intra-host hops), hosts of one switch/rack are adjacent, and the result is
  deterministic whatever order the members arrive in. Demoted members (confirmed
  stragglers) come last, in the same order: the ring still includes them, but a
  tree-based algorithm never waits on them for anything but their own leaf.
* **Link classes** (:mod:`.link_classes`): with link speeds known for every member
  (declared ``link_bps`` labels, or measured ones passed as ``link_speed``), members of
  one host are ordered by class (fastest first) so local index ``c`` pairs like links
  across hosts, and ``shard_weights`` sizes the hierarchical allreduce's shards in
  proportion to each local index's slowest class.
* **Unequal hosts** (:mod:`.host_slots`; e.g. 4 + 3, or 2 x 4 after a death): the plan
  carries ``host_slots`` (per host, the local index owning each of the largest host's
  ``K`` cross-host slots) and ``shard_weights`` per slot (owner speed over its slot
  count; unknown speeds count as equal), and the data plane runs the hierarchical
  allreduce over them (docs/hierarchy.md, "Unequal hosts"); equal hosts carry no ``host_slots`` (slot = local index).
* **Tree**: a binary heap over the healthy part of the ring (``parent[i] = (i-1)//2``) so
  tree neighbours are mostly ring-close; each demoted member hangs as a leaf under a
  healthy member (round-robin), never as an inner node.

O(N log N) (one sort); no I/O, no randomness, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Protocol

from resilient.coordinator.host_slots import host_slots, slot_weights
from resilient.coordinator.link_classes import class_rank, class_speeds, link_classes, member_speeds, shard_weights

#: Label names, outermost first, that group members topologically.
TOPOLOGY_LABELS: tuple[str, ...] = ("zone", "rack", "switch")


class PlanMember(Protocol):
    """What the planner reads of a member (:class:`~.membership.MemberInfo` has it)."""

    @property
    def member_id(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def labels(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class Plan:
    """``ring``: member ids in ring order; ``parent``: tree parent index into ``ring`` for
    each position (-1 for the root); ``host_groups``: ``(start, count)`` runs of one host in
    the ring; ``demoted``: demoted ids (they are the ring's tail); ``shard_weights``: one
    per cross-host shard (None: uniform); ``link_classes``: (speed, ids), fastest first;
    ``host_slots``: for unequal hosts, per host group the local index owning each slot
    (None: equal hosts, or no hierarchy)."""

    ring: tuple[str, ...]
    parent: tuple[int, ...]
    host_groups: tuple[tuple[int, int], ...]
    demoted: tuple[str, ...]
    shard_weights: tuple[float, ...] | None = None
    link_classes: tuple[tuple[float, tuple[str, ...]], ...] = ()
    host_slots: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON form stored in the epoch's ``plan`` (the ring itself is ``Epoch.members``)."""
        d: dict[str, object] = {
            "tree_parent": list(self.parent),
            "host_groups": [list(g) for g in self.host_groups],
            "demoted": list(self.demoted),
            "topology_labels": list(TOPOLOGY_LABELS),
        }
        if self.shard_weights:
            d["shard_weights"] = list(self.shard_weights)
        if self.link_classes:
            d["link_classes"] = [[s, list(ids)] for s, ids in self.link_classes]
        if self.host_slots:
            d["host_slots"] = [list(s) for s in self.host_slots]
        return d


def plan(members: Iterable[PlanMember], demoted: Collection[str] = (),
         avoid: Collection[tuple[str, str]] = (), link_speed: Mapping[str, float] | None = None) -> Plan:
    """Plan the ring and tree for ``members`` (anything with ``member_id``, ``host``,
    ``local_rank``, ``labels``). ``demoted``: ids moved to the ring's tail and the tree's
    leaves; ids not among ``members`` are ignored. ``avoid``: unordered pairs (slow links,
    :mod:`.straggler`) that should not be ring neighbours; the topology order is repaired
    by the fewest deterministic swaps inside the healthy / demoted part, and a pair that
    cannot be separated (e.g. 3 members) stays — best effort, never an error.
    ``link_speed``: measured cross-host bytes/s per member (over declared ``link_bps``
    labels; see the module docstring). Raises
    :class:`ValueError` on duplicate member ids (a caller bug: the keyspace cannot hold two)."""
    members = list(members)
    d = frozenset(demoted)
    speeds = member_speeds(members, link_speed)
    classes = link_classes(speeds) if speeds and all(m.member_id in speeds for m in members) else []
    rank = class_rank(classes)
    z, r, w = TOPOLOGY_LABELS
    # One string per member for (demoted, zone, rack, switch, host): sorting on a leading
    # string is several times faster in CPython than on a long tuple, and a whole host
    # shares the string, so it also delimits the host groups.
    keyed = [
        (f'{"1" if m.member_id in d else "0"}{(lab := m.labels).get(z, "")}\0{lab.get(r, "")}\0'
         f'{lab.get(w, "")}\0{m.host}', (rank.get(m.member_id, 0), m.local_rank), m.member_id)
        for m in members
    ]
    keyed.sort()
    ring = tuple([k[2] for k in keyed])
    n = len(ring)
    if len(set(ring)) != n:
        raise ValueError("duplicate member ids given to the planner")
    healthy = n
    for i in range(n - 1, -1, -1):  # demoted members form the tail
        if keyed[i][0][0] == "0":
            break
        healthy = i
    if avoid and n >= 4:
        keyed = _separate(keyed, healthy, {frozenset(p) for p in avoid if len(set(p)) == 2})
        ring = tuple([k[2] for k in keyed])
    if healthy:
        parent = [-1] + [(i - 1) >> 1 for i in range(1, healthy)] + [j % healthy for j in range(n - healthy)]
    else:  # everyone demoted: plain heap over all
        parent = [-1] + [(i - 1) >> 1 for i in range(1, n)] if n else []
    starts = [0] + [i for i in range(1, n) if keyed[i][0] != keyed[i - 1][0]] if n else []
    ends = starts[1:] + [n]
    groups = tuple(zip(starts, [e - b for b, e in zip(starts, ends)]))
    hosts = [ring[b:b + c] for b, c in groups]
    slots = None if d & set(ring) else host_slots(hosts)
    if slots is not None:   # unequal hosts: unknown speeds count as equal
        weights = slot_weights(hosts, slots, class_speeds(classes) if classes else dict.fromkeys(ring, 1.0))
    else:
        weights = shard_weights(hosts, classes) if classes and not d & set(ring) else None
    return Plan(ring=ring, parent=tuple(parent), host_groups=groups, demoted=ring[healthy:],
                shard_weights=tuple(weights) if weights else None,
                link_classes=tuple((s, tuple(ids)) for s, ids in classes),
                host_slots=tuple(tuple(s) for s in slots) if slots else None)



#: a member's sort key in :func:`plan`: (demoted+zone+rack+switch+host, (class rank, local rank), id)
_Keyed = tuple[str, tuple[int, int], str]


def _separate(keyed: list[_Keyed], healthy: int, avoid: set[frozenset[str]]) -> list[_Keyed]:
    """Swap members so that no pair in ``avoid`` is adjacent in the ring (cyclically),
    keeping swaps inside [0, healthy) or [healthy, n) (:func:`.ring.separate`: greedy,
    deterministic, the fewest swaps it finds)."""
    from resilient.coordinator.ring import separate   # ring.py builds on this module

    wanted = set().union(*avoid) if avoid else set()
    pos = {k[2]: i for i, k in enumerate(keyed) if k[2] in wanted}
    moves = separate(len(keyed), healthy, avoid, lambda i: keyed[i][2], pos.__getitem__)
    out = list(keyed)
    for final, base in moves.items():
        out[final] = keyed[base]
    return out
