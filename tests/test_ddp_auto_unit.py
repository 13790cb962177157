"""Pure logic of the drop-in pieces on the in-process thread engine: plain DDP made exact
without a user hook, a user's hook left alone, an unadmitted joiner's DDP skipping the
constructor collectives, the not-admitted gate, the op log and the launcher's exit-code
rule. The real-process version is tests/test_ddp_unchanged.py."""
from __future__ import annotations

import json
import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.ddp import contributors, install_auto_hook
from resilient.launcher.summary import job_exit_code
from resilient.torch_backend.communicator_engine import CommunicatorEngine, NotAdmittedGate
from resilient.torch_backend.inproc import InProcWorld
from resilient.torch_backend.op_log import OpLogEngine
from resilient.torch_backend.process_group import ResilientProcessGroup

install_auto_hook()


def _members(fn, names="abc", timeout=30):
    errors: list[BaseException] = []

    def run(mid, i):
        try:
            fn(mid, i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m, i)) for i, m in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive()
    if errors:
        raise errors[0]


def _linear() -> torch.nn.Module:
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    return model


def test_plain_ddp_averages_over_the_contributors_not_the_launch_size():
    """c dies after DDP's construction, before its gradient: a's and b's gradients are the
    mean over {a, b} (1.5), not the sum over 3 (1.0) that DDP's static division gives."""
    w = InProcWorld(["a", "b", "c"])
    grads, sets = {}, {}
    built = threading.Barrier(3)

    def member(mid, i):
        pg = ResilientProcessGroup(w.engine(mid), i, 3)
        model = _linear()
        ddp = DDP(model, process_group=pg)  # unchanged: no hook, default init_sync
        built.wait(10)
        if mid == "c":
            w.kill(mid)
            return
        ddp(torch.full((1, 4), float(i + 1))).sum().backward()
        grads[mid], sets[mid] = model.weight.grad.clone(), contributors(ddp)
        assert len(ddp._comm_hooks) == 1  # ours, registered at the first forward

    _members(member)
    for mid in "ab":
        assert torch.equal(grads[mid], torch.full((1, 4), 1.5)), grads[mid]
        assert sets[mid] == frozenset("ab")


def test_a_user_hook_registered_before_the_first_forward_is_left_alone():
    w = InProcWorld(["a", "b"])
    seen = {}

    def user_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer().fill_(7.0))  # no communication at all
        return fut

    def member(mid, i):
        pg = ResilientProcessGroup(w.engine(mid), i, 2)
        model = _linear()
        ddp = DDP(model, process_group=pg)
        ddp.register_comm_hook(None, user_hook)
        ddp(torch.ones(1, 4)).sum().backward()
        seen[mid] = (model.weight.grad.clone(), [h for h, _ in ddp._comm_hooks])

    _members(member, "ab")
    for grad, hooks in seen.values():
        assert torch.equal(grad, torch.full((1, 4), 7.0)) and hooks == [user_hook]


class _RefusingEngine:
    """An unadmitted joiner's engine: any op fails the test."""

    admitted = False

    def __init__(self, inner):
        self.inner = inner

    def world(self):
        return self.inner.world()

    def __getattr__(self, name):
        raise AssertionError(f"an unadmitted joiner ran {name}")


def test_unadmitted_joiners_ddp_constructor_runs_no_collective():
    w = InProcWorld(["a"])
    pg = ResilientProcessGroup(_RefusingEngine(w.engine("a")), 0, 1)
    ddp = DDP(_linear(), process_group=pg)  # default init_sync=True would broadcast
    from resilient.ddp import _auto_of

    assert _auto_of(ddp) is not None  # automatic mode, and no collective ran


