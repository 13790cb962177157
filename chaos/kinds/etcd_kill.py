"""``etcd_kill``: SIGKILL one member of a 3- or 5-member etcd, restarted after
``restart_after_s``. Chaos Mesh: PodChaos ``pod-kill`` on that etcd pod (the StatefulSet
restarts it: ``restart_after_s`` is not controllable)."""
from __future__ import annotations

from typing import Any, Mapping

from resilient.chaos.faults import Fault, FaultKind, Injector, ParamSpec, ParseContext, after_s
from resilient.chaos.mesh import MeshObject, Selectors


class EtcdKill(FaultKind):
    name = "etcd_kill"
    params = {
        "etcd_member": ParamSpec("int", required=True, minimum=0, help="etcd member index 0..etcd_members-1"),
        "restart_after_s": after_s("restart it"),
    }
    duration_param = "restart_after_s"
    target_params = ("etcd_member",)

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        if ctx.etcd_members < 3:
            raise ctx.error("kind", "etcd_kill needs a 3-member etcd (killing the only member loses the control "
                            "plane); set `etcd_members: 3`")
        if params["etcd_member"] >= ctx.etcd_members:
            raise ctx.error("etcd_member", f"must be < etcd_members ({ctx.etcd_members}), got {params['etcd_member']}")
        return params

    def target(self, params: Mapping[str, Any]) -> str:
        return f"etcd member {params['etcd_member']}"

    def inject(self, fault: Fault, ctx: Injector) -> None:
        i, now, restart = fault.params["etcd_member"], ctx.now(), fault.duration_s
        ctx.kill_etcd(i)
        ctx.injected(fault, now, target=f"etcd member {i}", end_s=now + restart if restart else None)
        if restart:
            ctx.later(restart, lambda: ctx.restart_etcd(i))

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        return [("PodChaos", {"action": "pod-kill", "mode": "all", "selector": sel.etcd(fault.params["etcd_member"])})]
