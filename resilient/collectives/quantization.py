"""Bucketed integer quantization for the exact compressed allreduce (pure torch ops, no
Python loop per element; see ``docs/compression.md``).

A flat float tensor is cut into *segments* ``(start, end, bits)``; each segment into
quantization buckets of ``bucket`` elements (the last one may be shorter). Every bucket
has one scale ``s = m / qmax(bits)`` where ``m`` is an agreed bound on ``|x|`` (the
group's MAX of the members' bucket maxima); an element quantizes to
``q = clamp(round(x / s), -qmax, qmax)`` and dequantizes to ``D(s, q) = fl32(s * q)``.

``bits`` is 2, 4 or 8 (compressed) or 32: fixed point at the wire width of float32, for
the elements that stay uncompressed inside a compressed op (1-D parameters such as biases
and norms). Its ``qmax`` is ``(2**29 - 1) // n`` for ``n`` members, so a sum of up to
``n`` values stays below ``2**29`` in magnitude.

Exactness: ``|sum q_i| < 2**29`` and ``s`` has a 24-bit mantissa, so ``s * Q`` is exact in
float64 and :func:`dequantize` rounds it once to float32: the result of the collective is
the exact real sum of the members' dequantized inputs, correctly rounded, whatever the
order in which the integers were added.

Wire widths: a partial sum over ``k`` contributors is sent at the narrowest width that
holds ``k * qmax`` (:func:`wire_bits`: ``bits`` for one input; at 4 bits and 4 members
4, 5, 6, 6 bits), up to 16 bits, else 32. Widths 32 and 16 are little-endian integers,
any other is cut into *planes* of 8, 4, 2, 1 bits (:func:`planes`), lowest bits first:
each plane holds its bits of every value packed ``8 / p`` to a byte, the first value in
the lowest bits, and the last plane the top bits in two's complement. The optional C
codec (``kernels/qcodec.c``, :mod:`resilient.kernels.qcodec`) and the torch code here
write the same bytes and compute the same bits; each stage uses the C codec when it is
built and takes the tensors (contiguous CPU, float32 input), the torch code otherwise.

Failure behaviour: shapes that do not match the layout raise :class:`ConfigError`;
non-finite inputs quantize to 0 (NaN) or ``±qmax`` (±inf) instead of poisoning the sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resilient.errors import ConfigError
from resilient.kernels import qcodec

BITS = (2, 4, 8, 32)
FINE = 32
#: the largest |sum of q| the fixed-point segments may reach (exact float64 product)
FINE_LIMIT = (1 << 29) - 1


def qmax(bits: int, members: int = 1) -> int:
    """Largest |q| for ``bits`` (``members`` only matters for the fixed-point width)."""
    if bits == FINE:
        return max(1, FINE_LIMIT // max(1, members))
    if bits not in BITS:
        raise ConfigError(f"quantization bits must be one of {BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


#: the widest packed wire; wider partial sums travel as int32
MAX_PACKED = 16


def wire_bits(bits: int, k: int, members: int = 1) -> int:
    """Wire width of a partial sum over ``k`` contributors: the narrowest that holds
    ``k * qmax`` in two's complement (``bits`` for one input), 32 beyond 16 bits."""
    if bits == FINE:
        return 32
    if k <= 1:
        return bits
    w = max(bits, (k * qmax(bits)).bit_length() + 1)
    if w <= MAX_PACKED:
        return w
    if w <= 32:
        return 32
    raise ConfigError(f"a sum over {k} members of {bits}-bit values does not fit in int32")


def planes(width: int) -> tuple[tuple[int, int], ...]:
    """``(bits, shift)`` of each plane of ``width``, lowest bits first: 32, 16 and 8 are
    one plane; 9..15 an 8-bit plane then the rest as below; under 8 the largest of 4, 2,
    1 bits first (6 = 4 + 2). The last plane's fields are signed."""
    if width in (8, 16, 32):
        return ((width, 0),)
    if not 1 <= width < MAX_PACKED:
        raise ConfigError(f"no wire format for width {width}")
    out, left, shift = [], width, 0
    if width > 8:
        out.append((8, 0))
        left, shift = width - 8, 8
    for p in (4, 2, 1):
        if left >= p:
            out.append((p, shift))
            shift += p
            left -= p
    return tuple(out)


