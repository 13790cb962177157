"""An in-memory group view with one static epoch, for unit tests of the data path:
real Communicators over real TCP transports on loopback, one thread per member, with the
control plane left out (the tests that run it for real use etcd and processes). No member
fails in these tests, so no recovery ever reads a ledger blob."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class Info:
    address: str


@dataclass
class StaticEpoch:
    number: int
    members: tuple[str, ...]
    token: str
    infos: dict[str, Any]
    roles: dict[str, str] = field(default_factory=dict)
    plan: Any = field(default_factory=dict)   # held as an EpochPlan, like Epoch's
    cause: str = "initial"
    added: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from resilient.coordinator.epoch import EpochPlan

        self.plan = EpochPlan.of(self.plan)


class StaticView:
    """In-memory GroupView with one epoch and a shared blob dict (unit tests of the
    algorithm only: no member fails here, so no recovery ever reads a ledger)."""

    def __init__(self, member_id: str, epoch: StaticEpoch, blobs: dict) -> None:
        self.member_id, self.epoch, self.blobs = member_id, epoch, blobs

    def current(self):
        return self.epoch

    def wait_for(self, pred, timeout):
        if pred(self.epoch):
            return self.epoch
        raise TimeoutError("static view: no such epoch")

    def subscribe(self, cb):
        return lambda: None

    def report_suspect(self, suspect_id, reason):
        pass

    def put_blob(self, epoch, name, payload):
        assert name != "ledger", "no recovery expected in this test"
        with self.blobs["lock"]:
            self.blobs[(epoch, name, self.member_id)] = payload
            self.blobs["lock"].notify_all()

    def wait_blobs(self, epoch, name, members, timeout):
        members = list(members)
        with self.blobs["lock"]:
            ok = self.blobs["lock"].wait_for(lambda: all((epoch, name, m) in self.blobs for m in members), timeout)
            if not ok:
                raise TimeoutError(f"blobs {name} missing")
            return {m: self.blobs[(epoch, name, m)] for m in members}

    def wait_blobs_until(self, epoch, name, done, timeout):
        found = []

        def ready():
            got = {k[2]: v for k, v in self.blobs.items() if isinstance(k, tuple) and k[:2] == (epoch, name)}
            found[:] = [done(got)]
            return found[0] is not None
        with self.blobs["lock"]:
            if not self.blobs["lock"].wait_for(ready, timeout):
                raise TimeoutError(f"blobs {name}: not complete")
            return found[0]

    def session_lost(self):
        return False

    def peer_alive(self, member_id):
        return True

    def leave(self, reason="left"):
        pass

    def request_readmission(self, seen_epoch):
        raise AssertionError("static view: no member is evicted here")


def run_members(member: Callable[[Any], None], members: Iterable[Any], timeout: float,
                hung: str = "a member hung") -> None:
    """One thread per member running ``member(m)``: all started, then each joined for up
    to ``timeout`` seconds. Fails with ``hung`` if any is still running."""
    ths = [threading.Thread(target=member, args=(m,)) for m in members]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout)
    assert not any(th.is_alive() for th in ths), hung


def member_input(i: int, seq: int, n: int) -> Any:
    """Member ``i``'s input to op ``seq``: ``n`` float32 values, distinct per member and op."""
    import torch

    return (torch.arange(n, dtype=torch.float32) % 97) * (i + 1) + seq * 10 + i


def run_allreduces(epoch: StaticEpoch, transports: dict[str, Any], ops: list[str], numel: int, *,
                   close: Iterable[Any] = (), timeout: float = 60.0, **comm_kw: Any) -> dict[str, list]:
    """Every member of ``epoch`` runs a real Communicator (op_timeout 20 s, ``comm_kw``)
    over a :class:`StaticView` and ``transports[member]``, and the allreduces ``ops`` on
    :func:`member_input`. Returns per member ``[(result, contributors tuple)]`` per op;
    raises the first member error, or fails if a member hangs past ``timeout``. Closes the
    communicators, then ``close`` (the real transports), whatever happens."""
    from resilient.collectives.communicator import Communicator

    ids = list(epoch.members)
    results: dict[str, list] = {m: [] for m in ids}
    errors: list[BaseException] = []
    comms: dict[str, Any] = {}
    blobs: dict = {"lock": threading.Condition()}

    def member(m: str) -> None:
        try:
            c = Communicator(StaticView(m, epoch, blobs), transports[m], op_timeout=20, **comm_kw)
            comms[m] = c
            for seq, op in enumerate(ops):
                t = member_input(ids.index(m), seq, numel)
                w = c.allreduce(t, op)
                results[m].append((t, tuple(w.contributors)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        run_members(member, ids, timeout, "a member hung")
        assert not errors, errors
    finally:
        for c in comms.values():
            c.close()
        for t in close:
            t.close()
    return results


def run_communicators(world: int, job: str, body: Callable[[str, Any], Any], timeout: float = 60.0,
                      transport: Callable[[str, str], Any] | None = None,
                      **comm_kw: Any) -> tuple[list[str], dict[str, Any]]:
    """``world`` members ``m0..`` over real TCP transports on loopback (``transport(member,
    job)`` builds another kind), one thread each running ``body(member, communicator)``
    (op_timeout 20 s, ``comm_kw``). Returns the ids and each member's return value; raises
    the first member error, fails if one hangs. Closes every communicator and transport,
    whatever happens."""
    from resilient.collectives.communicator import Communicator
    from resilient.transport.tcp import TcpTransport

    ids = [f"m{i}" for i in range(world)]
    trs = {m: (transport or TcpTransport)(m, job) for m in ids}
    epoch = StaticEpoch(1, tuple(ids), "tok", {m: Info(trs[m].address) for m in ids})
    blobs: dict = {"lock": threading.Condition()}
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def member(m: str) -> None:
        try:
            c = Communicator(StaticView(m, epoch, blobs), trs[m], **{"op_timeout": 20, **comm_kw})
            try:
                out[m] = body(m, c)
            finally:
                c.close()
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    try:
        run_members(member, ids, timeout)
    finally:
        for t in trs.values():
            t.close()
    assert not errors, errors
    return ids, out
