"""Transport-level logic of the NCCL path, on a machine without a GPU.

Real etcd (the session fixture), real EpochData / EpochWatcher (through the injected
:class:`EpochDataRendezvous`), real threads. The only fake is the :class:`NcclApi` seam
(:class:`FakeNccl` in tests/nccl_fake.py). What every transport does (send/recv, abort,
close, stats, cancel_op) is in tests/test_transport_contract.py; this file keeps what is
NCCL's own: the unique-id exchange, communicator reuse/rebuild, epoch-driven abort.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import pytest

from resilient.coordinator import keys
from resilient.coordinator.epoch import Epoch, EpochData, EpochWatcher
from resilient.coordinator.store import Store
from resilient.errors import ConfigError, TransportAborted, TransportError
from resilient.transport.nccl import UID_BYTES, UID_NAME, NcclTransport
from resilient.transport.rendezvous import EpochDataRendezvous
from nccl_fake import Fabric, FakeNccl

HANG_GUARD_S = 30.0   # only guards against a hang; behaviour is asserted, not speed


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def publish_epoch(store: Store, job: str, number: int, members: Sequence[str]) -> Epoch:
    """What the coordinator leader does (it is not under test here)."""
    ep = Epoch(number=number, members=tuple(members), token=f"tok{number}")
    store.put(keys.epoch(job), ep.to_json())
    return ep


def make(members: Sequence[str], store: Store, job: str, fabric: Fabric, **kw) -> dict[str, NcclTransport]:
    return {m: NcclTransport(m, EpochDataRendezvous(store, job), api=FakeNccl(fabric, m), **kw) for m in members}


def configure_all(ts: dict[str, NcclTransport], epoch: int) -> None:
    addrs = {m: t.address for m, t in ts.items()}
    for t in ts.values():
        t.configure(epoch, f"tok{epoch}", addrs)


def run_threads(fns: dict[str, Any]) -> dict[str, Any]:
    """Run each fn in a thread; return results or exceptions by name; fail on a hang."""
    out: dict[str, Any] = {}

    def wrap(name, fn):
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[name] = exc

    threads = [threading.Thread(target=wrap, args=(n, f), daemon=True) for n, f in fns.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG_GUARD_S)
        assert not th.is_alive(), "a transport call hung"
    return out


def ring_step(t: NcclTransport, order: Sequence[str], value: float, op_seq: int = 0) -> np.ndarray:
    i = order.index(t.member_id)
    nxt, prv = order[(i + 1) % len(order)], order[i - 1]
    out = np.full(16, value, dtype=np.float32)
    into = np.zeros(16, dtype=np.float32)
    reqs = [t.isend(nxt, out, op_seq, 0), t.irecv(prv, into, op_seq, 0)]
    assert t.wait(reqs)
    return into


def test_unique_id_travels_through_epoch_data_and_ranks_follow_member_ids(store, job_name):
    fabric = Fabric()
    members = ["m-b", "m-c", "m-a"]
    ts = make(members, store, job_name, fabric)
    publish_epoch(store, job_name, 1, members)
    configure_all(ts, 1)
    order = sorted(members)
    res = run_threads({m: (lambda t=t, v=float(k): ring_step(t, order, v)) for k, (m, t) in enumerate(ts.items())})
    # every member got its ring predecessor's value
    values = {m: float(k) for k, m in enumerate(members)}
    for m in members:
        assert not isinstance(res[m], BaseException), res[m]
        assert res[m].tolist() == [values[order[order.index(m) - 1]]] * 16
    # the creator is the first member id; its id is in etcd and is the one everybody used
    kv = store.get(keys.epoch_data_of(job_name, 1, UID_NAME, "m-a"))
    assert kv is not None and len(kv.value) == UID_BYTES
    assert sorted((m, r) for m, _, _, r in fabric.inits) == [("m-a", 0), ("m-b", 1), ("m-c", 2)]
    assert {uid for _, _, uid, _ in fabric.inits} == {kv.value}
    assert all(n == 3 for _, n, _, _ in fabric.inits)
    assert ts["m-a"].stats.bytes_sent == 64 and ts["m-a"].stats.received_by_peer == {"m-c": 64}
    for t in ts.values():
        t.close()


def test_epoch_that_removes_a_peer_aborts_a_blocked_recv(store, job_name):
    fabric = Fabric()
    ts = make(["a", "b"], store, job_name, fabric)
    publish_epoch(store, job_name, 1, ["a", "b"])
    configure_all(ts, 1)
    # set the communicator up with one exchange, then let `a` wait on a recv b never sends
    run_threads({m: (lambda t=t: ring_step(t, ["a", "b"], 1.0)) for m, t in ts.items()})
    a = ts["a"]
    with EpochWatcher(store, job_name) as watcher:
        a.attach(watcher)
        req = a.irecv("b", np.zeros(4, dtype=np.float32), 1, 0)
        started = threading.Event()

        def blocked():
            started.set()
            return a.wait([req])            # no timeout: only an abort can end it

        th_result: dict[str, Any] = {}
        th = threading.Thread(target=lambda: th_result.setdefault("r", _catch(blocked)), daemon=True)
        th.start()
        assert started.wait(HANG_GUARD_S)
        assert th.is_alive()                # really blocked on the hung recv
        publish_epoch(store, job_name, 2, ["a"])
        th.join(HANG_GUARD_S)
        assert not th.is_alive(), "wait() was not aborted by the new epoch"
    assert isinstance(th_result["r"], TransportAborted) and "removed ['b']" in str(th_result["r"])
    assert isinstance(req.error, TransportAborted)
    assert a.state == "aborted" and a.aborted
    assert len(a.api.aborts) == 1 and a.api.aborts[0].aborted     # ncclCommAbort was called
    # a new epoch clears the abort; the next setup uses epochs/2/
    a.configure(2, "tok2", {"a": a.address})
    assert not a.aborted and a.state == "configured"
    ts["b"].close()
    a.close()


def _catch(fn):
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001
        return exc


def test_epoch_that_only_adds_members_does_not_abort(store, job_name):
    fabric = Fabric()
    ts = make(["a", "b"], store, job_name, fabric)
    configure_all(ts, 1)
    ts["a"].on_epoch(Epoch(number=2, members=("a", "b", "c")))
    ts["a"].on_epoch(Epoch(number=1, members=("a",)))          # not newer: ignored
    assert not ts["a"].aborted
    ts["a"].on_epoch(Epoch(number=3, members=("b", "c")))       # removes a itself
    assert ts["a"].aborted
    for t in ts.values():
        t.close()


def test_same_members_keep_the_communicator_changed_members_rebuild(store, job_name):
    fabric = Fabric()
    ts = make(["a", "b", "c"], store, job_name, fabric)
    configure_all(ts, 1)
    order = ["a", "b", "c"]
    run_threads({m: (lambda t=t: ring_step(t, order, 1.0)) for m, t in ts.items()})
    assert len(fabric.inits) == 3
    configure_all(ts, 2)                                         # same members
    run_threads({m: (lambda t=t: ring_step(t, order, 2.0, op_seq=1)) for m, t in ts.items()})
    assert len(fabric.inits) == 3 and all(not t.api.aborts for t in ts.values())
    ts["c"].close()
    del ts["c"]
    configure_all(ts, 3)                                         # c removed: rebuild
    assert all(len(t.api.aborts) == 1 for t in ts.values())
    res = run_threads({m: (lambda t=t: ring_step(t, ["a", "b"], 3.0, op_seq=2)) for m, t in ts.items()})
    assert all(r.tolist() == [3.0] * 16 for r in res.values())
    assert len(fabric.inits) == 5 and {n for _, n, _, _ in fabric.inits[3:]} == {2}
    assert store.get(keys.epoch_data_of(job_name, 3, UID_NAME, "a")) is not None
    for t in ts.values():
        t.close()






def test_missing_unique_id_times_out_naming_the_creator(store, job_name):
    fabric = Fabric()
    b = NcclTransport("b", EpochDataRendezvous(store, job_name), api=FakeNccl(fabric, "b"), connect_timeout=0.3)
    b.configure(1, "tok1", {"a": "x", "b": b.address})
    req = b.irecv("a", np.zeros(1, dtype=np.float32), 0, 0)
    assert b.wait([req], timeout=0.1) is False                  # caller's timeout: False
    with pytest.raises(TransportError, match="member a did not publish the NCCL unique id"):
        b.wait([req])                                           # connect_timeout: error
    b.close()


def test_malformed_unique_id_is_refused(store, job_name):
    EpochData(store, job_name, 1).put("a", UID_NAME, b"short")
    b = NcclTransport("b", EpochDataRendezvous(store, job_name), api=FakeNccl(Fabric(), "b"), connect_timeout=5)
    b.configure(1, "tok1", {"a": "x", "b": b.address})
    with pytest.raises(TransportError, match="malformed NCCL unique id from member a: 5 bytes"):
        b.wait([b.irecv("a", np.zeros(1, dtype=np.float32), 0, 0)])
    b.close()


def test_newer_epoch_while_waiting_for_the_id_aborts_setup(store, job_name):
    publish_epoch(store, job_name, 1, ["a", "b"])
    b = NcclTransport("b", EpochDataRendezvous(store, job_name), api=FakeNccl(Fabric(), "b"), connect_timeout=HANG_GUARD_S)
    b.configure(1, "tok1", {"a": "x", "b": b.address})
    timer = threading.Timer(0.3, publish_epoch, args=(store, job_name, 2, ["b"]))
    timer.start()
    with pytest.raises(TransportAborted, match="superseded epoch 1"):
        b.wait([b.irecv("a", np.zeros(1, dtype=np.float32), 0, 0)])
    timer.join()
    b.close()


def test_peer_failure_fails_requests_until_next_epoch(store, job_name):
    fabric = Fabric()
    ts = make(["a", "b"], store, job_name, fabric)
    configure_all(ts, 1)
    run_threads({m: (lambda t=t: ring_step(t, ["a", "b"], 0.0)) for m, t in ts.items()})
    a = ts["a"]
    a._comm.async_error = "ncclRemoteError: peer b died"
    req = a.irecv("b", np.zeros(1, dtype=np.float32), 1, 0)
    with pytest.raises(TransportError, match="peer b died"):
        a.wait([req])
    assert isinstance(req.error, TransportError)
    with pytest.raises(TransportError, match="usable again after the next epoch"):
        a.wait([a.irecv("b", np.zeros(1, dtype=np.float32), 2, 0)])
    for t in ts.values():
        t.close()


def test_posting_to_a_non_member_names_the_members(store, job_name):
    t = NcclTransport("a", EpochDataRendezvous(store, job_name), api=FakeNccl(Fabric(), "a"))
    with pytest.raises(TransportError, match="before configure"):
        t.isend("b", np.zeros(1), 0, 0)
    t.configure(1, "tok1", {"a": "x", "b": "y"})
    with pytest.raises(ConfigError, match=r"not another member of epoch 1 \(\['a', 'b'\]\)"):
        t.isend("zz", np.zeros(1), 0, 0)
    with pytest.raises(ConfigError, match="not in epoch"):
        t.configure(2, "tok2", {"b": "y"})
    t.close()


def test_real_api_refuses_clearly_without_a_gpu():
    from resilient.transport.nccl import CtypesNccl

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU exists here")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        CtypesNccl(0)


def test_nccl_library_has_the_non_blocking_api_we_bind():
    """Loading libnccl needs no GPU: check the symbols and ABI facts CtypesNccl relies on."""
    import ctypes

    from resilient.transport.nccl import NCCL_IN_PROGRESS, _ConfigV21700, find_nccl_library

    path = find_nccl_library()
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        pytest.skip(f"no NCCL library here ({path}); `pip install nvidia-nccl-cu12` to run this check")
    for sym in ("ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclSend", "ncclRecv",
                "ncclGroupStart", "ncclGroupEnd", "ncclCommAbort"):
        assert hasattr(lib, sym), sym
    version = ctypes.c_int()
    assert lib.ncclGetVersion(ctypes.byref(version)) == 0
    assert version.value >= 21700, "non-blocking config v2.17 layout needs NCCL >= 2.17"
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    assert b"in progress" in lib.ncclGetErrorString(NCCL_IN_PROGRESS).lower()
    assert ctypes.sizeof(_ConfigV21700) == 40      # size_t + 2 uint + 4 int + pointer
