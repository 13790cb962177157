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

**A stalled tree falls back to one key per old member.** A tree message can stall: a
member inside an op that does not progress the transport (the direct shared-memory
algorithms wait on futex words) sends and reads nothing until that op ends, and the op may
need a member that waits at its boundary for this very agreement. So each old member,
:meth:`JoinAgreement.settle`, waits ``stall`` seconds for the root's record; without it (or
as soon as another member's own record shows the fallback has begun) it also writes its own
announced seq under its own key (``{"seq": n}``, the per-member agreement's record). The
result is then read either way (:func:`outcome`): the root's record, or the maximum over
every old member's own record once all are there. In etcd a stalled agreement costs what
the per-member agreement always costs; an unstalled one costs one key.

Why the result is the same everywhere: every old member announces one seq per epoch, and
both forms of the result are the maximum over exactly those seqs — the root writes its
record only after every old member's seq went into it, and the per-member form needs every
old member's own record. So no member has started an op at or after the result in the
older epoch, and any mix of readers of the two forms agrees. The root's key holds either
its record or (fallen back first) its own seq; once its record is written the root never
writes its own seq over it (:meth:`JoinAgreement.settle` checks under the lock its record
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
from typing import Callable, Protocol, Sequence

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


def decode_entry(raw: bytes, epoch: int, participants: int) -> tuple[int, bool]:
    """``(seq, is_root_record)`` of one ``joinseq`` key: the root's record
    (:func:`decode_agreed`, it has ``members``) or an old member's own ``{"seq": n}``.
    RecordError naming the rule for anything else."""
    f = records.fields("rendezvous", raw, "joinseq")
    if f.has("members"):
        return decode_agreed(raw, epoch, participants), True
    return int(f.int("seq", hi=MAX_SEQ)), False


def outcome(got: Mapping[str, bytes], tree: JoinTree, epoch: int) -> int | None:
    """The agreed seq from the ``joinseq`` keys seen (member id -> payload): the root's
    record; else, once every old member's own record is there, their maximum; else None
    (not known yet). RecordError for a malformed key it reads."""
    n = len(tree.members)
    root = got.get(tree.root)
    if root is not None:
        seq, is_record = decode_entry(root, epoch, n)
        if is_record:
            return seq
    if len(got) < n or any(m not in got for m in tree.members):
        return None
    return max(decode_entry(got[m], epoch, n)[0] for m in tree.members)


def admission_complete(got: Mapping[str, bytes], is_old: Callable[[str], bool], n_olds: int, epoch: int) -> bool:
    """Whether the ``joinseq`` keys ``got`` (member id -> payload) of growing epoch
    ``epoch`` with ``n_olds`` old members (``is_old``) hold the agreement's result in
    either form: a root record of this epoch over ``n_olds`` members under an old member's
    key, or every old member's own record. Needs no member order and costs O(keys), not
    O(members) (the coordinator's check each pass: docs/recovery.md, "a removal while an
    admission is pending"); a malformed key is no result."""
    if n_olds <= 0:
        return True   # nobody was there before: nothing to agree
    own = 0
    for m, raw in got.items():
        if not is_old(m):
            continue
        try:
            _, is_record = decode_entry(raw, epoch, n_olds)
        except RecordError:
            continue
        if is_record:
            return True
        own += 1
    return own == n_olds


def wait_outcome(view: AgreementView, epoch: EpochLike, timeout: float) -> int:
    """The agreed seq of growing ``epoch`` (either form, :func:`outcome`), waited for by a
    member that takes no part (a joiner, or a member reading a superseded agreement): a
    result already in etcd is returned even when a newer epoch is out; else EpochChanged /
    TimeoutError / RecordError as :meth:`JoinAgreement.wait`."""
    return _wait_outcome(view, JoinTree(old_members(epoch)), epoch.number, timeout)


def _wait_outcome(view: AgreementView, tree: JoinTree, epoch: int, timeout: float) -> int:
    return view.wait_blobs_until(epoch, BLOB, lambda got: outcome(got, tree, epoch), timeout)


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
        self._write = threading.Lock()   # the root's record vs its own fallback record (module docstring)
        self._recorded = False           # the root's record is written (never overwritten by its own seq)
        #: whether this member wrote its own record (the tree stalled; see :meth:`settle`)
        self.fell_back = False

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
        """An old member's wait for the agreed seq, ``seq`` being its own announced one:
        up to ``stall`` seconds for the tree's result; then (or at once when another
        member's own record shows the fallback has begun) it writes its own record too and
        waits for whichever form completes first, up to ``timeout`` in all. Raises what
        :meth:`wait` raises. EpochChanged in the first phase still writes the own record
        first: the members adopt growing epochs in order, so a superseded one must still be
        able to complete."""
        if self.reduction is None:
            raise ValueError(f"member {self.member} is not an old member of epoch {self.number}: it only waits")
        start = time.monotonic()
        try:
            got = self.view.wait_blobs_until(self.number, BLOB, self._outcome_or_fallback, min(stall, timeout))
        except TimeoutError:   # ResilientTimeout from the etcd view
            got = None
        except EpochChanged:
            # superseded by a growing epoch, the members still adopt this one first (in
            # order): its per-member form must be able to complete whatever the tree does
            try:
                self._fall_back(seq, "a newer epoch is out")
            except Exception as exc:  # noqa: BLE001 - the EpochChanged is what the caller acts on
                log.warning("join agreement of epoch %d: member %s could not write its own join seq: %s",
                            self.number, self.member, exc)
            raise
        if got is not None and got >= 0:
            return got
        self._fall_back(seq, f"the tree gave no result within {stall:.1f}s")
        return self.wait(max(0.0, timeout - (time.monotonic() - start)))

    def _fall_back(self, seq: int, why: str) -> None:
        """Write this member's own record (once; never over the root's record)."""
        with self._write:
            if self._recorded or self.fell_back:   # the root never replaces its record (module docstring)
                return
            self.view.put_blob(self.number, BLOB, encode_own(seq))
            self.fell_back = True
        log.info("join agreement of epoch %d: %s; member %s wrote its own join seq (op #%d)", self.number, why,
                 self.member, seq)

    def _outcome_or_fallback(self, got: Mapping[str, bytes]) -> int | None:
        """:func:`outcome`, or -1 once a member's own record is there (the fallback began)."""
        result = outcome(got, self.tree, self.number)
        if result is not None:
            return result
        if any(m != self.tree.root or not decode_entry(got[m], self.number, len(self.tree.members))[1]
               for m in got if m != self.member):
            return -1
        return None
