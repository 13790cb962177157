"""State commit/restore and the pickle-free state codec (pure logic)."""
from __future__ import annotations

import pytest
import torch

from resilient.elastic import ElasticSampler, State
from resilient.errors import ConfigError, FrameError
from resilient.torch_backend.codec import decode, encode


def test_commit_restore_rolls_back_model_optimizer_and_fields():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    sampler = ElasticSampler(100, 4, seed=1)
    state = State(model=model, optimizer=opt, sampler=sampler, step=5)
    state.commit()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sampler.record_step()
    state.step = 6
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert state.step == 5 and sampler.processed == 0 and opt.state_dict()["state"] == {}


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
