"""Speed-weighted batch shares: each member's measured samples/s in, its share of the
global batch out.

A member that is slower per sample (an older GPU, a throttled node) is not only a
straggler to demote: given a smaller part of every global batch it finishes its part at
the same time as the others. Two keys, both JSON, both validated on read
(:mod:`.records`; nothing is unpickled):

==========================  ===============================================  ==========
key                         value                                            lease
==========================  ===============================================  ==========
``rates/<member_id>``       ``{"v": 1, "member", "samples_per_s", "at"}``    member's
``shares``                  ``{"v": 1, "version", "at", "members":           none
                            {id: share}}``, shares > 0 summing to 1
==========================  ===============================================  ==========

Members write their rate (:func:`write_rate`, e.g. samples of their last steps / the
steps' compute seconds) at a low rate; the coordinator leader (:class:`SharePublisher`,
called after every reconcile pass with the current epoch's members from its in-memory
state, so the epoch is never re-read for it) turns the rates of those members
into shares (:func:`compute_shares`: proportional to speed, with *hysteresis*: the
published shares are kept until some member's share would move by more than
``hysteresis`` of its value, or the member set changed), and publishes them with a
version counter. Every member reads the same record and converts it to integer batch
sizes with :func:`batch_sizes` (the split with the shortest step, deterministic), so all agree without
a further round. A member with no rate record gets the mean share of the others (a
joiner is not starved before it has measured anything).

Failure behaviour: :func:`read_rates` and :func:`read_shares` skip a malformed record
(logged and counted as a bad ``health`` / ``scores`` record); :func:`batch_sizes`
raises :class:`~resilient.errors.ConfigError` naming the bad argument; the publisher's
etcd errors propagate to its caller (the coordinator logs them and retries next pass).
"""
from __future__ import annotations

import heapq
import json
import logging
import math
import time
from typing import Callable, Collection, Iterable, Mapping, Sequence, TypedDict

from resilient.coordinator import keys, records
from resilient.coordinator.prefix_cache import PrefixCache
from resilient.coordinator.store import KV, Store
from resilient.errors import ConfigError, RecordError

log = logging.getLogger(__name__)

RECORD_VERSION = 1
#: default relative change of some member's share needed to publish new shares
HYSTERESIS = 0.1


def rates_prefix(job: str) -> str:
    return keys.root(job) + "rates/"


def rate_key(job: str, member_id: str) -> str:
    return rates_prefix(job) + keys.check_name("member id", member_id)


def shares_key(job: str) -> str:
    return keys.root(job) + "shares"


def write_rate(store: Store, job: str, member_id: str, samples_per_s: float, lease_id: int | None) -> None:
    """Publish this member's measured samples/s (on its lease, so it goes with it).
    Raises ConfigError for a rate that is not a finite number > 0."""
    if not isinstance(samples_per_s, (int, float)) or not math.isfinite(samples_per_s) or samples_per_s <= 0:
        raise ConfigError(f"samples_per_s must be a finite number > 0, got {samples_per_s!r}")
    body = {"v": RECORD_VERSION, "member": member_id, "samples_per_s": float(samples_per_s), "at": time.time()}
    store.put(rate_key(job, member_id), json.dumps(body, separators=(",", ":")).encode(), lease=lease_id)


def parse_rate(raw: bytes, key: str = "") -> tuple[str, float]:
    """(member, samples/s) of a rate record; raises :class:`RecordError`."""
    f = records.fields("health", raw, key)
    member = f.name("member")
    rate = f.float("samples_per_s", lo=0.0)
    if rate <= 0:
        f.fail(f"samples_per_s is {rate}; want a number > 0")
    if key and keys.last_segment(key) != member:
        f.fail(f"the record names member {member!r} but sits under {keys.last_segment(key)!r}")
    return member, rate


def parse_rates(kvs: Iterable[KV]) -> dict[str, float]:
    """member -> samples/s of the rate records ``kvs`` (malformed ones skipped, logged,
    counted)."""
    out: dict[str, float] = {}
    for kv in kvs:
        try:
            member, rate = parse_rate(kv.value, kv.key)
        except RecordError as exc:
            records.skip(exc, kv.key)
            continue
        out[member] = rate
    return out


