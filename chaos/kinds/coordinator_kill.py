"""``coordinator_kill``: SIGKILL the coordinator that holds the leadership in etcd (a
standby takes over); a replacement starts after ``restart_after_s``. Chaos Mesh: PodChaos
``pod-kill`` on one coordinator (Chaos Mesh cannot select the leader; with 2 replicas it
is the leader half the time)."""
from __future__ import annotations

from typing import Any, Mapping

from resilient.chaos.faults import Fault, FaultKind, Injector, ParamSpec, ParseContext, after_s
from resilient.chaos.mesh import MeshObject, Selectors


class CoordinatorKill(FaultKind):
    name = "coordinator_kill"
    params = {
        "target": ParamSpec("choice", choices=("leader",), help="which coordinator: the current leader"),
        "restart_after_s": after_s("restart it"),
    }
    duration_param = "restart_after_s"
    target_params = ("target",)

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        if ctx.coordinators < 2:
            raise ctx.error("kind", "coordinator_kill needs a standby to take over; set `coordinators: 2` or more")
        params.setdefault("target", "leader")
        return params

    def target(self, params: Mapping[str, Any]) -> str:
        return "coordinator leader"

    def inject(self, fault: Fault, ctx: Injector) -> None:
        now, leader = ctx.now(), ctx.coordinator_leader()
        if not ctx.kill_coordinator(leader or ""):
            ctx.skipped(fault, now, f"no live leader ({leader!r})", target="coordinator leader")
            return
        restart = fault.duration_s
        ctx.injected(fault, now, target=f"coordinator {leader} (leader)", end_s=now + restart if restart else None)
        if restart:
            ctx.later(restart, lambda: ctx.start_coordinator(f"{leader}r"))

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        return [("PodChaos", {"action": "pod-kill", "mode": "one", "selector": sel.coordinators()})]
