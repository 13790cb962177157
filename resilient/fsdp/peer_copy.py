"""The in-memory peer copy of a plain FSDP member's shards: what it holds and how it moves.

With one replica group (plain FSDP, a 1-D mesh) a member's parameter shards and their
optimizer state exist only on that member. After every optimizer step each member packs
its shards — every FSDP parameter's padded shard (FSDP2's ``_sharded_param_data``) and the
optimizer state of that parameter — into one byte buffer and sends it to its *buddy*, the
next live member in rank order (on another host when the job has more than one: ranks
are laid out host by host), while it receives its predecessor's (after Gemini, SOSP '23).
The buddy holds the copy in host memory until the next step's copy replaces it.

Layout (:class:`Layout`): for each FSDP parameter in the order the parameter groups were
built (the same on every member), the padded shard, then each optimizer state tensor of
the parameter in key order — one shaped like the shard is stored padded to the padded
shard (so every member's buffer has the same size), a 0-dim one (``step``) as one element.
The layout is computed by each member from its own optimizer; a section starts with its
fingerprint (8 bytes), which the receiver checks, so a copy laid out otherwise (a member
whose model or optimizer differs) is refused with a clear error instead of misread.

A member that hosts a lost member's shards (an *orphan*, :mod:`.orphans`) appends them to
its copy, one section of the same layout each, so its buddy can take over both when the
host is lost too. Every member knows how many sections its predecessor sends: who hosts
whom follows from the committed membership, which all agree on.

Cost per step: one copy of the member's shards and their optimizer state into the buffer
(and one buffer of that size received), one point-to-point send and receive; memory: the
member's own last copy (its rollback point) plus its predecessor's, twice the shards with
their optimizer state (and one section more per orphan the member or its predecessor hosts).

Failure behaviour: :meth:`Layout.of` raises :class:`~resilient.errors.ConfigError` for an
optimizer state tensor that is neither 0-dim nor shaped like its parameter's shard (such an
optimizer cannot be copied or redone shard by shard), and :meth:`Layout.sections` for a
received copy of another size or fingerprint; :func:`exchange` never raises for a lost
peer: it reports whether the predecessor's copy arrived whole.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import torch

from resilient.errors import ConfigError, ResilientError

__all__ = ["Entry", "Layout", "exchange", "TAG"]

#: the point-to-point tag of the copy (apart from a script's own tags, which are small)
TAG = 0x5EED_C0


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local tensor (the attribute: ``to_local()`` dispatches, 50x slower)."""
    local = getattr(t, "_local_tensor", None)
    out: torch.Tensor = t if local is None else local
    return out


#: bytes before the first entry of a section: the layout's fingerprint (int64)
_HEADER = 8


