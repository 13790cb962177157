"""Contributor masks in a compact JSON form whose size does not depend on N decimal digits.

A contributor mask is an N-bit integer (bit ``i``: ``members[i]``, the op's members in
ring order). As a JSON integer it needs ~0.3 N decimal digits, and Python refuses to
parse or print one above 4,300 digits (``ValueError`` from ~14,285 members). Here each
mask becomes whichever of two forms is shorter:

* **arcs** — a JSON list ``[start0, length0, start1, length1, ...]`` of runs of set bits
  over the ring order; a run may wrap from the last member to the first (``start +
  length > N``). ``[]`` is the empty mask, ``[0, N]`` the full one. A ring collective's
  accumulators are contiguous arcs of the ring, so this is a few bytes at any N;
* **bitmap** — a JSON string: standard base64 of the mask's ``ceil(N / 8)`` bytes, little
  endian (bit ``i`` is bit ``i % 8`` of byte ``i // 8``). At most
  :func:`max_encoded_chars` characters, whatever the mask.

Encoding costs O(N / 64) word operations for a mask of a few runs (a ring's arcs) and
at most one O(N) scan otherwise; a mask with more runs than the bitmap's length allows
is sent as the bitmap without a scan (~0.3 ms per mask at 100k members).

Failure behaviour: :func:`decode_mask` raises :class:`~resilient.errors.CollectiveError`
naming the cause (wrong type, odd or oversized arc list, an arc out of range, bad base64,
a bitmap of the wrong length or with bits beyond N) and touches nothing; nothing here is
unpickled or evaluated. A legacy JSON integer (summaries written before this format) is
still accepted when it fits ``0 <= x < 2**N``.
"""
from __future__ import annotations

import base64
import binascii
import re

from resilient.errors import CollectiveError

#: the JSON value of one encoded mask: arcs (a flat int list) or a base64 bitmap
EncodedMask = list[int] | str


def _bitmap_bytes(n: int) -> int:
    return (n + 7) // 8


def max_encoded_chars(n: int) -> int:
    """An upper bound on the JSON text of any ``n``-member mask (the quoted bitmap)."""
    return 4 * ((_bitmap_bytes(n) + 2) // 3) + 2


def _arcs_chars(arcs: list[int]) -> int:
    """Length of ``arcs`` as compact JSON (``[a,b,...]``)."""
    return 2 + sum(len(str(v)) for v in arcs) + max(len(arcs) - 1, 0)


#: up to this many runs the arcs are found with big-integer operations (each O(N / 64));
#: beyond, by one regular-expression scan of the mask's binary digits (O(N), in C)
_FEW_RUNS = 8
_ONES = re.compile("1+")


def _runs(mask: int, n: int, budget: int) -> list[int] | None:
    """Runs of set bits of ``mask`` as ``[start, length, ...]`` (a run over bit n-1 and
    bit 0 merged into one wrapping arc), or None when they take more than ``budget``
    chars. Cost: O(N / 64) to count the runs, then O(runs · N / 64) for a few runs or one
    O(N) scan for more; a mask whose runs cannot fit ``budget`` is not scanned at all."""
    runs = ((mask ^ (mask << 1)).bit_count() + 1) // 2   # run boundaries / 2
    if 4 * (runs - 1) + 1 > budget:    # each arc but a merged one takes >= 4 chars (",a,b")
        return None
    out: list[int] = []
    if runs <= _FEW_RUNS:
        offset, x = 0, mask
        while x:
            low = (x & -x).bit_length() - 1
            y = x >> low
            run = (~y & (y + 1)).bit_length() - 1   # trailing ones of y
            out += (offset + low, run)
            offset += low + run
            x = y >> run
    else:
        for m in _ONES.finditer(format(mask, "b")[::-1]):   # digit i is bit i
            out += (m.start(), m.end() - m.start())
    if len(out) >= 4 and out[0] == 0 and out[-2] + out[-1] == n:
        out[-1] += out[1]        # the last run wraps into the first
        del out[:2]
    return out if _arcs_chars(out) <= budget else None


def encode_mask(mask: int, n: int) -> EncodedMask:
    """``mask`` (``0 <= mask < 2**n``) as arcs or a base64 bitmap, whichever is shorter.

    Raises ``ValueError`` for a mask out of range (a bug of the caller, not input)."""
    if mask < 0 or mask >> n:
        raise ValueError(f"mask {mask:#x} does not fit {n} members")
    budget = max_encoded_chars(n)
    arcs = _runs(mask, n, budget)
    if arcs is not None:
        return arcs
    return base64.b64encode(mask.to_bytes(_bitmap_bytes(n), "little")).decode("ascii")


def decode_mask(value: object, n: int, what: str = "mask") -> int:
    """The mask ``value`` (an :func:`encode_mask` result, or a legacy int) encodes for
    ``n`` members; :class:`CollectiveError` naming ``what`` and the cause if it is not one."""
    if isinstance(value, bool):
        raise CollectiveError(f"{what}: a boolean is not a contributor mask")
    if isinstance(value, int):
        if value < 0 or value >> n:
            raise CollectiveError(f"{what}: {value} is out of range for {n} members")
        return value
    if isinstance(value, str):
        return _decode_bitmap(value, n, what)
    if isinstance(value, list):
        return _decode_arcs(value, n, what)
    raise CollectiveError(f"{what}: expected an arc list or a base64 bitmap, got {type(value).__name__}")


def _decode_bitmap(value: str, n: int, what: str) -> int:
    if len(value) > max_encoded_chars(n):
        raise CollectiveError(f"{what}: a {len(value)}-character bitmap is longer than {n} members need")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise CollectiveError(f"{what}: the bitmap is not valid base64 ({exc})") from None
    if len(raw) != _bitmap_bytes(n):
        raise CollectiveError(f"{what}: the bitmap has {len(raw)} bytes, {n} members need {_bitmap_bytes(n)}")
    mask = int.from_bytes(raw, "little")
    if mask >> n:
        raise CollectiveError(f"{what}: the bitmap sets bits beyond member {n - 1}")
    return mask


def _decode_arcs(value: list[object], n: int, what: str) -> int:
    if len(value) % 2:
        raise CollectiveError(f"{what}: an arc list needs (start, length) pairs, got {len(value)} numbers")
    if len(value) > 2 * n:
        raise CollectiveError(f"{what}: {len(value) // 2} arcs for {n} members")
    full, mask = (1 << n) - 1, 0
    for i in range(0, len(value), 2):
        start, length = value[i], value[i + 1]
        if (not isinstance(start, int) or not isinstance(length, int) or isinstance(start, bool)
                or isinstance(length, bool)):
            raise CollectiveError(f"{what}: arc {i // 2} is not a pair of integers")
        if not 0 <= start < n or not 1 <= length <= n:
            raise CollectiveError(f"{what}: arc {i // 2} ({start}, {length}) is out of range for {n} members")
        run = ((1 << length) - 1) << start
        mask |= (run | (run >> n)) & full   # a wrapping arc continues at member 0
    return mask
