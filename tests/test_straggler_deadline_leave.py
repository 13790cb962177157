"""The deadline leaf path when the actives leave before a late leaf ran the last op.

Under ``--straggler-policy deadline`` the actives finish an op without a late leaf and
go on (the leaf lags them by up to one op). At the end of a job they finish the last op
without it and close; the leaf then runs that op with nobody left who has its
``contributors``. The parent's ``Communicator.close`` waits for its leaves
(``leaf_deadline.drain``), but the other actives' leaving publishes an epoch that removes
them, which aborts that wait and the leaf's op: the parent must then serve its retained
result until the leaf has recovered the op from it, through any epoch published
meanwhile, so the leaf reports the same contributors and the same result as everyone.
(Found as ``test_straggler_procs.py``'s deadline test failing under load: m2 reported
op 62 — the last — over ``[m2]`` alone while m0, m1, m3 reported ``[m0, m1, m3]``.)

The interleaving is forced, not timed: the leaf starts the op only after the other
actives finished it, left, and the parent is in its close (it starts once the parent's
close returned, or 3 s after the parent entered its ledger-status round, whichever is
first — later than any fixed linger). Real Communicators over real TCP transports on
loopback, one thread per member; the control plane is an in-memory view whose epochs the
test publishes (the coordinator's part), as a coordinator would when members leave."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from launcher_util import wait_for
import torch

from resilient.collectives.communicator import Communicator
from resilient.errors import EpochChanged
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info, StaticEpoch, member_input  # noqa: E402

pytestmark = pytest.mark.timeout(90)

NUMEL = 5000


class _Control:
    """The in-memory control plane: epochs published by the test, blobs per (epoch, name,
    member), subscribers called on every publish (like the etcd watch thread)."""

    def __init__(self, first: StaticEpoch) -> None:
        self.cond = threading.Condition()
        self.epochs = [first]
        self.blobs: dict[tuple[int, str, str], bytes] = {}
        self.subs: list[Callable[[Any], None]] = []

    def newest(self) -> StaticEpoch:
        with self.cond:
            return self.epochs[-1]

    def publish(self, e: StaticEpoch) -> None:
        with self.cond:
            assert e.number == self.epochs[-1].number + 1
            self.epochs.append(e)
            subs = list(self.subs)
            self.cond.notify_all()
        for cb in subs:
            cb(e)

    def has_blob(self, epoch: int, name: str, member: str) -> bool:
        with self.cond:
            return (epoch, name, member) in self.blobs


class _View:
    """One member's GroupView on :class:`_Control`."""

    def __init__(self, member_id: str, control: _Control) -> None:
        self.member_id, self.c = member_id, control

    def current(self) -> StaticEpoch:
        return self.c.newest()

    def wait_for(self, pred: Callable[[Any], bool], timeout: float) -> StaticEpoch:
        with self.c.cond:
            if not self.c.cond.wait_for(lambda: pred(self.c.epochs[-1]), timeout):
                raise TimeoutError("no such epoch")
            return self.c.epochs[-1]

    def subscribe(self, cb: Callable[[Any], None]) -> Callable[[], None]:
        with self.c.cond:
            self.c.subs.append(cb)

        def unsubscribe() -> None:
            with self.c.cond:
                if cb in self.c.subs:
                    self.c.subs.remove(cb)
        return unsubscribe

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        with self.c.cond:
            self.c.blobs[(epoch, name, self.member_id)] = bytes(payload)
            self.c.cond.notify_all()

    def wait_blobs(self, epoch: int, name: str, members: Any, timeout: float) -> dict[str, bytes]:
        members = list(members)
        with self.c.cond:
            ok = self.c.cond.wait_for(lambda: self.c.epochs[-1].number > epoch
                                      or all((epoch, name, m) in self.c.blobs for m in members), timeout)
            newest = self.c.epochs[-1].number
            partial = {m: self.c.blobs[(epoch, name, m)] for m in members if (epoch, name, m) in self.c.blobs}
        if newest > epoch:
            raise EpochChanged(f"epoch {newest} superseded {epoch}", newest, partial)
        if not ok:
            raise TimeoutError(f"blobs {name} of epoch {epoch} missing from {sorted(set(members) - set(partial))}")
        return partial

    def report_suspect(self, suspect_id: str, reason: str) -> None:
        pass

    def session_lost(self) -> bool:
        return False

    def peer_alive(self, member_id: str) -> bool:
        return member_id in self.c.newest().members

    def leave(self, reason: str = "left") -> None:
        pass

    def request_readmission(self, seen_epoch: int) -> None:
        raise AssertionError("nobody is evicted here")


