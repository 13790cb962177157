"""The ledger: partial progress of one op, exactly enough to finish it after a failure.

An op's flat output buffer is cut into *pieces* (ring: chunk x pipelining slice; small
ops: one piece). For every piece the ledger records the contributor mask (bit ``i`` =
``members[i]``, the op's original members in ring order) of the accumulator this member
holds in ``out`` for that piece (0: nothing usable). The member's own input is kept
unchanged in ``inp`` until the op completes (out of place), so it can always add itself.

A piece's mask is set only after its bytes are complete *and* reduced; a receive that
may have written part of a region clears the mask first (see
:meth:`~resilient.transport.base.Request.touched`). So whatever moment a peer dies or
the transport is aborted, ``masks`` describe ``out`` exactly.

Summaries are JSON (no pickle) published under ``epochs/<n>/data/ledger/<member>``;
their masks are in :mod:`.mask_codec` form (run-length arcs or a base64 bitmap), so a
summary encodes at any group size. A summary does not list the op's members: every
reader holds its own ledger of the same op, whose member order (the ring order of the
op's epoch, ``epoch``) the masks index, so the summary carries that order's count and
digest (``n_members``, ``members_sha``: :func:`members_digest`), a constant ~60 bytes
instead of ~11 bytes per member; a reader uses a peer's masks only when both match its
own (:mod:`.resume`). :func:`decode_status` validates a peer's summary and reads the
older forms too (integer masks, the member list); a member of an older release cannot
read the new form, so one job runs one release (a job's members are started from one
image).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.collectives.mask_codec import decode_mask, encode_mask
from resilient.collectives.recovery import PieceKind, Policy
from resilient.device import DeviceOps, device_ops
from resilient.errors import CollectiveError


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal [start, end) ranges covering ``range(n)`` (earlier ones longer)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass
class Ledger:
    seq: int
    kind: str                       # allreduce | reduce_scatter | allgather | broadcast | barrier
    members: tuple[str, ...]        # op's original members (mask bit order = ring order)
    me: int
    epoch: int                      # epoch the op started in
    digest: int
    inp: torch.Tensor               # flat, contiguous, kept until the op completes
    out: torch.Tensor               # flat accumulators / results
    pieces: list[tuple[int, int]]   # element ranges in ``out``
    piece_kind: PieceKind = PieceKind.REDUCE
    owners: list[int] | None = None  # copy pieces: index of the owner in ``members``
    want: list[int | None] | None = None  # reduce_scatter: member index that needs the piece
    inp_offset: list[int] | None = None  # element offset in ``inp`` of each piece's input (default: same as out)
    masks: list[int] = field(default_factory=list)
    has_input: bool = True
    done: bool = False
    need: list[int] | None = None   # final masks (after completion or recovery)
    enabled: bool = True
    #: ``inp`` is the caller's tensor, which receives the result when the op is over: an
    #: algorithm may write final values into ``inp`` as it goes, provided it keeps a copy of
    #: the input and restores ``inp`` from it before it raises (so a recovery or a rerun
    #: reads the input), and sets ``delivered`` once every piece's final value is in ``inp``
    #: (the op then skips its copy of ``out`` into the caller's tensor)
    deliver: bool = False
    delivered: bool = False
    #: where ``inp``/``out`` live (CpuOps: today's path) and, when > 0, the chunk size in
    #: elements of the host-staged transfers (:mod:`.staged`; 0: transfers go direct)
    ops: DeviceOps = field(default_factory=lambda: device_ops("cpu"))
    stage_elems: int = 0
    staged_posts: int = 0           # transfers posted through host staging (diagnostics, tests)
    #: a lazily written input: called with a piece index before that piece's input is
    #: read (:meth:`input_view`, :meth:`input_buf`; idempotent), so the compressed ring
    #: quantizes each piece as it needs it; whoever reads ``inp`` directly calls
    #: :meth:`ready_input` first. None: ``inp`` is complete
    fill_input: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    #: byte views of ``out`` / ``inp`` made once per op (see :meth:`buf`)
    _views: dict[str, memoryview | bool] = field(default_factory=dict, init=False, repr=False, compare=False)
    _digest: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.masks:
            self.masks = [0] * len(self.pieces)

    def view(self, p: int) -> torch.Tensor:
        s, e = self.pieces[p]
        return self.out[s:e]

    def ready_input(self) -> None:
        """Make every piece's input complete (a no-op without :attr:`fill_input`)."""
        if self.fill_input is not None:
            for p in range(len(self.pieces)):
                self.fill_input(p)

    def input_view(self, p: int) -> torch.Tensor:
        if self.fill_input is not None:
            self.fill_input(p)
        s, e = self.pieces[p]
        off = s if self.inp_offset is None else self.inp_offset[p]
        return self.inp[off:off + (e - s)]

    def buf(self, p: int) -> Any:
        """Piece ``p`` of ``out`` as a transport buffer: a byte memoryview for a CPU
        tensor (slicing it costs far less than turning a tensor view into bytes on every
        post), else the tensor view."""
        return self._bytes("_out_mv", self.out, self.pieces[p][0], p)

    def input_buf(self, p: int) -> Any:
        """Piece ``p``'s input as a transport buffer (see :meth:`buf`)."""
        if self.fill_input is not None:
            self.fill_input(p)
        start = self.pieces[p][0] if self.inp_offset is None else self.inp_offset[p]
        return self._bytes("_inp_mv", self.inp, start, p)

    def _bytes(self, key: str, t: torch.Tensor, start: int, p: int) -> Any:
        """Elements ``[start, start + len(piece p))`` of ``t``: a slice of its byte view,
        made once per op and cached under ``key`` (the tensor slice where ``t`` has none)."""
        mv = self._views.get(key)
        if mv is None:
            mv = self._views[key] = _bytes_of(t)
        s, e = self.pieces[p]
        if not isinstance(mv, memoryview):
            return t[start:start + e - s]
        es = t.element_size()
        return mv[start * es:(start + e - s) * es]

    def set(self, p: int, mask: int) -> None:
        if self.enabled:
            self.masks[p] = mask

    def set_range(self, start: int, stop: int, mask: int) -> None:
        """Pieces ``start .. stop-1`` get ``mask`` (one slice assignment: a chunk's slices at
        once; through :meth:`set` per piece where a subclass redefines it)."""
        if type(self).set is not Ledger.set:
            for p in range(start, stop):
                self.set(p, mask)
        elif self.enabled:
            self.masks[start:stop] = [mask] * (stop - start)

    @property
    def full(self) -> int:
        return (1 << len(self.members)) - 1

    def progressed(self) -> bool:
        return any(self.masks)

    def members_digest(self) -> str:
        """:func:`members_digest` of :attr:`members`, computed once per ledger (O(N) the
        first time, then O(1): a recovery compares it with every survivor's summary)."""
        if not self._digest:
            self._digest = members_digest(self.members)
        return self._digest

    def summary(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "kind": self.kind, "n_members": len(self.members),
            "members_sha": self.members_digest(), "epoch": self.epoch,
            "digest": self.digest, "n_pieces": len(self.pieces), "masks": list(self.masks),
            "has_input": self.has_input, "done": self.done,
            "need": list(self.need) if self.done and self.need is not None else None,
        }


