"""Chaos Mesh manifests for running a scenario against the Helm chart on Kubernetes.

The chart's pods carry ``app.kubernetes.io/name=resilient``,
``app.kubernetes.io/instance=<release>`` and ``app.kubernetes.io/component`` =
``worker | coordinator | etcd``; a worker's member index is its Indexed Job label
``batch.kubernetes.io/job-completion-index`` and an etcd member's index its StatefulSet
label ``apps.kubernetes.io/pod-index`` (Kubernetes >= 1.28).

Mapping (``chaos-mesh.org/v1alpha1``):

========================  ==============================================================
scenario fault            Chaos Mesh
========================  ==============================================================
kill                      PodChaos ``pod-kill`` on that worker
hang                      NetworkChaos ``loss`` 100 % for ``resume_after_s`` (a freeze
                          as the cluster sees it: no frames, no lease keep-alives)
slow                      NetworkChaos ``delay`` and/or ``bandwidth`` on that worker
drop_link                 NetworkChaos ``partition`` between the two workers
partition                 NetworkChaos ``partition`` between each pair of groups
etcd_kill                 PodChaos ``pod-kill`` on that etcd member (the StatefulSet
                          restarts it: ``restart_after_s`` is not controllable)
coordinator_kill          PodChaos ``pod-kill`` on one coordinator (Chaos Mesh cannot
                          select the leader; with 2 replicas it is the leader half the time)
netem                     NetworkChaos ``delay`` / ``loss`` between the two workers
========================  ==============================================================

Time-triggered faults become one ``Workflow`` whose ``Parallel`` entry runs, per fault, a
``Serial`` branch: ``Suspend`` until the fault's time, then the chaos (``deadline`` = how
long it lasts). ``flat=True`` instead emits the chaos objects themselves, which apply at
once. Op- and phase-triggered kill/hang cannot be timed from outside; they are returned as
:class:`Failpoint` notes (set ``RESILIENT_FAILPOINTS`` on that worker) and skipped here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from resilient.chaos.faults import Fault, FaultKind
from resilient.chaos.scenario import Scenario, resolve_faults

API_VERSION = "chaos-mesh.org/v1alpha1"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
ETCD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_KILL_DEADLINE = "10s"  # how long a pod-kill template stays "running" in a Workflow


@dataclass(frozen=True)
class Failpoint:
    """An op-triggered fault Chaos Mesh cannot time: set ``env`` on worker ``member``."""

    member: int
    env: str
    fault: str


def _name(text: str) -> str:
    """A DNS-1123 name (lowercase alphanumerics and '-', at most 63 characters)."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].rstrip("-")


def _selector(namespace: str, release: str | None, component: str,
              indices: tuple[int, ...] | None = None, index_label: str = INDEX_LABEL) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "resilient", "app.kubernetes.io/component": component}
    if release:
        labels["app.kubernetes.io/instance"] = release
    sel: dict[str, Any] = {"namespaces": [namespace], "labelSelectors": labels}
    if indices is not None:
        if len(indices) == 1:
            labels[index_label] = str(indices[0])
        else:
            sel["expressionSelectors"] = [{"key": index_label, "operator": "In",
                                           "values": [str(i) for i in indices]}]
    return sel


def _seconds(x: float) -> str:
    return f"{int(x)}s" if float(x).is_integer() else f"{int(round(x * 1000))}ms"


def fault_chaos(fault: Fault, namespace: str, release: str | None) -> list[tuple[str, dict[str, Any]]]:
    """``(kind, spec)`` pairs of Chaos Mesh objects that inject ``fault`` (one fault may
    need several, e.g. a partition of three groups). Duration, where the fault has one,
    is in ``spec["duration"]``."""
    p, k = fault.params, fault.kind
    worker = lambda *idx: _selector(namespace, release, "worker", tuple(idx))  # noqa: E731
    out: list[tuple[str, dict[str, Any]]] = []
    if k is FaultKind.KILL:
        out.append(("PodChaos", {"action": "pod-kill", "mode": "all", "selector": worker(p["member"])}))
    elif k is FaultKind.HANG:
        # no target: all egress of the pod is dropped (its frames, ACKs and keep-alives)
        out.append(("NetworkChaos", {"action": "loss", "mode": "all", "selector": worker(p["member"]),
                                     "loss": {"loss": "100", "correlation": "100"}}))
    elif k is FaultKind.SLOW:
        if p.get("delay_ms") is not None:
            out.append(("NetworkChaos", {"action": "delay", "mode": "all", "selector": worker(p["member"]),
                                         "delay": {"latency": f"{p['delay_ms']:g}ms", "jitter": "0ms",
                                                   "correlation": "100"}}))
        if p.get("bandwidth_mbit") is not None:
            out.append(("NetworkChaos", {"action": "bandwidth", "mode": "all", "selector": worker(p["member"]),
                                         "bandwidth": {"rate": f"{p['bandwidth_mbit']:g}mbps", "limit": 20971520,
                                                       "buffer": 10000}}))
    elif k is FaultKind.DROP_LINK:
        a, b = p["link"]
        out.append(("NetworkChaos", _link("partition", worker(a), worker(b))))
    elif k is FaultKind.PARTITION:
        groups = p["groups"]
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                out.append(("NetworkChaos", _link("partition", worker(*groups[i]), worker(*groups[j]))))
    elif k is FaultKind.ETCD_KILL:
        sel = _selector(namespace, release, "etcd", (p["etcd_member"],), ETCD_INDEX_LABEL)
        out.append(("PodChaos", {"action": "pod-kill", "mode": "all", "selector": sel}))
    elif k is FaultKind.COORDINATOR_KILL:
        out.append(("PodChaos", {"action": "pod-kill", "mode": "one",
                                 "selector": _selector(namespace, release, "coordinator")}))
    elif k is FaultKind.NETEM:  # Chaos Mesh's delay action carries no loss: one object each
        a, b = p["link"]
        if p.get("delay_ms") is not None:
            spec = _link("delay", worker(a), worker(b))
            spec["delay"] = {"latency": f"{p['delay_ms']:g}ms", "jitter": "0ms", "correlation": "0"}
            out.append(("NetworkChaos", spec))
        if p.get("loss_pct") is not None:
            spec = _link("loss", worker(a), worker(b))
            spec["loss"] = {"loss": f"{p['loss_pct']:g}", "correlation": "0"}
            out.append(("NetworkChaos", spec))
    duration = fault.duration_s
    if duration is not None and k not in (FaultKind.KILL, FaultKind.ETCD_KILL, FaultKind.COORDINATOR_KILL):
        for _, spec in out:
            spec["duration"] = _seconds(duration)
    return out


