"""Plain FSDP's peer copy and hosted shards, as pure logic (resilient/fsdp/peer_copy.py,
resilient/fsdp/orphans.py): the copy's layout is the same on every member whatever its
shard's length, a copy restores a member's shards and optimizer state exactly, and a
hosted (padded) shard stepped by the shadow optimizer is bitwise the real shard stepped by
the script's optimizer — for SGD with momentum and AdamW, across steps and an lr change.
The process-level proof is tests/test_fsdp_plain_procs.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from resilient.errors import ConfigError, DataLost
from resilient.fsdp.orphans import Orphan
from resilient.fsdp.peer_copy import Layout

PADDED = 6


def _member(rows: int, seed: int) -> tuple[list[SimpleNamespace], list[torch.nn.Parameter]]:
    """Two FSDP-like parameters: a padded flat shard of PADDED elements, the real shard a
    view of its first ``rows`` (what FSDP2's FSDPParam holds), and a 0-dim-free bias."""
    g = torch.Generator().manual_seed(seed)
    fps, params = [], []
    for _ in range(2):
        data = torch.zeros(PADDED, dtype=torch.float64)
        data[:rows] = torch.randn(rows, generator=g, dtype=torch.float64)
        p = torch.nn.Parameter(data[:rows])
        fps.append(SimpleNamespace(_sharded_param_data=data, sharded_param=p))
        params.append(p)
    return fps, params


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    opt.step()
    return grads


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)],
                         ids=["sgd-momentum", "adamw"])
def test_hosted_shard_steps_bitwise_like_the_real_one(make) -> None:
    rows = 4  # shorter than the padded shard: the padding must stay zero and change nothing
    fps, params = _member(rows, 1)
    opt = make(params)
    _step(opt, params, 10)
    layout = Layout.of(fps, opt)
    copy = layout.pack(fps, opt)
    host_params, host_states = layout.unpack(copy)
    orphan = Orphan("m1", host_params, host_states)
    host_opt = make([torch.nn.Parameter(torch.zeros(1))])  # the host's own optimizer (same class)
    for k in range(3):
        if k == 2:
            for grp in (opt.param_groups[0], host_opt.param_groups[0]):
                grp["lr"] = grp["lr"] / 2  # a scheduler's change reaches the shadow
        grads = _step(opt, params, 20 + k)
        for i, gr in enumerate(grads):
            padded = torch.zeros(PADDED, dtype=torch.float64)
            padded[:rows] = gr
            orphan.grads[i] = padded
        orphan.step(host_opt, [0, 0])
        for p, hp in zip(params, orphan.params):
            assert torch.equal(hp[:rows], p.detach()), f"step {k}"
            assert torch.equal(hp[rows:], torch.zeros(PADDED - rows, dtype=torch.float64))


def test_layout_is_the_same_for_every_shard_length_and_restores_exactly() -> None:
    sizes = set()
    for rows in (6, 3, 0):  # a full shard, a short one, an empty trailing one
        fps, params = _member(rows, 2)
        opt = torch.optim.AdamW(params, lr=0.01)
        _step(opt, params, 3)
        layout = Layout.of(fps, opt)
        sizes.add(layout.nbytes)
        saved = layout.pack(fps, opt)
        before = [p.detach().clone() for p in params]
        state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        _step(opt, params, 4)
        layout.restore(saved, fps, opt)
        for p, b, sb in zip(params, before, state_before):
            assert torch.equal(p.detach(), b)
            for key, value in sb.items():
                assert torch.equal(opt.state[p][key], value), key
        assert Layout.of(fps, opt, layout) is layout  # unchanged state: the layout is reused
    assert len(sizes) == 1


def test_state_that_is_not_shard_shaped_is_refused() -> None:
    fps, params = _member(4, 3)
    opt = torch.optim.SGD(params, lr=0.1)
    opt.state[params[0]]["row_stats"] = torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(ConfigError, match="row_stats"):
        Layout.of(fps, opt)


def test_a_hosts_copy_carries_its_orphans_and_splits_back_by_member() -> None:
    fps, params = _member(4, 1)
    opt = torch.optim.AdamW(params, lr=0.01)
    _step(opt, params, 10)
    layout = Layout.of(fps, opt)
    others = []
    for seed in (2, 3):  # two members this one hosts, each from its own copy
        ofps, oparams = _member(5, seed)
        oopt = torch.optim.AdamW(oparams, lr=0.01)
        _step(oopt, oparams, seed)
        others.append(Orphan(f"m{seed}", *layout.unpack(Layout.of(ofps, oopt).pack(ofps, oopt))))
    buf = layout.pack(fps, opt, orphans=others)
    assert buf.numel() == 3 * layout.nbytes
    parts = layout.sections(buf, ["m0", "m2", "m3"])
    assert torch.equal(parts["m0"], layout.pack(fps, opt))
    for o in others:
        got_params, got_states = layout.unpack(parts[o.member])
        assert all(torch.equal(a, b) for a, b in zip(got_params, o.params))
        assert all(s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)
                   for s, t in zip(got_states, o.states))
    with pytest.raises(ConfigError, match="2 members"):
        layout.sections(buf, ["m0", "m2"])
    # a member whose optimizer keeps other state: same size, another fingerprint
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    _step(sgd, params, 11)
    sgd_copy = Layout.of(fps, sgd).pack(fps, sgd)
    odd = torch.zeros(layout.nbytes, dtype=torch.uint8)
    odd[:min(odd.numel(), sgd_copy.numel())] = sgd_copy[:odd.numel()]
    with pytest.raises(ConfigError, match="another layout"):
        layout.sections(odd, ["m9"])
    del others[0].states[0]["exp_avg"]
    with pytest.raises(ConfigError, match="lack optimizer state 'exp_avg'"):
        layout.pack(fps, opt, orphans=others)


def test_the_holder_of_a_lost_member_follows_the_copies_it_travelled_in() -> None:
    from resilient.fsdp.plain import PlainShards

    s = PlainShards()
    s.members = s.committed_live = ("a", "b", "c", "d")
    s.carried = {m: () for m in s.members}
    # c lost: its copy went to d; the commit after it records that d's copy carries c
    assert s.holder("c", {"a", "b", "d"}) == "d" and s.hosted_by("d", {"a", "b", "d"}) == ["c"]
    s.committed_live = ("a", "b", "d")
    s.carried.update({x: tuple(s.hosted_by(x, s.committed_live)) for x in s.committed_live})
    # then d lost: a received d's copy, with c's section in it
    assert s.hosted_by("a", {"a", "b"}) == ["c", "d"]
    s.check_hosts({"a", "b"})
    # a lost in the same step as d, before a step committed with a's copy carrying c and d on
    assert s.holder("c", {"b"}) is None
    with pytest.raises(DataLost, match="c and d"):
        s.check_hosts({"b"})
