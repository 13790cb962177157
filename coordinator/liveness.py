"""The default liveness policy: a suspicion is confirmed by the suspect's lease, never by
one peer's word.

A peer that waits on a member past its op timeout writes ``suspects/<member>/<peer>``. The
member is confirmed dead when its lease has gone unrefreshed for at least two keep-alive
intervals (a member refreshes every ``ttl *`` :data:`~.membership.KEEPALIVE_FRACTION`
seconds, so ``remaining + 1 <= granted * KEEPALIVE_FRACTION`` means refreshes were
missed); a suspicion whose lease keeps being refreshed for a whole TTL after the first
report is dismissed; otherwise the coordinator asks again on its next pass.

Change how the coordinator decides a member is dead here (or pass another
:class:`~.policy.LivenessPolicy` to :class:`~.service.Coordinator`). Pure: no I/O, no
clock (``now`` comes in the case); never raises.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from resilient.coordinator.membership import KEEPALIVE_FRACTION
from resilient.coordinator.policy import LivenessPolicy, SuspectCase, SuspectRuling


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
