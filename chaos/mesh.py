"""Building blocks of Chaos Mesh objects for the Helm chart's pods.

:class:`Selectors` picks the chart's pods by label (``app.kubernetes.io/name=resilient``,
``app.kubernetes.io/instance=<release>``, ``app.kubernetes.io/component``; a worker by
its Indexed Job index, an etcd member by its StatefulSet pod index); :func:`link` is a
NetworkChaos spec between two sets of pods; :func:`seconds` and :func:`lasting` write
durations. Fault kinds (``chaos/kinds/``) build their ``chaos_mesh`` export from these;
:mod:`resilient.chaos.k8s` assembles the manifests. Pure data: raises nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: One Chaos Mesh object: its kind (``PodChaos``, ``NetworkChaos``, ...) and its spec.
MeshObject = tuple[str, dict[str, Any]]

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
ETCD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


@dataclass(frozen=True)
class Selectors:
    """Label selectors for the pods of one Helm release in ``namespace``."""

    namespace: str
    release: str | None = None

    def _select(self, component: str, indices: tuple[int, ...] | None = None,
                index_label: str = INDEX_LABEL) -> dict[str, Any]:
        labels = {"app.kubernetes.io/name": "resilient", "app.kubernetes.io/component": component}
        if self.release:
            labels["app.kubernetes.io/instance"] = self.release
        sel: dict[str, Any] = {"namespaces": [self.namespace], "labelSelectors": labels}
        if indices is not None:
            if len(indices) == 1:
                labels[index_label] = str(indices[0])
            else:
                sel["expressionSelectors"] = [{"key": index_label, "operator": "In",
                                               "values": [str(i) for i in indices]}]
        return sel

    def workers(self, *indices: int) -> dict[str, Any]:
        """The worker pods of these member indices."""
        return self._select("worker", tuple(indices))

    def etcd(self, index: int) -> dict[str, Any]:
        """The etcd pod of this StatefulSet index."""
        return self._select("etcd", (index,), ETCD_INDEX_LABEL)

    def coordinators(self) -> dict[str, Any]:
        """Every coordinator pod (Chaos Mesh cannot select the leader)."""
        return self._select("coordinator")


def seconds(x: float) -> str:
    """A Chaos Mesh duration: ``2s``, ``1500ms``."""
    return f"{int(x)}s" if float(x).is_integer() else f"{int(round(x * 1000))}ms"


def link(action: str, source: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """A NetworkChaos spec acting on the traffic between ``source`` and ``target`` pods."""
    return {"action": action, "mode": "all", "selector": source, "direction": "both",
            "target": {"mode": "all", "selector": target}}


def lasting(objects: list[MeshObject], duration_s: float | None) -> list[MeshObject]:
    """``objects`` with ``spec["duration"]`` set where the fault has a duration."""
    if duration_s is not None:
        for _, spec in objects:
            spec["duration"] = seconds(duration_s)
    return objects