def _bytes_of(t: torch.Tensor) -> memoryview | bool:
    """A flat writable byte view of a contiguous CPU tensor, or False (use tensor views)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


#: bounds a decoded summary must respect (a corrupt or hostile peer cannot make a
#: survivor allocate beyond them): members of one op, and pieces of one op's buffer
MAX_STATUS_MEMBERS = 1 << 20
MAX_STATUS_PIECES = 1 << 24
#: the summary format: 3 = the op's members by count and digest; 2 = their ids, masks in
#: :mod:`.mask_codec` form; 1 (implicit) = their ids, masks as JSON integers
STATUS_VERSION = 3
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_POLICIES = frozenset(p.value for p in Policy)


def members_digest(members: Sequence[str]) -> str:
    """The digest a summary names its op's member order by: the first 128 bits of the
    sha256 of the ids in mask-bit order, one per line (ids hold no newline:
    :func:`~resilient.coordinator.records.is_id`), as 32 hex digits."""
    return hashlib.sha256("\n".join(members).encode()).hexdigest()[:32]


def _wire_summary(L: Ledger) -> dict[str, Any]:
    """``L.summary()`` with every mask in :mod:`.mask_codec` form (arcs or a bitmap)."""
    s, n = L.summary(), len(L.members)
    s["masks"] = [encode_mask(m, n) for m in L.masks]
    if s["need"] is not None:
        s["need"] = [encode_mask(int(m), n) for m in s["need"]]
    return s


def encode_status(member: str, inflight: Ledger | None, retained: Ledger | None, next_seq: int | None = None,
                  policy: str | None = None) -> bytes:
    """This member's ledger summary as compact JSON (masks in :mod:`.mask_codec` form:
    no N-digit integers, so it encodes at any group size; each mask is at most
    :func:`~.mask_codec.max_encoded_chars` characters; the op's members by count and
    digest, not by id: the size does not grow with the group). ``next_seq``: set by a member in
    no collective (point-to-point catching up, :mod:`.p2p`): the first op seq it has not
    started, so survivors in that op rerun it with it instead of finishing without it.
    ``policy``: the in-flight op's contributor policy (a recovery's planner plans the op
    under it, whatever op or default its own call path has)."""
    status: dict[str, Any] = {
        "v": STATUS_VERSION,
        "member": member,
        "inflight": dict(_wire_summary(inflight), **({"policy": policy} if policy else {}))
        if inflight is not None else None,
        "retained": _wire_summary(retained) if retained is not None else None,
    }
    if next_seq is not None:
        status["next"] = int(next_seq)
    return json.dumps(status, separators=(",", ":")).encode()


def _field(obj: dict[str, Any], key: str, typ: type, where: str) -> Any:
    """``obj[key]`` when it is a ``typ`` (a bool is no int here); CollectiveError otherwise."""
    v = obj.get(key)
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
        raise CollectiveError(f"{where}: field {key!r} is {type(v).__name__}, expected {typ.__name__}")
    return v


def _decode_summary(obj: object, where: str, version: int) -> dict[str, Any] | None:
    """A validated summary with its masks as ints and its op's members as ``n_members``
    and ``members_sha`` (computed from the ids of an older form), or None;
    CollectiveError otherwise."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise CollectiveError(f"{where}: a summary must be an object, got {type(obj).__name__}")
    for key in ("seq", "epoch", "digest", "n_pieces"):
        _field(obj, key, int, where)
    _field(obj, "kind", str, where)
    for key in ("has_input", "done"):
        _field(obj, key, bool, where)
    if obj.get("policy") is not None and obj["policy"] not in _POLICIES:
        raise CollectiveError(f"{where}: 'policy' must be one of {sorted(_POLICIES)}")
    out = dict(obj)
    if version < 3:   # the member ids listed (older releases)
        members = _field(obj, "members", list, where)
        if len(members) > MAX_STATUS_MEMBERS or not all(isinstance(m, str) for m in members):
            raise CollectiveError(f"{where}: 'members' must be at most {MAX_STATUS_MEMBERS} member ids")
        del out["members"]
        n, out["members_sha"] = len(members), members_digest(members)
    else:
        n, sha = _field(obj, "n_members", int, where), _field(obj, "members_sha", str, where)
        if not 0 <= n <= MAX_STATUS_MEMBERS:
            raise CollectiveError(f"{where}: n_members {n} is out of range (0..{MAX_STATUS_MEMBERS})")
        if not _DIGEST_RE.fullmatch(sha):
            raise CollectiveError(f"{where}: 'members_sha' must be 32 lowercase hex digits (members_digest)")
    out["n_members"] = n
    pieces = obj["n_pieces"]
    if not 0 <= pieces <= MAX_STATUS_PIECES:
        raise CollectiveError(f"{where}: n_pieces {pieces} is out of range (0..{MAX_STATUS_PIECES})")
    for key in ("masks", "need"):
        vals = obj.get(key)
        if key == "need" and vals is None:
            continue
        if not isinstance(vals, list) or len(vals) != pieces:
            raise CollectiveError(f"{where}: {key!r} must list one mask per piece ({pieces})")
        out[key] = [decode_mask(v, n, f"{where} {key}[{p}]") for p, v in enumerate(vals)]
    return out


