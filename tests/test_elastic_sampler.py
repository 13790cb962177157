"""ElasticSampler (pure logic): every sample of an epoch exactly once across world changes."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from resilient.elastic.sampler import ElasticSampler
from resilient.errors import ConfigError


def _world(n: int, world: int, **kw) -> list[ElasticSampler]:
    return [ElasticSampler(n, rank=r, world_size=world, **kw) for r in range(world)]


def _run_step(samplers, contributors=None) -> list[int]:
    """One global step: each rank takes its slice; contributors' samples are 'trained'."""
    taken = [s.step_indices() for s in samplers]
    for s in samplers:
        s.record_step(contributors)
    ranks = range(len(samplers)) if contributors is None else contributors
    return [i for r in ranks for i in taken[r]]


def test_static_world_covers_epoch_once_and_ranks_are_disjoint():
    ss = _world(103, 4, batch_size=5, seed=3)
    per_rank = [list(s) for s in ss]
    seen = Counter(i for idx in per_rank for i in idx)
    assert set(seen) == set(range(103)) and max(seen.values()) == 1
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1
    assert len(ss[0]) == len(per_rank[0])


def test_same_inputs_same_plan_and_epoch_reshuffles():
    a, b = ElasticSampler(50, 4, seed=1), ElasticSampler(50, 4, seed=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == sorted(first)
    assert list(ElasticSampler(10, 3, shuffle=False)) == list(range(10))


def test_shrink_mid_epoch_reshards_remaining_without_skip_or_repeat():
    trained: list[int] = []
    ss = _world(100, 4, batch_size=3, seed=7)
    for _ in range(3):
        trained += _run_step(ss)
    # rank 2 dies at a step boundary; survivors renumber 0..2
    ss = [ss[0], ss[1], ss[3]]
    for r, s in enumerate(ss):
        s.set_world(r, 3)
    while ss[0].steps_left:
        trained += _run_step(ss)
    c = Counter(trained)
    assert set(c) == set(range(100)) and max(c.values()) == 1


def test_member_dying_mid_step_its_samples_are_served_again():
    ss = _world(40, 4, batch_size=2, shuffle=False)
    lost = ss[3].step_indices()
    trained = _run_step(ss, contributors=[0, 1, 2])  # rank 3's gradient was not summed
    assert not set(lost) & set(trained)
    ss = ss[:3]
    for r, s in enumerate(ss):
        s.set_world(r, 3)
    nxt = [i for s in ss for i in s.step_indices()]
    assert set(lost) <= set(nxt)  # re-served first (they are earliest in the order)
    while ss[0].steps_left:
        trained += _run_step(ss)
    c = Counter(trained)
    assert set(c) == set(range(40)) and max(c.values()) == 1


def test_grow_joiner_synced_by_state_dict():
    ss = _world(60, 2, batch_size=4, seed=5)
    trained = _run_step(ss) + _run_step(ss)
    joiner = ElasticSampler(1, 1)
    joiner.load_state_dict(json.loads(json.dumps(ss[0].state_dict())))  # JSON-able
    ss.append(joiner)
    for r, s in enumerate(ss):
        s.set_world(r, 3)
    assert len({tuple(s.step_indices()) for s in ss}) == 3
    while ss[0].steps_left:
        trained += _run_step(ss)
    c = Counter(trained)
    assert set(c) == set(range(60)) and max(c.values()) == 1


@pytest.mark.parametrize("seed", range(20))
def test_random_world_changes_exactly_once(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 300)
    world = rng.randint(1, 6)
    ss = _world(n, world, batch_size=rng.randint(1, 7), seed=seed)
    trained: list[int] = []
    while ss[0].steps_left:
        event = rng.random()
        if event < 0.15 and len(ss) > 1:  # a member dies mid-step
            dead = rng.randrange(len(ss))
            trained += _run_step(ss, [r for r in range(len(ss)) if r != dead])
            ss.pop(dead)
        elif event < 0.3 and len(ss) < 8:  # a joiner arrives, synced from rank 0
            j = ElasticSampler(1, 1)
            j.load_state_dict(ss[0].state_dict())
            ss.append(j)
        else:
            trained += _run_step(ss)
            continue
        for r, s in enumerate(ss):
            s.set_world(r, len(ss))
    c = Counter(trained)
    assert set(c) == set(range(n)) and (not c or max(c.values()) == 1)


def test_drop_last_drops_only_the_final_partial_block():
    ss = _world(23, 2, batch_size=5, drop_last=True, shuffle=False)
    got = [i for s in ss for i in s]
    assert sorted(got) == list(range(20))


def test_bad_arguments_name_the_cause():
    with pytest.raises(ConfigError, match="rank < world_size"):
        ElasticSampler(10, 2, rank=3, world_size=2)
    with pytest.raises(ConfigError, match="batch_size"):
        ElasticSampler(10, 0)
    s = ElasticSampler(10, 2, world_size=2)
    with pytest.raises(ConfigError, match="outside the world"):
        s.record_step([5])
    with pytest.raises(ConfigError, match="state_dict"):
        s.load_state_dict({"epoch": 1})
