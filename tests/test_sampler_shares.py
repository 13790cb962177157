"""ElasticSampler with speed-weighted per-rank batch sizes (pure logic)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from resilient.elastic import ElasticSampler
from resilient.errors import ConfigError


def test_each_rank_gets_its_size_and_the_short_block_splits_in_proportion():
    s = [ElasticSampler(50, 4, r, 3, shuffle=False) for r in range(3)]
    for x in s:
        x.set_batch_sizes([8, 8, 4])
    assert [len(x.step_indices()) for x in s] == [8, 8, 4]
    assert s[0].steps_left == 3  # 20 + 20 + 10
    last = [x.step_indices(step=2) for x in s]
    assert [len(v) for v in last] == [4, 4, 2]  # 10 left, split 8:8:4
    assert sorted(i for v in last for i in v) == list(range(40, 50))


def test_uniform_sizes_keep_the_old_split():
    a, b = ElasticSampler(10, 4, 0, 3, shuffle=False), ElasticSampler(10, 4, 0, 3, shuffle=False)
    b.set_batch_sizes([4, 4, 4])
    assert [a.step_indices(1, r) for r in range(3)] == [b.step_indices(1, r) for r in range(3)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.lists(st.integers(0, 9), min_size=2, max_size=5), st.data())
def test_every_sample_once_across_size_changes_and_a_death(n, sizes, data):
    if sum(sizes) == 0:
        sizes[0] = 1
    world = len(sizes)
    samplers = [ElasticSampler(n, 3, r, world, seed=3) for r in range(world)]
    seen: list[int] = []
    dead_at = data.draw(st.integers(0, 6))
    step = 0
    while samplers[0].steps_left:
        if step == 1:
            mine = sizes[:len(samplers)]
            for x in samplers:
                x.set_batch_sizes(mine if sum(mine) else None)
        contributors = list(range(len(samplers)))
        if step == dead_at and len(samplers) > 1:
            contributors = contributors[:-1]  # the last rank died in this step
        for r in contributors:
            seen.extend(samplers[0].step_indices(rank=r))
        for x in samplers:
            x.record_step(contributors)
        if len(contributors) < len(samplers):
            samplers = samplers[:-1]
            for r, x in enumerate(samplers):
                x.set_world(r, len(samplers))
                x.set_batch_sizes(sizes[:len(samplers)] if sum(sizes[:len(samplers)]) else None)
        step += 1
        assert step < 10 * n + 10
    assert sorted(seen) == list(range(n))


def test_follow_shares_and_state_dict():
    s = ElasticSampler(100, 10, 1, 4, seed=1)
    sizes = s.follow_shares({"a": 2 / 7, "b": 2 / 7, "c": 2 / 7, "d": 1 / 7}, ["a", "b", "c", "d"], 56)
    assert sizes == [16, 16, 16, 8] and len(s.step_indices()) == 16
    t = ElasticSampler(100, 10, 1, 4, seed=1)
    t.load_state_dict(s.state_dict())
    assert t.sizes() == sizes and t.step_indices() == s.step_indices()
    assert s.follow_shares(None, ["a", "b", "c", "d"], 56) == [10] * 4


def test_bad_sizes_are_refused():
    s = ElasticSampler(10, 2, 0, 2)
    for bad in ([1], [0, 0], [1, -1], [1.5, 1], [True, 1]):
        with pytest.raises(ConfigError, match="batch sizes"):
            s.set_batch_sizes(bad)
    with pytest.raises(ConfigError, match="members for a world"):
        s.follow_shares({"a": 1.0}, ["a"], 4)
