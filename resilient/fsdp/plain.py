"""Plain FSDP (one replica group, a 1-D mesh) survives a lost member, with no checkpoint.

A plain FSDP shard group on the resilient backend keeps its *logical* members — the ranks
``fully_shard`` sharded over — for the rest of the job: its ``rank()`` and ``size()`` do not
change when a member dies, so FSDP's shard layout stays valid. What changes is who holds
each shard:

- **Peer copy** (:mod:`.peer_copy`, :mod:`.plain_settle`): after every optimizer step each
  member sends its shards and their optimizer state to its buddy (the next live member) and
  all *commit* the step together.
- **Hosting** (:mod:`.orphans`, here): a dead member's buddy turns the committed copy into
  an orphan and stands in for it in FSDP's collectives. An all-gather runs over every
  member while all are live; after a loss it runs as a SUM all-reduce of a buffer in which
  each live member copies its slot and each host the slots of the members it hosts (copies
  among zeros: exact), with one flag per slot so every member sees whether every slot was
  filled. A reduce-scatter runs as an all-reduce of the whole input over the live members,
  each taking its own chunk and a host its orphans'. FSDP's divide factors are those of the
  live count, so each gradient is the mean over the members that contributed.
- **Redo** (:mod:`.plain_settle`): a step the loss cut through is redone at its optimizer
  step, bitwise as if the dead member had left cleanly before it.

Every decision that changes which op runs next is taken from what all members agree on —
an op's contributors, an all-reduce's result, the committed membership — never from a
member's own view of the epoch, which reaches members at different moments. An op whose
kind differs between members for that reason (one saw the loss, another not yet) fails on
all of them and is run again the same way on all.

A host copies its orphans on: its own peer copy carries them, so when the host is lost
too, its buddy takes over its shards and theirs.

Failure behaviour: a member lost together with its buddy in one step (no copy survives)
makes the ops that need its shards raise :class:`~resilient.errors.DataLost` naming both; so
does a loss before the first committed step. Ops that keep failing (more than :data:`MAX_ROUNDS` rounds)
raise :class:`~resilient.errors.CollectiveError`.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from resilient.errors import CollectiveError, ConfigError, DataLost, GroupChanged, InputMismatch
from resilient.fsdp.orphans import Orphan
from resilient.fsdp.peer_copy import Layout

log = logging.getLogger(__name__)

__all__ = ["PlainShards", "PLAIN", "MAX_ROUNDS", "check_supported"]

MAX_ROUNDS = 3
#: what a member sees when it and another disagree on the membership an op starts in
_RETRY = (GroupChanged, DataLost, InputMismatch, ConfigError)


@dataclasses.dataclass
class Call:
    """One FSDP collective call in progress (set by the wrappers of :mod:`.patches`)."""

    indices: list[int]
    #: ``factors_for(n) -> (pre, post, rs_op, ar_op)`` for n contributing members
    factors_for: Callable[[int], tuple[Any, Any, Any, Any]] | None = None
    factors: tuple[Any, Any, Any, Any] | None = None


@dataclasses.dataclass
class Reduction:
    """A reduce-scatter of the step: its input (kept for a redo), its output (FSDP's
    gradients are views of it), how it ran and the chunks of the members this one hosts."""

    call: Call
    inp: torch.Tensor
    output: torch.Tensor
    op: str
    work: Any
    orphan_chunks: dict[str, torch.Tensor]
    #: the pre-divide factor ``inp`` was divided by, and the post-divide factor of the chunks
    pre: Any = None
    post: Any = None


class _Done:
    """A finished op's handle (the engine's Handle protocol)."""

    def __init__(self, contributors: tuple[str, ...]) -> None:
        self.contributors = contributors

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Fallback:
    """A handle whose first try (``first``: the group's op over every member and what to run
    once it is done) is run again by ``retry`` if it fails because the membership changed
    before or in it — on the thread that waits, so every member runs the retry at the same
    point of its program. Without a first try, ``retry`` is the op."""

    def __init__(self, first: tuple[Any, Callable[[], object] | None] | None, retry: Callable[[], Any],
                 whole: Callable[[Any], bool] | None = None) -> None:
        #: ``whole(handle)``: whether a first try that did not raise delivered everything
        self.first, self._retry, self._whole = first, retry, whole
        self._h: Any = None if first is None else first[0]
        self._settled = False
        #: the first try delivered (as opposed to the retry)
        self.delivered_first = False

    @property
    def contributors(self) -> tuple[str, ...]:
        return tuple(self._h.contributors)

    def wait(self, timeout: float | None = None) -> bool:
        if self._settled:
            return True
        if self._h is None:
            self._h, self._settled = self._retry(), True
            return True
        if timeout is not None:
            return bool(self._h.wait(timeout))
        try:
            self._h.wait()
            if self._whole is not None and not self._whole(self._h):
                raise DataLost(f"the op ended with only {sorted(self._h.contributors)}")
            self.delivered_first = True
        except _RETRY as exc:
            log.warning("plain FSDP: %s; run again over the live members and the hosts", exc)
            self._h = self._retry()
        self._settled = True
        return True

    def finish(self) -> None:
        """The first try's completion step (dtype write-back), when it is what delivered."""
        if self.delivered_first and self.first is not None and self.first[1] is not None:
            self.first[1]()

    def is_completed(self) -> bool:
        return bool(self._h.is_completed())


