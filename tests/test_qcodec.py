"""The optional C codec (kernels/qcodec.c through resilient.collectives.quantization)
against the torch code, bitwise: members with and without the extension must write the
same wire bytes and compute the same values. Every width, odd lengths, the edge values
of each width, spans that start and end inside buckets, fixed-point segments, NaN, ±inf,
-0.0, subnormal and zero scales."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.collectives import quantization as Q
from resilient.kernels import qcodec

T = TypeVar("T")
needs_ext = pytest.mark.skipif(qcodec.codec() is None, reason="kernels/qcodec.c not built (or RESILIENT_QCODEC=0)")
WIDTHS = [*range(2, 17), 32]


@contextmanager
def torch_codec() -> Iterator[None]:
    """The torch code of quantization.py for the calls inside (as without the extension)."""
    real = qcodec.codec
    qcodec.codec = lambda: None   # type: ignore[assignment]
    try:
        yield
    finally:
        qcodec.codec = real   # type: ignore[assignment]


def both(f: Callable[[], T]) -> tuple[T, T]:
    with torch_codec():
        a = f()
    return a, f()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_the_extension_is_built_here():
    """The dev setup has a compiler: a missing module means the build failed."""
    if os.environ.get("RESILIENT_QCODEC") == "0":
        pytest.skip("switched off")
    assert qcodec.BUILT, "kernels/qcodec.c was not built: run `pip install -e .` again and read its warning"


def _values(width: int, count: int, seed: int) -> torch.Tensor:
    lo, hi = (-(1 << 31), (1 << 31) - 1) if width == 32 else (-(1 << (width - 1)), (1 << (width - 1)) - 1)
    q = torch.randint(lo, hi + 1, (count,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    if count:
        q[0], q[-1] = lo, hi
    if count > 2:
        q[1] = 0
    return q.to(torch.int32)


@needs_ext
@settings(max_examples=300, deadline=None, derandomize=True)
@given(width=st.sampled_from(WIDTHS), count=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_pack_and_receive_give_the_torch_bytes_and_values(width, count, seed):
    q = _values(width, count, seed)
    wa, wb = both(lambda: Q.pack(q, width))
    assert torch.equal(wa, wb)
    add = torch.randint(-1000, 1000, (count,), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.int32)
    for addend in (None, add):
        oa, ob = torch.full((count,), 7, dtype=torch.int32), torch.full((count,), 7, dtype=torch.int32)
        with torch_codec():
            Q.unpack_add(wa, count, width, oa, addend)
        Q.unpack_add(wa, count, width, ob, addend)
        assert torch.equal(oa, ob) and torch.equal(oa, q if addend is None else q + addend)


@needs_ext
@settings(max_examples=300, deadline=None, derandomize=True)
@given(w_in=st.sampled_from(WIDTHS), w_out=st.sampled_from(WIDTHS), count=st.integers(0, 5000),
       seed=st.integers(0, 2**16))
def test_the_fused_receive_is_unpack_add_then_pack(w_in, w_out, count, seed):
    """One reduce-scatter receive and the send it feeds: the sum's bytes at ``w_out``."""
    lim = (1 << (min(w_in, w_out) - 1)) - 1   # the sum (addend -1 or 0) fits both widths
    q = _values(w_in, count, seed).clamp(-lim, lim)
    wire = Q.pack(q, w_in)
    add = torch.randint(-1, 1, (count,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(count, dtype=torch.int32)
        dst = torch.full((Q.wire_nbytes(count, w_out),), 0xCD, dtype=torch.uint8)
        Q.unpack_add_pack(wire, count, w_in, out, add, dst, w_out)
        return out, dst
    (oa, da), (ob, db) = both(run)
    assert torch.equal(oa, q + add) and torch.equal(ob, oa)
    assert torch.equal(da, db) and torch.equal(db, Q.pack(q + add, w_out))


SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, 1e-38]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[Q.Segment], int]:
    n = draw(st.integers(1, 3000))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    segs = [Q.Segment(a, b, draw(st.sampled_from([2, 4, 8, 32]))) for a, b in zip(bounds, bounds[1:])]
    return segs, n


@needs_ext
@settings(max_examples=300, deadline=None, derandomize=True)
@given(lay=layouts(), bucket=st.sampled_from([1, 3, 7, 128, 1024]), members=st.integers(1, 5),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 1e-3, 1e-38, 1e30]),
       special=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from(SPECIAL)), max_size=4),
       zero_head=st.integers(0, 3000), agreed=st.sampled_from([1.0, 0.5, 2.0, 1e-40, 0.0]),
       finite_hint=st.booleans(), span=st.tuples(st.integers(0, 2999), st.integers(1, 3000)),
       divisor=st.sampled_from([0, 1, 3, 4, 7]))
