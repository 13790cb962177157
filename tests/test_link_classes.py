"""Link classes and weighted shards (coordinator/link_classes.py) and the planner's use of
them: pure functions, plain member records."""
from __future__ import annotations

import sys
from pathlib import Path

from resilient.coordinator.link_classes import (
    declared_speeds, link_classes, member_speeds, shard_weights, speeds_from_health,
)
from resilient.coordinator.planner import plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cp_planner import M  # noqa: E402  (plain member records)


def test_classes_group_within_ratio_fastest_first_and_take_the_slowest_speed():
    speeds = {"a": 100.0, "b": 90.0, "c": 50.0, "d": 45.0, "e": 10.0}
    assert link_classes(speeds) == [(90.0, ["a", "b"]), (45.0, ["c", "d"]), (10.0, ["e"])]
    assert link_classes({}) == []


def test_weights_follow_each_local_index_slowest_class_or_are_uniform():
    classes = [(2.0, ["a1", "b1"]), (1.0, ["a0", "b0"])]
    assert shard_weights([["a0", "a1"], ["b0", "b1"]], classes) == [round(1 / 3, 6), round(2 / 3, 6)]
    # one slow member slows its whole index
    assert shard_weights([["a0", "a1"], ["b0", "b1"]], [(2.0, ["a0", "a1", "b1"]), (1.0, ["b0"])]) == \
        [round(1 / 3, 6), round(2 / 3, 6)]
    assert shard_weights([["a0", "a1"], ["b0", "b1"]], [(1.0, ["a0", "a1", "b0", "b1"])]) is None   # all equal
    assert shard_weights([["a0", "a1"], ["b0"]], classes) is None            # unequal hosts
    assert shard_weights([["a0", "a1"], ["b0", "x"]], classes) is None       # unknown member


def test_declared_and_measured_speeds_ignore_malformed_values():
    ms = [M("a", "h", labels={"link_bps": "1e9"}), M("b", "h", labels={"link_bps": "fast"}),
          M("c", "h", labels={"link_bps": "-1"}), M("d", "h", labels={"link_bps": "nan"})]
    assert declared_speeds(ms) == {"a": 1e9}
    assert member_speeds(ms, {"b": 5.0, "c": float("inf"), "d": "x"}) == {"a": 1e9, "b": 5.0}


def test_measured_speed_is_the_slowest_cross_host_receive_rate():
    host = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    health = {"b0": {"link_bps": {"a0": 100.0, "a1": 7.0}},      # a1 -> b0 on the same host? no: A -> B
              "a0": {"link_bps": {"a1": 1.0, "b0": 50.0}},       # a1 -> a0 is intra-host: ignored
              "b1": {"link_bps": {"a0": 80.0, "zz": 3.0}},       # unknown member ignored
              "a1": {"link_bps": "garbage"}, "x": "not a record"}
    assert speeds_from_health(health, host) == {"a0": 80.0, "a1": 7.0, "b0": 50.0}


def test_planner_pairs_like_links_across_hosts_and_weights_shards():
    # host A's fast member has local rank 1, host B's has local rank 0: the plan orders
    # each host by class so index 0 is fast on both, and gives index 0 two thirds
    ms = [M("a0", "A", 0, {"link_bps": "1e9"}), M("a1", "A", 1, {"link_bps": "2e9"}),
          M("b0", "B", 0, {"link_bps": "2e9"}), M("b1", "B", 1, {"link_bps": "1e9"})]
    p = plan(ms)
    assert p.ring == ("a1", "a0", "b0", "b1")
    assert p.host_groups == ((0, 2), (2, 2))
    assert p.shard_weights == (round(2 / 3, 6), round(1 / 3, 6))
    d = p.to_dict()
    assert d["shard_weights"] == list(p.shard_weights) and d["link_classes"][0] == [2e9, ["a1", "b0"]]


def test_planner_without_speeds_is_unchanged_and_measured_overrides_declared():
    ms = [M("a0", "A", 0), M("a1", "A", 1), M("b0", "B", 0), M("b1", "B", 1)]
    p = plan(ms)
    assert p.ring == ("a0", "a1", "b0", "b1") and p.shard_weights is None and "shard_weights" not in p.to_dict()
    p = plan(ms, link_speed={"a0": 1.0, "a1": 3.0, "b0": 1.0, "b1": 3.0})
    assert p.ring == ("a1", "a0", "b1", "b0") and p.shard_weights == (0.75, 0.25)
    # a speed missing for one member: no classes, no weights
    assert plan(ms, link_speed={"a0": 1.0, "a1": 3.0, "b0": 1.0}).shard_weights is None


def test_link_rates_are_bytes_over_wait_for_busy_links_only():
    from resilient.health_reporter import LINK_MIN_BYTES, link_rates

    got = link_rates({"a": 10 * LINK_MIN_BYTES, "b": 5 * LINK_MIN_BYTES, "c": 100, "d": 4 * LINK_MIN_BYTES},
                     {"a": 2 * LINK_MIN_BYTES, "d": 0}, {"a": 0.5, "b": 1.0, "c": 1.0, "d": 0.0})
    assert got == {"a": 16 * LINK_MIN_BYTES, "b": 5 * LINK_MIN_BYTES}


