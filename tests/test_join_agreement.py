"""Unit tests of the join agreement's tree and rule (resilient/collectives/join_agreement.py).

Pure logic: an in-memory blob view and an in-memory channel stand in for etcd and the
data plane (the real-process admission tests exercise both for real).
"""
from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import pytest
from hypothesis import given, settings, strategies as st

from resilient.collectives import join_agreement as ja
from resilient.errors import FrameError, RecordError

R = TypeVar("R")


@dataclass
class FakeEpoch:
    number: int
    members: tuple[str, ...]
    added: tuple[str, ...] = ()


@dataclass
class MemoryBlobs:
    """epoch -> name -> member -> payload; counts puts; a wait blocks until its condition
    holds or raises TimeoutError at its deadline."""

    blobs: dict[tuple[int, str, str], bytes] = field(default_factory=dict)
    puts: list[tuple[int, str, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def writer(self, member: str) -> "MemberView":
        return MemberView(self, member)


@dataclass
class MemberView:
    store: MemoryBlobs
    member: str

    def current(self) -> None:
        return None

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        with self.store.cond:
            self.store.puts.append((epoch, name, self.member))
            self.store.blobs[(epoch, name, self.member)] = payload
            self.store.cond.notify_all()

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]:
        wanted = list(members)
        return self.wait_blobs_until(epoch, name, lambda got: dict(got) if all(m in got for m in wanted) else None,
                                     timeout)

    def wait_blobs_until(self, epoch: int, name: str, done: Callable[[Mapping[str, bytes]], R | None],
                         timeout: float) -> R:
        deadline = time.monotonic() + timeout
        with self.store.cond:
            while True:
                got = {m: v for (e, n, m), v in self.store.blobs.items() if (e, n) == (epoch, name)}
                result = done(got)
                if result is not None:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"epoch {epoch}: {name} not complete (have {sorted(got)})")
                self.store.cond.wait(left)


