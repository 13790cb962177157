"""What the torch process group needs from the collectives: the :class:`Engine` protocol,
and what ``resilient.elastic``/``resilient.ddp`` need beyond it: :class:`ElasticEngine`.

The process group (:mod:`.process_group`) translates ``torch.distributed`` calls into
these few calls; :mod:`.communicator_engine` implements them over
:class:`resilient.collectives.Communicator` (the real thing), and :mod:`.inproc` over
threads of one process (unit tests of the translation logic only).

Every call is asynchronous and returns a :class:`Handle`. Results are written into the
tensors passed in (torch's in-place convention); ``Handle.contributors`` is the exact set
of member ids whose inputs are in the result (for ``avg`` the divisor is its size).

Failure behaviour every engine keeps: when a member dies mid-op the op is finished by the
survivors and ``contributors`` says who is in the result; an op that cannot deliver its
contract fails its handle with a :class:`~resilient.errors.CollectiveError`; ``wait``
re-raises it in the caller.

:class:`ElasticEngine` adds the joiner admission of ``resilient.elastic.State.sync()``
and what the DDP hooks read (member id, admitted, the Communicator). Every engine a
:class:`~.process_group.ResilientProcessGroup` holds implements it; an engine that does
not admit joiners by rebuilding (the in-process one) says so with
``admits_by_rebuild = False`` and never has those calls made (they raise
:class:`~resilient.errors.UnsupportedOperation`). :func:`resilient.torch_backend.engine_of`
is the one way elastic and ddp reach a group's engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from resilient.live_world import World

if TYPE_CHECKING:  # pragma: no cover
    from resilient.torch_backend.communicator_engine import Comm

#: reduce ops every engine accepts (names, as the Communicator spells them)
REDUCE_OPS = ("sum", "avg", "min", "max", "prod")


class Handle(Protocol):
    """One op in flight."""

    @property
    def contributors(self) -> tuple[str, ...]:
        """The member ids whose inputs are in the result (once done)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; True when done, False if ``timeout`` passed; re-raises the
        op's error."""

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not)."""


class Engine(Protocol):
    """The collectives, seen by the process group (see the module docstring)."""

    def world(self) -> World:
        """The live world of this member (raises RemovedFromGroup once removed)."""

    def allreduce(self, tensor: torch.Tensor, op: str) -> Handle: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> Handle: ...

    def allgather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """``outputs[r]`` receives rank r's ``tensor`` (ranks of the op's world)."""

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str) -> Handle:
        """``output`` receives the reduction of every member's ``inputs[my rank]``."""

    def barrier(self) -> Handle: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...

    def recv_any(self, tensor: torch.Tensor, tag: int) -> Handle:
        """A receive from whichever rank's message comes first; the handle's
        contributors name the sender."""

    def close(self) -> None: ...


class ElasticEngine(Engine, Protocol):
    """An :class:`Engine` as ``resilient.elastic.State`` and ``resilient.ddp`` use it (see
    the module docstring). Failure behaviour: the control-plane calls raise
    :class:`~resilient.errors.StoreError` when etcd cannot be read or written (the caller's
    ``sync()`` fails rather than guess)."""

    @property
    def member_id(self) -> str:
        """This member's id."""

    @property
    def admitted(self) -> bool:
        """False on a joiner until :meth:`wait_admitted` returned (its DDP constructor then
        runs no collective)."""

    @property
    def comm(self) -> Comm | None:
        """The Communicator the ops run on (behind its not-admitted gate on a joiner);
        None for an engine without one (the in-process test engine)."""

    @property
    def admits_by_rebuild(self) -> bool:
        """True when joiners are admitted at ``State.sync()`` by every member calling
        :meth:`rebuild` and the joiner :meth:`announce_ready` + :meth:`wait_admitted`;
        False when the engine's group takes joiners in by itself (a joiner then takes part
        in the exchange and gets the broadcast)."""

    def pending_joiners(self) -> bool:
        """True when admitted joiners are waiting in ``State.sync()`` to be taken in."""

    def job_done(self) -> bool:
        """True once some member called :meth:`mark_done` (training finished)."""

    def mark_done(self) -> None:
        """Record that training finished, for joiners that arrive later."""

    def rebuild(self, min_epoch: int, timeout: float = 60.0) -> None:
        """Run the next ops over the members of the newest epoch (at least ``min_epoch``),
        joiners included, from op sequence 0."""

    def announce_ready(self) -> None:
        """Joiner: say it waits in ``State.sync()``."""

    def wait_admitted(self, timeout: float = 120.0) -> None:
        """Joiner: wait until the others rebuilt over its epoch; ops then run for real."""
