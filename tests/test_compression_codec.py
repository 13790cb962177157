"""The blocked codec (quantization.py) against a whole-tensor per-element reference, on
layouts that cross block boundaries (several blocks per segment, buckets that do not
divide the block, a bucket longer than a block, short tails, non-finite inputs)."""
from __future__ import annotations

import pytest
import torch

from resilient.collectives.quantization import (
    BLOCK, FINE, Segment, bucket_maxima, dequantize, pack, qmax, quantize, scales, unpack_add,
)


def _per_element(sc: torch.Tensor, segs: list[Segment], bucket: int) -> torch.Tensor:
    """Each element's bucket scale (float32)."""
    sizes = [min(bucket, s.numel - j * bucket) for s in segs for j in range(s.n_buckets(bucket))]
    return torch.repeat_interleave(sc, torch.tensor(sizes))


def _reference(x: torch.Tensor, sc: torch.Tensor, segs: list[Segment], bucket: int, members: int) -> torch.Tensor:
    per = _per_element(sc, segs, bucket)
    out = torch.empty(x.numel(), dtype=torch.int32)
    for s in segs:
        dt = torch.float64 if s.bits == FINE else torch.float32
        qm = float(qmax(s.bits, members))
        ss = per[s.start:s.end].to(dt)
        inv = torch.where(ss > 0, 1.0 / ss, torch.zeros_like(ss))
        r = (x[s.start:s.end].to(dt) * inv).nan_to_num(nan=0.0, posinf=qm, neginf=-qm)
        out[s.start:s.end] = r.clamp(-qm, qm).round().to(torch.int32)
    return out


@pytest.mark.parametrize("bucket", [1000, BLOCK + 5])
def test_blocked_codec_matches_the_per_element_reference(bucket):
    n = 2 * BLOCK + 1234
    h = n // 2 + 1
    segs = [Segment(0, h, 4), Segment(h, h + 5000, FINE), Segment(h + 5000, n, 8)]
    g = torch.Generator().manual_seed(bucket)
    xs = [torch.randn(n, generator=g) * (i + 1) for i in range(3)]
    xs[0][[7, BLOCK + 3, h + 10, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    maxima = [bucket_maxima(x, segs, bucket) for x in xs]
    for x, m in zip(xs, maxima):
        ref = torch.stack([c.abs().amax() for s in segs for c in x[s.start:s.end].split(bucket)])
        assert torch.equal(m.nan_to_num(-1.0), ref.nan_to_num(-1.0))  # NaN kept where it was
    agreed = torch.stack(maxima[1:]).amax(0)  # member 0 left out of the scale op: it is clamped
    sc = scales(agreed, segs, bucket, members=3)
    qs = [quantize(x, sc, segs, bucket, 3) for x in xs]
    for x, q in zip(xs, qs):
        assert torch.equal(q, _reference(x, sc, segs, bucket, 3))
    assert torch.equal(quantize(xs[1], sc, segs, bucket, 3, finite=True), qs[1])
    Q = qs[0] + qs[1] + qs[2]
    out = torch.full((n,), 7.0)
    assert dequantize(Q, sc, segs, bucket, out=out) is out
    assert torch.equal(out, (Q.double() * _per_element(sc, segs, bucket).double()).float())


@pytest.mark.parametrize("width", [2, 4, 8, 16, 32])
def test_unpack_add_is_one_ring_receive(width):
    count = 2 * BLOCK + 3
    g = torch.Generator().manual_seed(width)
    lim = (1 << (width - 1)) - 1
    vals = torch.randint(-lim, lim + 1, (count,), generator=g, dtype=torch.int32)
    mine = torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int32)
    wire = pack(vals, width)
    out = torch.empty(count, dtype=torch.int32)
    unpack_add(wire, count, width, out, mine)
    assert torch.equal(out, vals + mine)
    unpack_add(wire, count, width, out)
    assert torch.equal(out, vals)


def test_q_buffers_are_reused_only_when_nothing_holds_them():
    from resilient.collectives.compressed import _QBuffers

    pool = _QBuffers(keep=2)
    numel = 1 << 18  # 1 MiB of int32
    q = pool.take(numel)
    first = q.data_ptr()
    tail = q[5:9]
    del q
    held = pool.take(numel)  # a view of the first q is alive: a new buffer
    assert held.data_ptr() != first
    del tail
    again = pool.take(numel)  # nothing holds the first one now
    assert again.data_ptr() == first and again.dtype == torch.int32 and again.numel() == numel
    assert pool.take(100).numel() == 100  # small: plain allocation
