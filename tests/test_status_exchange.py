"""The ledger-status exchange of a recovery (resilient/collectives/status_exchange.py) and
the transport's control channel it rides on, over real TCP transports on loopback. The
etcd side is an in-memory view here (its real path runs in every multi-process recovery
test: test_collectives_multiproc, test_collectives_faults, test_chaos_real)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from hypothesis import given, settings, strategies as st

import resilient.collectives.status_exchange as sx
from resilient.collectives.status_exchange import (MAX_STATUS_BYTES, StatusExchange, pack_records, tree_children,
                                                   tree_parent, tree_received, tree_subtree, unpack_records)
from resilient.errors import FrameError
from resilient.collectives.tags import STATUS_EXCHANGE, control_seq, tag
from resilient.transport.tcp import TcpTransport


class _View:
    """put_blob/wait_blobs/current in memory. ``etcd_works=False``: wait_blobs never
    completes (times out), so only the transport path can deliver."""

    def __init__(self, etcd_works: bool) -> None:
        self.etcd_works = etcd_works
        self.cond = threading.Condition()
        self.blobs: dict[tuple[int, str], bytes] = {}
        self.looked = 0   # any_blob calls

    def put_blob(self, epoch, name, payload):
        with self.cond:
            self.blobs[(epoch, name)] = payload
            self.cond.notify_all()

    def wait_blobs(self, epoch, name, members, timeout):
        members = list(members)
        if not self.etcd_works:
            raise TimeoutError("this view's etcd path never delivers")
        with self.cond:
            if not self.cond.wait_for(lambda: all((epoch, m) in self.blobs for m in members), timeout):
                raise TimeoutError("missing")
            return {m: self.blobs[(epoch, m)] for m in members}

    def any_blob(self, epoch, name):
        with self.cond:
            self.looked += 1
            self.cond.notify_all()
            return any(e == epoch for e, _ in self.blobs)

    def current(self):
        return None


class _MemberView:
    """One member's window on the shared _View (put_blob keys by member)."""

    def __init__(self, shared: _View, me: str) -> None:
        self.shared, self.me = shared, me

    def put_blob(self, epoch, name, payload):
        self.shared.put_blob(epoch, self.me, payload)

    def wait_blobs(self, epoch, name, members, timeout):
        return self.shared.wait_blobs(epoch, name, members, timeout)

    def any_blob(self, epoch, name):
        return self.shared.any_blob(epoch, name)

    def current(self):
        return None


@pytest.fixture
def trio():
    trs = {m: TcpTransport(m, "job") for m in ("a", "b", "c")}
    addrs = {m: t.address for m, t in trs.items()}
    for t in trs.values():
        t.configure(1, "tok", addrs)
    yield trs
    for t in trs.values():
        t.close()


def _status(member: str, size: int = 50) -> bytes:
    return json.dumps({"member": member, "pad": "x" * size}).encode()


def _decide(raw):
    """A planner's stand-in: each survivor's decision names it and carries every summary
    the planner saw (so a test checks what reached the planner and what came back)."""
    saw = {k: v.decode() for k, v in raw.items()}
    return {m: json.dumps({"to": m, "saw": saw}).encode() for m in raw}


def _learned(got, me):
    """What a survivor learned: every summary (direct / etcd), or, from the planner's
    decision (tree), the summaries the planner saw; the decision must be addressed to it."""
    if got.summaries is not None:
        assert got.decision is None
        return got.summaries
    d = json.loads(got.decision)
    assert d["to"] == me
    return {k: v.encode() for k, v in d["saw"].items()}


def _run_all(trs, rings, view, epoch=1, timeout=10.0, **etcd):
    """Every member's exchange in a thread; ``etcd``: StatusExchange's etcd_max /
    etcd_after (default: the etcd path from the start, so each summary is published).
    ``out[m]``: what member ``m`` learned (:func:`_learned`)."""
    out, errors = {}, []
    exchanges = {}
    _run_all.raw = {}

    def one(m):
        try:
            x = exchanges[m] = StatusExchange(_MemberView(view, m), trs[m], epoch, rings[m], m,
                                              _status(m, 10 + len(m)), **etcd)
            got = _run_all.raw[m] = x.run(timeout, lambda: None, _decide)
            out[m] = _learned(got, m)
            assert x.wait_published() == x.etcd_started
        except BaseException as exc:  # surfaced below
            errors.append((m, exc))

    ths = [threading.Thread(target=one, args=(m,)) for m in rings]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout + 5)
    assert not any(th.is_alive() for th in ths), "an exchange hung"
    _run_all.exchanges = exchanges
    return out, errors


