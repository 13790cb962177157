"""torch ops the Communicator has no primitive for, composed from the ones it has.

Each function takes the :class:`~.engine.Engine` and returns ``(handle, then)``: the
engine handle(s) of the op and the step that writes the result into the caller's
tensors once they complete (run by :class:`~.work.ResilientWork`). Ops are *submitted*
before the function returns, so the order of ops on the wire is the order of the calls
(every member sees the same sequence).

* ``reduce`` = all_reduce on a copy; only ``dst`` writes the result.
* ``gather`` = all_gather; only ``dst`` keeps the pieces.
* ``scatter`` = broadcast of ``src``'s concatenated list; each rank keeps its chunk.
* ``all_to_all`` / ``all_to_all_single`` = one all_gather of every rank's (padded) input,
  each rank keeps what is addressed to it; with uneven splits a small all_gather of
  every rank's split sizes comes first (waited for at the call, so the data op's size
  is known).
* coalesced forms = one op per dtype over the concatenated tensors.

Failure behaviour: the fault contract of the underlying op holds — the result is exact
over ``contributors`` or the op fails with a named :class:`~resilient.errors.CollectiveError`
(``DataLost`` for a piece that exists nowhere, ``GroupChanged`` when the group shrank
before the op started). An op made of several engine ops whose parts completed over
different member sets (a member died between two of them) raises ``CollectiveError``
naming both sets instead of returning a mix. Split sizes that do not match across ranks
raise ``ValueError`` on every rank (each checks the exchanged matrix). A ``gather``/``scatter``
root whose list has another length than the group has members (one died after the caller
sized the list, as torch's object collectives do between their two ops) gets
``GroupChanged`` and every other rank ``InputMismatch`` — no rank waits for the others.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from resilient.errors import CollectiveError, GroupChanged, ResilientError
from resilient.torch_backend.dtypes import Packed, for_reduce
from resilient.torch_backend.engine import Engine, Handle

Then = Callable[[], object] | None


class AllOf:
    """A handle over several engine handles (one torch op); see the module docstring."""

    def __init__(self, handles: Sequence[Handle], what: str) -> None:
        self.handles = list(handles)
        self.what = what
        self.contributors: tuple[str, ...] = ()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        sets = [tuple(h.contributors) for h in self.handles]
        if len({frozenset(s) for s in sets}) > 1:
            raise CollectiveError(f"{self.what}: its parts completed over different member sets {sets} (a member "
                                  "left between them); the result would mix them, so none is returned — redo the step")
        self.contributors = sets[0] if sets else ()
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)


def _chain(*steps: Then) -> Then:
    live = [s for s in steps if s is not None]
    if not live:
        return None

    def run() -> None:
        for s in live:
            s()
    return run


class _Refused:
    """The handle of an op this rank took part in only to fail it (see :func:`_refuse`)."""

    def __init__(self, inner: Handle, error: CollectiveError) -> None:
        self.inner, self.error = inner, error
        self.contributors: tuple[str, ...] = ()

    def wait(self, timeout: float | None = None) -> bool:
        try:
            if not self.inner.wait(timeout):
                return False
        except ResilientError:  # the others' InputMismatch, relayed: ours says why
            pass
        raise self.error

    def is_completed(self) -> bool:
        return self.inner.is_completed()


def _refuse(engine: Engine, what: str, got: int, n: int, post: Callable[[torch.Tensor], Handle]) -> tuple[Handle, Then]:
    """The root's list has ``got`` entries but the group has ``n`` members (one left after
    the caller sized the list from the world size, or the list is wrong). Raising at the
    call would leave the other ranks waiting in the op for the root, so the root takes
    part with a descriptor nobody else uses (``post(marker)``): every other rank's op then
    fails with :class:`~resilient.errors.InputMismatch`, and the root's handle raises
    :class:`~resilient.errors.GroupChanged` saying what to do."""
    err = GroupChanged(f"{what}, the group has {n} members: a member left after the list was made (or the list "
                       "is wrong); call again with one entry per current member (dist.get_world_size())", got, n)
    return _Refused(post(torch.zeros(1, 1, 1, dtype=torch.int32)), err), None


# -- rooted ops ----------------------------------------------------------------------


def reduce(engine: Engine, t: torch.Tensor, op: str, dst: int, me: int) -> tuple[Handle, Then]:
    src = t if me == dst else t.clone()
    wire, wop, wb = for_reduce(src, op, "reduce")
    return engine.allreduce(wire, wop), wb if me == dst else None


def allgather_into(engine: Engine, outputs: Sequence[torch.Tensor], inp: torch.Tensor) -> tuple[Handle, Then]:
    """all_gather of any dtype: ``outputs[r]`` gets rank r's ``inp``."""
    src = Packed(inp)
    outs = [Packed(o, fill=False) for o in outputs]
    h = engine.allgather([p.wire for p in outs], src.wire)
    return h, _chain(*[p.unpack for p in outs if not p.native])


