"""The automatic compression switch: compress only where the measured link predicts a gain
(``docs/compression.md``).

Every member measures, per size class, the seconds each arm took on its recent calls,
and its link (bytes it sent / seconds of its fp32 calls) for a model prediction
``t_fp32 / t_q`` with ``t = W / B (+ codec)``, ``W`` the bytes a member sends in the ring
(:func:`ring_wire_bytes`) and the codec timed once on 1 Mi floats. The model only
decides whether the compressed arm is worth a first probe; after that measured times
decide (a model cannot see how loaded the CPUs are). Members measure different things,
and a decision that differs between members would desynchronise them, so the decision
is **agreed**: a 3-float MAX allreduce of ``[need fp32 probe, need compressed probe,
-speedup]`` (any probe request wins, then the slowest member's speedup). The agreed
decision is kept as a :class:`Plan` per size class and followed **without a vote** for
``revote_every`` calls (after a probe: for none), so in the steady state a call is the
chosen op alone. Whether a call votes depends only on what every member has alike: the
plan, and the op sequence number of the newest admission (a joiner has no plan, so at
the first call after an admission every member votes). A member that nevertheless voted
where another did not meets it at the same op number with a different descriptor: both
raise :class:`~resilient.errors.InputMismatch`, never a wrong result.
The chosen arm is logged when it changes and counted in
``resilient_compression_decisions_total{choice}``.

One call takes three sequence numbers, reserved together (a joiner is admitted before or
after them): with a vote, vote then the op (scale agreement + integer ring, or the plain
fp32 allreduce); without one, the op from the first number (the rest stay unused).

:func:`compressed_body` is where ``Communicator.allreduce(..., compression=...)`` turns its
argument into an op body: this switch, the fixed codec of :mod:`.compressed`, or none.

Failure behaviour: the vote is an ordinary collective (recovered like any); a member that
dies in it leaves the survivors' agreed decision intact; a member that dies between votes
leaves the survivors' plans identical. Measurement never raises; ``revote_every`` < 1
raises ConfigError.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from resilient.collectives.compressed import Compression, run_compressed
from resilient.collectives.recovery import Policy
from resilient.collectives.quantization import Segment, bucket_maxima, dequantize, pack, quantize, scales, unpack, wire_bits
from resilient.device.whole import WholeStaging, needs_staging
from resilient.errors import ConfigError
from resilient.kernels import ReduceOp

if TYPE_CHECKING:
    from resilient.collectives.compression_host import CompressionHost

log = logging.getLogger(__name__)


def ring_wire_bytes(nbytes: int, n: int, bits: int | None) -> float:
    """Bytes one member sends in a ring allreduce of ``nbytes`` of float32 (``bits`` None:
    uncompressed; else the integer ring's widths)."""
    if n <= 1:
        return 0.0
    elems = nbytes / 4 / n  # per chunk
    if bits is None:
        return 2 * (n - 1) * elems * 4
    rs = sum(wire_bits(bits, s + 1) for s in range(n - 1))
    ag = (n - 1) * wire_bits(bits, n)
    return elems * (rs + ag) / 8


def measure_codec(bits: int, bucket: int, numel: int = 1 << 20) -> tuple[float, float]:
    """Seconds per float32 byte of (quantize + dequantize) and of one ring step's
    (unpack + add + pack), timed on this machine."""
    x = torch.randn(numel)
    segs = [Segment(0, numel, bits)]
    t0 = time.perf_counter()
    sc = scales(bucket_maxima(x, segs, bucket), segs, bucket, 1)
    q = quantize(x, sc, segs, bucket, 1)
    dequantize(q, sc, segs, bucket)
    t1 = time.perf_counter()
    w = wire_bits(bits, 2)
    acc = q + unpack(pack(q, bits), numel, bits)
    pack(acc, w)
    t2 = time.perf_counter()
    return (t1 - t0) / (4 * numel), (t2 - t1) / (4 * numel)


@dataclass
class Plan:
    """An agreed decision for one (size class, bits): the arm ``choice`` decided by the
    vote at op ``voted_at``, followed without a vote for ``calls_left`` more calls.
    Identical on every member that took part in the vote (it is a function of the vote's
    result and of this switch's configuration only)."""

    choice: str
    voted_at: int
    calls_left: int


class CompressionSwitch:
    """Per-communicator state of the switch (see the module docstring).

    Per size class (``nbytes.bit_length()``) it keeps the measured seconds of each arm
    (moving average). Before both arms are measured it probes: fp32 first (that also
    measures the link), then the compressed arm unless the link model predicts a clear
    loss (speedup below ``skip_below``); after that the measured faster arm runs, the
    compressed one only if it beats fp32 by ``margin``, and an arm not measured for
    ``probe_every`` calls is measured again. Every member votes; the vote is MAX-agreed.

    A vote is held only when :meth:`needs_vote` says so: the first call of a size class,
    the call after a probe, every ``revote_every`` calls, and the first call after an
    admission (a member that joins has no plan, so every member votes again there).
    In between, every member follows its :class:`Plan`, which is identical on all."""

    def __init__(self, margin: float = 1.05, probe_every: int = 200, skip_below: float = 0.7,
                 revote_every: int = 64, codec_s_per_byte: dict[int, tuple[float, float]] | None = None) -> None:
        if revote_every < 1:
            raise ConfigError(f"revote_every must be >= 1 call, got {revote_every!r}")
        self.margin, self.probe_every, self.skip_below = margin, probe_every, skip_below
        self.revote_every = revote_every
        self._codec = codec_s_per_byte
        self.link_bytes_per_s: float | None = None
        self.measured: dict[tuple[int, str], float] = {}  # (size class, arm) -> seconds
        self._measured_at: dict[tuple[int, str], int] = {}  # (size class, arm) -> call count when measured
        self._calls: dict[int, int] = {}
        self.plans: dict[tuple[int, int], Plan] = {}  # (size class, bits) -> the agreed plan
        self.votes = 0  #: votes held (each one small MAX allreduce)
        self.last_choice: str | None = None
        self.last_speedup: float | None = None

    def codec_seconds(self, nbytes: int, n: int, bits: int) -> float:
        if self._codec is None:
            self._codec = {}
        if bits not in self._codec:
            self._codec[bits] = measure_codec(bits, 1024)
        a, b = self._codec[bits]
        return nbytes * (a + b * 2 * (n - 1) / max(1, n))

    def predicted_speedup(self, nbytes: int, n: int, bits: int) -> float:
        """Link-model prediction of t_fp32 / t_compressed; 0 without a link estimate yet."""
        B = self.link_bytes_per_s
        if not B or n <= 1:
            return 0.0
        t32 = ring_wire_bytes(nbytes, n, None) / B
        tq = ring_wire_bytes(nbytes, n, bits) / B + self.codec_seconds(nbytes, n, bits)
        return t32 / tq

    def needs_vote(self, nbytes: int, bits: int, admitted_at: int) -> bool:
        """Whether the call must start with a vote. Its inputs are the same on every member
        of the group: the plan (agreed), and ``admitted_at`` (the op sequence number of
        the newest admission, :attr:`Communicator.admitted_at`)."""
        p = self.plans.get((nbytes.bit_length(), bits))
        return p is None or p.calls_left <= 0 or p.voted_at < admitted_at

    def follow(self, nbytes: int, bits: int) -> str:
        """A call without a vote: the plan's arm (raises KeyError without a plan — call
        :meth:`needs_vote` first)."""
        c = nbytes.bit_length()
        p = self.plans[(c, bits)]
        p.calls_left -= 1
        self._calls[c] = self._calls.get(c, 0) + 1
        self.last_choice = p.choice
        return p.choice

    def _stale(self, c: int, arm: str) -> bool:
        at = self._measured_at.get((c, arm))
        return at is None or self._calls.get(c, 0) - at >= self.probe_every

    def vote(self, nbytes: int, n: int, bits: int) -> torch.Tensor:
        """``[need fp32 probe, need compressed probe, -speedup]`` (MAX-agreed)."""
        c = nbytes.bit_length()
        q = f"q{bits}"
        t32, tq = self.measured.get((c, "fp32")), self.measured.get((c, q))
        plan = self.plans.get((c, bits))
        current = plan.choice if plan is not None else None
        need32 = t32 is None or (current != "fp32" and self._stale(c, "fp32"))
        needq = not need32 and (tq is None or (current == "fp32" and self._stale(c, q))) \
            and self.predicted_speedup(nbytes, n, bits) >= self.skip_below
        speedup = t32 / tq if (t32 and tq) else self.predicted_speedup(nbytes, n, bits)
        return torch.tensor([float(need32), float(needq), -speedup], dtype=torch.float32)

    def decide(self, agreed: torch.Tensor, bits: int, nbytes: int = 0, seq: int = 0) -> str:
        """The arm from an agreed vote (the same on every member), kept as the size class's
        plan: for one call after a probe, else for ``revote_every`` calls. ``seq``: the
        vote's op sequence number."""
        need32, needq, speedup = float(agreed[0]) > 0, float(agreed[1]) > 0, -float(agreed[2])
        q = f"q{bits}"
        probe = need32 or needq
        choice = "fp32" if need32 else q if needq else (q if speedup > self.margin else "fp32")
        if choice != self.last_choice:
            log.info("compression switch: %s (agreed speedup %.2f%s)", choice, speedup, ", probe" if probe else "")
        self.last_choice, self.last_speedup = choice, speedup
        c = nbytes.bit_length()
        self._calls[c] = self._calls.get(c, 0) + 1
        self.plans[(c, bits)] = Plan(choice, seq, 0 if probe else self.revote_every - 1)
        self.votes += 1
        return choice

    def observe(self, choice: str, nbytes: int, n: int, sent: int, seconds: float) -> None:
        """Record one finished op: its time per arm, and (fp32) the link estimate."""
        c = nbytes.bit_length()
        key = (c, choice)
        old = self.measured.get(key)
        self.measured[key] = seconds if old is None else 0.5 * (old + seconds)
        self._measured_at[key] = self._calls.get(c, 0)
        if choice == "fp32" and sent > 0 and seconds > 0:
            B = sent / seconds
            self.link_bytes_per_s = B if self.link_bytes_per_s is None else 0.5 * (self.link_bytes_per_s + B)


def switch_for(comm: CompressionHost) -> CompressionSwitch:
    """The communicator's switch (``comm.compression_switch``; created with defaults)."""
    sw = comm.compression_switch
    if not isinstance(sw, CompressionSwitch):
        sw = comm.compression_switch = CompressionSwitch()
    return sw


def run_auto(comm: CompressionHost, t: torch.Tensor, op: ReduceOp, comp: Compression, segs: list[Segment], policy: Any) -> Any:
    """The op body of ``allreduce(..., compression=Compression(auto=True))`` (op thread):
    three sequence numbers ``k, k+1, k+2`` taken at once; with a vote (:meth:`CompressionSwitch.needs_vote`)
    the vote runs at ``k`` and the op at ``k+1`` (+ ``k+2``), without one the op runs at
    ``k`` (+ ``k+1``). A member that voted where another did not therefore meets it at
    op ``k`` with a different descriptor: both get ``InputMismatch`` (never a wrong result)."""
    sw = switch_for(comm)
    desc = {"k": "allreduce", "shape": list(t.shape), "dtype": str(t.dtype), "op": op.value}
    if not t.is_floating_point() or op not in (ReduceOp.SUM, ReduceOp.AVG):
        comp.stage_source(t)
        return comm.reduce_now(t, op, desc, policy)  # never compressed: no vote
    nbytes, n = t.numel() * t.element_size(), comm.size
    k = comm.reserve_seqs(3)   # adopts a growing epoch here, so admitted_at is the group's
    if sw.needs_vote(nbytes, comp.bits, comm.admitted_at):
        vote = sw.vote(nbytes, n, comp.bits)
        comm.reduce_now(vote, ReduceOp.MAX, {"k": "allreduce", "shape": [3], "dtype": "torch.float32", "op": "max",
                                          "q": "vote"}, policy, seq=k)
        choice, k = sw.decide(vote, comp.bits, nbytes, k), k + 1
    else:
        choice = sw.follow(nbytes, comp.bits)
    comm.metrics.compression_decision(choice)
    sent0, t0 = comm.transport.stats.bytes_sent, time.monotonic()
    if choice == "fp32":
        comp.stage_source(t)   # the plain op reads t itself
        res = comm.reduce_now(t, op, desc, policy, seq=k)
    else:
        res = run_compressed(comm, t, op, comp, segs, policy, seqs=(k, k + 1))
    sw.observe(choice, nbytes, n, comm.transport.stats.bytes_sent - sent0, time.monotonic() - t0)
    return res


def compressed_body(comm: CompressionHost, t: torch.Tensor, op: ReduceOp, compression: Any,
                    policy: Policy | str | None) -> Callable[[], Any] | None:
    """The op body of ``comm.allreduce(t, op, compression=compression)``: the fixed codec
    (:func:`.compressed.run_compressed`) or this switch (:func:`run_auto`); None when the
    call runs exact (no compression, or a layout that leaves ``t`` uncompressed). A tensor off the
    CPU is staged whole through host memory (:mod:`resilient.device.whole`); a bad
    ``compression`` raises ConfigError (before any communication)."""
    comp = Compression.parse(compression)
    if comp is None:
        return None
    segs = comp.layout(t)
    if segs is None:
        comp.stage_source(t)   # the exact op reads t itself
        return None
    body = run_auto if comp.auto else run_compressed
    st = WholeStaging(comm.sizing.staging)   # the codec runs on the CPU: CUDA tensors via the host
    if needs_staging(t, comm.sizing.staging):
        comp = comp.stage_source(t)   # staged through the host: the codec reads t's host copy
    h = st.host(t, output=True)
    return st.run(lambda: body(comm, h, op, comp, segs, policy))
