"""The chaos runner: starts real etcd (1 or 3 members), coordinator(s) and members, injects
a scenario's faults and collects a :class:`~resilient.chaos.verifier.RunLog`.

Status: the runner needs the collectives (``resilient.collectives.Communicator``) and a
worker harness; until they exist :func:`run_scenario` raises :class:`RunnerUnavailable`
and ``resilient chaos run`` says so. The seam it fills is fixed:

    run_scenario(scenario, seed, workdir) -> RunLog   # then verifier.verify(run_log)

Injection plan (for the implementation): op/phase-triggered kill/hang through
``RESILIENT_FAILPOINTS`` in the victim's environment (:meth:`Fault.failpoint_spec`);
time-triggered kill/hang by ``os.kill(pid, SIGKILL/SIGSTOP/SIGCONT)`` on PIDs it started;
etcd_kill / coordinator_kill by SIGKILL of that process (restart through
:class:`~resilient.coordinator.local_etcd.LocalEtcd`); slow / drop_link / partition
through the transport's fault hooks; netem only as root with ``ip netns`` (else the fault
is recorded as skipped with the reason). Every process it starts is stopped by PID.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from resilient.chaos.scenario import Scenario
from resilient.chaos.verifier import RunLog
from resilient.errors import ConfigError


class RunnerUnavailable(ConfigError):
    """The runner cannot run here (a part it needs is missing); the message says which."""


def runner_unavailable_reason() -> str | None:
    """``None`` when the runner can run; otherwise why not."""
    if importlib.util.find_spec("resilient.collectives.communicator") is None:
        return ("the chaos runner is not available yet: it needs resilient.collectives.Communicator and a worker "
                "harness, which are still being built; `resilient chaos check` and `resilient chaos k8s` work now")
    return "the chaos runner is not implemented yet in this build"


def skip_reason(scenario: Scenario) -> str | None:
    """Why this scenario must be skipped on this machine (e.g. netem needs root), else ``None``."""
    if "root" in scenario.requires and os.geteuid() != 0:
        return f"scenario {scenario.name!r} needs root and `ip netns` for tc netem; run it as root"
    return None


def run_scenario(scenario: Scenario, seed: int, workdir: str | os.PathLike | None = None) -> RunLog:
    """Run one seed of ``scenario`` for real and return its log. Raises
    :class:`RunnerUnavailable` until the runner exists."""
    reason = runner_unavailable_reason()
    raise RunnerUnavailable(reason)
