"""Rank side of the node agent's local channel (node-lease mode, docs/scale.md).

Unless run with ``--no-node-lease`` (``RESILIENT_NODE_LEASE=0``) the launcher sets
``RESILIENT_AGENT_SOCKET`` in every worker's environment, and :func:`resilient.connect` joins through the agent
instead of etcd (:func:`join_via_agent`):

* **registration**: ``hello`` with this rank's :class:`~resilient.coordinator.MemberInfo`;
  the agent writes it into its one ``nodes/<node>`` record on the node lease (no
  ``members/<id>`` key, no keep-alive of this rank's own) and answers ``registered``;
* **epochs**: the :class:`~resilient.coordinator.EpochWatcher` is built without an etcd
  watch (``watch=False``); every ``epoch`` record the agent relays is fed to it
  (:meth:`~resilient.coordinator.EpochWatcher.feed`), so it is parsed, delta-resolved and
  validated exactly like a value from etcd; ``watcher.watches_opened`` stays 0;
* **liveness**: :class:`AgentSession` (a :class:`~resilient.coordinator.MemberSession`
  without a lease of its own) sends a ``beat`` every ttl/3 from a daemon thread (SIGSTOP
  freezes it: the agent removes this rank after the TTL);
* **health**: :meth:`AgentSession.send_health` is the
  :class:`~resilient.health_reporter.HealthReporter`'s sink: windows go to the agent's
  :class:`~resilient.coordinator.health.NodeHealthAggregator`, not to etcd.

Failure behaviour: the agent refusing the hello (an id it did not hand out, a failed
etcd write) raises :class:`~resilient.errors.ConfigError` with its reason; no answer
within ``timeout``: :class:`~resilient.errors.ResilientTimeout`; no socket:
:class:`~resilient.errors.ConfigError` naming the path. A malformed message from the
agent is logged and dropped. **If the agent goes away** (its socket closes), the rank
falls back to its own etcd watch (``watches_opened`` becomes 1, epochs keep coming) and
its session is marked lost — nobody vouches for it any more and the node lease ends with
the agent — so the Communicator reports it removed instead of hanging. The agent
removing it (``removed``) also marks the session lost.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading

from resilient.coordinator.epoch import EpochWatcher
from resilient.coordinator.membership import KEEPALIVE_FRACTION, MemberInfo, MemberSession
from resilient.coordinator.store import Store
from resilient.coordinator.straggler import HealthRecord
from resilient.errors import ConfigError, ResilientTimeout, StoreError
from resilient.launcher import channel_wire as wire

log = logging.getLogger(__name__)

__all__ = ["AgentSession", "agent_socket", "join_via_agent"]


def agent_socket() -> str | None:
    """The agent's socket path from ``RESILIENT_AGENT_SOCKET`` (None: no agent channel)."""
    return os.environ.get(wire.SOCKET_ENV) or None