def test_gate_forwards_attributes_and_close_but_turns_ops_into_the_exit_call():
    class Comm:
        members = ["a", "b"]
        closed = False

        def close(self):
            Comm.closed = True

        def allreduce(self, *a, **k):
            raise AssertionError("must not run")

    calls = []
    gate = NotAdmittedGate(Comm(), "j", on_op=lambda m, op: calls.append((m, op)))
    assert gate.members == ["a", "b"]
    gate.allreduce(torch.zeros(1), op="sum", async_op=True)
    gate.close()
    assert calls == [("j", "allreduce")] and Comm.closed
    eng = CommunicatorEngine(gate, watcher=None, session=None, member_id="j")
    assert eng.admitted is False and eng._comm_members() == ["a", "b"]
    eng._open_gate()
    assert eng.admitted is True and isinstance(eng.comm, Comm)


def test_op_log_writes_kind_ordinal_and_contributors(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    w = InProcWorld(["a", "b"])
    path = str(tmp_path / "ops-{rank}.jsonl")
    logged = {}

    def member(mid, i):
        eng = OpLogEngine(w.engine(mid), path) if mid == "b" else w.engine(mid)
        pg = ResilientProcessGroup(eng, i, 2)
        for _ in range(2):
            t = torch.ones(3, dtype=torch.int64)
            opts = torch.distributed.AllreduceOptions()
            pg.allreduce([t], opts).wait()
        if mid == "b":
            logged["path"] = eng.op_log_path
            eng.close()

    _members(member, "ab")
    assert logged["path"].endswith("ops-1.jsonl")
    recs = [json.loads(line) for line in open(logged["path"])]
    assert [(r["kind"], r["n"], r["rank"], sorted(r["contributors"])) for r in recs] == \
        [("allreduce", 0, 1, ["a", "b"]), ("allreduce", 1, 1, ["a", "b"])]


def test_op_log_unwritable_path_is_a_config_error(tmp_path):
    from resilient.errors import ConfigError

    with pytest.raises(ConfigError, match="RESILIENT_OP_LOG"):
        OpLogEngine(InProcWorld(["a"]).engine("a"), str(tmp_path / "no" / "such" / "dir" / "x"))


@pytest.mark.parametrize("codes, rc", [
    ([0, 0], 0),            # everyone finished
    ([0, -9], 0),           # one killed by a signal: the survivor finished the work
    ([0, 7], 1),            # a worker failed with an error code of its own
    ([-9, -9], 1),          # every worker died
    ([-15, 0, -9], 0),
    ([None, 0], 0),         # (a worker never started counts as not finished)
])
def test_job_exit_code(codes, rc):
    assert job_exit_code(codes) == rc


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_members_the_job_started_with_rebuild_buckets_a_model_under_state_keeps_them():
    """Plain DDP on the members the job started with runs DDP's one-time bucket rebuild (its
    broadcast over our group) at the second forward, as on any backend; a model handed to
    State keeps the initial layout (a joiner builds that one); a State built after the
    rebuild is refused, naming the fix."""
    from resilient.ddp import hold_layout
    from resilient.errors import ConfigError

    w = InProcWorld(["a", "b"])
    seen = {}

    def member(mid, i):
        pg = ResilientProcessGroup(w.engine(mid), i, 2)
        inner, early = _two_layers(), _two_layers()
        hold_layout(early)  # State(model=early) built before the DDP over it
        plain, held, held_early = (DDP(_two_layers(), process_group=pg), DDP(inner, process_group=pg),
                                   DDP(early, process_group=pg))
        hold_layout(inner)  # State(model=inner) after DDP(inner), as scripts do
        for _ in range(3):
            for ddp in (plain, held, held_early):
                ddp(torch.ones(2, 4)).sum().backward()
        seen[mid] = tuple(d._get_ddp_logging_data()["has_rebuilt_buckets"] for d in (plain, held, held_early))
        with pytest.raises(ConfigError, match="build the State before the first training step"):
            hold_layout(plain)

    _members(member, "ab")
    assert seen == {"a": (1, 0, 0), "b": (1, 0, 0)}, seen
