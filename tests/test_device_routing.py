"""NCCL selected automatically (resilient/device/routing.py): members publish their device
record through ``resilient.connect(device=...)``; each epoch the Communicator builds
DeviceRecords from the epoch's member records and calls ``choose_transport``; a device op
of an ``nccl`` epoch posts its device buffers over the NCCL transport, else it stages
through the host.

No GPU here: "device ops" are CPU tensors with forced staging (the path CUDA tensors
take), the members' records *claim* CUDA GPUs, the NCCL transport runs over its fake api
(tests/nccl_fake.py, one fabric shared by the two members of this process) and the
device-buffer predicate stands in for "is a CUDA tensor" (ledger pieces, byte views for a
CPU ledger, and float64 tensors: the op's data; the chain's int32 token stays on TCP); ``hierarchical=False`` as for CUDA ops
(``Sizing.for_device``). Real etcd, coordinator, sockets."""
from __future__ import annotations

import logging
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.coordinator.epoch import Epoch
from resilient.coordinator.membership import MemberInfo
from resilient.device.routing import DeviceRoute, SplitTransport, records_of
from resilient.device.select import NCCL_LABEL, UUID_LABEL, DeviceRecord
from resilient.errors import RecordError, TransportAborted
from resilient.transport.base import Buffer
from resilient.transport.nccl import HEADER, NcclTransport
from resilient.transport.rendezvous import EpochDataRendezvous, LocalRendezvous

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collective_harness import coordinator  # noqa: E402
from nccl_fake import Fabric, FakeNccl  # noqa: E402

HOST = socket.gethostname()
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]


def data_buffer(buf: Buffer) -> bool:
    """The op's data: a ledger piece (a byte view of a CPU ledger) or a float64 tensor."""
    return isinstance(buf, memoryview) or (isinstance(buf, torch.Tensor) and buf.dtype == torch.float64)


def run_members(etcd: str, job: str, uuids: list[str], body: Any) -> tuple[Fabric, list[DeviceRoute], list[Any]]:
    """Two members m0, m1 connected in threads (records claiming ``uuids``), each running
    ``body(comm, rank)``; returns the fabric, the routes and the bodies' results."""
    import resilient
    from resilient.coordinator import Store

    fabric = Fabric()
    store = Store(etcd)
    routes = [DeviceRoute(f"m{i}", lambda rec, m=f"m{i}": NcclTransport(
        m, EpochDataRendezvous(store, job), api=FakeNccl(fabric, m), connect_timeout=30), is_device=data_buffer)
        for i in range(2)]
    out: list[Any] = [None, None]

    def member(i: int) -> None:
        try:
            comm = resilient.connect(etcd, job, f"m{i}", world=2, timeout=60, ttl=2.0, op_timeout=30,
                                     device=DeviceRecord(f"m{i}", HOST, "cuda:0", uuids[i], True),
                                     staging=True, hierarchical=False, device_route=routes[i])
            try:
                out[i] = body(comm, i)
            finally:
                comm.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[i] = exc

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(2)]
    try:
        with coordinator(etcd, job):
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
    finally:
        store.close()
    assert not any(t.is_alive() for t in threads)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return fabric, routes, out


def ops(comm: Any, i: int) -> dict[str, Any]:
    big = torch.arange(300_001, dtype=torch.float64) * (i + 1)          # ring
    small = torch.arange(1000, dtype=torch.float64) * (i + 1)           # recursive doubling
    b = torch.arange(50_000, dtype=torch.float64) + (100 if i == 1 else 0)
    import resilient.device.routing as R
    orig = R.SplitTransport.isend
    def isend(self, peer, buf, *a, **k):
        print("ISEND", type(buf), getattr(buf, "dtype", None), self.is_device(buf), flush=True)
        return orig(self, peer, buf, *a, **k)
    R.SplitTransport.isend = isend
    comm.allreduce(big)
    staged = [comm.retained.staged_posts]
    comm.allreduce(small)
    staged.append(comm.retained.staged_posts)
    comm.broadcast(b, root=1)                                           # chain + int32 token
    staged.append(comm.retained.staged_posts)
    return {"big": big, "small": small, "b": b, "staged": staged, "members": list(comm.members)}


