"""The speed-weighted DDP hook (pure logic, in-process thread engine): members with
different sample counts get the exact per-sample mean over the contributors; the
process-level version (real etcd, coordinator, processes, SIGKILL/SIGSTOP) is
tests/test_hetero_procs.py."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.ddp import SampleCount, make_weighted, weighted_ddp_comm_hook
from resilient.errors import ConfigError
from resilient.torch_backend.inproc import InProcWorld
from resilient.torch_backend.process_group import ResilientProcessGroup

DIM = 6


def data(n: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, DIM, generator=g, dtype=dtype)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 1.0


def make_model(dtype) -> torch.nn.Linear:
    """The same parameters on every member (no global RNG: the members are threads)."""
    model = torch.nn.Linear(DIM, 1, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, DIM, dtype=dtype).reshape(1, DIM))
        model.bias.fill_(0.25)
    return model


def local_loss(model, x, y):
    return ((model(x) - y) ** 2).sum() / max(len(x), 1)


def run_members(counts: dict[str, int], dead: str | None = None, dtype=torch.float64):
    """One DDP step per member on its slice of the data; ``dead`` dies before contributing."""
    ids = list(counts)
    w = InProcWorld(ids)
    x, y = data(sum(counts.values()), dtype)
    starts = {m: sum(counts[k] for k in ids[:i]) for i, m in enumerate(ids)}
    out: dict[str, tuple[torch.Tensor, tuple, float]] = {}
    errors: list[BaseException] = []
    ready = threading.Barrier(len(ids))

    def member(mid: str, i: int) -> None:
        try:
            pg = ResilientProcessGroup(w.engine(mid), i, len(ids))
            model = make_model(dtype)
            ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
            state = SampleCount(pg)
            make_weighted(ddp, state)
            ready.wait(10)
            if mid == dead:
                w.kill(mid)
                return
            s = starts[mid]
            state.set(counts[mid])
            local_loss(ddp, x[s:s + counts[mid]], y[s:s + counts[mid]]).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            out[mid] = (grad, tuple(sorted(state.tracker.step_contributors())), state.last_total)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(m, i)) for i, m in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert not errors, errors
    return out, x, y, starts


def reference(x, y, rows: list[int], dtype=torch.float64) -> torch.Tensor:
    model = make_model(dtype)
    local_loss(model, x[rows], y[rows]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_uneven_counts_give_the_exact_per_sample_mean():
    counts = {"a": 16, "b": 16, "c": 16, "d": 8}
    out, x, y, _ = run_members(counts)
    ref = reference(x, y, list(range(56)))
    for mid, (grad, contributors, total) in out.items():
        assert contributors == ("a", "b", "c", "d") and total == 56
        assert torch.allclose(grad, ref, rtol=0, atol=1e-12), (mid, (grad - ref).abs().max())
    # the unweighted mean of the local means differs: the weighting is what makes it exact
    plain = sum(reference(x, y, list(range(s, s + n))) for s, n in ((0, 16), (16, 16), (32, 16), (48, 8))) / 4
    assert (plain - ref).abs().max() > 1e-3


def test_a_member_that_died_is_left_out_of_the_count_too():
    counts = {"a": 10, "b": 20, "c": 5}
    out, x, y, starts = run_members(counts, dead="b")
    rows = list(range(starts["a"], starts["a"] + 10)) + list(range(starts["c"], starts["c"] + 5))
    ref = reference(x, y, rows)
    for mid in ("a", "c"):
        grad, contributors, total = out[mid]
        assert contributors == ("a", "c") and total == 15
        assert torch.allclose(grad, ref, rtol=0, atol=1e-12), (mid, (grad - ref).abs().max())


def test_a_member_with_no_samples_adds_nothing():
    counts = {"a": 7, "b": 0, "c": 9}
    out, x, y, _ = run_members(counts)
    ref = reference(x, y, list(range(16)))
    for grad, _, total in out.values():
        assert total == 16 and torch.isfinite(grad).all()
        assert torch.allclose(grad, ref, rtol=0, atol=1e-12)


def test_unset_or_inexact_counts_are_refused():
    state = SampleCount()
    with pytest.raises(ConfigError, match="state.set"):
        weighted_ddp_comm_hook(state, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="integer >= 0"):
        state.set(-1)
    with pytest.raises(ConfigError, match="integer >= 0"):
        state.set(2.5)  # type: ignore[arg-type]
