"""The node agent's local channel: the wire format's validation (unit), and the agent's
side (NodeChannel) with a rank's side (join_via_agent) over a real unix socket and a real
etcd — registration into one node record, the epoch relay, a refused hello, health
windows into one summary, and the rank's fallback to its own watch when the agent goes."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import tempfile

import pytest

from launcher_util import wait_for
from resilient.agent_channel import join_via_agent
from resilient.coordinator import Store, keys
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.epoch import Epoch
from resilient.coordinator.health import make_record
from resilient.coordinator.node_health import SummaryPolicy
from resilient.coordinator.membership import MemberInfo
from resilient.errors import ConfigError, RecordError
from resilient.launcher import channel_wire as wire
from resilient.launcher.agent import SOCKET_NAME, UNIX_PATH_MAX, agent_run_dir
from resilient.launcher.node_channel import NodeChannel
from resilient.launcher.node_members import NodeMembers


def _roundtrip(msg: wire.Message) -> wire.Message:
    frame = wire.encode(msg)
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    return wire.decode(frame[4:], wire.MAX_AGENT_FRAME)


def test_every_message_roundtrips():
    info = MemberInfo("r0", host="h", address="127.0.0.1:1", labels={"rack": "a"}, pid=7)
    rec = make_record("r0", 3, 1, 5, 1.0, {"r1": 0.25}, [0.1, 0.2])
    for msg in (wire.Hello(info), wire.Beat(), wire.Health(rec), wire.Leave("done"),
                wire.Registered(12, 2.0, "n0-x"), wire.Refused("no"), wire.EpochRecord(b'{"number":1}', 9),
                wire.Removed("hung"), wire.Left()):
        assert _roundtrip(msg) == msg


@pytest.mark.parametrize("payload, cause", [
    (b"\xff\xfe", "not UTF-8 JSON"),
    (b"{", "not UTF-8 JSON"),
    (b'{"t": NaN}', "not UTF-8 JSON"),
    (b"[1]", "not a JSON object"),
    (b'{"t": "dance"}', "unknown message type 'dance'"),
    (b'{"t": "hello"}', "'member' is missing"),
    (b'{"t": "hello", "member": {"member_id": "a/../b"}}', "member_id"),
    (b'{"t": "hello", "member": {"member_id": "r0", "pid": -1}}', "pid"),
    (b'{"t": "health", "record": {"member": "r0", "ops": "many"}}', "ops"),
    (b'{"t": "registered", "lease": 1, "ttl": 0, "node": "n"}', "ttl"),
    (b'{"t": "registered", "lease": true, "ttl": 1, "node": "n"}', "lease"),
    (b'{"t": "epoch", "record": 5}', "'record' must be the epoch record"),
    (b'{"t": "epoch", "record": "{}", "revision": 1.5}', "revision"),
])
def test_malformed_messages_are_rejected_naming_the_cause(payload, cause):
    with pytest.raises(RecordError, match="bad") as err:
        wire.decode(payload, wire.MAX_RANK_FRAME)
    assert cause in str(err.value) and err.value.key == "agent channel"   # kind: node, member or health


def test_oversized_payload_and_frame_header():
    with pytest.raises(RecordError, match="more than the 10 accepted"):
        wire.decode(b'{"t": "beat", "x": 1}', 10)
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack(">I", wire.MAX_RANK_FRAME + 1))
        with pytest.raises(wire.ChannelClosed, match="more than"):
            wire.read_frame(b, wire.MAX_RANK_FRAME)
        a.sendall(struct.pack(">I", 10) + b"abc")
        a.close()
        with pytest.raises(wire.ChannelClosed, match="mid-frame"):
            wire.read_frame(b, wire.MAX_RANK_FRAME)
    finally:
        b.close()


def test_node_record_keeps_per_rank_host_and_labels_compactly():
    infos = (MemberInfo("r0", host="h", labels={"rack": "a", "gpu": "u0"}),
             MemberInfo("r1", host="v1", labels={"rack": "a", "gpu": "u1"}))
    rec = NodeRecord("n0", "h", {"rack": "a"}, infos, 2.0)
    raw = json.loads(rec.to_json())
    assert "host" not in raw["ranks"][0] and raw["ranks"][1]["host"] == "v1"
    assert raw["ranks"][0]["labels"] == {"gpu": "u0"}       # the node's labels are written once
    back = NodeRecord.from_json(rec.to_json(), "/resilient/j/nodes/n0")
    assert [(r.host, r.labels) for r in back.ranks] == [(i.host, i.labels) for i in infos]


def _epoch(number: int, members: list[str]) -> bytes:
    return Epoch(number, tuple(members), {m: MemberInfo(m, address="127.0.0.1:1") for m in members}).to_json()


def test_channel_registers_relays_refuses_aggregates_and_rank_falls_back(etcd_session, job_name, tmp_path):
    store = Store(etcd_session.endpoints)
    lease = store.grant(30)
    members = NodeMembers(store, job_name, "n0", "h", lease, 30)
    store.put(keys.epoch(job_name), _epoch(1, ["r0"]))      # before the channel: relayed once, at registration
    chan = NodeChannel(str(tmp_path / "agent.sock"), store, job_name, members, lambda m: m in ("r0", "r1"),
                       SummaryPolicy(min_gap=0.01))
    session = None
    try:
        session, watcher = join_via_agent(store, job_name, MemberInfo("r0", address="127.0.0.1:5"), chan.path, 10)
        assert session.lease_id == lease and session.node == "n0"
        node = NodeRecord.from_json(store.get(keys.node(job_name, "n0")).value, keys.node(job_name, "n0"))
        assert [(r.member_id, r.address) for r in node.ranks] == [("r0", "127.0.0.1:5")]
        assert store.get(keys.node(job_name, "n0")).lease == lease
        wait_for(lambda: watcher.current() is not None, 30, "the current epoch relayed on registration")
        store.put(keys.epoch(job_name), b'{"number": "two"}')              # malformed: skipped by the rank
        store.put(keys.epoch(job_name), _epoch(2, ["r0", "r1"]))
        wait_for(lambda: watcher.current().number == 2, 30, "epoch 2 through the relay")
        assert watcher.watches_opened == 0 and session.epochs_relayed == 3

        with pytest.raises(ConfigError, match="not one this agent gave"):
            join_via_agent(store, job_name, MemberInfo("intruder"), chan.path, 10)

        session.send_health(make_record("r0", 2, 1, 4, 1.0, {}, [0.1]))
        summary = wait_for(lambda: store.get(keys.health_of(job_name, "n0")), 30, "the node's health summary")
        assert set(json.loads(summary.value)["ranks"]) == {"r0"}

        chan.close()                                                      # the agent goes away
        wait_for(lambda: watcher.watches_opened == 1, 30, "the rank's fallback to its own watch")
        # the channel's reader opens the watch, then marks the session lost (agent_channel._agent_gone)
        wait_for(session.lost.is_set, 30, "the session marked lost (nobody vouches for the rank)")
        store.put(keys.epoch(job_name), _epoch(3, ["r1"]))
        wait_for(lambda: watcher.current().number == 3, 30, "epoch 3 through the rank's own watch")
    finally:
        if session is not None:
            session.close()
        chan.close()
        store.revoke(lease)
        store.close()


def test_leave_removes_only_that_rank_and_marks_it_departed(etcd_session, job_name, tmp_path):
    store = Store(etcd_session.endpoints)
    lease = store.grant(30)
    members = NodeMembers(store, job_name, "n0", "h", lease, 30)
    members.add(MemberInfo("r1", address="127.0.0.1:6"))
    chan = NodeChannel(str(tmp_path / "agent.sock"), store, job_name, members, lambda m: m == "r0")
    try:
        session, watcher = join_via_agent(store, job_name, MemberInfo("r0"), chan.path, 10)
        session.close(revoke=True, reason="finished")
        watcher.close()
        kv = store.get(keys.node(job_name, "n0"))
        assert [r.member_id for r in NodeRecord.from_json(kv.value).ranks] == ["r1"]
        assert b"finished" in store.get(keys.departed_of(job_name, "r0")).value
        assert store.get(keys.departed_of(job_name, "r1")) is None
    finally:
        chan.close()
        store.revoke(lease)
        store.close()


@pytest.mark.parametrize("deep", [False, True])
def test_agent_run_dir_is_private_and_short_enough_for_its_socket(tmp_path, deep):
    """Under the given directory when the socket path fits, under /tmp when it would pass
    the unix limit; mode 0700 either way, and the socket binds there (a real bind). The
    shallow case uses a short directory of its own under /tmp: pytest's ``tmp_path`` may
    itself be too deep (CI's ``/tmp/pytest-of-root/pytest-106/popen-gw0/<test>`` is)."""
    base = str(tmp_path / ("d" * 100)) if deep else tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    run_dir = agent_run_dir(base)
    try:
        assert os.path.dirname(run_dir) == ("/tmp" if deep else base)
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        path = os.path.join(run_dir, SOCKET_NAME)
        assert len(os.fsencode(path)) <= UNIX_PATH_MAX
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(path)
    finally:
        shutil.rmtree(run_dir)
        if not deep:
            shutil.rmtree(base)