def check_exact(res: dict[str, Any]) -> None:
    assert torch.equal(res["big"], torch.arange(300_001, dtype=torch.float64) * 3)
    assert torch.equal(res["small"], torch.arange(1000, dtype=torch.float64) * 3)
    assert torch.equal(res["b"], torch.arange(50_000, dtype=torch.float64) + 100)


def test_distinct_gpus_send_the_device_ops_over_nccl(etcd_session, job_name, caplog):
    caplog.set_level(logging.INFO, logger="resilient.device.routing")
    fabric, routes, out = run_members(etcd_session.endpoint_arg, job_name, UUIDS, ops)
    for res, route in zip(out, routes):
        check_exact(res)
        assert res["staged"] == [0, 0, 0]              # nothing went through the host staging slots
        assert route.nccl_ops == 3 and route.nccl is None     # closed with the Communicator
    # both members' op data crossed the NCCL fabric: each allreduce moves ~its tensor per member
    assert fabric.bytes_moved >= 2 * 8 * (300_001 + 1000 + 50_000) * 0.9
    assert "device ops over nccl (nccl: each of the 2 members has its own GPU" in caplog.text


def test_a_shared_gpu_stages_through_the_host_and_logs_why(etcd_session, job_name, caplog):
    caplog.set_level(logging.INFO, logger="resilient.device.routing")
    fabric, routes, out = run_members(etcd_session.endpoint_arg, job_name, [UUIDS[0], UUIDS[0]], ops)
    for res, route in zip(out, routes):
        check_exact(res)
        assert all(n > 0 for n in res["staged"]), res["staged"]
        assert route.nccl_ops == 0 and route.nccl is None
    assert fabric.bytes_moved == 0
    assert f"device ops over host-staged (host-staged: 2 members share GPU {UUIDS[0]}" in caplog.text


def mismatch_then_ops(comm: Any, i: int) -> dict[str, Any]:
    import resilient

    try:
        comm.allreduce(torch.ones(1000 + i, dtype=torch.float64))       # the members disagree on the shape
        raised = None
    except resilient.InputMismatch as exc:
        raised = exc
    res = ops(comm, i)
    res["raised"] = raised
    return res


def test_a_mismatch_over_nccl_raises_on_every_member_and_the_next_ops_restart_the_communicator(
        etcd_session, job_name):
    fabric, routes, out = run_members(etcd_session.endpoint_arg, job_name, UUIDS, mismatch_then_ops)
    for res in out:
        assert res["raised"] is not None, "InputMismatch expected on every member"
        check_exact(res)
        assert res["staged"] == [0, 0, 0]
    assert all(route.nccl_ops == 4 for route in routes)
    # two communicators per member: the first epoch's, and the restart at op #1 after the mismatch
    assert sorted(m for m, *_ in fabric.inits) == ["m0", "m0", "m1", "m1"]
    assert len({uid for _, _, uid, _ in fabric.inits}) == 2


# -- pure logic ---------------------------------------------------------------------------


def epoch(number: int, labels: dict[str, dict[str, str]], device: str = "cuda:0") -> Epoch:
    members = tuple(sorted(labels))
    return Epoch(number, members, {m: MemberInfo(m, host=HOST, device=device, labels=labels[m]) for m in members},
                 token=f"t{number}")


GPUS = {"a": {UUID_LABEL: UUIDS[0], NCCL_LABEL: "1"}, "b": {UUID_LABEL: UUIDS[1], NCCL_LABEL: "1"}}


