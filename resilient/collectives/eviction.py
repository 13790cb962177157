"""The evicted member's side of ``--straggler-policy evict`` (coordinator/eviction.py).

* :func:`removed_error`: the error a Communicator raises when an epoch no longer has its
  member — :class:`~resilient.errors.Evicted` (a ``RemovedFromGroup``) naming the
  re-admission time when the epoch's ``plan["evicted"]`` lists it, else the plain
  ``RemovedFromGroup``.
* :func:`await_readmission` (``Communicator.rejoin``, after it closed the old
  Communicator): ask the coordinator to re-admit this member (``readmit/<member>`` on its
  lease), reset the transport's connections and wait for the epoch that has it again;
  the caller then builds a new Communicator with ``joining=True`` on the same view,
  transport and settings: it starts at the group's op seq (the ``joinseq``
  announcements of the others).

Failure behaviour: :func:`await_readmission` raises ``RemovedFromGroup`` if the lease is gone (the
member must restart as a new member), ``ConfigError`` if the member was never evicted
(it is in the epoch its Communicator runs), ``TimeoutError`` if it is not re-admitted
within ``timeout`` (calling it again keeps waiting; the request stays), and whatever the
joiner path raises (``TimeoutError``/``EpochChanged`` when the group does not announce its
op seq within ``epoch_timeout``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from resilient.collectives.group import EpochLike, GroupView
from resilient.errors import ConfigError, Evicted, RemovedFromGroup, TransportError
from resilient.transport.base import Transport

log = logging.getLogger(__name__)


def eviction_of(member_id: str, epoch: EpochLike) -> dict[str, Any] | None:
    """``plan.evicted[member_id]`` of ``epoch`` ({at, until, hold_s, count, ...}) or None."""
    return epoch.plan.evicted.get(member_id)


def removed_error(member_id: str, epoch: EpochLike, message: str) -> RemovedFromGroup:
    """The error for a member that ``epoch`` does not contain (see the module docstring)."""
    ev = eviction_of(member_id, epoch)
    if ev is None:
        return RemovedFromGroup(message)
    until: float | None
    hold: float | None
    try:
        until, hold = float(ev["until"]), float(ev["hold_s"])
    except (KeyError, TypeError, ValueError):
        until = hold = None
    when = ("at an unknown time" if until is None else
            f"from {time.strftime('%H:%M:%S', time.localtime(until))} (in {max(0.0, until - time.time()):.1f} s; "
            f"hold {hold:g} s)")
    return Evicted(
        f"member {member_id} was evicted from the group in epoch {epoch.number} as a straggler (the coordinator's "
        f"detector confirmed it slow; --straggler-policy evict); it is re-admitted {when} once it asks: call "
        f"comm = comm.rejoin(timeout) to wait for that epoch and continue at the group's op sequence number",
        epoch=int(epoch.number), readmit_at=until, hold_s=hold)


def await_readmission(view: GroupView, transport: Transport, last_epoch: int, epoch_timeout: float,
                      timeout: float | None = None) -> EpochLike:
    """The epoch that has this member again (see :meth:`resilient.collectives.Communicator.rejoin`);
    ``last_epoch``: the epoch the closed Communicator ran."""
    me = view.member_id
    if view.session_lost():
        raise RemovedFromGroup(f"member {me} lost its lease; it cannot be re-admitted — restart it as a new member")
    cur = view.current()
    if cur is not None and me in cur.members and cur.number <= last_epoch:
        raise ConfigError(f"member {me} is in epoch {cur.number}, the one its Communicator runs: it was not "
                          "evicted, there is nothing to rejoin")
    if cur is None or me not in cur.members:
        seen = cur.number if cur is not None else last_epoch
        ev = eviction_of(me, cur) if cur is not None else None
        if timeout is None:
            until = float(ev["until"]) if ev and "until" in ev else time.time()
            timeout = max(0.0, until - time.time()) + epoch_timeout
        view.request_readmission(seen)
        # forget every connection of the epochs before the eviction (the survivors dropped theirs)
        try:
            transport.configure(seen, "", {})
        except TransportError as exc:   # already configured past it: nothing of the old epochs is left
            log.debug("rejoin: transport reset skipped: %s", exc)
        log.info("member %s asks to be re-admitted (newest epoch %d without it)", me, seen)
        cur = view.wait_for(lambda e: me in e.members and e.number > seen, timeout)
    log.info("member %s re-admitted in epoch %d", me, cur.number)
    return cur
