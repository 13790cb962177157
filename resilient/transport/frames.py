"""Frame codec: a fixed little-endian struct header in front of raw payload bytes.

Header (48 bytes)::

    magic    4s   b"RSLC"
    version  u8   1
    kind     u8   HELLO | DATA | ERROR | PROBE | JOIN
    flags    u16  reserved, 0
    epoch    u64  epoch the sender was in when it posted the message
    op_seq   u64  the op's sequence number within the communicator
    tag      u64  the algorithm's (step, slice) tag
    length   u64  payload length in bytes
    digest   u32  digest of the op descriptor (kind, shape, dtype, reduce op)
    crc      u32  zlib.crc32 of the 44 bytes above

The payload is raw bytes (DATA, ERROR) or UTF-8 JSON (HELLO); a PROBE has none: it asks
a peer which op it is in (``tag`` :data:`PROBE_QUERY`, carrying the asker's op and
descriptor digest in ``op_seq`` / ``digest``) or answers that (``tag``
:data:`PROBE_ANSWER`), see :func:`check_probe`; a JOIN has none either: it carries one
member's subtree maximum of a join agreement (``epoch``: the growing epoch, ``op_seq``:
the seq; :mod:`resilient.collectives.join_agreement`), see :func:`check_join`. Nothing is
ever unpickled.

Failure behaviour: every function here raises :class:`~resilient.errors.FrameError` and
nothing else on bad input — :func:`decode_header` on a bad size, magic, version, kind,
checksum or a payload length over the kind's cap (:data:`PAYLOAD_CAP`), :func:`check_probe`
on a PROBE frame that is not one of the two documented forms, :func:`check_join` on a
JOIN frame that is not the documented form, :func:`decode_hello` / :func:`decode_json` on a
payload that is not the documented JSON object, and :func:`encode_header` on a field that
does not fit its u64/u32 slot (e.g. an epoch number >= 2**64 from a corrupt epoch record),
so a corrupt stream is refused at the first bad header instead of being written into a
user buffer, and a bad local value never surfaces as a ``struct.error``.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from resilient.errors import FrameError
from resilient.transport.tags import OP_NAMESPACE, SEQ_MASK, namespace_of

MAGIC = b"RSLC"
VERSION = 1
HELLO, DATA, ERROR, PROBE, JOIN = 1, 2, 3, 4, 5
KINDS = {HELLO: "HELLO", DATA: "DATA", ERROR: "ERROR", PROBE: "PROBE", JOIN: "JOIN"}
#: the two PROBE forms (its ``tag`` field)
PROBE_QUERY, PROBE_ANSWER = 0, 1

_BODY = struct.Struct("<4sBBHQQQQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size  # 48
MAX_CONTROL_PAYLOAD = 1 << 20  # ERROR payloads: a short message
#: a HELLO is ~200 bytes of JSON; anything bigger before the handshake is refused
MAX_HELLO_PAYLOAD = 4096
MAX_PAYLOAD = 1 << 48
#: the largest payload a header of each kind may announce (DATA: :data:`MAX_PAYLOAD`); a
#: PROBE carries none, but one that announces a short payload is refused by
#: :func:`check_probe` after its header, so the stream stays in step and the link lives
PAYLOAD_CAP = {HELLO: MAX_HELLO_PAYLOAD, ERROR: MAX_CONTROL_PAYLOAD, PROBE: MAX_CONTROL_PAYLOAD,
               JOIN: MAX_CONTROL_PAYLOAD}
U64_MAX = (1 << 64) - 1
#: longest job name / member id / token / session a HELLO may carry
MAX_HELLO_FIELD = 512


@dataclass(frozen=True)
class Header:
    kind: int
    epoch: int
    op_seq: int
    tag: int
    length: int
    digest: int = 0


def check_u64(what: str, value: object) -> int:
    """``value`` if it is an int that fits a u64 header field; else :class:`FrameError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise FrameError(f"{what} {value!r} does not fit the frame header's unsigned 64-bit field "
                         f"(0..2**64-1): the value is corrupt (e.g. a bad epoch record); fix its source")
    return value


def encode_header(h: Header) -> bytes:
    """The 48 header bytes of ``h``; :class:`FrameError` if a field is out of range."""
    if h.kind not in KINDS:
        raise FrameError(f"unknown frame kind {h.kind!r}")
    for what in ("epoch", "op_seq", "tag", "length"):
        check_u64(f"frame {what}", getattr(h, what))
    if isinstance(h.digest, bool) or not isinstance(h.digest, int):
        raise FrameError(f"frame digest must be an int, got {h.digest!r}")
    body = _BODY.pack(MAGIC, VERSION, h.kind, 0, h.epoch, h.op_seq, h.tag, h.length, h.digest & 0xFFFFFFFF)
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse and validate a 48-byte header; :class:`FrameError` names what is wrong."""
    if len(raw) != HEADER_SIZE:
        raise FrameError(f"frame header must be {HEADER_SIZE} bytes, got {len(raw)}")
    body = bytes(raw[: _BODY.size])
    (crc,) = _CRC.unpack_from(raw, _BODY.size)
    magic, version, kind, _flags, epoch, op_seq, tag, length, digest = _BODY.unpack(body)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r}): the peer is not a resilient transport or the stream is out of sync")
    if zlib.crc32(body) != crc:
        raise FrameError("frame header checksum mismatch: the stream is corrupt")
    if version != VERSION:
        raise FrameError(f"frame version {version} is not supported (this side speaks {VERSION}); upgrade both sides")
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    cap = PAYLOAD_CAP.get(kind, MAX_PAYLOAD)
    if length > cap:
        raise FrameError(f"{KINDS[kind]} frame announces a payload of {length} bytes (limit {cap})")
    return Header(kind, epoch, op_seq, tag, length, digest)


@dataclass(frozen=True)
class Probe:
    """A PROBE frame: ``answer`` False asks the peer which op it is in and says ours
    (``op_seq``, descriptor ``digest``); True is the peer's answer (its op and digest)."""

    op_seq: int
    digest: int
    answer: bool


def encode_probe(epoch: int, p: Probe) -> bytes:
    """The whole PROBE frame of ``p`` (a header, no payload); :class:`FrameError` for a
    field out of range."""
    return encode_header(Header(PROBE, epoch, p.op_seq, PROBE_ANSWER if p.answer else PROBE_QUERY, 0, p.digest))


def check_probe(h: Header, peer: str) -> Probe:
    """The probe a PROBE header ``h`` from member ``peer`` carries. :class:`FrameError`
    naming ``peer`` and the field when it is not one of the two documented forms: a
    payload (a probe has none), a ``tag`` other than :data:`PROBE_QUERY` /
    :data:`PROBE_ANSWER`, or an ``op_seq`` outside the collective ops' namespace
    (:mod:`~resilient.transport.tags`)."""
    what = f"member {peer} sent a bad PROBE frame"
    if h.kind != PROBE:
        raise FrameError(f"{what}: kind {KINDS.get(h.kind, h.kind)} is not PROBE")
    if h.length:
        raise FrameError(f"{what}: it announces {h.length} payload bytes, a probe has none "
                         "(the peer runs an incompatible transport; upgrade both sides)")
    if h.tag not in (PROBE_QUERY, PROBE_ANSWER):
        raise FrameError(f"{what}: tag {h.tag} is neither a query ({PROBE_QUERY}) nor an answer ({PROBE_ANSWER})")
    if namespace_of(h.op_seq) != OP_NAMESPACE:
        raise FrameError(f"{what}: op #{h.op_seq:#x} is not a collective op (probes ask about collectives only)")
    return Probe(h.op_seq, h.digest, h.tag == PROBE_ANSWER)


def encode_join(epoch: int, seq: int) -> bytes:
    """The whole JOIN frame carrying ``seq`` for the agreement of epoch ``epoch`` (a
    header, no payload); :class:`FrameError` for a field out of range."""
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MASK:
        raise FrameError(f"join seq {seq!r} is not an op sequence number in [0, {SEQ_MASK}]")
    return encode_header(Header(JOIN, epoch, seq, 0, 0))


def check_join(h: Header, peer: str) -> tuple[int, int]:
    """``(epoch, seq)`` of a JOIN header ``h`` from member ``peer``. :class:`FrameError`
    naming ``peer`` and the field when it is not the documented form: a payload (a JOIN
    has none), a non-zero ``tag`` or ``digest``, or a seq outside the collective ops' 40
    bits."""
    what = f"member {peer} sent a bad JOIN frame"
    if h.kind != JOIN:
        raise FrameError(f"{what}: kind {KINDS.get(h.kind, h.kind)} is not JOIN")
    if h.length or h.tag or h.digest:
        raise FrameError(f"{what}: a join frame has no payload, tag or digest (got {h.length} bytes, tag {h.tag}, "
                         f"digest {h.digest}); the peer runs an incompatible transport, upgrade both sides")
    if h.op_seq > SEQ_MASK:
        raise FrameError(f"{what}: seq {h.op_seq:#x} is not an op sequence number of the collectives")
    return h.epoch, h.op_seq


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode_json(payload: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    """A JSON object from UTF-8 bytes; :class:`FrameError` for anything else (bad UTF-8,
    bad JSON, nesting too deep to parse, an integer too long to convert, a non-object)."""
    try:
        obj = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise FrameError(f"{what} payload is not valid UTF-8 JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"{what} payload must be a JSON object")
    return obj


@dataclass(frozen=True)
class Hello:
    """The dialler's first frame: who it claims to be and for which epoch. ``session`` is
    a random id of the dialling transport (one per process), sent only on the wire: a
    second HELLO for a member whose link is live is accepted only from the same session."""

    job: str
    epoch: int
    token: str
    member: str
    session: str = ""


def encode_hello(h: Hello) -> bytes:
    """A whole HELLO frame (header + JSON payload)."""
    payload = encode_json({"job": h.job, "epoch": h.epoch, "token": h.token, "member": h.member,
                           "session": h.session})
    if len(payload) > MAX_HELLO_PAYLOAD:
        raise FrameError(f"HELLO payload of {len(payload)} bytes exceeds {MAX_HELLO_PAYLOAD}: job name, "
                         f"member id or token too long (each at most {MAX_HELLO_FIELD} characters)")
    return encode_header(Header(HELLO, check_u64("epoch", h.epoch), 0, 0, len(payload))) + payload


def decode_hello(payload: bytes | bytearray | memoryview) -> Hello:
    """Parse and type-check a HELLO payload; :class:`FrameError` names the bad field."""
    if len(payload) > MAX_HELLO_PAYLOAD:
        raise FrameError(f"HELLO payload of {len(payload)} bytes exceeds {MAX_HELLO_PAYLOAD}")
    obj = decode_json(payload, "HELLO")
    fields: dict[str, Any] = {}
    for name in ("job", "token", "member", "session"):
        v = obj.get(name, "" if name == "session" else None)
        if not isinstance(v, str) or len(v) > MAX_HELLO_FIELD:
            raise FrameError(f"HELLO field {name!r} must be a string of at most {MAX_HELLO_FIELD} characters")
        fields[name] = v
    if not fields["member"]:
        raise FrameError("HELLO field 'member' is empty")
    epoch = obj.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= U64_MAX:
        raise FrameError(f"HELLO field 'epoch' must be an integer in 0..2**64-1, got {str(epoch)[:40]!r}")
    return Hello(epoch=epoch, **fields)