def test_control_frames_never_meet_an_ops_data(trio):
    a, b = trio["a"], trio["b"]
    ctl = bytearray(b"control!")
    data = bytearray(b"op-data-")
    # sent in the order control, data; the data receive is posted first and alone
    sends = [a.isend("b", ctl, control_seq(1), 3), a.isend("b", data, 5, 7)]
    got_data = bytearray(8)
    assert b.wait([b.irecv("a", got_data, 5, 7)], timeout=5)
    assert got_data == data
    got_ctl = bytearray(8)
    assert b.wait([b.irecv("a", got_ctl, control_seq(1), 3)], timeout=5)   # kept aside meanwhile
    assert got_ctl == ctl
    # and the other way round: data first on the wire, the control receive posted first
    sends += [a.isend("b", data, 6, 7), a.isend("b", ctl, control_seq(2), 3)]
    r_ctl, r_data = b.irecv("a", bytearray(8), control_seq(2), 3), b.irecv("a", bytearray(8), 6, 7)
    assert b.wait([r_ctl, r_data], timeout=5)
    assert a.wait(sends, timeout=5)


@pytest.fixture(params=["direct", "tree-chain", "tree-star"])
def mode(request, monkeypatch):
    """direct: every survivor sends to every other; tree-chain: up a chain a <- b <- c to
    the planner a and decisions back down (fanout 1); tree-star: b and c are a's children."""
    monkeypatch.setattr(sx, "DIRECT_MAX", 16 if request.param == "direct" else 1)
    monkeypatch.setattr(sx, "TREE_FANOUT", 1 if request.param == "tree-chain" else 2)
    return request.param


def test_every_survivor_gets_every_summary_over_the_transport(trio, mode):
    ring = ["a", "b", "c"]
    view = _View(etcd_works=False)   # only the transport path can deliver
    out, errors = _run_all(trio, {m: ring for m in ring}, view, timeout=5.0)
    assert not errors, errors
    for m in ring:
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ring}
    assert {k for k in view.blobs} == {(1, m) for m in ring}   # published for observers too


def test_etcd_path_completes_when_survivors_disagree_on_the_ring(trio, mode):
    # c is already in the next op over a grown group and lists a member the others do not
    trs = dict(trio)
    rings = {"a": ["a", "b"], "b": ["a", "b", "c"], "c": ["a", "b", "c"]}
    view = _View(etcd_works=True)
    out, errors = _run_all(trs, rings, view, timeout=5.0)
    assert not errors, errors
    assert out["a"] == {m: _status(m, 10 + len(m)) for m in ("a", "b")}
    for m in ("b", "c"):
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ("a", "b", "c")}
    # leftovers of epoch 1's exchange were cancelled: the next one works over the ring
    out2, errors2 = _run_all(trs, {m: ["a", "b", "c"] for m in "abc"}, _View(etcd_works=False), epoch=2, timeout=5.0)
    assert not errors2, errors2


def test_a_corrupt_length_frame_is_rejected_without_decoding(trio):
    a, b = trio["a"], trio["b"]
    view = _View(etcd_works=False)
    seq = control_seq(1)
    import struct

    a.isend("b", struct.pack("<Q", MAX_STATUS_BYTES + 1), seq, tag(0, 0, STATUS_EXCHANGE))
    x = StatusExchange(_MemberView(view, "b"), b, 1, ["a", "b"], "b", _status("b"), direct_max=16)
    t0 = time.monotonic()
    with pytest.raises(FrameError, match="limit"):
        x.run(5.0, lambda: None)
    assert time.monotonic() - t0 < 5.0


def test_a_summary_naming_another_member_is_rejected(trio):
    a, b = trio["a"], trio["b"]
    view = _View(etcd_works=False)
    seq = control_seq(1)
    import struct

    body = _status("c")
    a.isend("b", struct.pack("<Q", len(body)), seq, tag(0, 0, STATUS_EXCHANGE))
    a.isend("b", body, seq, tag(0, 1, STATUS_EXCHANGE))
    x = StatusExchange(_MemberView(view, "b"), b, 1, ["a", "b"], "b", _status("b"), direct_max=16)
    with pytest.raises(FrameError, match="where 'a'"):
        x.run(5.0, lambda: None)