def _aligned(off: int) -> int:
    """Entries start on 8-byte boundaries (a view of any dtype; the buffer travels as int64)."""
    return (off + 7) // 8 * 8


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the copy: parameter ``index``'s shard (``key`` None) or its state ``key``."""

    index: int
    key: str | None
    dtype: torch.dtype
    #: elements in the buffer (the padded shard, or 1 for a 0-dim state)
    numel: int
    scalar: bool
    offset: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    nbytes: int

    #: per entry, how many optimizer state entries each parameter had (to reuse a layout)
    signature: tuple[int, ...] = ()
    #: a fingerprint of the entries, the first 8 bytes of every section
    digest: int = 0

    @classmethod
    def of(cls, fsdp_params: Sequence[Any], optimizer: Any | None, previous: "Layout | None" = None) -> "Layout":
        """The layout of this member's copy (see the module docstring); ``previous`` is
        returned when the optimizer state has the same entries."""
        states = [{} if optimizer is None else optimizer.state.get(fp.sharded_param, {}) for fp in fsdp_params]
        signature = tuple(len(st) for st in states)
        if previous is not None and previous.signature == signature:
            return previous
        entries: list[Entry] = []
        off = _HEADER
        for i, fp in enumerate(fsdp_params):
            data = fp._sharded_param_data
            e = Entry(i, None, data.dtype, data.numel(), False, off)
            entries.append(e)
            off = _aligned(off + e.nbytes)
            state = states[i]
            local_shape = tuple(_local(fp.sharded_param).shape)
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    raise ConfigError(f"plain FSDP peer copy: optimizer state {key!r} is a {type(value).__name__}, "
                                      "not a tensor; use an optimizer whose state is tensors (SGD, Adam, AdamW)")
                t = _local(value)
                if t.dim() == 0:
                    e = Entry(i, key, t.dtype, 1, True, off)
                elif tuple(t.shape) == local_shape:
                    e = Entry(i, key, t.dtype, data.numel(), False, off)
                else:
                    raise ConfigError(f"plain FSDP peer copy: optimizer state {key!r} has shape {tuple(t.shape)}, "
                                      f"neither 0-dim nor the shard's {local_shape}; an optimizer with such "
                                      "state (factored, per-row) cannot be kept shard by shard")
                entries.append(e)
                off = _aligned(off + e.nbytes)
        text = repr([(e.index, e.key, str(e.dtype), e.numel, e.scalar, e.offset) for e in entries])
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
        return cls(tuple(entries), off, signature, digest)

    def view(self, buf: torch.Tensor, e: Entry) -> torch.Tensor:
        """Entry ``e`` of ``buf`` (uint8) as a flat tensor of its dtype."""
        return buf[e.offset:e.offset + e.nbytes].view(e.dtype)

    def pack(self, fsdp_params: Sequence[Any], optimizer: Any | None,
             spare: torch.Tensor | None = None, orphans: Sequence[Any] = ()) -> torch.Tensor:
        """This member's shards and state, then those of each orphan it hosts
        (:class:`~resilient.fsdp.orphans.Orphan`, one section of ``nbytes`` each), as one
        buffer (a copy; into ``spare`` when it is a buffer of this size that nothing else
        holds). Raises :class:`~resilient.errors.ConfigError` for an orphan whose state has
        other entries than this member's."""
        total = self.nbytes * (1 + len(orphans))
        buf = spare if spare is not None and spare.numel() == total else torch.zeros(total, dtype=torch.uint8)
        dsts, srcs = [], []
        for e in self.entries:
            fp = fsdp_params[e.index]
            if e.key is None:
                src = fp._sharded_param_data.reshape(-1)
            else:
                assert optimizer is not None  # a state entry comes from an optimizer
                src = _local(optimizer.state[fp.sharded_param][e.key]).reshape(-1)
            dsts.append(self.view(buf, e)[:src.numel()])
            srcs.append(src)
        for k, o in enumerate(orphans, 1):
            section = buf[k * self.nbytes:(k + 1) * self.nbytes]
            for e in self.entries:
                state = o.states[e.index]
                if e.key is not None and e.key not in state:
                    raise ConfigError(f"plain FSDP peer copy: the hosted shards of {o.member} lack optimizer state "
                                      f"{e.key!r} that this member's have; the optimizers' state differs")
                src = (o.params[e.index] if e.key is None else state[e.key]).reshape(-1)
                dsts.append(self.view(section, e)[:src.numel()])
                srcs.append(src)
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
            for k in range(1 + len(orphans)):
                buf[k * self.nbytes:k * self.nbytes + _HEADER].view(torch.int64).fill_(self.digest)
        return buf

    def sections(self, buf: torch.Tensor, members: Sequence[str]) -> dict[str, torch.Tensor]:
        """A received copy split by member: ``members[0]`` the sender, then its orphans."""
        if buf.numel() != self.nbytes * len(members):
            raise ConfigError(f"plain FSDP peer copy: {buf.numel()} bytes for {len(members)} members' shards of "
                              f"{self.nbytes} bytes each; the members' optimizers or models differ")
        out = {m: buf[k * self.nbytes:(k + 1) * self.nbytes] for k, m in enumerate(members)}
        for m, part in out.items():
            got = int(part[:_HEADER].view(torch.int64)[0])
            if got != self.digest:
                raise ConfigError(f"plain FSDP peer copy: the copy of {m}'s shards has another layout than this "
                                  f"member's (fingerprint {got:#x}, here {self.digest:#x}): the members' models or "
                                  "optimizers differ (parameters, their order, dtypes or optimizer state)")
        return out

    def restore(self, buf: torch.Tensor, fsdp_params: Sequence[Any], optimizer: Any | None) -> None:
        """Put a buffer of this member's own shards and state back (its rollback)."""
        with torch.no_grad():
            for e in self.entries:
                fp = fsdp_params[e.index]
                src = self.view(buf, e)
                if e.key is None:
                    fp._sharded_param_data.view(-1).copy_(src)
                    continue
                assert optimizer is not None
                t = _local(optimizer.state[fp.sharded_param][e.key])
                if t.dim():
                    t.view(-1).copy_(src[:t.numel()])
                else:
                    t.copy_(src[0])

    def unpack(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Another member's copy as owned tensors: its padded shards, and per shard its
        optimizer state (padded like the shard; 0-dim ones as 0-dim)."""
        params: list[torch.Tensor] = []
        states: list[dict[str, torch.Tensor]] = []
        for e in self.entries:
            t = self.view(buf, e).clone()
            if e.key is None:
                params.append(t)
                states.append({})
            else:
                states[e.index][e.key] = t.reshape(()) if e.scalar else t
        return params, states


def exchange(engine: Any, payload: torch.Tensor, buddy: int, pred: int, nbytes_in: int,
             at: Any = None, spare: torch.Tensor | None = None) -> tuple[bool, torch.Tensor]:
    """Send ``payload`` to rank ``buddy`` and receive the predecessor's (rank ``pred``) copy
    of ``nbytes_in`` bytes. Returns ``(arrived whole, buffer)``; a lost buddy or predecessor
    is reported, not raised. ``at(frac)`` is called before the send (0.0) and after it is
    posted (1.0): the failpoints of the refresh."""
    rbuf = (spare if spare is not None and spare.numel() == nbytes_in
            else torch.empty(nbytes_in, dtype=torch.uint8))
    recv = engine.recv(rbuf.view(torch.int64), pred, TAG)
    if at is not None:
        at(0.0)
    send = engine.send(payload.view(torch.int64), buddy, TAG)
    if at is not None:
        at(1.0)
    try:
        send.wait()
    except ResilientError:
        pass  # the buddy is gone: the commit sees it
    try:
        recv.wait()
    except ResilientError:
        return False, rbuf
    return True, rbuf
