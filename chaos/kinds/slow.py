"""``slow``: added delay and/or a bandwidth cap on one member's transport, for
``duration_s``, through its shaping file. Chaos Mesh: NetworkChaos ``delay`` and/or
``bandwidth`` on that worker."""
from __future__ import annotations

from typing import Any

from resilient.chaos.faults import (DURATION, MEMBER, ExpectedEffect, Fault, FaultKind, Injector, ParamSpec,
                                    ParseContext)
from resilient.chaos.mesh import MeshObject, Selectors, lasting


class Slow(FaultKind):
    name = "slow"
    params = {
        "member": MEMBER,
        "delay_ms": ParamSpec("float", minimum=0, help="added one-way delay per frame"),
        "bandwidth_mbit": ParamSpec("float", minimum=0, exclusive_min=True, help="bandwidth cap in Mbit/s"),
        "duration_s": DURATION,
    }
    duration_param = "duration_s"
    effect = ExpectedEffect(may_evict=True, recovery_timed=False)

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        if "delay_ms" not in params and "bandwidth_mbit" not in params:
            raise ctx.error("delay_ms", "slow needs `delay_ms:` and/or `bandwidth_mbit:`")
        return params

    def inject(self, fault: Fault, ctx: Injector) -> None:
        p = fault.params
        items = []
        if p.get("delay_ms"):
            items.append(f"delay={float(p['delay_ms']):g}ms")
        if p.get("bandwidth_mbit"):
            items.append(f"bw={float(p['bandwidth_mbit']) * 125000:.0f}B/s")
        ctx.shape(fault, ctx.now(), {p["member"]: items or ["delay=0ms"]})

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        p, out = fault.params, []
        if p.get("delay_ms") is not None:
            out.append(("NetworkChaos", {"action": "delay", "mode": "all", "selector": sel.workers(p["member"]),
                                         "delay": {"latency": f"{p['delay_ms']:g}ms", "jitter": "0ms",
                                                   "correlation": "100"}}))
        if p.get("bandwidth_mbit") is not None:
            out.append(("NetworkChaos", {"action": "bandwidth", "mode": "all", "selector": sel.workers(p["member"]),
                                         "bandwidth": {"rate": f"{p['bandwidth_mbit']:g}mbps", "limit": 20971520,
                                                       "buffer": 10000}}))
        return lasting(out, fault.duration_s)
