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
