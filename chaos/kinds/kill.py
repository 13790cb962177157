"""``kill``: SIGKILL a member — in-process at an op/phase (failpoint) or at a time.
Chaos Mesh: PodChaos ``pod-kill`` on that worker."""
from __future__ import annotations

import signal

from resilient.chaos.faults import MEMBER, ExpectedEffect, Fault, FaultKind, Injector
from resilient.chaos.mesh import MeshObject, Selectors


class Kill(FaultKind):
    name = "kill"
    params = {"member": MEMBER}
    failpoint_action = "kill"
    effect = ExpectedEffect(excuses_victim=True, victim_loses_data=True)

    def inject(self, fault: Fault, ctx: Injector) -> None:
        member = fault.params["member"]
        ctx.injected(fault, ctx.now(), target=f"member {member}", victim=member)
        ctx.signal_member(member, signal.SIGKILL)

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        return [("PodChaos", {"action": "pod-kill", "mode": "all", "selector": sel.workers(fault.params["member"])})]
