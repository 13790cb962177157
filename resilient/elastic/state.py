"""``State``: what a training job must keep across membership changes, and how joiners get it.

``State(model=net, optimizer=opt, sampler=sampler, step=0, ...)`` holds the model, the
optimizer and any user fields (objects with ``state_dict()``/``load_state_dict()`` — the
elastic sampler, an LR scheduler — or plain values: numbers, strings, lists, dicts,
tensors), reachable as attributes (``state.step += 1``).

* ``commit()`` snapshots everything in memory (a pickle-free byte copy);
* ``restore()`` rolls back to the last commit (after a step that failed as a whole, e.g.
  under the ``strict`` policy);
* ``sync()`` is the step-boundary agreement. **Every live member calls it at the same
  point of each step** (before the forward pass). It costs one 4-element int64 allreduce
  (MAX) when nothing changed: the newest membership epoch any member has seen, whether a
  member still needs the state (every member on the first call of a fresh job), the most
  commits, and whether admitted joiners are waiting. If state must move, the source is
  the lowest-ranked healthy member with the most commits (rank 0 on the first call) and
  it is sent with two broadcasts (length + commit count, then the payload as int64
  words); every member that needed it loads it before it takes part in training. If the
  epoch changed, the ``on_membership_change(world)`` callbacks run on every member, in
  registration order, at that same step boundary (re-shard the sampler there). ``sync()``
  returns True when the world changed or state was transferred; ``last_sync`` has the
  seconds each phase took.
* ``finish()`` after the last step: a joiner that arrives later gets
  :class:`TrainingFinished` from ``sync()`` (exit normally) instead of an error.

Joiners. A restarted worker (``RESILIENT_JOINER=1`` from ``resilient-run``) starts with a
fresh Communicator over the epoch that admitted it. The Communicator's group never
grows, so the others admit it by rebuilding theirs (``CommunicatorEngine.rebuild``) at
the ``sync()`` where the exchange says a joiner is waiting; the joiner announces it is
waiting (an etcd key on its lease) when it enters ``sync()``, so the others never stall
on its start-up, only on the transfer itself. The joiner's first op is the transfer: it
takes part in no gradient allreduce before it holds the healthy members' parameters.
On the in-process test engine (no ``rebuild``) a joiner takes part in the exchange.

Failure behaviour: a member dying during ``sync()`` is absorbed by the collectives; if the
chosen source dies before the payload arrives the broadcast fails with
:class:`~resilient.errors.DataLost` and ``sync()`` starts over once on the new world
before re-raising. A payload that does not parse raises
:class:`~resilient.errors.FrameError`; data that came over the network is never unpickled.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from resilient.errors import CollectiveError, ConfigError, ResilientError
from resilient.torch_backend.codec import decode, encode
from resilient.live_world import World

_BIG = 1 << 62


def _live_world(group: Any = None) -> World | None:
    from resilient.live_world import world

    engine = getattr(group, "engine", None)
    if engine is not None:
        return engine.world()
    try:
        return world()
    except ConfigError:  # not on the resilient backend: a static world
        if dist.is_initialized():
            members = tuple(str(r) for r in range(dist.get_world_size()))
            return World(rank=dist.get_rank(), size=len(members), epoch=0, members=members,
                         member_id=str(dist.get_rank()))
        return None


class TrainingFinished(ResilientError):
    """A joiner arrived after the other members called :meth:`State.finish`: there is no
    training left to take part in (exit normally)."""


class State:
    """See the module docstring."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 group: Any = None, joiner: bool | None = None, **user_fields: Any) -> None:
        for name in user_fields:
            if name.startswith("_") or name in ("commit", "restore", "sync", "state_dict", "load_state_dict",
                                                "on_membership_change", "group", "world"):
                raise ConfigError(f"State field name {name!r} is reserved; pick another name")
        object.__setattr__(self, "_fields", dict(user_fields))
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "group", group)
        if joiner is None:
            joiner = os.environ.get("RESILIENT_JOINER", "0") == "1"
        object.__setattr__(self, "joiner", bool(joiner))
        object.__setattr__(self, "_fresh", True)  # has not received / confirmed the shared state yet
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_epoch_seen", None)
        object.__setattr__(self, "_callbacks", [])
        object.__setattr__(self, "syncs_received", 0)
        #: seconds since the start of the last sync() at which each phase ended
        #: (``exchange_s``, ``rebuild_s``, ``transfer_s``; only the phases that ran)
        object.__setattr__(self, "last_sync", {})

    # -- fields as attributes ---------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(f"State has no field {name!r}; pass it to State(...) as {name}=...")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._fields:
            self._fields[name] = value
        else:
            object.__setattr__(self, name, value)

    # -- snapshot -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything the state holds, as nested dicts/lists/tensors/values."""
        out: dict[str, Any] = {"fields": {}}
        if self.model is not None:
            out["model"] = self.model.state_dict()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        for k, v in self._fields.items():
            out["fields"][k] = {"sd": v.state_dict()} if hasattr(v, "state_dict") else {"v": v}
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Adopt ``sd`` (what :meth:`state_dict` returned, possibly on another member)."""
        if self.model is not None:
            self.model.load_state_dict(sd["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        for k, entry in sd.get("fields", {}).items():
            if k not in self._fields:
                raise ConfigError(f"synced state has field {k!r} that this State lacks; build State with the "
                                  "same fields on every member")
            if "sd" in entry:
                self._fields[k].load_state_dict(entry["sd"])
            else:
                self._fields[k] = entry["v"]

    @property
    def commits(self) -> int:
        return self._commits

    def commit(self) -> None:
        """Snapshot everything in memory (what :meth:`restore` returns to)."""
        object.__setattr__(self, "_snapshot", encode(self.state_dict()))
        object.__setattr__(self, "_commits", self._commits + 1)

    def restore(self) -> None:
        """Roll back to the last :meth:`commit`; ConfigError if there was none."""
        if self._snapshot is None:
            raise ConfigError("State.restore() before any commit(); call commit() after each good step")
        self.load_state_dict(decode(self._snapshot))

    def finish(self) -> None:
        """Training is over: tell joiners that arrive from now on (they get
        :class:`TrainingFinished` from :meth:`sync` instead of waiting or failing). Call it
        on every member after the last step. Failure: StoreError if etcd is unreachable."""
        engine = self._engine()
        if hasattr(engine, "mark_done"):
            engine.mark_done()

    # -- membership ---------------------------------------------------------------------

    def on_membership_change(self, callback: Callable[[World], None]) -> Callable[[World], None]:
        """Call ``callback(world)`` at the sync() where a new epoch is first agreed on (usable
        as a decorator)."""
        self._callbacks.append(callback)
        return callback

    def _pg(self) -> Any:
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()  # noqa: SLF001

    def _allreduce(self, t: torch.Tensor, op: Any) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._pg().allreduce([t], opts).wait()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg().broadcast([t], opts).wait()

    def _engine(self) -> Any:
        return getattr(self._pg(), "engine", None)

    def _exchange(self, world: World) -> tuple[int, bool, int, bool]:
        needs = self._fresh or self.joiner
        engine = self._engine()
        pending = bool(getattr(engine, "pending_joiners", lambda: False)())
        flags = torch.tensor([world.epoch, int(needs), self._commits, int(pending)], dtype=torch.int64)
        self._allreduce(flags, dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1]), int(flags[2]), bool(flags[3])

    def _transfer(self, world: World, max_commits: int) -> None:
        healthy = not self.joiner and self._commits == max_commits
        cand = torch.tensor([self._pg().rank() if healthy else _BIG], dtype=torch.int64)
        self._allreduce(cand, dist.ReduceOp.MIN)
        src = int(cand[0])
        if src == _BIG:
            engine = self._engine()
            if getattr(engine, "job_done", lambda: False)():
                raise TrainingFinished("the other members finished training before this joiner could sync; "
                                       "nothing is left to do")
            raise ConfigError("State.sync(): every live member is a joiner with no state; restart the job "
                              "(at least one member must hold the training state)")
        me = self._pg().rank()
        payload = encode(self.state_dict()) if me == src else b""
        n = torch.tensor([len(payload), self._commits], dtype=torch.int64)
        self._broadcast(n, src)
        size, max_commits = int(n[0]), int(n[1])
        buf = torch.zeros((size + 7) // 8 * 8, dtype=torch.uint8)  # sent as int64 words (a dtype every engine takes)
        if me == src and size:
            buf[:size].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(buf.view(torch.int64), src)
        buf = buf[:size]
        if me != src and (self._fresh or self.joiner):
            self.load_state_dict(decode(buf.numpy().tobytes()))
            object.__setattr__(self, "syncs_received", self.syncs_received + 1)
        object.__setattr__(self, "_commits", max_commits)
        object.__setattr__(self, "_snapshot", encode(self.state_dict()))

    def sync(self) -> bool:
        """The step-boundary agreement (see the module docstring). Collective: every live
        member must call it at the same point."""
        engine = self._engine()
        rebuilds = hasattr(engine, "rebuild")
        t0 = time.monotonic()
        timing: dict[str, float] = {}
        for attempt in (0, 1):
            world = _live_world(self.group)
            if world is None:
                raise ConfigError("State.sync() needs torch.distributed initialised: call "
                                  "dist.init_process_group('resilient') first")
            try:
                if self.joiner and rebuilds:
                    # a joiner's communicator is fresh (op 0 over the epoch that admitted it);
                    # the others rebuild theirs at their next sync() and meet it here
                    epoch, needed = world.epoch, True
                    if hasattr(engine, "announce_ready"):
                        engine.announce_ready()
                        engine.wait_admitted()
                    self._transfer(world, 0)
                    timing["transfer_s"] = time.monotonic() - t0
                    break
                epoch, needed, max_commits, pending = self._exchange(world)
                timing["exchange_s"] = time.monotonic() - t0
                if pending and rebuilds:
                    engine.rebuild(epoch)
                    timing["rebuild_s"] = time.monotonic() - t0
                    self._transfer(_live_world(self.group), max_commits)
                    timing["transfer_s"] = time.monotonic() - t0
                    needed = True
                elif needed:
                    self._transfer(world, max_commits)
                    timing["transfer_s"] = time.monotonic() - t0
                break
            except CollectiveError:
                if attempt:
                    raise
        object.__setattr__(self, "last_sync", timing)
        object.__setattr__(self, "_fresh", False)
        object.__setattr__(self, "joiner", False)
        changed = self._epoch_seen is not None and epoch != self._epoch_seen
        object.__setattr__(self, "_epoch_seen", epoch)
        if changed:
            now = _live_world(self.group)
            for cb in list(self._callbacks):
                cb(now)
        return changed or needed
