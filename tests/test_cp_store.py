"""Store adapter against a real etcd: KV, CAS, leases, reconnecting watches, errors."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from resilient.coordinator.store import Compare, Delete, Put, Store, parse_endpoints
from resilient.errors import ConfigError, LeaseExpired, StoreUnavailable
from cp_helpers import wait_until


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def test_put_get_delete_prefix(store, job_name):
    p = f"/t/{job_name}/"
    rev = store.put(p + "a", b"1")
    store.put(p + "b", "2")
    kv = store.get(p + "a")
    assert kv.value == b"1" and kv.mod_revision == rev and kv.lease == 0
    assert [k.key for k in store.get_prefix(p)] == [p + "a", p + "b"]
    assert store.delete(p + "a") is True
    assert store.delete(p + "a") is False
    assert store.get(p + "a") is None
    assert store.delete_prefix(p) == 1
    assert store.get_prefix(p) == []


def test_cas_and_create(store, job_name):
    k = f"/t/{job_name}/k"
    assert store.create(k, b"v1") is True
    assert store.create(k, b"other") is False
    rev = store.get(k).mod_revision
    assert store.cas(k, rev, b"v2") is True
    assert store.cas(k, rev, b"v3") is False          # stale revision loses
    assert store.get(k).value == b"v2"
    guard = f"/t/{job_name}/guard"
    store.put(guard, b"me")
    rev = store.get(k).mod_revision
    assert store.cas(k, rev, b"v4", extra=[Compare(guard, "value", "==", b"someone-else")]) is False
    assert store.txn([Compare(guard, "value", "==", b"me")], [Put(k, b"v5"), Delete(guard)]) is True
    assert store.get(k).value == b"v5" and store.get(guard) is None


def test_lease_lifecycle(store, job_name):
    k = f"/t/{job_name}/leased"
    lease = store.grant(2)
    assert store.lease_ttl(lease)[1] == 2
    store.put(k, b"x", lease=lease)
    assert store.get(k).lease == lease
    assert store.keepalive(lease) == 2
    assert store.revoke(lease) is True
    assert store.get(k) is None                      # keys go with the lease, at once
    assert store.lease_ttl(lease) is None
    assert store.revoke(lease) is False
    with pytest.raises(LeaseExpired):
        store.keepalive(lease)
    with pytest.raises(LeaseExpired, match="gone"):
        store.put(k, b"y", lease=lease)


def test_watch_prefix_delivers_in_order_from_revision(store, job_name):
    p = f"/t/{job_name}/w/"
    first = store.put(p + "0", b"0")
    got, done = [], threading.Event()

    def cb(evs):
        got.extend(evs)
        if any(e.key == p + "3" for e in evs):
            done.set()

    h = store.watch_prefix(p, first, cb)               # replays from `first`
    try:
        store.put(p + "1", b"1")
        store.delete(p + "0")
        store.put(p + "3", b"3")
        assert done.wait(10)
        assert [(e.type, e.key) for e in got] == [("put", p + "0"), ("put", p + "1"), ("delete", p + "0"),
                                                  ("put", p + "3")]
        assert [e.mod_revision for e in got] == sorted(e.mod_revision for e in got)
    finally:
        h.cancel()


def test_watch_survives_etcd_restart_without_missing_events(etcd, job_name):
    store = Store(etcd.endpoints)
    p = f"/t/{job_name}/"
    got = []
    h = store.watch_prefix(p, None, got.extend)
    try:
        assert h.connected.wait(10)
        store.put(p + "before", b"1")
        wait_until(lambda: len(got) == 1, 10, "first event")
        etcd.kill(0)
        wait_until(lambda: not h.connected.is_set(), 10, "the watch to notice etcd died")
        etcd.restart(0)
        # Written at once after the restart, probably before the watch has reconnected:
        store.put(p + "after1", b"2")
        store.put(p + "after2", b"3")
        wait_until(lambda: len(got) == 3, 20, "the events written after the restart")
        assert [e.key for e in got] == [p + "before", p + "after1", p + "after2"]
        assert h.reconnects >= 1
    finally:
        h.cancel()
        store.close()


def test_wrong_endpoint_is_a_clear_bounded_error():
    store = Store(["127.0.0.1:1"], retry_timeout=1.0, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.get("/x")
    assert time.monotonic() - t0 < 15        # bounded: not a hang
    assert "127.0.0.1:1" in str(info.value) and "check that etcd is running" in str(info.value)


@pytest.mark.parametrize("bad", ["", "nohost", "host:notaport", ","])
def test_bad_endpoint_strings_raise_config_error(bad):
    with pytest.raises(ConfigError, match="etcd endpoint"):
        parse_endpoints(bad)


def test_parse_endpoints_forms():
    assert parse_endpoints("http://10.0.0.1:2379, b:2") == [("10.0.0.1", 2379), ("b", 2)]
    assert parse_endpoints(["a:1"]) == [("a", 1)]


def test_tls_and_auth_options_are_validated():
    with pytest.raises(ConfigError, match="cert_key and cert_cert"):
        Store(["127.0.0.1:2379"], ca_cert="/ca.pem", cert_key="/k.pem")
    with pytest.raises(ConfigError, match="user and password"):
        Store(["127.0.0.1:2379"], user="root")
    with pytest.raises(ConfigError, match="TLS: cannot read the etcd CA file ./nonexistent/ca.pem."):
        Store(["127.0.0.1:2379"], ca_cert="/nonexistent/ca.pem")


PROTOBUF_FIRST = r"""
import sys
import google.protobuf
from google.protobuf import descriptor_pb2
fd = descriptor_pb2.FileDescriptorProto(name="user_model.proto", package="user")
fd.message_type.add(name="Thing")
assert fd.SerializeToString()
from resilient.coordinator.store import Store
s = Store([sys.argv[1]])
s.put("/t/protobuf-first", b"ok")
print(google.protobuf.__version__, s.get("/t/protobuf-first").value.decode())
"""


def test_store_imports_and_works_after_modern_protobuf(etcd_session):
    """docs/design.md §2: a training script that imported protobuf (tensorboard...) first."""
    out = subprocess.run([sys.executable, "-c", PROTOBUF_FIRST, etcd_session.endpoints[0]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    version, value = out.stdout.split()
    assert int(version.split(".")[0]) >= 4 and value == "ok"
