"""Property-based fuzzing of every parser of an etcd record (and of the state codec):
whatever bytes are stored, only the documented error escapes — RecordError for records,
FrameError for the codec — and what does parse obeys the documented ranges. Pure logic."""
from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.coordinator import keys, records
from resilient.coordinator.epoch import Epoch, parse_epoch_number
from resilient.coordinator.eviction import Eviction, parse_readmit
from resilient.coordinator.health import make_record, parse_health, parse_scores
from resilient.coordinator.membership import MemberInfo
from resilient.errors import ConfigError, FrameError, RecordError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HUGE = st.sampled_from([2 ** 63, 2 ** 64, -1, -(2 ** 70), 10 ** 400, 1e308, 2 ** 63 - 1])
SCALARS = (st.none() | st.booleans() | st.integers() | HUGE | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20))
JSONISH = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=20)


def _dumps(value) -> bytes:
    """JSON text as a careless or hostile writer would produce it (NaN, Infinity, 1e400)."""
    text = json.dumps(value, allow_nan=True)
    return text.replace("1e+308", "1e400").encode()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


RAW = (st.binary(max_size=64) | JSONISH.map(_dumps)
       | st.integers(min_value=1, max_value=3000).map(_nested)
       | st.sampled_from([b"1e400", b'{"number": 1e400}', b"NaN", b'{"a": Infinity}', b"\xff\xfe", b"",
                          b"9" * 5000, b'{"' + b"a" * 100 + b'": 1}']))


def _valid_member(mid: str = "m1") -> dict:
    return MemberInfo(mid, host="h", address="127.0.0.1:1", labels={"rack": "r1"}, pid=42, ttl=2.0).to_dict()


def _valid_epoch() -> dict:
    infos = {m: MemberInfo(m, host="h", pid=1) for m in ("m0", "m1")}
    e = Epoch(number=3, members=("m0", "m1"), infos=infos, roles={"m0": "active", "m1": "demoted"},
              plan={"tree_parent": [-1, 0], "host_groups": [[0, 2]], "demoted": ["m1"], "avoid": [["m0", "m1"]],
                    "leaf_deadline_ms": 10.0,
                    "evicted": {"m2": {"at": 1.0, "until": 2.0, "hold_s": 1.0, "count": 1, "after_epoch": 2}}},
              token="ab", cause="joined", trigger_at=1.0, published_at=2.0, leader="c1", added=("m1",))
    return json.loads(e.to_json())


def _mutate(base: dict, path: list, value) -> bytes:
    """``base`` with the field at ``path`` (a chain of keys/indices) replaced by ``value``."""
    d = json.loads(json.dumps(base))
    node = d
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return _dumps(d)


def _paths(d, prefix=()):
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        out.append(list(prefix) + [k])
        out += _paths(v, list(prefix) + [k])
    return out


MEMBER_PATHS = _paths(_valid_member())
EPOCH_PATHS = _paths(_valid_epoch())


def _only_record_error(parse, raw: bytes):
    try:
        return parse(raw)
    except RecordError as exc:
        assert exc.kind in records.KINDS and str(exc).startswith("bad ")
        return None


def _check_member(info: MemberInfo) -> None:
    assert keys.check_name("member id", info.member_id) == info.member_id
    assert 0 <= info.pid < 2 ** 63 and 0 <= info.local_rank < 2 ** 63
    assert math.isfinite(info.ttl) and info.ttl >= 0
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in info.labels.items())


@FAST
@given(RAW | st.builds(_mutate, st.just(_valid_member()), st.sampled_from(MEMBER_PATHS), JSONISH))
def test_member_parser_raises_only_record_error(raw):
    info = _only_record_error(MemberInfo.from_json, raw)
    if info is not None:
        _check_member(info)