def gather(engine: Engine, outputs: Sequence[torch.Tensor], inp: torch.Tensor, dst: int, me: int,
           n: int) -> tuple[Handle, Then]:
    if me == dst and len(outputs) != n:
        return _refuse(engine, f"gather: the gather_list on dst has {len(outputs)} tensors", len(outputs), n,
                       lambda mark: engine.allgather([torch.empty_like(mark) for _ in range(n)], mark))
    outs = list(outputs) if me == dst else [torch.empty_like(inp) for _ in range(n)]
    return allgather_into(engine, outs, inp)


def scatter(engine: Engine, out: torch.Tensor, inputs: Sequence[torch.Tensor], src: int, me: int,
            n: int) -> tuple[Handle, Then]:
    m = out.numel()
    if me == src:
        if len(inputs) != n:
            return _refuse(engine, f"scatter: the scatter_list on src has {len(inputs)} tensors", len(inputs), n,
                           lambda mark: engine.broadcast(mark, src))
        for i, x in enumerate(inputs):
            if x.numel() != m or x.dtype != out.dtype:
                raise ValueError(f"scatter: scatter_list[{i}] is {tuple(x.shape)}/{x.dtype}, the output is "
                                 f"{tuple(out.shape)}/{out.dtype}")
        big = torch.cat([x.detach().reshape(-1) for x in inputs]) if n else out.new_empty(0)
    else:
        big = torch.empty(n * m, dtype=out.dtype)
    p = Packed(big)
    h = engine.broadcast(p.wire, src)

    def then() -> None:
        p.unpack()
        out.copy_(big[me * m:(me + 1) * m].view(out.shape))
    return h, then


# -- all to all -----------------------------------------------------------------------


def all_to_all_flat(engine: Engine, inp: torch.Tensor, in_sizes: list[int], out_sizes: list[int],
                    write: Callable[[int, torch.Tensor], None], me: int, exchange: bool) -> tuple[Handle, Then]:
    """Rank j's ``inp`` (1-D) holds, in rank order, ``in_sizes[k]`` elements for rank k;
    ``write(j, piece)`` receives the piece from rank j (``out_sizes[j]`` elements).
    ``exchange=False``: every size is known to be equal on every rank (no size round)."""
    n = len(in_sizes)
    if exchange:
        mine = torch.tensor(list(in_sizes) + list(out_sizes), dtype=torch.int64)
        got = [torch.empty(2 * n, dtype=torch.int64) for _ in range(n)]
        engine.allgather(got, mine).wait()
        sends = [g[:n].tolist() for g in got]
        recvs = [g[n:].tolist() for g in got]
        bad = [(j, k) for j in range(n) for k in range(n) if sends[j][k] != recvs[k][j]]
        if bad:
            j, k = bad[0]
            raise ValueError(f"all_to_all: rank {j} sends {sends[j][k]} elements to rank {k}, which expects "
                             f"{recvs[k][j]} (split sizes disagree across ranks)")
    else:
        sends = [list(in_sizes) for _ in range(n)]
    width = max((sum(s) for s in sends), default=0)
    buf = torch.zeros(width, dtype=inp.dtype)
    buf[:inp.numel()].copy_(inp)
    outs = [torch.empty(width, dtype=inp.dtype) for _ in range(n)]
    h, unpack = allgather_into(engine, outs, buf)

    def then() -> None:
        if unpack is not None:
            unpack()
        for j in range(n):
            off = sum(sends[j][:me])
            write(j, outs[j][off:off + sends[j][me]])
    return h, then


