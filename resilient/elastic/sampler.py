"""An elastic sampler: the rest of the epoch, re-sharded over whoever is alive.

Every member builds the same plan from the same inputs, so no communication is needed
beyond what the training loop already agrees on (the epoch, the live world, and which
ranks contributed to each committed step):

* the epoch's order is a permutation of ``range(num_samples)`` (seeded by ``seed + epoch``
  when ``shuffle``);
* the *remaining* samples are that order minus the ones already processed;
* a global step takes the next ``world_size * batch_size`` remaining samples; rank ``r``
  gets the ``r``-th slice of ``batch_size`` (the last, shorter block is split as evenly as
  possible, sizes differing by at most one; ``drop_last`` drops it instead);
* :meth:`ElasticSampler.record_step` marks the step's samples of the *contributing* ranks
  processed (all ranks by default). If some rank's slice did not contribute (it died
  mid-step), its samples stay pending and the plan is rebuilt at once, so they are served
  again - to the survivors - and never skipped;
* :meth:`ElasticSampler.set_world` (on a membership change, at a step boundary) rebuilds the
  plan from the remaining samples for the new rank / world size.

*speed-weighted shares* (uneven members): :meth:`ElasticSampler.set_batch_sizes` gives
  each rank its own number of samples per global step (the coordinator publishes shares
  from measured samples/s, ``resilient.coordinator.shares``; :meth:`follow_shares` turns
  the record into sizes). A step then takes ``sum(sizes)`` samples and rank ``r`` gets
  the ``r``-th slice of ``sizes[r]``; the last, shorter block is split in proportion to
  the sizes (largest remainder). Weight the gradient by each rank's count
  (``resilient.ddp.weighted_ddp_comm_hook``) so it stays the mean per sample.

So, across any sequence of world changes within an epoch, each sample is processed exactly
once (and with ``drop_last``, at most once, only the final partial block is dropped).
:meth:`state_dict` / :meth:`load_state_dict` carry the progress (JSON-able) so a joiner
synced from a healthy member continues the same plan.

Usage with ``resilient.elastic.State``: keep the sampler in the state, call
``sampler.set_world(world.rank, world.size)`` in ``on_membership_change`` and create a new
iterator (``iter(sampler)`` / a new DataLoader iterator) afterwards; call
``sampler.record_step(contributors)`` when a step commits. Pure logic, no I/O: a bad
argument raises :class:`~resilient.errors.ConfigError` naming it.
"""
from __future__ import annotations

import random
from typing import Any, Iterable, Iterator, Mapping, Sequence

from resilient.errors import ConfigError


