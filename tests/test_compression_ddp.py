"""The compression DDP hook with error feedback: real Communicators over loopback TCP (one
thread per member) under torch's DDP, and the pure residual/State rules."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.ddp import ErrorFeedback, compression_hook
from resilient.elastic import State
from resilient.torch_backend.communicator_engine import CommunicatorEngine
from resilient.torch_backend.process_group import ResilientProcessGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import run_communicators  # noqa: E402


def test_residual_rule_contributor_and_left_out():
    ef = ErrorFeedback(bits=4)
    x = torch.tensor([1.0, -2.0, 0.5])
    own = torch.tensor([0.75, -2.0, 0.25])
    ef.update("0", x, own, x, True, None)
    assert torch.equal(ef.residuals["0"], x - own)
    ef.update("0", x, own, x, False, None)  # left out of the op: the whole input is delayed
    assert torch.equal(ef.residuals["0"], x)


def test_in_place_bookkeeping_gives_the_allocating_rules_bits():
    """stage/settle (the hook's float32 path: reused buffers) against input_for/update
    over steps that are compressed, left out and uncompressed, with buffer reuse."""
    from resilient.collectives.compressed import CompressedResult
    from resilient.collectives.quantization import Segment, bucket_maxima, clean_maxima, quantize, scales

    segs = [Segment(0, 40, 32), Segment(40, 1064, 4)]
    fast, ref, fused = (ErrorFeedback(bits=4, bucket=128) for _ in range(3))
    g = torch.Generator().manual_seed(3)
    for step, (contributed, compressed) in enumerate([(True, True), (True, True), (False, True),
                                                      (True, False), (True, True), (False, False), (True, False)]):
        grad = torch.randn(1064, generator=g) * (step + 1)
        x, xr = fast.stage("0", grad), ref.input_for("0", grad)
        assert torch.equal(x, xr)
        m, _ = clean_maxima(bucket_maxima(x, segs, 128))
        sc = scales(m * 1.5, segs, 128, 3)   # the group's bound: above this member's maxima
        q = quantize(x, sc, segs, 128, 3)
        info = {"q": q, "scales": sc, "segments": segs, "bucket": 128}
        res = CompressedResult(("m0",), compression=info if compressed else None)
        agg = torch.randn(1064, generator=g)
        own = res.dequantized_input() if compressed else xr
        ref.update("0", xr, own, agg, contributed, res)
        fast.settle("0", x, agg, contributed, res)
        assert torch.equal(fast.residuals["0"], ref.residuals["0"]), step
        # the op's way: the residual written as it quantizes (Compression.residual), in a
        # buffer of the bucket's own that becomes the residual only on settle
        fresh = fused.residual_buffer("0", grad)
        before = fused.residuals.get("0")
        xf = fused.stage("0", grad)
        qf = quantize(xf, sc, segs, 128, 3, residual=fresh)
        assert torch.equal(qf, q) and (before is None or torch.equal(fused.residuals["0"], before))
        res_f = CompressedResult(("m0",), compression=dict(info, q=qf, residual=fresh) if compressed else None)
        fused.settle("0", xf, agg, contributed, res_f, fresh)
        assert torch.equal(fused.residuals["0"], ref.residuals["0"]), step
        assert (fused.residuals["0"] is fresh) == (contributed and compressed)
    assert fast.residuals["0"].abs().max() == 0   # the last contributed step ran uncompressed


def test_state_keeps_own_residuals_and_a_joiner_starts_at_zero():
    ef = ErrorFeedback(bits=4, adaptive=True)
    ef.member_id = "m0"
    ef.residuals["3"] = torch.ones(5)
    ef.bucket_bits["3"] = 8
    st = State(ef=ef)
    st.commit()
    ef.residuals["3"] = torch.zeros(5)
    st.restore()  # own snapshot: residuals come back
    assert torch.equal(st.ef.residuals["3"], torch.ones(5))
    other = ErrorFeedback(bits=4, adaptive=True)
    other.member_id = "m7"  # a joiner loading m0's state: shared bits, no residuals
    other.load_state_dict(ef.state_dict())
    assert other.residuals == {} and other.bits_for("3") == 8


def _train(world: int, steps: int, bits: int = 4):
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).state_dict()

    def body(m, comm):
        i = int(m[1:])
        pg = ResilientProcessGroup(CommunicatorEngine(comm, None, None, m), i, world)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        model.load_state_dict(init)  # the global RNG is shared by the threads
        ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
        ef = ErrorFeedback(bits=bits, group=pg)
        ddp.register_comm_hook(ef, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        trace = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step * 100 + i)
            x = torch.randn(32, 64, generator=g)
            opt.zero_grad()
            loss = ((ddp(x) - x[:, :1]) ** 2).mean()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            res = {k: v.clone() for k, v in ef.residuals.items()}
            opt.step()
            trace.append((grads, res, ef.tracker.bucket_sets()))
            ef.tracker.reset()
        return [p.detach().clone() for p in model.parameters()], trace, comm.next_seq

    return run_communicators(world, "qddp", body, timeout=120, small_bytes=1024)


def test_ddp_compression_hook_keeps_members_bitwise_identical():
    ids, out = _train(3, 4)
    ref = out[ids[0]][0]
    for m in ids[1:]:
        for a, b in zip(ref, out[m][0]):
            assert torch.equal(a, b), m
    for m in ids:
        for grads, res, sets in out[m][1]:
            assert sets and all(s == frozenset(ids) for s in sets)
            # the residual is what the quantizer held back: small but not zero
            r = torch.cat([v.reshape(-1) for v in res.values()])
            assert 0 < float(r.abs().max()) < 0.1
    for k in range(4):  # the averaged gradient of each step is the same on every member
        for m in ids[1:]:
            for a, b in zip(out[ids[0]][1][k][0], out[m][1][k][0]):
                assert torch.equal(a, b)


def test_adaptive_bits_follow_the_aggregate_and_scales():
    from resilient.collectives.compressed import CompressedResult
    from resilient.collectives.quantization import Segment

    ef = ErrorFeedback(bits=4, bucket=4, adaptive=True, adaptive_threshold=0.5)
    segs = [Segment(0, 8, 4)]
    agg = torch.ones(8)
    coarse = CompressedResult(("m0",), compression={"scales": torch.tensor([2.0, 2.0]), "segments": segs, "bucket": 4})
    ef.update("0", agg, agg, agg, True, coarse)      # noise ~ s: large against |agg| -> 8 bits next
    assert ef.bits_for("0") == 8
    fine = CompressedResult(("m0",), compression={"scales": torch.tensor([1e-3, 1e-3]), "segments": segs, "bucket": 4})
    ef.update("0", agg, agg, agg, True, fine)        # tiny noise -> back to the configured 4 bits
    assert ef.bits_for("0") == 4


def test_compression_hook_refuses_a_group_without_a_communicator():
    from resilient.errors import ConfigError
    from resilient.torch_backend.inproc import InProcWorld

    pg = ResilientProcessGroup(InProcWorld(["m0"]).engine("m0"), 0, 1)  # resilient group, no Communicator
    with pytest.raises(ConfigError, match="'resilient' backend"):
        compression_hook(ErrorFeedback(group=pg), None)  # refused before the bucket is read