def all_to_all_single(engine: Engine, output: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                      in_splits: Sequence[int], me: int, n: int) -> tuple[Handle, Then]:
    row_in = inp[0].numel() if inp.dim() and inp.shape[0] else max(1, inp.numel())
    row_out = output[0].numel() if output.dim() and output.shape[0] else max(1, output.numel())
    exchange = bool(in_splits) or bool(out_splits)
    rows_in = list(in_splits) if in_splits else [inp.shape[0] // n if inp.dim() else 0] * n
    rows_out = list(out_splits) if out_splits else [output.shape[0] // n if output.dim() else 0] * n
    if not exchange and (inp.dim() == 0 or inp.shape[0] % n or output.shape[0] % n):
        raise ValueError(f"all_to_all_single: with equal splits dim 0 ({tuple(inp.shape)} / {tuple(output.shape)}) "
                         f"must divide by the world size {n}")
    flat_out = output.reshape(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
    offsets = [sum(rows_out[:j]) * row_out for j in range(n)]

    def write(j: int, piece: torch.Tensor) -> None:
        flat_out[offsets[j]:offsets[j] + piece.numel()].copy_(piece)

    h, then = all_to_all_flat(engine, inp.detach().reshape(-1), [r * row_in for r in rows_in],
                              [r * row_out for r in rows_out], write, me, exchange)
    copy_back = None if output.is_contiguous() else (lambda: output.copy_(flat_out.view(output.shape)))
    return h, _chain(then, copy_back)


def all_to_all(engine: Engine, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               me: int, n: int) -> tuple[Handle, Then]:
    if len(outputs) != n or len(inputs) != n:
        raise ValueError(f"all_to_all: {len(outputs)} outputs and {len(inputs)} inputs, need the world size {n} each")
    dtypes = {t.dtype for t in [*outputs, *inputs]}
    if len(dtypes) != 1:
        raise ValueError(f"all_to_all: every tensor must have one dtype, got {sorted(map(str, dtypes))}")
    inp = torch.cat([x.detach().reshape(-1) for x in inputs])

    def write(j: int, piece: torch.Tensor) -> None:
        outputs[j].copy_(piece.view(outputs[j].shape))

    return all_to_all_flat(engine, inp, [x.numel() for x in inputs], [o.numel() for o in outputs], write, me, True)


# -- coalesced forms: one op per dtype ---------------------------------------------------


def _by_dtype(indices: Sequence[int], dtypes: Sequence[torch.dtype]) -> list[list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i in indices:
        groups.setdefault(dtypes[i], []).append(i)
    return list(groups.values())


def _split_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    off = 0
    for t in targets:
        t.copy_(flat[off:off + t.numel()].view(t.shape))
        off += t.numel()


def _splitter(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> Callable[[], None]:
    """The step that copies consecutive parts of ``flat`` into ``targets``."""
    return lambda: _split_into(flat, targets)


def allreduce_coalesced(engine: Engine, tensors: Sequence[torch.Tensor], op: str) -> tuple[Handle, Then]:
    handles, steps = [], []
    for group in _by_dtype(range(len(tensors)), [t.dtype for t in tensors]):
        ts = [tensors[i] for i in group]
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        wire, wop, wb = for_reduce(flat, op, "all_reduce_coalesced")
        handles.append(engine.allreduce(wire, wop))
        steps.append(_chain(wb, _splitter(flat, ts)))
    return AllOf(handles, "all_reduce_coalesced"), _chain(*steps)


def allgather_coalesced(engine: Engine, output_lists: Sequence[Sequence[torch.Tensor]],
                        inputs: Sequence[torch.Tensor], n: int, what: str) -> tuple[Handle, Then]:
    """``output_lists[k][r]`` gets rank r's ``inputs[k]``."""
    handles, steps = [], []
    for group in _by_dtype(range(len(inputs)), [t.dtype for t in inputs]):
        ins = [inputs[i] for i in group]
        flat = torch.cat([t.detach().reshape(-1) for t in ins])
        outs = [torch.empty_like(flat) for _ in range(n)]
        h, unpack = allgather_into(engine, outs, flat)
        handles.append(h)

        steps.append(_chain(unpack, *[_splitter(outs[r], [output_lists[i][r] for i in group]) for r in range(n)]))
    return AllOf(handles, what), _chain(*steps)


def reduce_scatter_coalesced(engine: Engine, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                             op: str, n: int) -> tuple[Handle, Then]:
    """``outputs[k]`` gets the reduction of chunk ``my rank`` of every rank's ``inputs[k]``."""
    handles, steps = [], []
    for group in _by_dtype(range(len(inputs)), [t.dtype for t in inputs]):
        outs = [outputs[i] for i in group]
        for i in group:
            if inputs[i].numel() != n * outputs[i].numel():
                raise ValueError(f"reduce_scatter_tensor_coalesced: input {i} has {inputs[i].numel()} elements, need "
                                 f"world size {n} x output {outputs[i].numel()}")
        chunks = [torch.cat([inputs[i].detach().reshape(-1)[r * outputs[i].numel():(r + 1) * outputs[i].numel()]
                             for i in group]) for r in range(n)]
        flat = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype)
        wire, wop, wb = for_reduce(flat, op, "reduce_scatter_tensor_coalesced")
        wires = [for_reduce(c, op, "reduce_scatter_tensor_coalesced")[0] for c in chunks]
        handles.append(engine.reduce_scatter(wire, wires, wop))
        steps.append(_chain(wb, _splitter(flat, outs)))
    return AllOf(handles, "reduce_scatter_tensor_coalesced"), _chain(*steps)


# -- point-to-point with oneself ----------------------------------------------------------


class SelfMailbox:
    """send/recv where the peer is this rank (torch allows it; ``batch_isend_irecv`` lists
    do it): a copy kept here, matched by tag in order, never through the Communicator
    (whose one op thread would wait on a receive that only a later send of the same
    thread could satisfy)."""

    def __init__(self, member_id: str) -> None:
        import threading

        self.member_id = member_id
        self._cond = threading.Condition()
        self._boxes: dict[int, list[torch.Tensor]] = {}

    def send(self, t: torch.Tensor, tag: int) -> Handle:
        with self._cond:
            self._boxes.setdefault(tag, []).append(t.detach().clone())
            self._cond.notify_all()
        return _SelfHandle(self, None, tag)

    def recv(self, t: torch.Tensor, tag: int) -> Handle:
        return _SelfHandle(self, t, tag)


class _SelfHandle:
    def __init__(self, box: SelfMailbox, target: torch.Tensor | None, tag: int) -> None:
        self.box, self.target, self.tag = box, target, tag
        self.contributors: tuple[str, ...] = (box.member_id,)
        self._done = target is None

    def wait(self, timeout: float | None = None) -> bool:
        if self._done or self.target is None:
            return True
        with self.box._cond:
            if not self.box._cond.wait_for(lambda: self.box._boxes.get(self.tag), timeout):
                return False
            self.target.copy_(self.box._boxes[self.tag].pop(0).view(self.target.shape))
        self._done = True
        return True

    def is_completed(self) -> bool:
        if not self._done:
            with self.box._cond:
                return bool(self.box._boxes.get(self.tag))
        return True
