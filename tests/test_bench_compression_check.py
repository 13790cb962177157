"""bench/_compression_check.py, the bitwise checks bench/compression.py applies to every
output of its resilient arms, against real Communicators (4 members, loopback, threads):
the float ring's result is recomputed bitwise in its ring order, the compressed one from
the contributors' inputs; a one-ulp change, another summation order or a wrong scale is
caught."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _compression_check import Checker, ring_sum  # noqa: E402
from static_group import run_communicators  # noqa: E402

NUMEL = 40_960


def _input(m: str) -> torch.Tensor:
    return torch.randn(NUMEL // 1024, 1024, generator=torch.Generator().manual_seed(int(m[1:]) + 11))


def test_every_output_of_the_fp32_ring_and_the_compressed_op_is_checked_bitwise():
    def body(m, c):
        chk = Checker(_input)
        t = _input(m)
        w = c.allreduce(t)
        ok32 = chk.fp32(t, w.contributors, c.retained)
        bumped = t.clone()
        bumped.view(-1)[123] = torch.nextafter(bumped.view(-1)[123], torch.tensor(float("inf")))
        bad32 = chk.fp32(bumped, w.contributors, c.retained)
        members = c.retained.members
        q = _input(m)
        wq = c.allreduce(q, compression="q4")
        okq = chk.compressed(q, wq.contributors, c.last_compression)
        info = dict(c.last_compression)
        info["scales"] = info["scales"] * 2
        badq = chk.compressed(q, wq.contributors, info)
        return ok32, bad32, okq, badq, chk.checked, len(chk.failures), t, members

    ids, got = run_communicators(4, "benchcheck", body, small_bytes=1024, slice_bytes=16 << 10)
    for m in ids:
        ok32, bad32, okq, badq, checked, failures, _, _ = got[m]
        assert (ok32, bad32, okq, badq) == (True, False, True, False), m
        assert (checked, failures) == (4, 2)
    # the ring's order matters: a plain left-to-right sum differs in some element, so the
    # check could not pass with the wrong order
    t, members = got[ids[0]][6], got[ids[0]][7]
    xs = [_input(k).reshape(-1) for k in members]
    assert torch.equal(t.reshape(-1), ring_sum(xs))
    assert not torch.equal(ring_sum(xs), xs[0] + xs[1] + xs[2] + xs[3])
