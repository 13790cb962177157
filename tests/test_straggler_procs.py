"""Straggler mitigation end to end with real processes: a real etcd, the real
``resilient coordinator --straggler-policy demote`` and 4 member processes
(bench/straggler.py's member mode: TCP transport wrapped by the shaper, health reporter,
an exactness check of every op against its reported contributors).

m2 is slowed 3x through its shaping file; the coordinator probes, then demotes it (epoch
roles), the leaf path keeps every result exact with m2 among the contributors; then the
file is rewritten at runtime to remove the slowness and m2 is promoted back, with the
ring in the topology-optimal order (what the planner gives with nobody demoted and no
link avoided). Every process is ended by PID in ``Run.close``."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402

from resilient.coordinator.epoch import read_epoch
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import plan

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script(ROOT / "bench" / "straggler.py", "straggler_bench")


def _wait(pred, timeout: float, what: str, run) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = run.first_epoch(pred)
        if hit is not None:
            return hit
        time.sleep(0.1)
    raise AssertionError(f"no epoch where {what} within {timeout}s; epochs: "
                         f"{[(r['number'], r['cause'], r['roles'], r['avoid']) for r in run.epochs]}")


def test_slow_member_is_demoted_kept_exact_and_promoted_back_to_the_optimal_ring(etcd_session):
    bench = _bench()
    args = argparse.Namespace(world=4, numel=1 << 16, report_s=0.5, ops=0, keep=False)
    cap = "bw=20MB/s,ref_bw=20MB/s"
    specs = {f"m{i}": cap for i in range(4)}
    specs["m2"] = cap + ",slow=3x"
    run = bench.Run(",".join(etcd_session.endpoints), "demote", specs, args, 0.0)
    try:
        t0 = run.start()
        demoted = _wait(lambda r: r["roles"].get("m2") == "demoted", 40, "m2 is demoted", run)
        assert demoted["cause"] == "health"
        assert [m for m, v in demoted["roles"].items() if v == "demoted"] == ["m2"]   # nobody else
        assert demoted["members"][-1] == "m2"                                         # at the tail
        # let ops run on the leaf path for a while, then heal m2 at runtime
        n_demoted = demoted["number"]
        logs_dir = run.dir

        def ops_in(epoch_n: int) -> int:
            p = logs_dir / "m2.jsonl"
            return sum(1 for l in p.read_text().splitlines() if f'"epoch": {epoch_n}' in l) if p.exists() else 0

        deadline = time.monotonic() + 30
        while ops_in(n_demoted) < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ops_in(n_demoted) >= 10, "no ops ran on the leaf path"
        (run.dir / "shape-m2").write_text(cap)
        healed_at = time.time()
        promoted = _wait(lambda r: r["number"] > n_demoted and r["roles"].get("m2") == "active", 40,
                         "m2 is promoted back", run)
        assert promoted["cause"] == "health"
        assert promoted["at"] >= healed_at
        infos = [MemberInfo(member_id=m, host="h") for m in promoted["members"]]
        optimal = list(plan(infos).ring)
        epoch, _ = read_epoch(run.store, run.job)
        assert list(epoch.members) == optimal == ["m0", "m1", "m2", "m3"]
        assert not epoch.plan.get("avoid") and all(v == "active" for v in epoch.roles.values())
        logs = run.stop()
    finally:
        run.close()
    # every op of every member exact over its contributors; on the leaf path m2 still counts
    assert all(r["ok"] for log in logs.values() for r in log), "a wrong result"
    assert all(len(log) == len(logs["m0"]) for log in logs.values())
    leaf_ops = [r for log in logs.values() for r in log if r["epoch"] == n_demoted]
    assert len(leaf_ops) >= 10 and all(sorted(r["contributors"]) == ["m0", "m1", "m2", "m3"] for r in leaf_ops)
    assert all(sorted(r["contributors"]) == ["m0", "m1", "m2", "m3"] for log in logs.values() for r in log)
    assert t0 < demoted["at"]


# Pairwise over (victim, policy): each victim and each policy once (the other two pairs
# ran the same code paths and cost ~30 s of make test's 20-minute budget).
@pytest.mark.parametrize("victim,policy", [("parent", "deadline"), ("m2", "demote")])
def test_leaf_or_its_parent_killed_on_the_leaf_path_survivors_finish_exactly(etcd_session, victim, policy):
    """SIGKILL (by PID) the demoted leaf, or its tree parent, while ops run on the leaf
    path (lossless, or under the deadline policy, where the 3x slow leaf's input is often
    left out): the coordinator removes it, the survivors finish the interrupted op from
    their ledgers and go on; every result of every survivor is exact over its
    contributors, and the survivors agree on every op's contributors."""
    import os
    import signal

    bench = _bench()
    args = argparse.Namespace(world=4, numel=1 << 16, report_s=0.5, ops=0, keep=False)
    cap = "bw=20MB/s,ref_bw=20MB/s"
    specs = {f"m{i}": cap for i in range(4)}
    specs["m2"] = cap + ",slow=3x"
    run = bench.Run(",".join(etcd_session.endpoints), policy, specs, args, 0.0)
    try:
        run.start()
        demoted = _wait(lambda r: r["roles"].get("m2") == "demoted", 40, "m2 is demoted", run)
        ring = demoted["members"]
        dead = "m2" if victim == "m2" else ring[0]     # the planner hangs the only leaf under ring[0]
        p = run.dir / "m0.jsonl"
        deadline = time.monotonic() + 30
        while sum(1 for l in p.read_text().splitlines() if f'"epoch": {demoted["number"]}' in l) < 5:
            assert time.monotonic() < deadline, "no ops on the leaf path"
            time.sleep(0.05)
        os.kill(run.procs[1 + int(dead[1:])].pid, signal.SIGKILL)
        _wait(lambda r: dead not in r["members"], 30, f"{dead} is removed", run)
        survivors = [m for m in ("m0", "m1", "m2", "m3") if m != dead]
        # survivors keep running ops in the new epoch
        p = run.dir / f"{survivors[0]}.jsonl"
        n0 = len(p.read_text().splitlines())
        deadline = time.monotonic() + 30
        while len(p.read_text().splitlines()) < n0 + 5:
            assert time.monotonic() < deadline, "survivors made no progress after the kill"
            time.sleep(0.05)
        (run.dir / "stop").write_text("1")
        deadline = time.monotonic() + 60
        while not all((run.dir / f"done-{m}").exists() for m in survivors):
            assert time.monotonic() < deadline, "survivors did not finish"
            time.sleep(0.05)
        logs = {m: [__import__("json").loads(l) for l in (run.dir / f"{m}.jsonl").read_text().splitlines() if l]
                for m in survivors}
    finally:
        run.close()
    assert all(r["ok"] for log in logs.values() for r in log), "a wrong result"
    assert len({len(log) for log in logs.values()}) == 1
    last = [log[-1]["contributors"] for log in logs.values()]
    if policy == "demote" or dead == "m2":     # nobody is left out: every survivor counts
        assert all(sorted(c) == sorted(survivors) for c in last)
    else:                                      # the deadline may leave the slow leaf m2 out
        assert all(set(survivors) - {"m2"} <= set(c) <= set(survivors) for c in last)
    by_seq: dict[int, set] = {}
    for log in logs.values():
        for r in log:
            by_seq.setdefault(r["seq"], set()).add(tuple(r["contributors"]))
    assert all(len(v) == 1 for v in by_seq.values()), "survivors disagree on an op's contributors"


