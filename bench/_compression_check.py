"""What every resilient output of bench/compression.py must equal, bitwise.

One responsibility: given each member's input (a function of its id), say whether an
allreduce output is exactly what its contract makes it.

* **fp32** (the float ring, ``algorithms/ring.py``): chunk ``c`` of the ``n`` chunks
  (``split(numel, n)``) is summed along the ring from ``members[c]`` in the op's ring
  order (the ledger's ``members``): ``((x_c + x_{c+1}) + ...) + x_{c+n-1}``; the
  all-gather copies. That fixed order is what makes the float result bitwise identical
  on every member, so the check recomputes it. Only a fault-free ring over every member
  can be recomputed this way: another layout, or fewer contributors, counts as a failure.
* **compressed** (``docs/compression.md``): ``fl32(sum_{i in C} s * q_i)`` with
  ``C = work.contributors``; the scales ``s`` are recomputed here from the bucket maxima
  of the scale contributors' inputs and the members bound, and must equal the agreed ones.

Expected values are computed once per (arm, member order, contributor set) and kept, so
checking a call costs one comparison of its output. Nothing is read back from the
Communicator except what the contract is stated over: the contributor sets, the ring's
member order and layout, the agreed scales (compared, not used) and the segments.

Failure behaviour: a mismatch is recorded in :attr:`Checker.failures` (a short text), never
raised: the bench reports ``exact: false`` and goes on.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from resilient.collectives.ledger import Ledger, split
from resilient.collectives.quantization import Segment, bucket_maxima, dequantize, quantize, scales


def ring_sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The float ring's allreduce-SUM of the flat ``xs`` (in ring order): chunk ``c``
    accumulated from ``xs[c]`` onwards around the ring."""
    n, numel = len(xs), xs[0].numel()
    out = torch.empty(numel, dtype=xs[0].dtype)
    for c, (a, b) in enumerate(split(numel, n)):
        acc = out[a:b]
        acc.copy_(xs[c][a:b])
        for k in range(1, n):
            acc.add_(xs[(c + k) % n][a:b])
    return out


def ring_layout_matches(L: Ledger, numel: int) -> bool:
    """Whether ``L``'s pieces are the float ring's: ``n`` chunks of ``split(numel, n)``,
    each cut into the same number of slices."""
    n, P = len(L.members), len(L.pieces)
    if n < 2 or P % n or L.out.numel() != numel:
        return False
    S = P // n
    return all(L.pieces[c * S][0] == a and L.pieces[(c + 1) * S - 1][1] == b
               for c, (a, b) in enumerate(split(numel, n)))


def compressed_sum(xs: dict[str, torch.Tensor], contributors: Sequence[str], scale_contributors: Sequence[str],
                   segs: list[Segment], bucket: int, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``fl32(sum_{i in C} s*q_i)``, ``s``) with ``s`` from the scale contributors' maxima."""
    m = torch.stack([bucket_maxima(xs[k], segs, bucket) for k in scale_contributors]).amax(0)
    sc = scales(m, segs, bucket, bound)
    Q = torch.zeros(xs[contributors[0]].numel(), dtype=torch.int64)
    for k in contributors:
        Q += quantize(xs[k], sc, segs, bucket, bound)
    return dequantize(Q.to(torch.int32), sc, segs, bucket), sc


class Checker:
    """Checks outputs of one tensor size. ``input_of(member)``: that member's flat float32
    input (called at most once per member)."""

    def __init__(self, input_of: Callable[[str], torch.Tensor]) -> None:
        self._input_of = input_of
        self._xs: dict[str, torch.Tensor] = {}
        self._expected: dict[Any, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.checked = 0
        self.failures: list[str] = []

    @property
    def exact(self) -> bool:
        """Every output checked so far was exact (and at least one was checked)."""
        return self.checked > 0 and not self.failures

    def input(self, m: str) -> torch.Tensor:
        """Member ``m``'s flat input (made once, kept until :meth:`release`)."""
        if m not in self._xs:
            self._xs[m] = self._input_of(m).reshape(-1)
        return self._xs[m]

    def _record(self, ok: bool, what: str) -> bool:
        self.checked += 1
        if not ok and len(self.failures) < 10:
            self.failures.append(what)
        return ok

    def fail(self, what: str) -> None:
        """An output that could not be checked: counted, and a failure."""
        self._record(False, what)

    def fp32(self, out: torch.Tensor, contributors: Sequence[str], L: Ledger | None) -> bool:
        """``out`` of a float32 SUM allreduce whose ledger is ``L`` (``Communicator.retained``)."""
        flat = out.reshape(-1)
        if L is None or not ring_layout_matches(L, flat.numel()):
            return self._record(False, "fp32: not the float ring's layout")
        if sorted(contributors) != sorted(L.members):
            return self._record(False, f"fp32: contributors {sorted(contributors)} of {list(L.members)}")
        key = ("fp32", tuple(L.members))
        if key not in self._expected:
            self._expected[key] = (ring_sum([self.input(m) for m in L.members]), None)
        return self._record(bool(torch.equal(flat, self._expected[key][0])), f"fp32 op {L.seq}: output differs")

    def compressed(self, out: torch.Tensor, contributors: Sequence[str], info: dict[str, Any]) -> bool:
        """``out`` of a compressed SUM allreduce (``info``: ``Communicator.last_compression``)."""
        segs: list[Segment] = list(info["segments"])
        C, SC = tuple(sorted(contributors)), tuple(sorted(info["scale_contributors"]))
        key = ("q", tuple((s.start, s.end, s.bits) for s in segs), info["bucket"], info["members_bound"], C, SC)
        if key not in self._expected:
            self._expected[key] = compressed_sum({m: self.input(m) for m in set(C) | set(SC)}, C, SC, segs,
                                                 info["bucket"], info["members_bound"])
        exp, sc = self._expected[key]
        assert sc is not None
        ok = bool(torch.equal(info["scales"], sc)) and bool(torch.equal(out.reshape(-1), exp))
        return self._record(ok, f"q{segs[0].bits} op {info['seq']} C={list(C)}: output or scales differ")

    def release(self) -> None:
        """Drop the inputs (the expected values stay)."""
        self._xs.clear()
