"""Property-based fuzzing of the frame codec (issue 14): whatever bytes or values go in,
only :class:`~resilient.errors.FrameError` ever comes out of the header, HELLO and JSON
decoders and of the header encoder (never ``struct.error``, ``RecursionError``,
``UnicodeDecodeError``, ``KeyError``...); valid values round-trip."""
from __future__ import annotations

import json
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from resilient.errors import FrameError
from resilient.transport import frames

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
u64 = st.integers(0, frames.U64_MAX)
anyint = st.one_of(st.integers(), st.integers(-(1 << 70), 1 << 70), st.just(1 << 64), st.just(-1))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


def _body(magic: bytes, version: int, kind: int, epoch: int, op_seq: int, tag: int, length: int, digest: int) -> bytes:
    body = struct.pack("<4sBBHQQQQI", magic, version, kind, 0, epoch, op_seq, tag, length, digest)
    return body + struct.pack("<I", zlib.crc32(body))


@FUZZ
@given(st.binary(max_size=120))
def test_decode_header_of_arbitrary_bytes_raises_only_frame_error(raw):
    try:
        h = frames.decode_header(raw)
    except FrameError:
        return
    assert len(raw) == frames.HEADER_SIZE and h.kind in frames.KINDS


@FUZZ
@given(st.sampled_from([frames.MAGIC, b"RSLD", b"\x00" * 4]), st.integers(0, 255), st.integers(0, 255),
       u64, u64, u64, u64, st.integers(0, (1 << 32) - 1))
def test_decode_header_with_a_valid_checksum_checks_every_field(magic, version, kind, epoch, op_seq, tag, length, digest):
    raw = _body(magic, version, kind, epoch, op_seq, tag, length, digest)
    try:
        h = frames.decode_header(raw)
    except FrameError:
        cap = frames.PAYLOAD_CAP.get(kind, frames.MAX_PAYLOAD)
        assert magic != frames.MAGIC or version != frames.VERSION or kind not in frames.KINDS or length > cap
        return
    assert (h.kind, h.epoch, h.op_seq, h.tag, h.length, h.digest) == (kind, epoch, op_seq, tag, length, digest)


@FUZZ
@given(st.integers(0, 255), anyint, anyint, anyint, anyint, anyint)
def test_encode_header_raises_only_frame_error_and_round_trips(kind, epoch, op_seq, tag, length, digest):
    h = frames.Header(kind, epoch, op_seq, tag, length, digest)
    try:
        raw = frames.encode_header(h)
    except FrameError:
        assert kind not in frames.KINDS or any(not 0 <= v <= frames.U64_MAX for v in (epoch, op_seq, tag, length))
        return
    try:
        back = frames.decode_header(raw)
    except FrameError:
        assert length > frames.MAX_CONTROL_PAYLOAD  # a control frame over its cap is refused on decode
        return
    assert back == frames.Header(kind, epoch, op_seq, tag, length, digest & 0xFFFFFFFF)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["job", "epoch", "token", "member", "session", "x"]), json_values,
                                 max_size=6).map(lambda d: json.dumps(d).encode())))
def test_decode_hello_raises_only_frame_error(payload):
    try:
        h = frames.decode_hello(payload)
    except FrameError:
        return
    assert isinstance(h.member, str) and h.member and 0 <= h.epoch <= frames.U64_MAX


@FUZZ
@given(st.text(max_size=40), u64, st.text(max_size=40), st.text(min_size=1, max_size=40), st.text(max_size=40))
def test_hello_round_trips(job, epoch, token, member, session):
    raw = frames.encode_hello(frames.Hello(job, epoch, token, member, session))
    h = frames.decode_header(raw[:frames.HEADER_SIZE])
    assert h.kind == frames.HELLO and h.length == len(raw) - frames.HEADER_SIZE
    assert frames.decode_hello(raw[frames.HEADER_SIZE:]) == frames.Hello(job, epoch, token, member, session)


@pytest.mark.parametrize("payload", [
    b"[" * 100_000 + b"]" * 100_000,            # nesting too deep for the parser
    b'{"epoch": ' + b"9" * 5000 + b"}",          # an integer too long to convert
    b"\xff\xfe",                                 # not UTF-8
    b'{"job": "j", "epoch": 18446744073709551616, "token": "t", "member": "a"}',  # epoch 2**64
    b'{"job": "j", "epoch": true, "token": "t", "member": "a"}',
    b'{"job": "j", "epoch": 1, "token": "t", "member": ""}',
    b'{"job": "j", "epoch": 1, "token": "t", "member": "' + b"a" * 600 + b'"}',
])
def test_hostile_hello_payloads_are_frame_errors(payload):
    with pytest.raises(FrameError):
        frames.decode_hello(payload)


def test_epoch_beyond_u64_is_a_frame_error_not_struct_error():
    with pytest.raises(FrameError, match="64-bit"):
        frames.encode_header(frames.Header(frames.DATA, 1 << 64, 0, 0, 0))
    with pytest.raises(FrameError, match="64-bit"):
        frames.encode_hello(frames.Hello("j", 1 << 64, "t", "a"))