def test_beyond_etcd_max_a_working_transport_puts_nothing_in_etcd(trio, mode):
    """Above etcd_max survivors the etcd copy is skipped when the transport path works:
    no key, no wait on N keys; each member looks once (a key-only read) whether another
    fell back, finds nothing and puts nothing."""
    ring = ["a", "b", "c"]
    view = _View(etcd_works=True)
    out, errors = _run_all(trio, {m: ring for m in ring}, view, timeout=5.0, etcd_max=2, etcd_after=0.2)
    assert not errors, errors
    for m in ring:
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ring}
        assert _run_all.exchanges[m].etcd_started is False
    with view.cond:
        assert view.cond.wait_for(lambda: view.looked == 3, 10), "each member looked for a fallback once"
    assert view.blobs == {}


def test_beyond_etcd_max_a_stalled_transport_falls_back_to_etcd(trio, mode):
    """Survivors that disagree on the ring stall over the transport; above etcd_max they
    fall back to etcd after etcd_after and complete there (below it this case went
    through etcd from the start)."""
    rings = {"a": ["a", "b"], "b": ["a", "b", "c"], "c": ["a", "b", "c"]}
    view = _View(etcd_works=True)
    out, errors = _run_all(dict(trio), rings, view, timeout=8.0, etcd_max=1, etcd_after=0.3)
    assert not errors, errors
    assert out["a"] == {m: _status(m, 10 + len(m)) for m in ("a", "b")}
    for m in ("b", "c"):
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ("a", "b", "c")}
    assert set(view.blobs) == {(1, "a"), (1, "b"), (1, "c")}


def test_a_member_done_over_the_transport_answers_a_fallback_in_etcd(trio, mode):
    """Beyond etcd_max, a member whose exchange completed over the transport looks once,
    a second after any fallback would have begun, for a summary of its epoch in etcd; one
    being there (another survivor fell back), it puts its own so that survivor's wait can
    complete."""
    ring = ["a", "b", "c"]
    view = _View(etcd_works=True)
    view.put_blob(1, "z", _status("z"))          # a survivor that fell back (its view of the ring differed)
    out, errors = _run_all(trio, {m: ring for m in ring}, view, timeout=5.0, etcd_max=2, etcd_after=0.2)
    assert not errors, errors
    assert not any(x.etcd_started for x in _run_all.exchanges.values())
    with view.cond:
        assert view.cond.wait_for(lambda: {(1, m) for m in ring} <= set(view.blobs), 10), view.blobs


def test_the_etcd_puts_a_recovery_costs():
    from resilient.collectives.status_exchange import ETCD_MAX, etcd_puts

    assert etcd_puts(8) == 8 and etcd_puts(ETCD_MAX) == ETCD_MAX
    assert etcd_puts(ETCD_MAX + 1) == 0 and etcd_puts(99_992) == 0


# -- the tree beyond direct_max: summaries up to the planner, decisions down ------------------

class _Counting:
    """A transport that records every receive posted (peer, tag, bytes)."""

    def __init__(self, inner):
        self.inner, self.recvs = inner, []

    def irecv(self, peer, buf, seq, t, *a):
        self.recvs.append((peer, t, len(buf)))
        return self.inner.irecv(peer, buf, seq, t, *a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_in_the_tree_a_leaf_receives_no_summary_only_its_decision(trio, monkeypatch):
    """Beyond direct_max only the planner holds every summary: a leaf posts two receives
    (its decision's length and body, from its parent) and none for another's summary."""
    monkeypatch.setattr(sx, "DIRECT_MAX", 1)
    monkeypatch.setattr(sx, "TREE_FANOUT", 2)
    trs = {m: _Counting(t) for m, t in trio.items()}
    ring = ["a", "b", "c"]
    out, errors = _run_all(trs, {m: ring for m in ring}, _View(etcd_works=False), timeout=5.0)
    assert not errors, errors
    for m in ring:
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ring}   # the planner saw all
        assert _run_all.raw[m].summaries is None                        # ... and they did not
    down = sx.tag(sx._DOWN, 0, STATUS_EXCHANGE), sx.tag(sx._DOWN, 1, STATUS_EXCHANGE)
    for leaf in ("b", "c"):
        assert [(p, t) for p, t, _ in trs[leaf].recvs] == [("a", down[0]), ("a", down[1])]
        decision = _run_all.raw[leaf].decision
        assert trs[leaf].recvs[1][2] == 16 + len(pack_records([(leaf, decision)]))   # its own decision only
    assert {p for p, _, _ in trs["a"].recvs} == {"b", "c"} and len(trs["a"].recvs) == 4


