"""Shared fixtures: a real etcd on a free loopback port, stopped afterwards."""
from __future__ import annotations

import pytest

from resilient.coordinator.local_etcd import LocalEtcd


@pytest.fixture(scope="session")
def etcd_session():
    """One real etcd for the whole session; tests isolate themselves by job prefix."""
    with LocalEtcd() as etcd:
        yield etcd


@pytest.fixture
def etcd():
    """A real etcd private to one test (use when the test kills or restarts etcd)."""
    with LocalEtcd() as etcd:
        yield etcd


@pytest.fixture
def job_name(request) -> str:
    """A job name unique to the test, so tests sharing etcd_session never collide."""
    import re
    import uuid

    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def ring_on_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The member processes this test starts (they inherit the environment) run the ring
    between members of one host (``RESILIENT_SHM_DIRECT=0``) instead of the default
    direct shared-memory algorithms: for tests that assert the ring's recovery — which
    contributor set a kill at a ring phase leaves, that a recovery ran (a failpoint in
    it fires). The direct algorithms' own fault outcomes: tests/test_shm_direct_procs.py."""
    monkeypatch.setenv("RESILIENT_SHM_DIRECT", "0")


#: test files that assert machine-wide state (nothing new in /dev/shm; network namespaces,
#: veths and qdiscs they create and remove): `make test` runs them one after another on one
#: worker (xdist group ``machine``), after the rest (see the Makefile). test_torch_api_calls.py
#: runs on the workers again: its size_after flake under load was a survivor's exit seen by the
#: lease reaper before the read, fixed in the worker (it reads size_after between two barriers)
SERIAL_FILES = frozenset({"test_shm_direct.py", "test_shm_direct_procs.py", "test_shm_direct_rs.py",
                          "test_transport_shm.py", "test_chaos_netns.py", "test_chaos_scenario.py",
                          "test_node_loss_training.py", "test_multinode_netns.py"})
#: CPU-only files that start no member, etcd or segment (the type check, compilers, codecs):
#: they run on the other worker beside the machine-wide ones, which leave a core idle
SIDECAR_FILES = frozenset({"test_typecheck.py", "test_qcodec.py", "test_stream_copy.py", "test_cuda_compile.py"})
#: a file whose outcome shifts under the load of a second worker (a late member's deadline):
#: it runs last, alone
ALONE_FILES = frozenset({"test_straggler_procs.py"})
#: the slowest files (from `make test`'s durations) go first, so the two workers of the first
#: phase end together instead of one finishing a long file alone
SLOWEST_FIRST = ("test_torch_api_calls.py", "test_collectives_faults.py", "test_fsdp_hsdp_procs.py",
                 "test_torch_suite.py", "test_chaos_real.py", "test_hierarchical_procs.py",
                 "test_collectives_multiproc.py", "test_hetero_procs.py", "test_admission_removal_procs.py",
                 "test_ddp_unchanged.py", "test_chaos_runner.py", "test_launcher_agent.py")


@pytest.hookimpl(tryfirst=True)   # before -m selects and xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        if name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif name in SIDECAR_FILES:
            item.add_marker(pytest.mark.sidecar)
        elif name in ALONE_FILES:
            item.add_marker(pytest.mark.alone)
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))
