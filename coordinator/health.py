"""Health records: ``health/<member_id>``, written by each member at a low rate, and the
coordinator's straggler verdicts, ``straggler`` (one JSON object), read by status.

Record format (version 1), one *window* of ops, JSON::

    {"v": 1, "member": "m3", "epoch": 7, "seq": 42,      # seq: window counter of this member
     "at": 1718000000.0,                                 # wall time the window closed
     "ops": 25, "window_s": 1.02,                        # ops completed, wall seconds covered
     "wait_s": {"m2": 0.61, "m4": 0.02},                 # seconds blocked on receives, per peer
     "op_s_p50": 0.040, "op_s_max": 0.061,               # per-op wall time (optional)
     "shaping": "slow=3x"}                               # optional: injected slowness (bench)

:func:`make_record` builds it (the rank side's :mod:`resilient.health_reporter` calls it
from :class:`~resilient.transport.base.TransportStats` deltas); the detector
(:mod:`.straggler`) reads ``ops``, ``window_s``, ``wait_s``, ``epoch``, ``seq``, ``at``.
Under a node agent (the launcher's default) a rank's windows go to its node's
:class:`~.node_health.NodeHealthAggregator` instead, which writes one ``health/<node>``
summary when something changed, within a job-wide write budget (:mod:`.node_health`);
:func:`expand_health` turns either form into per-member records.

The coordinator's policy is a :class:`~.policy.HealthPolicy`: a :class:`DemotionRule` —
a pure function from every member's record to the set of members to demote
(:data:`no_demotion`, the default, reads nothing) — or a :class:`StragglerPolicy` —
stateful, fed the current epoch as well, returning a :class:`~.straggler.Verdict`
(demoted members and links to avoid). The coordinator leader publishes a
:class:`StragglerPolicy`'s scores to ``straggler`` (:func:`write_scores`) at a low rate.

Records live on the member's lease, so a dead member's health goes with it. Failure
behaviour: :func:`write_health` raises :class:`~resilient.errors.LeaseExpired` when the
lease is gone and :class:`~resilient.errors.StoreUnavailable` when etcd is unreachable;
:func:`read_health` and :func:`read_scores` skip malformed records (and log them).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from typing import TYPE_CHECKING, TypedDict, cast

from resilient.coordinator import keys, records
from resilient.coordinator.link_classes import LINK_LABEL
from resilient.coordinator.node_health import SUMMARY_VERSION as SUMMARY_VERSION   # re-exported
from resilient.coordinator.node_health import NodeHealthAggregator as NodeHealthAggregator
from resilient.coordinator.node_health import SummaryPolicy as SummaryPolicy
from resilient.coordinator.node_health import summary_records
from resilient.coordinator.policy import HealthPolicy, NoEvictions, PolicyNeeds
from resilient.coordinator.store import Store
from resilient.coordinator.straggler import (
    DEMOTED, HealthRecord, MemberState, ScoreRow, StragglerConfig, StragglerDetector, Verdict,
)
from resilient.errors import ConfigError, RecordError

if TYPE_CHECKING:  # pragma: no cover - epoch.py reaches eviction.py (and so this module) lazily
    from resilient.coordinator.epoch import Epoch
    from resilient.coordinator.epoch_view import EpochView

log = logging.getLogger(__name__)

RECORD_VERSION = 1

#: a stateless demotion rule: every member's record -> the members to demote
DemotionFn = Callable[[Mapping[str, HealthRecord]], Set[str]]


class DemotionRule(NoEvictions):
    """A :class:`~.policy.HealthPolicy` from a plain function of the health records (the
    members it names are demoted; nobody is evicted). ``reads_health=False``: the
    coordinator reads no records for it (``fn`` gets ``{}``). What ``fn`` raises
    demotes nobody that pass (the coordinator logs it)."""

    def __init__(self, fn: DemotionFn, reads_health: bool = True) -> None:
        self.fn = fn
        self._needs = PolicyNeeds(health=reads_health)

    @property
    def needs(self) -> PolicyNeeds:
        return self._needs

    @property
    def leaf_deadline_ms(self) -> float | None:
        return None

    def verdict(self, records: Mapping[str, HealthRecord], epoch: EpochView | None, alive: Collection[str],
                requests: Mapping[str, int]) -> Verdict:
        return Verdict(demoted=frozenset(self.fn(records)), avoid=frozenset())


def _nobody(records: Mapping[str, HealthRecord]) -> Set[str]:
    return frozenset()


#: The default policy: nobody is demoted (and no health record is read).
no_demotion = DemotionRule(_nobody, reads_health=False)


def make_record(member_id: str, epoch: int, seq: int, ops: int, window_s: float,
                wait_s: Mapping[str, float], op_times: Sequence[float] = (), at: float | None = None,
                **extra: object) -> HealthRecord:
    """A version-1 health record for one window (see the module docstring)."""
    rec: dict[str, object] = {"v": RECORD_VERSION, "member": member_id, "epoch": int(epoch), "seq": int(seq),
                 "at": time.time() if at is None else float(at), "ops": int(ops),
                 "window_s": round(float(window_s), 6),
                 "wait_s": {str(p): round(float(s), 6) for p, s in wait_s.items() if s > 0}}
    if op_times:
        s = sorted(op_times)
        rec["op_s_p50"] = round(s[len(s) // 2], 6)
        rec["op_s_max"] = round(s[-1], 6)
    rec.update(extra)
    return cast(HealthRecord, rec)   # the known fields are typed above; ``extra`` passes through


def write_health(store: Store, job: str, member_id: str, record: HealthRecord, lease_id: int | None) -> None:
    """Write ``member_id``'s health record (``at`` is filled in if absent)."""
    body = dict(record)
    body.setdefault("at", time.time())
    store.put(keys.health_of(job, member_id), json.dumps(body, separators=(",", ":")).encode(), lease=lease_id)


