"""IncrementalRing's batched update (a rack loss, a large join: one rebuild of the list
instead of one memmove per member) yields the planner's ring, like single updates."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import plan
from resilient.coordinator.ring import BATCH, IncrementalRing, plan_hash


def _info(i: int) -> MemberInfo:
    return MemberInfo(member_id=f"r{i}", host=f"h{i // 4}", local_rank=i % 4, address=f"10.0.0.{i % 250}:1",
                      labels={"rack": f"k{(i // 4) % 5}"}, pid=1)


batch = st.tuples(st.sets(st.integers(0, 120), max_size=3 * BATCH),
                  st.dictionaries(st.integers(0, 120), st.booleans(), max_size=3 * BATCH))


@settings(max_examples=60, deadline=None)
@given(st.lists(batch, min_size=1, max_size=6))
def test_batched_updates_give_the_planners_ring(batches: list[tuple[set[int], dict[int, bool]]]) -> None:
    ring, present = IncrementalRing(), dict[int, bool]()
    for remove, upsert in batches:
        gone = [i for i in remove if i in present and i not in upsert]
        ring.update(remove=[f"r{i}" for i in gone], upsert=[(_info(i), d) for i, d in upsert.items()])
        for i in gone:
            del present[i]
        present.update(upsert)
        demoted = {f"r{k}" for k, v in present.items() if v}
        p = plan([_info(k) for k in present], demoted)
        assert ring.ring() == p.ring
        assert ring.demoted_count == len(p.demoted)
        assert ring.hash() == plan_hash(p.ring, len(p.demoted))
        assert all(ring.position(m) == i for i, m in enumerate(p.ring))
        # a ring built at once (IncrementalRing.of, a loaded state's) is the same ring, and updates alike
        built = IncrementalRing.of([(_info(k), v) for k, v in present.items()] + [(_info(k), v) for k, v in upsert.items()])
        assert built.ring() == p.ring and built.demoted_count == len(p.demoted)
        built.update(remove=[f"r{k}" for k in list(present)[:2]])
        assert built.ring() == tuple(m for m in p.ring if m not in {f"r{k}" for k in list(present)[:2]})


def test_a_large_batch_removing_and_reinserting_one_id() -> None:
    ring = IncrementalRing()
    ring.update(upsert=[(_info(i), False) for i in range(4 * BATCH)])
    ring.update(remove=[f"r{i}" for i in range(BATCH)], upsert=[(_info(3), True)])
    want = plan([_info(i) for i in range(BATCH, 4 * BATCH)] + [_info(3)], {"r3"})
    assert ring.ring() == want.ring and ring.demoted_count == 1
