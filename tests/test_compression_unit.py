"""The exact compressed allreduce without failures: the codec (quantize, pack/unpack,
wire widths, exact dequantization) and real Communicators over loopback TCP checked
bitwise against the sum of the members' dequantized inputs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from resilient.collectives.compressed import Compression, ring_layout
from resilient.collectives.quantization import (
    Segment, bucket_maxima, dequantize, pack, qmax, quantize, scales, unpack, wire_bits, wire_nbytes,
)
from resilient.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import run_communicators  # noqa: E402


@pytest.mark.parametrize("width", [*range(2, 17), 32])
@pytest.mark.parametrize("count", [0, 1, 7, 1000, 1003])
def test_pack_unpack_roundtrip(width, count):
    g = torch.Generator().manual_seed(width * 1000 + count)
    lim = (1 << (width - 1)) - 1
    q = torch.randint(-lim, lim + 1, (count,), generator=g, dtype=torch.int32)
    wire = pack(q, width)
    assert wire.dtype == torch.uint8 and wire.numel() == wire_nbytes(count, width)
    back = unpack(wire, count, width).to(torch.int32)
    assert torch.equal(back, q)


def test_wire_width_follows_contributors():
    """The narrowest two's complement width holding k * qmax, up to 16 bits, then 32."""
    assert [wire_bits(4, k) for k in (1, 2, 3, 4, 5, 9, 10, 18, 19, 4681, 4682)] == [4, 5, 6, 6, 7, 7, 8, 8, 9, 16, 32]
    assert [wire_bits(8, k) for k in (1, 2, 3, 4, 258, 259)] == [8, 9, 10, 10, 16, 32]
    assert [wire_bits(2, k) for k in (1, 2, 3, 4, 127, 128)] == [2, 3, 3, 4, 8, 9]
    assert wire_bits(32, 1) == 32


def test_quantize_is_bounded_and_dequantize_is_the_exact_product():
    g = torch.Generator().manual_seed(1)
    segs = [Segment(0, 5000, 4), Segment(5000, 5300, 32), Segment(5300, 7001, 8)]
    xs = [torch.randn(7001, generator=g) * (i + 1) for i in range(3)]
    m = torch.stack([bucket_maxima(x, segs, 256) for x in xs]).amax(0)
    sc = scales(m, segs, 256, members=3)
    qs = [quantize(x, sc, segs, 256, 3) for x in xs]
    for s in segs:
        lim = qmax(s.bits, 3)
        for q in qs:
            assert int(q[s.start:s.end].abs().max()) <= lim
    Q = qs[0] + qs[1] + qs[2]
    got = dequantize(Q, sc, segs, 256)
    # reference: per element fl32(s * Q) with s expanded per bucket, exact in float64
    per = torch.cat([sc[i:i + 1].expand(min(256, s.end - s.start - 256 * j)) for s in segs
                     for j in range(-(-(s.end - s.start) // 256))
                     for i in [sum(t.n_buckets(256) for t in segs[:segs.index(s)]) + j]])
    assert torch.equal(got, (Q.double() * per.double()).float())
    # the fixed-point segment reproduces its inputs far better than float16 would
    d0 = dequantize(qs[0], sc, segs, 256)
    assert float((d0[5000:5300] - xs[0][5000:5300]).abs().max()) < 1e-6 * float(xs[0][5000:5300].abs().max())
    # non-finite input does not poison the sum
    bad = xs[0].clone()
    bad[0], bad[1], bad[2] = float("nan"), float("inf"), -float("inf")
    qb = quantize(bad, sc, segs, 256, 3)
    assert qb[0] == 0 and qb[1] == 7 and qb[2] == -7


def test_compression_options_are_validated():
    assert Compression.parse(None) is None and Compression.parse("fp32") is None
    assert Compression.parse("q8").bits == 8 and Compression.parse(2).bits == 2
    for bad in ("q3", 5, "fast", 32):
        with pytest.raises(ConfigError):
            Compression.parse(bad)
    c = Compression(bits=4, min_numel=100)
    assert c.layout(torch.zeros(10, 10)) == [Segment(0, 100, 4)]
    assert c.layout(torch.zeros(1000)) is None          # 1-D: uncompressed
    assert c.layout(torch.zeros(5, 5)) is None          # small: uncompressed
    with pytest.raises(ConfigError):
        Compression(segments=((0, 5, 4), (6, 10, 4))).layout(torch.zeros(10))


def test_ring_layout_is_chunk_major_and_tiles_every_segment():
    segs = [Segment(0, 1000, 4), Segment(1000, 1003, 32)]
    pieces, parts, per_chunk = ring_layout(segs, 4, lambda nbytes: 2 if nbytes > 500 else 1)
    assert per_chunk == 2 and len(pieces) == 8
    # contiguous, in order: chunk c is pieces [c * per_chunk, (c + 1) * per_chunk)
    assert pieces[0][0] == 0 and pieces[-1][1] == 1003
    assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))
    # each piece's parts tile it with the bits of the segments it covers
    for (a, b), pp in zip(pieces, parts):
        assert sum(e - s for s, e, _ in pp) == b - a
        for s, e, bits in pp:
            assert bits == (4 if a + e <= 1000 else 32) and (a + s >= 1000) == (bits == 32)
    # chunks of near-equal wire cost: the 3 fixed-point elements weigh 8 packed ones each
    cost = [sum((e - s) * bits for p in range(c * 2, c * 2 + 2) for s, e, bits in parts[p]) for c in range(4)]
    assert max(cost) - min(cost) <= 32 and sum(cost) == 1000 * 4 + 3 * 32


