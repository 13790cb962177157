"""The coordinator's decision is a pure function of what a pass read (coordinator/decide.py):
unit tests without etcd — the cause classification, the join debounce, re-admissions held
back, evictions, the repair of a malformed epoch record — and the default liveness rule
(coordinator/liveness.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from resilient.coordinator.decide import EpochFacts, HealthOutcome, Snapshot, decide, repair_number
from resilient.coordinator.eviction import Eviction
from resilient.coordinator.liveness import LeaseLiveness
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.policy import SuspectCase

NOW = 1000.0


def entry(m: str, pid: int = 1) -> tuple[MemberInfo, int]:
    return MemberInfo(member_id=m, host=f"h{m}", pid=pid, address=f"10.0.0.1:{pid}"), 100 + pid


def directory(*ids: str) -> dict[str, tuple[MemberInfo, int]]:
    return {m: entry(m) for m in ids}


def epoch(number: int, *ids: str, demoted: tuple[str, ...] = (), evicted: tuple[str, ...] = ()) -> EpochFacts:
    return EpochFacts(number, set(ids), set(demoted), {m: entry(m)[0] for m in ids}, (), evicted)


def snap(published: EpochFacts | None, alive: dict[str, tuple[MemberInfo, int]], **kw: object) -> Snapshot:
    return Snapshot(published=published, alive=alive, now=NOW, **kw)  # type: ignore[arg-type]


# -- what changed ----------------------------------------------------------------------------


def test_nothing_changed_is_unchanged_and_still_cleans_up_stale_markers_and_consumed_reports():
    d = decide(snap(epoch(3, "m0", "m1"), directory("m0", "m1"),
                    departed={"gone": ("/j/departed/gone", 5.0), "m1": ("/j/departed/m1", 6.0)},
                    bad_markers=["/j/departed/bad"], consumed=["/j/suspects/m9/m0"]))
    assert d.outcome == "unchanged"
    # a marker of a member still alive stays (its removal is still to come); the others go
    assert d.cleanup == ("/j/departed/gone", "/j/departed/bad", "/j/suspects/m9/m0")


def test_first_epoch_waits_for_min_members_then_is_initial_with_the_earliest_join():
    alive = directory("m0", "m1")
    assert decide(snap(None, alive, min_members=3)).outcome == "unchanged"
    d = decide(snap(None, alive, min_members=2, join_seen={"m0": 7.0, "m1": 5.0}))
    assert (d.outcome, d.cause, d.path, d.trigger, d.number) == ("publish", "initial", "join", 5.0, 1)
    assert d.added == ("m0", "m1") and d.removed == () and set(d.members) == {"m0", "m1"}


def test_a_member_that_restarted_under_the_same_id_is_removed_and_added_again():
    alive = directory("m0", "m1")
    alive["m1"] = entry("m1", pid=2)   # a new process: new pid, address and lease
    d = decide(snap(epoch(4, "m0", "m1"), alive, departed={"m1": ("/j/departed/m1", 9.0)}))
    assert d.outcome == "publish" and d.removed == ("m1",) and d.added == ("m1",)
    assert (d.cause, d.trigger, d.number) == ("member_lost", 9.0, 5)


def test_a_partial_pass_looks_only_at_the_dirty_members():
    pub = epoch(2, "m0", "m1", "m2")
    alive = directory("m0", "m1")   # m2 is gone from the directory...
    assert decide(snap(pub, alive, full=False, dirty=frozenset({"m1"}))).outcome == "unchanged"   # ...unmarked
    d = decide(snap(pub, alive, full=False, dirty=frozenset({"m2"})))
    assert d.outcome == "publish" and d.removed == ("m2",)


# -- the cause and trigger -------------------------------------------------------------------


def test_a_confirmed_suspect_beats_a_revoke_marker_and_triggers_at_its_first_report():
    d = decide(snap(epoch(1, "m0", "m1", "m2"), directory("m0"), confirmed={"m1": 3.0},
                    departed={"m1": ("/j/departed/m1", 1.0), "m2": ("/j/departed/m2", 2.0)}))
    assert (d.cause, d.path, d.trigger) == ("suspect_confirmed", "suspect", 3.0)
    assert d.removed == ("m1", "m2")


def test_a_revoke_is_found_by_the_member_marker_or_its_node_marker():
    d = decide(snap(epoch(1, "a-g0", "a-g1", "b-g0"), directory("b-g0"), node_of={"a-g0": "a", "a-g1": "a"},
                    departed={"a": ("/j/departed/a", 4.0)}))
    assert (d.cause, d.path, d.trigger, d.removed) == ("member_lost", "revoke", 4.0, ("a-g0", "a-g1"))


def test_a_removal_without_marker_is_a_lease_expiry_timed_by_the_watch_or_now():
    pub = epoch(1, "m0", "m1", "m2")
    d = decide(snap(pub, directory("m0"), lost_seen={"m2": 8.0}))
    assert (d.cause, d.path, d.trigger) == ("lease_expired", "lease_expiry", 8.0)
    d = decide(snap(pub, directory("m0")))
    assert d.trigger == NOW


def test_a_role_change_only_is_a_health_epoch_with_the_deadline_in_its_plan():
    pub = epoch(6, "m0", "m1", "m2")
    d = decide(snap(pub, directory("m0", "m1", "m2"),
                    health=HealthOutcome(demoted=frozenset({"m2"}), leaf_deadline_ms=10.0)))
    assert (d.outcome, d.cause, d.path, d.trigger) == ("publish", "health", None, NOW)
    assert d.demoted == {"m2"} and d.extras == {"leaf_deadline_ms": 10.0} and d.removed == d.added == ()
    # an avoided link that is new changes the plan too; one naming a dead member is dropped
    d = decide(snap(pub, directory("m0", "m1", "m2"), health=HealthOutcome(avoid=[["m0", "m1"], ["m1", "m9"]])))
    assert d.cause == "health" and d.extras == {"avoid": [["m0", "m1"]]}


# -- the join debounce ---------------------------------------------------------------------


def test_joins_alone_wait_for_their_debounce_but_ride_along_with_a_removal():
    pub = epoch(2, "m0", "m1")
    assert decide(snap(pub, directory("m0", "m1", "m2"), joins_due=False)).outcome == "joins_deferred"
    d = decide(snap(pub, directory("m0", "m1", "m2"), joins_due=True, join_seen={"m2": 11.0}))
    assert (d.outcome, d.cause, d.trigger, d.added) == ("publish", "joined", 11.0, ("m2",))
    d = decide(snap(pub, directory("m0", "m2"), joins_due=False))
    assert d.outcome == "publish" and d.removed == ("m1",) and d.added == ("m2",) and d.cause == "lease_expired"


def test_joins_with_a_role_change_do_not_wait():
    d = decide(snap(epoch(2, "m0", "m1", "m2"), directory("m0", "m1", "m2", "m3"), joins_due=False,
                    health=HealthOutcome(demoted=frozenset({"m1"}))))
    assert d.outcome == "publish" and d.added == ("m3",) and d.demoted == {"m1"}


# -- evictions and re-admissions -------------------------------------------------------------


def test_an_eviction_removes_a_live_member_and_joiners_wait_for_the_next_epoch():
    ev = Eviction(at=NOW, until=NOW + 30, hold_s=30.0, after_epoch=5)
    pub = epoch(5, "m0", "m1", "m2", "m3")
    d = decide(snap(pub, directory("m0", "m1", "m2", "m3", "m4"), health=HealthOutcome(evicted={"m3": ev})))
    assert (d.outcome, d.cause, d.path, d.trigger) == ("publish", "evicted", None, NOW)
    assert d.removed == ("m3",) and d.added == () and set(d.members) == {"m0", "m1", "m2"}
    assert d.held_back == {"m4"} and d.extras == {"evicted": {"m3": ev.to_dict()}}
    # an eviction of a member whose lease has gone too counts for nothing: a plain loss
    d = decide(snap(pub, directory("m0", "m1", "m2"), health=HealthOutcome(evicted={"m3": ev})))
    assert d.cause == "lease_expired" and "evicted" not in d.extras


def test_a_readmission_is_held_back_from_an_epoch_that_removes_and_published_alone_next():
    pub = epoch(8, "m0", "m1", "m2")
    health = HealthOutcome(readmitted=frozenset({"m3"}))
    d = decide(snap(pub, directory("m0", "m1", "m3"), health=health))
    assert d.outcome == "publish" and d.removed == ("m2",) and d.added == ()
    assert "m3" not in d.members and d.held_back == {"m3"}
    nxt = epoch(9, "m0", "m1")
    d = decide(snap(nxt, directory("m0", "m1", "m3"), full=False, dirty=frozenset({"m3"}), health=health))
    assert (d.outcome, d.cause, d.added, d.number) == ("publish", "readmitted", ("m3",), 10)
    # a partial pass looks at whom the policy let back in even when nothing marked it
    d = decide(snap(nxt, directory("m0", "m1", "m3"), full=False, health=health))
    assert d.added == ("m3",) and d.cause == "readmitted"


# -- repair ----------------------------------------------------------------------------------


def test_a_removal_while_an_admission_is_pending_leaves_the_joiners_out_and_marks_them_due():
    # epoch 5 added j1; its op seq is not agreed yet (admitting) when m2 is lost
    pending = decide(snap(epoch(5, "m0", "m1", "m2", "j1"), directory("m0", "m1", "j1"), admitting={"j1"},
                          departed={"m2": ("/j/departed/m2", 9.0)}))
    assert pending.outcome == "publish" and set(pending.members) == {"m0", "m1"}
    assert pending.removed == ("j1", "m2") and pending.added == ()
    assert pending.cause == "member_lost" and "j1" in pending.held_back   # added again by the next pass
    # agreed (nothing admitting): the joiner stays, only the lost member goes
    agreed = decide(snap(epoch(5, "m0", "m1", "m2", "j1"), directory("m0", "m1", "j1"),
                         departed={"m2": ("/j/departed/m2", 9.0)}))
    assert set(agreed.members) == {"m0", "m1", "j1"} and agreed.removed == ("m2",)
    # no removal: a pending admission changes nothing
    assert decide(snap(epoch(5, "m0", "j1"), directory("m0", "j1"), admitting={"j1"})).outcome == "unchanged"


def test_a_malformed_epoch_record_is_published_over_after_the_history():
    pub = epoch(4, "m0", "m1")
    d = decide(snap(pub, directory("m0", "m1"), corrupt=True, history_top=7, epoch_revision=90))
    assert (d.outcome, d.cause, d.number) == ("publish", "repaired", 8)
    d = decide(snap(None, directory("m0", "m1"), corrupt=True, history_top=0, epoch_revision=90, joins_due=False))
    assert (d.outcome, d.cause, d.number, d.added) == ("publish", "repaired", 90, ("m0", "m1"))
    assert repair_number(0, 0) == 1


# -- liveness --------------------------------------------------------------------------------


@pytest.mark.parametrize("remaining, first, ruling", [
    (2.0, NOW - 1, "confirm"),    # 10 s lease refreshed every 3.3 s: 8 s unrefreshed is two missed (+1 s slack)
    (3.0, NOW - 1, "wait"),       # 7 s: within the slack
    (9.5, NOW - 1, "wait"),       # refreshed lately, suspected only lately
    (9.5, NOW - 12, "dismiss"),   # kept being refreshed for a whole TTL after the report
])
def test_lease_liveness_confirms_only_by_the_lease(remaining: float, first: float, ruling: str):
    assert LeaseLiveness().judge(SuspectCase(first, remaining, 10.0, NOW)) == ruling


def test_the_snapshot_is_not_changed_by_deciding():
    alive = directory("m0", "m1", "m3")
    s = snap(epoch(8, "m0", "m1", "m2"), alive, health=HealthOutcome(readmitted=frozenset({"m3"})))
    before = replace(s)
    decide(s)
    assert s == before and set(alive) == {"m0", "m1", "m3"}


# -- measured link speeds ------------------------------------------------------------------


def test_measured_link_speeds_publish_once_then_noise_inside_the_band_publishes_nothing():
    alive = directory("m0", "m1")
    first = decide(snap(epoch(3, "m0", "m1"), alive, measured_speeds={"m0": 2e8, "m1": 1e8}))
    assert first.outcome == "publish" and first.cause == "health" and first.removed == first.added == ()
    assert first.extras["link_bps"] == {"m0": 2e8, "m1": 1e8} and first.link_speeds == {"m0": 2e8, "m1": 1e8}
    planned = replace(epoch(4, "m0", "m1"), link_speeds={"m0": 2e8, "m1": 1e8})
    noisy = decide(snap(planned, alive, measured_speeds={"m0": 2.3e8, "m1": 0.85e8}))
    assert noisy.outcome == "unchanged"
    moved = decide(snap(planned, alive, measured_speeds={"m0": 2.3e8, "m1": 3e8}))
    assert moved.outcome == "publish" and moved.link_speeds == {"m0": 2e8, "m1": 3e8}
    # a tighter band lets the same noise through
    assert decide(snap(planned, alive, measured_speeds={"m0": 2.3e8}, speed_band=0.1)).outcome == "publish"


def test_incomplete_or_unmeasured_speeds_publish_nothing_but_ride_along_with_a_change():
    alive = directory("m0", "m1")
    assert decide(snap(epoch(3, "m0", "m1"), alive, measured_speeds={"m0": 2e8})).outcome == "unchanged"
    assert decide(snap(epoch(3, "m0", "m1"), alive)).outcome == "unchanged"      # not measured
    lost = decide(snap(epoch(3, "m0", "m1", "m2"), alive, measured_speeds={"m0": 2e8}))
    assert lost.outcome == "publish" and lost.removed == ("m2",) and lost.extras["link_bps"] == {"m0": 2e8}