def decode_status(raw: bytes) -> dict[str, Any]:
    """A peer's ledger summary (:func:`encode_status`, or an older form: integer masks,
    the member ids listed), validated, with every mask as an int and the op's members
    as ``n_members`` and ``members_sha``. Raises
    :class:`~resilient.errors.CollectiveError` naming the field and the cause when it is
    not valid JSON or not a well-formed summary (types, sizes, masks out of range);
    nothing is unpickled or evaluated."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CollectiveError(f"a peer's ledger summary is not valid JSON: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise CollectiveError(f"a peer's ledger summary must be a JSON object, got {type(obj).__name__}")
    member = obj.get("member")
    if not isinstance(member, str):
        raise CollectiveError("a peer's ledger summary names no member: corrupt or foreign data")
    where = f"the ledger summary of {member}"
    version = obj.get("v", 1)
    if version not in (1, 2, STATUS_VERSION) or isinstance(version, bool):
        raise CollectiveError(f"{where} has format version {version!r}; this release reads 1 to "
                              f"{STATUS_VERSION}: run one release of resilient in the whole job")
    return {**obj, "inflight": _decode_summary(obj.get("inflight"), f"{where} (in flight)", version),
            "retained": _decode_summary(obj.get("retained"), f"{where} (retained)", version)}