class Mailbox:
    """The data plane: messages queued, delivered in an order the test picks."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, str, int, int]] = []  # (sender, parent, epoch, seq)
        self.sender = ""

    def channel(self, sender: str) -> "Sender":
        return Sender(self, sender)


@dataclass
class Sender:
    box: Mailbox
    me: str

    def send_up(self, parent: str, epoch: int, seq: int) -> None:
        self.box.queue.append((self.me, parent, epoch, seq))


def run_agreement(n_old: int, seqs: list[int], arity: int, order_seed: int, dead: set[int] = frozenset()):
    olds = tuple(f"m{i:03d}" for i in range(n_old))
    epoch = FakeEpoch(7, olds + ("j1", "j2"), added=("j1", "j2"))
    store, box = MemoryBlobs(), Mailbox()
    parts = {m: ja.JoinAgreement(store.writer(m), epoch, m, box.channel(m), arity) for m in epoch.members}
    rng = random.Random(order_seed)
    pending = [i for i in range(n_old) if i not in dead]
    rng.shuffle(pending)
    # contributions and deliveries interleaved in a random order
    while pending or box.queue:
        if pending and (not box.queue or rng.random() < 0.5):
            i = pending.pop()
            parts[olds[i]].contribute(seqs[i])
        else:
            sender, parent, e, seq = box.queue.pop(rng.randrange(len(box.queue)))
            if olds.index(sender) in dead:
                continue
            parts[parent].on_child(sender, seq)
    return parts, store


@settings(max_examples=150, deadline=None)
@given(n_old=st.integers(1, 40), arity=st.integers(2, 6), seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_every_member_and_joiner_gets_the_max_from_one_put(n_old, arity, seed, data):
    seqs = data.draw(st.lists(st.integers(0, ja.MAX_SEQ), min_size=n_old, max_size=n_old))
    parts, store = run_agreement(n_old, seqs, arity, seed)
    assert store.puts == [(7, "joinseq", "m000")]  # one key, written once, by the root
    assert {p.wait(1.0) for p in parts.values()} == {max(seqs)}


@settings(max_examples=60, deadline=None)
@given(n_old=st.integers(2, 30), arity=st.integers(2, 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_a_silent_member_means_no_agreement_never_a_smaller_one(n_old, arity, seed, data):
    dead = {data.draw(st.integers(0, n_old - 1))}
    parts, store = run_agreement(n_old, list(range(n_old)), arity, seed, dead=dead)
    assert store.puts == []
    with pytest.raises(TimeoutError):
        parts["j1"].wait(0.1)


@given(n=st.integers(1, 200), arity=st.integers(2, 8))
def test_tree_is_a_spanning_tree_rooted_at_position_zero(n, arity):
    tree = ja.JoinTree(tuple(f"m{i}" for i in range(n)), arity)
    assert tree.parent(tree.root) is None
    seen = []
    for m in tree.members:
        kids = tree.children(m)
        assert len(kids) <= arity
        assert all(tree.parent(k) == m for k in kids)
        seen.extend(kids)
    assert sorted(seen) == sorted(tree.members[1:])  # every non-root has exactly one parent


def test_old_members_are_the_epochs_members_minus_the_added_in_order():
    e = FakeEpoch(3, ("b", "j", "a", "c"), added=("j",))
    assert ja.old_members(e) == ("b", "a", "c")
    assert ja.JoinTree(ja.old_members(e)).root == "b"


def test_tree_refuses_empty_duplicate_and_bad_arity():
    with pytest.raises(ValueError, match="at least one"):
        ja.JoinTree(())
    with pytest.raises(ValueError, match="duplicate"):
        ja.JoinTree(("a", "a"))
    with pytest.raises(ValueError, match="arity"):
        ja.JoinTree(("a",), 1)


def test_reduction_refuses_a_stranger_a_changed_value_and_a_bad_seq():
    tree = ja.JoinTree(("a", "b", "c", "d", "e", "f"), 2)  # a: b c; b: d e; c: f
    r = ja.Reduction(tree, "b")
    with pytest.raises(FrameError, match="not its parent"):
        r.receive("f", 1)
    with pytest.raises(FrameError, match="not an op sequence"):
        r.receive("d", -1)
    with pytest.raises(FrameError, match="not an op sequence"):
        r.receive("d", True)
    assert r.receive("d", 5) is None
    assert r.receive("d", 5) is None  # a repeat is harmless
    with pytest.raises(FrameError, match="two different"):
        r.receive("d", 6)
    assert r.offer(3) is None
    assert r.receive("e", 9) == 9
    assert r.receive("e", 9) is None  # completes exactly once


def test_agreed_record_is_validated():
    raw = ja.encode_agreed(4, 11, 3)
    assert ja.decode_agreed(raw, 4, 3) == 11
    with pytest.raises(RecordError, match="stale or foreign"):
        ja.decode_agreed(raw, 5, 3)
    with pytest.raises(RecordError, match="stale or foreign"):
        ja.decode_agreed(raw, 4, 2)
    for bad in (b"", b"[]", b'{"seq": "1", "epoch": 4, "members": 3}', json.dumps({"seq": 1}).encode(),
                json.dumps({"seq": 2**41, "epoch": 4, "members": 3}).encode()):
        with pytest.raises(RecordError):
            ja.decode_agreed(bad, 4, 3)


def test_a_joiner_cannot_contribute_and_refuses_child_messages():
    e = FakeEpoch(2, ("a", "j"), added=("j",))
    store = MemoryBlobs()
    j = ja.JoinAgreement(store.writer("j"), e, "j", Mailbox().channel("j"))
    with pytest.raises(ValueError, match="only waits"):
        j.contribute(1)
    with pytest.raises(FrameError, match="no old member"):
        j.on_child("a", 1)
    a = ja.JoinAgreement(store.writer("a"), e, "a", Mailbox().channel("a"))
    a.contribute(4)  # a lone old member is its own root: it writes at once
    assert j.wait(1.0) == 4


def settle_all(parts: dict[str, ja.JoinAgreement], seqs: dict[str, int], stall: float,
               timeout: float = 10.0, deadline: float | None = None) -> dict[str, int | BaseException]:
    """Every old member's :meth:`JoinAgreement.settle` on a thread of its own (as each
    member's helper thread runs it); member -> its result or exception. Fails when one has
    not returned ``deadline`` seconds (default ``timeout`` + 5) after the start."""
    out: dict[str, int | BaseException] = {}

    def one(m: str) -> None:
        try:
            out[m] = parts[m].settle(seqs[m], stall, timeout)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[m] = exc
    threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in seqs]
    end = time.monotonic() + (timeout + 5 if deadline is None else deadline)
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a settle did not return by its deadline"
    return out


def test_one_stalled_member_costs_the_keys_around_it_not_one_per_old_member():
    """200 old members, arity 4; one member (position 5) reads and sends nothing (inside an
    op that does not progress the transport); every other message is delivered. After the
    stall it, its children and its ancestors write covering records (rules a-c) — the
    others write nothing — and every member and the joiner get the maximum."""
    n, stuck = 200, 5
    olds = tuple(f"m{i:03d}" for i in range(n))
    e = FakeEpoch(7, olds + ("j",), added=("j",))
    store, box = MemoryBlobs(), Mailbox()
    parts = {m: ja.JoinAgreement(store.writer(m), e, m, box.channel(m)) for m in e.members}
    seqs = {m: 100 + (i * 37) % 50 for i, m in enumerate(olds)}
    seqs[olds[stuck]] = 1000                       # the stalled member's seq is the largest: it must count
    for m in olds:
        parts[m].contribute(seqs[m])
    while box.queue:
        sender, parent, _, seq = box.queue.pop()
        if olds[stuck] not in (sender, parent):
            parts[parent].on_child(sender, seq)
    assert store.puts == []                        # the tree stalled at the stuck member
    results = settle_all({m: parts[m] for m in olds}, seqs, stall=0.3)
    assert results == {m: 1000 for m in olds}
    tree = parts[olds[0]].tree
    around = {olds[stuck], *tree.children(olds[stuck])}
    a = olds[stuck]
    while (a := tree.parent(a)) is not None:
        around.add(a)
    writers = [m for _, _, m in store.puts]
    assert set(writers) == around and len(writers) == len(around), (sorted(writers), sorted(around))
    assert parts["j"].wait(1.0) == 1000


@settings(max_examples=40, deadline=None)
@given(n_old=st.integers(2, 60), arity=st.integers(2, 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_any_stalled_members_end_with_the_maximum_everywhere(n_old, arity, seed, data):
    """Some members read and send nothing, some other messages are lost: after the stall
    every old member gets the maximum of every announced seq, from the covering records."""
    olds = tuple(f"m{i:03d}" for i in range(n_old))
    e = FakeEpoch(7, olds + ("j",), added=("j",))
    store, box = MemoryBlobs(), Mailbox()
    parts = {m: ja.JoinAgreement(store.writer(m), e, m, box.channel(m), arity) for m in e.members}
    stuck = set(data.draw(st.sets(st.sampled_from(olds), max_size=3)))
    seqs = {m: data.draw(st.integers(0, 1000)) for m in olds}
    rng = random.Random(seed)
    for m in olds:
        parts[m].contribute(seqs[m])
    while box.queue:
        sender, parent, _, seq = box.queue.pop(rng.randrange(len(box.queue)))
        if sender not in stuck and parent not in stuck and rng.random() > 0.1:
            parts[parent].on_child(sender, seq)
    results = settle_all({m: parts[m] for m in olds}, seqs, stall=0.2)
    assert results == {m: max(seqs.values()) for m in olds}
    assert parts["j"].wait(1.0) == max(seqs.values())


def test_a_stalled_tree_ends_as_the_per_member_agreement_with_the_same_result():
    olds = tuple(f"m{i}" for i in range(6))
    e = FakeEpoch(9, olds + ("j",), added=("j",))
    store = MemoryBlobs()
    parts = {m: ja.JoinAgreement(store.writer(m), e, m, Mailbox().channel(m), 2) for m in e.members}
    seqs = {m: 10 + i for i, m in enumerate(olds)}
    for m in olds:
        parts[m].contribute(seqs[m])   # the leaves' messages are never delivered: the tree is stalled
    assert store.puts == []
    results = settle_all({m: parts[m] for m in olds}, seqs, stall=0.2)
    assert results == {m: max(seqs.values()) for m in olds}
    assert sorted(m for _, _, m in store.puts) == sorted(olds)   # every old member's own key, once
    assert all(parts[m].fell_back for m in olds)
    assert parts["j"].wait(1.0) == max(seqs.values())


def test_once_one_member_falls_back_the_others_do_not_wait_out_their_stall():
    olds = ("a", "b", "c")
    e = FakeEpoch(4, olds + ("j",), added=("j",))
    store = MemoryBlobs()
    parts = {m: ja.JoinAgreement(store.writer(m), e, m, Mailbox().channel(m)) for m in e.members}
    store.writer("c").put_blob(4, ja.BLOB, ja.encode_own(7))   # c stalled and fell back already
    # stall and timeout of an hour: only the fallback already begun can end these waits
    # within the deadline (a member that waited out its stall fails it)
    results = settle_all({m: parts[m] for m in ("a", "b")}, {"a": 3, "b": 5}, stall=3600.0, timeout=3600.0,
                         deadline=20.0)
    assert results == {"a": 7, "b": 7}


def test_a_completed_tree_costs_one_key_and_no_member_falls_back():
    olds = tuple(f"m{i:03d}" for i in range(9))   # run_agreement's ids
    seqs = list(range(20, 29))
    parts, store = run_agreement(len(olds), seqs, 3, order_seed=5)
    results = settle_all({m: parts[m] for m in olds}, dict(zip(olds, seqs)), stall=0.05)
    assert results == {m: 28 for m in olds}
    assert store.puts == [(7, "joinseq", "m000")]
    assert not any(parts[m].fell_back for m in olds)


def test_outcome_reads_the_roots_record_or_every_own_record_never_part_of_them():
    tree = ja.JoinTree(("r", "a", "b"))
    own = {"r": ja.encode_own(4), "a": ja.encode_own(9)}
    assert ja.outcome(own, tree, 3) is None                       # b's is missing: no guess
    assert ja.outcome({**own, "b": ja.encode_own(2)}, tree, 3) == 9
    assert ja.outcome({"r": ja.encode_agreed(3, 9, 3)}, tree, 3) == 9
    # the root's record beside (or instead of) own records: the same maximum either way
    assert ja.outcome({**own, "r": ja.encode_agreed(3, 9, 3)}, tree, 3) == 9
    with pytest.raises(RecordError, match="stale or foreign"):
        ja.outcome({"r": ja.encode_agreed(2, 9, 3)}, tree, 3)
    with pytest.raises(RecordError):
        ja.outcome({**own, "b": b'{"seq": -1}'}, tree, 3)
    # covering records: the root heard from a (whose subtree max it holds) but not from b
    cover = {"r": ja.encode_cover(3, 9, 3, 0, [1])}
    assert ja.outcome(cover, tree, 3) is None                       # b's place uncovered
    assert ja.outcome({**cover, "b": ja.encode_cover(3, 2, 3, 2, [])}, tree, 3) == 9
    assert ja.outcome({**cover, "b": ja.encode_own(11)}, tree, 3) == 11
    with pytest.raises(RecordError, match="foreign"):
        ja.outcome({**cover, "b": ja.encode_cover(3, 2, 3, 1, [])}, tree, 3)   # b's record names a's position


@dataclass
class SlowFirstWait(MemberView):
    """A view whose first condition wait times out at once, whatever is there (a watch
    that had not caught up yet)."""

    slow: bool = True

    def wait_blobs_until(self, epoch, name, done, timeout):
        if self.slow:
            self.slow = False
            raise TimeoutError("a watch that had not caught up yet")
        return super().wait_blobs_until(epoch, name, done, timeout)


def test_the_root_never_writes_its_own_seq_over_its_record():
    e = FakeEpoch(5, ("r", "a", "j"), added=("j",))
    store = MemoryBlobs()
    box = Mailbox()
    r = ja.JoinAgreement(SlowFirstWait(store, "r"), e, "r", box.channel("r"))
    a = ja.JoinAgreement(store.writer("a"), e, "a", box.channel("a"))
    a.contribute(6)
    r.contribute(2)
    (_, parent, _, seq), = box.queue
    r.on_child("a", seq)            # the tree completes: the root's record is written
    assert r.settle(2, 30.0, 5.0) == 6   # its stall wait "timed out"; its own seq (2) is not written over the record
    assert store.puts == [(5, ja.BLOB, "r")]
    e = ja.parse_entry(store.blobs[(5, ja.BLOB, "r")], 5, 2)
    assert (e.seq, e.kind) == (6, "agreed")
    assert not r.fell_back


def test_admission_complete_takes_either_form_and_no_part_of_one():
    olds = {"a": 0, "b": 1, "c": 2}

    def done(got):
        return ja.admission_complete(got, olds.get, 3, 8)
    assert done({}) is False
    assert done({"a": ja.encode_own(1), "b": ja.encode_own(2)}) is False            # c missing
    assert done({"a": ja.encode_own(1), "b": ja.encode_own(2), "c": ja.encode_own(0)}) is True
    assert done({"b": ja.encode_agreed(8, 4, 3)}) is True                           # the root's record, any old key
    assert done({"j": ja.encode_agreed(8, 4, 3)}) is False                          # not an old member's key
    assert done({"a": ja.encode_agreed(7, 4, 3)}) is False                          # another epoch's record
    assert done({"a": b"junk", "b": ja.encode_own(2), "c": ja.encode_own(0)}) is False
    assert ja.admission_complete({}, olds.get, 0, 8) is True                        # nobody before: nothing to agree
    # covering records: the root heard from b; c's own record covers c
    assert done({"a": ja.encode_cover(8, 5, 3, 0, [1]), "c": ja.encode_own(9)}) is True
    assert done({"a": ja.encode_cover(8, 5, 3, 0, [1])}) is False                   # c uncovered
    assert done({"a": ja.encode_cover(8, 5, 3, 1, [1]), "c": ja.encode_own(9)}) is False   # a's names b's place
