"""``PrefixWake``: an event set by every change under an etcd prefix, for waits that
would otherwise poll etcd.

A joiner waits in ``CommunicatorEngine.wait_admitted`` until every other member has
rebuilt its Communicator over the joiner's epoch (each puts a key under
``sync-rebuilt/``); the survivors' admission allreduce waits for the joiner meanwhile,
so every millisecond between the last key landing and the joiner noticing it is paid by
the survivors. With ``PrefixWake`` the joiner re-reads the prefix as soon as a change
arrives instead of on a 20 ms poll.

Usage: build it before the first read of the prefix (it waits, boundedly, until the
watch is connected, so no change after that read is missed), then alternate reading
and :meth:`PrefixWake.wait`; :meth:`PrefixWake.close` cancels the watch.

Failure behaviour: a watch that does not connect within ``connect_timeout`` or drops
later loses nothing but speed — :meth:`wait` returns after its ``timeout`` either way,
so the caller's loop re-reads (a poll at that period; ``wait_admitted`` uses 0.1 s). It never raises from the watch
thread.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from resilient.coordinator.store import Store


class PrefixWake:
    """See the module docstring."""

    def __init__(self, store: Store, prefix: str, connect_timeout: float = 2.0) -> None:
        self._event = threading.Event()
        self._watch = store.watch_prefix(prefix, None, lambda _events: self._event.set())
        self._watch.connected.wait(connect_timeout)

    def wait(self, timeout: float) -> bool:
        """Wait until something under the prefix changed since the last call (True) or
        ``timeout`` passed (False)."""
        changed = self._event.wait(timeout)
        self._event.clear()
        return changed

    def close(self) -> None:
        self._watch.cancel()