class PlainShards:
    """The plain FSDP group of this process (see the module docstring; one: :data:`PLAIN`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.pg: Any = None
        self.members: tuple[str, ...] = ()
        self.me: str = ""
        self.index: dict[str, int] = {}
        self.fsdp_params: list[Any] = []
        self._param_index: dict[int, int] = {}
        #: the members of the last committed step (agreed)
        self.committed_live: tuple[str, ...] = ()
        #: this member's copy of the last committed step (its rollback point)
        self.own_copy: torch.Tensor | None = None
        #: the predecessor's copy of the last committed step
        self.copies: dict[str, torch.Tensor] = {}
        #: the buffers of the step before the committed one, reused for the next copy
        self.spare_own: torch.Tensor | None = None
        self.spare_copy: torch.Tensor | None = None
        #: the buffer ``copies`` are sections of
        self.copy_buf: torch.Tensor | None = None
        self.orphans: dict[str, Orphan] = {}
        self._hosts: dict[str, str] = {}
        #: per member, the lost members whose shards its last committed copy carried
        self.carried: dict[str, tuple[str, ...]] = {}
        self.reductions: list[Reduction] = []
        self.in_settle = False
        self.optimizer: Any = None
        self.layout: Layout | None = None
        self.steps = 0
        #: steps redone after a loss, and the seconds each step's peer copy took (bench/fsdp.py)
        self.steps_redone = 0
        self.copy_s: list[float] = []
        self.disabled: str | None = None

    # -- registration (FSDPParamGroup.__init__) ------------------------------------

    def register(self, pg: Any, fsdp_params: Sequence[Any]) -> None:
        world = pg.engine.world()
        with self._lock:
            if self.pg is None:
                self.pg, self.members, self.me = pg, tuple(world.members), world.member_id
                self.index = {m: i for i, m in enumerate(self.members)}
                self.committed_live = self.members
                pg.shards = self
            elif pg is not self.pg:
                self.disabled = "FSDP parameter groups shard over different groups"
                log.error("resilient: plain FSDP over two different groups; only the first is protected")
                return
            for fp in fsdp_params:
                self._param_index[id(fp)] = len(self.fsdp_params)
                self.fsdp_params.append(fp)

    @property
    def logical_rank(self) -> int:
        return self.index[self.me]

    @property
    def logical_size(self) -> int:
        return len(self.members)

    def live(self) -> tuple[str, ...]:
        """This member's view of the live members (not agreed: only to choose a first try)."""
        current = set(self.pg.engine.world().members)
        return tuple(m for m in self.members if m in current)

    def in_order(self, members: Iterable[str]) -> tuple[str, ...]:
        have = set(members)
        return tuple(m for m in self.members if m in have)

    def host_of(self, member: str) -> str:
        """The member that received lost ``member``'s last committed copy: its buddy at the
        last commit before the loss (remembered for the rest of the job)."""
        host = self._hosts.get(member)
        if host is None:
            ring = self.committed_live
            host = self._hosts[member] = ring[(ring.index(member) + 1) % len(ring)]
        return host

    def holder(self, member: str, present: Iterable[str]) -> str | None:
        """The member of ``present`` that holds lost ``member``'s shards: the member that
        received its copy, or, when that one was lost too, whoever received *its* copy — a
        host's copy carries the orphans it hosted at that commit. None: no copy survives
        (the member was lost together with its host, before the host had copied it on)."""
        have = set(present)
        host, seen = self.host_of(member), {member}
        while host not in have:
            if host in seen or member not in self.carried.get(host, ()):
                return None
            seen.add(host)
            host = self.host_of(host)
        return host

    def hosted_by(self, who: str, present: Sequence[str] | set[str]) -> list[str]:
        """The members not in ``present`` whose shards ``who`` holds (member order)."""
        have = set(present)
        return [m for m in self.members if m not in have and self.holder(m, have) == who]

    def hosted(self, present: Sequence[str] | set[str]) -> list[str]:
        """The members not in ``present`` that this one hosts."""
        return self.hosted_by(self.me, present)

    def check_hosts(self, present: Sequence[str] | set[str]) -> None:
        have = set(present)
        for m in self.members:
            if m not in have and self.holder(m, have) is None:
                raise DataLost(f"plain FSDP: {m} and {self.host_of(m)}, which received its peer copy, are both lost "
                               "before that copy was copied on; its shards exist nowhere (restore from a checkpoint)")

    def orphan(self, member: str) -> Orphan:
        """The orphan of ``member`` on this host, made from the committed copy if new."""
        o = self.orphans.get(member)
        if o is None:
            copy = self.copies.get(member)
            if copy is None or self.layout is None:
                raise DataLost(f"plain FSDP: {member} was lost before its first peer copy was committed; "
                               "its shards exist nowhere (restore from a checkpoint)")
            params, states = self.layout.unpack(copy)
            o = self.orphans[member] = Orphan(member, params, states)
            log.warning("plain FSDP: %s hosts the shards of the lost %s from its peer copy", self.me, member)
        return o

    def chunk(self, flat: torch.Tensor, member: str) -> torch.Tensor:
        n = flat.numel() // self.logical_size
        i = self.index[member]
        return flat.reshape(-1)[i * n:(i + 1) * n]

    # -- the FSDP call in progress (thread-local, set by the wrappers) -------------

    def begin(self, fsdp_params: Sequence[Any]) -> Call:
        call = Call([self._param_index[id(fp)] for fp in fsdp_params if id(fp) in self._param_index])
        self._local.call = call
        return call

    def end(self) -> None:
        self._local.call = None

    def current(self) -> Call | None:
        return getattr(self._local, "call", None)

    # -- the collectives -----------------------------------------------------------

    def all_gather(self, target: torch.Tensor, inp: torch.Tensor, back: Callable[[], object] | None,
                   start: Callable[[], tuple[Any, Callable[[], object] | None]]) -> Any:
        """FSDP's all-gather into ``target``: ``start()`` (the group's own all-gather over
        every member) while all are live; else, or when that fails, see the module."""
        from resilient.torch_backend.composed import _chain
        from resilient.torch_backend.work import ResilientWork

        call = self.current()
        handle = self._first_or_retry(start, lambda: self._gather_by_sum(target, inp, call), self._everyone)
        return ResilientWork(handle, [target], _chain(handle.finish, back))

    def _first_or_retry(self, start: Callable[[], tuple[Any, Callable[[], object] | None]],
                        retry: Callable[[], Any], whole: Callable[[Any], bool] | None = None) -> "_Fallback":
        """The op over every member while all are live, falling back to ``retry``; run at
        once when not all are live (the caller's program order, as on every member)."""
        handle = _Fallback(start() if self.live() == self.members else None, retry, whole)
        if handle.first is None:
            handle.wait()
        return handle

    def _everyone(self, handle: Any) -> bool:
        return set(handle.contributors) >= set(self.members)

    def _gather_by_sum(self, target: torch.Tensor, inp: torch.Tensor, call: Call | None) -> Any:
        n, m = len(self.members), inp.numel()
        for _ in range(MAX_ROUNDS + 1):
            live = set(self.live())
            gone = [x for x in self.members if x not in live]
            if gone and call is None:
                raise DataLost(f"all_gather over a plain FSDP group: {gone} were lost and this is not an FSDP "
                               "all-gather; their slots have no copy")
            buf = torch.zeros(n * m + n, dtype=target.dtype)  # the slots, then one flag per slot
            buf[self.logical_rank * m:(self.logical_rank + 1) * m].copy_(inp.reshape(-1))
            buf[n * m + self.logical_rank] = 1
            for x in gone:
                if self.holder(x, live) == self.me:
                    assert call is not None
                    i = self.index[x]
                    buf[i * m:(i + 1) * m].copy_(self.orphan(x).all_gather_input(call.indices).view(buf.dtype))
                    buf[n * m + i] = 1
            h = self.pg.engine.allreduce(buf, "sum")
            try:
                h.wait()
            except _RETRY as exc:
                log.warning("plain FSDP all-gather: %s; again", exc)
                continue
            self.check_hosts(h.contributors)
            if bool((buf[n * m:] == 1).all()):
                target.view(-1).copy_(buf[:n * m])
                return _Done(tuple(h.contributors))
            self._await_view(set(h.contributors))  # a host had not seen the loss yet: once it has, again
        raise CollectiveError(f"plain FSDP all-gather: the members kept changing (live {list(self.live())})")

    def _await_view(self, present: set[str], timeout: float = 30.0) -> None:
        """Until this member's epoch view no longer shows a member outside ``present`` (an
        op's contributors: those lost in it are published within the lease TTL), or
        ``timeout`` passes (the next round then says what is missing)."""
        deadline = time.monotonic() + timeout
        while set(self.live()) - present and time.monotonic() < deadline:
            time.sleep(0.005)

    def reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor, op: str,
                       start: Callable[[], tuple[Any, Callable[[], object] | None]]) -> Any:
        """FSDP's reduce-scatter, kept for a redo until the step commits: ``start()`` (the
        group's own reduce-scatter over every member) while all are live; see the module."""
        from resilient.torch_backend.dtypes import for_reduce
        from resilient.torch_backend.work import ResilientWork

        engine = self.pg.engine
        chunks: dict[str, torch.Tensor] = {}
        def by_sum() -> Any:
            for _ in range(MAX_ROUNDS + 1):
                x = inp.detach().clone()
                wire, wop, wb = for_reduce(x, op, "reduce_scatter_tensor")
                h = engine.allreduce(wire, wop)
                try:
                    h.wait()
                except _RETRY as exc:
                    log.warning("plain FSDP reduce-scatter: %s; again", exc)
                    continue
                if wb is not None:
                    wb()
                output.view(-1).copy_(self.chunk(x, self.me))
                chunks.clear()
                chunks.update({x_: self.chunk(x, x_).clone() for x_ in self.hosted(h.contributors)})
                return _Done(tuple(h.contributors))
            raise CollectiveError("plain FSDP reduce-scatter: the members kept changing")
        handle = self._first_or_retry(start, by_sum)
        work = ResilientWork(handle, [output], handle.finish)
        call = self.current() or Call([])
        pre, post = (call.factors or (None, None))[:2]
        with self._lock:
            self.reductions.append(Reduction(call, inp, output, op, work, chunks, pre, post))
        return work


PLAIN = PlainShards()


def check_supported(fsdp_param_group: Any) -> str | None:
    """Why a plain FSDP parameter group cannot be protected (None: it can)."""
    for fp in fsdp_param_group.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            return "a parameter is sharded on a dimension other than 0 (shard_placement_fn)"
        if getattr(fp, "param_dtype", None) not in (None, fp._sharded_param_data.dtype):
            return "mixed precision (param_dtype): the all-gather carries a cast, not the shard"
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload"
    return None