def parse_health(raw: bytes, key: str = "") -> HealthRecord:
    """Validate one ``health/<member>`` record: a JSON object whose known fields have
    their types (``epoch``, ``seq``, ``ops``: integers in [0, 2**63); ``at``,
    ``window_s``, ``op_s_*``: finite numbers >= 0; ``wait_s`` and ``link_bps``: member id
    -> finite number >= 0; ``shaping``, ``member``: bounded strings; ``null`` means
    absent); other fields pass as they are.
    Raises :class:`~resilient.errors.RecordError`."""
    f = records.fields("health", raw, key)
    rec = {k: v for k, v in f.d.items() if v is not None}   # null: absent
    for name in ("v", "epoch", "seq", "ops"):
        if f.has(name):
            rec[name] = f.int(name)
    for name in ("at", "window_s", "op_s_p50", "op_s_max"):
        if f.has(name):
            rec[name] = f.float(name, lo=0.0)
    if f.has("wait_s"):
        rec["wait_s"] = f.float_map("wait_s", lo=0.0)
    if f.has(LINK_LABEL):
        rec[LINK_LABEL] = f.float_map(LINK_LABEL, lo=0.0)
    for name in ("shaping", "member"):
        if f.has(name):
            rec[name] = f.str(name, max_len=256)
    return cast(HealthRecord, rec)   # every known field was checked above


def expand_health(key: str, raw: bytes, prefix: str) -> dict[str, HealthRecord]:
    """The member records one ``health/`` key holds: a node summary (version 3,
    :func:`.node_health.parse_summary`; version 2, ``{"v": 2, "node", "at", "ranks":
    {member: window}}``, each window validated as a record of its own) expands into its
    ranks' records; any other value is one member's record, keyed by the key's last
    segment (``prefix``: the ``health/`` prefix). Raises
    :class:`~resilient.errors.RecordError` for a malformed record."""
    f = records.fields("health", raw, key)
    version = f.d.get("v")
    if version == SUMMARY_VERSION:
        return summary_records(f, key)
    if version == 2:
        ranks = f.obj("ranks", {})
        return {mid: parse_health(json.dumps(rec).encode(), f"{key}#{mid}")
                for mid, rec in (ranks.by_name() if ranks is not None else ())}
    rec = parse_health(raw, key)
    mid = key[len(prefix):]
    if not records.is_id(mid):
        raise RecordError(f"bad health record at {key}: the key does not end in a valid member id", "health", key)
    return {mid: rec}


def read_health(store: Store, job: str) -> dict[str, HealthRecord]:
    """Every member's health record, read in pages of 1,000 keys (under etcd's response
    limit at any job size: a node summary is ~0.5 KB); node summaries are expanded into
    their ranks' records (:func:`expand_health`). Malformed records are skipped (logged
    and counted). The coordinator keeps them from a watch instead
    (:class:`.health_cache.HealthCache`); this is one O(N) read."""
    from resilient.coordinator.directory import paged_snapshot

    prefix = keys.health(job)
    out: dict[str, HealthRecord] = {}
    kvs, _ = paged_snapshot(store, prefix)
    for kv in kvs:
        try:
            out.update(expand_health(kv.key, kv.value, prefix))
        except RecordError as exc:
            records.skip(exc, kv.key)
    return out


def scores_key(job: str) -> str:
    """``/resilient/<job>/straggler``: the leader's latest straggler scores and states."""
    return keys.root(job) + "straggler"


def write_scores(store: Store, job: str, verdict: Verdict, lease_id: int | None = None) -> None:
    """Publish ``{"at", "members": {id: {score, state}}, "demoted": [...], "avoid": [[a, b]...]}``."""
    body = {"at": time.time(), "members": verdict.scores, "demoted": sorted(verdict.demoted),
            "avoid": [list(p) for p in sorted(verdict.avoid)]}
    store.put(scores_key(job), json.dumps(body, separators=(",", ":")).encode(), lease=lease_id)


class ScoresRecord(TypedDict, total=False):
    """The ``straggler`` record as :func:`parse_scores` validated it (other fields pass)."""

    at: float
    members: dict[str, ScoreRow]
    demoted: list[str]
    avoid: list[list[str]]


