"""``State``: what a training job must keep across membership changes, and how joiners get it.

``State(model=net, optimizer=opt, sampler=sampler, step=0, ...)`` holds the model, the
optimizer and any user fields (objects with ``state_dict()``/``load_state_dict()`` — the
elastic sampler, an LR scheduler — or plain values: numbers, strings, lists, dicts,
tensors), reachable as attributes (``state.step += 1``).

* ``commit()`` marks a restore point. It copies no parameter and no optimizer state
  (the bulk: what training changes only in ``optimizer.step()``): it records their
  version counters and copies the small rest (model buffers, optimizer
  hyper-parameters, user fields). After an exact allreduce the survivors are already
  consistent, so nothing on the step's common path needs a copy.
* ``restore()`` rolls back to the last commit: exact for a step that failed before
  ``optimizer.step()`` (e.g. a gradient allreduce that raised under the ``strict``
  policy: the bulk is untouched, the rest is put back). If the bulk did change since the
  commit it raises ConfigError instead of guessing; ``State(..., full_snapshots=True)``
  keeps a full in-memory copy at every commit (Horovod's semantics, at the cost of a
  copy of the whole state per step) and then restores across an optimizer step too.
* ``sync()`` is the step-boundary agreement. **Every live member calls it at the same
  point of each step** (before the forward pass). The full exchange is one 4-element
  int64 allreduce (MAX): the newest membership epoch any member has seen, whether a
  member still needs the state (every member on the first call of a fresh job), the most
  commits, and whether admitted joiners are waiting. On the resilient backend it runs
  only when something changed: each ``sync()`` ends by issuing, asynchronously, a
  1-element allreduce (MAX) of "this member sees a change" (a newer epoch than the one
  agreed, or admitted joiners ready to sync), which runs on the op thread during the
  step's forward pass; the next ``sync()`` waits for it (long done) and runs the full
  exchange only if a member saw a change — so a change is acted on at the first step
  boundary after a member saw it at a ``sync()``, one step later than with the exchange
  on every step, and nothing of the agreement is left on the step's critical path (see
  :meth:`State._look_ahead`). Every member decides from the same reduced flag, so they
  all skip or all exchange. Elsewhere (another backend, the in-process test engine) the
  full exchange runs every step. On the first call of a fresh job
  the source (rank 0) broadcasts the state (length + commit count, then the payload as
  int64 words). If the epoch changed, the ``on_membership_change(world)`` callbacks run
  on every member, in registration order, at that same step boundary (re-shard the
  sampler there). ``sync()`` returns True when the world changed or state was
  transferred; ``last_sync`` has the seconds (since the start of the call) at which each
  phase ended: ``exchange_s``, ``rebuild_s``, ``snapshot_s`` (source), ``admitted_s``
  and ``stream_s`` (joiner: admitted, state received and loaded), ``transfer_s``.
* ``finish()`` after the last step: a joiner that arrives later gets
  :class:`TrainingFinished` from ``sync()`` (exit normally) instead of an error.

Joiners. A restarted worker (``RESILIENT_JOINER=1`` from ``resilient-run``) starts with a
fresh Communicator over the epoch that admitted it. The Communicator's group never
grows, so the others admit it by rebuilding theirs (``CommunicatorEngine.rebuild``) at
the ``sync()`` where the exchange says a joiner is waiting; the joiner announces it is
waiting (an etcd key on its lease) when it enters ``sync()``, so the others never stall
on its start-up. At admission one small allreduce (3 + 3 x world int64) agrees on the
source (the lowest-ranked healthy member with the most commits) and carries each
joiner's stream endpoint (a listening socket on ``RESILIENT_HOST`` and a random token).
The source streams its state at that step boundary from a background thread
(:mod:`resilient.elastic.stream`): parameters and optimizer state straight from the live
tensors (no copy; its next ``optimizer.step()`` waits for the stream to end, which a
one-shot step pre-hook enforces), the small rest from a copy, in two parts: first the
model, the user fields and the optimizer's hyper-parameters, then the optimizer state.
The source and every other survivor return to training at once. The joiner loads the
first part (parameters received straight into its own) and returns from ``sync()``;
the optimizer state arrives on a background thread during its first forward/backward
and is loaded before its first ``optimizer.step()`` (a one-shot step pre-hook; also
before ``commit()``, ``restore()``, ``state_dict()``: :mod:`resilient.elastic.catchup`),
so its state equals the survivors' at admission exactly when it is first used; the
survivors wait for it only inside their next gradient allreduce, for as long as the
first part took longer than their step's compute. If a joiner
cannot open an IPv4 receiver, everyone falls back to the broadcast transfer. On the
in-process test engine (``admits_by_rebuild`` False) a joiner takes part in the exchange and gets
the broadcast.

Failure behaviour: a member dying during ``sync()`` is absorbed by the collectives; if the
chosen source dies before the broadcast payload arrives the broadcast fails with
:class:`~resilient.errors.DataLost` and ``sync()`` starts over once on the new world
before re-raising. If the source dies while it streams to a joiner (or no stream
arrives within ``State.stream_timeout``, 120 s), the joiner's ``sync()`` raises DataLost
— or, when the cut falls in the optimizer-state part, its first ``optimizer.step()``
(and every later ``commit``/``restore``/``state_dict``) does — (the others are training
already; the launcher restarts the joiner, which is synced again). A payload that does not parse raises
:class:`~resilient.errors.FrameError`; data that came over the network is never unpickled.
"""
from __future__ import annotations

