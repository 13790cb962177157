"""The planner's ring kept incrementally, and the plan hash every member checks.

:func:`.planner.plan` sorts every member on each call: O(N log N), ~0.1 s at 100,000
ranks. :class:`IncrementalRing` keeps the same sorted order (the same sort key, built by
:func:`sort_key`) and updates it by bisection, so an epoch that removes one node costs
O(changed · log N) comparisons plus one list copy. Without ``avoid`` pairs the ring it
gives is exactly ``plan(...).ring`` (property-tested in ``tests/test_scale_delta.py``);
with ``avoid`` pairs (slow links) the caller falls back to :func:`.planner.plan`.

:func:`plan_hash` is the digest published in every delta epoch: the ring order, the
number of demoted members (the ring's tail) and the avoided links. The tree and the host
groups are pure functions of the ring and the member infos, so a member whose derived
ring hashes the same holds the same plan. The ring order enters as the SHA-256 of each
id's 8-byte digest (:func:`id_digest`) in ring order, not of the ids' text: the ring keeps
those digests in a flat array beside its ids, so hashing 100,000 members is one pass of
SHA-256 over 800 KB in C (~0.5 ms) instead of joining 100,000 string objects scattered
over the heap (8-9 ms in the coordinator's process, most of a small epoch's CPU:
docs/scale.md). Two rings hash alike only if every position's ids share a 64-bit
digest: a consistency check between members, not an authentication (the epoch record's
writer is authenticated by etcd).

Pure: no I/O, no clock.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import sys
from array import array
from collections.abc import KeysView
from typing import Callable, Collection, Iterable, Sequence

from resilient.coordinator.planner import TOPOLOGY_LABELS, PlanMember

#: from this many members changed in one update the ring list is rebuilt once (see
#: :meth:`IncrementalRing.update`)
BATCH = 16

#: what the ring orders: the planner's member shape (read-only, so MemberInfo matches)
RingMember = PlanMember


def sort_key(m: RingMember, demoted: bool) -> tuple[str, int, str]:
    """The planner's sort key for one member (see :func:`.planner.plan`)."""
    z, r, w = TOPOLOGY_LABELS
    lab = m.labels
    return (f'{"1" if demoted else "0"}{lab.get(z, "")}\0{lab.get(r, "")}\0{lab.get(w, "")}\0{m.host}',
            m.local_rank, m.member_id)


@functools.lru_cache(maxsize=1 << 18)
def id_digest(member_id: str) -> int:
    """A member id's 64-bit digest (BLAKE2b, 8 bytes, read little-endian), the unit the
    plan hash is made of. Cached: a planner's ring of known ids is hashed without
    recomputing them."""
    return int.from_bytes(hashlib.blake2b(member_id.encode(), digest_size=8).digest(), "little")


def _digest_of(digests: "array[int]", demoted_count: int, avoid: Iterable[Sequence[str]]) -> str:
    h = hashlib.sha256()
    if sys.byteorder == "little":
        h.update(memoryview(digests).cast("B"))
    else:  # pragma: no cover - the hash is defined on little-endian words
        swapped = array("Q", digests)
        swapped.byteswap()
        h.update(memoryview(swapped).cast("B"))
    h.update(json.dumps([demoted_count, sorted(sorted(p) for p in avoid)], separators=(",", ":")).encode())
    return h.hexdigest()[:32]


def plan_hash(ring: Sequence[str], demoted_count: int, avoid: Iterable[Sequence[str]] = ()) -> str:
    """Hex digest (32 characters) of a plan: ring order (as :func:`id_digest` of each id,
    see the module docstring), demoted tail length, avoided links."""
    return _digest_of(array("Q", map(id_digest, ring)), demoted_count, avoid)