def test_quantize_dequantize_and_maxima_give_the_torch_bits(lay, bucket, members, seed, scale, special, zero_head,
                                                            agreed, finite_hint, span, divisor):
    segs, n = lay
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    for i, v in special:
        x[i % n] = v
    x[:zero_head] = 0.0
    ma, mb = both(lambda: Q.bucket_maxima(x, segs, bucket))
    (ca, fa), (cb, fb) = Q.clean_maxima(ma), Q.clean_maxima(mb)
    assert torch.equal(bits(ca), bits(cb)) and fa == fb
    # the agreed bound may be above this member's maxima, or subnormal, or zero
    sc = Q.scales(torch.nan_to_num(ca * agreed, posinf=3.4e38), segs, bucket, members)
    finite = fa and finite_hint
    lo = min(span[0], n - 1)
    sp = (lo, max(lo + 1, min(span[1], n)))

    def quant() -> tuple[torch.Tensor, torch.Tensor]:
        q, r = torch.full((n,), 5, dtype=torch.int32), torch.full((n,), 9.0)
        Q.quantize(x, sc, segs, bucket, members, out=q, finite=finite, residual=r, span=sp)
        return q, r
    (qa, ra), (qb, rb) = both(quant)
    assert torch.equal(qa, qb)
    assert torch.equal(torch.isnan(ra), torch.isnan(rb))
    assert torch.equal(bits(torch.nan_to_num(ra)), bits(torch.nan_to_num(rb)))
    for s in segs:   # every value inside its bound, whatever the input (no NaN cast to int)
        assert int(qa[s.start:s.end].abs().max()) <= max(5, Q.qmax(s.bits, members))
    total = qa * members   # a sum over the members, still exact after dequantize
    da, db = both(lambda: Q.dequantize(total, sc, segs, bucket, out=torch.full((n,), 1.5), span=sp, divisor=divisor))
    assert torch.equal(bits(da), bits(db))
    with torch_codec():   # the divisor is a separate division, bit for bit
        plain = Q.dequantize(total, sc, segs, bucket, out=torch.full((n,), 1.5), span=sp)
    if divisor:
        plain[sp[0]:sp[1]].div_(divisor)
    assert torch.equal(bits(plain), bits(da))


@needs_ext
def test_buffers_too_short_raise_instead_of_being_overrun():
    """The C codec reads and writes raw addresses: a call whose buffers are shorter than
    its counts say takes the torch code, which raises, and leaves the memory past the
    tensors alone (a guard word after each short buffer keeps its bytes)."""
    def guarded(n: int, dtype: torch.dtype, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
        whole = torch.full((n + 16,), fill, dtype=dtype)
        return whole[:n], whole[n:]

    q = torch.arange(40, dtype=torch.int32)
    wire, guard = guarded(2, torch.uint8, 0xCD)
    with pytest.raises(RuntimeError):
        Q.pack_into(q, 4, wire)
    assert (guard == 0xCD).all()
    out, guard = guarded(8, torch.int32, 7)
    with pytest.raises(RuntimeError):
        Q.unpack_add(torch.zeros(40, dtype=torch.uint8), 40, 8, out)
    assert (guard == 7).all()
    with pytest.raises(RuntimeError):
        Q.unpack_add(torch.zeros(2, dtype=torch.uint8), 40, 8, torch.zeros(40, dtype=torch.int32))
    segs = [Q.Segment(0, 40, 4)]
    x = torch.randn(40)
    sc = torch.ones(1)   # 40 elements in buckets of 8 need 5 scales
    out, guard = guarded(40, torch.int32, 7)
    with pytest.raises(RuntimeError):
        Q.quantize(x, sc, segs, 8, 1, out=out)
    assert (guard == 7).all()


def test_without_the_extension_the_torch_code_runs():
    """No module: the package imports and the codec is torch's (the same results)."""
    code = ("import sys; sys.modules['resilient.kernels._qcodec'] = None\n"
            "import torch\n"
            "from resilient.kernels import qcodec\n"
            "from resilient.collectives import quantization as Q\n"
            "q = torch.arange(-7, 8, dtype=torch.int32)\n"
            "assert qcodec.codec() is None and not qcodec.BUILT\n"
            "out = torch.empty(15, dtype=torch.int32); Q.unpack_add(Q.pack(q, 5), 15, 5, out)\n"
            "assert torch.equal(out, q); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_setting_switches_the_extension_off():
    code = "from resilient.kernels import qcodec; print(qcodec.codec() is None)"
    for value, expect in (("0", "True"), ("1", str(qcodec._ext is None))):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "RESILIENT_QCODEC": value})
        assert r.returncode == 0 and r.stdout.strip() == expect, r.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RESILIENT_QCODEC": "maybe"})
    assert bad.returncode != 0 and "RESILIENT_QCODEC" in bad.stderr
