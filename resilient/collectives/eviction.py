"""The evicted member's side of ``--straggler-policy evict`` (coordinator/eviction.py).

* :func:`removed_error`: the error a Communicator raises when an epoch no longer has its
  member — :class:`~resilient.errors.Evicted` (a ``RemovedFromGroup``) naming the
  re-admission time when the epoch's ``plan["evicted"]`` lists it, else the plain
  ``RemovedFromGroup``.
* :func:`rejoin` (``Communicator.rejoin``): close the old Communicator, ask the
  coordinator to re-admit this member (``readmit/<member>`` on its lease), wait for the
  epoch that has it again, reset the transport's connections and return a new
  Communicator built with ``joining=True`` on the same view, transport and settings: it
  starts at the group's op seq (the ``joinseq`` announcements of the others).

Failure behaviour: :func:`rejoin` raises ``RemovedFromGroup`` if the lease is gone (the
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

from resilient.errors import ConfigError, Evicted, RemovedFromGroup, TransportError

log = logging.getLogger(__name__)


def eviction_of(member_id: str, epoch: Any) -> dict | None:
    """``plan["evicted"][member_id]`` of ``epoch`` ({at, until, hold_s, count, ...}) or None."""
    plan = getattr(epoch, "plan", None) or {}
    entry = (plan.get("evicted") or {}).get(member_id) if isinstance(plan, dict) else None
    return entry if isinstance(entry, dict) else None


def removed_error(member_id: str, epoch: Any, message: str) -> RemovedFromGroup:
    """The error for a member that ``epoch`` does not contain (see the module docstring)."""
    ev = eviction_of(member_id, epoch)
    if ev is None:
        return RemovedFromGroup(message)
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


def rejoin(comm: Any, timeout: float | None = None) -> Any:
    """See :meth:`resilient.collectives.Communicator.rejoin`."""
    from resilient.collectives.communicator import Communicator

    view, me = comm.view, comm.member_id
    comm.close()
    if view.session_lost():
        raise RemovedFromGroup(f"member {me} lost its lease; it cannot be re-admitted — restart it as a new member")
    cur = view.current()
    last = comm._epoch.number
    if cur is not None and me in cur.members and cur.number <= last:
        raise ConfigError(f"member {me} is in epoch {cur.number}, the one its Communicator runs: it was not "
                          "evicted, there is nothing to rejoin")
    if cur is None or me not in cur.members:
        seen = cur.number if cur is not None else last
        ev = eviction_of(me, cur) if cur is not None else None
        if timeout is None:
            until = float(ev["until"]) if ev and "until" in ev else time.time()
            timeout = max(0.0, until - time.time()) + comm.epoch_timeout
        store, job, session = getattr(view, "store", None), getattr(view, "job", None), getattr(view, "session", None)
        if store is not None and job is not None and session is not None:
            from resilient.coordinator.eviction import request_readmission

            request_readmission(store, job, me, seen, session.lease_id)
        # forget every connection of the epochs before the eviction (the survivors dropped theirs)
        try:
            comm.transport.configure(seen, "", {})
        except TransportError as exc:   # already configured past it: nothing of the old epochs is left
            log.debug("rejoin: transport reset skipped: %s", exc)
        log.info("member %s asks to be re-admitted (newest epoch %d without it)", me, seen)
        cur = view.wait_for(lambda e: me in e.members and e.number > seen, timeout)
    log.info("member %s re-admitted in epoch %d", me, cur.number)
    # type(comm): a Communicator from resilient.connect() hands its transport, lease and store on
    return type(comm)(view, comm.transport, joining=True, **comm._init_kwargs)
