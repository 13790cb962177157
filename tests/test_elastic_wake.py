"""coordinator/wake.py's PrefixWake over a real etcd: a change under the prefix wakes the
waiter (what a joiner's wait_admitted now waits on instead of a 20 ms poll); a change
elsewhere does not; no change returns False after the timeout."""
from __future__ import annotations

import threading

from resilient.coordinator.store import Store
from resilient.coordinator.wake import PrefixWake


def test_a_change_under_the_prefix_wakes_the_waiter_and_others_do_not(etcd_session, job_name):
    store = Store(etcd_session.endpoints)
    prefix = f"/resilient/{job_name}/sync-rebuilt/"
    wake = PrefixWake(store, prefix)
    try:
        store.put(f"/resilient/{job_name}/elsewhere", b"1")
        assert wake.wait(0.3) is False  # a change outside the prefix is no wake-up
        put = threading.Thread(target=lambda: store.put(prefix + "m1", b"3"))
        put.start()
        assert wake.wait(30) is True
        put.join(30)
        assert wake.wait(0.05) is False  # consumed: the next wait needs a new change
    finally:
        wake.close()
        store.close()