def test_deadline_policy_finishes_ops_without_a_late_member_and_everyone_reports_it(etcd_session):
    """``--straggler-policy deadline`` with real processes: m2 starts every op 200 ms late
    (bench member mode's fixed per-op delay); the coordinator demotes it (same detection
    as ``demote``) and the epoch's plan carries the deadline; on the leaf path ops then
    finish without m2's input — m2 itself reporting the same contributors as everyone —
    and every output of every member is exact over the contributors it reported."""
    import json

    bench = _bench()
    args = argparse.Namespace(world=4, numel=1 << 16, report_s=0.5, ops=0, keep=False)
    cap = "bw=20MB/s,ref_bw=20MB/s"
    specs = {f"m{i}": cap for i in range(4)}
    run = bench.Run(",".join(etcd_session.endpoints), "deadline", specs, args, 200.0, leaf_deadline_ms=10.0)
    try:
        run.start()
        demoted = _wait(lambda r: r["roles"].get("m2") == "demoted", 60, "m2 is demoted", run)
        assert [m for m, v in demoted["roles"].items() if v == "demoted"] == ["m2"]
        from resilient.coordinator import keys
        from resilient.coordinator.epoch import Epoch

        kv = run.store.get(keys.epoch_record(run.job, demoted["number"]))
        assert kv is not None and Epoch.from_json(kv.value).plan["leaf_deadline_ms"] == 10.0
        p = run.dir / "m0.jsonl"

        def without_m2() -> int:
            rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
            return sum(1 for r in rows if r["epoch"] >= demoted["number"] and "m2" not in r["contributors"])

        deadline = time.monotonic() + 60
        while without_m2() < 5:
            assert time.monotonic() < deadline, "no op finished without the late member"
            time.sleep(0.1)
        logs = run.stop()
    finally:
        run.close()
    assert all(r["ok"] for log in logs.values() for r in log), "a wrong result"
    assert len({len(log) for log in logs.values()}) == 1
    by_seq: dict[int, set] = {}
    for log in logs.values():
        for r in log:
            by_seq.setdefault(r["seq"], set()).add(tuple(r["contributors"]))
    bad = {seq: v for seq, v in by_seq.items() if len(v) != 1}
    assert not bad, (f"members disagree on an op's contributors: {bad}; "
                     f"{ {m: [r for r in log if r['seq'] in bad] for m, log in logs.items()} }; "
                     f"{[(r['number'], r['cause'], r['members'], r['roles']) for r in run.epochs]}")
    left_out = [r for r in logs["m2"] if "m2" not in r["contributors"]]
    assert len(left_out) >= 5 and all(r["contributors"] == ["m0", "m1", "m3"] for r in left_out)
    assert all(r["epoch"] >= demoted["number"] for r in left_out)   # only ever on the leaf path


