"""Which algorithm runs an op, and its ledger layout (pieces): the one place that chooses.

* allreduce: the leaf path when the epoch demoted members (:mod:`.leaf`, wrapping what
  the active members run); else, above ``small_bytes`` with every member on one host
  sharing memory (``Sizing.shm_direct``), the direct shared-memory allreduce
  (:mod:`.shm_direct`, the ring's layout); else hierarchical by hosts when the plan groups them into
  equal hosts, or unequal ones its ``host_slots`` covers (:mod:`.hierarchical`,
  ``Sizing.hierarchical``); else the pipelined ring above
  ``small_bytes`` (:mod:`.ring`), recursive doubling below (:mod:`.recursive_doubling`);
* reduce_scatter / allgather: (reduce_scatter only) the direct shared-memory reduce-scatter
  when every member is on one host sharing memory (``Sizing.shm_direct``;
  :mod:`.shm_direct_rs`, the ring's layout); else hierarchical when the plan groups by
  equal hosts, else the ring with one chunk per member;
* broadcast: the pipelined chain plus a one-element barrier (:mod:`.chain`).

Deterministic: every member reads the same epoch and sizes, so every member picks the
same algorithm and layout. Pure: nothing here blocks or fails.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from resilient.collectives.algorithms.base import Algorithm
from resilient.collectives.algorithms.chain import ChainBroadcastWithBarrier
from resilient.collectives.algorithms.hierarchical import select as select_hierarchical, select_per_member
from resilient.collectives.algorithms.leaf import LeafPath
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.algorithms.shm_direct import ShmDirectAllreduce, eligible as shm_eligible
from resilient.collectives.algorithms.shm_direct_rs import ShmDirectReduceScatter
from resilient.collectives.group import EpochLike
from resilient.collectives.ledger import split

Pieces = list[tuple[int, int]]


@dataclass(frozen=True)
class Sizing:
    """The communicator's size settings: ring above ``small_bytes``, slices of about
    ``slice_bytes`` (at most ``max_slices`` per chunk), hierarchical and direct shared
    memory (one host) when allowed."""

    small_bytes: int = 64 << 10
    slice_bytes: int = 2 << 20
    max_slices: int = 64
    hierarchical: bool = True
    #: force the host-staged data path for CPU tensors too (CUDA tensors always take it)
    staging: bool = False
    #: bytes of one host staging slot (the staged transfers' chunk size)
    stage_bytes: int = 1 << 20
    #: the direct shared-memory allreduce for members of one host (CPU, unstaged ops only;
    #: the Communicator's default is ``RESILIENT_SHM_DIRECT``, on)
    shm_direct: bool = True

    def for_device(self, device: torch.device) -> "Sizing":
        """The sizing of an op on ``device``: a CUDA op is never hierarchical (that path
        moves host buffers only; the flat ring / recursive doubling stage through the host),
        nor direct shared memory."""
        return self if device.type == "cpu" else replace(self, hierarchical=False, shm_direct=False)

    def stage_elems(self, device: torch.device, elem_bytes: int) -> int:
        """The staged transfers' chunk size in elements for an op on ``device`` (0: direct)."""
        if device.type == "cpu" and not self.staging:
            return 0
        return max(1, self.stage_bytes // max(1, elem_bytes))

    def slices(self, chunk_bytes: int) -> int:
        """Pipelining slices for one chunk of ``chunk_bytes`` (1 for an empty chunk)."""
        return max(1, min(self.max_slices, -(-chunk_bytes // self.slice_bytes)))

    def slices_for(self, nbytes: int, n: int) -> int:
        return self.slices(max(1, nbytes // max(1, n)))

    def ring_or_rd(self, nbytes: int, n: int) -> bool:
        """Whether ``nbytes`` over ``n`` members is a large message (a ring, not recursive doubling)."""
        return nbytes > self.small_bytes and n > 1


def ring_pieces(numel: int, n: int, S: int) -> Pieces:
    """The ring's layout: ``n`` chunks (``split(numel, n)``) of ``S`` slices each."""
    return [(s0 + a, s0 + b) for (s0, e0) in split(numel, n) for (a, b) in split(e0 - s0, S)]


def allreduce(members: list[str], epoch: EpochLike, numel: int, elem_bytes: int,
              sizing: Sizing) -> tuple[Pieces, Algorithm]:
    """Pieces and algorithm of an allreduce of ``numel`` elements over ``members``."""
    n = len(members)
    nbytes = numel * elem_bytes
    leaf = LeafPath.for_epoch(members, epoch)   # demoted members: leaf path (algorithms/leaf.py)
    nr = leaf.ring_size if leaf else n
    if (sizing.shm_direct and not sizing.staging and not leaf and sizing.ring_or_rd(nbytes, n) and numel >= n
            and shm_eligible(members, epoch)):
        S = sizing.slices_for(nbytes, n)
        return ring_pieces(numel, n, S), ShmDirectAllreduce(S)
    hier = (select_hierarchical(members, epoch, numel, elem_bytes, sizing.slices)
            if sizing.hierarchical and not leaf and sizing.ring_or_rd(nbytes, n) else None)
    algo: Algorithm
    if hier is not None:
        pieces, algo = hier
    elif sizing.ring_or_rd(nbytes, nr) and numel >= nr:
        S = sizing.slices_for(nbytes, nr)
        pieces = ring_pieces(numel, nr, S)
        algo = RingReduceScatterAllgather(S)
    else:
        pieces = [(0, numel)]
        algo = RecursiveDoubling()
    if leaf:
        algo = leaf.wrap(algo)
    return pieces, algo


@dataclass(frozen=True)
class PerMember:
    """Layout of an op with one chunk of ``m`` elements per member: pieces, the chunk
    (member index) of each piece and each piece's offset in its member's chunk."""

    pieces: Pieces
    owner: list[int]
    offset: list[int]
    algorithm: Algorithm


def per_member(kind: str, members: list[str], epoch: EpochLike, n: int, m: int, elem_bytes: int,
               sizing: Sizing) -> PerMember:
    """``kind``: ``"reduce_scatter"`` or ``"allgather"`` over ``n`` members."""
    S = sizing.slices(m * elem_bytes)
    pieces = [(c * m + a, c * m + b) for c in range(n) for (a, b) in split(m, S)]
    owners = [c for c in range(n) for _ in range(S)]
    offs = [a for c in range(n) for (a, b) in split(m, S)]
    if (kind == "reduce_scatter" and sizing.shm_direct and not sizing.staging and m >= 1 and n == len(members)
            and shm_eligible(members, epoch)):
        return PerMember(pieces, owners, offs, ShmDirectReduceScatter(S))
    hier = select_per_member(kind, members, epoch, m, S) if sizing.hierarchical else None
    if hier is not None:
        return PerMember(list(hier[0].pieces), list(hier[0].owner), list(hier[0].offset), hier[1])
    algo = (RingReduceScatterAllgather(S, shift=1, do_ag=False) if kind == "reduce_scatter"
            else RingReduceScatterAllgather(S, shift=1, do_rs=False))
    return PerMember(pieces, owners, offs, algo)


def broadcast(numel: int, elem_bytes: int, root: int, sizing: Sizing) -> tuple[Pieces, Algorithm]:
    S = sizing.slices(numel * elem_bytes)
    return split(numel, S), ChainBroadcastWithBarrier(root, S)