def test_records_come_from_the_member_records_and_a_bad_label_is_refused():
    recs = records_of(epoch(1, GPUS))
    assert recs == [DeviceRecord("a", HOST, "cuda:0", UUIDS[0], True), DeviceRecord("b", HOST, "cuda:0", UUIDS[1], True)]
    with pytest.raises(RecordError, match=f"label {NCCL_LABEL}='yes' must be '1' or '0'"):
        records_of(epoch(1, {**GPUS, "b": {UUID_LABEL: UUIDS[1], NCCL_LABEL: "yes"}}))
    with pytest.raises(RecordError, match="not a GPU UUID"):
        records_of(epoch(1, {**GPUS, "b": {UUID_LABEL: "GPU-zz", NCCL_LABEL: "1"}}))


def test_an_epoch_that_removes_a_member_aborts_the_nccl_transport_and_the_next_op_rebuilds():
    fabric, rdv = Fabric(), LocalRendezvous()
    route = DeviceRoute("a", lambda rec: NcclTransport("a", rdv, api=FakeNccl(fabric, "a"), connect_timeout=5),
                        is_device=data_buffer)
    e1 = epoch(1, GPUS)
    split = route.for_op(e1, host=_NoHost())
    assert isinstance(split, SplitTransport) and route.nccl is not None and route.nccl.epoch == 1
    req = split.irecv("b", torch.zeros(4, dtype=torch.float64), 0, 0)
    route.on_epoch(epoch(2, {"a": GPUS["a"]}))                       # b is gone
    assert route.nccl.aborted
    with pytest.raises(TransportAborted, match=r"epoch 2 removed \['b'\]"):
        split.wait([req], timeout=5)
    e3 = epoch(3, GPUS)                                               # b is back: a fresh communicator
    assert route.for_op(e3, host=_NoHost()) is not None and route.nccl.epoch == 3 and not route.nccl.aborted
    route.close()
    assert route.nccl is None


def test_a_cpu_epoch_is_not_routed_and_a_direct_op_never_is():
    route = DeviceRoute("a", lambda rec: pytest.fail("no NCCL transport for a CPU epoch"))
    cpu = epoch(1, {"a": {}, "b": {}}, device="cpu")
    assert route.choice(cpu).kind == "tcp" and route.for_op(cpu, _NoHost()) is None

    class L:
        seq, stage_elems = 0, 0
    host = _NoHost()
    assert route.op_transport(L(), epoch(2, GPUS), host) is host      # nothing staged: direct, host transport