class ElasticSampler:
    """Yields this rank's sample indices for the rest of the epoch (see the module doc).

    Usable as a ``torch.utils.data.Sampler`` (it has ``__iter__`` and ``__len__``); it does
    not import torch.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_samples < 0:
            raise ConfigError(f"num_samples must be >= 0, got {num_samples}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._processed: set[int] = set()
        self._sizes: list[int] | None = None  # per-rank samples per step (None: batch_size each)
        self.rank, self.world_size = 0, 1
        self.set_world(rank, world_size)

    # -- plan -----------------------------------------------------------------------------

    def _order(self) -> list[int]:
        order = list(range(self.num_samples))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _replan(self) -> None:
        self._remaining = [i for i in self._order() if i not in self._processed]
        self.step = 0  # steps of the current plan already recorded

    def sizes(self) -> list[int]:
        """Samples per global step of each rank (``batch_size`` each unless set)."""
        return list(self._sizes) if self._sizes is not None else [self.batch_size] * self.world_size

    def _block(self, step: int) -> list[list[int]]:
        """Slices of global step ``step`` of the current plan, one per rank."""
        sizes = self.sizes()
        g = sum(sizes)
        block = self._remaining[step * g:(step + 1) * g]
        if len(block) == g:
            return _cut(block, sizes)
        if self.drop_last or not block:
            return [[] for _ in sizes]
        return _cut(block, _proportional(len(block), sizes))

    @property
    def steps_left(self) -> int:
        """Global steps left in the current plan."""
        g = sum(self.sizes())
        left = max(0, len(self._remaining) - self.step * g)
        return left // g if self.drop_last else -(-left // g)

    # -- API ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start data epoch ``epoch``: a fresh order, nothing processed."""
        self.epoch = int(epoch)
        self._processed.clear()
        self._replan()

    def set_world(self, rank: int, world_size: int) -> None:
        """Re-shard the remaining samples of the epoch for ``rank`` of ``world_size``.
        Call at a step boundary (after the last :meth:`record_step`) on every member."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        self.rank, self.world_size = int(rank), int(world_size)
        self._sizes = None
        self._replan()

    def set_batch_sizes(self, sizes: Sequence[int] | None) -> None:
        """Per-rank samples per global step for the current world (``None``: ``batch_size``
        each). Call at a step boundary on every member with the same list (what
        :meth:`follow_shares` computes); :meth:`set_world` resets it. Raises ConfigError
        unless ``sizes`` has one integer >= 0 per rank and a positive sum."""
        if sizes is not None:
            sizes = list(sizes)
            if (len(sizes) != self.world_size or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in sizes)
                    or sum(sizes) < 1):
                raise ConfigError(f"batch sizes must be {self.world_size} integers >= 0 with a positive sum, got {sizes!r}")
        if sizes != self._sizes:
            self._sizes = sizes
            self._replan()

    def follow_shares(self, shares: Mapping[str, float] | None, members: Sequence[str], global_batch: int) -> list[int]:
        """Adopt the coordinator's speed-weighted ``shares`` (the ``members`` map of the
        ``shares`` record, or ``None``: uniform) for ``members`` in rank order, as integer
        sizes summing to ``global_batch`` (:func:`resilient.coordinator.shares.batch_sizes`,
        deterministic, so every member gets the same plan). Returns the sizes. Raises
        ConfigError if ``members`` is not the current world or the batch is too small."""
        if len(members) != self.world_size:
            raise ConfigError(f"follow_shares got {len(members)} members for a world of {self.world_size}")
        if shares is None:
            self.set_batch_sizes(None)
            return self.sizes()
        from resilient.coordinator.shares import batch_sizes

        sizes = batch_sizes(shares, members, global_batch)
        self.set_batch_sizes(sizes)
        return sizes

    def step_indices(self, step: int | None = None, rank: int | None = None) -> list[int]:
        """Indices of ``rank`` (default: ours) in global step ``step`` (default: the next)."""
        step = self.step if step is None else step
        rank = self.rank if rank is None else rank
        return self._block(step)[rank] if step < self.step + self.steps_left else []

    def record_step(self, contributors: Iterable[int] | None = None) -> None:
        """The next global step committed; ``contributors`` are the ranks (of the current
        world) whose samples went into it (default: all). Samples of other ranks stay
        pending and are re-planned at once, so they are not skipped."""
        slices = self._block(self.step)
        ranks = range(self.world_size) if contributors is None else sorted(set(contributors))
        for r in ranks:
            if not 0 <= r < self.world_size:
                raise ConfigError(f"contributor rank {r} is outside the world of size {self.world_size}")
            self._processed.update(slices[r])
        if len(ranks) == self.world_size:
            self.step += 1
        else:
            self._replan()

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from the next step to the end of the current plan. Make a new
        iterator after :meth:`set_world` or a partial :meth:`record_step`."""
        for s in range(self.step, self.step + self.steps_left):
            yield from self._block(s)[self.rank]

    def __len__(self) -> int:
        return sum(len(self._block(s)[self.rank]) for s in range(self.step, self.step + self.steps_left))

    @property
    def processed(self) -> int:
        """How many samples of this epoch are processed."""
        return len(self._processed)

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able progress: epoch, seed, settings and the processed indices."""
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "drop_last": self.drop_last, "epoch": self.epoch,
                "processed": sorted(self._processed), "batch_sizes": self._sizes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a healthy member's progress (keeps our rank/world; call :meth:`set_world`
        after it if the world changed)."""
        try:
            self.num_samples = int(state["num_samples"])
            self.batch_size = int(state["batch_size"])
            self.shuffle = bool(state["shuffle"])
            self.seed = int(state["seed"])
            self.drop_last = bool(state["drop_last"])
            self.epoch = int(state["epoch"])
            processed = {int(i) for i in state["processed"]}
            sizes = state.get("batch_sizes")
            sizes = None if sizes is None else [int(x) for x in sizes]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an ElasticSampler state_dict ({exc!r}); pass what state_dict() returned") from exc
        if any(not 0 <= i < self.num_samples for i in processed):
            raise ConfigError("ElasticSampler state_dict has indices outside range(num_samples)")
        self._processed = processed
        # per-rank sizes are kept when they fit our world (else uniform: set them again)
        self._sizes = sizes if sizes is not None and len(sizes) == self.world_size and sum(sizes) > 0 else None
        self._replan()


def _proportional(n: int, weights: Sequence[int]) -> list[int]:
    """``n`` split in proportion to ``weights`` by largest remainder (ties: earlier rank);
    equal weights give sizes differing by at most one, the extra ones to the first ranks."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    out = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:n - sum(out)]:
        out[i] += 1
    return out


def _cut(block: list[int], sizes: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(block[start:start + n])
        start += n
    return out
