"""Bad records and hostile connections against a real etcd, real coordinator and member
processes and real signals: nothing wedges the coordinator or kills a watcher."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from http_probe import mark_refused

from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store, keys, records
from resilient.coordinator.metrics import MAX_HTTP_THREADS
from cp_helpers import CoordinatorThread, coordinator_proc, member_proc, resilient_cli, wait_until
from launcher_util import RESILIENT_RUN, SCRIPTS, Launcher


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def bad_records(metrics_url: str, kind: str) -> float:
    prefix = f'resilient_bad_records_total{{kind="{kind}"}} '
    for line in get(metrics_url + "/metrics")[1].splitlines():
        if line.startswith(prefix):
            return float(line.split()[1])
    raise AssertionError(f"{prefix!r} missing from /metrics")


CORRUPT = {
    "garbage": b"not json {",
    "1e400": b'{"number": 1e400, "members": ["m0"]}',
    "2**64": json.dumps({"number": 2 ** 64, "members": ["m0", "m1"]}).encode(),
}


@pytest.mark.parametrize("corrupt,then", [("garbage", signal.SIGSTOP), ("1e400", signal.SIGKILL),
                                          ("2**64", None)])
def test_corrupt_epoch_key_is_published_over_and_later_failures_still_handled(etcd_session, store, job_name,
                                                                              corrupt, then):
    coord = coordinator_proc(etcd_session.endpoint_arg, job_name, "c1", 2.0)
    members = [member_proc(etcd_session.endpoint_arg, job_name, f"m{i}", ttl=2.0) for i in range(3)]
    watcher = None
    try:
        url = coord.wait_line(r"metrics (http://\S+)", 30).group(1)
        for m in members:
            m.wait_line(r"^READY", 30)
        watcher = EpochWatcher(store, job_name)     # the rank side's watcher, in this process
        seen: list = []
        watcher.subscribe(seen.append)
        first = watcher.wait_for(lambda e: len(e.members) == 3, 20)
        before = records.bad_counts()["epoch"]
        store.put(keys.epoch(job_name), CORRUPT[corrupt])
        repaired = watcher.wait_for(lambda e: e.number > first.number, 20)
        assert repaired.number == first.number + 1 and repaired.cause == "repaired"
        assert set(repaired.members) == set(first.members)
        assert records.bad_counts()["epoch"] > before          # the watcher skipped it, logged and counted
        status, body = get(url + "/healthz")
        assert status == 200 and "malformed epoch record" in body, body
        assert bad_records(url, "epoch") >= 1
        assert coord.popen.poll() is None
        if then is not None:
            members[1].signal(then)
            after = watcher.wait_for(lambda e: "m1" not in e.members, 20)
            assert after.number == repaired.number + 1 and after.removed == ("m1",)
            assert after.cause == "lease_expired"
        assert [e.number for e in seen] == list(range(first.number, seen[-1].number + 1))
    finally:
        if watcher is not None:
            watcher.close()
        for m in members:
            m.stop()
        assert coord.stop() == 0, "\n".join(coord.err[-30:])


@pytest.mark.parametrize("history", ["gone", "corrupt"])
def test_corrupt_epoch_and_history_still_yields_a_higher_number(etcd_session, store, job_name, history):
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05)
    sessions = [MemberSession.register(store, job_name, MemberInfo(member_id="m0"), ttl=5.0)]
    watcher = EpochWatcher(store, job_name)
    try:
        first = watcher.wait_for(lambda e: e.members == ("m0",), 15)
        if history == "gone":
            store.delete_prefix(keys.root(job_name) + "epochs/")
        else:
            store.put(keys.epoch_record(job_name, first.number), b'{"number": "x"}')
        rev = store.put(keys.epoch(job_name), b"\xff\xfe")
        repaired = watcher.wait_for(lambda e: e.number > first.number, 15)
        assert repaired.cause == "repaired"
        if history == "gone":   # the revision floor
            assert repaired.number >= rev > first.number
        else:                   # the history key's number still counts
            assert repaired.number == first.number + 1
        wait_until(lambda: f"published epoch {repaired.number} over a malformed epoch record"
                   in coord.coordinator.healthy()[1], 10, "the coordinator's health to name the repair")
        assert coord.coordinator.healthy()[0]
    finally:
        watcher.close()
        coord.close()
        for s in sessions:
            s.close()


def test_member_record_with_1e400_is_skipped_and_counted(etcd_session, store, job_name):
    coord = coordinator_proc(etcd_session.endpoint_arg, job_name, "c1", 2.0)
    store.put(keys.member(job_name, "bad"), b'{"member_id": "bad", "pid": 1e400}')
    store.put(keys.members(job_name) + "deep", b"[" * 50000 + b"]" * 50000)
    member = member_proc(etcd_session.endpoint_arg, job_name, "m0", ttl=2.0)
    watcher = EpochWatcher(store, job_name)
    try:
        url = coord.wait_line(r"metrics (http://\S+)", 30).group(1)
        e = watcher.wait_for(lambda e: "m0" in e.members, 20)
        assert e.members == ("m0",)
        wait_until(lambda: bad_records(url, "member") >= 2, 10, "both bad member records counted")
        assert coord.popen.poll() is None and get(url + "/healthz")[0] == 200
        out = resilient_cli("status", "--etcd", etcd_session.endpoint_arg, "--job", job_name, "--json")
        assert out.returncode == 0, out.stderr
        assert [r["id"] for r in json.loads(out.stdout)["members"]] == ["m0"]
    finally:
        watcher.close()
        member.stop()
        assert coord.stop() == 0, "\n".join(coord.err[-30:])


def test_status_names_a_corrupt_epoch_key(etcd_session, store, job_name):
    store.put(keys.epoch(job_name), b'{"number": 1e400, "members": []}')
    args = ("status", "--etcd", etcd_session.endpoint_arg, "--job", job_name)
    out = resilient_cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["epoch"] is None and "'number'" in doc["epoch_error"] and "not an integer" in doc["epoch_error"]
    table = resilient_cli(*args)
    assert table.returncode == 0 and "epoch: CORRUPT: bad epoch record" in table.stdout


@pytest.mark.parametrize("flag,value", [("--rdzv-id", "x/../y"), ("--rdzv-id", "ok\n"), ("--job", "a/b")])
def test_resilient_run_refuses_bad_job_names_before_touching_etcd(etcd_session, store, flag, value):
    before = store.revision()
    out = subprocess.run([RESILIENT_RUN, "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_session.endpoint_arg,
                          flag, value, os.path.join(SCRIPTS, "worker.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{flag} {value!r} is not a valid job id" in out.stderr and "letters, digits" in out.stderr
    assert store.revision() == before        # nothing was written anywhere


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_http_connections_hold_a_bounded_number_of_threads(etcd_session, job_name):
    coord = coordinator_proc(etcd_session.endpoint_arg, job_name, "c1", 2.0)
    conns: list[socket.socket] = []
    try:
        url = coord.wait_line(r"metrics (http://\S+)", 30).group(1)
        host, port = url.split("//")[1].rsplit(":", 1)
        wait_until(lambda: get(url + "/healthz")[1].startswith("ok leader"), 30, "/healthz ok leader")
        baseline = _threads(coord.pid)
        for _ in range(200):
            conns.append(socket.create_connection((host, int(port)), timeout=10))
        peak = baseline
        refused = set()

        def all_answered() -> bool:
            nonlocal peak
            peak = max(peak, _threads(coord.pid))
            return mark_refused(conns, refused) >= 200 - MAX_HTTP_THREADS

        wait_until(all_answered, 20, "the connections beyond the thread bound to be answered 503")
        # gRPC's own pool grows and shrinks by itself (up to ~a dozen threads); unbounded, the
        # 200 connections held 200 more
        assert peak <= baseline + MAX_HTTP_THREADS + 20, (baseline, peak)
        # the idle ones that got a thread are dropped after the request timeout: service resumes
        wait_until(lambda: get(url + "/healthz")[0] == 200, 30, "/healthz 200 with 200 idle connections open")
        assert coord.popen.poll() is None
    finally:
        for c in conns:
            c.close()
        assert coord.stop() == 0


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if width == 8:
                    addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                out.add((addr, int(hexport, 16)))
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def test_every_listener_of_a_standalone_job_is_on_loopback(tmp_path):
    stop = str(tmp_path / "stop")
    run = Launcher(["--standalone", "--nproc-per-node", "1", "--metrics-port", "0",
                    os.path.join(SCRIPTS, "worker.py")], str(tmp_path / "d"), {"STOP_FILE": stop})
    try:
        w0 = run.dump(0)
        agent = run.proc.pid

        def cmdline(pid: int) -> str:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode()

        kids = {p: cmdline(p) for p in _children(agent)}
        etcd = [p for p, c in kids.items() if c.split()[0].endswith("etcd")]
        coordinator = [p for p, c in kids.items() if " coordinator --etcd " in c]
        assert len(etcd) == 1 and len(coordinator) == 1 and int(w0["PID"]) in kids, kids
        pids = {"agent": agent, "etcd": etcd[0], "coordinator": coordinator[0], "worker": int(w0["PID"])}
        # the agent's /metrics and TCPStore, the coordinator's /metrics, etcd's client and peer ports
        wait_until(lambda: len(_listening(agent)) >= 2 and _listening(coordinator[0]) and
                   len(_listening(etcd[0])) >= 2, 30, "every listener to be up")
        listeners = {name: _listening(p) for name, p in pids.items()}
        wide = {(name, a, port) for name, socks in listeners.items() for a, port in socks
                if a not in ("127.0.0.1", "::1")}
        assert not wide, f"listeners beyond loopback: {wide} (all: {listeners})"
        assert w0["MASTER_ADDR"] == "localhost"     # as torchrun; the store listens on 127.0.0.1 only
        open(stop, "w").close()
        assert run.wait(60) == 0
    finally:
        run.close()


def test_a_watcher_started_over_a_corrupt_epoch_key_waits_for_a_valid_one(etcd_session, store, job_name, caplog):
    store.put(keys.epoch(job_name), b'{"number": 5, "members": ["m1\\n"]}')
    with caplog.at_level("ERROR", logger="resilient.coordinator.records"):
        watcher = EpochWatcher(store, job_name)
    try:
        assert watcher.current() is None
        assert any("not a valid id" in r.getMessage() for r in caplog.records)
        store.put(keys.epoch(job_name), b"\x80garbage")           # skipped on the watch too
        good = {"number": 6, "members": ["m1"]}
        store.put(keys.epoch(job_name), json.dumps(good).encode())
        assert watcher.wait_for(lambda e: e.number == 6, 10).members == ("m1",)
    finally:
        watcher.close()
