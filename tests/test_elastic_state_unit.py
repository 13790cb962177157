"""State commit/restore and the pickle-free state codec (pure logic)."""
from __future__ import annotations

import pytest
import torch

from resilient.elastic import ElasticSampler, State
from resilient.errors import ConfigError, FrameError
from resilient.torch_backend.codec import decode, encode


def test_full_snapshots_roll_back_model_optimizer_and_fields_across_an_optimizer_step():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    sampler = ElasticSampler(100, 4, seed=1)
    state = State(model=model, optimizer=opt, sampler=sampler, step=5, full_snapshots=True)
    state.commit()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sampler.record_step()
    state.step = 6
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert state.step == 5 and sampler.processed == 0 and opt.state_dict()["state"] == {}


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def test_marker_commit_restores_a_step_that_failed_before_the_optimizer_step():
    """The default commit copies no parameter/optimizer tensor; restore() after a failed
    gradient step (forward + backward ran, optimizer.step() did not) is still exact."""
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(100, 4, seed=1)
    state = State(model=model, optimizer=opt, sampler=sampler, step=5, hist=[1, 2])
    model(torch.randn(8, 3)).sum().backward()
    opt.step()  # momentum buffers exist: optimizer state is part of the bulk
    state.commit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    snapshot_tensors = [t for t in state._snapshot["small"]["buffers"]]  # noqa: SLF001
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    assert all(t.data_ptr() not in param_ptrs for t in snapshot_tensors)
    # the failed step: forward (BatchNorm running stats move), backward, fields touched
    model(torch.randn(8, 3) * 5 + 3).sum().backward()
    sampler.record_step()
    state.step = 6
    state.hist.append(3)
    opt.param_groups[0]["lr"] = 0.01  # e.g. a scheduler stepped
    state.restore()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # buffers rolled back, params untouched
    assert all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(momentum, model.parameters()))
    assert state.step == 5 and state.hist == [1, 2] and sampler.processed == 0
    assert opt.param_groups[0]["lr"] == 0.1


def test_marker_restore_after_an_optimizer_step_is_a_clear_error():
    model = _bn_model()
    opt = torch.optim.Adam(model.parameters())
    state = State(model=model, optimizer=opt, step=0)
    state.commit()
    model(torch.randn(8, 3)).sum().backward()
    opt.step()  # creates optimizer state and changes the parameters
    with pytest.raises(ConfigError, match="full_snapshots=True"):
        state.restore()
    state.commit()
    model(torch.randn(8, 3)).sum().backward()
    opt.step()  # changes existing optimizer state in place
    with pytest.raises(ConfigError, match="optimizer.step"):
        state.restore()


def test_restore_without_commit_and_reserved_names_are_clear_errors():
    with pytest.raises(ConfigError, match="commit"):
        State(step=1).restore()
    with pytest.raises(ConfigError, match="reserved"):
        State(sync=1)
    with pytest.raises(AttributeError, match="epoch"):
        State(step=1).epoch  # noqa: B018


def test_codec_roundtrip_and_malformed_payloads():
    obj = {"a": torch.arange(6, dtype=torch.int64).view(2, 3), 0: (1.5, None, "x"), "e": torch.zeros(0),
           "h": torch.ones(2, dtype=torch.bfloat16), "l": [True, {"k": 3}]}
    back = decode(encode(obj))
    assert torch.equal(back["a"], obj["a"]) and back[0] == (1.5, None, "x") and back["l"] == [True, {"k": 3}]
    assert back["h"].dtype == torch.bfloat16 and back["e"].numel() == 0
    raw = encode(obj)
    with pytest.raises(FrameError):
        decode(raw[:20])
    with pytest.raises(FrameError):
        decode(b"\xff" * 8 + raw[8:])
    with pytest.raises(ConfigError, match="state.f"):
        encode({"f": object()})
