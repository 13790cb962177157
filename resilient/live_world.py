"""The live world: who am I and who else is in the job, right now.

``resilient.world()`` returns a :class:`World` — this process's ``rank``, the ``size`` of
the world, the membership ``epoch`` number and the ``members`` (member ids in ring order)
— computed on every call from the newest epoch the control plane has published, so it is
right as soon as a membership change is published (a member died, a joiner was admitted).
``rank`` is this member's position in ``members``; ranks are dense ``0..size-1`` and may
change when the world changes (a survivor after the dead member moves down by one).

Relation to ``torch.distributed``: after ``dist.init_process_group("resilient")``,
``dist.get_rank()`` and ``dist.get_world_size()`` return the *same live values* as
``resilient.world().rank`` / ``.size`` (the process group answers them from the epoch),
so after a membership change they report the new world, not the launch-time one. The
``RANK`` / ``WORLD_SIZE`` environment variables keep their launch-time values: use them
only to start.

Failure behaviour: while etcd is unreachable the view keeps the last epoch seen. A member
that is no longer in the newest epoch (its lease expired while it was stopped, or it was
evicted) gets :class:`~resilient.errors.RemovedFromGroup` from :func:`world` — it never
receives a rank that belongs to someone else. Calling :func:`world` before a live view
is installed raises :class:`~resilient.errors.ConfigError` saying how to install one.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from resilient.errors import ConfigError, RemovedFromGroup


@dataclass(frozen=True)
class World:
    """One consistent snapshot of the live world (see the module docstring)."""

    rank: int
    size: int
    epoch: int
    members: tuple[str, ...]
    member_id: str

    @classmethod
    def from_members(cls, member_id: str, epoch: int, members: Sequence[str]) -> "World":
        """The view of ``member_id`` in an epoch with ``members`` (ring order). Raises
        :class:`RemovedFromGroup` if ``member_id`` is not among them."""
        members = tuple(members)
        if member_id not in members:
            raise RemovedFromGroup(
                f"member {member_id!r} is not in epoch {epoch} (members {list(members)}): it was removed "
                "from the job (lease expired or evicted); restart it so it rejoins as a new member")
        return cls(rank=members.index(member_id), size=len(members), epoch=int(epoch), members=members,
                   member_id=member_id)

    def rank_of(self, member_id: str) -> int:
        """Rank of another member in this world; ValueError if it is not in it."""
        return self.members.index(member_id)


_lock = threading.Lock()
_provider: Callable[[], World] | None = None


def install(provider: Callable[[], World] | None) -> None:
    """Install the function :func:`world` answers from (the torch backend does this when
    the process group is created; ``None`` uninstalls)."""
    global _provider
    with _lock:
        _provider = provider


def world() -> World:
    """The live world of this process (see the module docstring for failure behaviour)."""
    with _lock:
        provider = _provider
    if provider is None:
        raise ConfigError("resilient.world() has no live view yet: call "
                          "torch.distributed.init_process_group('resilient') (after `import resilient`) first")
    return provider()
