"""Frame codec: a fixed little-endian struct header in front of raw payload bytes.

Header (48 bytes)::

    magic    4s   b"RSLC"
    version  u8   1
    kind     u8   HELLO | DATA | ERROR
    flags    u16  reserved, 0
    epoch    u64  epoch the sender was in when it posted the message
    op_seq   u64  the op's sequence number within the communicator
    tag      u64  the algorithm's (step, slice) tag
    length   u64  payload length in bytes
    digest   u32  digest of the op descriptor (kind, shape, dtype, reduce op)
    crc      u32  zlib.crc32 of the 44 bytes above

The payload is raw bytes (DATA), or UTF-8 JSON (HELLO, ERROR). Nothing is ever
unpickled. :func:`decode_header` raises :class:`~resilient.errors.FrameError` on a bad
magic, version, kind, checksum or an absurd length, so a corrupt stream is refused at
the first bad header instead of being written into a user buffer.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from resilient.errors import FrameError

MAGIC = b"RSLC"
VERSION = 1
HELLO, DATA, ERROR = 1, 2, 3
KINDS = {HELLO: "HELLO", DATA: "DATA", ERROR: "ERROR"}

_BODY = struct.Struct("<4sBBHQQQQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size  # 48
MAX_CONTROL_PAYLOAD = 1 << 20  # HELLO / ERROR payloads are small JSON
MAX_PAYLOAD = 1 << 48


@dataclass(frozen=True)
class Header:
    kind: int
    epoch: int
    op_seq: int
    tag: int
    length: int
    digest: int = 0


def encode_header(h: Header) -> bytes:
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
    if length > (MAX_CONTROL_PAYLOAD if kind != DATA else MAX_PAYLOAD):
        raise FrameError(f"{KINDS[kind]} frame announces an absurd payload length {length}")
    return Header(kind, epoch, op_seq, tag, length, digest)


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode_json(payload: bytes | bytearray, what: str) -> dict:
    try:
        obj = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"{what} payload is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"{what} payload must be a JSON object")
    return obj
