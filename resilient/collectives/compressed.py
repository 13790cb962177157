"""The exact compressed allreduce: agree scales, quantize once, integer ring, dequantize
once (``docs/compression.md``).

One user call is two collectives with consecutive sequence numbers, reserved together
(a joiner is admitted before or after the pair, never between):

1. *scale*: a float32 MAX allreduce of this member's bucket maxima plus its member count.
   Any contributor set gives a valid bound: a member left out of it (it joined the op
   late in a recovery) has its values clamped to ``±qmax`` — its dequantized input is
   still exactly what the result contains;
2. *ring*: an int32 SUM allreduce of ``q`` over :class:`~.algorithms.quantized_ring.QuantizedRing`
   (packed wire), recovered like any op from its integer ledger.

Contract (what the tests check bitwise): ``out = fl32(sum_{i in C} s * q_i)`` per bucket,
``/ |C|`` for AVG, with ``C = work.contributors`` (the ring's) and ``s * q_i`` member
``i``'s dequantized input; identical on every member. ``Communicator.last_compression``
keeps the scales, this member's ``q`` and the scale op's contributors.

Failure behaviour: as for the uncompressed allreduce (recovery, policies, errors); a
bad :class:`Compression` raises :class:`~resilient.errors.ConfigError` before any
communication.
"""
from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from resilient.collectives.algorithms import RecursiveDoubling, RingReduceScatterAllgather
from resilient.collectives.algorithms.base import Algorithm
from resilient.collectives.algorithms.leaf import LeafPath
from resilient.collectives.group import EpochLike
from resilient.collectives.algorithms.quantized_ring import QuantizedRing
from resilient.collectives.ledger import Ledger, split
from resilient.collectives.ops import result_of
from resilient.collectives.quantization import (
    BITS, FINE, Segment, bucket_maxima, check_segments, clean_maxima, dequantize, quantize, scales,
)
from resilient.collectives.recovery import Policy
from resilient.errors import ConfigError
from resilient.kernels import ReduceOp

if TYPE_CHECKING:
    from resilient.collectives.compression_host import CompressionHost


