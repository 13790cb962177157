"""The blocked codec (quantization.py) against a whole-tensor per-element reference, on
layouts that cross block boundaries (several blocks per segment, buckets that do not
divide the block, a bucket longer than a block, short tails, non-finite inputs)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.collectives.quantization import (
    BLOCK, FINE, Segment, bucket_maxima, dequantize, pack, pack_into, qmax, quantize, scales, unpack, unpack_add,
    wire_nbytes,
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


def reference_wire(values: list[int], width: int) -> list[int]:
    """The wire format written out per element (docs/compression.md): 32 and 16 bits
    little-endian integers; otherwise planes of 8, then 4, 2, 1 bits as needed, lowest bits
    first; a narrower plane has ``per = 8 // p`` fields per byte, field ``j`` of byte
    ``i`` being value ``i + j*K`` (``K`` = the plane's bytes)."""
    if width in (8, 16, 32):
        widths = [width]
    else:
        widths, left = ([8], width - 8) if width > 8 else ([], width)
        for p in (4, 2, 1):
            if left >= p:
                widths.append(p)
                left -= p
    out, shift, n = [], 0, len(values)
    for p in widths:
        fields = [(v >> shift) & ((1 << p) - 1) for v in values]
        if p >= 8:
            for f in fields:
                out += list(f.to_bytes(p // 8, "little"))
        else:
            per = 8 // p
            K = -(-n // per)
            plane = [0] * K
            for i, f in enumerate(fields):
                plane[i % K] |= f << (p * (i // K))
            out += plane
        shift += p
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(width=st.sampled_from([*range(2, 17), 32]), count=st.integers(0, 300), seed=st.integers(0, 2**16),
       lead=st.integers(0, 3))
def test_pack_into_is_pack_and_round_trips(width, count, seed, lead):
    """The vectorised packing (``pack``, ``pack_into`` into an aligned slice of a larger
    wire) against a per-element reference of the wire format, and back through ``unpack``."""
    lim = (1 << (width - 1)) - 1
    q = torch.randint(-lim - 1, lim + 1, (count,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    if count:
        q[0], q[-1] = -lim - 1, lim   # the edge values
    wire = pack(q, width)
    assert wire.numel() == wire_nbytes(count, width)
    assert wire.tolist() == reference_wire(q.tolist(), width)
    big = torch.full((4 * lead + wire.numel() + 3,), 0xAB, dtype=torch.uint8)
    pack_into(q, width, big[4 * lead:4 * lead + wire.numel()])
    assert torch.equal(big[4 * lead:4 * lead + wire.numel()], wire)
    assert bool((big[:4 * lead] == 0xAB).all()) and bool((big[4 * lead + wire.numel():] == 0xAB).all())
    assert torch.equal(unpack(wire, count, width).to(torch.int32), q)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sizes=st.lists(st.tuples(st.integers(1, 40), st.sampled_from([2, 4, 8, 32])), min_size=1, max_size=6),
       k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_multi_part_wire_round_trips(sizes, k, seed):
    """One piece spanning segments of different bits: each part packed at its width at
    an aligned offset of one wire, unpacked and added back exactly."""
    from resilient.collectives.algorithms.quantized_ring import QuantizedRing, wire_plan

    parts, pos = [], 0
    for n, bits in sizes:
        parts.append((pos, pos + n, bits))
        pos += n
    plan = wire_plan(tuple(parts), k, 4)
    g = torch.Generator().manual_seed(seed)
    q = torch.cat([torch.randint(-k * qmax(b, 4), k * qmax(b, 4) + 1, (e - s,), generator=g, dtype=torch.int32)
                   for s, e, b in parts]) if k > 1 else \
        torch.cat([torch.randint(-qmax(b, 4), qmax(b, 4) + 1, (e - s,), generator=g, dtype=torch.int32)
                   for s, e, b in parts])
    wire = QuantizedRing._pack(q, plan)
    assert wire.numel() == plan[1] and all(off % 4 == 0 for _, _, _, off in plan[0])
    out, add = torch.empty_like(q), torch.arange(q.numel(), dtype=torch.int32)
    for a, b, w, off in plan[0]:
        unpack_add(wire[off:off + wire_nbytes(b - a, w)], b - a, w, out[a:b], add[a:b])
    assert torch.equal(out, q + add)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 300), st.sampled_from([2, 4, 8, FINE]), st.integers(0, 2**31 - 1),
       st.booleans(), st.floats(1e-30, 1e30))
def test_residual_written_as_it_quantizes_is_x_minus_the_dequantized_input(n, bucket, bits, seed, special, mag):
    """quantize(..., residual=e) gives the same q and e == x - dequantize(q) bitwise, on
    layouts with a fixed-point segment, zero buckets, -0.0 and non-finite inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * float(mag)
    h = n // 2
    x[h:h + bucket] = 0.0   # a zero bucket (the hashed table's untouched rows): scale 0
    if special:
        x[torch.randint(0, n, (3,), generator=g)] = torch.tensor([-0.0, float("nan"), float("inf")])
    segs = [Segment(0, h, FINE), Segment(h, n, bits)] if 0 < h < n else [Segment(0, n, bits)]
    m = bucket_maxima(x, segs, bucket).nan_to_num(nan=0.0, posinf=1e30)
    sc = scales(m, segs, bucket, members=3)
    e = torch.full((n,), 5.0)
    q = quantize(x, sc, segs, bucket, 3, residual=e)
    assert torch.equal(q, quantize(x, sc, segs, bucket, 3))
    want = x - dequantize(q, sc, segs, bucket)
    assert torch.equal(e.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(e.isnan(), want.isnan())


@settings(max_examples=80, deadline=None, derandomize=True)
@given(sizes=st.lists(st.tuples(st.integers(1, 700), st.sampled_from([2, 4, 8, FINE])), min_size=1, max_size=3),
       bucket=st.integers(1, 300), cuts=st.lists(st.integers(0, 2100), max_size=6), seed=st.integers(0, 2**16),
       special=st.booleans(), reverse=st.booleans())
def test_quantize_and_dequantize_by_spans_are_the_whole_calls_bits(sizes, bucket, cuts, seed, special, reverse):
    """The span kernels (the ring quantizes and dequantizes piece by piece): any tiling of
    the tensor by spans, in any order, writes bitwise the whole call's ``q``, residual
    and dequantized values, which equal the per-element reference; elements outside a
    span are left as they were. Spans start and end inside buckets, segments and blocks."""
    segs, pos = [], 0
    for n, bits in sizes:
        segs.append(Segment(pos, pos + n, bits))
        pos += n
    n = pos
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    if special:
        x[torch.randint(0, n, (4,), generator=g)] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    m = bucket_maxima(x, segs, bucket).nan_to_num(nan=0.0, posinf=1e30)
    sc = scales(m, segs, bucket, members=3)
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    spans = list(zip(bounds, bounds[1:]))
    if reverse:
        spans.reverse()
    e_whole = torch.empty(n)
    q_whole = quantize(x, sc, segs, bucket, 3, residual=e_whole)
    assert torch.equal(q_whole, _reference(x, sc, segs, bucket, 3))
    q = torch.full((n,), 12345, dtype=torch.int32)
    e = torch.full((n,), 7.0)
    for a, b in spans:
        quantize(x, sc, segs, bucket, 3, out=q, residual=e, span=(a, b))
        rest = q[:a] if reverse else q[b:]   # the spans not written yet
        assert bool((rest == 12345).all()) and bool((e[:a] if reverse else e[b:]).eq(7.0).all())
    assert torch.equal(q, q_whole)
    assert torch.equal(e.isnan(), e_whole.isnan())
    assert torch.equal(e.nan_to_num(0.0).view(torch.int32), e_whole.nan_to_num(0.0).view(torch.int32))
    Q = q * 2 - 1
    d_whole = dequantize(Q, sc, segs, bucket)
    assert torch.equal(d_whole, (Q.double() * _per_element(sc, segs, bucket).double()).float())
    d = torch.full((n,), -3.0)
    for a, b in spans:
        assert dequantize(Q, sc, segs, bucket, out=d, span=(a, b)) is d
    assert torch.equal(d, d_whole)