def read_rates(store: Store, job: str) -> dict[str, float]:
    """Every member's published samples/s (malformed records skipped, logged, counted)."""
    return parse_rates(store.get_prefix(rates_prefix(job)))


#: seconds between the rate cache's paged re-reads of ``rates/`` (a safety net: the watch
#: keeps it current)
RATES_RESYNC_S = 300.0


class RateCache(PrefixCache[float]):
    """Every member's rate, kept in memory from a watch on ``rates/``
    (:class:`~.prefix_cache.PrefixCache`): loaded once by a paged read, then updated by
    the watch's events, O(change); re-read (paged) every ``resync_interval`` seconds and
    after the watch reports a compaction. A malformed record is skipped (logged, counted)
    and forgets that member's earlier rate. Store errors of a read propagate to the
    caller of :meth:`rates` (the watch itself reconnects on its own)."""

    def __init__(self, store: Store, job: str, resync_interval: float = RATES_RESYNC_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(store, rates_prefix(job), resync_interval, clock)
        self.job = job

    def parse(self, key: str, raw: bytes) -> Mapping[str, float]:
        member, rate = parse_rate(raw, key)
        return {member: rate}

    def rates(self) -> dict[str, float]:
        """A copy of the current rates (member -> samples/s); starts the watch on first
        use and re-reads when due. Store errors propagate (the next call retries)."""
        self.refresh()
        return self.copy()


def compute_shares(rates: Mapping[str, float], members: Iterable[str],
                   previous: Mapping[str, float] | None = None,
                   hysteresis: float = HYSTERESIS) -> dict[str, float] | None:
    """Shares of ``members`` proportional to their ``rates`` (members without a rate get
    the mean rate of those with one; all equal when none has one). Returns ``None`` when
    ``previous`` covers the same members and no share would move by more than
    ``hysteresis`` (relative): keep publishing ``previous``. Pure."""
    ms = sorted(set(members))
    if not ms:
        return None
    known = [rates[m] for m in ms if m in rates]
    mean = sum(known) / len(known) if known else 1.0
    speed = {m: rates.get(m, mean) for m in ms}
    total = sum(speed.values())
    new = {m: speed[m] / total for m in ms}
    if previous is not None and sorted(previous) == ms and all(
            abs(new[m] - previous[m]) <= hysteresis * previous[m] for m in ms):
        return None
    return new


class SharesRecord(TypedDict):
    """A validated ``shares`` record (:func:`parse_shares`)."""

    version: int
    members: dict[str, float]
    at: float


def parse_shares(raw: bytes, key: str = "") -> SharesRecord:
    """Validate a ``shares`` record: ``version`` int, ``members`` id -> share > 0, the
    shares summing to 1 (within 1e-6). Raises :class:`RecordError`."""
    f = records.fields("scores", raw, key)
    version = int(f.int("version"))
    members = f.float_map("members", lo=0.0)
    if not members or any(v <= 0 for v in members.values()):
        f.fail("members must map at least one member id to a share > 0")
    if abs(sum(members.values()) - 1.0) > 1e-6:
        f.fail(f"the shares sum to {sum(members.values())}, not 1")
    return {"version": version, "members": dict(members), "at": float(f.float("at", 0.0))}


def read_shares(store: Store, job: str) -> SharesRecord | None:
    """The published shares record (``None`` when absent or malformed: logged and counted)."""
    kv = store.get(shares_key(job))
    if kv is None:
        return None
    try:
        return parse_shares(kv.value, kv.key)
    except RecordError as exc:
        records.skip(exc, kv.key)
        return None


def batch_sizes(shares: Mapping[str, float], order: Sequence[str], global_batch: int) -> list[int]:
    """Per member of ``order`` (the ranks' order), its number of samples in a global batch
    of ``global_batch``: the integer split with the shortest step, i.e. the least
    ``max(size / share)`` (members not in ``shares`` weigh the mean of the others), each at
    least 1 while ``global_batch >= len(order)``. Built by giving samples one at a time to
    the member whose ``(size + 1) / share`` is least (ties to the earlier rank; started at
    the floor of the proportional split, which lies on that path): a greedy that is optimal
    for this min-max, and never below the floor of the exact proportional split. Rounding
    proportions instead (largest remainder) can give a slow member one sample too many:
    shares 0.285/0.282/0.285/0.148 of 56 gave 16/15/16/9 (the slow member 9 x 2 = 18 fast
    units of step time) where 16/16/16/8 takes 16. Deterministic: every member computes
    the same list. Raises ConfigError on an empty ``order`` or ``global_batch < len(order)``."""
    if not order:
        raise ConfigError("batch_sizes: no members")
    if global_batch < len(order):
        raise ConfigError(f"global batch {global_batch} is smaller than the {len(order)} members; raise it")
    known = [shares[m] for m in order if m in shares]
    mean = sum(known) / len(known) if known else 1.0
    w = [float(shares.get(m, mean)) for m in order]
    total = sum(w)
    sizes = [max(1, int(math.floor(global_batch * x / total))) for x in w]
    if sum(sizes) > global_batch:  # the floor of 1 each took too many: start from 1 each
        sizes = [1] * len(order)
    heap = [((n + 1) / x, i) for i, (n, x) in enumerate(zip(sizes, w))]
    heapq.heapify(heap)
    for _ in range(global_batch - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, ((sizes[i] + 1) / w[i], i))
    return sizes


class SharePublisher:
    """The leader side: after each reconcile pass, :meth:`publish` takes the rates (kept
    in memory by a :class:`RateCache`: no read of ``rates/`` per pass) and writes new
    shares when :func:`compute_shares` says they moved (hysteresis). State (the last
    published shares and version) is re-read from etcd on first use, so a new leader
    continues the version sequence. :meth:`stop` (leadership ends) closes the watch."""

    def __init__(self, store: Store, job: str, hysteresis: float = HYSTERESIS,
                 resync_interval: float = RATES_RESYNC_S) -> None:
        if not 0 <= hysteresis < 1:
            raise ConfigError(f"share hysteresis must be in [0, 1), got {hysteresis}")
        self.store, self.job, self.hysteresis = store, job, hysteresis
        self._last: SharesRecord | None = None
        self._loaded = False
        self.rate_cache = RateCache(store, job, resync_interval)

    def stop(self) -> None:
        """Close the rate watch (the coordinator calls it when its leadership ends)."""
        self.rate_cache.close()

    def after_pass(self, members: Collection[str] | None) -> bool:
        """The coordinator's hook, after each reconcile pass: :meth:`publish` for
        ``members``, the current epoch's members as the coordinator holds them in memory
        (None: no epoch yet, nothing to do). It takes the rates from the watch-kept
        :class:`RateCache` and never reads the epoch. Never raises (a failure is logged and the shares are
        retried next pass; batches stay as last published). Returns whether it wrote."""
        if members is None:
            return False
        try:
            rates = self.rate_cache.rates()
            if not rates:   # nobody measures: nothing to do
                return False
            return self.publish(members, rates)
        except Exception as exc:  # noqa: BLE001 - shares are advisory; the pass itself succeeded
            log.warning("shares not published this pass, retrying next pass: %s: %s", type(exc).__name__, exc)
            return False

    def publish(self, members: Iterable[str], rates: Mapping[str, float] | None = None) -> bool:
        """Publish shares for ``members`` (the current epoch's) if they changed enough
        (``rates``: already read, else read here). Returns whether a record was written. Nothing is written while no member has a
        rate (uniform batches stay the default). Store errors propagate."""
        if not self._loaded:
            self._last, self._loaded = read_shares(self.store, self.job), True
        rates = read_rates(self.store, self.job) if rates is None else rates
        members = list(members)
        if not any(m in rates for m in members):
            return False
        prev = self._last["members"] if self._last else None
        new = compute_shares(rates, members, prev, self.hysteresis)
        if new is None:
            return False
        version = (self._last["version"] + 1) if self._last else 1
        at = time.time()
        body = {"v": RECORD_VERSION, "version": version, "at": at, "members": new}
        self.store.put(shares_key(self.job), json.dumps(body, separators=(",", ":")).encode())
        self._last = {"version": version, "members": new, "at": at}
        return True
