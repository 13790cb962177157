"""Which members form each replica group of an HSDP mesh, and which groups are broken.

FSDP2's HSDP (``fully_shard(module, mesh=mesh_2d)``) shards parameters inside each row of
the mesh (the *shard* dimension, mesh dim 1) and all-reduces the sharded gradients down each
column (the *replicate* dimension, mesh dim 0). A row is one replica group: it holds one
whole copy of the model, sharded over its members. When one of its members dies, the row
cannot deliver its gradient (its reduce-scatter lost a contribution and a shard) nor its
parameters (a shard exists only on the dead member inside the row), so the whole row is
dropped from the replicate dimension: every column's group shows, in every epoch, only the
members of rows that are whole in that epoch (:class:`ReplicaLayout.keep`). Every member
derives the same membership from the same epoch, so the columns agree without talking.

A row once broken stays dropped for the rest of the job (a dead member never returns under
its member id); its survivors are paused (:mod:`resilient.fsdp.pause`).

Failure behaviour: :meth:`ReplicaLayout.from_mesh` raises
:class:`~resilient.errors.ConfigError` when the mesh names a rank the world does not have.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from resilient.errors import ConfigError

__all__ = ["ReplicaLayout"]


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """``rows[r]``: the member ids of replica group ``r`` (a mesh row), in shard-rank order."""

    rows: tuple[tuple[str, ...], ...]

    @classmethod
    def from_mesh(cls, mesh_rows: Sequence[Sequence[int]], world_members: Sequence[str]) -> "ReplicaLayout":
        """The layout of a 2-D mesh given as world ranks (``DeviceMesh.mesh.tolist()``, dim 0
        replicate, dim 1 shard) over the world's members in rank order."""
        try:
            rows = tuple(tuple(world_members[int(r)] for r in row) for row in mesh_rows)
        except IndexError:
            raise ConfigError(f"the HSDP mesh {list(map(list, mesh_rows))} names a rank outside the world of "
                              f"{len(world_members)} members") from None
        return cls(rows)

    def row_of(self, member: str) -> int | None:
        """The replica group of ``member`` (None: not in the mesh)."""
        for i, row in enumerate(self.rows):
            if member in row:
                return i
        return None

    def broken(self, alive: Iterable[str]) -> frozenset[int]:
        """The rows with at least one member not in ``alive``."""
        present = set(alive)
        return frozenset(i for i, row in enumerate(self.rows) if any(m not in present for m in row))

    def keep(self, members: Sequence[str]) -> tuple[str, ...]:
        """``members`` (an epoch's, in ring order) without those of broken rows; members
        outside the mesh are kept."""
        dropped = self.broken(members)
        return tuple(m for m in members if self.row_of(m) not in dropped)
