"""Every dtype ``torch.distributed`` hands the backend, on a Communicator that moves six.

The Communicator (:mod:`resilient.collectives.communicator`) runs float32/64, float16,
bfloat16, int32 and int64. This module maps the other dtypes onto those, per kind of op:

* **copies** (broadcast, all_gather, gather, scatter, all_to_all, send/recv): the tensor's
  bytes, packed into an int32 buffer (padded to 4 bytes) — exact for *any* dtype (bool,
  uint8, int8, int16, complex, uint16...), no widening on the wire.
* **reductions** (all_reduce, reduce, reduce_scatter): ``bool``, ``uint8``, ``int8``,
  ``int16`` are computed in int64 and cast back, which wraps exactly like the narrow
  type's own arithmetic (what gloo does); ``bool`` follows gloo: SUM and MAX are a logical
  OR, PRODUCT and MIN a logical AND. ``complex64/128`` are reduced as their real view
  (SUM, AVG; torch itself refuses MIN/MAX/PRODUCT on complex). BAND/BOR/BXOR on integer
  and bool tensors are computed bit by bit (MIN/MAX/SUM-mod-2 over the expanded bits:
  exact, at 1 int32 per bit on the wire).

Failure behaviour: a dtype/op pair torch itself does not define (MIN on complex, a bitwise
op on floats, AVG on bool, reductions on unsigned 16/32/64-bit) raises
:class:`~resilient.errors.UnsupportedOperation` naming the pair and what to use instead.
"""
from __future__ import annotations

from typing import Callable

import torch

from resilient.errors import UnsupportedOperation

#: dtypes the Communicator moves as they are
NATIVE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64})
#: integer dtypes reduced in int64 and cast back (wrap-around arithmetic, as the narrow type)
WIDENED = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16})
BITWISE = ("band", "bor", "bxor")

WriteBack = Callable[[], object]


def _unsupported(what: str, hint: str) -> Exception:
    return UnsupportedOperation(what, hint)


class Packed:
    """``tensor``'s bytes in an int32 buffer (``wire``); :meth:`unpack` copies them back.
    A native-dtype contiguous tensor is its own wire (no copy)."""

    def __init__(self, tensor: torch.Tensor, fill: bool = True) -> None:
        self.tensor = tensor
        self.native = tensor.dtype in NATIVE and tensor.is_contiguous()
        if self.native:
            self.wire = tensor
            return
        self.nbytes = tensor.numel() * tensor.element_size()
        self._bytes = torch.zeros(-(-self.nbytes // 4) * 4, dtype=torch.uint8)
        if fill and self.nbytes:
            self._bytes[:self.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self.wire = self._bytes.view(torch.int32)

    def unpack(self) -> None:
        if self.native or not self.nbytes:
            return
        self.tensor.copy_(self._bytes[:self.nbytes].view(self.tensor.dtype).view(self.tensor.shape))


def for_reduce(t: torch.Tensor, op: str, where: str) -> tuple[torch.Tensor, str, WriteBack | None]:
    """``(wire, wire_op, write_back)`` for reducing ``t`` with ``op``: run the
    Communicator's reduction with ``wire_op`` on ``wire`` (filled from ``t``), then
    ``write_back()`` puts the result into ``t`` (None when ``t`` is the wire itself)."""
    d = t.dtype
    if op in BITWISE:
        if d.is_floating_point or d.is_complex:
            raise _unsupported(f"{where} with {op.upper()} on {d}", "bitwise reductions take integer or bool tensors")
        return _bitwise(t, op)
    if d.is_complex:
        if op not in ("sum", "avg"):
            raise _unsupported(f"{where} with {op.upper()} on {d}", "complex tensors reduce with SUM or AVG")
        return torch.view_as_real(t), op, None
    if d in NATIVE:
        return t, op, None
    if d == torch.bool:
        if op == "avg":
            raise _unsupported(f"{where} with AVG on torch.bool", "use SUM/MAX (logical OR) or PRODUCT/MIN (logical AND)")
        wire = t.to(torch.int32)
        return wire, {"sum": "max", "prod": "min"}.get(op, op), lambda: t.copy_(wire != 0)
    if d in WIDENED:
        wire = t.to(torch.int64)
        return wire, op, lambda: t.copy_(wire)
    raise _unsupported(f"{where} on {d}", "reduce int8/16/32/64, uint8, bool, float or complex tensors")


def _bitwise(t: torch.Tensor, op: str) -> tuple[torch.Tensor, str, WriteBack]:
    """Bitwise AND/OR/XOR as MIN/MAX/SUM over the tensor's bits (one int32 per bit)."""
    nbits = 1 if t.dtype == torch.bool else t.element_size() * 8
    src = t.detach().reshape(-1).to(torch.int64)
    shifts = torch.arange(nbits, dtype=torch.int64, device=src.device)
    bits = ((src.unsqueeze(1) >> shifts) & 1).to(torch.int32).contiguous()
    wire_op = {"band": "min", "bor": "max", "bxor": "sum"}[op]

    def write_back() -> None:
        b = bits.to(torch.int64) & 1  # XOR: the sum's parity
        value = (b << shifts).sum(dim=1)
        t.copy_((value != 0).view(t.shape) if t.dtype == torch.bool else value.to(t.dtype).view(t.shape))

    return bits, wire_op, write_back
