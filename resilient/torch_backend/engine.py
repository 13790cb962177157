"""What the torch process group needs from the collectives: the :class:`Engine` protocol.

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
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from resilient.live_world import World

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

    def close(self) -> None: ...
