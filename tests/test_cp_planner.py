"""The planner is a pure function: unit tests with plain member records."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from resilient.coordinator.planner import plan


@dataclass(frozen=True)
class M:
    member_id: str
    host: str
    local_rank: int = 0
    labels: dict = field(default_factory=dict)


def cluster(hosts: int, per_host: int, racks: int = 1) -> list[M]:
    return [M(f"w{h:02d}-{r}", f"host{h:02d}", r, {"rack": f"rack{h % racks}"})
            for h in range(hosts) for r in range(per_host)]


def test_same_host_members_are_adjacent():
    members = cluster(5, 4)
    random.Random(1).shuffle(members)
    p = plan(members)
    hosts = [m.split("-")[0] for m in p.ring]
    # each host appears as one contiguous run
    runs = [h for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h]
    assert len(runs) == len(set(runs)) == 5
    assert [c for _, c in p.host_groups] == [4] * 5


def test_rack_label_groups_hosts():
    members = cluster(6, 2, racks=2)
    p = plan(members)
    racks = [next(m.labels["rack"] for m in members if m.member_id == mid) for mid in p.ring]
    assert racks == sorted(racks)


def test_deterministic_whatever_the_input_order():
    members = cluster(7, 3)
    expected = plan(members)
    for seed in range(5):
        shuffled = list(members)
        random.Random(seed).shuffle(shuffled)
        assert plan(shuffled) == expected


def test_demoted_members_go_to_the_ring_tail_and_tree_leaves():
    members = cluster(4, 2)
    p = plan(members, demoted={"w01-0", "w02-1", "not-a-member"})
    assert p.demoted == ("w01-0", "w02-1")
    assert p.ring[-2:] == ("w01-0", "w02-1")
    idx = {m: i for i, m in enumerate(p.ring)}
    parents = set(p.parent)
    for d in p.demoted:
        assert idx[d] not in parents                 # nobody hangs below a demoted member
        assert p.ring[p.parent[idx[d]]] not in p.demoted


def test_tree_is_a_valid_rooted_tree():
    p = plan(cluster(9, 3), demoted={"w00-0"})
    assert p.parent[0] == -1 and p.parent.count(-1) == 1
    for i, parent in enumerate(p.parent[1:], start=1):
        # walking up always reaches the root
        seen, j = set(), i
        while j != -1:
            assert j not in seen
            seen.add(j)
            j = p.parent[j]


def test_empty_and_single():
    assert plan([]).ring == () and plan([]).parent == ()
    p = plan([M("a", "h")])
    assert p.ring == ("a",) and p.parent == (-1,)


def test_all_demoted_still_plans():
    p = plan(cluster(2, 2), demoted={"w00-0", "w00-1", "w01-0", "w01-1"})
    assert len(p.ring) == 4 and p.parent[0] == -1


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        plan([M("a", "h1"), M("a", "h2")])