import copy
import ipaddress
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from resilient.elastic.catchup import PendingOptimizerState
from resilient.elastic.stream import NextPart, Snapshot, StateReceiver, endpoint_words, serve
from resilient.errors import CollectiveError, ConfigError, DataLost, ResilientError, TrainingFinished
from resilient.settings import Settings
from resilient.torch_backend import engine_of
from resilient.torch_backend.codec import decode, encode
from resilient.torch_backend.engine import ElasticEngine
from resilient.live_world import World

_BIG = 1 << 62


def _live_world(group: Any = None) -> World | None:
    from resilient.live_world import world

    engine = engine_of(group)
    if engine is not None:
        live: World = engine.world()
        return live
    try:
        return world()
    except ConfigError:  # not on the resilient backend: a static world
        if dist.is_initialized():
            members = tuple(str(r) for r in range(dist.get_world_size()))
            return World(rank=dist.get_rank(), size=len(members), epoch=0, members=members,
                         member_id=str(dist.get_rank()))
        return None


class _StreamFailed(Exception):
    """The joiner's state stream broke (raised past sync()'s retry as DataLost)."""


class State:
    """See the module docstring."""

    #: seconds a joiner waits for its state stream (and a source's send may take)
    stream_timeout: float = 120.0

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 group: Any = None, joiner: bool | None = None, full_snapshots: bool = False,
                 **user_fields: Any) -> None:
        for name in user_fields:
            if name.startswith("_") or name in ("commit", "restore", "sync", "state_dict", "load_state_dict",
                                                "on_membership_change", "group", "world"):
                raise ConfigError(f"State field name {name!r} is reserved; pick another name")
        object.__setattr__(self, "_fields", dict(user_fields))
        if model is not None:  # a joiner builds DDP's initial buckets: every member keeps them
            from resilient.ddp import hold_layout

            hold_layout(model)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "group", group)
        if joiner is None:
            joiner = Settings.from_env().joiner
        object.__setattr__(self, "joiner", bool(joiner))
        object.__setattr__(self, "_fresh", True)  # has not received / confirmed the shared state yet
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "full_snapshots", bool(full_snapshots))
        object.__setattr__(self, "_serving", None)  # the Snapshot parts being streamed to joiners (source only)
        object.__setattr__(self, "_pending", None)  # joiner: optimizer state still arriving (catchup.py)
        object.__setattr__(self, "_epoch_seen", None)
        object.__setattr__(self, "_callbacks", [])
        #: the next sync()'s agreement, issued at the end of this one: (Work, flag tensor)
        object.__setattr__(self, "_ahead", None)
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

    def state_dict(self) -> dict[str, Any]:
        """Everything the state holds, as nested dicts/lists/tensors/values. On a joiner
        whose optimizer state is still arriving it waits for it (DataLost if it broke)."""
        self._settle()
        out: dict[str, Any] = {"fields": {}}
        if self.model is not None:
            out["model"] = self.model.state_dict()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        for k, v in self._fields.items():
            out["fields"][k] = {"sd": v.state_dict()} if hasattr(v, "state_dict") else {"v": v}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Adopt ``sd`` (what :meth:`state_dict` returned, possibly on another member)."""
        self._settle()  # a joiner's optimizer state still arriving must not overwrite this
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        self._load_model_and_fields(sd)

    def _load_model_and_fields(self, sd: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(sd["model"])
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
        return int(self._commits)

    # -- restore points -------------------------------------------------------------------
    #
    # A commit is a marker, not a copy: parameters and optimizer state (the bulk of a
    # training state) change only in ``optimizer.step()``, so commit() records their
    # version counters and copies only the small rest (model buffers, optimizer
    # hyper-parameters, user fields). restore() puts the small rest back and checks the
    # counters: unchanged means the bulk is exactly what it was at the commit (a step that
    # failed in its gradient allreduce never reached optimizer.step()).

    def _bulk(self) -> list[Any]:
        """Version stamps of every parameter and optimizer-state entry."""
        out: list[Any] = []
        if self.model is not None:
            out.extend(("p", id(p), p._version) for p in self.model.parameters())  # noqa: SLF001
        if self.optimizer is not None:
            for param, st in self.optimizer.state.items():
                for k, v in st.items():
                    out.append((id(param), k, ("t", id(v), v._version) if isinstance(v, torch.Tensor)  # noqa: SLF001
                                else ("v", v)))
        return out

    def _small(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fields": copy.deepcopy({k: v.state_dict() if hasattr(v, "state_dict") else v
                                                        for k, v in self._fields.items()})}
        if self.model is not None:
            out["buffers"] = [b.detach().clone() for b in self.model.buffers()]
        if self.optimizer is not None:
            out["groups"] = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                           for g in self.optimizer.param_groups])
        return out

    def _mark(self) -> None:
        if self.full_snapshots:
            object.__setattr__(self, "_snapshot", encode(self.state_dict()))
        else:
            object.__setattr__(self, "_snapshot", {"bulk": self._bulk(), "small": self._small()})

    def commit(self) -> None:
        """Mark a restore point (what :meth:`restore` returns to). Cheap by default: no
        copy of parameters or optimizer state (see :meth:`restore`); with
        ``State(full_snapshots=True)`` a full in-memory copy, as Horovod's commit."""
        self._settle()
        self._mark()
        object.__setattr__(self, "_commits", self._commits + 1)
        serving = self._serving
        if serving is not None and not any(t.is_alive() for part in serving for t in part.threads):
            object.__setattr__(self, "_serving", None)

    def restore(self) -> None:
        """Roll back to the last :meth:`commit`. By default that is exact for what a failed
        step can have changed before ``optimizer.step()`` (user fields, the sampler, model
        buffers, optimizer hyper-parameters; parameters and optimizer state untouched). If
        parameters or optimizer state changed since the commit (``optimizer.step()`` ran),
        ConfigError says so: build the State with ``full_snapshots=True`` to roll back
        across an optimizer step. ConfigError too if there was no commit."""
        self._settle()
        snap = self._snapshot
        if snap is None:
            raise ConfigError("State.restore() before any commit(); call commit() after each good step")
        if self.full_snapshots:
            self.load_state_dict(decode(snap))
            return
        if self._bulk() != snap["bulk"]:
            raise ConfigError("State.restore(): parameters or optimizer state changed since the last commit() "
                              "(optimizer.step() ran); the default commit is a marker, not a copy. Restore only "
                              "steps that failed before optimizer.step(), or build State(..., full_snapshots=True) "
                              "to keep a full copy at every commit")
        small = snap["small"]
        if self.model is not None:
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), small["buffers"]):
                    b.copy_(saved)
        if self.optimizer is not None:
            for g, saved in zip(self.optimizer.param_groups, small["groups"]):
                g.update(copy.deepcopy(saved))
        for k, v in copy.deepcopy(small["fields"]).items():
            if hasattr(self._fields[k], "state_dict"):
                self._fields[k].load_state_dict(v)
            else:
                self._fields[k] = v
        object.__setattr__(self, "_snapshot", {"bulk": self._bulk(), "small": small})

    def finish(self) -> None:
        """Training is over: tell joiners that arrive from now on (they get
        :class:`TrainingFinished` from :meth:`sync` instead of waiting or failing). Call it
        on every member after the last step. Failure: StoreError if etcd is unreachable."""
        engine = self._engine()
        if engine is not None:
            engine.mark_done()

    # -- membership ---------------------------------------------------------------------

    def on_membership_change(self, callback: Callable[[World], None]) -> Callable[[World], None]:
        """Call ``callback(world)`` at the sync() where a new epoch is first agreed on (usable
        as a decorator)."""
        self._callbacks.append(callback)
        return callback

    def _pg(self) -> Any:
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()  # noqa: SLF001

    def _allreduce_async(self, t: torch.Tensor, op: Any) -> Any:
        """Issue an in-place allreduce of ``t`` on the state's group; returns its Work."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self._pg().allreduce([t], opts)

    def _allreduce(self, t: torch.Tensor, op: Any) -> None:
        self._allreduce_async(t, op).wait()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg().broadcast([t], opts).wait()

    def _engine(self) -> ElasticEngine | None:
        """The resilient group's engine (None on another backend: a static group)."""
        return engine_of(self._pg())

    def _look_ahead(self, world: World) -> None:
        """Issue the next :meth:`sync`'s agreement now, asynchronously (it runs on the op
        thread while the step computes): a 1-element allreduce (MAX) of whether this member
        sees a change — a newer epoch than the one agreed, or admitted joiners that wait to
        sync (``pending_joiners``: local unless the epoch grew). Every member issues it at
        the same point (the end of ``sync()``), so the op order stays the same on all.
        Failure behaviour: etcd errors of ``pending_joiners`` propagate (StoreError)."""
        engine = self._engine()
        pending = engine is not None and engine.pending_joiners()
        flag = torch.tensor([int(pending or world.epoch != self._epoch_seen)], dtype=torch.int64)
        object.__setattr__(self, "_ahead", (self._allreduce_async(flag, dist.ReduceOp.MAX), flag))

    def _nothing_changed(self) -> bool:
        """Wait for the agreement :meth:`_look_ahead` issued at the last ``sync()``: True
        when no member saw a change (this sync() may skip the exchange). False when there
        is none, or when it failed (CollectiveError: the full exchange then runs, as after
        a failed exchange)."""
        ahead = self._ahead
        object.__setattr__(self, "_ahead", None)
        if ahead is None:
            return False
        work, flag = ahead
        try:
            work.wait()
        except CollectiveError:
            return False
        return int(flag[0]) == 0

    def _exchange(self, world: World) -> tuple[int, bool, int, bool]:
        needs = self._fresh or self.joiner
        engine = self._engine()
        pending = engine is not None and engine.pending_joiners()
        flags = torch.tensor([world.epoch, int(needs), self._commits, int(pending)], dtype=torch.int64)
        self._allreduce(flags, dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1]), int(flags[2]), bool(flags[3])

    def _transfer(self, world: World, max_commits: int) -> None:
        healthy = not self.joiner and self._commits == max_commits
        cand = torch.tensor([self._pg().rank() if healthy else _BIG], dtype=torch.int64)
        self._allreduce(cand, dist.ReduceOp.MIN)
        src = int(cand[0])
        if src == _BIG:
            raise self._no_source()
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
        self._mark()

    def _no_source(self) -> ResilientError:
        engine = self._engine()
        if engine is not None and engine.job_done():
            return TrainingFinished("the other members finished training before this joiner could sync; "
                                    "nothing is left to do")
        return ConfigError("State.sync(): every live member is a joiner with no state; restart the job "
                           "(at least one member must hold the training state)")

    def _snapshot_for_stream(self) -> list[Snapshot]:
        """The state at this step boundary for the joiners' stream, in the order a joiner
        needs it: first the model, the user fields and the optimizer's hyper-parameters,
        then (a second part, :mod:`resilient.elastic.catchup`) the optimizer state, which
        a joiner reads only at its first ``optimizer.step()``. Parameters and optimizer
        state are sent from the live tensors (no copy): they change only in
        ``optimizer.step()``, which a one-shot step pre-hook holds back until the stream
        is done (the joiner is behind anyway: the next gradient allreduce waits for it).
        The small rest (buffers, which a forward pass may change, hyper-parameters,
        fields) is copied. Without an optimizer everything is copied, in one part."""
        sd = self.state_dict()
        if self.optimizer is None:
            return [Snapshot(sd)]
        params = {p.data_ptr() for p in self.model.parameters()} if self.model is not None else set()
        first: dict[str, Any] = {"fields": copy.deepcopy(sd["fields"]), "rest": 1,
                                 "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                          for g in self.optimizer.param_groups])}
        if "model" in sd:
            first["model"] = {k: v if isinstance(v, torch.Tensor) and v.data_ptr() in params else copy.deepcopy(v)
                              for k, v in sd["model"].items()}
        parts = [Snapshot(first, copy=False), Snapshot({"optimizer": sd["optimizer"]}, copy=False)]
        handle: list[Any] = []

        def hold_step(*_: Any) -> None:
            for part in parts:
                part.join()
            handle[0].remove()

        handle.append(self.optimizer.register_step_pre_hook(hold_step))
        return parts

    def _load_first_part(self, obj: Any, rest: NextPart) -> None:
        """Joiner: adopt the stream's first part; the optimizer state that follows is
        received in the background and settled before the first optimizer step (or at
        once with ``full_snapshots``, whose markers copy the whole state)."""
        if not isinstance(obj, dict) or "fields" not in obj:
            rest.close()
            raise _StreamFailed("the state stream's first part is not a State snapshot")
        if "rest" not in obj:  # one part: the whole state_dict
            rest.close()
            self.load_state_dict(obj)
            return
        if self.optimizer is None:
            rest.close()
            raise ConfigError("the synced state has optimizer state but this State has no optimizer; build State "
                              "with the same model/optimizer/fields on every member")
        self._load_model_and_fields(obj)
        for g, hyper in zip(self.optimizer.param_groups, obj["groups"]):
            g.update(hyper)
        pending = PendingOptimizerState(rest, self.stream_timeout)
        object.__setattr__(self, "_pending", pending)
        handle: list[Any] = []

        def settle_first(*_: Any) -> None:
            handle[0].remove()
            self._settle()

        handle.append(self.optimizer.register_step_pre_hook(settle_first))
        if self.full_snapshots:
            self._settle()

    def _settle(self) -> None:
        """Joiner: wait for the optimizer state still arriving (see :meth:`_load_first_part`)
        and load it; the admission marker then covers it too. DataLost if it broke."""
        pending = self._pending
        if pending is None:
            return
        assert self.optimizer is not None
        pending.settle(self.optimizer)
        object.__setattr__(self, "_pending", None)
        snap = self._snapshot
        if isinstance(snap, dict) and "bulk" in snap:
            snap["bulk"] = self._bulk()

    def _param_targets(self, structure: Any) -> dict[int, torch.Tensor]:
        """Tensor index -> this model's parameter, for the stream's ``model`` entries that are
        parameters: received straight into the parameters' memory (their load is then a
        no-op self-copy)."""
        if self.model is None or not isinstance(structure, dict):
            return {}
        top = dict((k, v) for k, v in structure.get("__d__", []) if isinstance(k, str))
        entries = top.get("model", {}).get("__d__", []) if isinstance(top.get("model"), dict) else []
        params = dict(self.model.named_parameters())
        out: dict[int, torch.Tensor] = {}
        for name, node in entries:
            if name in params and isinstance(node, dict) and "__t__" in node:
                out[int(node["__t__"])] = params[name].data
        return out

    def _admit(self, max_commits: int, timing: dict[str, float], t0: float) -> None:
        """Admission of joiners (every member of the rebuilt group calls it): one small
        allreduce agrees on the source (lowest-ranked healthy member with the most
        commits) and on each joiner's stream endpoint; the source snapshots its state and
        streams it from a background thread (:mod:`resilient.elastic.stream`) and, like
        every other healthy member, returns to training at once; each joiner receives and
        loads it before its first op. Falls back to the broadcast transfer when a joiner
        cannot open an IPv4 receiver."""
        pg = self._pg()
        me, n = pg.rank(), pg.size()
        needy = self._fresh or self.joiner
        healthy = not needy and self._commits == max_commits
        info = torch.zeros(3 + 3 * n, dtype=torch.int64)
        info[0] = _BIG - me if healthy else 0
        info[1] = self._commits
        receiver = None
        if needy:
            try:
                receiver = StateReceiver(Settings.from_env().host)
                ip, port = endpoint_words(receiver.host, receiver.port)
                info[3 + 3 * me:6 + 3 * me] = torch.tensor([ip, port, receiver.token])
            except (OSError, ValueError):
                if receiver is not None:
                    receiver.close()
                receiver = None
                info[2] = 1  # no receiver here: everyone uses the broadcast transfer
        try:
            self._allreduce(info, dist.ReduceOp.MAX)
        except BaseException:
            if receiver is not None:
                receiver.close()
            raise
        if int(info[2]):
            if receiver is not None:
                receiver.close()
            world = _live_world(self.group)
            if world is None:
                raise ConfigError("State.sync(): torch.distributed is no longer initialised")
            self._transfer(world, max_commits)
            return
        if int(info[0]) == 0:
            if receiver is not None:
                receiver.close()
            raise self._no_source()
        src, max_commits = _BIG - int(info[0]), int(info[1])
        if me == src:
            snap = self._snapshot_for_stream()
            for r in range(n):
                ip, port, token = (int(v) for v in info[3 + 3 * r:6 + 3 * r])
                if r != me and port:
                    serve(snap, str(ipaddress.IPv4Address(ip)), port, token, timeout=self.stream_timeout)
            object.__setattr__(self, "_serving", snap)
            timing["snapshot_s"] = time.monotonic() - t0
        if receiver is not None:
            try:
                obj, rest = receiver.receive_first(self.stream_timeout, into=self._param_targets)
            except (DataLost, TimeoutError) as exc:
                raise _StreamFailed(str(exc)) from exc
            self._load_first_part(obj, rest)
            object.__setattr__(self, "syncs_received", self.syncs_received + 1)
            timing["stream_s"] = time.monotonic() - t0
        object.__setattr__(self, "_commits", max_commits)
        self._mark()

    def sync(self) -> bool:
        """The step-boundary agreement (see the module docstring). Collective: every live
        member must call it at the same point."""
        engine = self._engine()
        # the engine that admits joiners by rebuilding (None: a joiner takes part in the exchange)
        rebuilder = engine if engine is not None and engine.admits_by_rebuild else None
        t0 = time.monotonic()
        timing: dict[str, float] = {}
        if rebuilder is not None and not self._fresh and not self.joiner and self._nothing_changed():
            # every member got the same flag: all of them skip the exchange here
            timing["exchange_s"] = time.monotonic() - t0
            object.__setattr__(self, "last_sync", timing)
            world = _live_world(self.group)
            if world is not None:
                self._look_ahead(world)
            return False
        for attempt in (0, 1):
            world = _live_world(self.group)
            if world is None:
                raise ConfigError("State.sync() needs torch.distributed initialised: call "
                                  "dist.init_process_group('resilient') first")
            try:
                if self.joiner and rebuilder is not None:
                    # a joiner's communicator is fresh (op 0 over the epoch that admitted it);
                    # the others rebuild theirs at their next sync() and meet it here
                    epoch, needed = world.epoch, True
                    rebuilder.announce_ready()
                    rebuilder.wait_admitted()
                    timing["admitted_s"] = time.monotonic() - t0
                    self._admit(0, timing, t0)
                    timing["transfer_s"] = time.monotonic() - t0
                    break
                epoch, needed, max_commits, pending = self._exchange(world)
                timing["exchange_s"] = time.monotonic() - t0
                if pending and rebuilder is not None:
                    rebuilder.rebuild(epoch)
                    timing["rebuild_s"] = time.monotonic() - t0
                    self._admit(max_commits, timing, t0)
                    timing["transfer_s"] = time.monotonic() - t0
                    needed = True
                elif needed:
                    self._transfer(world, max_commits)
                    timing["transfer_s"] = time.monotonic() - t0
                break
            except _StreamFailed as exc:  # the others are training already: no second attempt
                raise DataLost(f"State.sync(): the joiner's state stream failed: {exc}") from exc
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
        if rebuilder is not None:
            ahead_world = _live_world(self.group)
            if ahead_world is not None:
                self._look_ahead(ahead_world)
        return changed or needed
