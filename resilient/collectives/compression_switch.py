"""The automatic compression switch: compress only where the measured link predicts a gain
(``docs/compression.md``).

Every member keeps its own measurements — the wire throughput of its last allreduces
(bytes it sent / seconds, the codec's share taken out) and its codec speed (timed once on
1 Mi floats) — and predicts the speedup of the compressed ring over the fp32 ring for the
op at hand: ``t_fp32 = W_fp32 / B``, ``t_q = W_q / B + codec(nbytes)`` with ``W`` the bytes
a member sends in the ring (:func:`ring_wire_bytes`). Members measure different things,
and a decision that differs between members would desynchronise them, so the decision is
**agreed**: a 2-float MAX allreduce of ``[-speedup, probe]`` precedes the op (the slowest
prediction wins; any member may ask for an fp32 *probe* to refresh its link estimate,
every ``probe_every`` calls, and before it has any estimate). The chosen arm is logged
when it changes and counted in ``resilient_compression_decisions_total{choice}``.

One call takes three sequence numbers, reserved together: vote, then either the scale
agreement + integer ring, or the plain fp32 allreduce (the third number stays unused).

Failure behaviour: the vote is an ordinary collective (recovered like any); a member that
dies in it leaves the survivors' agreed decision intact. Measurement never raises.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from resilient.collectives.compressed import Compression, run_compressed
from resilient.collectives.quantization import Segment, bucket_maxima, dequantize, pack, quantize, scales, unpack, wire_bits
from resilient.kernels import ReduceOp

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


class CompressionSwitch:
    """Per-communicator state of the switch (see the module docstring). ``bits``/``bucket``:
    the compressed arm; ``margin``: the predicted speedup it must beat."""

    def __init__(self, margin: float = 1.15, probe_every: int = 50,
                 codec_s_per_byte: dict[int, tuple[float, float]] | None = None) -> None:
        self.margin, self.probe_every = margin, probe_every
        self._codec = codec_s_per_byte
        self.link_bytes_per_s: float | None = None
        self._since_probe = 0
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
        """Predicted t_fp32 / t_compressed; 0 without a link estimate yet."""
        B = self.link_bytes_per_s
        if not B or n <= 1:
            return 0.0
        t32 = ring_wire_bytes(nbytes, n, None) / B
        tq = ring_wire_bytes(nbytes, n, bits) / B + self.codec_seconds(nbytes, n, bits)
        return t32 / tq

    def vote(self, nbytes: int, n: int, bits: int) -> torch.Tensor:
        probe = self.link_bytes_per_s is None or self._since_probe >= self.probe_every
        return torch.tensor([-self.predicted_speedup(nbytes, n, bits), 1.0 if probe else 0.0], dtype=torch.float32)

    def decide(self, agreed: torch.Tensor, bits: int) -> str:
        speedup, probe = -float(agreed[0]), float(agreed[1]) > 0
        choice = f"q{bits}" if not probe and speedup > self.margin else "fp32"
        if choice != self.last_choice:
            log.info("compression switch: %s (agreed predicted speedup %.2f%s)", choice, speedup,
                     ", fp32 probe" if probe else "")
        self.last_choice, self.last_speedup = choice, speedup
        return choice

    def observe(self, choice: str, nbytes: int, n: int, sent: int, seconds: float) -> None:
        """Update the link estimate from one finished op (``sent``: bytes this member sent)."""
        if choice == "fp32":
            self._since_probe = 0
            wire_s = seconds
        else:
            self._since_probe += 1
            wire_s = seconds - self.codec_seconds(nbytes, n, int(choice[1:]))
        if sent <= 0 or wire_s <= 0:
            return
        B = sent / wire_s
        self.link_bytes_per_s = B if self.link_bytes_per_s is None else 0.5 * (self.link_bytes_per_s + B)


def switch_for(comm: Any) -> CompressionSwitch:
    """The communicator's switch (``comm.compression_switch``; created with defaults)."""
    sw = comm.__dict__.get("compression_switch")
    if sw is None:
        sw = comm.__dict__["compression_switch"] = CompressionSwitch()
    return sw


def run_auto(comm: Any, t: torch.Tensor, op: ReduceOp, comp: Compression, segs: list[Segment], policy: Any) -> Any:
    """The op body of ``allreduce(..., compression=Compression(auto=True))`` (op thread):
    vote, then ``comp`` or fp32."""
    sw = switch_for(comm)
    desc = {"k": "allreduce", "shape": list(t.shape), "dtype": str(t.dtype), "op": op.value}
    if not t.is_floating_point() or op not in (ReduceOp.SUM, ReduceOp.AVG):
        return comm._reduce(t, op, desc, policy)  # never compressed: no vote
    nbytes, n = t.numel() * t.element_size(), comm.size
    vote = sw.vote(nbytes, n, comp.bits)
    comm._reduce(vote, ReduceOp.MAX, {"k": "allreduce", "shape": [2], "dtype": "torch.float32", "op": "max",
                                      "q": "vote"}, policy, reserve=3)
    k = comm._retained.seq
    choice = sw.decide(vote, comp.bits)
    if comm._metrics is not None:
        try:
            comm._metrics.record_compression_decision(choice)
        except Exception as exc:  # noqa: BLE001 - metrics never fail an op
            log.debug("metrics: %s", exc)
    sent0, t0 = comm.transport.stats.bytes_sent, time.monotonic()
    if choice == "fp32":
        res = comm._reduce(t, op, desc, policy, seq=k + 1)
    else:
        res = run_compressed(comm, t, op, comp, segs, policy, seqs=(k + 1, k + 2))
    sw.observe(choice, nbytes, n, comm.transport.stats.bytes_sent - sent0, time.monotonic() - t0)
    return res
