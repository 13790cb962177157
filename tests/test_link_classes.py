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


def test_measured_speed_is_the_fastest_cross_host_link_in_either_direction():
    host = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    health = {"b0": {"link_bps": {"a0": 100.0, "a1": 7.0}},      # links a0-b0 and a1-b0 (A -> B)
              "a0": {"link_bps": {"a1": 1.0, "b0": 50.0}},       # a1 -> a0 is intra-host: ignored
              "b1": {"link_bps": {"a0": 80.0, "zz": 3.0}},       # unknown member ignored
              "a1": {"link_bps": "garbage"}, "x": "not a record"}
    # a link's figure bounds both of its ends: a0 100 (a0-b0), a1 7 (its only link),
    # b0 100 (as receiver from a0), b1 80 (as receiver from a0)
    assert speeds_from_health(health, host) == {"a0": 100.0, "a1": 7.0, "b0": 100.0, "b1": 80.0}


def test_a_noisy_figure_never_splits_a_pair_across_hosts():
    """Pairs (a0, b0) at 25 and (a1, b1) at 50; one window reads a0 -> b0 at 45 (a late
    receiver). Charged to both ends, a0 and b0 stay in one class: the plan keeps the pairs
    (local index c on both hosts is one pair) and only the weights move."""
    host = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    ms = [M("a0", "A", 0), M("a1", "A", 1), M("b0", "B", 0), M("b1", "B", 1)]
    for noisy in (25.0, 45.0):
        health = {"b0": {"link_bps": {"a0": noisy}}, "a0": {"link_bps": {"b0": 25.0}},
                  "b1": {"link_bps": {"a1": 50.0}}, "a1": {"link_bps": {"b1": 50.0}}}
        speeds = speeds_from_health(health, host)
        assert speeds["a0"] == speeds["b0"] == noisy and speeds["a1"] == speeds["b1"] == 50.0
        ring = plan(ms, link_speed=speeds).ring
        assert {frozenset((ring[0], ring[2])), frozenset((ring[1], ring[3]))} == \
            {frozenset(("a0", "b0")), frozenset(("a1", "b1"))}, ring


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


def test_link_figures_are_medians_over_the_last_windows_once_there_are_enough():
    from resilient.health_reporter import LINK_MIN_WINDOWS, LINK_WINDOWS, link_medians

    assert (LINK_MIN_WINDOWS, LINK_WINDOWS) == (5, 7)
    w = [{"a": 50.0, "b": 25.0}, {"a": 30.0, "b": 67.0}, {"a": 58.0, "b": 40.0}, {"a": 47.0, "b": 26.0},
         {"a": 52.0, "b": 27.0}, {"b": 24.0}]
    # a: 30/47/50/52/58 -> 50 (the 30 and the 58 are single windows' swings); b: 24..67 -> 26.5
    assert link_medians(w) == {"a": 50.0, "b": 26.5}
    assert link_medians(w[:4]) == {} and link_medians(w[:5]) == {"a": 50.0, "b": 27.0}
    assert link_medians([{"a": 1.0}, {"a": 2.0}, {"a": 4.0}, {"a": 8.0}], min_windows=3) == {"a": 3.0}   # even: the middle two's mean


class PacedRelay:
    """A TCP relay on loopback: one connection accepted, forwarded to ``upstream``; the
    bytes coming back from upstream are passed on at ``rate`` bytes/s (a slow link), the
    other direction as they come. Closed with its sockets and threads."""

    def __init__(self, upstream: str, rate: float) -> None:
        import socket
        import threading

        self.upstream, self.rate = upstream, rate
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.socks: list = []
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        import socket
        import threading

        try:
            client, _ = self.lsock.accept()
        except OSError:
            return
        host, _, port = self.upstream.rpartition(":")
        up = socket.create_connection((host, int(port)))
        self.socks += [client, up]
        for src, dst, rate in ((client, up, 0.0), (up, client, self.rate)):
            t = threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _pump(src, dst, rate: float) -> None:
        import time

        t0, sent = time.monotonic(), 0
        try:
            while chunk := src.recv(16 << 10):
                dst.sendall(chunk)
                sent += len(chunk)
                if rate:
                    time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        except OSError:
            pass

    def close(self) -> None:
        for sock in [self.lsock, *self.socks]:
            sock.close()
        for t in self.threads:
            t.join(5)


def test_reporter_windows_measure_a_slow_link_slower(etcd_session, job_name):
    """Real TCP transports; a dials b and c through relays that pass their bytes back at
    4 MB/s and 16 MB/s (slow links, not late senders); a's windows report b's link as the
    slower one, and the planner's reader classes them apart."""
    import threading

    import numpy as np

    from resilient.coordinator import Store
    from resilient.coordinator.health import read_health
    from resilient.health_reporter import LINK_MIN_WINDOWS, HealthReporter
    from resilient.transport.tcp import TcpTransport

    store = Store(etcd_session.endpoints)
    ts = {m: TcpTransport(m, job_name) for m in "abc"}
    addrs = {m: t.address for m, t in ts.items()}
    relays = {"b": PacedRelay(addrs["b"], 4e6), "c": PacedRelay(addrs["c"], 16e6)}
    ts["a"].configure(1, "t", {**addrs, "b": relays["b"].address, "c": relays["c"].address})   # a dials (lowest id)
    for m in "bc":
        ts[m].configure(1, "t", addrs)
    clock = [0.0]
    rep = HealthReporter(store, job_name, "a", None, ts["a"].stats, interval=1.0, clock=lambda: clock[0])
    try:
        n = 1 << 20
        for window in range(LINK_MIN_WINDOWS):   # a figure is reported once that many windows measured the link
            for op, p in enumerate(["b", "c"], start=2 * window):   # one sender at a time
                buf = np.zeros(n, dtype=np.uint8)
                th = threading.Thread(target=lambda: ts[p].wait([ts[p].isend("a", np.ones(n, dtype=np.uint8), op, 0)],
                                                                timeout=30))
                th.start()
                ts["a"].wait([ts["a"].irecv(p, buf, op, 0)], timeout=30)
                th.join(30)
                assert buf.all()
            clock[0] += 1.5
            assert rep.op_done(1, 0.5)
            assert ("link_bps" in read_health(store, job_name)["a"]) == (window == LINK_MIN_WINDOWS - 1)
        rec = read_health(store, job_name)["a"]
        assert set(rec["link_bps"]) == {"b", "c"}
        assert rec["link_bps"]["b"] < 0.6 * rec["link_bps"]["c"], rec["link_bps"]
        # the relay's 4 MB/s, not loopback's GB/s (a loaded machine may pace it slower: the
        # lower bound only says a figure was measured, the upper one that the relay set it)
        assert 0.5e6 < rec["link_bps"]["b"] < 6e6, rec["link_bps"]
        speeds = speeds_from_health({"a": rec}, {"a": "A", "b": "B", "c": "C"})
        # a's links bound a from below too: its fastest (to c) classes it with c
        assert [ids for _, ids in link_classes(speeds)] == [["a", "c"], ["b"]]
    finally:
        for t in ts.values():
            t.close()
        for r in relays.values():
            r.close()
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