class IncrementalRing:
    """Members in planner order, updated by bisection. ``update`` raises
    :class:`ValueError` on removing an id it does not hold (a caller bug).

    The sort keys, the ids and the ids' digests (:func:`id_digest`) are kept in three
    parallel sequences, so :meth:`ring` reads the ids and :meth:`hash` the digests (one
    flat array) without building anything per call."""

    def __init__(self) -> None:
        self._keys: list[tuple[str, int, str]] = []
        self._ids: list[str] = []
        self._digests: array[int] = array("Q")
        self._key_of: dict[str, tuple[str, int, str]] = {}
        self._demoted = 0

    @classmethod
    def of(cls, members: Iterable[tuple[RingMember, bool]]) -> "IncrementalRing":
        """A ring of ``members`` (``(member, demoted)``; the last one of an id wins), built
        with one sort: what ``update(upsert=members)`` on an empty ring gives, without its
        per-member bookkeeping (at 100,000 members the first epoch's and every loaded
        state's ring)."""
        r = cls()
        key_of = r._key_of
        for m, demoted in members:
            key_of[m.member_id] = sort_key(m, demoted)
        r._keys = sorted(key_of.values())
        r._ids = [k[2] for k in r._keys]
        r._digests = array("Q", map(id_digest, r._ids))
        r._demoted = sum(1 for k in r._keys if k[0][0] == "1")
        return r

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._key_of

    def member_ids(self) -> KeysView[str]:
        """The ids in the ring, as a live set view."""
        return self._key_of.keys()

    def update(self, remove: Iterable[str] = (), upsert: Iterable[tuple[RingMember, bool]] = ()) -> None:
        """Drop ``remove`` ids, then insert (or move) each ``(member, demoted)``.

        A few changes go by bisection and one list insert/delete each (a memmove of the
        list per change); from :data:`BATCH` changes on (a rack loss, a large join) the
        lists are rebuilt once from slices around the changed positions, so a change of
        k members costs O(k log N) comparisons plus one O(N) copy, not k memmoves."""
        gone = list(dict.fromkeys(remove))
        latest = {m.member_id: (m, demoted) for m, demoted in upsert}   # the last one of an id wins
        dropping = set(gone)
        gone += [mid for mid in latest if mid in self._key_of and mid not in dropping]
        if len(gone) + len(latest) >= BATCH:
            self._rebuild(gone, latest)
            return
        for mid in gone:
            i = self._find(mid)
            del self._keys[i], self._ids[i], self._digests[i]
            self._forget(mid)
        for mid, (m, demoted) in latest.items():
            k = self._remember(m, demoted)
            i = bisect.bisect_left(self._keys, k)
            self._keys.insert(i, k)
            self._ids.insert(i, mid)
            self._digests.insert(i, id_digest(mid))

    def _rebuild(self, gone: list[str], latest: dict[str, tuple[RingMember, bool]]) -> None:
        """:meth:`update` for many changes: one pass over the lists."""
        keys_, ids, digests = self._keys, self._ids, self._digests
        cuts: list[tuple[int, int, tuple[str, int, str] | None]] = [(self._find(mid), 1, None) for mid in gone]
        for mid in gone:
            self._forget(mid)
        new = sorted(self._remember(m, demoted) for m, demoted in latest.values())
        cuts += [(bisect.bisect_left(keys_, k), 0, k) for k in new]   # positions in the old list
        cuts.sort(key=lambda c: (c[0], c[1]))    # at one position: inserts (in key order) before the drop
        out_keys: list[tuple[str, int, str]] = []
        out_ids: list[str] = []
        out_digests: array[int] = array("Q")
        prev = 0
        for i, _, k in cuts:
            out_keys += keys_[prev:i]
            out_ids += ids[prev:i]
            out_digests += digests[prev:i]
            if k is None:
                prev = i + 1
            else:
                out_keys.append(k)
                out_ids.append(k[2])
                out_digests.append(id_digest(k[2]))
                prev = i
        out_keys += keys_[prev:]
        out_ids += ids[prev:]
        out_digests += digests[prev:]
        self._keys, self._ids, self._digests = out_keys, out_ids, out_digests

    def _remember(self, m: RingMember, demoted: bool) -> tuple[str, int, str]:
        k = self._key_of[m.member_id] = sort_key(m, demoted)
        self._demoted += demoted
        return k

    def _forget(self, mid: str) -> None:
        k = self._key_of.pop(mid)
        self._demoted -= k[0][0] == "1"

    def _find(self, mid: str) -> int:
        """The position of ``mid``'s key (:class:`KeyError` if absent)."""
        k = self._key_of[mid]
        i = bisect.bisect_left(self._keys, k)
        if i >= len(self._keys) or self._keys[i] != k:   # pragma: no cover - invariant
            raise ValueError(f"ring lost track of member {mid!r}")
        return i

    def position(self, member_id: str) -> int:
        """The member's index in :meth:`ring` (O(log N)); :class:`KeyError` if absent."""
        return bisect.bisect_left(self._keys, self._key_of[member_id])

    def at(self, index: int) -> str:
        """The member id at ring ``index`` (negative counts from the end)."""
        return self._ids[index]

    def ring(self) -> tuple[str, ...]:
        return tuple(self._ids)

    @property
    def demoted_count(self) -> int:
        return self._demoted

    def hash(self, avoid: Iterable[Sequence[str]] = (), moves: dict[int, int] | None = None) -> str:
        """:func:`plan_hash` of this ring, or of it with ``moves`` applied ({final
        position: position here}, :func:`separate`'s answer): O(N) in C, no list of ids."""
        if not moves:
            return _digest_of(self._digests, self._demoted, avoid)
        digests = array("Q", self._digests)
        for final, base in moves.items():
            digests[final] = self._digests[base]
        return _digest_of(digests, self._demoted, avoid)