def test_a_bundle_naming_a_member_outside_the_subtree_is_rejected(trio, monkeypatch):
    """A child's bundle must hold exactly its subtree's summaries: one naming another
    member is a corrupt peer (FrameError), not a summary to plan with."""
    monkeypatch.setattr(sx, "DIRECT_MAX", 1)
    monkeypatch.setattr(sx, "TREE_FANOUT", 2)
    import struct

    a, b = trio["a"], trio["b"]
    view = sx.hashlib.sha256(b"1\n1\n2\nb\na").digest()[:16]   # a's view is b's: epoch 1, direct_max 1, fanout 2, [b, a]
    body = view + pack_records([("c", _status("c"))])   # but a's subtree is a alone
    seq = control_seq(1)
    sends = [a.isend("b", struct.pack("<Q", len(body)), seq, tag(sx._UP, 0, STATUS_EXCHANGE)),
             a.isend("b", body, seq, tag(sx._UP, 1, STATUS_EXCHANGE))]
    x = StatusExchange(_MemberView(_View(etcd_works=False), "b"), b, 1, ["b", "a"], "b", _status("b"))
    with pytest.raises(FrameError, match="naming 'c'"):
        x.run(5.0, lambda: None, _decide)
    assert a.wait(sends, timeout=5)


def test_without_a_decide_function_the_tree_refuses_to_start(trio):
    x = StatusExchange(_MemberView(_View(etcd_works=False), "a"), trio["a"], 1, ["a", "b"], "a", _status("a"),
                       direct_max=1)
    with pytest.raises(ValueError, match="decide"):
        x.run(1.0, lambda: None)


@settings(max_examples=80, deadline=None)  # the checks are quadratic in n: 400 x 200 took ~50 s
@given(n=st.integers(1, 160), fanout=st.integers(1, 20))
def test_the_tree_covers_every_survivor_once(n, fanout):
    """Every survivor but the planner has one parent, whose children list it; the planner's
    subtree is everyone; subtrees of siblings are disjoint; a leaf receives nothing."""
    assert sorted(tree_subtree(0, n, fanout)) == list(range(n))
    assert tree_parent(0, n, fanout) == -1
    for i in range(1, n):
        assert i in tree_children(tree_parent(i, n, fanout), n, fanout)
    for i in range(n):
        kids = tree_children(i, n, fanout)
        below = [tree_subtree(c, n, fanout) for c in kids]
        flat = [x for b in below for x in b]
        assert len(flat) == len(set(flat)) and sorted(flat + [i]) == sorted(tree_subtree(i, n, fanout))
    received = tree_received(n, fanout)
    assert received[0] == n - 1
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[tree_parent(i, n, fanout)] + 1
    assert sum(received) == sum(depth)   # each summary is received once per hop up to the planner
    if fanout >= 2:
        assert max(depth) <= n.bit_length()
        # balanced: no second-level survivor forwards more than its share of the rest
        assert all(received[c] + 1 <= -(-(n - 1) // fanout) for c in tree_children(0, n, fanout))


def test_tree_traffic_at_100k_survivors():
    """At 100,000 survivors and fanout 16 the summaries received in all are ~N x depth
    (not N^2), most survivors are leaves that receive none, and no one but the planner
    receives more than a sixteenth of them."""
    n = 100_000
    received = tree_received(n, 16)
    assert received[0] == n - 1
    assert sum(received) < 5 * n
    assert sum(1 for r in received if r == 0) > 0.6 * n
    assert max(received[1:]) < n // 16


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_unpack_records_rejects_garbage_with_frame_error(raw):
    try:
        out = unpack_records(raw, ["a", "b"], "x", "test records")
    except FrameError:
        return
    assert set(out) == {"a", "b"}


def test_records_round_trip():
    recs = [("a", b"1"), ("bé", b""), ("c", b"x" * 1000)]
    assert unpack_records(pack_records(recs), ["c", "bé", "a"], "x", "t") == dict(recs)
    with pytest.raises(FrameError, match="missing"):
        unpack_records(pack_records(recs[:2]), ["c", "bé", "a"], "x", "t")
    with pytest.raises(FrameError, match="twice"):
        unpack_records(pack_records(recs + recs[:1]), ["c", "bé", "a"], "x", "t")
    with pytest.raises(FrameError, match="longer"):
        unpack_records(pack_records(recs)[:-5], ["c", "bé", "a"], "x", "t")
