"""The local channel between a node agent and its ranks: frames and messages (docs/scale.md).

One unix stream socket in the agent's run directory (``RESILIENT_AGENT_SOCKET``). Each
frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON: one object with a
``"t"`` (type) field. Never pickle. Messages:

rank -> agent (at most :data:`MAX_RANK_FRAME` bytes):

* ``hello {member: MemberRecord}`` — register this rank (the agent writes its
  ``nodes/<node>`` record and answers ``registered``);
* ``beat {}`` — liveness, every ttl/3 (a SIGSTOPped rank stops beating: the agent
  removes it after the TTL);
* ``health {record: HealthRecord}`` — one health window for the node's aggregator;
* ``leave {reason}`` — remove this rank now (answered by ``left``).

agent -> rank (at most :data:`MAX_AGENT_FRAME` bytes):

* ``registered {lease, ttl, node}``; ``refused {message}``;
* ``epoch {record, revision}`` — the ``epoch`` key's value exactly as etcd holds it (a
  full or a delta record), parsed by the rank as any etcd record;
* ``removed {reason}`` — the agent removed this rank (hung, or its node record lost it);
* ``left {}``.

:func:`decode` validates a frame's payload and returns a typed message.

Failure behaviour: a malformed payload raises :class:`~resilient.errors.RecordError`
(kind ``node``, key ``agent channel``) naming the field and the rule — the reader drops
that message and keeps the connection (the peer is ours, so a bad message is a bug to
report, not an attack to survive). A frame header announcing more than the limit, or a
connection closed mid-frame, raises :class:`ChannelClosed`: the stream can no longer be
framed and the connection is closed.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Union

from resilient.coordinator import records
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.straggler import HealthRecord
from resilient.errors import RecordError, ResilientError

#: rank -> agent frames: a health window or a member record (the etcd record limit)
MAX_RANK_FRAME = records.MAX_RECORD_BYTES
#: agent -> rank frames: an epoch record (etcd's 1.5 MiB request limit) JSON-escaped
MAX_AGENT_FRAME = 4 << 20
#: env var naming the agent's socket in a worker's environment
SOCKET_ENV = "RESILIENT_AGENT_SOCKET"
_HEADER = struct.Struct(">I")
log = logging.getLogger(__name__)
KIND, KEY = "node", "agent channel"


class ChannelClosed(ResilientError):
    """The agent channel ended (peer gone, or a frame that cannot be read)."""


@dataclass(frozen=True)
class Hello:
    member: MemberInfo


@dataclass(frozen=True)
class Beat:
    pass


@dataclass(frozen=True)
class Health:
    #: one health window, validated as a ``health/<member>`` record
    record: HealthRecord


@dataclass(frozen=True)
class Leave:
    reason: str


@dataclass(frozen=True)
class Registered:
    lease: int
    ttl: float
    node: str


@dataclass(frozen=True)
class Refused:
    message: str


@dataclass(frozen=True)
class EpochRecord:
    #: the ``epoch`` key's value as etcd holds it
    record: bytes
    revision: int


@dataclass(frozen=True)
class Removed:
    reason: str


@dataclass(frozen=True)
class Left:
    pass


Message = Union[Hello, Beat, Health, Leave, Registered, Refused, EpochRecord, Removed, Left]


def encode(msg: Message) -> bytes:
    """One frame (header + JSON) for ``msg``."""
    body: dict[str, object]
    if isinstance(msg, Hello):
        body = {"t": "hello", "member": dict(msg.member.to_dict())}
    elif isinstance(msg, Beat):
        body = {"t": "beat"}
    elif isinstance(msg, Health):
        body = {"t": "health", "record": dict(msg.record)}
    elif isinstance(msg, Leave):
        body = {"t": "leave", "reason": msg.reason}
    elif isinstance(msg, Registered):
        body = {"t": "registered", "lease": msg.lease, "ttl": msg.ttl, "node": msg.node}
    elif isinstance(msg, Refused):
        body = {"t": "refused", "message": msg.message}
    elif isinstance(msg, EpochRecord):
        body = {"t": "epoch", "record": msg.record.decode("utf-8"), "revision": msg.revision}
    elif isinstance(msg, Removed):
        body = {"t": "removed", "reason": msg.reason}
    else:
        body = {"t": "left"}
    payload = json.dumps(body, separators=(",", ":")).encode()
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes, limit: int) -> Message:
    """Validate one frame's payload; :class:`RecordError` naming the cause if malformed."""
    if len(payload) > limit:
        raise RecordError(f"bad agent message: {len(payload)} bytes, more than the {limit} accepted", KIND, KEY)
    try:
        value: object = json.loads(payload.decode("utf-8"), parse_constant=_reject)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"bad agent message: not UTF-8 JSON ({exc}); both ends must run the same "
                          "resilient release", KIND, KEY) from None
    f = records.Fields(KIND, value, KEY)
    t = f.str("t", max_len=16)
    if t == "hello":
        return Hello(MemberInfo.from_dict(f.obj("member"), KEY))
    if t == "beat":
        return Beat()
    if t == "health":
        from resilient.coordinator.health import parse_health

        return Health(parse_health(json.dumps(f.obj("record").d).encode(), KEY))
    if t == "leave":
        return Leave(f.str("reason", "left", max_len=200))
    if t == "registered":
        return Registered(f.int("lease"), f.float("ttl", lo=0.001, hi=86400.0), f.name("node"))
    if t == "refused":
        return Refused(f.str("message"))
    if t == "epoch":
        rec = f.d.get("record")
        if not isinstance(rec, str) or len(rec) > MAX_AGENT_FRAME:
            f.fail("field 'record' must be the epoch record as a string")
        return EpochRecord(rec.encode("utf-8", "surrogatepass"), f.int("revision", 0))
    if t == "removed":
        return Removed(f.str("reason", "removed", max_len=200))
    if t == "left":
        return Left()
    f.fail(f"unknown message type {t!r} (expected hello, beat, health, leave, registered, refused, "
           "epoch, removed or left); both ends must run the same resilient release")


def _reject(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def send(sock: socket.socket, msg: Message) -> None:
    """Write one frame; :class:`ChannelClosed` if the peer is gone."""
    try:
        sock.sendall(encode(msg))
    except OSError as exc:
        raise ChannelClosed(f"agent channel closed while sending: {exc}") from exc


def receive(sock: socket.socket, limit: int, sender: Callable[[], str]) -> Iterator[Message]:
    """The messages arriving on ``sock``, until :class:`ChannelClosed` is raised; a
    malformed one is logged as an error (naming ``sender()``) and skipped."""
    while True:
        payload = read_frame(sock, limit)
        try:
            msg = decode(payload, limit)
        except RecordError as exc:
            log.error("agent channel: dropped a message from %s: %s", sender(), exc)
            continue
        yield msg


def read_frame(sock: socket.socket, limit: int) -> bytes:
    """The next frame's payload; :class:`ChannelClosed` at EOF, on an error or when the
    header announces more than ``limit`` bytes (the stream cannot be re-framed)."""
    (n,) = _HEADER.unpack(_read_exact(sock, _HEADER.size))
    if n > limit:
        raise ChannelClosed(f"agent channel: a frame of {n} bytes announced, more than the {limit} accepted; "
                            "closing the connection (both ends must run the same resilient release)")
    return _read_exact(sock, n)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except OSError as exc:
            raise ChannelClosed(f"agent channel closed: {exc}") from exc
        if not chunk:
            raise ChannelClosed("agent channel closed by the peer" + (" mid-frame" if buf else ""))
        buf += chunk
    return bytes(buf)
