"""A silent node loss is published within the liveness bound (docs/scale.md, "Silent
loss"): the node lease is granted ``node_lease_ttl(bound)`` so that etcd's expiry loop
(every 0.5 s) cannot push the revoke past the bound, and a node that keeps refreshing is
never declared dead.

The decision (:func:`node_lease_ttl`) is tested as a pure function, the lessor's timing
on the simulated etcd's virtual clock (no real time), and the whole path on a real etcd
with a real coordinator: a SIGSTOPped lease holder is removed by the lease-expiry path
while its sibling, refreshing, stays in every epoch."""
from __future__ import annotations

import math
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim_store import EXPIRY_TICK, MIN_LEASE_TTL, Clock, SimStore
from resilient.coordinator.liveness import ETCD_EXPIRY_LOOP, ETCD_MIN_LEASE_TTL, node_lease_ttl
from resilient.coordinator.membership import KEEPALIVE_FRACTION
from resilient.coordinator.store import WatchEvent
from resilient.errors import ConfigError
from tests.cp_helpers import PY, CoordinatorThread, Proc, wait_until


@given(st.floats(min_value=2.5, max_value=3600.0, allow_nan=False))
def test_granted_ttl_plus_the_expiry_loop_is_within_the_bound_and_as_long_as_it_can_be(bound):
    g = node_lease_ttl(bound)
    assert isinstance(g, int) and g >= ETCD_MIN_LEASE_TTL
    assert g + ETCD_EXPIRY_LOOP <= bound < g + 1 + ETCD_EXPIRY_LOOP


@pytest.mark.parametrize("bound", [2.49, 1.0, 0.0, -5.0, math.nan, math.inf])
def test_a_bound_etcd_cannot_keep_is_a_config_error_naming_the_fix(bound):
    with pytest.raises(ConfigError, match="pass a larger --ttl"):
        node_lease_ttl(bound)


def test_the_simulated_etcd_keeps_etcds_lessor_constants():
    assert (EXPIRY_TICK, MIN_LEASE_TTL) == (ETCD_EXPIRY_LOOP, ETCD_MIN_LEASE_TTL)


@settings(max_examples=60, deadline=None)
@given(bound=st.sampled_from([2.5, 3.0, 4.2, 5.0, 10.0]), tick_phase=st.floats(0.0, 0.4999),
       refresh_phase=st.floats(0.0, 0.999), refreshes=st.integers(3, 40))
def test_on_etcds_lessor_a_refreshing_node_stays_and_a_silent_one_goes_within_the_bound(
        bound, tick_phase, refresh_phase, refreshes):
    """Virtual time over the simulated etcd (0.5 s expiry loop at any phase): the lease
    refreshed every third of its TTL is never revoked; once the refreshes stop, its key
    is deleted no earlier than the lease's TTL and no later than ``bound`` after the last."""
    clock = Clock()
    clock.now += tick_phase                      # where the lessor's 0.5 s loop stands
    store = SimStore(clock)
    deleted: list[float] = []

    def on_event(evs: list[WatchEvent]) -> None:
        deleted.extend(clock.now for ev in evs if ev.type == "delete")

    store.watch_prefix("/n/", None, on_event)
    g = node_lease_ttl(bound)
    lease = store.grant(g)
    store.put("/n/node", b"{}", lease=lease)
    period = g * KEEPALIVE_FRACTION
    clock.advance(refresh_phase * period)
    last = clock.now
    for _ in range(refreshes):
        store.keepalive(lease)
        last = clock.now
        clock.advance(period)
        assert not deleted, "a node refreshing every third of its TTL was revoked"
    clock.run_until(last + bound + 1)
    assert len(deleted) == 1
    assert g <= deleted[0] - last <= bound


#: a node agent's lease holder: the node lease for the liveness bound, its record, one LeaseMux
HOLDER = """
import sys, time
from resilient.coordinator import Store, keys
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.lease_mux import LeaseMux
from resilient.coordinator.liveness import node_lease_ttl
from resilient.coordinator.membership import MemberInfo
endpoints, job, node, bound = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
store = Store(endpoints.split(","))
mux = LeaseMux(store)
granted = node_lease_ttl(bound)
lease = store.grant(granted)
mux.add(lease, granted)
ranks = tuple(MemberInfo(member_id=f"{node}-g{r}", host=node, local_rank=r, address=f"127.0.0.1:{29500 + r}", pid=0)
              for r in range(2))
store.put(keys.node(job, node), NodeRecord(node, node, {}, ranks, bound).to_json(), lease=lease)
print(f"READY {lease} {granted}", flush=True)
while True:
    time.sleep(1)
"""


def test_real_etcd_a_stopped_node_is_removed_by_lease_expiry_within_the_bound_its_refreshing_sibling_never(
        etcd_session, job_name):
    from resilient.coordinator import Store, keys
    from resilient.coordinator.epoch import Epoch, read_epoch

    bound = 3.0
    store = Store(etcd_session.endpoints)
    procs = [Proc([PY, "-c", HOLDER, etcd_session.endpoint_arg, job_name, node, str(bound)]) for node in ("na", "nb")]
    coord = None
    stopped = False
    try:
        ready = [p.wait_line(r"READY (\d+) (\d+)", 60) for p in procs]
        t_ready = time.monotonic()
        lease_a, lease_b = (int(m.group(1)) for m in ready)
        for lid in (lease_a, lease_b):   # etcd granted the shortened TTL: TTL + its loop <= the bound
            got = store.lease_ttl(lid)
            assert got is not None and got[1] == node_lease_ttl(bound) == 2
        coord = CoordinatorThread(etcd_session.endpoints, job_name, ttl=2.0)
        everyone = {"na-g0", "na-g1", "nb-g0", "nb-g1"}
        wait_until(lambda: (e := read_epoch(store, job_name)[0]) is not None and set(e.members) == everyone,
                   30, "the first epoch with both nodes")
        procs[1].signal(signal.SIGSTOP)   # a silent loss: nb's LeaseMux stops refreshing
        stopped = True
        t_stop = time.time()
        gone = wait_until(lambda: (e := read_epoch(store, job_name)[0]) is not None and "nb-g0" not in e.members
                          and e, 30, "the epoch without the stopped node")
        # the mechanism: etcd's lessor revoked the expired lease, the coordinator's watch saw
        # the record go (cause lease_expired: no departed marker, no suspect, no revoke of ours)
        assert gone.cause == "lease_expired" and set(gone.members) == {"na-g0", "na-g1"}
        assert set(gone.removed) == {"nb-g0", "nb-g1"} and store.lease_ttl(lease_b) is None
        print(f"published {1000 * (gone.published_at - t_stop):.0f} ms after the stop "
              f"(bound {bound:.0f} s; the last refresh was before the stop)")
        # no false positive: na refreshes over one stream and outlives its TTL several times
        wait_until(lambda: time.monotonic() - t_ready > 2 * node_lease_ttl(bound) + ETCD_EXPIRY_LOOP, 30,
                   "two lease TTLs of the refreshing node")
        assert store.lease_ttl(lease_a) is not None
        history = [Epoch.from_json(store.get(keys.epoch_record(job_name, n)).value) for n in coord.coordinator.published]
        assert history and all({"na-g0", "na-g1"} <= set(e.members) for e in history)
        assert [e.cause for e in history if e.removed] == ["lease_expired"]
    finally:
        if coord is not None:
            coord.close()
        if stopped:
            procs[1].signal(signal.SIGCONT)
        for p in procs:
            p.stop()
        store.close()
