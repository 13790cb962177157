"""The op seq at which a growing epoch takes effect, agreed with one etcd key per epoch.

One responsibility: the *join agreement* of a growing epoch (joiners added, nobody
removed). Its contract:

* **inputs** — the old members of the growing epoch ``n`` in the epoch's order
  (:func:`old_members`: the members not in ``added``), and each old member's announced
  seq: the first op seq it has not started (it then starts no op of that seq or later in
  the older epoch);
* **output** — the agreed seq, the largest announced one, identical at every old member
  and every joiner.

How: a max-reduction along a k-ary tree of the old members by position
(:class:`JoinTree`; position 0 is the root, the children of position ``i`` are
``k*i + 1 .. k*i + k``). Each member combines its own seq with its children's subtree
maxima (:class:`Reduction`) and sends the result to its parent over a :class:`Channel`
(the data plane); the root, once it has its whole tree, writes the one key
``epochs/<n>/data/joinseq/<root>`` (:func:`encode_agreed`) exactly once, and every old
member and joiner waits on that key (:meth:`JoinAgreement.wait`, a watch of the epoch's
``joinseq`` prefix). In etcd that is one put per growing epoch and one watch per
participant, instead of one put per old member and every participant reading all N keys.

**A stalled tree falls back to a few covering records, not one key per old member.** A
tree message can stall: a member inside an op that does not progress the transport (the
direct shared-memory algorithms wait on futex words) sends and reads nothing until that op
ends, and the op may need a member that waits at its boundary for this very agreement. So
an old member may also write a *covering record* under its own key (:func:`encode_cover`:
the maximum over itself and the subtrees of the children it heard from, with its position
and theirs). The result is then read either way (:func:`outcome`): the root's record, or
the maximum over covering records (and the per-member agreement's own records) once they
cover every old member, a position being covered by its own record or by an ancestor's
that heard from the child on the path (:func:`covered_max`). Each old member's helper
thread, :meth:`JoinAgreement.settle`, writes its covering record only when the tree alone
cannot bring its part to the root:

* (a) ``stall`` seconds passed without a result and its own subtree is incomplete (a
  child's message never came: the stalled member itself, whose transport is not read, and
  its ancestors, each missing the child on the path);
* (b) its parent's record is there and did not hear from it (a stalled parent never read
  its message: its children write theirs, a complete child covering its whole subtree);
* (c) a child's record is there and its own subtree is incomplete (the fallback moves up
  to the root at once, without waiting out each ancestor's stall).

So one stalled member costs about ``1 + arity + depth`` keys (itself, its children, its
ancestors: ~14 at 100,000 old members), where every old member wrote its own before; a
member of the per-member agreement (``RESILIENT_JOIN_TREE=0``, NCCL) writes its own
``{"seq": n}`` record at once, which the others treat as a covering record of its position
(rules b and c then complete the coverage around it). An unstalled tree still costs one
key. A member whose wait a newer epoch ends writes its covering record at once (the
members adopt growing epochs in order, so a superseded agreement must still complete
whatever the tree does): at most one key per old member, only in that case.

Why the result is the same everywhere: every old member announces one seq per epoch, and
both forms of the result are the maximum over exactly those seqs — the root writes its
record only after every old member's seq went into it, and the covering form needs every
old member's seq in some record (its own, or an ancestor's that heard its subtree). So no member has started an op at or after the result in the
older epoch, and any mix of readers of the two forms agrees. The root's key holds either
its record or (fallen back first) its covering record; once its record is written the root
never writes a covering record over it (:meth:`JoinAgreement.settle` checks under the lock its record
is written under), so a late reader never sees the record replaced by a partial one.

Failure behaviour: a child that sends a second, different value, or a value from a member
that is not its child, or a seq outside ``[0, 2**40)``, raises
:class:`~resilient.errors.FrameError` from :meth:`Reduction.receive` (nothing of it is
used; the sender is corrupt). A member that dies mid-agreement: the root never completes;
the coordinator's next epoch (which removes it) supersedes ``n`` and :meth:`JoinAgreement.wait`
raises :class:`~resilient.errors.EpochChanged` as the etcd wait does. A silent member: no
result within ``timeout`` -> ``TimeoutError`` (:class:`~resilient.errors.ResilientTimeout`).
A lost or stalled tree message costs ``stall`` seconds and the fallback's keys, never a
wrong seq or a hang. A malformed ``joinseq`` record raises :class:`~resilient.errors.RecordError`
naming the rule (a member never adopts a guessed seq). Nothing here hangs: every wait is
the view's, with its deadline.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from resilient.collectives.group import AgreementView, EpochLike
from resilient.coordinator import records
from resilient.errors import EpochChanged, FrameError, RecordError
from resilient.transport.tags import SEQ_MASK

log = logging.getLogger(__name__)

#: children per tree node: depth log4(N) (8 hops at 100k members), 4 messages into a node
ARITY = 4
#: the blob name of the agreed seq (``epochs/<n>/data/joinseq/<root>``)
BLOB = "joinseq"
#: announced seqs are op seqs of the collective namespace (the low 40 bits)
MAX_SEQ = SEQ_MASK


def old_members(epoch: EpochLike) -> tuple[str, ...]:
    """The members of the growing ``epoch`` that were members before it, in its order:
    the participants of its agreement (a joiner computes the same from the record)."""
    added = set(epoch.added)
    return tuple(m for m in epoch.members if m not in added)


@dataclass(frozen=True)
class JoinTree:
    """The k-ary reduction tree of ``members`` (in the epoch's order) by position."""

    members: tuple[str, ...]
    arity: int = ARITY

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a join agreement needs at least one old member")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"duplicate member ids in the join tree: {list(self.members)}")
        if self.arity < 2:
            raise ValueError(f"join tree arity must be >= 2, got {self.arity}")

    @property
    def root(self) -> str:
        return self.members[0]

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        # built once per tree: members.index would scan up to 100k ids per parent/children call
        return {m: i for i, m in enumerate(self.members)}

    def index_of(self, member: str) -> int | None:
        """``member``'s position, or None for a member not in the tree."""
        return self._index.get(member)

    def position(self, member: str) -> int:
        """``member``'s position; ValueError for a member not in the tree."""
        try:
            return self._index[member]
        except KeyError:
            raise ValueError(f"member {member!r} is not in the join tree") from None

    def parent(self, member: str) -> str | None:
        """The member ``member`` sends its subtree's maximum to (None: it is the root)."""
        i = self.position(member)
        return None if i == 0 else self.members[(i - 1) // self.arity]

    def children(self, member: str) -> tuple[str, ...]:
        """The members whose subtree maxima ``member`` waits for."""
        first = self.arity * self.position(member) + 1
        return self.members[first:first + self.arity]


def check_seq(value: object, what: str) -> int:
    """``value`` if it is an announced op seq (an int in ``[0, 2**40)``); else FrameError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise FrameError(f"{what}: {value!r} is not an op sequence number in [0, {MAX_SEQ}]")
    return value


class Reduction:
    """One member's part of the max-reduction: its own seq plus each child's subtree
    maximum. :meth:`offer` and :meth:`receive` return the subtree's maximum once it is
    complete (exactly once), None before and after."""

    def __init__(self, tree: JoinTree, member: str) -> None:
        self.tree, self.member = tree, member
        self.waiting = set(tree.children(member))
        self.got: dict[str, int] = {}
        self.own: int | None = None
        self.done = False
        self._lock = threading.Lock()

    def offer(self, seq: int) -> int | None:
        """This member's announced seq (a repeat of the same value changes nothing)."""
        seq = check_seq(seq, f"member {self.member}'s own seq")
        with self._lock:
            if self.own is not None and self.own != seq:
                raise FrameError(f"member {self.member} announced op #{self.own} and then op #{seq} for one epoch")
            self.own = seq
            return self._complete()

    def receive(self, child: str, seq: object) -> int | None:
        """A child's subtree maximum; FrameError when ``child`` is not a child of this
        member or sends two different values (see the module docstring)."""
        value = check_seq(seq, f"member {child}'s subtree maximum")
        with self._lock:
            if child not in self.waiting:
                raise FrameError(f"member {child} sent a join seq to {self.member}, which is not its parent in "
                                    f"the join tree (its parent is {self.tree.parent(child) if child in self.tree.members else 'none: not an old member'})")
            if child in self.got and self.got[child] != value:
                raise FrameError(f"member {child} sent two different join seqs ({self.got[child]}, {value})")
            self.got[child] = value
            return self._complete()

    def heard(self) -> dict[str, int]:
        """The children heard from so far and their subtree maxima (a copy)."""
        with self._lock:
            return dict(self.got)

    def _complete(self) -> int | None:
        if self.done or self.own is None or self.got.keys() != self.waiting:
            return None
        self.done = True
        return max([self.own, *self.got.values()])


def encode_agreed(epoch: int, seq: int, participants: int) -> bytes:
    """The root's record: ``{"seq": n, "epoch": e, "members": count}``."""
    return json.dumps({"seq": check_seq(seq, "agreed seq"), "epoch": epoch, "members": participants},
                      sort_keys=True, separators=(",", ":")).encode()


def decode_agreed(raw: bytes, epoch: int, participants: int) -> int:
    """The agreed seq of a root record, validated like every etcd record: RecordError
    naming the rule for a malformed record, or one of another epoch or participant count
    (a record from another tree is never adopted)."""
    f = records.fields("rendezvous", raw, "joinseq")
    seq = int(f.int("seq", hi=MAX_SEQ))
    got_epoch, got_members = int(f.int("epoch")), int(f.int("members"))
    if got_epoch != epoch or got_members != participants:
        raise RecordError(f"joinseq record for epoch {got_epoch} over {got_members} members read as the agreement "
                          f"of epoch {epoch} over {participants}: a stale or foreign record; delete it")
    return seq


def encode_own(seq: int) -> bytes:
    """An old member's own record (the per-member agreement's): ``{"seq": n}``."""
    return json.dumps({"seq": check_seq(seq, "announced seq")}, separators=(",", ":")).encode()


def encode_cover(epoch: int, seq: int, participants: int, pos: int, got: Iterable[int]) -> bytes:
    """A fallen-back old member's covering record: ``{"seq", "epoch", "members", "pos",
    "got"}``, ``seq`` the maximum over the member at position ``pos`` and the subtrees of
    its children at positions ``got`` (those it heard from)."""
    return json.dumps({"seq": check_seq(seq, "covered seq"), "epoch": epoch, "members": participants, "pos": pos,
                       "got": sorted(got)}, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Entry:
    """One ``joinseq`` key, decoded: ``kind`` ``agreed`` (the root's record), ``cover`` (a
    covering record: ``pos`` and the child positions ``got``) or ``own`` (the per-member
    agreement's ``{"seq": n}``: it covers its writer alone)."""

    seq: int
    kind: str
    pos: int | None = None
    got: tuple[int, ...] = ()


def parse_entry(raw: bytes, epoch: int, participants: int) -> Entry:
    """Decode one ``joinseq`` key (see :class:`Entry`), validated like every etcd record:
    RecordError naming the rule for a malformed one, or a root or covering record of
    another epoch or participant count (a record from another tree is never used)."""
    f = records.fields("rendezvous", raw, "joinseq")
    if not f.has("members"):
        return Entry(int(f.int("seq", hi=MAX_SEQ)), "own")
    if not f.has("pos"):
        return Entry(decode_agreed(raw, epoch, participants), "agreed")
    seq = int(f.int("seq", hi=MAX_SEQ))
    got_epoch, got_members = int(f.int("epoch")), int(f.int("members"))
    if got_epoch != epoch or got_members != participants:
        raise RecordError(f"joinseq covering record for epoch {got_epoch} over {got_members} members read in epoch "
                          f"{epoch} over {participants}: a stale or foreign record; delete it")
    return Entry(seq, "cover", int(f.int("pos", hi=participants - 1)),
                 tuple(f.ints("got", hi=max(0, participants - 1))))


def covered_max(entries: Mapping[int, Entry], participants: int, arity: int = ARITY) -> int | None:
    """The maximum over ``entries`` (position -> its key's :class:`Entry`) once they cover
    every position of the tree of ``participants`` old members, else None. A position is
    covered by its own entry, or by an ancestor's covering entry whose ``got`` holds the
    child on the path (that subtree's maximum is in it). Cost: the entries and their
    children, not the whole tree, unless every position has an entry of its own."""
    best = -1
    stack = [0]
    while stack:
        p = stack.pop()
        e = entries.get(p)
        if e is None:
            return None
        best = max(best, e.seq)
        first = arity * p + 1
        stack.extend(c for c in range(first, min(first + arity, participants)) if c not in e.got)
    return best


def _placed(m: str, e: Entry, pos: int | None, arity: int, participants: int, where: str) -> Entry:
    """``e`` (the key of member ``m``, at position ``pos``) with its position; RecordError
    when a covering record names another position or children that are not ``m``'s."""
    if pos is None:
        raise RecordError(f"joinseq record of {m!r}, which is no old member of the agreement ({where})",
                          "rendezvous", "joinseq")
    if e.kind == "cover":
        first = arity * pos + 1
        if e.pos != pos or any(not first <= c < min(first + arity, participants) for c in e.got):
            raise RecordError(f"joinseq covering record of {m!r} names position {e.pos} and children {list(e.got)}; "
                              f"{m!r} is at {pos} ({where}): a foreign record", "rendezvous", "joinseq")
        return e
    return Entry(e.seq, e.kind, pos)


def outcome(got: Mapping[str, bytes], tree: JoinTree, epoch: int,
            parsed: dict[str, tuple[bytes, Entry]] | None = None) -> int | None:
    """The agreed seq from the ``joinseq`` keys seen (member id -> payload): the root's
    record; else the maximum over the covering and own records once they cover every old
    member (:func:`covered_max`); else None (not known yet). RecordError for a malformed
    key it reads. Keys of members that are no old member are not read. ``parsed``: a
    cache kept across calls of one wait (member id -> its payload and validated entry), so
    a wait woken for every new key parses each key once, not once per wake."""
    n = len(tree.members)
    root = got.get(tree.root)
    if root is not None:
        e = parse_entry(root, epoch, n)
        if e.kind == "agreed":
            return e.seq
    entries: dict[int, Entry] = {}
    for m, raw in got.items():
        pos = tree.index_of(m)
        if pos is None:
            continue
        hit = None if parsed is None else parsed.get(m)
        if hit is not None and hit[0] == raw:
            entries[pos] = hit[1]
            continue
        entries[pos] = _placed(m, parse_entry(raw, epoch, n), pos, tree.arity, n, f"epoch {epoch}")
        if parsed is not None:
            parsed[m] = (raw, entries[pos])
    return covered_max(entries, n, tree.arity)


def admission_complete(got: Mapping[str, bytes], old_position: Callable[[str], int | None], n_olds: int,
                       epoch: int, arity: int = ARITY) -> bool:
    """Whether the ``joinseq`` keys ``got`` (member id -> payload) of growing epoch
    ``epoch`` with ``n_olds`` old members hold the agreement's result in either form: a
    root record of this epoch over ``n_olds`` members under an old member's key, or
    covering and own records that cover every old member (``old_position``: an old
    member's position in the epoch's order, None for any other id). Costs O(keys) position
    lookups (the coordinator's check each pass: docs/recovery.md, "a removal while an
    admission is pending"); a malformed key is no result."""
    if n_olds <= 0:
        return True   # nobody was there before: nothing to agree
    entries: dict[int, Entry] = {}
    for m, raw in got.items():
        pos = old_position(m)
        if pos is None:
            continue
        try:
            e = _placed(m, parse_entry(raw, epoch, n_olds), pos, arity, n_olds, f"epoch {epoch}")
        except RecordError:
            continue
        if e.kind == "agreed":
            return True
        entries[pos] = e
    return covered_max(entries, n_olds, arity) is not None


def wait_outcome(view: AgreementView, epoch: EpochLike, timeout: float) -> int:
    """The agreed seq of growing ``epoch`` (either form, :func:`outcome`), waited for by a
    member that takes no part (a joiner, or a member reading a superseded agreement): a
    result already in etcd is returned even when a newer epoch is out; else EpochChanged /
    TimeoutError / RecordError as :meth:`JoinAgreement.wait`."""
    return _wait_outcome(view, JoinTree(old_members(epoch)), epoch.number, timeout)


def _wait_outcome(view: AgreementView, tree: JoinTree, epoch: int, timeout: float) -> int:
    parsed: dict[str, tuple[bytes, Entry]] = {}
    return view.wait_blobs_until(epoch, BLOB, lambda got: outcome(got, tree, epoch, parsed), timeout)


class Channel(Protocol):
    """The data-plane side of the agreement: deliver ``seq`` (this member's subtree
    maximum for the growing epoch ``epoch``) to ``parent``, whose :meth:`JoinAgreement.on_child`
    it must reach. Best effort: a lost message makes the agreement time out (or a newer
    epoch supersede it), never agree on a wrong seq."""

    def send_up(self, parent: str, epoch: int, seq: int) -> None: ...


class JoinAgreement:
    """The agreement of one growing ``epoch`` at one participant (an old member, or a
    joiner that only :meth:`wait` s). See the module docstring for the protocol and the
    failure behaviour."""

    def __init__(self, view: AgreementView, epoch: EpochLike, member: str, channel: Channel,
                 arity: int = ARITY) -> None:
        self.view, self.number, self.member, self.channel = view, epoch.number, member, channel
        self.tree = JoinTree(old_members(epoch), arity)
        self.reduction = Reduction(self.tree, member) if member in self.tree.members else None
        self._write = threading.Lock()   # the root's record vs its covering record (module docstring)
        self._recorded = False           # the root's record is written (never overwritten by a covering one)
        self._stalled = False            # ``stall`` passed without a result (rule a)
        self._covered: frozenset[int] | None = None   # children positions its written covering record heard
        #: whether this member wrote a covering record (the tree stalled; see :meth:`settle`)
        self.fell_back = False
        self._parsed: dict[str, tuple[bytes, Entry]] = {}   # outcome's cache over this agreement's waits

    def contribute(self, seq: int) -> None:
        """An old member's announced seq (call it once, off the op thread)."""
        if self.reduction is None:
            raise ValueError(f"member {self.member} is not an old member of epoch {self.number}: it only waits")
        self._forward(self.reduction.offer(seq))

    def on_child(self, child: str, seq: object) -> None:
        """A child's subtree maximum arrived (the channel's receiver calls this)."""
        if self.reduction is None:
            raise FrameError(f"member {child} sent a join seq for epoch {self.number} to {self.member}, "
                                "which is no old member of it")
        self._forward(self.reduction.receive(child, seq))

    def _forward(self, subtree_max: int | None) -> None:
        if subtree_max is None:
            return
        parent = self.tree.parent(self.member)
        if parent is None:
            with self._write:
                self.view.put_blob(self.number, BLOB, encode_agreed(self.number, subtree_max, len(self.tree.members)))
                self._recorded = True
        else:
            self.channel.send_up(parent, self.number, subtree_max)

    def wait(self, timeout: float) -> int:
        """The agreed seq (:func:`outcome`): waits on this epoch's ``joinseq`` keys, one
        prefix watch (EpochChanged / TimeoutError / RecordError as the module docstring
        says)."""
        return _wait_outcome(self.view, self.tree, self.number, timeout)

    def settle(self, seq: int, stall: float, timeout: float) -> int:
        """An old member's wait for the agreed seq, ``seq`` being its own announced one,
        up to ``timeout`` in all: it writes its covering record when the tree alone cannot
        bring its part to the root (rules a-c of the module docstring: ``stall`` seconds
        without a result and its subtree incomplete; its parent's record without it; a
        child's record while its subtree is incomplete), and again when it has heard from
        more children since. Raises what :meth:`wait` raises. EpochChanged still writes
        its covering record first: the members adopt growing epochs in order, so a
        superseded one must still be able to complete."""
        if self.reduction is None:
            raise ValueError(f"member {self.member} is not an old member of epoch {self.number}: it only waits")
        if self.reduction.own is None:
            self.contribute(seq)   # announced here (the tracker contributes before it settles)
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= timeout:
                return self.wait(0.0)   # the last look: the result, or TimeoutError
            window = timeout - elapsed if self._stalled else min(stall - elapsed, timeout - elapsed)
            try:
                got = self.view.wait_blobs_until(self.number, BLOB, self._outcome_or_cover, max(0.0, window))
            except TimeoutError:   # ResilientTimeout from the etcd view
                if self._stalled:
                    raise
                self._stalled = True
                if self._incomplete():
                    self._fall_back(f"the tree gave no result within {stall:.1f}s")
                continue
            except EpochChanged:
                try:
                    self._fall_back("a newer epoch is out")
                except Exception as exc:  # noqa: BLE001 - the EpochChanged is what the caller acts on
                    log.warning("join agreement of epoch %d: member %s could not write its covering record: %s",
                                self.number, self.member, exc)
                raise
            if got >= 0:
                return got
            self._fall_back("the records around it need its own")

    def _incomplete(self) -> bool:
        assert self.reduction is not None
        return not self.reduction.done

    def _heard(self) -> frozenset[int]:
        """The positions of the children whose subtree maximum this member received."""
        assert self.reduction is not None
        return frozenset(self.tree.position(c) for c in self.reduction.heard())

    def _fall_back(self, why: str) -> None:
        """Write (or widen) this member's covering record; never over the root's record."""
        assert self.reduction is not None
        with self._write:
            if self._recorded:   # the root never replaces its record (module docstring)
                return
            own, got = self.reduction.own, self.reduction.heard()
            heard = frozenset(self.tree.position(c) for c in got)
            if own is None or self._covered is not None and heard <= self._covered:
                return   # nothing announced yet (contribute comes first), or written already, covering as much
            subtree = max([own, *got.values()])
            self.view.put_blob(self.number, BLOB, encode_cover(self.number, subtree, len(self.tree.members),
                                                               self.tree.position(self.member), heard))
            self._covered = heard
            self.fell_back = True
        log.info("join agreement of epoch %d: %s; member %s wrote its covering record (op #%d, %d of %d children)",
                 self.number, why, self.member, subtree, len(heard), len(self.tree.children(self.member)))

    def _outcome_or_cover(self, got: Mapping[str, bytes]) -> int | None:
        """:func:`outcome`; else -1 when this member must write (or widen) its covering
        record now (rules a-c); else None (wait on)."""
        result = outcome(got, self.tree, self.number, self._parsed)
        if result is not None:
            return result
        if self._recorded or self.reduction is None or self.reduction.own is None:
            return None   # the root's record is out (the watch will show it), or nothing announced yet
        heard = self._heard()
        if self._covered is not None and heard <= self._covered:
            return None   # what it could add is there already
        n = len(self.tree.members)
        me = self.tree.position(self.member)
        parent = self.tree.parent(self.member)
        if parent is not None and parent in got:
            p = parse_entry(got[parent], self.number, n)
            if p.kind != "agreed" and me not in p.got:
                return -1   # (b) its parent's record did not hear from it
        incomplete = self._incomplete()
        if incomplete and any(c in got for c in self.tree.children(self.member)):
            return -1       # (c) a child fell back: its subtree cannot reach this member by the tree
        if incomplete and self._stalled:
            return -1       # (a) stalled with its subtree incomplete
        if self._covered is not None and heard > self._covered:
            return -1       # written before: now it can cover more
        return None
