"""LeaseMux: many leases kept alive over one stream; a revoked one is reported lost.
Real etcd."""
from __future__ import annotations

import pytest

from resilient.coordinator import Store
from resilient.coordinator.lease_mux import LeaseMux
from tests.cp_helpers import wait_until


@pytest.mark.parametrize("streams", [1, 3])
def test_one_stream_keeps_many_leases_and_reports_a_revoked_one(etcd_session, streams):
    store = Store(etcd_session.endpoints)
    mux = LeaseMux(store, streams=streams)
    lost: list[int] = []
    try:
        leases = [store.grant(2) for _ in range(20)]
        for lid in leases:
            mux.add(lid, 2, lost.append)
        wait_until(lambda: mux.received >= 3 * len(leases), 30, "three refreshes of every lease")
        assert all(store.lease_ttl(lid) is not None for lid in leases)   # past their 2 s TTL: refreshed
        store.revoke(leases[0])
        wait_until(lambda: lost == [leases[0]], 15, "the revoked lease reported lost")
        assert leases[0] in mux.lost and len(mux) == 19 and mux.reconnects == 0
        assert mux.batches < mux.sent      # refreshes leave in per-tick batches, not one by one
    finally:
        mux.close()
        store.close()


def test_a_stalled_etcd_gets_one_refresh_in_flight_per_lease_and_keeps_every_lease(etcd):
    """etcd frozen (SIGSTOP) for longer than a refresh interval: a refresh that comes due
    while the lease's last one is unanswered is held back (``deferred``), so no lease has
    two in flight, and sent once etcd answers again; no lease is lost."""
    import os
    import signal
    import time

    store = Store(etcd.endpoints)
    mux = LeaseMux(store, streams=2)
    lost: list[int] = []
    pid = etcd.members[0].proc.pid
    try:
        leases = [store.grant(6) for _ in range(30)]     # refreshed every 2 s
        for lid in leases:
            mux.add(lid, 6, lost.append)
        wait_until(lambda: mux.received >= 2 * len(leases), 30, "two refreshes of every lease")
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 2.8        # every lease comes due during the freeze
            in_flight = 0
            while time.monotonic() < deadline:
                in_flight = max(in_flight, mux.sent - mux.received)
                time.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert 0 < in_flight <= len(leases)          # one refresh in flight per lease at most
        wait_until(lambda: mux.deferred > 0 and mux.received == mux.sent, 20, "the held-back refreshes sent and answered")
        received = mux.received
        wait_until(lambda: mux.received >= received + len(leases), 20, "every lease refreshed again")
        assert lost == [] and mux.lost_unanswered == 0 and mux.reconnects == 0
        assert all(store.lease_ttl(lid) is not None for lid in leases)
    finally:
        mux.close()
        store.close()
