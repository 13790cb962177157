"""``partition``: members in different ``groups`` cannot talk for ``duration_s`` (every
member drops every member of the other groups). Chaos Mesh: NetworkChaos ``partition``
between each pair of groups."""
from __future__ import annotations

from resilient.chaos.faults import DURATION, ExpectedEffect, Fault, FaultKind, Injector, ParamSpec
from resilient.chaos.members import member_id
from resilient.chaos.mesh import MeshObject, Selectors, lasting, link


class Partition(FaultKind):
    name = "partition"
    params = {"groups": ParamSpec("groups", required=True, help="[[0, 1], [2, 3]]: disjoint member groups"),
              "duration_s": DURATION}
    duration_param = "duration_s"
    effect = ExpectedEffect(may_evict=True)

    def inject(self, fault: Fault, ctx: Injector) -> None:
        groups = [list(g) for g in fault.params["groups"]]
        per_member: dict[int, list[str]] = {}
        for g in groups:
            others = [m for h in groups if h is not g for m in h]
            for m in g:
                per_member[m] = [f"drop={member_id(o)}" for o in others]
        ctx.shape(fault, ctx.now(), per_member)

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        groups = fault.params["groups"]
        out: list[MeshObject] = []
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                out.append(("NetworkChaos", link("partition", sel.workers(*groups[i]), sel.workers(*groups[j]))))
        return lasting(out, fault.duration_s)
