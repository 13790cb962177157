"""Cross-host slots for hosts of unequal sizes (issue 16): pure functions, no I/O.

The hierarchical allreduce splits the buffer into ``K`` shards, one per *slot*; shard
``c`` crosses hosts on the ring of the slot-``c`` owners, one per host. With equal hosts
of ``k`` members, ``K = k`` and slot ``c`` is local index ``c`` on every host (the plan
then carries no ``host_slots``). With unequal hosts (e.g. 4 + 3, or 2 x 4 after a death)
:func:`host_slots` makes ``K`` the largest host's size and deals the slots of a smaller
host round-robin over its members (slot ``c`` -> local index ``c mod k_h``): the first
local indices — the fastest link class, as the planner orders a host — take the extra
slots. Every host still sends ``2(H-1)/H`` of the buffer across hosts; a member owning
``j`` slots carries ``j`` shards, so :func:`slot_weights` sizes shard ``c`` by the slowest
owner's speed divided by its slot count, which balances the bytes per link.

:func:`slots_problem` is the one check of a published ``host_slots`` against the plan's
``host_groups`` (the epoch parse raises on it, the typed plan reads a bad one as absent).

Failure behaviour: none; degenerate input (fewer than 2 hosts, no host of 2 or more
members, unknown speeds) gives None, i.e. the plain layout or uniform shards;
:func:`slots_problem` returns what is wrong as text, it never raises.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def host_slots(groups: Sequence[Sequence[str]]) -> list[list[int]] | None:
    """For each host in ``groups`` (member ids by local index), the local index owning
    each of the ``K = max host size`` slots; None when the hosts are equal (slot = local
    index), fewer than 2, or all of a single member (no hierarchy to run)."""
    sizes = [len(g) for g in groups]
    if len(sizes) < 2 or min(sizes) < 1 or max(sizes) < 2 or len(set(sizes)) == 1:
        return None
    k = max(sizes)
    return [[c % n for c in range(k)] for n in sizes]


def slot_weights(groups: Sequence[Sequence[str]], slots: Sequence[Sequence[int]],
                 speed: Mapping[str, float]) -> list[float] | None:
    """One weight per slot, normalised to sum 1 (rounded to 6 places): the smallest, over
    hosts, of the slot owner's ``speed`` divided by the number of slots it owns; None
    when a member has no speed or every weight is equal (uniform shards)."""
    if not slots or len(slots) != len(groups):
        return None
    per: list[float] = []
    for c in range(len(slots[0])):
        rates = []
        for g, own in zip(groups, slots):
            m = g[own[c]]
            if m not in speed:
                return None
            rates.append(speed[m] / own.count(own[c]))
        per.append(min(rates))
    if len(set(per)) <= 1:
        return None
    total = sum(per)
    return [round(x / total, 6) for x in per]


def slots_problem(slots: object, counts: Sequence[int]) -> str | None:
    """What is wrong with ``slots`` as the ``host_slots`` of hosts of ``counts`` members
    (the plan's ``host_groups`` run lengths), or None when it is usable: one list per
    host, all of the same length ``K`` (at most ``sum(counts)``), integer entries in
    ``[0, count)``, every local index of a host owning at least one slot."""
    if not isinstance(slots, (list, tuple)) or len(slots) != len(counts):
        return f"host_slots must be one list per host_groups run ({len(counts)} runs)"
    lengths = {len(s) for s in slots if isinstance(s, (list, tuple))}
    if len(lengths) != 1 or len(slots) == 0:
        return "host_slots must hold lists, all of the same length K"
    K = lengths.pop()
    if not 1 <= K <= sum(counts):
        return f"host_slots has K = {K} slots per host, not in [1, {sum(counts)}]"
    for h, (own, count) in enumerate(zip(slots, counts)):
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < count for v in own):
            return f"host_slots[{h}] = {list(own)!r} holds an entry outside [0, {count}) (host {h} has {count} members)"
        if len(set(own)) != count:
            return f"host_slots[{h}] = {list(own)!r} leaves a local index of host {h} without a slot"
    return None
