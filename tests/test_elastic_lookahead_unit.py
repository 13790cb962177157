"""``State.sync()``'s look-ahead agreement (resilient/elastic/state.py), on a world of
threads whose engine admits joiners by rebuilding, as the real one does: when nothing
changed a sync() issues one 1-element allreduce for the next step and runs no exchange;
a change any one member sees (a joiner waiting, a death) makes every member run the full
exchange at the same later sync(). A member deciding otherwise than its peers would meet
another op kind at the same sequence number: the in-process world raises InputMismatch."""
from __future__ import annotations

import threading

import torch

from resilient.elastic import State
from resilient.torch_backend.inproc import InProcEngine, InProcWorld
from resilient.torch_backend.process_group import ResilientProcessGroup


class RebuildingEngine(InProcEngine):
    """An in-process engine that admits by rebuilding (``sync()`` takes the look-ahead path):
    ``pending_joiners`` is what the test sets, ``rebuild`` records the call (no joiner is
    really there, so the admission that follows finds no one to stream to); every
    allreduce's shape is logged."""

    admits_by_rebuild = True

    def __init__(self, world: InProcWorld, member_id: str) -> None:
        super().__init__(world, member_id)
        self.pending = False
        self.rebuilds: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.syncs = 0

    def pending_joiners(self) -> bool:
        return self.pending

    def rebuild(self, min_epoch: int, timeout: float = 60.0) -> None:
        self.rebuilds.append(self.syncs)

    def allreduce(self, tensor: torch.Tensor, op: str):  # type: ignore[no-untyped-def]
        self.shapes.append(tuple(tensor.shape))
        return super().allreduce(tensor, op)


def _run(members: list[str], steps: int, between) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """Each member calls sync() ``steps`` times; ``between(mid, step, engine, world)`` runs
    after each (True: this member stops). Returns per member: the shapes each sync()
    allreduced, what it returned, the syncs its callbacks ran at, its rebuilds."""
    w = InProcWorld(members)
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def member(mid: str, rank: int) -> None:
        try:
            engine = RebuildingEngine(w, mid)
            pg = ResilientProcessGroup(engine, rank, len(members))
            state = State(model=torch.nn.Linear(2, 1), group=pg, joiner=False, step=0)
            rec: dict = {"ops": [], "returned": [], "callbacks": [], "engine": engine}
            state.on_membership_change(lambda world: rec["callbacks"].append(engine.syncs))
            out[mid] = rec
            for step in range(steps):
                engine.syncs = step
                before = len(engine.shapes)
                rec["returned"].append(state.sync())
                rec["ops"].append(engine.shapes[before:])
                if between(mid, step, engine, w):
                    return
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(m, i)) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a member hung in sync()"
    assert not errors, errors
    return out


LOOK_AHEAD = [(1,)]          # the only op of a sync() where nothing changed


def test_a_sync_where_nothing_changed_runs_no_exchange_only_the_next_step_s_look_ahead():
    out = _run(["a", "b", "c"], 6, lambda *_: False)
    for mid, rec in out.items():
        first = rec["ops"][0]
        assert first[0] == (4,) and first[-1] == (1,), first   # the fresh job's exchange ... look-ahead
        assert rec["ops"][1:] == [LOOK_AHEAD] * 5, (mid, rec["ops"])
        assert rec["returned"][1:] == [False] * 5


def test_a_joiner_seen_by_one_member_makes_every_member_exchange_and_rebuild_at_the_same_sync():
    def between(mid, step, engine, world) -> bool:  # type: ignore[no-untyped-def]
        if mid == "b" and step == 2:
            engine.pending = True    # only b sees it, from the look-ahead b issues at the end of sync #3
        return False

    out = _run(["a", "b", "c"], 6, between)
    for mid, rec in out.items():
        assert rec["engine"].rebuilds[:1] == [4], (mid, rec["engine"].rebuilds)
        assert (4,) in rec["ops"][4] and rec["returned"][4], (mid, rec["ops"][4])
        assert rec["ops"][1:4] == [LOOK_AHEAD] * 3, (mid, rec["ops"])


def test_a_death_makes_the_survivors_exchange_and_run_their_callbacks_at_the_same_sync():
    def between(mid, step, engine, world) -> bool:  # type: ignore[no-untyped-def]
        if mid == "c" and step == 2:
            world.kill("c")          # between two syncs: the epoch moves on
            return True
        return False

    out = _run(["a", "b", "c"], 7, between)
    changed_at = {mid: rec["callbacks"] for mid, rec in out.items() if mid != "c"}
    assert len({tuple(v) for v in changed_at.values()}) == 1 and len(changed_at["a"]) == 1, changed_at
    at = changed_at["a"][0]
    for mid in ("a", "b"):
        rec = out[mid]
        assert rec["returned"][at] and (4,) in rec["ops"][at], (mid, at, rec["ops"])
        assert all(ops == LOOK_AHEAD for i, ops in enumerate(rec["ops"][1:], 1) if i != at), (mid, rec["ops"])
