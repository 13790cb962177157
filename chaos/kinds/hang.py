"""``hang``: SIGSTOP a member (in-process at an op/phase, or at a time), SIGCONT after
``resume_after_s``. Chaos Mesh: NetworkChaos 100 % ``loss`` for ``resume_after_s`` (a
freeze as the cluster sees it: no frames, no lease keep-alives)."""
from __future__ import annotations

import signal

from resilient.chaos.faults import MEMBER, ExpectedEffect, Fault, FaultKind, Injector, after_s
from resilient.chaos.mesh import MeshObject, Selectors, lasting


class Hang(FaultKind):
    name = "hang"
    params = {"member": MEMBER, "resume_after_s": after_s("SIGCONT")}
    failpoint_action = "stop"
    duration_param = "resume_after_s"
    effect = ExpectedEffect(excuses_victim=True)

    def inject(self, fault: Fault, ctx: Injector) -> None:
        now = ctx.now()
        ctx.signal_member(fault.params["member"], signal.SIGSTOP)
        self.fired_in_process(fault, ctx, now)

    def fired_in_process(self, fault: Fault, ctx: Injector, at: float) -> None:
        member, resume = fault.params["member"], fault.duration_s
        ctx.injected(fault, at, target=f"member {member}", victim=member, end_s=at + resume if resume else None)
        if resume:
            ctx.resume_later(member, resume)

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        # no target: all egress of the pod is dropped (its frames, ACKs and keep-alives)
        spec = {"action": "loss", "mode": "all", "selector": sel.workers(fault.params["member"]),
                "loss": {"loss": "100", "correlation": "100"}}
        return lasting([("NetworkChaos", spec)], fault.duration_s)
