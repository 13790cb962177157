"""Link classes and weighted cross-host shards (issue 16): pure functions, no I/O.

A member's *link speed* is the throughput (bytes/s) of its cross-host link: declared in
its ``MemberInfo.labels["link_bps"]`` (e.g. known NIC classes of a mixed cluster) or
measured by the health reporters (``link_bps`` in their health windows: the fastest
figure of any of its cross-host links, :func:`speeds_from_health`); a measured value
wins over a declared one.

:func:`link_classes` groups members whose speeds are within ``ratio`` of the class's
fastest member (fastest class first; a class's speed is its slowest member's, so a
class never promises more than each of its links gives). :func:`shard_weights` sizes
the hierarchical allreduce's shards: shard ``c`` crosses hosts on the ring of the
members with local index ``c``, whose speed is its slowest member's class speed, so
shard ``c`` gets a share proportional to it (``None``: uniform shards — speeds unknown
for some member, or every index equally fast).

Measured speeds reach the plan through :func:`settle_speeds` (hysteresis): the speeds a
plan was made with are published in the epoch (``plan["link_bps"]``); a member's speed
changes only when a new measurement leaves the band ``[old / (1 + band), old * (1 +
band)]``, so noise inside the band never republishes an epoch, and a new coordinator
leader starts from the published speeds (:func:`parse_speeds`).

Failure behaviour: malformed labels or health fields (not a finite positive number,
not a mapping) are ignored — that member's speed is unknown — never an error: the plan
then falls back to uniform shards.
"""
from __future__ import annotations

import math
from typing import Any, Collection, Iterable, Mapping, Protocol, Sequence

from resilient.coordinator.host_slots import slot_weights

#: the label (bytes/s, a decimal number) declaring a member's cross-host link speed
LINK_LABEL = "link_bps"


def _speed(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


class Labelled(Protocol):
    """What the speed functions read of a member (:class:`~.membership.MemberInfo` has it)."""

    @property
    def member_id(self) -> str: ...

    @property
    def labels(self) -> Mapping[str, object]: ...


def declared_speeds(members: Iterable[Labelled]) -> dict[str, float]:
    """``{member_id: bytes/s}`` from each member's ``labels["link_bps"]`` (valid ones)."""
    out: dict[str, float] = {}
    for m in members:
        labels = m.labels
        s = _speed(labels.get(LINK_LABEL)) if isinstance(labels, Mapping) else None
        if s is not None:
            out[m.member_id] = s
    return out


def member_speeds(members: Iterable[Labelled], measured: Mapping[str, float] | None = None) -> dict[str, float]:
    """Declared speeds (:func:`declared_speeds`) overridden by the valid ``measured`` ones."""
    out = declared_speeds(members)
    for m, v in (measured or {}).items():
        s = _speed(v)
        if s is not None:
            out[m] = s
    return out


def speeds_from_health(health: Mapping[str, Mapping[str, Any]], host_of: Mapping[str, str]) -> dict[str, float]:
    """Each member's measured cross-host speed from the health windows. Member ``r``'s
    record has ``link_bps[p]`` = the rate it received from ``p``: a figure for the link
    between ``r`` and ``p``, which carries at most the slower of the two members' own
    speeds (their NICs), so it bounds *both* from below. A member's speed is the largest
    figure of any of its cross-host links, in either direction (unknown when none).

    Why not the sender's slowest receiver (the rule before): a plan pairs each member with
    one peer per host (local index ``c`` across hosts), so a pair's figure was charged to
    its sender alone; one noisy window that put one member of a slow pair in the fast
    class made the planner pair it with a fast member of the other host, whose link then
    measured slow and was charged to the fast member: the plan settled on two slow pairs
    (``bench/hierarchy.py``, case weighted: weighted shards 0.78x uniform). Charged to
    both ends, the two members of a pair always share one class, so a noisy figure can
    change the weights but never split a pair."""
    out: dict[str, float] = {}
    for r, rec in health.items():
        rates = rec.get(LINK_LABEL) if isinstance(rec, Mapping) else None
        if not isinstance(rates, Mapping):
            continue
        for p, v in rates.items():
            s = _speed(v)
            if s is None or p not in host_of or r not in host_of or host_of[p] == host_of[r]:
                continue
            for m in (p, r):
                out[m] = max(out.get(m, s), s)
    return out


#: default hysteresis band of :func:`settle_speeds`: a change under 25 % is noise
SPEED_BAND = 0.25


def _sig(x: float, digits: int = 3) -> float:
    """``x`` rounded to ``digits`` significant digits (short epoch records)."""
    return float(f"{x:.{digits - 1}e}")


def settle_speeds(current: Mapping[str, float], measured: Mapping[str, float], alive: Collection[str],
                  band: float = SPEED_BAND) -> dict[str, float]:
    """The link speeds a plan should use now, for the ``alive`` members: each keeps its
    ``current`` (published) speed unless a valid ``measured`` one lies outside
    ``[current / (1 + band), current * (1 + band)]`` (then the measurement, rounded to 3
    significant digits, wins); a member without a current speed takes its measurement;
    one without either has none. Pure and deterministic; invalid values are ignored."""
    out: dict[str, float] = {}
    for m in sorted(set(current) | set(measured)):
        if m not in alive:
            continue
        old, new = _speed(current.get(m)), _speed(measured.get(m))
        if new is not None and (old is None or not old / (1 + band) <= new <= old * (1 + band)):
            out[m] = _sig(new)
        elif old is not None:
            out[m] = old
    return out


def parse_speeds(raw: object) -> dict[str, float]:
    """The ``plan["link_bps"]`` of a published epoch as ``{member: bytes/s}``: entries
    that are not a string key with a finite positive number are dropped (a malformed
    record costs only those members' speeds, which the next measurement restores)."""
    if not isinstance(raw, Mapping):
        return {}
    out: dict[str, float] = {}
    for m, v in raw.items():
        s = _speed(v) if isinstance(m, str) and not isinstance(v, bool) else None
        if s is not None:
            out[m] = s
    return out


def link_classes(speeds: Mapping[str, float], ratio: float = 0.8) -> list[tuple[float, list[str]]]:
    """Members grouped into classes, fastest first, as ``(class speed, member ids)``;
    deterministic (ties broken by member id)."""
    order = sorted(speeds, key=lambda m: (-speeds[m], m))
    classes: list[tuple[float, list[str]]] = []
    top = 0.0
    for m in order:
        if not classes or speeds[m] < ratio * top:
            top = speeds[m]
            classes.append((top, []))
        classes[-1][1].append(m)
    return [(min(speeds[m] for m in ids), sorted(ids)) for _, ids in classes]


def class_rank(classes: Sequence[tuple[float, Sequence[str]]]) -> dict[str, int]:
    """``{member: index of its class}`` (0 = fastest)."""
    return {m: i for i, (_, ids) in enumerate(classes) for m in ids}


def shard_weights(groups: Sequence[Sequence[str]], classes: Sequence[tuple[float, Sequence[str]]]) -> list[float] | None:
    """One weight per local index for hosts ``groups`` (equal sizes): the slowest class
    speed among the members with that index, normalised to sum 1 (rounded, so the
    epoch record stays short); None when a member has no class, the hosts are unequal
    (:mod:`.host_slots` weighs those) or all weights are equal."""
    if not groups or len({len(g) for g in groups}) != 1:
        return None
    return slot_weights(groups, [list(range(len(g))) for g in groups], class_speeds(classes))


def class_speeds(classes: Sequence[tuple[float, Sequence[str]]]) -> dict[str, float]:
    """``{member: its class's speed}``."""
    return {m: s for s, ids in classes for m in ids}