@FAST
@given(RAW | st.builds(_mutate, st.just(_valid_epoch()), st.sampled_from(EPOCH_PATHS), JSONISH))
def test_epoch_parser_raises_only_record_error(raw):
    e = _only_record_error(Epoch.from_json, raw)
    if e is not None:
        assert 0 <= e.number < 2 ** 63
        assert len(set(e.members)) == len(e.members)
        assert all(keys.check_name("member id", m) for m in e.members)
        for info in e.infos.values():
            _check_member(info)
        tree = e.plan.get("tree_parent")
        assert tree is None or (len(tree) == e.size and all(-1 <= p < max(1, e.size) for p in tree))
        assert math.isfinite(e.trigger_at) and math.isfinite(e.published_at)
        assert parse_epoch_number(raw) == e.number
    else:
        _only_record_error(parse_epoch_number, raw)


HEALTH = make_record("m1", epoch=2, seq=5, ops=10, window_s=1.0, wait_s={"m2": 0.5}, op_times=[0.1, 0.2], at=1.0,
                     link_bps={"m2": 1e8})
SCORES = {"at": 1.0, "members": {"m1": {"score": 0.5, "state": "ok"}, "m2": {"score": None, "state": "evicted",
                                                                         "until": 3.0, "hold_s": 30}},
          "demoted": ["m1"], "avoid": [["m1", "m2"]]}


@FAST
@given(RAW | st.builds(_mutate, st.just(HEALTH), st.sampled_from(_paths(HEALTH)), JSONISH))
def test_health_parser_raises_only_record_error(raw):
    rec = _only_record_error(parse_health, raw)
    if rec is not None:
        from resilient.coordinator.straggler import window_features

        window_features(rec)   # the detector's reader never sees a type it cannot handle
        for name in ("epoch", "seq", "ops"):
            assert name not in rec or 0 <= rec[name] < 2 ** 63
        for speed in rec.get("link_bps", {}).values():   # the node agent sums and compares these
            assert isinstance(speed, float) and math.isfinite(speed) and speed >= 0


def test_health_window_with_a_bad_link_speed_is_refused():
    """A rank's window whose ``link_bps`` is not an id -> finite number >= 0 is refused
    whole (RecordError), before the node agent's aggregator or the detector reads it."""
    for bad in ({"m2": "x"}, {"bad id!": 5.0}, {"m2": -1.0}, {"m2": float("inf")}, ["m2", 1.0]):
        rec = dict(HEALTH, link_bps=bad)
        with pytest.raises(RecordError):
            parse_health(json.dumps(rec).encode())
    assert parse_health(json.dumps(HEALTH).encode())["link_bps"] == {"m2": 1e8}


@FAST
@given(RAW | st.builds(_mutate, st.just(SCORES), st.sampled_from(_paths(SCORES)), JSONISH))
def test_scores_parser_raises_only_record_error(raw):
    body = _only_record_error(parse_scores, raw)
    if body is not None:
        for row in body["members"].values():
            assert row["score"] is None or math.isfinite(row["score"])


EVICTION = {"at": 1.0, "until": 2.0, "hold_s": 1.0, "count": 1, "after_epoch": 2}


@FAST
@given(RAW | st.builds(_mutate, st.just(EVICTION), st.sampled_from(_paths(EVICTION)), JSONISH))
def test_eviction_readmit_departed_suspect_parsers_raise_only_record_error(raw):
    def eviction(b):
        return Eviction.from_dict(records.load("eviction", b))

    ev = _only_record_error(eviction, raw)
    if ev is not None:
        assert all(math.isfinite(x) for x in (ev.at, ev.until, ev.hold_s)) and 0 <= ev.count < 2 ** 63
    n = _only_record_error(parse_readmit, raw)
    assert n is None or 0 <= n < 2 ** 63
    for kind in ("departed", "suspect"):
        at = _only_record_error(lambda b: records.timestamp(kind, b), raw)
        assert at is None or (math.isfinite(at) and at >= 0)


@FAST
@given(st.text(max_size=12) | st.sampled_from(["ok\n", "m1\n", "x/../y", "a/b", ".x", "-x", "a" * 129, "ok\r"]))
def test_names_match_in_full(value):
    try:
        keys.check_name("job name", value)
    except ConfigError:
        return
    assert "/" not in value and "\n" not in value and 1 <= len(value) <= 128


