"""Unit tests of the join agreement's tree and rule (resilient/collectives/join_agreement.py).

Pure logic: an in-memory blob view and an in-memory channel stand in for etcd and the
data plane (the real-process admission tests exercise both for real).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Iterable

import pytest
from hypothesis import given, settings, strategies as st

from resilient.collectives import join_agreement as ja
from resilient.errors import FrameError, RecordError


@dataclass
class FakeEpoch:
    number: int
    members: tuple[str, ...]
    added: tuple[str, ...] = ()


@dataclass
class MemoryBlobs:
    """epoch -> name -> member -> payload; counts puts; a wait returns what is there or
    raises TimeoutError (nothing here blocks)."""

    blobs: dict[tuple[int, str, str], bytes] = field(default_factory=dict)
    puts: list[tuple[int, str, str]] = field(default_factory=list)

    def writer(self, member: str) -> "MemberView":
        return MemberView(self, member)


@dataclass
class MemberView:
    store: MemoryBlobs
    member: str

    def current(self) -> None:
        return None

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        self.store.puts.append((epoch, name, self.member))
        self.store.blobs[(epoch, name, self.member)] = payload

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]:
        out = {m: self.store.blobs[(epoch, name, m)] for m in members if (epoch, name, m) in self.store.blobs}
        missing = [m for m in members if m not in out]
        if missing:
            raise TimeoutError(f"missing {missing}")
        return out


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