def _link(action: str, source: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    return {"action": action, "mode": "all", "selector": source, "direction": "both",
            "target": {"mode": "all", "selector": target}}


def to_manifests(scenario: Scenario, namespace: str = "default", release: str | None = None,
                 flat: bool = False, seed: int = 0) -> tuple[list[dict[str, Any]], list[Failpoint]]:
    """The Chaos Mesh objects for ``scenario`` (``member: random`` resolved with ``seed``)
    and the op-triggered faults that need failpoints instead. Raises nothing for valid
    scenarios; a scenario without time-triggered faults yields no objects."""
    base = _name(scenario.name)
    timed: list[tuple[Fault, list[tuple[str, dict[str, Any]]]]] = []
    failpoints: list[Failpoint] = []
    for fault in resolve_faults(scenario, seed):
        if fault.trigger.in_process:
            failpoints.append(Failpoint(fault.member or 0, f"RESILIENT_FAILPOINTS={fault.failpoint_spec()}",
                                        fault.describe()))
        else:
            timed.append((fault, fault_chaos(fault, namespace, release)))
    meta = lambda name: {"name": name, "namespace": namespace,  # noqa: E731
                         "labels": {"app.kubernetes.io/name": "resilient", "app.kubernetes.io/component": "chaos",
                                    "resilient.io/scenario": base}}
    if flat:
        docs = []
        for i, (fault, objs) in enumerate(timed):
            for j, (kind, spec) in enumerate(objs):
                docs.append({"apiVersion": API_VERSION, "kind": kind,
                             "metadata": meta(_name(f"{base}-{i}-{fault.kind.value}-{j}")), "spec": spec})
        return docs, failpoints
    if not timed:
        return [], failpoints
    templates: list[dict[str, Any]] = []
    branches = []
    for i, (fault, objs) in enumerate(timed):
        steps = []
        if fault.trigger.time_s:
            wait = f"wait-{i}"
            templates.append({"name": wait, "templateType": "Suspend", "deadline": _seconds(fault.trigger.time_s)})
            steps.append(wait)
        for j, (kind, spec) in enumerate(objs):
            spec = dict(spec)
            deadline = spec.pop("duration", None) or POD_KILL_DEADLINE
            name = _name(f"fault-{i}-{fault.kind.value}-{j}")
            key = kind[0].lower() + kind[1:]
            templates.append({"name": name, "templateType": kind, "deadline": deadline, key: spec})
            steps.append(name)
        branch = f"branch-{i}"
        templates.append({"name": branch, "templateType": "Serial", "children": steps})
        branches.append(branch)
    templates.insert(0, {"name": "timeline", "templateType": "Parallel", "children": branches})
    workflow = {"apiVersion": API_VERSION, "kind": "Workflow", "metadata": meta(base),
                "spec": {"entry": "timeline", "templates": templates}}
    return [workflow], failpoints


def render(scenario: Scenario, namespace: str = "default", release: str | None = None, flat: bool = False,
           seed: int = 0) -> str:
    """Multi-document YAML of :func:`to_manifests`, headed by comments that list the
    failpoints to set on workers for op-triggered faults."""
    import yaml

    docs, failpoints = to_manifests(scenario, namespace, release, flat, seed)
    head = [f"# Chaos Mesh manifests for scenario {scenario.name!r} ({scenario.source})",
            f"# apply after `helm install {release or 'RELEASE'} helm/resilient -n {namespace}`"]
    for fp in failpoints:
        head.append(f"# not expressible in Chaos Mesh: {fp.fault}: set env {fp.env} on worker index {fp.member}")
    if not docs:
        head.append("# (no time-triggered faults: nothing for Chaos Mesh to apply)")
    body = yaml.safe_dump_all(docs, sort_keys=False) if docs else ""
    return "\n".join(head) + "\n" + ("---\n" + body if body else "")
