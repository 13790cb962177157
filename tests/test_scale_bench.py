"""bench/scale.py at a small size (the real coordinator over the simulated etcd), and the
simulated etcd's limits. Pure in-process; a few seconds."""
from __future__ import annotations

import argparse

import pytest

from bench.scale import run_sim
from bench.sim_store import MAX_REQUEST, Clock, SimStore
from resilient.coordinator.store import Put, Store
from resilient.errors import ConfigError, LeaseExpired, StoreError

KEYS = ("epoch_bytes_node_loss", "writes_per_epoch", "coordinator_cpu_ms_per_epoch", "coordinator_idle_core_fraction",
        "publish_ms_after_crash", "publish_ms_after_silent_loss", "deliver_p99_ms", "keepalives_per_s",
        "steady_writes_per_s", "etcd_db_mb_after_hour")


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(gpus=512, gpus_per_node=8, nodes_per_rack=8, ttl=5.0, proxies=4, steady=3.0,
                                   health_budget=10.0, health_window=1.0, health_noise=0.02, health_busy=0.5,
                                   health_warmup=2.0, reload_interval=300.0, derive_sample=4, seed=3,
                                   straggler_policy=False, sim_params=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_small_simulation_runs_every_scenario_and_agrees_on_the_plan():
    from resilient.collectives.status_exchange import tree_received

    out = run_sim(_args())
    assert set(KEYS) <= out.keys() and out["plan_hash_agree"] is True
    causes = [e["cause"] for e in out["epochs"]]
    assert causes == ["member_lost", "lease_expired", "lease_expired", "health", "joined", "member_lost"]
    # every live agent checked every epoch's hash: 64 nodes less the silent loss, a rack, the last loss
    assert [e["agents_checked"] for e in out["epochs"]] == [64, 63, 55, 55, 55, 54]
    assert out["epoch_bytes_node_loss"] < 2048 and out["writes_per_epoch"] <= 4
    # the data plane's etcd writes: no ledger key beyond 64 survivors, the join tree root's one key
    assert [e["data_plane_writes"] for e in out["epochs"]] == [0, 0, 0, 0, 1, 0]
    assert out["writes_per_epoch_with_data_plane"] <= 4
    # the largest removal's ledger summaries (the first crash: 511 survivors) go up the
    # 16-ary tree: sum(depths) summaries in all, not 511 x 510; half receive none, no one
    # but the planner more than a sixteenth
    n = out["ledger_survivors"]
    assert n == 511 and out["ledger_summaries_received_all_to_all"] == n * (n - 1)
    assert out["ledger_summaries_received"] == sum(tree_received(n, 16)) < 3 * n
    assert out["ledger_summaries_max_but_planner"] <= -(-(n - 1) // 16) and out["ledger_survivors_receiving_none"] >= n // 2
    # one lease per node, granted node_lease_ttl(5 s) = 4 s and refreshed every third of it
    assert out["node_lease_ttl_s"] == 4
    assert out["keepalives_per_s"] == pytest.approx(64 / (4.0 / 3), rel=0.05)
    # the silent loss = the lease's TTL + etcd's expiry tick wait (0-500 ms, virtual) + the
    # coordinator's reaction; the TTL plus the longest tick wait is the bound --ttl
    assert 0 <= out["lease_expiry_to_delete_ms"] <= 500
    assert out["publish_ms_after_silent_loss"] == pytest.approx(
        4000 + out["lease_expiry_to_delete_ms"] + out["silent_loss_reaction_ms"], abs=0.2)
    assert out["publish_ms_after_silent_loss_worst_tick"] == pytest.approx(4500 + out["silent_loss_reaction_ms"],
                                                                          abs=0.2)


def test_small_simulation_with_the_straggler_policy_probes_then_demotes():
    """The real detector, fed one node's health windows, first avoids the slow rank's
    link (an epoch with avoided links), then demotes it; every agent agrees on both."""
    out = run_sim(_args(straggler_policy=True))
    health = [e for e in out["epochs"] if e["cause"] == "health"]
    assert [e["avoid_links"] for e in health] == [1, 0] and out["straggler_policy"] is True
    assert out["plan_hash_agree"] is True and out["cpu_ms_per_epoch_avoiding_links"] is not None


def test_sim_store_enforces_etcds_limits():
    clock = Clock()
    st = SimStore(clock)
    with pytest.raises(StoreError, match="request is too large"):
        st.txn([], [Put("/k", b"x" * (MAX_REQUEST + 1))])
    for i in range(5):
        st.put(f"/big/{i}", b"x" * 1_000_000)
    with pytest.raises(StoreError, match="larger than max"):
        st.get_prefix("/big/")
    kvs, _, more = st.snapshot_page("/big/", "/big/", 2)
    assert len(kvs) == 2 and more
    lease = st.grant(2)
    st.put("/l", b"1", lease=lease)
    clock.run_until(clock.now + 3)          # expired on the lessor's tick: the key goes with it
    assert st.get("/l") is None
    with pytest.raises(LeaseExpired):
        st.keepalive(lease)


def test_calibration_measures_a_real_etcd_and_the_sim_loads_its_file(etcd_session, tmp_path):
    """bench/calibrate_sim.py against the real etcd (few samples): every Latency field
    fitted, non-negative; the file round-trips into the SimStore's latencies; a
    malformed file is refused naming the field and the fix."""
    import json

    from bench.calibrate_sim import FIELDS, load_params, measure
    from resilient.coordinator import Store

    store = Store(etcd_session.endpoints)
    try:
        got = measure(store, members=50, samples=5, big_kb=64)
    finally:
        store.close()
    fitted = got["fitted"]
    assert set(fitted) == set(FIELDS) and all(v >= 0 for v in fitted.values())
    assert fitted["read"] > 0 and fitted["write"] > 0 and fitted["txn"] > 0 and fitted["lease"] > 0
    path = tmp_path / "params.json"
    path.write_text(json.dumps({"v": 1, "fitted": fitted}))
    lat = load_params(str(path))
    assert SimStore(Clock(), lat).lat.txn == fitted["txn"]
    path.write_text(json.dumps({"v": 1, "fitted": {**fitted, "watch": -1}}))
    with pytest.raises(ConfigError, match="fitted.watch .*rerun bench/calibrate_sim.py"):
        load_params(str(path))


def test_sim_store_implements_every_store_method_with_its_parameters():
    """bench/scale.py hands the SimStore to the coordinator code as a Store (a cast:
    Store is the concrete etcd client, not a Protocol); that holds only while every
    Store method (but etcd's auth administration, which the coordinator never calls)
    exists on SimStore with the same parameters."""
    import inspect

    admin = {"add_role", "add_user", "enable_auth"}
    for name, fn in vars(Store).items():
        if name.startswith("_") or not callable(fn) or name in admin:
            continue
        sim = vars(SimStore).get(name)
        assert sim is not None, f"SimStore lacks Store.{name}"
        assert list(inspect.signature(sim).parameters) == list(inspect.signature(fn).parameters), name
