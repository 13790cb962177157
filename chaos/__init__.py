"""Chaos runs that prove the claim "nothing lost, no hang, exact results" (docs/design.md §6).

Modules: :mod:`~resilient.chaos.scenario` (YAML format and validation),
:mod:`~resilient.chaos.faults` (faults, triggers and the fault-kind interface),
:mod:`~resilient.chaos.kinds` (one file per fault kind, and their registry),
:mod:`~resilient.chaos.workload` (deterministic inputs, independent expected outputs),
:mod:`~resilient.chaos.verifier` (checks every op record), :mod:`~resilient.chaos.report`
(table, JSON, PNG timeline), :mod:`~resilient.chaos.k8s` and :mod:`~resilient.chaos.mesh`
(Chaos Mesh manifests) and :mod:`~resilient.chaos.runner` (starts real etcd,
coordinators and members; with :mod:`~resilient.chaos.supervision`,
:mod:`~resilient.chaos.injection`, :mod:`~resilient.chaos.monitor` and
:mod:`~resilient.chaos.records`).

Nothing here imports torch at package import time.
"""
