"""Chaos Mesh manifests for running a scenario against the Helm chart on Kubernetes.

The chart's pods carry ``app.kubernetes.io/name=resilient``,
``app.kubernetes.io/instance=<release>`` and ``app.kubernetes.io/component`` =
``worker | coordinator | etcd``; a worker's member index is its Indexed Job label
``batch.kubernetes.io/job-completion-index`` and an etcd member's index its StatefulSet
label ``apps.kubernetes.io/pod-index`` (Kubernetes >= 1.28).

Each fault kind says how Chaos Mesh (``chaos-mesh.org/v1alpha1``) injects it: its
:meth:`~resilient.chaos.faults.FaultKind.chaos_mesh` in ``chaos/kinds/<kind>.py`` (kill:
PodChaos pod-kill; hang: NetworkChaos 100 % loss; slow, drop_link, partition, netem:
NetworkChaos; etcd_kill, coordinator_kill: PodChaos), built from the selectors of
:mod:`resilient.chaos.mesh`. A kind without an equivalent makes the export fail with a
:class:`~resilient.errors.ScenarioError` naming the fault.

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

from resilient.chaos.faults import Fault
from resilient.chaos.mesh import ETCD_INDEX_LABEL, INDEX_LABEL, MeshObject, Selectors, seconds
from resilient.chaos.scenario import Scenario, resolve_faults
from resilient.errors import ScenarioError

__all__ = ["API_VERSION", "ETCD_INDEX_LABEL", "INDEX_LABEL", "POD_KILL_DEADLINE", "Failpoint", "fault_chaos",
           "render", "to_manifests"]

API_VERSION = "chaos-mesh.org/v1alpha1"
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


def fault_chaos(fault: Fault, namespace: str, release: str | None,
                where: str = "<scenario>: kind") -> list[MeshObject]:
    """``(kind, spec)`` pairs of Chaos Mesh objects that inject ``fault`` (one fault may
    need several, e.g. a partition of three groups), from its kind's
    :meth:`~resilient.chaos.faults.FaultKind.chaos_mesh`. Duration, where the fault has
    one, is in ``spec["duration"]``. Raises :class:`ScenarioError` starting ``where``
    (``FILE:LINE: faults[i].kind``) when the kind has no Chaos Mesh equivalent."""
    objects = fault.kind.chaos_mesh(fault, Selectors(namespace, release))
    if objects is None:
        raise ScenarioError(f"{where}: {fault.kind.name} has no Chaos Mesh equivalent, so this scenario cannot be "
                            f"exported; remove that fault to export the others, or run the scenario with "
                            f"`resilient chaos run`")
    return objects


def to_manifests(scenario: Scenario, namespace: str = "default", release: str | None = None,
                 flat: bool = False, seed: int = 0) -> tuple[list[dict[str, Any]], list[Failpoint]]:
    """The Chaos Mesh objects for ``scenario`` (``member: random`` resolved with ``seed``)
    and the op-triggered faults that need failpoints instead. Raises nothing for valid
    scenarios; a scenario without time-triggered faults yields no objects."""
    base = _name(scenario.name)
    timed: list[tuple[Fault, list[MeshObject]]] = []
    failpoints: list[Failpoint] = []
    for index, fault in enumerate(resolve_faults(scenario, seed)):
        if fault.trigger.in_process:
            failpoints.append(Failpoint(fault.member or 0, f"RESILIENT_FAILPOINTS={fault.failpoint_spec()}",
                                        fault.describe()))
        else:
            where = f"{scenario.source}:{fault.line}: faults[{index}].kind"
            timed.append((fault, fault_chaos(fault, namespace, release, where)))

    def meta(name: str) -> dict[str, Any]:
        return {"name": name, "namespace": namespace,
                "labels": {"app.kubernetes.io/name": "resilient", "app.kubernetes.io/component": "chaos",
                           "resilient.io/scenario": base}}
    if flat:
        docs = []
        for i, (fault, objs) in enumerate(timed):
            for j, (kind, spec) in enumerate(objs):
                docs.append({"apiVersion": API_VERSION, "kind": kind,
                             "metadata": meta(_name(f"{base}-{i}-{fault.kind.name}-{j}")), "spec": spec})
        return docs, failpoints
    if not timed:
        return [], failpoints
    templates: list[dict[str, Any]] = []
    branches = []
    for i, (fault, objs) in enumerate(timed):
        steps = []
        if fault.trigger.time_s:
            wait = f"wait-{i}"
            templates.append({"name": wait, "templateType": "Suspend", "deadline": seconds(fault.trigger.time_s)})
            steps.append(wait)
        for j, (kind, spec) in enumerate(objs):
            spec = dict(spec)
            deadline = spec.pop("duration", None) or POD_KILL_DEADLINE
            name = _name(f"fault-{i}-{fault.kind.name}-{j}")
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
