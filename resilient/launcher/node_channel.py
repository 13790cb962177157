"""The agent side of the local channel (node-lease mode, docs/scale.md): one unix socket
for all local ranks, one etcd watch on ``epoch`` for the whole node.

:class:`NodeChannel` listens on ``<run dir>/agent.sock`` (wire format:
:mod:`resilient.launcher.channel_wire`). For each connected rank it runs a reader thread
and a writer thread (a send queue, so a stopped rank never blocks the relay):

* ``hello``: the member id must be one the agent gave a running worker (``expects``);
  the rank is added to the node record (:class:`~.node_members.NodeMembers`) and
  answered ``registered``, then sent the newest ``epoch`` record;
* ``beat``: its time is kept; :meth:`stale` names the ranks silent for longer than the
  TTL (the agent removes them: a SIGSTOPped or otherwise hung rank);
* ``health``: a window of that rank only (another member id is refused), fed to the
  node's :class:`~resilient.coordinator.node_health.NodeHealthAggregator` (one
  ``health/<node>`` summary, written when something changed within the job's write
  budget; no per-rank write reaches etcd). The job's node count, which sizes the
  node's share of the budget, is taken from each relayed epoch (its member count over
  this node's ranks); a summary that waited for its time or a token is written by
  :meth:`NodeChannel.health_tick`, which a thread of the channel calls every 0.25 s;
* ``leave``: removed from the node record now, answered ``left``, and no longer served.

The node's one watch on ``epoch`` relays every value etcd delivers (the record as
stored: full or delta; each rank resolves and validates it as any etcd record, so no
parsed state crosses the socket); after a compacted watch the current value is re-read
and relayed. ``relayed`` counts records sent.

Failure behaviour: a malformed message is logged with its cause and dropped (the
connection stays); a frame that cannot be read closes that rank's connection only (its
beats stop, so it is removed after the TTL unless its process exits first). A socket
that cannot be bound raises :class:`~resilient.errors.ConfigError` (TMPDIR too long). A
failed etcd write for a hello is answered ``refused`` with the error (the rank's connect
fails with it); a failed health summary write is logged and retried with the next window.
:meth:`close` closes every connection and the watch and removes the socket.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import replace
from typing import Callable

from resilient.coordinator import keys
from resilient.coordinator.delta import epoch_size
from resilient.coordinator.node_health import NodeHealthAggregator, SummaryPolicy
from resilient.coordinator.store import Store, WatchEvent
from resilient.errors import ConfigError, StoreError
from resilient.launcher import channel_wire as wire
from resilient.launcher.node_members import NodeMembers

log = logging.getLogger("resilient.launcher")

#: seconds between the channel's checks for a health summary that waited
TICK_S = 0.25


class _Rank:
    """One connected rank: its socket, send queue and last beat."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.member_id: str | None = None
        self.last_beat = time.monotonic()
        self.outbox: queue.Queue[wire.Message | None] = queue.Queue()
        self.closed = False

    def post(self, msg: wire.Message) -> None:
        if not self.closed:
            self.outbox.put(msg)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(None)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class NodeChannel:
    """See the module docstring. ``expects(member_id) -> bool`` says whether a hello's id
    belongs to a running worker of this agent."""

    def __init__(self, path: str, store: Store, job: str, members: NodeMembers,
                 expects: Callable[[str], bool], health: SummaryPolicy | None = None) -> None:
        self.path, self.store, self.job, self.members, self.expects = path, store, job, members, expects
        self.health = NodeHealthAggregator(store, job, members.node, members.lease, health)
        self._health_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ranks: list[_Rank] = []
        self._latest: wire.EpochRecord | None = None
        self.relayed = 0
        self._closed = False
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._server.bind(path)
        except OSError as exc:
            self._server.close()
            raise ConfigError(f"cannot open the agent channel at {path} ({exc}): unix socket paths are limited "
                              "to 107 bytes; point TMPDIR at a shorter directory") from exc
        os.chmod(path, 0o600)
        self._server.listen(256)
        key = keys.epoch(job)
        kv, rev = store.get_with_revision(key)
        if kv is not None:
            self._latest = wire.EpochRecord(kv.value, kv.mod_revision)
            self._size_health(kv.value)
        self._watch = store.watch_key(key, rev + 1, self._on_epoch_events)
        self._accepter = threading.Thread(target=self._accept_loop, name="agent-channel", daemon=True)
        self._accepter.start()
        self._stop_ticks = threading.Event()
        threading.Thread(target=self._tick_loop, name="agent-health-tick", daemon=True).start()

    # -- epochs ---------------------------------------------------------------------------

    def _on_epoch_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            rec = None
            if ev.type == "resync":
                kv = self.store.get(keys.epoch(self.job))
                rec = wire.EpochRecord(kv.value, kv.mod_revision) if kv is not None else None
            elif ev.type == "put":
                rec = wire.EpochRecord(ev.value, ev.mod_revision)
            if rec is None:
                continue
            with self._lock:
                self._latest = rec
                targets = [r for r in self._ranks if r.member_id is not None]
            for r in targets:
                r.post(rec)
                self.relayed += 1
            self._size_health(rec.record)   # after the ranks have it: parsing is off their path

    def _size_health(self, raw: bytes) -> None:
        """Tell the health aggregator the job's node count: the epoch's member count over
        this node's ranks (a record that does not parse is left to the ranks' own
        validation and changes nothing here)."""
        size = epoch_size(raw)
        if size is None:
            return
        here = max(1, len(self.members.ids()))
        with self._health_lock:
            self.health.set_job_size(-(-size // here))

    # -- connections ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            rank = _Rank(sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._ranks.append(rank)
            threading.Thread(target=self._read_loop, args=(rank,), name="agent-channel-read", daemon=True).start()
            threading.Thread(target=self._write_loop, args=(rank,), name="agent-channel-write", daemon=True).start()

    def _write_loop(self, rank: _Rank) -> None:
        while True:
            msg = rank.outbox.get()
            if msg is None:
                break
            try:
                wire.send(rank.sock, msg)
            except wire.ChannelClosed:
                break
        rank.close()
        rank.sock.close()

    def _read_loop(self, rank: _Rank) -> None:
        try:
            for msg in wire.receive(rank.sock, wire.MAX_RANK_FRAME, lambda: rank.member_id or "a new rank"):
                self._handle(rank, msg)
        except wire.ChannelClosed as exc:
            if not self._closed:
                log.info("agent channel: %s disconnected (%s)", rank.member_id or "a rank", exc)
        finally:
            rank.close()
            with self._lock:
                if rank in self._ranks and rank.member_id is None:
                    self._ranks.remove(rank)   # a registered rank stays until it is forgotten (beats)

    def _handle(self, rank: _Rank, msg: wire.Message) -> None:
        if isinstance(msg, wire.Hello):
            self._hello(rank, msg)
        elif rank.member_id is None:
            log.error("agent channel: a %s before hello; dropped", type(msg).__name__.lower())
        elif isinstance(msg, wire.Beat):
            rank.last_beat = time.monotonic()
        elif isinstance(msg, wire.Health):
            self._health(rank.member_id, msg)
        elif isinstance(msg, wire.Leave):
            try:
                self.members.remove(rank.member_id, msg.reason)
            except StoreError as exc:
                log.error("agent channel: could not remove %s on its leave: %s", rank.member_id, exc)
            with self._health_lock:
                self.health.drop(rank.member_id)
            rank.post(wire.Left())
            with self._lock:   # no longer a member: not served epochs, not beat-checked
                self._ranks = [r for r in self._ranks if r is not rank]
        else:
            log.error("agent channel: %s sent a %s (an agent-to-rank message); dropped",
                      rank.member_id, type(msg).__name__.lower())

    def _hello(self, rank: _Rank, msg: wire.Hello) -> None:
        mid = msg.member.member_id
        if rank.member_id is not None or not self.expects(mid):
            why = (f"this connection is already registered as {rank.member_id}" if rank.member_id is not None else
                   f"member id {mid!r} is not one this agent gave a running worker "
                   "(connect with the RESILIENT_MEMBER_ID the launcher set, or run resilient-run "
                   "--no-node-lease for members that pick their own ids)")
            rank.post(wire.Refused(why))
            return
        try:
            self.members.add(replace(msg.member, ttl=self.members.ttl))
        except StoreError as exc:
            rank.post(wire.Refused(f"the agent could not write the node record: {exc}"))
            return
        with self._lock:
            rank.member_id, rank.last_beat = mid, time.monotonic()
            latest = self._latest
        rank.post(wire.Registered(self.members.lease, self.members.ttl, self.members.node))
        if latest is not None:
            rank.post(latest)
        log.info("agent channel: %s registered in node record %s", mid, self.members.node)

    def _tick_loop(self) -> None:
        while not self._stop_ticks.wait(TICK_S):
            self.health_tick()

    def health_tick(self) -> None:
        """Write the node's health summary if it waited and is due now (its paced time
        came, a token arrived); a thread of the channel calls it every :data:`TICK_S`.
        Never raises: a failed write is logged and retried."""
        with self._health_lock:
            try:
                self.health.tick()
            except StoreError as exc:
                log.warning("node %s: health summary write failed (retried): %s", self.members.node, exc)

    def _health(self, member_id: str, msg: wire.Health) -> None:
        if msg.record.get("member") != member_id:
            log.error("agent channel: %s sent a health window of %r; dropped (a rank reports only itself)",
                      member_id, msg.record.get("member"))
            return
        with self._health_lock:
            try:
                self.health.maybe_flush(msg.record)
            except StoreError as exc:
                log.warning("node %s: health summary write failed (next window retries): %s",
                            self.members.node, exc)

    # -- the agent's calls ----------------------------------------------------------------

    def stale(self, ttl: float) -> list[str]:
        """Registered ranks whose last beat is older than ``ttl`` seconds."""
        now = time.monotonic()
        with self._lock:
            return [r.member_id for r in self._ranks if r.member_id is not None and now - r.last_beat > ttl]

    def forget(self, member_id: str, reason: str | None = None) -> None:
        """Stop serving ``member_id`` (removed or exited); with ``reason`` tell it first."""
        with self._lock:
            gone = [r for r in self._ranks if r.member_id == member_id]
            self._ranks = [r for r in self._ranks if r.member_id != member_id]
        with self._health_lock:
            self.health.drop(member_id)
        for r in gone:
            if reason is not None:
                r.post(wire.Removed(reason))
            r.outbox.put(None)   # the writer sends what is queued, then closes the connection

    def close(self) -> None:
        self._closed = True
        self._stop_ticks.set()
        self._watch.cancel()
        try:
            self._server.shutdown(socket.SHUT_RDWR)   # wakes the accept loop (close alone does not)
        except OSError:
            pass
        try:
            self._server.close()
        finally:
            with self._lock:
                ranks, self._ranks = self._ranks, []
            for r in ranks:
                r.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
