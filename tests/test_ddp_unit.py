"""DDP with the resilient comm hook on the in-process thread engine (pure logic: the
translation, the contributor-set mean, State sync of a joiner). The same scenario with
real processes, etcd and SIGKILL is in test_ddp_procs.py."""
from __future__ import annotations

import threading

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.ddp import ContributorTracker, ddp_comm_hook, make_elastic
from resilient.elastic import State
from resilient.torch_backend.inproc import InProcWorld
from resilient.torch_backend.process_group import ResilientProcessGroup


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # different init per member: State.sync() must align them
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, member: str):
    g = torch.Generator().manual_seed(step * 1000 + sum(map(ord, member)))
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def test_hook_divides_by_the_contributor_count():
    """A bucket whose op finished without a dead member is the exact mean over the rest."""
    w = InProcWorld(["a", "b", "c"])
    grads: dict[str, torch.Tensor] = {}
    trackers: dict[str, ContributorTracker] = {}
    go = threading.Barrier(2)

    def member(mid: str, i: int, dies: bool) -> None:
        pg = ResilientProcessGroup(w.engine(mid), i, 3)
        model = torch.nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(0.0)
        ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
        trackers[mid] = ContributorTracker()
        ddp.register_comm_hook((pg, trackers[mid]), ddp_comm_hook)
        if dies:
            go.wait(10)
            w.kill(mid)  # dies before contributing its gradient
            return
        if mid == "a":
            go.wait(10)
        x = torch.full((1, 4), float(i + 1))
        ddp(x).sum().backward()
        grads[mid] = model.weight.grad.clone()

    threads = [threading.Thread(target=member, args=(m, i, m == "c")) for i, m in enumerate("abc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    # d(sum(w.x))/dw = x: mean over a (1s) and b (2s) = 1.5, not (1+2)/3
    for mid in "ab":
        assert torch.equal(grads[mid], torch.full((1, 4), 1.5))
        assert trackers[mid].step_contributors() == frozenset({"a", "b"})


def test_training_survives_a_death_and_syncs_a_joiner():
    """4 members train; one dies mid-step; survivors stay bitwise identical after every
    step and the loss keeps going down; a joiner is synced before it takes part."""
    w = InProcWorld(["m0", "m1", "m2", "m3"])
    steps, kill_at, join_at = 30, 9, 16
    params: dict[tuple[str, int], list[torch.Tensor]] = {}
    losses: dict[str, list[float]] = {}
    changes: dict[str, list[int]] = {}
    joiner_synced: dict[str, list[torch.Tensor]] = {}
    threads: list[threading.Thread] = []

    def member(mid: str, first_step: int, joiner: bool) -> None:
        v = w.view(mid)
        pg = ResilientProcessGroup(w.engine(mid), v.rank, v.size)
        model = make_model(seed=hash(mid) % 1000)
        ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
        make_elastic(ddp, (pg, ContributorTracker()))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = State(model=model, optimizer=opt, group=pg, joiner=joiner, step=first_step)
        state.on_membership_change(lambda world: changes.setdefault(mid, []).append(world.size))
        losses[mid] = []
        while state.step < steps:
            if mid == "m0" and state.step == join_at and "j1" not in w.members:
                w.join("j1", at_seq=w._seq["m0"])  # admitted at the next op: the sync exchange
                t = threading.Thread(target=member, args=("j1", 0, True))
                threads.append(t)
                t.start()
            state.sync()
            if joiner and mid not in joiner_synced:
                joiner_synced[mid] = [p.detach().clone() for p in model.parameters()]
            if mid == "m3" and state.step == kill_at:
                w.kill(mid)  # dies before contributing this step's gradient
                return
            x, y = batch(state.step, mid)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses[mid].append(loss.item())
            params[(mid, state.step)] = [p.detach().clone() for p in model.parameters()]
            state.step += 1
            state.commit()

    for m in ["m0", "m1", "m2", "m3"]:
        threads.append(threading.Thread(target=member, args=(m, 0, False)))
        threads[-1].start()
    for t in list(threads):
        t.join(120)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a member hung"

    survivors = ["m0", "m1", "m2"]
    for s in range(steps):
        ref = params[("m0", s)]
        for m in survivors[1:] + (["m3"] if s < kill_at else []) + (["j1"] if s >= join_at else []):
            assert all(torch.equal(a, b) for a, b in zip(ref, params[(m, s)])), f"{m} differs at step {s}"
    # the joiner held the survivors' parameters (after step join_at-1) before its first step
    assert all(torch.equal(a, b) for a, b in zip(joiner_synced["j1"], params[("m0", join_at - 1)]))
    assert changes["m0"] == [3, 4] and changes["m1"] == [3, 4]
    first, last = sum(losses["m0"][:5]) / 5, sum(losses["m0"][-5:]) / 5
    assert last < first * 0.5, (first, last)
