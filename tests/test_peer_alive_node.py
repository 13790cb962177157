"""``EtcdGroupView.peer_alive`` for a rank of a node record (no ``members/<id>`` key): it
reads the node record on the node lease (real etcd). Alive while the lease lives and the
record lists the rank; not alive once the lease is revoked, once the rank is dropped from
the record, or when the record is malformed (logged and counted, never a crash)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from resilient.collectives.group import EtcdGroupView
from resilient.coordinator import Store, keys, records
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.membership import MemberInfo


@dataclass
class _Session:
    member_id: str = "me"


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def _view(store: Store, job: str) -> EtcdGroupView:
    return EtcdGroupView(store, job, _Session(), watcher=None)


def _put_node(store: Store, job: str, node: str, ranks: list[str], lease: int) -> None:
    rec = NodeRecord(node, "h", {}, tuple(MemberInfo(r, host="h", local_rank=i) for i, r in enumerate(ranks)), 5.0)
    store.put(keys.node(job, node), rec.to_json(), lease=lease)


def test_node_rank_alive_while_its_node_lease_lives(store, job_name):
    lease, other = store.grant(10), store.grant(10)
    try:
        _put_node(store, job_name, "n0", ["r0", "r1"], lease)
        _put_node(store, job_name, "n1", ["r2"], other)
        view = _view(store, job_name)
        assert view.peer_alive("r0") and view.peer_alive("r1") and view.peer_alive("r2")
        assert not view.peer_alive("nobody")                       # listed by no record, no member key
        _put_node(store, job_name, "n0", ["r0"], lease)             # r1 vouched out: the record drops it
        assert view.peer_alive("r0") and not view.peer_alive("r1")
        store.revoke(lease)                                         # the node is gone: its record with it
        assert not view.peer_alive("r0")
        assert not _view(store, job_name).peer_alive("r0")          # a fresh view (no memory) agrees
        assert view.peer_alive("r2")                                # the other node is untouched
    finally:
        store.revoke(other)


def test_member_key_still_counts(store, job_name):
    lease = store.grant(10)
    try:
        store.put(keys.member(job_name, "solo"), MemberInfo("solo").to_json(), lease=lease)
        view = _view(store, job_name)
        assert view.peer_alive("solo")
        store.revoke(lease)
        assert not view.peer_alive("solo")
    finally:
        store.revoke(lease)


def test_malformed_node_record_reads_as_not_alive_and_is_logged(store, job_name, caplog):
    lease = store.grant(10)
    try:
        _put_node(store, job_name, "good", ["g0"], lease)
        # r9 is named, but the record is not valid (ranks is not a list): its ranks count as gone
        store.put(keys.node(job_name, "bad"), b'{"node":"bad","host":"h","ranks":{"member_id":"r9"}}', lease=lease)
        before = records.bad_counts()["node"]
        view = _view(store, job_name)
        with caplog.at_level(logging.WARNING):
            assert not view.peer_alive("r9")
            assert view.peer_alive("g0")                            # the valid record is still read
        assert records.bad_counts()["node"] > before
        assert any("bad" in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
        # a record that was good when found and is malformed on the re-read: not alive, logged
        _put_node(store, job_name, "n2", ["r5"], lease)
        fresh = _view(store, job_name)
        assert fresh.peer_alive("r5")
        store.put(keys.node(job_name, "n2"), b"not json", lease=lease)
        before = records.bad_counts()["node"]
        assert not fresh.peer_alive("r5")
        assert records.bad_counts()["node"] == before + 1           # only n2 was read, and skipped
    finally:
        store.revoke(lease)
