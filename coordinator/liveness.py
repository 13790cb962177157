"""The default liveness policy: a suspicion is confirmed by the suspect's lease, never by
one peer's word.

A peer that waits on a member past its op timeout writes ``suspects/<member>/<peer>``. The
member is confirmed dead when its lease has gone unrefreshed for at least two keep-alive
intervals (a member refreshes every ``ttl *`` :data:`~.membership.KEEPALIVE_FRACTION`
seconds, so ``remaining + 1 <= granted * KEEPALIVE_FRACTION`` means refreshes were
missed); a suspicion whose lease keeps being refreshed for a whole TTL after the first
report is dismissed; otherwise the coordinator asks again on its next pass.

A **silent** node (no suspect report: it stopped, froze, lost its network) is found by
etcd alone, when it revokes the node's expired lease. etcd's lessor checks for expired
leases every :data:`ETCD_EXPIRY_LOOP` s, so a lease of TTL ``g`` is revoked ``g`` to
``g + 0.5`` s after its last refresh. :func:`node_lease_ttl` is the TTL a node agent
grants so that the *liveness bound* it was given (``--ttl``: a node silent that long is
declared dead) holds whatever the loop's phase: ``floor(bound - 0.5)`` whole seconds
(etcd counts whole seconds). A node that keeps refreshing every third of that TTL is
never declared dead (docs/scale.md, "Silent loss").

Change how the coordinator decides a member is dead here (or pass another
:class:`~.policy.LivenessPolicy` to :class:`~.service.Coordinator`). Pure: no I/O, no
clock (``now`` comes in the case); ``judge`` never raises; :func:`node_lease_ttl`
raises :class:`~resilient.errors.ConfigError` for a bound etcd cannot keep.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from resilient.coordinator.membership import KEEPALIVE_FRACTION
from resilient.coordinator.policy import LivenessPolicy, SuspectCase, SuspectRuling
from resilient.errors import ConfigError

#: etcd's lessor revokes expired leases in a loop that runs every 500 ms
#: (``revokeExpiredLeases`` in etcd's lease/lessor.go)
ETCD_EXPIRY_LOOP = 0.5
#: the smallest TTL etcd grants: ceil(1.5 x its election timeout), 2 s with the defaults
ETCD_MIN_LEASE_TTL = 2


def node_lease_ttl(bound: float) -> int:
    """The whole-second TTL to grant a node lease so that, if the node falls silent right
    after a refresh, etcd revokes the lease no later than ``bound`` seconds after that
    refresh (its expiry loop adds up to :data:`ETCD_EXPIRY_LOOP`): the largest integer
    ``g`` with ``g + ETCD_EXPIRY_LOOP <= bound``. The node is then declared dead between
    ``g`` and ``g + 0.5`` s after its last refresh, plus the coordinator's reaction.
    Refresh it every ``g * KEEPALIVE_FRACTION`` s (:class:`~.lease_mux.LeaseMux` does,
    given ``g``). Raises :class:`~resilient.errors.ConfigError` when ``bound`` is not a
    finite number of at least ``ETCD_MIN_LEASE_TTL + ETCD_EXPIRY_LOOP`` (2.5 s): etcd
    would raise a shorter TTL to its minimum and the bound would not hold."""
    least = ETCD_MIN_LEASE_TTL + ETCD_EXPIRY_LOOP
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= least):
        raise ConfigError(f"node liveness bound {bound!r} s is too short: etcd grants leases of at least "
                          f"{ETCD_MIN_LEASE_TTL} s and revokes them up to {ETCD_EXPIRY_LOOP} s late, so the "
                          f"bound must be >= {least} s; pass a larger --ttl")
    return int(math.floor(bound - ETCD_EXPIRY_LOOP))


class LeaseLiveness:
    """The rule in the module docstring (a :class:`~.policy.LivenessPolicy`)."""

    def judge(self, case: SuspectCase) -> SuspectRuling:
        if case.lease_remaining + 1 <= case.lease_granted * KEEPALIVE_FRACTION:
            return "confirm"
        if case.now - case.first_report > case.lease_granted + 1:
            return "dismiss"
        return "wait"


if TYPE_CHECKING:  # pragma: no cover - a static check that it implements the protocol
    _conforms: type[LivenessPolicy] = LeaseLiveness
