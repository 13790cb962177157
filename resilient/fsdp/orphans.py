"""A lost member's shards, hosted by the survivor that holds its peer copy.

When a plain FSDP member dies, its buddy (:mod:`resilient.fsdp.peer_copy`) turns the last
committed copy into an :class:`Orphan`: the dead member's padded parameter shards and their
optimizer state, owned by the buddy. From then on the buddy stands in for it: it supplies
the dead member's slot of every all-gather and receives its chunk of every gradient
reduction (:mod:`resilient.fsdp.plain`), and after each optimizer step it steps the orphan
with a *shadow* optimizer: the script's optimizer class with the same hyperparameters as
the parameter group each shard belongs to (read at every step, so schedulers carry over).
The job keeps its logical size; the buddy holds two members' shards (the uneven reshard to
N - 1 members).

Exact: the padded shard steps like the real one, element by element — the padding has zero
gradients and stays zero — for every optimizer whose update is elementwise (SGD, Adam,
AdamW, RMSprop, ...). An optimizer that mixes elements of a tensor (a norm, LAMB's trust
ratio) would see the padding; :class:`Orphan` does not detect it.

Failure behaviour: :meth:`Orphan.step` re-raises the shadow optimizer's errors.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["Orphan"]


class Orphan:
    """Member ``member``'s shards on its host (see the module docstring)."""

    def __init__(self, member: str, params: list[torch.Tensor], states: list[dict[str, torch.Tensor]]) -> None:
        self.member = member
        self.params = params
        self.states = states
        #: gradient per parameter index for the step in progress (padded, like the shard)
        self.grads: dict[int, torch.Tensor] = {}
        self._committed = self._clone()
        self._shadow: Any = None

    def _clone(self) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        return [p.clone() for p in self.params], [{k: v.clone() for k, v in s.items()} for s in self.states]

    def commit(self) -> None:
        """The current shards are the step's committed state (the rollback point)."""
        self._committed = self._clone()

    def restore(self) -> None:
        """Back to the committed state (a step being redone)."""
        params, states = self._committed
        for p, q in zip(self.params, params):
            p.copy_(q)
        for s, t in zip(self.states, states):
            for k in list(s):
                if k not in t:
                    del s[k]
            for k, v in t.items():
                if k in s:
                    s[k].copy_(v)
                else:
                    s[k] = v.clone()
        if self._shadow is not None:
            self._load_state()
        self.grads.clear()

    def all_gather_input(self, indices: Sequence[int]) -> torch.Tensor:
        """The member's all-gather input of the FSDP parameter group of ``indices``."""
        return torch.cat([self.params[i] for i in indices])

    def _load_state(self) -> None:
        self._shadow.state.clear()
        for p, s in zip(self.params, self.states):
            if s:
                self._shadow.state[p] = s

    def step(self, optimizer: Any, groups: Sequence[int]) -> None:
        """Step every shard that has a gradient with the shadow of ``optimizer``;
        ``groups[i]``: the index of shard i's parameter group in ``optimizer``."""
        if self._shadow is None:
            per_group: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
            for i, p in enumerate(self.params):
                per_group[groups[i]].append(p)
            spec = [{"params": ps, **{k: v for k, v in g.items() if k != "params"}}
                    for ps, g in zip(per_group, optimizer.param_groups) if ps]
            self._shadow = type(optimizer)(spec)
            self._shadow._resilient_shadow = True  # the backend's step hooks leave it alone
            self._group_of = [i for i, ps in enumerate(per_group) if ps]
            self._load_state()
        for shadow_group, gi in zip(self._shadow.param_groups, self._group_of):
            for k, v in optimizer.param_groups[gi].items():
                if k != "params":
                    shadow_group[k] = v
        for i, p in enumerate(self.params):
            p.grad = self.grads.get(i)
        with torch.no_grad():
            self._shadow.step()
        for i, p in enumerate(self.params):
            p.grad = None
            state = self._shadow.state.get(p)
            if state is not None:
                self.states[i] = state
        self.grads.clear()