def test_evict_policy_slow_member_is_evicted_rejoins_after_the_hold_and_stays_in_once_healthy(etcd_session):
    """``--straggler-policy evict --evict-hold-s 3`` with real processes: m2 is slowed 3x;
    the coordinator evicts it (an epoch without it, cause ``evicted``, its lease alive);
    the survivors' ops go on over m0, m1, m3 with exact results; m2's Communicator raises
    ``Evicted`` naming the re-admission; m2 is healed at runtime and calls
    ``comm.rejoin()``; it is re-admitted (cause ``readmitted``) no earlier than the
    published hold, runs ops with the group's op seqs, stays in over several healthy
    windows, and the ring is the topology-optimal one again."""
    import json

    from resilient.coordinator import keys

    bench = _bench()
    args = argparse.Namespace(world=4, numel=1 << 16, report_s=0.5, ops=0, keep=False)
    cap = "bw=20MB/s,ref_bw=20MB/s"
    specs = {f"m{i}": cap for i in range(4)}
    specs["m2"] = cap + ",slow=3x"
    hold = 3.0
    run = bench.Run(",".join(etcd_session.endpoints), "evict", specs, args, 0.0, evict_hold_s=hold)
    try:
        run.start()
        out = _wait(lambda r: r["cause"] == "evicted" and "m2" not in r["members"], 60, "m2 is evicted", run)
        assert out["members"] == ["m0", "m1", "m3"] and set(out["roles"].values()) == {"active"}
        ev = out["evicted"]["m2"]
        assert ev["hold_s"] == hold and ev["count"] == 1
        assert run.store.get(keys.member(run.job, "m2")) is not None        # its lease is alive
        events = run.dir / "m2.events.jsonl"

        def rows(p: Path) -> list[dict]:
            return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []

        deadline = time.monotonic() + 30
        while not rows(events):
            assert time.monotonic() < deadline, "m2 never got Evicted"
            time.sleep(0.05)
        got = rows(events)[0]
        assert got["event"] == "evicted" and got["epoch"] >= out["number"]
        assert got["readmit_at"] == ev["until"] and got["hold_s"] == hold
        assert "evicted" in got["message"] and "straggler" in got["message"] and "rejoin" in got["message"]
        # the survivors keep running without it while it is out
        p0 = run.dir / "m0.jsonl"
        deadline = time.monotonic() + 30
        while sum(1 for r in rows(p0) if r["epoch"] == out["number"]) < 3:
            assert time.monotonic() < deadline, "the survivors made no progress while m2 was out"
            time.sleep(0.05)
        (run.dir / "shape-m2").write_text(cap)            # healed at runtime
        back = _wait(lambda r: r["number"] > out["number"] and "m2" in r["members"], 60, "m2 is re-admitted", run)
        assert back["cause"] == "readmitted" and not back["evicted"]
        assert back["published_at"] >= ev["until"]
        # m2 runs ops again, then stays in over 6 health windows of its own on probation
        p2 = run.dir / "m2.jsonl"
        deadline = time.monotonic() + 30
        while sum(1 for r in rows(p2) if r["epoch"] >= back["number"]) < 10:
            assert time.monotonic() < deadline, "m2 ran no ops after its re-admission"
            time.sleep(0.05)
        windows: set = set()
        deadline = time.monotonic() + 40
        while len(windows) < 6:
            assert time.monotonic() < deadline, f"m2 wrote {len(windows)} health windows after re-admission"
            kv = run.store.get(keys.health_of(run.job, "m2"))
            rec = json.loads(kv.value) if kv else {}
            if rec.get("epoch", 0) >= back["number"]:
                windows.add((rec["seq"], rec["at"]))
            time.sleep(0.1)
        assert run.first_epoch(lambda r: r["number"] > back["number"] and "m2" not in r["members"]) is None
        epoch, _ = read_epoch(run.store, run.job)
        optimal = list(plan([MemberInfo(member_id=m, host="h") for m in epoch.members]).ring)
        assert list(epoch.members) == optimal == ["m0", "m1", "m2", "m3"]
        assert all(v == "active" for v in epoch.roles.values()) and "evicted" not in epoch.plan
        logs = run.stop()
        ev_rows = rows(events)
    finally:
        run.close()
    assert [r["event"] for r in ev_rows] == ["evicted", "rejoined"]
    assert all(r["ok"] for log in logs.values() for r in log), "a wrong result"
    by_seq: dict[int, set] = {}
    for log in logs.values():
        for r in log:
            by_seq.setdefault(r["seq"], set()).add(tuple(r["contributors"]))
    assert all(len(v) == 1 for v in by_seq.values()), "members disagree on an op's contributors"
    assert len({len(logs[m]) for m in ("m0", "m1", "m3")}) == 1           # the survivors never skipped an op
    # m2's last op (the one it got Evicted in, if in flight) may be finished by recovery with
    # its contribution (an all-gather-phase removal keeps every member); every op after it
    # until m2 is back runs over the survivors
    rejoined = ev_rows[1]
    out_ops = [r for r in logs["m0"] if ev_rows[0]["seq"] < r["seq"] < rejoined["seq"]]
    assert out_ops and all(r["contributors"] == ["m0", "m1", "m3"] for r in out_ops), \
        [(r["seq"], r["contributors"], r["recovered"]) for r in out_ops[:3]]
    m2_after = [r for r in logs["m2"] if r["seq"] >= rejoined["seq"]]
    assert m2_after and m2_after[0]["seq"] == rejoined["seq"]             # started at the group's op seq
    assert all("m2" in r["contributors"] for r in m2_after)
    assert not {r["seq"] for r in logs["m2"]} & {r["seq"] for r in out_ops}   # nothing while it was out
    print(json.dumps({"evicted_in_flight": ev_rows[0]["in_flight"],
                      "survivor_ops_recovered": sum(1 for m in ("m0", "m1", "m3") for r in logs[m] if r["recovered"]),
                      "ops_while_out": len(out_ops)}))