class _NoHost:
    def isend(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("host transport not expected")

    irecv = isend

    def wait(self, *a: Any, **k: Any) -> bool:
        raise AssertionError("host transport not expected")


def ddp_step(comm: Any, i: int) -> dict[str, Any]:
    """One DDP step on the resilient process group over this Communicator (staging forced:
    the path a model's CUDA gradients take, host-staged)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilient.ddp import contributors, install_auto_hook
    from resilient.torch_backend.communicator_engine import CommunicatorEngine
    from resilient.torch_backend.process_group import ResilientProcessGroup

    install_auto_hook()
    pg = ResilientProcessGroup(CommunicatorEngine(comm, comm.watcher, comm.session, comm.member_id), i, 2)
    model = torch.nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(0.0)
    ddp = DDP(model, process_group=pg)
    ddp(torch.full((1, 4), float(i + 1), dtype=torch.float64)).sum().backward()
    return {"grad": model.weight.grad.clone(), "contributors": contributors(ddp),
            "staged": comm.retained.staged_posts}


def test_ddp_with_staging_forced_averages_exactly_through_the_staged_path(etcd_session, job_name):
    _, routes, out = run_members(etcd_session.endpoint_arg, job_name, [UUIDS[0], UUIDS[0]], ddp_step)
    for res in out:
        assert torch.equal(res["grad"], torch.full((1, 4), 1.5, dtype=torch.float64)), res["grad"]
        assert res["contributors"] == frozenset({"m0", "m1"}) and res["staged"] > 0


def test_view_rendezvous_publishes_only_its_own_entries_and_rate_limits_peeks():
    from resilient.errors import ConfigError, EpochChanged
    from resilient.transport.rendezvous import ViewRendezvous

    class Blobs:
        member_id = "a"

        def __init__(self) -> None:
            self.data: dict[tuple[int, str, str], bytes] = {}
            self.waits = 0

        def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
            self.data[(epoch, name, self.member_id)] = payload

        def wait_blobs(self, epoch: int, name: str, members: Any, timeout: float) -> dict[str, bytes]:
            self.waits += 1
            (m,) = members
            if epoch == 9:
                raise EpochChanged("epoch 10 superseded epoch 9", 10, {})
            if (epoch, name, m) not in self.data:
                raise TimeoutError(m)
            return {m: self.data[(epoch, name, m)]}

    blobs = Blobs()
    rdv = ViewRendezvous(blobs)
    with pytest.raises(ConfigError, match="cannot publish 'x' as member b"):
        rdv.publish(1, "x", "b", b"1")
    assert rdv.peek(1, "x", "a") is None and blobs.waits == 1
    rdv.publish(1, "x", "a", b"yes")
    assert rdv.peek(1, "x", "a") is None and blobs.waits == 1       # within PEEK_EVERY_S: not asked again
    assert rdv.fetch(1, "x", "a", 1.0) == b"yes"
    with pytest.raises(TransportAborted, match="epoch 10 superseded epoch 9"):
        rdv.fetch(9, "x", "a", 1.0)


def op_then_m1_leaves(comm: Any, i: int) -> bool | None:
    """Both allreduce over NCCL; m1 then leaves (its close revokes its lease) and m0 waits
    until the epoch without m1 aborted its NCCL communicator (the Communicator's epoch
    subscription), reporting whether it did within the deadline."""
    import time

    t = torch.arange(1000, dtype=torch.float64)
    comm.allreduce(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float64) * 2)
    if i == 1:
        return None
    nccl = comm.device_route.nccl
    deadline = time.monotonic() + 20
    while not nccl.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(nccl.aborted) and nccl.state == "aborted"   # m0 has not closed it: the epoch did


def test_an_epoch_without_a_member_aborts_the_communicators_nccl_transport(etcd_session, job_name):
    _, routes, out = run_members(etcd_session.endpoint_arg, job_name, UUIDS, op_then_m1_leaves)
    assert out[0] is True and routes[0].nccl_ops == 1


def test_a_mixed_wait_completes_device_buffers_over_nccl_and_the_rest_over_tcp():
    from resilient.transport.tcp import TcpTransport

    fabric, rdv = Fabric(), LocalRendezvous()
    tcp = {m: TcpTransport(m, "job", tls=None) for m in "ab"}
    nccl = {m: NcclTransport(m, rdv, api=FakeNccl(fabric, m), connect_timeout=20) for m in "ab"}
    try:
        for m in "ab":
            tcp[m].configure(1, "tok", {k: t.address for k, t in tcp.items()})
            nccl[m].configure(1, "tok", {"a": "a", "b": "b"})
        sa, sb = (SplitTransport(tcp[m], nccl[m], data_buffer) for m in "ab")
        x, tok = torch.arange(64, dtype=torch.float64), torch.tensor([7], dtype=torch.int32)
        y, got = torch.zeros(64, dtype=torch.float64), torch.zeros(1, dtype=torch.int32)
        sends = [sa.isend("b", x, 3, 0), sa.isend("b", tok.numpy(), 3, 1)]
        recvs = [sb.irecv("a", y, 3, 0), sb.irecv("a", got.numpy(), 3, 1)]
        out: dict[str, object] = {}
        th = threading.Thread(target=lambda: out.update(a=sa.wait(sends, timeout=20)), daemon=True)
        th.start()
        assert sb.wait(recvs, timeout=20) is True
        th.join(20)
        assert out.get("a") is True
        assert torch.equal(x, y) and got.item() == 7
        assert fabric.bytes_moved == 64 * 8 + HEADER.size and tcp["b"].stats.bytes_received == 4   # + its header
    finally:
        for m in "ab":
            nccl[m].close()
            tcp[m].close()
