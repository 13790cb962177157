"""``netem``: ``tc netem`` delay/loss on the traffic between the two members of ``link``
only, for ``duration_s`` (root: every member of the scenario runs in its own network
namespace, :class:`~resilient.chaos.netns.NetnsLab`; htb + u32 on both namespace veths).
Recorded as skipped, with the probed reason, where the kernel has no netem qdisc.
Chaos Mesh: NetworkChaos ``delay`` / ``loss`` between the two workers."""
from __future__ import annotations

import sys
from typing import Any

from resilient.chaos.faults import (DURATION, LINK, ORACLE_NO_TRANSPORT, ExpectedEffect, Fault, FaultKind, Injector,
                                    ParamSpec, ParseContext)
from resilient.chaos.mesh import MeshObject, Selectors, lasting, link
from resilient.chaos.netns import NetnsError


class Netem(FaultKind):
    name = "netem"
    params = {
        "link": LINK,
        "delay_ms": ParamSpec("float", minimum=0, help="tc netem delay"),
        "loss_pct": ParamSpec("float", minimum=0, maximum=100, help="tc netem loss, percent"),
        "duration_s": DURATION,
    }
    duration_param = "duration_s"
    effect = ExpectedEffect(may_evict=True, recovery_timed=False)
    needs_netns = True

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        if "delay_ms" not in params and "loss_pct" not in params:
            raise ctx.error("delay_ms", "netem needs `delay_ms:` and/or `loss_pct:`")
        if "root" not in ctx.requires:
            raise ctx.error("kind", "netem needs root and ip netns; add `requires: [root]` to the scenario so runs "
                            "without root skip it with a clear message")
        return params

    def inject(self, fault: Fault, ctx: Injector) -> None:
        p, now, lab = fault.params, ctx.now(), ctx.lab
        if ctx.backend == "oracle":
            ctx.skipped(fault, now, ORACLE_NO_TRANSPORT)
            return
        if lab is None or ctx.netem_unavailable is not None:
            ctx.skipped(fault, now, ctx.netem_unavailable or "the members are not in network namespaces")
            return
        a, b = p["link"]
        lab.apply_netem(a, b, delay_ms=float(p.get("delay_ms") or 0), loss_pct=float(p.get("loss_pct") or 0))
        dur = fault.duration_s
        ctx.injected(fault, now, end_s=now + dur if dur else None)
        if dur:
            ctx.later(dur, lambda: _clear(ctx, a, b))

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject]:
        # Chaos Mesh's delay action carries no loss: one object each
        p, out = fault.params, []
        a, b = p["link"]
        if p.get("delay_ms") is not None:
            spec = link("delay", sel.workers(a), sel.workers(b))
            spec["delay"] = {"latency": f"{p['delay_ms']:g}ms", "jitter": "0ms", "correlation": "0"}
            out.append(("NetworkChaos", spec))
        if p.get("loss_pct") is not None:
            spec = link("loss", sel.workers(a), sel.workers(b))
            spec["loss"] = {"loss": f"{p['loss_pct']:g}", "correlation": "0"}
            out.append(("NetworkChaos", spec))
        return lasting(out, fault.duration_s)


def _clear(ctx: Injector, a: int, b: int) -> None:
    """Remove the netem of link ``a``-``b``; a failure while the run ends is ignored (the
    lab is going away), otherwise reported on stderr."""
    try:
        lab = ctx.lab
        if lab is not None:
            lab.clear_netem(a, b)
    except NetnsError as exc:
        if not ctx.stopping():
            print(f"chaos: could not remove netem from link {a}-{b}: {exc}", file=sys.stderr, flush=True)
