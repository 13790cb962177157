"""Chaos runs that prove the claim "nothing lost, no hang, exact results" (docs/design.md §6).

Modules: :mod:`~resilient.chaos.scenario` (YAML format and validation),
:mod:`~resilient.chaos.faults` (fault kinds and triggers),
:mod:`~resilient.chaos.workload` (deterministic inputs, independent expected outputs),
:mod:`~resilient.chaos.verifier` (checks every op record), :mod:`~resilient.chaos.report`
(table, JSON, PNG timeline), :mod:`~resilient.chaos.k8s` (Chaos Mesh manifests) and
:mod:`~resilient.chaos.runner` (starts real etcd, coordinators and members).

Nothing here imports torch at package import time.
"""