def test_reporter_windows_measure_a_slow_link_slower(etcd_session, job_name):
    """Real TCP transports: b sends to a at 4 MB/s, c at 16 MB/s (shaped); a's window
    reports b's link as the slower one, and the planner's reader classes them apart."""
    import threading

    import numpy as np

    from resilient.coordinator import Store
    from resilient.coordinator.health import read_health
    from resilient.health_reporter import HealthReporter
    from resilient.transport.shaping import ShapedTransport
    from resilient.transport.tcp import TcpTransport

    store = Store(etcd_session.endpoints)
    ts = {m: TcpTransport(m, job_name) for m in "abc"}
    addrs = {m: t.address for m, t in ts.items()}
    for t in ts.values():
        t.configure(1, "t", addrs)
    clock = [0.0]
    rep = HealthReporter(store, job_name, "a", None, ts["a"].stats, interval=1.0, clock=lambda: clock[0])
    senders = {"b": ShapedTransport(ts["b"], "bw=4MB/s"), "c": ShapedTransport(ts["c"], "bw=16MB/s")}
    try:
        n = 1 << 20
        for op, p in enumerate(["b", "c", "b", "c"]):   # one sender at a time: each wait is its transfer
            buf = np.zeros(n, dtype=np.uint8)
            th = threading.Thread(target=lambda: senders[p].wait([senders[p].isend("a", np.ones(n, dtype=np.uint8), op, 0)]))
            th.start()
            ts["a"].wait([ts["a"].irecv(p, buf, op, 0)], timeout=30)
            th.join(30)
            assert buf.all()
        clock[0] += 1.5
        assert rep.op_done(1, 0.5)
        rec = read_health(store, job_name)["a"]
        assert set(rec["link_bps"]) == {"b", "c"}
        assert rec["link_bps"]["b"] < 0.6 * rec["link_bps"]["c"], rec["link_bps"]
        speeds = speeds_from_health({"a": rec}, {"a": "A", "b": "B", "c": "C"})
        assert [ids for _, ids in link_classes(speeds)] == [["c"], ["b"]]
    finally:
        for t in ts.values():
            t.close()
        store.close()


def test_settled_speeds_move_only_outside_the_band_and_only_for_live_members():
    from resilient.coordinator.link_classes import settle_speeds

    cur = {"a": 100.0, "b": 100.0, "gone": 5.0}
    # inside the 25 % band: the published speeds stay; outside: the measurement (3 digits)
    assert settle_speeds(cur, {"a": 124.0, "b": 81.0}, {"a", "b"}) == {"a": 100.0, "b": 100.0}
    assert settle_speeds(cur, {"a": 126.0, "b": 79.0}, {"a", "b"}) == {"a": 126.0, "b": 79.0}
    assert settle_speeds(cur, {"c": 1234567.0, "a": "bad"}, {"a", "c"}) == {"a": 100.0, "c": 1230000.0}
    assert settle_speeds(cur, {}, {"a", "b"}, band=0.01) == {"a": 100.0, "b": 100.0}


def test_published_speeds_drop_malformed_entries():
    from resilient.coordinator.link_classes import parse_speeds

    assert parse_speeds({"a": 1.5, "b": "x", "c": -1, "d": True, "e": float("nan")}) == {"a": 1.5}
    assert parse_speeds(["a", 1.0]) == {} and parse_speeds(None) == {}


def test_unequal_hosts_deal_the_largest_hosts_slots_round_robin_and_weigh_them_by_load():
    from resilient.coordinator.host_slots import host_slots, slot_weights

    groups = [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2"]]
    slots = host_slots(groups)
    assert slots == [[0, 1, 2, 3], [0, 1, 2, 0]]
    # equal speeds: b0 carries slots 0 and 3, so each gets half a link
    assert slot_weights(groups, slots, dict.fromkeys(groups[0] + groups[1], 1.0)) == \
        [round(1 / 6, 6), round(1 / 3, 6), round(1 / 3, 6), round(1 / 6, 6)]
    # b0 twice as fast as the rest: its two slots are as fast as the others
    speed = dict.fromkeys(groups[0] + groups[1], 1.0) | {"b0": 2.0}
    assert slot_weights(groups, slots, speed) is None
    assert slot_weights(groups, slots, {"a0": 1.0}) is None                 # unknown speeds
    assert host_slots([["a0", "a1"], ["b0", "b1"]]) is None                 # equal hosts: slot = index
    assert host_slots([["a0", "a1"]]) is None and host_slots([["a0"], ["b0"]]) is None
    assert host_slots([["a0", "a1"], ["b0"]]) == [[0, 1], [0, 0]]


def test_planner_gives_unequal_hosts_slots_and_weights_also_after_a_death():
    ms = [M(f"a{i}", "A", i) for i in range(4)] + [M(f"b{i}", "B", i) for i in range(4)]
    full = plan(ms)
    assert full.host_slots is None and "host_slots" not in full.to_dict()
    after = plan([m for m in ms if m.member_id != "b2"])          # 2 x 4 less one: 4 + 3
    assert after.host_groups == ((0, 4), (4, 3))
    assert after.host_slots == ((0, 1, 2, 3), (0, 1, 2, 0))
    d = after.to_dict()
    assert d["host_slots"] == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert d["shard_weights"] == [round(1 / 6, 6), round(1 / 3, 6), round(1 / 3, 6), round(1 / 6, 6)]
    # with link speeds the fastest member of the small host takes the extra slot
    speeds = {m.member_id: 1.0 for m in ms} | {"b3": 2.0}
    p = plan([m for m in ms if m.member_id != "b2"], link_speed=speeds)
    assert p.ring[4:] == ("b3", "b0", "b1") and p.host_slots == ((0, 1, 2, 3), (0, 1, 2, 0))
    assert p.shard_weights is None   # b3's two slots at half of 2.0 = every other slot's 1.0
    # demoted members: no hierarchy, so no slots
    assert plan(ms[:7], demoted={"a1"}).host_slots is None
