"""``drop_link``: cut the connection between two members for ``duration_s`` (``drop=m<j>``
in both ends' shaping files). Chaos Mesh: NetworkChaos ``partition`` between the two
workers."""
from __future__ import annotations

from resilient.chaos.faults import DURATION, LINK, ExpectedEffect, Fault, FaultKind, Injector
from resilient.chaos.members import member_id
from resilient.chaos.mesh import MeshObject, Selectors, lasting, link


class DropLink(FaultKind):
    name = "drop_link"
    params = {"link": LINK, "duration_s": DURATION}
    duration_param = "duration_s"
    effect = ExpectedEffect(may_evict=True)

    def inject(self, fault: Fault, ctx: Injector) -> None:
        a, b = fault.params["link"]
        ctx.shape(fault, ctx.now(), {a: [f"drop={member_id(b)}"], b: [f"drop={member_id(a)}"]})

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        a, b = fault.params["link"]
        return lasting([("NetworkChaos", link("partition", sel.workers(a), sel.workers(b)))], fault.duration_s)