def wire_nbytes(count: int, width: int) -> int:
    """Bytes of ``count`` values at ``width``: each plane rounded up to whole bytes."""
    return sum(-(-count * p // 8) for p, _ in planes(width))


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    bits: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def n_buckets(self, bucket: int) -> int:
        return -(-self.numel // bucket)


def check_segments(segments: list[Segment], numel: int) -> None:
    """Raise ConfigError unless ``segments`` tile ``[0, numel)`` in order with valid bits."""
    pos = 0
    for s in segments:
        if s.start != pos or s.end <= s.start or s.bits not in BITS:
            raise ConfigError(f"quantization segments must tile [0, {numel}) in order with bits in {BITS}; got {segments}")
        pos = s.end
    if pos != numel:
        raise ConfigError(f"quantization segments cover [0, {pos}) but the tensor has {numel} elements")


#: elements per cache block: every stage runs its passes block by block, so a multi-pass
#: stage reads and writes main memory once and the other passes stay in L2 (2-4x faster
#: per byte than whole-tensor passes on 16-64 MiB tensors; see ``bench/codec.py``)
BLOCK = 1 << 17


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _rows(x: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (flat) as full rows of ``bucket`` elements and the shorter tail (or None)."""
    full = x.numel() // bucket * bucket
    head = x[:full].view(-1, bucket)
    return head, (x[full:].view(1, -1) if full < x.numel() else None)


def _row_blocks(rows: int, bucket: int) -> list[tuple[int, int]]:
    """Row ranges of about :data:`BLOCK` elements (at least one row each)."""
    return _spans(rows, max(1, BLOCK // bucket))


def bucket_maxima(x: torch.Tensor, segments: list[Segment], bucket: int) -> torch.Tensor:
    """float32 max |x| per bucket of every segment, concatenated (NaN/inf kept: see
    :func:`clean_maxima`)."""
    out = torch.empty(sum(s.n_buckets(bucket) for s in segments), dtype=torch.float32)
    c = qcodec.codec()
    if c is not None and x.dtype == torch.float32 and _cpu_contig(x) and _covers(segments, bucket, x.numel(), out):
        for s, off in zip(segments, _bucket_offsets(segments, bucket)):
            c.maxima(x.data_ptr() + 4 * s.start, s.numel, bucket, out.data_ptr() + 4 * off)
        return out
    off = 0
    for s in segments:
        v = x[s.start:s.end].to(torch.float32)
        head, tail = _rows(v, bucket)
        rows = head.shape[0]
        if rows:
            scratch = torch.empty(min(rows, max(1, BLOCK // bucket)), bucket, dtype=torch.float32)
            for a, b in _row_blocks(rows, bucket):
                sc = scratch[:b - a]
                torch.abs(head[a:b], out=sc)
                torch.amax(sc, 1, out=out[off + a:off + b])
        off += rows
        if tail is not None:
            out[off] = tail.abs().amax()  # tail: one row
            off += 1
    return out


def clean_maxima(m: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Maxima with NaN -> 0 and inf -> float32 max, and whether they were all finite
    (then :func:`quantize` may skip its NaN pass)."""
    finite = bool(torch.isfinite(m).all())
    return (m if finite else torch.nan_to_num(m, nan=0.0, posinf=torch.finfo(torch.float32).max)), finite


def scales(maxima: torch.Tensor, segments: list[Segment], bucket: int, members: int) -> torch.Tensor:
    """Per-bucket float32 scale ``m / qmax`` from agreed maxima."""
    q = torch.cat([torch.full((s.n_buckets(bucket),), float(qmax(s.bits, members)), dtype=torch.float32)
                   for s in segments])
    if q.numel() != maxima.numel():
        raise ConfigError(f"{maxima.numel()} bucket maxima for a layout of {q.numel()} buckets")
    return (maxima.to(torch.float32) / q).to(torch.float32)


def _blocks(s: Segment, bucket: int, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The part of segment ``s`` inside the element range ``[lo, hi)`` as blocks
    ``(e0, e1, r0, r1)``: elements ``[e0, e1)`` relative to the segment, its buckets
    ``[r0, r1)``. A block is either whole buckets (about :data:`BLOCK` elements, at least
    one bucket) or a single bucket's part (a range that starts or ends inside a bucket,
    or the segment's shorter last bucket)."""
    a, b = max(lo, s.start) - s.start, min(hi, s.end) - s.start
    out: list[tuple[int, int, int, int]] = []
    if a >= b:
        return out
    if a % bucket:   # a range starting inside a bucket: that bucket's part first
        e = min(b, (a // bucket + 1) * bucket)
        out.append((a, e, a // bucket, a // bucket + 1))
        a = e
    whole = b // bucket * bucket
    step = max(1, BLOCK // bucket) * bucket
    while a < whole:
        e = min(whole, a + step)
        out.append((a, e, a // bucket, e // bucket))
        a = e
    if a < b:   # a range ending inside a bucket (or the short last bucket)
        out.append((a, b, a // bucket, a // bucket + 1))
    return out


def _bucket_offsets(segments: list[Segment], bucket: int) -> list[int]:
    """Index of each segment's first bucket scale in the concatenated scales."""
    offs, off = [], 0
    for s in segments:
        offs.append(off)
        off += s.n_buckets(bucket)
    return offs


def quantize(x: torch.Tensor, sc: torch.Tensor, segments: list[Segment], bucket: int, members: int,
             out: torch.Tensor | None = None, finite: bool = False,
             residual: torch.Tensor | None = None, span: tuple[int, int] | None = None) -> torch.Tensor:
    """int32 ``q`` of the flat float tensor ``x`` under per-bucket scales ``sc``
    (``finite``: the caller knows ``x`` has no NaN/inf, one pass less).

    ``residual`` (flat float32, ``x.numel()`` elements, not overlapping ``x``; ``x`` must
    be float32 then): also write ``x - dequantize(q)`` into it, block by block while the
    block is in cache — error feedback's residual without a second pass over ``q`` and
    ``x`` after the op. Bitwise what ``x - dequantize(q, sc, ...)`` gives (the same ops
    per element).

    ``span`` (``(lo, hi)``, element indices): only those elements of ``out`` (and of
    ``residual``) are written, the others are left as they are — the compressed ring
    quantizes its input piece by piece as it needs it. Every element gets the same ops
    whatever the span (and the block it falls in), so any set of spans tiling the tensor
    gives bitwise the whole call's result."""
    out = torch.empty(x.numel(), dtype=torch.int32) if out is None else out
    if residual is not None and (x.dtype != torch.float32 or residual.dtype != torch.float32
                                 or residual.numel() != x.numel()):
        raise ConfigError("quantize's residual needs float32 x and a float32 residual of the same size")
    lo, hi = (0, x.numel()) if span is None else span
    c = qcodec.codec()
    if (c is not None and x.dtype == torch.float32 and out.dtype == torch.int32 and sc.dtype == torch.float32
            and _cpu_contig(x, out, sc) and (residual is None or _cpu_contig(residual))
            and out.numel() >= x.numel() and _covers(segments, bucket, x.numel(), sc)):
        for s, off in zip(segments, _bucket_offsets(segments, bucket)):
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                first, pos0 = divmod(a - s.start, bucket)
                c.quantize(x.data_ptr() + 4 * a, out.data_ptr() + 4 * a,
                           0 if residual is None else residual.data_ptr() + 4 * a, b - a,
                           sc.data_ptr() + 4 * (off + first), bucket, pos0, float(qmax(s.bits, members)),
                           s.bits == FINE)
        return out
    sc64: torch.Tensor | None = None
    for s, off in zip(segments, _bucket_offsets(segments, bucket)):
        blocks = _blocks(s, bucket, lo, hi)
        if not blocks:
            continue
        qm = float(qmax(s.bits, members))
        fine = s.bits == FINE
        dt = torch.float64 if fine else torch.float32  # the fixed-point qmax needs 53 bits
        if fine and sc64 is None:
            sc64 = sc.to(torch.float64)
        ssc = (sc64 if fine else sc.to(torch.float32))
        assert ssc is not None
        ssc = ssc[off:off + s.n_buckets(bucket)]
        inv_all = torch.where(ssc > 0, 1.0 / ssc, torch.zeros_like(ssc))  # a zero bound: everything -> 0
        # a subnormal scale's inverse overflows to inf, and 0 * inf is NaN: that segment
        # needs the NaN pass even when x is finite (as the C codec always does)
        nan_pass = not finite or not bool(torch.isfinite(inv_all).all())
        size = max(e1 - e0 for e0, e1, _, _ in blocks)
        scratch = torch.empty(size, dtype=dt)
        own = None if residual is None else torch.empty(size, dtype=dt)
        own32 = None if residual is None or not fine else torch.empty(size, dtype=torch.float32)
        for e0, e1, r0, r1 in blocks:
            rows = r1 - r0
            a, b = s.start + e0, s.start + e1
            ss = ssc[r0:r1].view(rows, 1)
            inv = inv_all[r0:r1].view(rows, 1)
            r = scratch[:b - a].view(rows, -1)
            xv = x[a:b].view(rows, -1)
            if xv.dtype == dt:
                torch.mul(xv, inv, out=r)
            else:   # widen (exact) first, then the same-dtype multiply
                r.copy_(xv)
                r.mul_(inv)
            if nan_pass:
                r.nan_to_num_(nan=0.0, posinf=qm, neginf=-qm)
            oo = out[a:b].view(rows, -1)
            oo.copy_(r.clamp_(-qm, qm).round_())
            if residual is not None:
                assert own is not None
                # dequantize's ops on this block (from the int32 q: -0.0 rounds to +0)
                d = own[:b - a].view(rows, -1)
                d.copy_(oo)
                d.mul_(ss)
                if own32 is not None:   # fixed point: the float64 product rounded once
                    d32 = own32[:b - a].view(rows, -1)
                    d32.copy_(d)
                    d = d32
                torch.sub(xv, d, out=residual[a:b].view(rows, -1))
    return out


def dequantize(Q: torch.Tensor, sc: torch.Tensor, segments: list[Segment], bucket: int,
               out: torch.Tensor | None = None, span: tuple[int, int] | None = None,
               divisor: int = 0) -> torch.Tensor:
    """float32 ``fl32(s * Q)`` per bucket (exact product in float64, one rounding);
    ``out`` (float32, flat) may be the caller's tensor: no temporary of its size.
    ``span`` (``(lo, hi)``): only those elements of ``out`` are written (the ring
    dequantizes each piece once it is final); the same bits as the whole call's.
    ``divisor`` (> 0): each value then divided by it in float32 (an AVG's contributor
    count), the bits of a separate ``out.div_(divisor)``."""
    out = torch.empty(Q.numel(), dtype=torch.float32) if out is None else out
    lo, hi = (0, Q.numel()) if span is None else span
    c = qcodec.codec()
    if (c is not None and Q.dtype == torch.int32 and out.dtype == torch.float32 and sc.dtype == torch.float32
            and _cpu_contig(Q, out, sc) and out.numel() >= Q.numel() and _covers(segments, bucket, Q.numel(), sc)):
        for s, off in zip(segments, _bucket_offsets(segments, bucket)):
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                first, pos0 = divmod(a - s.start, bucket)
                c.dequantize(Q.data_ptr() + 4 * a, out.data_ptr() + 4 * a, b - a, sc.data_ptr() + 4 * (off + first),
                             bucket, pos0, s.bits == FINE, divisor)
        return out
    sc64: torch.Tensor | None = None
    for s, off in zip(segments, _bucket_offsets(segments, bucket)):
        blocks = _blocks(s, bucket, lo, hi)
        if not blocks:
            continue
        # |Q| < 2**24 outside fixed point: Q is exact in float32 and one float32 multiply is
        # the correctly rounded exact product; fixed point needs the float64 product
        fine = s.bits == FINE
        if fine and sc64 is None:
            sc64 = sc.to(torch.float64)
        ssc = sc64 if fine else sc.to(torch.float32)
        assert ssc is not None
        ssc = ssc[off:off + s.n_buckets(bucket)]
        wide = torch.empty(max(e1 - e0 for e0, e1, _, _ in blocks), dtype=torch.float64) if fine else None
        for e0, e1, r0, r1 in blocks:
            rows = r1 - r0
            a, b = s.start + e0, s.start + e1
            ss = ssc[r0:r1].view(rows, 1)
            qq, oo = Q[a:b].view(rows, -1), out[a:b].view(rows, -1)
            if wide is None:
                oo.copy_(qq)  # exact (|Q| < 2**24); then one same-dtype multiply
                oo.mul_(ss)
            else:
                w = wide[:b - a].view(rows, -1)
                w.copy_(qq)
                oo.copy_(w.mul_(ss))
            if divisor > 0:
                oo.div_(divisor)
    return out


# -- wire packing ---------------------------------------------------------------------

_INT = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def _cpu_contig(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in ts)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _covers(segments: list[Segment], bucket: int, numel: int, sc: torch.Tensor) -> bool:
    """Whether ``segments`` end inside ``numel`` elements and ``sc`` holds a scale for
    each of their buckets: the C codec reads raw addresses, so a call whose buffers are
    too short takes the torch code instead (which raises on it) rather than reading or
    writing past a tensor's end."""
    return (all(s.end <= numel for s in segments)
            and sc.numel() >= sum(s.n_buckets(bucket) for s in segments))


def _pack_plane(b: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """``out`` (uint8, ``K = ceil(n / per)`` bytes, ``per = 8 // width``) = the low
    ``width`` bits of the ``n`` int8 values ``b``, field ``j`` of byte ``i`` being value
    ``i + j*K`` (zero past the end): ``per`` contiguous runs, a few whole-tensor uint8 ops."""
    per = 8 // width
    n = b.numel()
    K = -(-n // per)
    v = torch.bitwise_and(b.view(torch.uint8), (1 << width) - 1)
    if n < per * K:
        v = torch.cat([v, torch.zeros(per * K - n, dtype=torch.uint8)])
    rows = v.view(per, K)
    r = rows[0].clone()
    for j in range(1, per):
        r.bitwise_or_(rows[j] << (width * j))
    out.copy_(r)


def pack_into(q: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """:func:`pack` of the int32 ``q`` written into ``out`` (uint8 of
    :func:`wire_nbytes` bytes, 4-byte aligned for widths 16 and 32)."""
    if width in (16, 32):
        out.view(_INT[width]).copy_(q)
        return
    c = qcodec.codec()
    if c is not None and q.dtype == torch.int32 and _cpu_contig(q, out) and _nbytes(out) >= wire_nbytes(q.numel(), width):
        c.pack(out.data_ptr(), q.data_ptr(), q.numel(), width)
        return
    if width == 8:
        out.view(torch.int8).copy_(q)
        return
    # under 8 bits every value fits int8: the planes are cut from one int8 copy (4x less
    # memory per pass than int32)
    src = q.to(torch.int8) if width < 8 else q
    off = 0
    for p, shift in planes(width):
        nb = -(-q.numel() * p // 8)
        v = src if shift == 0 else torch.bitwise_right_shift(src, shift)
        if p == 8:   # the low byte of a wider value
            out[off:off + nb].copy_(torch.bitwise_and(v, 255))
        else:   # low planes masked first: the int8 cast then never sees a value out of range
            top = shift + p == width
            _pack_plane((v if top else torch.bitwise_and(v, (1 << p) - 1)).to(torch.int8), p, out[off:off + nb])
        off += nb


def pack(q: torch.Tensor, width: int) -> torch.Tensor:
    """Flat int32 ``q`` as the uint8 wire bytes of ``width`` (see the module's wire
    format: 8, 16, 32: little-endian integers; others: bit planes).

    Whole-tensor ops in the torch code: unlike the float stages, blocking these does not
    pay (int8 shifts are compute-bound; see ``bench/codec.py``)."""
    if width == 32:
        return q.contiguous().view(torch.uint8)
    if width == 16:
        return q.to(torch.int16).view(torch.uint8)
    out = torch.empty(wire_nbytes(q.numel(), width), dtype=torch.uint8)
    pack_into(q, width, out)
    return out


def _unpack_plane(wire: torch.Tensor, count: int, p: int, signed: bool) -> torch.Tensor:
    """The ``count`` fields of one plane of ``p`` bits (int8; sign-extended when ``signed``,
    else the field's value 0 .. 2**p - 1, which fits too for p < 8)."""
    if p == 8:
        return wire[:count].view(torch.int8) if signed else wire[:count]
    per = 8 // p
    K = -(-count // per)
    if signed:   # shift each field to the top of the byte, then arithmetic-shift down
        w = wire[:K].view(torch.int8)
        cols = [(w << (8 - p * (j + 1))) >> (8 - p) for j in range(per)]
    else:
        cols = [(wire[:K] >> (p * j)) & ((1 << p) - 1) for j in range(per)]
    return torch.cat(cols)[:count]


def unpack(wire: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` values of ``wire`` (uint8) as a tensor that adds into int32 (int8 /
    int16 / int32; views without a copy where possible)."""
    if width == 32:
        return wire[:count * 4].view(torch.int32)
    if width == 16:
        return wire[:count * 2].view(torch.int16)
    pl = planes(width)
    if len(pl) == 1:
        return _unpack_plane(wire, count, width, True)
    # under 8 bits the value is put together in int8 (it fits, and int8 passes are 4x
    # cheaper); the fields are disjoint bits and the top one is signed, so adding them
    # shifted is the two's complement value
    dt = torch.int8 if width < 8 else torch.int32
    acc = torch.zeros(count, dtype=dt)
    off = 0
    for j, (p, shift) in enumerate(pl):
        nb = -(-count * p // 8)
        v = _unpack_plane(wire[off:off + nb], count, p, j == len(pl) - 1)
        v = v.view(torch.int8) if dt == torch.int8 and v.dtype == torch.uint8 else v.to(dt)
        acc.add_(v.bitwise_left_shift(shift) if shift else v)
        off += nb
    return acc


def unpack_add(wire: torch.Tensor, count: int, width: int, out: torch.Tensor, addend: torch.Tensor | None = None) -> None:
    """``out`` (int32, ``count`` values) = the values of ``wire`` (+ ``addend``, int32):
    one ring receive."""
    unpack_add_pack(wire, count, width, out, addend)


def unpack_add_pack(wire: torch.Tensor, count: int, width: int, out: torch.Tensor, addend: torch.Tensor | None = None,
                    dst: torch.Tensor | None = None, dst_width: int = 0) -> None:
    """:func:`unpack_add`, then (with ``dst``) ``out`` packed at ``dst_width`` into ``dst``
    (:func:`pack_into`): one reduce-scatter receive and the send it feeds, in one call of
    the C codec (it decodes the range, then encodes it)."""
    c = qcodec.codec()
    if (c is not None and out.dtype == torch.int32 and _cpu_contig(wire, out)
            and (addend is None or (addend.dtype == torch.int32 and _cpu_contig(addend) and addend.numel() >= count))
            and (dst is None or (_cpu_contig(dst) and _nbytes(dst) >= wire_nbytes(count, dst_width)))
            and out.numel() >= count and _nbytes(wire) >= wire_nbytes(count, width)):
        if dst is None:
            c.unpack_add(out.data_ptr(), wire.data_ptr(), count, width, 0 if addend is None else addend.data_ptr())
        else:
            c.unpack_add_pack(out.data_ptr(), wire.data_ptr(), count, width,
                              0 if addend is None else addend.data_ptr(), dst.data_ptr(), dst_width)
        return
    vals = unpack(wire, count, width)
    if addend is not None and vals.dtype == out.dtype:
        torch.add(addend, vals, out=out)
    else:
        out.copy_(vals)  # widen first: torch's mixed-dtype add is several times slower than copy + add
        if addend is not None:
            out.add_(addend)
    if dst is not None:
        pack_into(out, dst_width, dst)