def test_ring_layout_of_many_small_segments_sends_per_chunk_messages():
    """The DDP hook's layout (weights between biases): S pieces per chunk, not one per segment."""
    segs, pos = [], 0
    for i in range(12):
        n = 5000 if i % 2 == 0 else 64
        segs.append(Segment(pos, pos + n, 4 if i % 2 == 0 else 32))
        pos += n
    pieces, parts, per_chunk = ring_layout(segs, 4, lambda nbytes: 1)
    assert per_chunk == 1 and len(pieces) == 4
    assert sum(len(pp) for pp in parts) >= len(segs)   # pieces span segments
    assert pieces[0][0] == 0 and pieces[-1][1] == pos and all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))


def _reference(xs: list[torch.Tensor], segs: list[Segment], bucket: int, avg: bool) -> torch.Tensor:
    """fl32(sum_i s * q_i) with scales from every member's maxima (no failure here)."""
    n = len(xs)
    m = torch.stack([bucket_maxima(x, segs, bucket) for x in xs]).amax(0)
    sc = scales(m, segs, bucket, n)
    Q = sum(quantize(x, sc, segs, bucket, n).to(torch.int64) for x in xs).to(torch.int32)
    out = dequantize(Q, sc, segs, bucket)
    return out / n if avg else out


@pytest.mark.parametrize("bits,numel,world", [(4, 40_000, 3), (8, 40_000, 4), (2, 9_001, 2), (4, 5_000, 1)])
def test_compressed_allreduce_is_the_exact_dequantized_sum(bits, numel, world):
    inputs = {f"m{i}": torch.randn(numel // 100, 100, generator=torch.Generator().manual_seed(i)) * (i + 1)
              for i in range(world)}
    segs = [Segment(0, numel // 100 * 100, bits)]

    def body(m, c):
        outs = []
        for op in ("sum", "avg"):
            t = inputs[m].clone()
            w = c.allreduce(t, op, compression=Compression(bits=bits, bucket=512, min_numel=100))
            outs.append((t, w.contributors))
        plain = torch.ones(10)   # 1-D: stays uncompressed in the same API
        c.allreduce(plain, compression="q4")
        outs.append((plain, None))
        return outs, c.next_seq

    ids, got = run_communicators(world, "qjob", body, small_bytes=1024, slice_bytes=16 << 10)
    xs = [inputs[m].reshape(-1) for m in ids]
    for k, avg in enumerate((False, True)):
        ref = _reference(xs, segs, 512, avg).view(inputs[ids[0]].shape)
        for m in ids:
            out, contrib = got[m][0][k]
            assert contrib == tuple(ids)
            assert torch.equal(out, ref), (m, k, float((out - ref).abs().max()))
    for m in ids:
        assert torch.equal(got[m][0][2][0], torch.full((10,), float(world)))
        assert got[m][1] == 5  # two compressed ops take two sequence numbers each
    if world > 1:
        exact = sum(xs)
        err = float((got[ids[0]][0][0][0].reshape(-1) - exact).abs().max())
        assert err <= world * float(max(x.abs().max() for x in xs)) / qmax(bits) / 2 * 1.001


def test_a_source_is_read_and_the_tensor_receives_the_result():
    """``Compression.source`` (the DDP hook's staged ``grad + e``): the op reads it and
    writes into the tensor, bitwise the result of the op run on a copy; the source is left
    as it is. A call that runs uncompressed (a 1-D tensor, or the switch choosing fp32)
    copies the source into the tensor first."""
    world, numel = 3, 30_000
    inputs = {f"m{i}": torch.randn(numel // 100, 100, generator=torch.Generator().manual_seed(i)) for i in range(world)}
    segs = [Segment(0, numel, 4)]

    def body(m, c):
        src = inputs[m].clone()
        t = torch.full_like(src, float("nan"))
        c.allreduce(t, "avg", compression=Compression(bits=4, bucket=512, min_numel=100, source=src))
        one = torch.ones(10)
        plain = torch.full((10,), float("nan"))
        c.allreduce(plain, compression=Compression(bits=4, source=one))
        auto_src = inputs[m].clone()
        auto = torch.full_like(auto_src, float("nan"))
        c.allreduce(auto, "avg", compression=Compression(bits=4, bucket=512, min_numel=100, auto=True, source=auto_src))
        return t, src, plain, one, auto, auto_src

    ids, got = run_communicators(world, "qsrc", body, small_bytes=1024, slice_bytes=16 << 10)
    ref = _reference([inputs[m].reshape(-1) for m in ids], segs, 512, True).view(numel // 100, 100)
    for m in ids:
        t, src, plain, one, auto, auto_src = got[m]
        assert torch.equal(t, ref) and torch.equal(src, inputs[m])
        assert torch.equal(plain, torch.full((10,), float(world))) and torch.equal(one, torch.ones(10))
        assert torch.equal(auto_src, inputs[m]) and not bool(auto.isnan().any())   # fp32 or q4: either ran on the source
        assert torch.equal(auto, got[ids[0]][4])
    with pytest.raises(ConfigError):
        Compression(source=torch.ones(3)).source_for(torch.ones(4))


# -- the automatic switch ------------------------------------------------------------------

def test_switch_probes_then_follows_measured_times():
    from resilient.collectives.compression_switch import CompressionSwitch, ring_wire_bytes

    assert ring_wire_bytes(4 << 20, 4, None) == 2 * 3 * (1 << 20)          # fp32: 2(n-1)/n of the bytes
    assert ring_wire_bytes(4 << 20, 4, 4) == (1 << 18) * (4 + 5 + 6 + 3 * 6) / 8   # 4, 5, 6 bits, then 6
    nb = 64 << 20
    sw = CompressionSwitch(codec_s_per_byte={4: (1e-9, 1e-9)}, probe_every=10)
    v = sw.vote(nb, 4, 4)
    assert v[0] == 1 and sw.decide(v, 4, nb) == "fp32"            # nothing measured: fp32 probe first
    sw.observe("fp32", nb, 4, sent=100_000_000, seconds=1.0)       # 100 MB/s
    assert -2 > float(sw.vote(nb, 4, 4)[2]) and sw.predicted_speedup(nb, 4, 4) > 2
    v = sw.vote(nb, 4, 4)
    assert v[1] == 1 and sw.decide(v, 4, nb) == "q4"                # model predicts a gain: probe q4
    sw.observe("q4", nb, 4, sent=0, seconds=2.0)                    # measured: q4 loses (loaded CPUs)
    v = sw.vote(nb, 4, 4)
    assert float(v[0]) == float(v[1]) == 0 and sw.decide(v, 4, nb) == "fp32"
    sw.observe("q4", nb, 4, sent=0, seconds=0.1)                     # later calls: q4 got fast
    sw.observe("q4", nb, 4, sent=0, seconds=0.1)
    assert sw.decide(sw.vote(nb, 4, 4), 4, nb) == "q4"
    # the agreed vote is the MAX over members: any probe request and the slowest speedup win
    mine = sw.vote(nb, 4, 4)
    assert sw.decide(torch.maximum(mine, torch.tensor([0.0, 0.0, -0.9])), 4, nb) == "fp32"
    assert sw.decide(torch.maximum(mine, torch.tensor([1.0, 0.0, -9.0])), 4, nb) == "fp32"
    fast = CompressionSwitch(codec_s_per_byte={4: (1e-9, 1e-9)})
    fast.observe("fp32", nb, 4, sent=10**11, seconds=1.0)           # a fast link: no q4 probe at all
    assert fast.vote(nb, 4, 4)[1] == 0


def test_auto_mode_agrees_on_one_arm_and_stays_exact():
    from resilient.collectives.compression_switch import CompressionSwitch

    x0 = {f"m{i}": torch.randn(200, 100, generator=torch.Generator().manual_seed(i)) for i in range(3)}

    def body(m, c):
        sw = c.compression_switch = CompressionSwitch(codec_s_per_byte={4: (0.0, 0.0)})
        outs = []
        for step in range(3):
            # step 0: nothing measured, fp32 probe; step 1: the model (slow link, free codec)
            # asks for a q4 probe; step 2: m2 measured q4 as slower, so the agreed arm is fp32
            if step == 1:
                sw.link_bytes_per_s = 1e6
            if step == 2 and m == "m2":
                key = (t.numel() * 4).bit_length()
                sw.measured[(key, "q4")] = 10 * sw.measured[(key, "fp32")]
            t = x0[m].clone()
            w = c.allreduce(t, compression="auto")
            outs.append((t, sw.last_choice, w.contributors))
        return outs

    from prometheus_client import CollectorRegistry

    from resilient.metrics import RankMetrics

    metrics = RankMetrics(CollectorRegistry())  # shared by the three members here
    ids, got = run_communicators(3, "qauto", body, small_bytes=1024, metrics=metrics)
    decisions = {c: metrics.compression_decisions.labels(c)._value.get() for c in ("fp32", "q4", "q8")}
    assert decisions == {"fp32": 6, "q4": 3, "q8": 0}
    assert metrics.compression_bits._value.get() == 32
    assert [o[1] for o in got["m0"]] == ["fp32", "q4", "fp32"]
    for m in ids:
        assert [o[1] for o in got[m]] == ["fp32", "q4", "fp32"]
        for k in range(3):
            assert torch.equal(got[m][k][0], got["m0"][k][0])
    exact = sum(x0[m] for m in ids)
    # fp32 arm: the plain ring's float sum; q4 arm: the dequantized sum
    assert torch.allclose(got["m0"][0][0], exact, atol=1e-5)
    ref = _reference([x0[m].reshape(-1) for m in ids], [Segment(0, 20_000, 4)], 1024, False).view(200, 100)
    assert torch.equal(got["m0"][1][0], ref)