def parse_scores(raw: bytes, key: str = "") -> ScoresRecord:
    """Validate the ``straggler`` record: ``members`` id -> {``score``: finite number or
    null, ``state``: string, ``until``/``hold_s``: finite numbers}, ``demoted``: ids,
    ``avoid``: [id, id] pairs, ``at``: finite. Raises :class:`~resilient.errors.RecordError`."""
    f = records.fields("scores", raw, key)
    body = dict(f.d)
    body["at"] = f.float("at", 0.0)
    members: dict[str, dict[str, object]] = {}
    sub = f.obj("members", {})
    for m, v in (sub.by_name() if sub is not None else ()):
        e = records.Fields("scores", v, key, f"members.{m}")
        row = dict(e.d)
        row["score"] = e.float("score", None)
        row["state"] = e.str("state", None, max_len=32)
        for name in ("until", "hold_s"):
            if e.has(name):
                row[name] = e.float(name)
        members[m] = row
    body["members"] = members
    body["demoted"] = list(f.names("demoted", ()))
    avoid = f.rows("avoid", [])
    for pair in avoid:
        if len(pair) != 2 or any(not records.is_id(x) for x in pair):
            f.fail(f"avoid holds {pair!r}, not a pair of member ids")
    body["avoid"] = avoid
    return cast(ScoresRecord, body)   # every known field was checked above


def read_scores(store: Store, job: str) -> ScoresRecord:
    """The published scores (``{}`` when none or malformed: logged and counted)."""
    kv = store.get(scores_key(job))
    if kv is None:
        return {}
    try:
        return parse_scores(kv.value, kv.key)
    except RecordError as exc:
        records.skip(exc, kv.key)
        return {}


class StragglerPolicy(NoEvictions):
    """The coordinator's straggler policy: a :class:`~.straggler.StragglerDetector` fed
    with the health records and the current epoch on every reconcile pass.

    ``evaluate(records, epoch, now) -> Verdict``; the members serving demoted leaves (their
    tree parents in the epoch's plan) are passed as exempt. ``leaf_deadline_ms`` (not
    None): the deadline policy — the coordinator puts it into the plan of every epoch with
    a demoted member, and the leaf path then finishes an op without a leaf whose input
    is later than that after the ring (``resilient/collectives/algorithms/leaf_deadline.py``);
    raises :class:`~resilient.errors.ConfigError` for a value outside [0, 600000].
    Stateless across coordinator failover by design: a new leader starts from the epoch's roles (demoted members stay
    demoted until they have been clear for ``release_windows``)."""

    def __init__(self, config: StragglerConfig | None = None, leaf_deadline_ms: float | None = None) -> None:
        if leaf_deadline_ms is not None:
            try:
                ok = 0.0 <= float(leaf_deadline_ms) <= 600_000.0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ConfigError(f"leaf deadline {leaf_deadline_ms!r} ms is not a number in [0, 600000]; "
                                  "pass e.g. --leaf-deadline-ms 10")
            leaf_deadline_ms = float(leaf_deadline_ms)
        self.detector = StragglerDetector(config)
        #: ``--straggler-policy deadline``: published as ``plan["leaf_deadline_ms"]`` in
        #: every epoch that demotes someone; None: the lossless ``demote`` policy
        self.leaf_deadline_ms = leaf_deadline_ms
        self._seeded_from: int | None = None

    # -- the HealthPolicy protocol (coordinator/policy.py) --------------------------------

    @property
    def needs(self) -> PolicyNeeds:
        return PolicyNeeds(health=True, epoch=True, scores=True)

    def verdict(self, records: Mapping[str, HealthRecord], epoch: EpochView | None, alive: Collection[str],
                requests: Mapping[str, int]) -> Verdict:
        return self.evaluate(records, epoch)

    def evaluate(self, records: Mapping[str, HealthRecord], epoch: Epoch | EpochView | None,
                 now: float | None = None) -> Verdict:
        """One pass of the detector over ``records`` on ``epoch``'s ring. Cost: the
        records and the demoted members, each looked up in the view (O(log N) on the
        coordinator's :class:`~.epoch_view.StateView`); a full :class:`~.epoch.Epoch`
        is indexed first (O(N))."""
        from resilient.coordinator.epoch_view import view_of   # epoch.py reaches this module lazily

        now = time.time() if now is None else now
        if epoch is None:   # no ring to score on: the detector keeps what it knows
            return self.detector.verdict()
        view = view_of(epoch)
        demoted = view.demoted()
        if self._seeded_from is None:   # a fresh leader: keep the demotions already published
            self._seeded_from = view.number
            for m in demoted:
                self.detector.seed(m, MemberState(state=DEMOTED, since=now))
        parents = {p for p in (view.leaf_parent(m) for m in demoted) if p is not None}
        return self.detector.update(records, view, view.number, now, exempt=parents)   # O(changed) on HealthRecords


if TYPE_CHECKING:  # pragma: no cover - static checks that both implement the protocol
    _rule_conforms: type[HealthPolicy] = DemotionRule
    _straggler_conforms: type[HealthPolicy] = StragglerPolicy