class _QBuffers:
    """int32 buffers for ``q`` reused across calls (a fresh 64 MiB buffer costs more in
    page faults than quantizing into it). ``q`` outlives its op (``last_compression``,
    ``CompressedResult``, the DDP hook's residual), so a buffer is handed out again only
    when nothing else holds its storage: no ``q``, no view of it, no ledger. Thread-safe
    (several communicators may share a process); at most ``keep`` buffers are kept, each
    of at least 1 MiB. Falls back to plain allocation when torch lacks the use count."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._bufs: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @staticmethod
    def _unshared(buf: torch.Tensor) -> bool:
        # the pool's own tensor and the temporary storage object made here: nobody else
        return bool(_USE_COUNT is not None and _USE_COUNT(buf.untyped_storage()._cdata) == 2)

    def take(self, numel: int) -> torch.Tensor:
        """A flat int32 tensor of ``numel`` elements (contents undefined)."""
        if numel * 4 < (1 << 20) or _USE_COUNT is None:
            return torch.empty(numel, dtype=torch.int32)
        with self._lock:
            for i, b in enumerate(self._bufs):
                if b.numel() == numel and self._unshared(b):
                    self._bufs.append(self._bufs.pop(i))  # most recently used last
                    return b.view(numel)
            fresh = torch.empty(numel, dtype=torch.int32)
            idle = [i for i, b in enumerate(self._bufs) if self._unshared(b)]
            if len(self._bufs) >= self.keep and idle:
                self._bufs.pop(idle[0])  # the least recently used idle one
            if len(self._bufs) < self.keep:
                self._bufs.append(fresh)
            return fresh.view(numel)


#: the storage use count (private torch API, present in the torch this project pins)
_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_Q_BUFFERS = _QBuffers()
#: scale agreements up to this size run recursive doubling whatever the communicator's
#: ``small_bytes`` (the DDP hook's 128-element buckets give 128 KiB of maxima per 16 MiB)
SCALE_RD_BYTES = 1 << 20


@dataclass(frozen=True)
class Compression:
    """``bits`` (2, 4, 8) per element, one scale per ``bucket`` elements. A tensor with
    fewer than ``min_numel`` elements or at most one dimension stays uncompressed (a plain
    allreduce), unless explicit ``segments`` (``(start, end, bits)``, bits 32 = uncompressed
    fixed point) give the layout of a flat buffer, as the DDP hook does."""

    bits: int = 4
    bucket: int = 1024
    min_numel: int = 4096
    segments: tuple[tuple[int, int, int], ...] | None = None
    auto: bool = False  #: let the measured-link switch choose between this and fp32 per call
    #: error feedback's buffer (flat float32, the input's size, not overlapping it): the
    #: op also writes ``x - s*q_own`` there as it quantizes, before the ring
    #: (``info["residual"]`` is the buffer when it did); not part of the op's identity.
    #: If the op then fails, the buffer holds that op's values and the caller drops them
    residual: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    #: the op's input when it is not the tensor's own values (the DDP hook's staged
    #: ``grad + e``): the op reads it and writes the result into the tensor, one copy less.
    #: Same shape and dtype as the tensor, not overlapping it, left as it is. Where the
    #: call runs uncompressed or off the CPU it is first copied into the tensor
    #: (:meth:`stage_source`); not part of the op's identity
    source: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.bits not in BITS or self.bits == FINE:
            raise ConfigError(f"compression bits must be 2, 4 or 8, got {self.bits!r}")
        if self.bucket < 1:
            raise ConfigError(f"compression bucket must be >= 1 element, got {self.bucket!r}")

    @classmethod
    def parse(cls, value: Any) -> "Compression | None":
        """``None`` / ``"none"`` / ``"fp32"`` -> no compression; ``"q8"``, ``"q4"``,
        ``"q2"`` or an int -> that many bits; ``"auto"`` -> 4 bits where the switch
        predicts a gain (:mod:`.compression_switch`); a Compression -> itself."""
        if value is None or isinstance(value, Compression):
            return value
        if isinstance(value, str):
            v = value.strip().lower()
            if v in ("none", "fp32", "off", ""):
                return None
            if v == "auto":
                return cls(auto=True)
            if v.startswith("q") and v[1:].isdigit():
                return cls(bits=int(v[1:]))
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(bits=value)
        raise ConfigError(f"compression {value!r}: use None, 'q8', 'q4', 'q2', 'auto', an int or a Compression")

    def source_for(self, t: torch.Tensor) -> torch.Tensor | None:
        """:attr:`source` when the op can read it in place of ``t`` (flat CPU memory of
        ``t``'s dtype and size), else None (raises ConfigError for a source of another
        shape or dtype)."""
        src = self.source
        if src is None:
            return None
        if src.shape != t.shape or src.dtype != t.dtype:
            raise ConfigError(f"compression source {tuple(src.shape)} {src.dtype} for a tensor "
                              f"{tuple(t.shape)} {t.dtype}")
        ok = src.device.type == "cpu" and t.device.type == "cpu" and src.is_contiguous()
        return src if ok else None

    def stage_source(self, t: torch.Tensor) -> "Compression":
        """This compression with its :attr:`source` copied into ``t`` (an op that reads
        ``t`` itself: uncompressed, or staged off the CPU); itself when there is none."""
        if self.source is None:
            return self
        with torch.no_grad():
            t.copy_(self.source)
        return replace(self, source=None)

    def layout(self, t: torch.Tensor) -> list[Segment] | None:
        """The segments for ``t``, or None when it stays uncompressed."""
        if self.segments is not None:
            segs = [Segment(int(a), int(b), int(k)) for a, b, k in self.segments]
            check_segments(segs, t.numel())
            return segs if any(s.bits != FINE for s in segs) else None
        if t.dim() <= 1 or t.numel() < self.min_numel:
            return None
        return [Segment(0, t.numel(), self.bits)]


#: a piece's parts: ``(start, end, bits)`` relative to the piece, in order, tiling it
Parts = tuple[tuple[int, int, int], ...]


def _cost_cuts(segs: list[Segment], targets: list[int]) -> list[int]:
    """Element indices where the cumulative wire cost (``bits`` per element) first reaches
    each of the increasing ``targets``."""
    out, ti, cost = [], 0, 0
    for s in segs:
        seg_cost = s.numel * s.bits
        while ti < len(targets) and targets[ti] <= cost + seg_cost:
            out.append(s.start + -(-(targets[ti] - cost) // s.bits))
            ti += 1
        cost += seg_cost
    return out + [segs[-1].end] * (len(targets) - len(out))


def piece_parts(segs: list[Segment], a: int, b: int) -> Parts:
    """The segments of ``[a, b)``, relative to ``a``."""
    return tuple((max(a, s.start) - a, min(b, s.end) - a, s.bits) for s in segs if s.start < b and s.end > a)


def ring_layout(segs: list[Segment], n: int, slices_of: Any) -> tuple[list[tuple[int, int]], list[Parts], int]:
    """Chunk-major pieces over ``n`` members: the flat buffer cut into ``n`` contiguous
    chunks of equal wire cost (elements weighted by their bits), each chunk into the same
    number of pipelining slices (``slices_of`` its float32 bytes, the largest chunk's), again
    of equal cost. A piece may span several segments: its wire is the concatenation of each
    part packed at its own width (:class:`~.algorithms.quantized_ring.QuantizedRing`), so a
    layout of many small segments (the DDP hook's biases between weight matrices) still
    sends ``S`` messages per chunk, not one per segment. Returns (pieces, parts per piece,
    pieces per chunk)."""
    total = sum(s.numel * s.bits for s in segs)
    bounds = [segs[0].start] + _cost_cuts(segs, [total * c // n for c in range(1, n)]) + [segs[-1].end]
    S = max(slices_of(max(1, (bounds[c + 1] - bounds[c]) * 4)) for c in range(n))
    pieces: list[tuple[int, int]] = []
    for c in range(n):
        c0, c1 = bounds[c], bounds[c + 1]
        inner = [x for x in segs if x.start < c1 and x.end > c0]
        if not inner:
            pieces += [(c0, c0)] * S
            continue
        clipped = [Segment(max(c0, x.start), min(c1, x.end), x.bits) for x in inner]
        cost0 = sum(x.numel * x.bits for x in clipped)
        cuts = [c0] + _cost_cuts(clipped, [cost0 * j // S for j in range(1, S)]) + [c1]
        pieces += [(cuts[j], cuts[j + 1]) for j in range(S)]
    return pieces, [piece_parts(segs, a, b) for a, b in pieces], S


#: the integer ring's wire format (quantization.py: tight widths as bit planes); in the
#: ops' descriptors, so members of releases with another format meet with different
#: digests and raise InputMismatch instead of misreading each other's bytes. The C codec
#: and the torch code write this same format.
WIRE_FORMAT = "planes-1"


def _layout_digest(comp: Compression, segs: list[Segment]) -> int:
    return zlib.crc32(json.dumps([comp.bucket, [(s.start, s.end, s.bits) for s in segs], WIRE_FORMAT]).encode())


def run_compressed(comm: CompressionHost, t: torch.Tensor, op: ReduceOp, comp: Compression, segs: list[Segment],
                   policy: Policy | str | None, seqs: tuple[int, int] | None = None) -> Any:
    """The op body (on the communicator's op thread); returns the ring's result as a
    :class:`CompressedResult`. ``seqs``: pre-reserved (scale, ring) sequence numbers
    (the automatic switch reserves them with its vote); else two are reserved here."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ConfigError(f"a compressed allreduce supports sum and avg, not {op.value}")
    if not t.is_floating_point():
        raise ConfigError(f"a compressed allreduce needs a floating-point tensor, got {t.dtype}")
    x = t.detach().reshape(-1)   # the result goes here
    src = comp.source_for(t)
    if src is None:
        comp = comp.stage_source(t)
    xin = x if src is None else src.detach().reshape(-1)   # the input is read from here
    numel, bucket = x.numel(), comp.bucket
    lay = _layout_digest(comp, segs)
    maxima, finite = clean_maxima(bucket_maxima(xin, segs, bucket))
    scale_in = torch.cat([maxima, torch.tensor([float(comm.size)])])
    desc_s = {"k": "allreduce", "shape": [scale_in.numel()], "dtype": "torch.float32", "op": "max",
              "q": "scale", "layout": lay}
    # the scale op is latency-bound (a few hundred KiB at most): recursive doubling's
    # log2(n) rounds, not the ring's 2(n-1) dependent steps
    rd = replace(comm.sizing, small_bytes=max(comm.sizing.small_bytes, SCALE_RD_BYTES))
    if seqs is None:
        res_s = comm.reduce_now(scale_in, ReduceOp.MAX, desc_s, policy, reserve=2, sizing=rd)
        assert comm.retained is not None   # the op just finished
        ring_seq = comm.retained.seq + 1
    else:
        res_s = comm.reduce_now(scale_in, ReduceOp.MAX, desc_s, policy, seq=seqs[0], sizing=rd)
        ring_seq = seqs[1]
    n_bound = max(1, int(scale_in[-1].item()))
    sc = scales(scale_in[:-1], segs, bucket, n_bound)
    rbuf = comp.residual
    if rbuf is not None and not (x.dtype == torch.float32 and rbuf.dtype == torch.float32 and rbuf.is_contiguous()
                                 and rbuf.numel() == numel):
        rbuf = None   # not a buffer this op can fill: the caller dequantizes its own input
    q = _Q_BUFFERS.take(numel)
    lazy = _LazyInput(numel, lambda span: quantize(xin, sc, segs, bucket, n_bound, out=q, finite=finite,
                                            residual=None if rbuf is None else rbuf.view(-1), span=span))
    nbytes = numel * 4
    # straight into the caller's tensor when it is flat float32 memory (no temporary, no copy)
    direct = t.dtype == torch.float32 and t.is_contiguous()
    early = _Early()   # pieces the ring dequantized into x as they became final

    def build(members: list[str], me: int, seq: int, digest: int) -> tuple[Ledger, Any]:
        n = len(members)
        leaf = LeafPath.for_epoch(members, comm.epoch)
        nr = leaf.ring_size if leaf else n
        algo: Any
        ring = leaf is None and n > 1 and numel >= n and nbytes > comm.sizing.small_bytes
        if not (ring and lazy.fresh):
            lazy.complete()   # a rerun or another algorithm: q whole before the ledger
        if ring:
            pieces, parts, per_chunk = ring_layout(segs, n, comm.sizing.slices)
            early.ledger = None
            algo = QuantizedRing(parts, per_chunk, n_bound, on_final=early.final if direct else None)
        elif comm.sizing.ring_or_rd(nbytes, nr) and numel >= nr:  # leaf path: exact int32 ring, full width
            S = comm.sizing.slices_for(nbytes, nr)
            pieces = [(s0 + a, s0 + b) for (s0, e0) in split(numel, nr) for (a, b) in split(e0 - s0, S)]
            algo = RingReduceScatterAllgather(S)
        else:
            pieces, algo = [(0, numel)], RecursiveDoubling()
        if leaf:
            algo = leaf.wrap(algo)
        L = Ledger(seq, "allreduce", tuple(members), me, comm.epoch.number, digest, q,
                   comm.take_buffer(numel, torch.int32), pieces)
        if not lazy.done:
            L.fill_input = lazy.bind(pieces)
        if isinstance(algo, QuantizedRing) and algo.on_final is not None:
            # an AVG's division too: early pieces are kept only when the ring ran to its
            # end, and then every piece's sum is over all n members
            div = n if op is ReduceOp.AVG else 0
            early.bind(L, algo, lambda span: dequantize(L.out, sc, segs, bucket, out=x, span=span, divisor=div))
        return L, algo

    desc_r = {"k": "allreduce", "shape": [numel], "dtype": "torch.int32", "op": "sum", "q": "ring", "layout": lay}
    L = comm.run_op(desc_r, _Layout(build), policy=policy, seq=ring_seq)
    lazy.complete()   # q outlives the op (last_compression, the DDP hook's residual)
    L.fill_input = None
    r = result_of(L)
    masks = L.need or [L.full] * len(L.pieces)

    def divisor(p: int) -> int:   # an AVG's divisor of piece p: its contributors
        return bin(masks[p]).count("1") if op is ReduceOp.AVG else 0

    if direct and early.clean(L):
        res = x   # the pieces the ring did not dequantize as it went (none, normally)
        for p in early.missing():
            dequantize(L.out, sc, segs, bucket, out=x, span=L.pieces[p], divisor=divisor(p))
    else:   # after a recovery every piece again, from the final sums
        res = dequantize(L.out, sc, segs, bucket, out=x if direct else None)
        for p in range(len(L.pieces)) if op is ReduceOp.AVG else ():
            a, b = L.pieces[p]
            res[a:b].div_(divisor(p))
    early.release()   # the ring and early refer to each other: free the ledger (and q) now, not at a gc
    if not direct:
        t.copy_(res.view(t.shape))
    info = {"seq": L.seq, "scales": sc, "q": q, "scale_contributors": tuple(res_s.contributors),
            "members_bound": n_bound, "segments": segs, "bucket": bucket, "residual": rbuf}
    comm.last_compression = info
    return CompressedResult(r.contributors, r.piece_contributors, r.recovered, info)


def _nothing(span: tuple[int, int]) -> None:
    return None


class _LazyInput:
    """This call's ``q``, written piece by piece as the ring first reads each piece
    (:attr:`.Ledger.fill_input`): the first sends leave after one piece is quantized,
    the rest is quantized while they are on the wire. ``write(span)`` quantizes one
    element range. Bound to the first ledger's pieces only; :meth:`complete` writes
    whatever is left (before a rerun's ledger, a recovery, the caller's use of ``q``)."""

    def __init__(self, numel: int, write: Callable[[tuple[int, int]], object]) -> None:
        self.numel, self.write = numel, write
        self.pieces: list[tuple[int, int]] | None = None
        self.written: list[bool] = []
        self.done = False

    @property
    def fresh(self) -> bool:
        """Not bound to a ledger yet (the op's first layout)."""
        return self.pieces is None and not self.done

    def bind(self, pieces: list[tuple[int, int]]) -> Callable[[int], None]:
        self.pieces, self.written = pieces, [False] * len(pieces)
        return self.fill

    def fill(self, p: int) -> None:
        if not self.written[p]:
            self.written[p] = True
            a, b = self.pieces[p] if self.pieces is not None else (0, 0)
            if b > a:
                self.write((a, b))

    def complete(self) -> None:
        if self.done:
            return
        if self.pieces is None:
            self.write((0, self.numel))
        else:
            for p in range(len(self.pieces)):
                self.fill(p)
        self.done = True
        # drop the closure over q, x and the residual: a retained ledger keeps its
        # fill_input, and a held q would stop _Q_BUFFERS from reusing the buffer
        self.write = _nothing


class _Early:
    """Pieces of one ring ledger already dequantized into the caller's tensor."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None
        self.ring: QuantizedRing | None = None
        self.written: list[bool] = []
        self.write: Callable[[tuple[int, int]], object] | None = None

    def bind(self, L: Ledger, ring: QuantizedRing, write: Callable[[tuple[int, int]], object]) -> None:
        self.ledger, self.ring, self.written, self.write = L, ring, [False] * len(L.pieces), write

    def clean(self, L: Ledger) -> bool:
        """Whether ``L`` is this ring's ledger and the ring ran to its end: no recovery
        changed a sum after it was dequantized (else every piece is dequantized again)."""
        return self.ledger is L and self.ring is not None and self.ring.finished

    def release(self) -> None:
        self.ledger = self.ring = self.write = None

    def final(self, p: int) -> None:
        L = self.ledger
        if L is not None and self.write is not None and not self.written[p]:
            self.written[p] = True
            a, b = L.pieces[p]
            if b > a:
                self.write((a, b))

    def missing(self) -> list[int]:
        return [p for p, w in enumerate(self.written) if not w]


class _Layout:
    """An :class:`~.ops.OpSpec` over a layout function of the op's members."""

    def __init__(self, build: Callable[[list[str], int, int, int], tuple[Ledger, Algorithm]]) -> None:
        self.build = build

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]:
        return self.build(members, me, seq, digest)


@dataclass(frozen=True)
class CompressedResult:
    """What ``Work.result()`` holds for a compressed op: the ring's contributor sets and
    ``compression`` (scales, this member's ``q``, scale contributors, layout) — what error
    feedback needs to know this member's dequantized input."""

    contributors: tuple[str, ...]
    piece_contributors: list[tuple[str, ...]] | None = None
    recovered: bool = False
    compression: dict[str, Any] | None = None

    def dequantized_input(self) -> torch.Tensor:
        """``s * q`` of this member (float32, flat)."""
        c = self.compression
        if c is None:
            raise ValueError("this result has no compression record (the op ran uncompressed)")
        return dequantize(c["q"], c["scales"], c["segments"], c["bucket"])