def test_the_probed_records_are_refused_with_their_cause():
    with pytest.raises(RecordError, match="'number'.*not an integer"):
        Epoch.from_json(b'{"number": 1e400, "members": []}')
    with pytest.raises(RecordError, match="'pid'.*not an integer"):
        MemberInfo.from_json(b'{"member_id": "m1", "pid": 1e400}')
    with pytest.raises(RecordError, match="'number'"):
        Epoch.from_json(json.dumps({"number": 2 ** 64, "members": []}).encode())
    with pytest.raises(RecordError, match="nested deeper"):
        Epoch.from_json(_nested(100000))
    with pytest.raises(RecordError, match="not UTF-8"):
        MemberInfo.from_json(b'{"member_id": "m\xff"}')
    with pytest.raises(RecordError, match="not a valid id"):
        MemberInfo.from_json(b'{"member_id": "m1\\n"}')
    assert Epoch.from_json(json.dumps(_valid_epoch()).encode()).number == 3


def _codec_payload(header) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h


CODEC_RAW = (st.binary(max_size=64) | JSONISH.map(lambda v: _codec_payload({"s": v, "t": []}))
             | st.builds(lambda t: _codec_payload({"s": {"__t__": 0}, "t": [t]}),
                         st.lists(JSONISH, min_size=0, max_size=5))
             | st.builds(lambda shape, n: _codec_payload({"s": {"__t__": 0}, "t": [["float32", shape, 0, n]]}),
                         st.lists(st.integers(min_value=-2, max_value=2 ** 64) | HUGE, max_size=70), HUGE | st.integers()))


@FAST
@given(CODEC_RAW)
def test_codec_decode_raises_only_frame_error_and_allocates_no_more_than_the_payload(raw):
    from resilient.torch_backend.codec import decode

    try:
        out = decode(raw)
    except FrameError:
        return
    import torch

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from tensors(v)

    assert sum(t.numel() * t.element_size() for t in tensors(out)) <= len(raw)


def test_codec_refuses_a_huge_shape_before_allocating():
    from resilient.torch_backend.codec import decode

    with pytest.raises(FrameError, match="does not have 0 bytes"):
        decode(_codec_payload({"s": {"__t__": 0}, "t": [["float64", [2 ** 40, 2 ** 20], 0, 0]]}))
    with pytest.raises(FrameError, match="runs past the end"):
        decode(_codec_payload({"s": {"__t__": 0}, "t": [["float64", [2 ** 30], 0, 2 ** 33]]}))


NODE = {"addr": "127.0.0.1", "store_port": 29500, "nproc": 2, "host": "h", "agent": "7a3f"}
STARTED = {"nodes": [0, 1], "agents": ["7a3f", "7a40"], "master_addr": "127.0.0.1", "master_port": 29500,
           "time": 1.0}


@FAST
@given(RAW | st.builds(_mutate, st.just(NODE), st.sampled_from(_paths(NODE)), JSONISH)
       | st.builds(_mutate, st.just(STARTED), st.sampled_from(_paths(STARTED)), JSONISH))
def test_launcher_rendezvous_parsers_raise_only_record_error(raw):
    from resilient.launcher.rendezvous import parse_node, parse_started

    node = _only_record_error(parse_node, raw)
    assert node is None or (0 <= node["store_port"] <= 65535 and node["nproc"] >= 1)
    started = _only_record_error(parse_started, raw)
    assert started is None or (1 <= started["master_port"] <= 65535 and all(n >= 0 for n in started["nodes"]))


@FAST
@given(RAW)
def test_joinseq_blob_raises_record_error_only(raw):
    from resilient.collectives.join_agreement import MAX_SEQ, parse_entry

    try:
        e = parse_entry(raw, 7, 12)
    except RecordError:
        return
    assert isinstance(e.seq, int) and 0 <= e.seq <= MAX_SEQ and e.kind in ("agreed", "cover", "own")
    assert e.kind != "cover" or (e.pos is not None and 0 <= e.pos < 12 and all(0 <= c < 12 for c in e.got))