@pytest.mark.parametrize("growing", [False, True], ids=["removal", "removal-then-role-change"])
def test_actives_leave_before_the_late_leaf_ran_the_last_op_and_it_still_reports_their_contributors(growing):
    """m2 is a deadline leaf under m0 (deadline 0 ms). After op 0 (everyone), m0, m1, m3
    finish op 1 — the last — without it;
    m1 and m3 close and leave (epoch 2: ``[m0, m2]``); m0 closes (its wait for m2's ack
    is aborted by epoch 2). With ``growing``, a role change (epoch 3, same members, m2
    active — what the coordinator published in the failing run) lands while m0 is in its
    ledger-status round of epoch 2. Only then m2 runs op 1: it must report
    ``[m0, m1, m3]`` with their exact sum (m0's retained result), not rerun the op alone."""
    ids = ["m0", "m1", "m2", "m3"]
    trs = {m: TcpTransport(m, "leavejob") for m in ids}
    infos = {m: Info(trs[m].address) for m in ids}
    control = _Control(StaticEpoch(1, ("m0", "m1", "m3", "m2"), "tok1", infos,
                                   roles={"m0": "active", "m1": "active", "m3": "active", "m2": "demoted"},
                                   plan={"tree_parent": [-1, -1, -1, 0], "leaf_deadline_ms": 0.0}))
    comms: dict[str, Communicator] = {}
    results: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = {}
    first: dict[str, tuple[str, ...]] = {}
    errors: list[BaseException] = []
    finished = {m: threading.Event() for m in ids}        # op 1 returned
    closed = {m: threading.Event() for m in ids}          # close() returned
    go_leaf = threading.Event()

    def member(m: str) -> None:
        try:
            c = comms[m]
            # op 0: everyone, on time or not (it sets up the links, as the ops before the
            # last one do in a job); op 1 is the last op, which the leaf runs late
            w0 = c.allreduce(member_input(ids.index(m), 0, NUMEL), "sum")
            first[m] = tuple(w0.contributors)
            if m == "m2":
                go_leaf.wait(60)
            t = member_input(ids.index(m), 1, NUMEL)
            w = c.allreduce(t, "sum")
            results[m] = (t, tuple(w.contributors))
            finished[m].set()
            if m == "m0":   # the parent closes while its leaf still has op 1 to run
                c.close()
                closed[m].set()
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            finished[m].set()
            closed[m].set()

    for m in ids:
        comms[m] = Communicator(_View(m, control), trs[m], op_timeout=20, small_bytes=1024, slice_bytes=4096,
                                recovery_timeout=30)
    threads = {m: threading.Thread(target=member, args=(m,), name=f"member-{m}") for m in ids}
    try:
        for th in threads.values():
            th.start()
        for m in ("m0", "m1", "m3"):
            assert finished[m].wait(30), f"{m} did not finish op 1 without the late leaf"
        assert not errors, errors
        # m1 and m3 are done: they close and leave; the coordinator publishes an epoch without them
        for m in ("m1", "m3"):
            comms[m].close()
            closed[m].set()
        two = {m: infos[m] for m in ("m0", "m2")}
        control.publish(StaticEpoch(2, ("m0", "m2"), "tok2", two, roles={"m0": "active", "m2": "demoted"},
                                    plan={"tree_parent": [-1, 0], "leaf_deadline_ms": 0.0}, cause="member_lost"))
        n = 2
        # m0 is in close(): its wait for m2 is aborted; it joins the recovery of epoch 2
        wait_for(lambda: control.has_blob(2, "ledger", "m0") or closed["m0"].is_set(), 20,
              "m0 neither served epoch 2 nor closed")
        if growing:
            n = 3
            control.publish(StaticEpoch(3, ("m0", "m2"), "tok3", two, roles={"m0": "active", "m2": "active"},
                                        cause="health"))
        # the late leaf starts only now: once m0's close returned, or 3 s after it began serving
        closed["m0"].wait(3.0)
        go_leaf.set()
        if closed["m0"].wait(0) and not finished["m2"].is_set():
            # m0 has gone without serving: the coordinator publishes an epoch without it
            control.publish(StaticEpoch(n + 1, ("m2",), f"tok{n + 1}", {"m2": infos["m2"]}, cause="member_lost"))
        assert finished["m2"].wait(30), "the leaf did not finish op 1"
        assert closed["m0"].wait(30), "the parent's close did not return"
        assert not errors, errors
        comms["m2"].close()
    finally:
        go_leaf.set()
        for th in threads.values():
            th.join(30)
        for c in comms.values():
            c.close()
        for t in trs.values():
            t.close()
    assert not any(th.is_alive() for th in threads.values()), "a member hung"
    assert {m: results[m][1] for m in ids} == {m: ("m0", "m1", "m3") for m in ids}, \
        "members disagree on op 1's contributors"
    assert len(set(first.values())) == 1, f"members disagree on op 0's contributors: {first}"
    want = sum(member_input(ids.index(m), 1, NUMEL) for m in ("m0", "m1", "m3"))
    for m in ids:
        assert torch.equal(results[m][0], want), f"{m}'s op 1 result is not the exact sum over m0, m1, m3"