class _Link:
    """The connection: a reader thread dispatching the agent's messages."""

    def __init__(self, path: str, watcher: EpochWatcher, timeout: float) -> None:
        self.watcher = watcher
        self.session: AgentSession | None = None
        self.answers: queue.Queue[wire.Registered | wire.Refused] = queue.Queue()
        self.left = threading.Event()
        self.epochs_relayed = 0
        self._closing = False
        self._send_lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            self.sock.settimeout(None)
        except OSError as exc:
            self.sock.close()
            raise ConfigError(f"cannot reach the node agent at {path} ({exc}): {wire.SOCKET_ENV} is set by "
                              "resilient-run (its node agent); unset it outside the launcher") from exc
        self._reader = threading.Thread(target=self._read_loop, name="agent-link", daemon=True)
        self._reader.start()

    def send(self, msg: wire.Message) -> None:
        with self._send_lock:
            wire.send(self.sock, msg)

    def _read_loop(self) -> None:
        try:
            for msg in wire.receive(self.sock, wire.MAX_AGENT_FRAME, lambda: "the node agent"):
                self._dispatch(msg)
        except wire.ChannelClosed as exc:
            if not self._closing:
                self._agent_gone(str(exc))

    def _dispatch(self, msg: wire.Message) -> None:
        if isinstance(msg, (wire.Registered, wire.Refused)):
            self.answers.put(msg)
        elif isinstance(msg, wire.EpochRecord):
            self.epochs_relayed += 1
            self.watcher.feed(msg.record, msg.revision)
        elif isinstance(msg, wire.Removed):
            if self.session is not None:
                self.session.removed(f"the node agent removed this rank: {msg.reason}")
        elif isinstance(msg, wire.Left):
            self.left.set()
        else:
            log.error("agent channel: the node agent sent a %s (a rank-to-agent message); dropped",
                      type(msg).__name__.lower())

    def _agent_gone(self, why: str) -> None:
        if self.session is None:   # still joining: the hello fails with the cause
            self.answers.put(wire.Refused(f"the node agent closed the connection before answering ({why})"))
            return
        removed = self.session.lost.is_set()   # the agent removed this rank, then closed the channel
        log.log(logging.INFO if removed else logging.WARNING, "agent channel: %s (%s); falling back to this "
                "rank's own etcd watch", "closed after this rank's removal" if removed else "the node agent is gone",
                why)
        self.left.set()
        try:
            self.watcher.open_watch()
        except StoreError as exc:
            log.error("agent channel: could not open an epoch watch of our own: %s", exc)
        self.session.removed("the node agent is gone: nobody vouches for this rank and its node lease "
                             "ends with the agent")

    def close(self) -> None:
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class AgentSession(MemberSession):
    """A member registered through its node agent: ``member_id``, ``lease_id`` (the node
    lease), ``ttl``, ``node``, ``lost``, :meth:`on_lost`, :meth:`close` as a
    :class:`MemberSession`; no lease or keep-alive of its own (see the module docstring)."""

    def __init__(self, store: Store, job: str, info: MemberInfo, link: _Link, reg: wire.Registered) -> None:
        # MemberSession.__init__ is not called: it starts a keep-alive of a lease this rank
        # does not own; the fields its methods (on_lost, _mark_lost) use are set here.
        self.store, self.job, self.info, self.member_id = store, job, info, info.member_id
        self.lease_id, self.ttl, self.owns_lease, self.node = reg.lease, reg.ttl, False, reg.node
        self.heartbeat_file = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._on_lost = []
        self._lock = threading.Lock()
        self._link = link
        self._thread = threading.Thread(target=self._beat_loop, name=f"agent-beat:{self.member_id}", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        interval = max(0.05, self.ttl * KEEPALIVE_FRACTION)
        while not self._stop.wait(interval):
            try:
                self._link.send(wire.Beat())
            except wire.ChannelClosed:
                return   # the link's reader handles the agent being gone

    @property
    def epochs_relayed(self) -> int:
        """Epoch records the agent relayed to this rank so far."""
        return self._link.epochs_relayed

    def send_health(self, record: HealthRecord) -> None:
        """The HealthReporter sink: one window to the agent's aggregator. Raises
        :class:`~resilient.launcher.channel_wire.ChannelClosed` if the agent is gone."""
        self._link.send(wire.Health(record))

    def removed(self, why: str) -> None:
        """This rank is no longer a member (the agent removed it, or is gone)."""
        if not self.lost.is_set():
            log.warning("member %s: %s", self.member_id, why)
        self._mark_lost(closing=True)

    def close(self, revoke: bool = True, reason: str = "closed") -> None:
        """Stop beating; with ``revoke`` ask the agent to remove this rank now (waits up
        to 5 s for its answer), else the agent removes it when the process exits or its
        beats are missed for the TTL. Safe to call twice; never raises."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                self._link.send(wire.Leave(reason))
                if not self._link.left.wait(5.0):
                    log.warning("member %s: the node agent did not confirm the leave within 5 s", self.member_id)
            except wire.ChannelClosed as exc:
                log.warning("member %s: could not tell the node agent it leaves: %s", self.member_id, exc)
        self._mark_lost(closing=True)
        self._link.close()


def join_via_agent(store: Store, job: str, info: MemberInfo, path: str,
                   timeout: float = 30.0) -> tuple[AgentSession, EpochWatcher]:
    """Register ``info`` through the node agent at ``path``; the session and an epoch
    watcher fed by the agent's relay. Raises as the module docstring says; on failure
    nothing is left open."""
    watcher = EpochWatcher(store, job, watch=False)
    link: _Link | None = None
    try:
        link = _Link(path, watcher, timeout)
        link.send(wire.Hello(info))
        try:
            answer = link.answers.get(timeout=timeout)
        except queue.Empty:
            raise ResilientTimeout(f"the node agent at {path} did not answer member {info.member_id}'s hello "
                                   f"within {timeout:.0f}s") from None
        if isinstance(answer, wire.Refused):
            raise ConfigError(f"the node agent refused member {info.member_id}: {answer.message}")
        session = AgentSession(store, job, info, link, answer)
        link.session = session
        return session, watcher
    except BaseException:
        if link is not None:
            link.close()
        watcher.close()
        raise
