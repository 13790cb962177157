"""The launcher's agent in node-lease mode (the default) grants its node
lease ``node_lease_ttl(--lease-ttl)`` (real etcd: the TTL etcd reports for the lease), and
a ``--lease-ttl`` under 2.5 s as given, with a warning naming the looser bound. The
agent's hung-rank check stays on ``--lease-ttl`` (``control.lease_ttl``)."""
from __future__ import annotations

import logging

import pytest

from resilient.coordinator import Store
from resilient.launcher.agent import Agent, ControlPlane, node_grant_ttl
from resilient.launcher.args import parse
from resilient.launcher.env import Placement
from resilient.launcher.logs import WorkerLogs
from resilient.launcher.rendezvous import LeaseKeeper


@pytest.mark.parametrize("bound, granted", [(5.0, 4.0), (2.5, 2.0), (3.49, 2.0), (30.0, 29.0)])
def test_grant_is_node_lease_ttl_of_the_bound(bound, granted, caplog):
    with caplog.at_level(logging.WARNING, logger="resilient.launcher"):
        assert node_grant_ttl(bound) == granted
    # only the launcher's own records: a watch thread another test left behind may log too
    assert not [r for r in caplog.records if r.name.startswith("resilient.launcher")]


@pytest.mark.parametrize("bound, late", [(2.0, "2.5s"), (1.0, "2.5s"), (2.4, "2.9s")])
def test_short_bound_is_granted_as_given_with_a_warning(bound, late, caplog):
    with caplog.at_level(logging.WARNING, logger="resilient.launcher"):
        assert node_grant_ttl(bound) == bound
    (rec,) = [r for r in caplog.records if r.name.startswith("resilient.launcher")]
    assert f"up to {late} after its last refresh" in rec.getMessage()
    assert "pass --lease-ttl 2.5 or more" in rec.getMessage()


def _agent(etcd_session, job: str, ttl: str, tmp_path, monkeypatch) -> tuple[Agent, ControlPlane]:
    monkeypatch.setenv("RESILIENT_NODE_LEASE", "1")
    cfg = parse(["--etcd", etcd_session.endpoint_arg, "--job", job, "--lease-ttl", ttl, "--nproc-per-node", "1",
                 "true"])
    store = Store(etcd_session.endpoints)
    control = ControlPlane(store, list(etcd_session.endpoints), job, cfg.lease_ttl, LeaseKeeper(store, cfg.lease_ttl))
    logs = WorkerLogs(str(tmp_path / "logs"), cfg.run_id, cfg.role)
    return Agent(cfg, Placement(0, 1, 1, "localhost", 0, cfg.run_id), logs, control), control


@pytest.mark.parametrize("ttl, granted", [("5", 4.0), ("2", 2.0)])
def test_agent_grants_the_node_lease_its_ttl(etcd_session, job_name, tmp_path, monkeypatch, ttl, granted):
    agent, control = _agent(etcd_session, job_name, ttl, tmp_path, monkeypatch)
    lease = control.node_lease
    try:
        assert agent.node is not None and lease is not None
        assert agent.node.granted_ttl == granted
        remaining_granted = control.store.lease_ttl(lease)
        assert remaining_granted is not None and remaining_granted[1] == granted   # what etcd holds
        assert control.lease_ttl == float(ttl)                  # the hang check's bound stays --lease-ttl
    finally:
        agent._drop_node_lease()
        control.keeper.stop()
        agent.logs.close()
    assert control.store.lease_ttl(lease) is None               # revoked at the end
    control.store.close()
