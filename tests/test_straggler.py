"""Pure tests of the straggler detector (coordinator/straggler.py) and the planner's link
avoidance, fed by a step-level simulation of a synchronous ring allreduce.

The simulation is the realistic part: members run 2(n-1) ring steps per op, each step
is "compute, then send to the successor and receive from the predecessor" and a member
finishes a step when both its send and its receive are done — so one slow member gates
everybody and every other member's extra time appears as waiting, exactly what the
transport's per-peer wait counters see. Demoted members take the leaf path (send input to
the tree parent before the ring, receive the result after). Health windows are built
from those timings the way resilient/health_reporter.py builds them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from resilient.coordinator.planner import plan
from resilient.coordinator.straggler import (
    DEMOTED, OK, PROBE, StragglerConfig, StragglerDetector, window_features,
)
from resilient.errors import ConfigError


@dataclass
class M:
    member_id: str
    host: str = "h0"
    local_rank: int = 0
    labels: dict = field(default_factory=dict)


@dataclass
class Faults:
    slow_member: dict = field(default_factory=dict)    # member -> send time factor
    slow_link: dict = field(default_factory=dict)      # (src, dst) -> send time factor
    late: dict = field(default_factory=dict)           # member -> seconds late per op


class RingSim:
    """Event-time simulation of ring allreduce ops; returns health windows."""

    def __init__(self, ids: list[str], seed: int, jitter: float = 0.3, compute: float = 1e-3,
                 tx: float = 2e-3, ops_per_window: int = 25) -> None:
        self.ids = ids
        self.rng = random.Random(seed)
        self.jitter, self.compute, self.tx = jitter, compute, tx
        self.ops_per_window = ops_per_window
        self.t = {m: 0.0 for m in ids}           # each member's clock (end of its last op)
        self.win_start = dict(self.t)
        self.wait = {m: {} for m in ids}
        self.ops = 0
        self.seq = 0
        self.total_ops = 0

    def j(self, x: float) -> float:
        return x * (1 + self.rng.uniform(-self.jitter, self.jitter))

    def send_time(self, src: str, dst: str, f: Faults, scale: float = 1.0) -> float:
        return self.j(self.tx * scale) * f.slow_member.get(src, 1.0) * f.slow_link.get((src, dst), 1.0)

    def _wait(self, m: str, peer: str, s: float) -> None:
        self.wait[m][peer] = self.wait[m].get(peer, 0.0) + max(0.0, s)

    def op(self, ring: list[str], demoted: set[str], f: Faults) -> None:
        active = [m for m in ring if m not in demoted] or list(ring)
        leaves = [m for m in ring if m in demoted and m not in active]
        n = len(active)
        start = {m: self.t[m] + self.j(self.compute) + f.late.get(m, 0.0) for m in ring}
        ready0 = dict(start)
        parent = {lf: active[i % n] for i, lf in enumerate(leaves)}
        for lf in leaves:   # leaf sends its whole input (n chunks) to its parent first
            p = parent[lf]
            arrive = start[lf] + self.send_time(lf, p, f, scale=n)
            self._wait(p, lf, arrive - ready0[p])
            ready0[p] = max(ready0[p], arrive)
            self.t[lf] = start[lf] + self.send_time(lf, p, f, scale=n)  # its own send done
        done = dict(ready0)
        for _step in range(2 * (n - 1)):
            ready = {m: done[m] + self.j(self.compute) for m in active}
            arrive = {}
            send_done = {}
            for i, m in enumerate(active):
                dst = active[(i + 1) % n]
                st = self.send_time(m, dst, f)
                send_done[m] = ready[m] + st
                arrive[dst] = ready[m] + st
            for i, m in enumerate(active):
                src = active[i - 1]
                self._wait(m, src, arrive[m] - ready[m])
                done[m] = max(send_done[m], arrive[m])
        for m in active:
            self.t[m] = done[m]
        for lf in leaves:
            p = parent[lf]
            back = done[p] + self.send_time(p, lf, f, scale=n)
            self._wait(lf, p, back - self.t[lf])
            self.t[lf] = max(self.t[lf], back)
            self.t[p] = max(self.t[p], done[p] + self.send_time(p, lf, f, scale=n))
        self.ops += 1
        self.total_ops += 1

    def windows(self, epoch: int) -> dict[str, dict] | None:
        if self.ops < self.ops_per_window:
            return None
        self.seq += 1
        now = max(self.t.values())
        recs = {}
        for m in self.ids:
            recs[m] = {"v": 1, "seq": self.seq, "epoch": epoch, "at": now, "ops": self.ops,
                       "window_s": self.t[m] - self.win_start[m], "wait_s": dict(self.wait[m])}
        self.win_start = dict(self.t)
        self.wait = {m: {} for m in self.ids}
        self.ops = 0
        return recs


def run(ids, ops, faults_at, seed=1, config=None, jitter=0.3):
    """Drive sim + detector + planner for ``ops`` ops; ``faults_at(op_index) -> Faults``.
    Returns (detector, history of (op index, ring, demoted, avoid))."""
    members = [M(m, host=f"h{i // 2}", local_rank=i % 2) for i, m in enumerate(ids)]
    det = StragglerDetector(config or StragglerConfig(link_hold_s=1e9))
    sim = RingSim(ids, seed, jitter=jitter)
    p = plan(members)
    ring, demoted, avoid, epoch = list(p.ring), set(), frozenset(), 1
    history = [(0, tuple(ring), frozenset(), frozenset())]
    for k in range(ops):
        sim.op(ring, demoted, faults_at(k))
        recs = sim.windows(epoch)
        if recs is None:
            continue
        parents = {ring[p.parent[i]] for i, m in enumerate(ring) if m in demoted and p.parent[i] >= 0}
        v = det.update(recs, ring, epoch, now=recs[ids[0]]["at"], exempt=parents)
        if v.demoted != frozenset(demoted) or v.avoid != avoid:
            p = plan(members, demoted=v.demoted, avoid=v.avoid)
            ring, demoted, avoid, epoch = list(p.ring), set(v.demoted), v.avoid, epoch + 1
            history.append((k, tuple(ring), frozenset(demoted), avoid))
    return det, history


IDS = [f"m{i}" for i in range(5)]


@pytest.mark.parametrize("seed", range(5))
def test_2000_ops_of_30_percent_jitter_and_no_straggler_demote_nobody(seed):
    det, history = run(IDS, 2000, lambda k: Faults(), seed=seed)
    assert history == history[:1], f"the ring changed without a straggler: {history[1:]} {det.events}"
    assert all(s.state == OK for s in det.members.values())
    assert len(det.members) == 5   # it did score everyone


def test_slow_member_is_probed_then_demoted_and_stays_demoted():
    det, history = run(IDS, 1000, lambda k: Faults(slow_member={"m2": 3.0}))
    v = det.verdict()
    assert v.demoted == {"m2"}
    assert v.avoid == frozenset()                      # the probe's link avoidance was dropped
    assert history[-1][1][-1] == "m2"                  # a leaf: the ring's tail
    states = [e[2].split(":")[0] for e in det.events if e[1] == "m2"]
    assert states == ["probe", "demoted"]
    assert len(history) == 3                           # probe epoch, demotion epoch: no flapping
    assert v.scores["m2"]["state"] == DEMOTED and v.scores["m2"]["score"] > 0.1


def test_slow_link_is_avoided_and_nobody_is_demoted():
    members = [M(m, host=f"h{i // 2}", local_rank=i % 2) for i, m in enumerate(IDS)]
    ring = plan(members).ring
    a, b = ring[1], ring[2]                            # a ring edge in the topology order
    det, history = run(IDS, 1000, lambda k: Faults(slow_link={(a, b): 3.0}))
    v = det.verdict()
    assert v.demoted == frozenset()
    assert v.avoid == {tuple(sorted((a, b)))}
    final = history[-1][1]
    adjacent = {frozenset((final[i], final[(i + 1) % 5])) for i in range(5)}
    assert frozenset((a, b)) not in adjacent
    assert any("slow link confirmed" in e[2] for e in det.events)
    assert len(history) == 2                           # one re-order, then stable


def test_member_late_by_a_fixed_delay_per_op_is_demoted():
    det, _ = run(IDS, 1000, lambda k: Faults(late={"m4": 0.02}))
    assert det.verdict().demoted == {"m4"}


def test_promotion_back_restores_the_topology_optimal_ring():
    members = [M(m, host=f"h{i // 2}", local_rank=i % 2) for i, m in enumerate(IDS)]
    optimal = plan(members).ring
    det, history = run(IDS, 1500, lambda k: Faults(slow_member={"m1": 3.0}) if k < 600 else Faults())
    demoted_at = [h for h in history if h[2]]
    assert demoted_at and demoted_at[0][2] == {"m1"}
    assert history[-1][2] == frozenset() and history[-1][3] == frozenset()
    assert history[-1][1] == optimal
    assert [e[2].split(":")[0] for e in det.events if e[1] == "m1"] == ["probe", "demoted", "promoted"]


def test_one_slow_window_in_every_few_never_confirms():
    # Slow 2 windows out of every 3 (never 3 in a row): a hiccup pattern, not a shift.
    det, history = run(IDS, 1500, lambda k: Faults(slow_member={"m3": 3.0}) if (k // 25) % 3 != 2 else Faults())
    assert len(history) == 1 and det.verdict().demoted == frozenset()


def test_hysteresis_band_keeps_a_demoted_member_demoted():
    # After demotion m0 gets "mildly slow": between release_shift and shift: no promotion.
    cfg = StragglerConfig(link_probe=False)
    det = StragglerDetector(cfg)
    ring = IDS

    def recs(seq, busy_m0):
        out = {}
        for m in IDS:
            busy = busy_m0 if m == "m0" else 0.001
            out[m] = {"seq": seq, "epoch": 1, "at": 100.0 + seq, "ops": 10, "window_s": 0.1,
                      "wait_s": {"x": 0.1 - busy * 10}}
        return out

    seq = 0
    for _ in range(3):
        seq += 1
        v = det.update(recs(seq, 0.005), ring, 1, 100.0 + seq)     # 40 % of the op: slow
    assert v.demoted == {"m0"}
    for _ in range(20):
        seq += 1
        v = det.update(recs(seq, 0.0017), ring, 1, 100.0 + seq)    # 7 %: inside the band
    assert v.demoted == {"m0"}
    for _ in range(5):
        seq += 1
        v = det.update(recs(seq, 0.001), ring, 1, 100.0 + seq)     # back to normal
    assert v.demoted == frozenset()


def test_never_more_than_a_minority_demoted():
    slow = {"m0": 3.0, "m1": 3.0, "m2": 3.0}
    det, _ = run(IDS, 800, lambda k: Faults(slow_member=slow), config=StragglerConfig(link_probe=False))
    assert len(det.verdict().demoted) <= 2


def test_a_window_is_counted_once_and_stale_or_bad_records_are_ignored():
    det = StragglerDetector(StragglerConfig(link_probe=False, confirm_windows=2))
    good = {m: {"seq": 1, "epoch": 1, "at": 50.0, "ops": 10, "window_s": 0.1, "wait_s": {"p": 0.09}} for m in IDS}
    good["m0"] = {"seq": 1, "epoch": 1, "at": 50.0, "ops": 10, "window_s": 0.1, "wait_s": {"p": 0.0}}
    for _ in range(5):   # the same window again and again: one observation
        v = det.update(good, IDS, 1, 50.0)
    assert v.demoted == frozenset() and det.members["m0"].slow_run == 1
    stale = {m: dict(r, seq=2) for m, r in good.items()}
    v = det.update(stale, IDS, 1, 50.0 + 11)   # older than stale_s
    assert det.members["m0"].slow_run == 1
    bad = {m: {"seq": 3, "at": 60.0, "ops": "x"} for m in IDS}
    det.update(bad, IDS, 1, 60.0)
    assert det.members["m0"].slow_run == 1
    assert window_features({"ops": 0, "window_s": 1.0}) is None
    assert window_features({"ops": 2, "window_s": 1.0, "wait_s": {"a": 0.5}}) == (0.25, 0.5, 2)


def test_departed_member_loses_its_state():
    det, _ = run(IDS, 600, lambda k: Faults(slow_member={"m2": 3.0}))
    assert "m2" in det.verdict().demoted
    v = det.update({}, [m for m in IDS if m != "m2"], 9, 1e6)
    assert "m2" not in det.members and v.demoted == frozenset()


def test_bad_config_names_the_fix():
    with pytest.raises(ConfigError, match="hysteresis"):
        StragglerDetector(StragglerConfig(shift=0.05, release_shift=0.1))
    with pytest.raises(ConfigError, match="min_members"):
        StragglerDetector(StragglerConfig(min_members=2))


def test_planner_separates_avoided_pairs_and_keeps_demoted_at_the_tail():
    members = [M(f"m{i}", host=f"h{i // 2}", local_rank=i % 2) for i in range(6)]
    base = plan(members, demoted={"m5"})
    a, b = base.ring[0], base.ring[1]
    p = plan(members, demoted={"m5"}, avoid={(a, b)})
    assert p.ring[-1] == "m5" and p.demoted == ("m5",)
    adjacent = {frozenset((p.ring[i], p.ring[(i + 1) % 6])) for i in range(6)}
    assert frozenset((a, b)) not in adjacent
    assert sorted(p.ring) == sorted(base.ring)
    assert plan(members, demoted={"m5"}, avoid={(a, b)}) == p     # deterministic
    assert plan(members, avoid=()) == plan(members)               # no avoidance: unchanged


def test_cli_straggler_policy_flag_defaults_to_demote_and_off_disables():
    import argparse

    from resilient.cli import coordinator as cli
    from resilient.coordinator.health import StragglerPolicy, no_demotion

    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    base = ["--etcd", "127.0.0.1:1", "--job", "j"]
    assert isinstance(cli.health_policy_from_args(ap.parse_args(base)), StragglerPolicy)
    assert cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "off"])) is no_demotion
    with pytest.raises(SystemExit):
        ap.parse_args(base + ["--straggler-policy", "bogus"])   # evict: tests/test_straggler_evict.py
    # deadline: opt-in, its grace published by the policy; the flag alone is refused
    dl = cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "deadline"]))
    assert isinstance(dl, StragglerPolicy) and dl.leaf_deadline_ms == cli.DEFAULT_LEAF_DEADLINE_MS == 10.0
    dl = cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "deadline", "--leaf-deadline-ms", "0"]))
    assert dl.leaf_deadline_ms == 0.0
    assert cli.health_policy_from_args(ap.parse_args(base)).leaf_deadline_ms is None
    with pytest.raises(ConfigError, match="--straggler-policy deadline"):
        cli.health_policy_from_args(ap.parse_args(base + ["--leaf-deadline-ms", "5"]))
    with pytest.raises(ConfigError, match="leaf deadline"):
        cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "deadline", "--leaf-deadline-ms", "-1"]))


def test_a_member_demoted_again_soon_after_promotion_is_held_twice_as_long():
    """Anti-flap: demoted -> promoted -> demoted again within redemote_window_s needs
    2x the clear windows (then 4x...), capped; after a long healthy spell it is 1x again."""
    cfg = StragglerConfig(link_probe=False, release_windows=2, max_release_windows=6, redemote_window_s=50)
    det = StragglerDetector(cfg)
    t = [100.0]
    seq = [0]

    def feed(busy_m0: float, n: int) -> frozenset:
        v = None
        for _ in range(n):
            seq[0] += 1
            t[0] += 1.0
            recs = {m: {"seq": seq[0], "epoch": 1, "at": t[0], "ops": 10, "window_s": 0.1,
                        "wait_s": {"x": 0.1 - (busy_m0 if m == "m0" else 0.001) * 10}} for m in IDS}
            v = det.update(recs, IDS, 1, t[0])
        return v.demoted

    def clear_windows_to_promote() -> int:
        for k in range(1, 50):
            if feed(0.001, 1) == frozenset():
                return k
        raise AssertionError("never promoted")

    assert feed(0.005, 3) == {"m0"}
    assert clear_windows_to_promote() == 2
    assert feed(0.005, 3) == {"m0"}              # again, soon: 2x
    assert clear_windows_to_promote() == 4
    assert feed(0.005, 3) == {"m0"}              # and again: capped at 6
    assert clear_windows_to_promote() == 6
    feed(0.001, 60)                              # a long healthy spell
    assert feed(0.005, 3) == {"m0"}
    assert clear_windows_to_promote() == 2
    with pytest.raises(ConfigError, match="max_release_windows"):
        StragglerDetector(StragglerConfig(release_windows=5, max_release_windows=4))