def separate(n: int, healthy: int, avoid: Collection[frozenset[str]], at: Callable[[int], str],
             position: Callable[[str], int]) -> dict[int, int]:
    """The planner's link separation (:func:`.planner.plan` with ``avoid``) as sparse
    moves: ``{final position: position in the sorted ring}`` for the positions it
    changes, on a ring of ``n`` ids read through ``at`` (``position`` of an id: only
    asked for ids in ``avoid`` pairs; :class:`KeyError` means not in the ring).

    Greedy and deterministic: for the first bad edge (a pair in ``avoid`` adjacent,
    cyclically), swap its second member with the nearest position inside the same part
    ([0, ``healthy``) or [``healthy``, n)) that lowers the number of bad edges; stop when
    none is left or no swap helps. A swap only changes the four edges at its two
    positions, so each trial costs O(1), not O(n): the cost is O(|avoid| + trials)
    lookups. The planner needs ``n >= 4``; smaller rings are returned unmoved."""
    if n < 4 or not avoid:
        return {}
    src: dict[int, int] = {}

    def get(p: int) -> str:
        return at(src.get(p, p))

    def is_bad(e: int) -> bool:
        a, b = get(e), get((e + 1) % n)
        return a != b and frozenset((a, b)) in avoid

    bad: set[int] = set()
    for pair in avoid:
        for m in pair:
            try:
                p = position(m)
            except KeyError:
                continue
            bad.update(e for e in ((p - 1) % n, p) if is_bad(e))

    def swap(j: int, k: int) -> None:
        sj, sk = src.get(j, j), src.get(k, k)
        for pos, val in ((j, sk), (k, sj)):
            if val == pos:
                src.pop(pos, None)
            else:
                src[pos] = val

    for _ in range(2 * n):
        if not bad:
            break
        improved = False
        for i in sorted(bad):
            j = (i + 1) % n
            lo, hi = (0, healthy) if j < healthy else (healthy, n)
            for dist in range(1, max(j - lo, hi - 1 - j) + 1):
                for k in (j + dist, j - dist):
                    if not lo <= k < hi or k == i:
                        continue
                    touched = {(j - 1) % n, j, (k - 1) % n, k}
                    swap(j, k)
                    trial = (bad - touched) | {e for e in touched if is_bad(e)}
                    if len(trial) < len(bad):
                        bad, improved = trial, True
                        break
                    swap(j, k)   # undo
                if improved:
                    break
            if improved:
                break
        if not improved:
            break
    return src
