"""The coordinator's two policy contracts: liveness (is a suspected member dead?) and
health (whom to demote, evict or re-admit).

The coordinator (:mod:`.service`) calls only what is declared here; it never probes a
policy for optional attributes. Implementations:

* :class:`LivenessPolicy` — :class:`.liveness.LeaseLiveness` (the default: a suspicion is
  confirmed by the suspect's lease going unrefreshed, never by one peer's word).
* :class:`HealthPolicy` — :class:`.health.DemotionRule` (a plain function of the health
  records; :data:`.health.no_demotion` is the default), :class:`.health.StragglerPolicy`
  (``--straggler-policy demote`` / ``deadline``) and :class:`.eviction.EvictPolicy`
  (``--straggler-policy evict``).

Declarations only: no I/O, nothing here raises. What a failing policy costs is the
coordinator's business: a health policy that raises demotes nobody that pass (logged).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from resilient.coordinator.straggler import HealthRecord, Verdict

if TYPE_CHECKING:  # pragma: no cover - epoch.py reaches eviction.py (and so health.py) lazily
    from resilient.coordinator.epoch_view import EpochView

#: a liveness policy's ruling on one suspect: revoke its lease, drop the reports, or ask again later
SuspectRuling = Literal["confirm", "dismiss", "wait"]


@dataclass(frozen=True)
class SuspectCase:
    """What is known of one suspect: ``first_report`` — wall time of its earliest
    ``suspects/<it>/<reporter>`` report; its lease's ``lease_remaining`` and
    ``lease_granted`` seconds (etcd's TTL answer); ``now`` — wall time of the judgement."""

    first_report: float
    lease_remaining: float
    lease_granted: float
    now: float


class LivenessPolicy(Protocol):
    """Decides whether a suspected member (reported by a peer, its lease still present)
    is dead. A member whose lease is gone is dead without asking."""

    def judge(self, case: SuspectCase) -> SuspectRuling:
        """``confirm``: the coordinator revokes the lease and publishes the removal (cause
        ``suspect_confirmed``); ``dismiss``: the reports are deleted; ``wait``: ask again
        next pass. Pure; must not raise."""
        ...


@dataclass(frozen=True)
class PolicyNeeds:
    """What the coordinator reads for a health policy each pass: ``health`` — the
    ``health/`` records; ``epoch`` — the current epoch as an
    :class:`~.epoch_view.EpochView` (ring neighbours, roles, leaf parents and plan extras
    by lookup: O(log N) each on delta epochs, no planner run); ``readmit_requests`` — the
    ``readmit/`` requests; ``scores`` — publish the verdict's scores (``straggler`` key,
    metrics)."""

    health: bool = True
    epoch: bool = False
    readmit_requests: bool = False
    scores: bool = False


class EvictionEntry(Protocol):
    """One current eviction, as an epoch's ``plan["evicted"]`` carries it."""

    def to_dict(self) -> dict[str, float | int]:
        ...


class NoEvictions:
    """The eviction part of a :class:`HealthPolicy` that never evicts: nobody is out,
    nobody is re-admitted (a base for such policies)."""

    @property
    def evicted(self) -> Mapping[str, EvictionEntry]:
        return {}

    @property
    def readmitted(self) -> Set[str]:
        return frozenset()


class HealthPolicy(Protocol):
    """Demotes, evicts and re-admits members from their health records."""

    @property
    def needs(self) -> PolicyNeeds:
        """The inputs :meth:`verdict` wants (see :class:`PolicyNeeds`)."""
        ...

    @property
    def evicted(self) -> Mapping[str, EvictionEntry]:
        """Members out of the epoch while their lease lives (empty unless evicting)."""
        ...

    @property
    def readmitted(self) -> Set[str]:
        """Members once evicted and now let back in (their epoch's cause is ``readmitted``)."""
        ...

    @property
    def leaf_deadline_ms(self) -> float | None:
        """Put into the plan of every epoch with a demoted member (None: lossless leaves)."""
        ...

    def verdict(self, records: Mapping[str, HealthRecord], epoch: EpochView | None, alive: Collection[str],
                requests: Mapping[str, int]) -> Verdict:
        """One pass: ``records`` (empty unless ``needs.health``), the current ``epoch``
        (None unless ``needs.epoch``, or before the first), the ``alive`` member ids, the
        re-admission ``requests`` (member -> epoch it answers; empty unless
        ``needs.readmit_requests``). May raise: the pass then demotes nobody."""
        ...
