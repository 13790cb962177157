"""LeaseMux's refresh schedule (RefreshWheel): pure logic, no etcd, no clock."""
from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.coordinator.lease_mux import TICK, RefreshWheel, interval_ticks
from resilient.coordinator.membership import KEEPALIVE_FRACTION


def _ids(reqs: list) -> list[int]:
    return [r.ID for r in reqs]


def test_interval_is_the_most_whole_ticks_within_a_third_of_the_ttl():
    assert interval_ticks(4) == 26                      # 1.30 s <= 4/3 s < 1.35 s
    assert interval_ticks(6) == 40                      # exactly 2 s: not rounded down a tick
    assert interval_ticks(0.01) == 1                    # never less than one tick
    for ttl in (2, 3, 4, 5, 30):
        every = interval_ticks(ttl) * TICK
        assert every <= ttl * KEEPALIVE_FRACTION + 1e-9 < every + TICK


def test_leases_added_together_are_dealt_evenly_over_the_ticks_of_their_interval():
    wheel = RefreshWheel()
    every = interval_ticks(4)
    for lid in range(1, 3 * every + 1):
        wheel.add(lid, 4, None, now_tick=0)
    per_tick = [len(wheel.due(t)) for t in range(1, every + 1)]
    assert per_tick == [3] * every                      # no burst: each tick carries N / interval


@settings(max_examples=50, deadline=None)
@given(ttls=st.lists(st.sampled_from([2, 3, 4, 5]), min_size=1, max_size=40),
       start=st.integers(0, 1000))
def test_every_lease_is_refreshed_first_within_one_interval_then_exactly_every_interval(ttls, start):
    wheel = RefreshWheel()
    for lid, ttl in enumerate(ttls, 1):
        wheel.add(lid, ttl, None, now_tick=start)
    seen: dict[int, list[int]] = defaultdict(list)
    for t in range(start, start + 400):
        for lid in _ids(wheel.due(t)):
            seen[lid].append(t)
    for lid, ttl in enumerate(ttls, 1):
        every = interval_ticks(ttl)
        ticks = seen[lid]
        assert start < ticks[0] <= start + every
        assert all(b - a == every for a, b in zip(ticks, ticks[1:]))


def test_a_late_tick_sends_each_overdue_lease_once_and_books_from_now():
    wheel = RefreshWheel()
    for lid in range(1, 11):
        wheel.add(lid, 4, None, now_tick=0)
    late = 10 * interval_ticks(4)
    assert sorted(_ids(wheel.due(late))) == list(range(1, 11))
    assert wheel.next_tick() == late + interval_ticks(4)
    assert wheel.due(late + interval_ticks(4) - 1) == []


def test_a_removed_lease_is_not_sent_and_a_re_added_one_is_sent_once_per_interval():
    wheel = RefreshWheel()
    wheel.add(7, 4, None, now_tick=0)
    wheel.add(8, 4, None, now_tick=0)
    assert wheel.remove(7) is not None and wheel.remove(7) is None
    wheel.add(8, 4, None, now_tick=0)                   # again: the first booking goes stale
    sent = [lid for t in range(1, 4 * interval_ticks(4) + 1) for lid in _ids(wheel.due(t))]
    assert 7 not in sent and sent.count(8) == 4


def test_rebook_all_makes_every_lease_due_now_once():
    wheel = RefreshWheel()
    for lid in range(1, 6):
        wheel.add(lid, 4, None, now_tick=0)
    wheel.rebook_all(3)
    assert sorted(_ids(wheel.due(3))) == [1, 2, 3, 4, 5]
    assert wheel.due(3 + interval_ticks(4) - 1) == []
