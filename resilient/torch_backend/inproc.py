"""An in-process engine: a world of threads in one process.

For unit tests of the translation logic (process group, DDP hook, State) only — it
stands in for :class:`resilient.collectives.Communicator` where no network is needed.
Every member calls ops in the same order; op ``k`` of every member meets in a shared slot.
:meth:`InProcWorld.kill` removes a member: ops in flight complete over the members that
had deposited their input (exactly like a death during reduce-scatter — ``contributors``
shrinks), later ops run without it, and the epoch number goes up. :meth:`InProcWorld.join`
adds a member (it starts at the next op). Nothing here touches sockets or etcd.

As an :class:`~.engine.ElasticEngine` it admits joiners by itself (``join``), not by
rebuilding: ``admits_by_rebuild`` is False, no joiner is ever pending or unadmitted, and
the rebuild calls raise :class:`~resilient.errors.UnsupportedOperation`.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import torch

from resilient.errors import InputMismatch, RemovedFromGroup, UnsupportedOperation
from resilient.live_world import World

if TYPE_CHECKING:  # pragma: no cover
    from resilient.torch_backend.communicator_engine import Comm
    from resilient.torch_backend.engine import ElasticEngine


#: one op's shared record: kind, inputs / handles by member, ring order, result
Slot = dict[str, Any]
#: ``compute(slot, contributors) -> result`` (run once, by the op's last depositor)
Compute = Callable[[Slot, tuple[str, ...]], Any]


class _Handle:
    def __init__(self) -> None:
        self.contributors: tuple[str, ...] = ()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.slot: Slot = {}

    def _set(self, contributors: tuple[str, ...], error: BaseException | None = None) -> None:
        self.contributors, self._error = contributors, error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class InProcWorld:
    """Shared state of one thread world (see the module docstring)."""

    def __init__(self, members: Sequence[str]) -> None:
        self.members: list[str] = list(members)
        self.epoch = 1
        self._cond = threading.Condition()
        self._slots: dict[int, Slot] = {}
        self._seq: dict[str, int] = {m: 0 for m in members}
        self._p2p: dict[tuple[str, str, int], list[torch.Tensor]] = {}

    def engine(self, member_id: str) -> "InProcEngine":
        return InProcEngine(self, member_id)

    def kill(self, member_id: str) -> None:
        """Remove ``member_id``: pending ops finish without it."""
        with self._cond:
            self.members.remove(member_id)
            self.epoch += 1
            self._cond.notify_all()

    def join(self, member_id: str, at_seq: int) -> None:
        """Add ``member_id``; its first op is op ``at_seq`` of the others."""
        with self._cond:
            self.members.append(member_id)
            self._seq[member_id] = at_seq
            self.epoch += 1
            self._cond.notify_all()

    def view(self, member_id: str) -> World:
        with self._cond:
            return World.from_members(member_id, self.epoch, self.members)

    # one collective: deposit, wait for every live member, compute once
    def _run(self, member: str, kind: str, payload: object, compute: Compute) -> _Handle:
        h = _Handle()
        with self._cond:
            if member not in self.members:
                raise RemovedFromGroup(f"member {member!r} was removed (epoch {self.epoch})")
            seq = self._seq[member]
            self._seq[member] = seq + 1
            slot = self._slots.setdefault(seq, {"kind": kind, "inputs": {}, "handles": {}, "order": None})
            if slot["order"] is None:
                slot["order"] = list(self.members)  # ranks as of the op's first caller
            slot["inputs"][member] = payload
            slot.setdefault("kinds", {})[member] = kind
            slot["handles"][member] = h
            h.slot = slot
            self._cond.notify_all()

        def finish() -> None:
            with self._cond:
                while not set(self.members) <= set(slot["inputs"]) and "result" not in slot:
                    self._cond.wait()
                if "result" not in slot:
                    kinds = set(slot["kinds"].values())
                    # ranks as of completion: the live members that deposited, in ring order
                    contributors = tuple(m for m in self.members if m in slot["inputs"])
                    slot["order"] = list(self.members)
                    try:
                        if len({k for k in kinds}) != 1:
                            raise InputMismatch(f"op #{seq}: members called different collectives {slot['kinds']}")
                        slot["result"] = (compute(slot, contributors), contributors, None)
                    except BaseException as exc:  # noqa: BLE001
                        slot["result"] = (None, contributors, exc)
                    self._cond.notify_all()
                value, contributors, error = slot["result"]
            h._set(contributors, error)

        threading.Thread(target=finish, daemon=True).start()
        return h


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op in ("sum", "avg"):
            acc += t
        elif op == "min":
            torch.minimum(acc, t, out=acc)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif op == "prod":
            acc *= t
    if op == "avg":
        acc = acc / len(tensors)
    return acc


class InProcEngine:
    """One member's :class:`~.engine.ElasticEngine` in an :class:`InProcWorld`."""

    #: no Communicator behind it (``resilient.ddp.compression_hook`` refuses it)
    comm: Comm | None = None
    #: joiners come in through :meth:`InProcWorld.join`, not by rebuilding
    admits_by_rebuild = False
    admitted = True

    def __init__(self, world: InProcWorld, member_id: str) -> None:
        self.w = world
        self.member_id = member_id

    def world(self) -> World:
        return self.w.view(self.member_id)

    # -- joiner admission: not by rebuilding (see the module docstring) --------------------

    def pending_joiners(self) -> bool:
        return False

    def job_done(self) -> bool:
        return False

    def mark_done(self) -> None:
        return None

    def _no_rebuild(self, call: str) -> NoReturn:
        raise UnsupportedOperation(f"{call} on the in-process engine",
                                   "it admits joiners with InProcWorld.join; check admits_by_rebuild first")

    def rebuild(self, min_epoch: int, timeout: float = 60.0) -> None:
        self._no_rebuild("rebuild()")

    def announce_ready(self) -> None:
        self._no_rebuild("announce_ready()")

    def wait_admitted(self, timeout: float = 120.0) -> None:
        self._no_rebuild("wait_admitted()")

    def _deliver(self, h: _Handle, write: Callable[[], object]) -> _Handle:
        """Write this member's output once the op is computed."""
        out = _Handle()

        def run() -> None:
            try:
                h.wait()
                write()
                out._set(h.contributors)
            except BaseException as exc:  # noqa: BLE001
                out._set(h.contributors, exc)

        threading.Thread(target=run, daemon=True).start()
        return out

    def allreduce(self, tensor: torch.Tensor, op: str) -> _Handle:
        me = self.member_id

        def compute(slot: Slot, contributors: tuple[str, ...]) -> Any:
            return _reduce([slot["inputs"][m] for m in contributors], op)

        h = self.w._run(me, f"allreduce-{op}-{tuple(tensor.shape)}", tensor.clone(), compute)
        return self._deliver(h, lambda: tensor.copy_(self._result_of(h, tensor)))

    @staticmethod
    def _result_of(h: _Handle, like: torch.Tensor) -> Any:
        return h.slot["result"][0]

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Handle:
        order = self.world().members

        def compute(slot: Slot, contributors: tuple[str, ...]) -> Any:
            src = slot["order"][root] if root < len(slot["order"]) else order[root]
            return slot["inputs"][src].clone()

        h = self.w._run(self.member_id, f"broadcast-{root}", tensor.clone(), compute)
        return self._deliver(h, lambda: tensor.copy_(self._result_of(h, tensor)))

    def allgather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> _Handle:
        def compute(slot: Slot, contributors: tuple[str, ...]) -> Any:
            return [slot["inputs"][m].clone() for m in contributors]

        h = self.w._run(self.member_id, "allgather", tensor.clone(), compute)

        def write() -> None:
            for o, r in zip(outputs, self._result_of(h, tensor)):
                o.copy_(r)

        return self._deliver(h, write)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str) -> _Handle:
        me = self.member_id

        def compute(slot: Slot, contributors: tuple[str, ...]) -> Any:
            return [_reduce([slot["inputs"][m][i] for m in contributors], op) for i in range(len(contributors))]

        h = self.w._run(me, f"reduce_scatter-{op}", [t.clone() for t in inputs], compute)
        return self._deliver(h, lambda: output.copy_(self._result_of(h, output)[h.contributors.index(me)]))

    def barrier(self) -> _Handle:
        h = self.w._run(self.member_id, "barrier", None, lambda slot, c: None)
        return self._deliver(h, lambda: None)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> _Handle:
        key = (self.member_id, self.world().members[dst], tag)
        h = _Handle()
        with self.w._cond:
            self.w._p2p.setdefault(key, []).append(tensor.clone())
            self.w._cond.notify_all()
        h._set((self.member_id,))
        return h

    def recv_any(self, tensor: torch.Tensor, tag: int) -> _Handle:
        h = _Handle()

        def run() -> None:
            with self.w._cond:
                while True:
                    key = next((k for k, q in self.w._p2p.items() if q and k[1:] == (self.member_id, tag)), None)
                    if key is not None:
                        break
                    self.w._cond.wait()
                tensor.copy_(self.w._p2p[key].pop(0))
            h._set((key[0],))

        threading.Thread(target=run, daemon=True).start()
        return h

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> _Handle:
        key = (self.world().members[src], self.member_id, tag)
        h = _Handle()

        def run() -> None:
            with self.w._cond:
                while not self.w._p2p.get(key):
                    self.w._cond.wait()
                tensor.copy_(self.w._p2p[key].pop(0))
            h._set((key[0],))

        threading.Thread(target=run, daemon=True).start()
        return h

    def close(self) -> None:
        return None


if TYPE_CHECKING:  # pragma: no cover - the type checker proves it is what a process group takes
    _IS_AN_ELASTIC_ENGINE: type[ElasticEngine] = InProcEngine
