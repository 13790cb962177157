"""One op spec per collective: its input checks, its ledger layout for the op's members
(which algorithm, which pieces: :mod:`.algorithms.select`) and how the finished ledger
becomes the result.

Adding a collective: one spec class here (``layout`` and ``finish``) plus its public
method in :mod:`.communicator`. Failure behaviour: ``layout`` raises
:class:`~resilient.errors.GroupChanged` (through the ``check_group`` callback, which first
tells every member) for an op with one buffer per member over a changed group, and
:class:`~resilient.errors.DataLost` for a broadcast whose root is gone; bad inputs raise
:class:`~resilient.errors.ConfigError` naming the input; ``finish`` does not fail.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from resilient.collectives.algorithms import select
from resilient.collectives.algorithms.base import Algorithm
from resilient.collectives.buffers import BufferPool
from resilient.collectives.group import EpochLike
from resilient.collectives.ledger import Ledger
from resilient.collectives.recovery import PieceKind, members_of
from resilient.device import device_ops, whole
from resilient.errors import ConfigError, DataLost
from resilient.kernels import ReduceOp
from resilient.kernels.copy import copy_into

#: ``check_group(n0, members, seq, kind, what)``: raise GroupChanged (after telling every
#: member) when ``members`` is not the ``n0`` members the op's buffers were made for
GroupCheck = Callable[[int, list[str], int, str, str], None]


DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}


def as_tensor(x: Any, what: str) -> torch.Tensor:
    """``x`` (a CPU or CUDA tensor, or a numpy array, of a supported dtype) as a tensor;
    ConfigError otherwise (other devices: :func:`resilient.device.device_ops` names the fix)."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            import numpy as np

            if isinstance(x, np.ndarray):
                t = torch.from_numpy(x)
            else:
                raise TypeError
        except TypeError:
            raise ConfigError(f"{what} must be a torch tensor or a numpy array, got {type(x).__name__}") from None
    if t.device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} is on {t.device}; the communicator takes CPU or CUDA tensors: move it with .cpu()")
    if t.dtype not in DTYPES:
        raise ConfigError(f"{what} has dtype {t.dtype}; supported: float32, float64, float16, bfloat16, int32, int64")
    return t


def digest(desc: dict[str, Any]) -> int:
    """The descriptor digest every frame of the op carries (members compare it)."""
    return zlib.crc32(json.dumps(desc, sort_keys=True).encode())


@dataclass(frozen=True)
class OpResult:
    contributors: tuple[str, ...]
    piece_contributors: list[tuple[str, ...]] | None = None
    recovered: bool = False


class OpSpec(Protocol):
    """One collective call: ``layout`` builds the ledger and algorithm for the op's
    current members (called again when recovery reruns the op)."""

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]: ...


def result_of(L: Ledger) -> OpResult:
    """The contributor sets of a finished ledger (per piece when they differ)."""
    need = L.need or [L.full] * len(L.pieces)
    if L.want is not None:  # reduce_scatter: this member's output is its own chunk only
        need = [m for m, w in zip(need, L.want) if w == L.me] or need
    sets = [tuple(members_of(m, L.members)) for m in need]
    uniq = set(sets)
    if len(uniq) <= 1:
        return OpResult(sets[0] if sets else tuple(L.members), None, False)
    union = tuple(m for m in L.members if any(m in s for s in sets))
    return OpResult(union, sets, False)


def on_device(t: torch.Tensor, body: Callable[[], OpResult]) -> Callable[[], OpResult]:
    """The op body for tensor ``t`` (call on the caller's thread). CPU: ``body`` itself.
    CUDA: the device's op stream first waits for the caller's pending work (enqueued now,
    no host wait), the body's torch work runs on that stream, and the op synchronizes the
    device before its Work completes (the result is ready on any stream then)."""
    if t.device.type == "cpu":
        return body
    ops = device_ops(t.device)
    ops.wait_for_caller()

    def run() -> OpResult:
        with ops.op_stream():
            res = body()
        ops.synchronize()
        return res
    return run


def ledger_on_device(L: Ledger, algo: Algorithm, device: torch.device,
                     sizing: select.Sizing) -> tuple[Ledger, Algorithm]:
    """Give ``L`` its device's buffer ops and, when the op is staged (CUDA, or
    ``staging=True``) and ``algo`` can stage, the staged chunk size. An op on an algorithm
    that cannot stage (the leaf paths of demoted members) runs on whole-tensor host copies
    of its ledger's buffers (:mod:`resilient.device.whole`; ``finish`` copies the result
    back to the caller's tensor) when it is CUDA or staging is forced; a plain CPU op runs
    direct."""
    if not algo.capabilities.staged and whole.needs_staging(L.out, sizing.staging):
        L.inp, L.out = whole.to_host(L.inp), whole.to_host(L.out)
        L.ops, L.stage_elems = device_ops("cpu"), 0
        return L, algo
    L.ops = device_ops(device)
    L.stage_elems = sizing.stage_elems(device, L.out.element_size()) if algo.capabilities.staged else 0
    return L, algo


def finish_avg(L: Ledger, op: ReduceOp) -> torch.Tensor:
    """The result to hand out (the ledger keeps the undivided sums: a slower survivor
    may still need them to finish this op)."""
    if op is not ReduceOp.AVG:
        return L.out
    res = L.out.clone()
    need = L.need or [L.full] * len(L.pieces)
    for p, m in enumerate(need):
        s, e = L.pieces[p]
        v = res[s:e]
        k = bin(m).count("1")
        if v.is_floating_point():
            v.div_(k)
        else:
            v.copy_(torch.div(v, k, rounding_mode="trunc"))
    return res


class AllreduceOp:
    """allreduce (and barrier: one int32 zero) of ``t`` in place."""

    def __init__(self, kind: str, t: torch.Tensor, op: ReduceOp, pool: BufferPool, sizing: select.Sizing) -> None:
        self.kind, self.t, self.op, self.pool, self.sizing = kind, t, op, pool, sizing.for_device(t.device)
        self.ops = device_ops(t.device)
        if t.is_contiguous():
            self.inp = t.detach().view(-1)  # the ledger's kept input: t is not written before the op completes
        else:
            self.inp = pool.take(t.numel(), t.dtype, self.ops)
            self.inp.copy_(t.detach().reshape(-1))

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]:
        inp = self.inp
        pieces, algo = select.allreduce(members, epoch, inp.numel(), inp.element_size(), self.sizing)
        L, algo = ledger_on_device(Ledger(seq, self.kind, tuple(members), me, epoch.number, digest, inp,
                                          self.pool.take(inp.numel(), inp.dtype, self.ops), pieces),
                                   algo, self.t.device, self.sizing)
        # the result may go straight into the caller's tensor: the kept input is a view of it
        # (not a staged copy, not the copy of a strided tensor), and AVG divides at the end
        L.deliver = (L.inp is self.inp and self.t.is_contiguous() and self.op is not ReduceOp.AVG
                     and self.t.device.type == "cpu")
        return L, algo

    def finish(self, L: Ledger) -> OpResult:
        if not L.delivered:   # else the algorithm wrote the result into t (inp is t's view)
            copy_into(self.t, finish_avg(L, self.op).view(self.t.shape))
        return result_of(L)


class ReduceScatterOp:
    def __init__(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, n0: int, sizing: select.Sizing,
                 check_group: GroupCheck) -> None:
        if len(ins) != n0:
            raise ConfigError(f"reduce_scatter needs one input per member ({n0}), got {len(ins)}")
        for i, x in enumerate(ins):
            if x.shape != out.shape or x.dtype != out.dtype:
                raise ConfigError(f"reduce_scatter input {i} is {tuple(x.shape)}/{x.dtype}, output is "
                                  f"{tuple(out.shape)}/{out.dtype}")
        if any(x.device != out.device for x in ins):
            raise ConfigError(f"reduce_scatter inputs and output must be on one device (output on {out.device})")
        self.out, self.op, self.n0, self.sizing, self.check_group = out, op, n0, sizing.for_device(out.device), check_group
        self.inp = torch.cat([x.detach().reshape(-1) for x in ins]) if ins else out.reshape(-1).clone()
        self.m = out.numel()

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]:
        self.check_group(self.n0, members, seq, "reduce_scatter", "input")
        lay = select.per_member("reduce_scatter", members, epoch, self.n0, self.m, self.out.element_size(), self.sizing)
        want: list[int | None] = list(lay.owner)
        return ledger_on_device(Ledger(seq, "reduce_scatter", tuple(members), me, epoch.number, digest, self.inp,
                                torch.empty_like(self.inp), lay.pieces, want=want), lay.algorithm, self.out.device,
                         self.sizing)

    def finish(self, L: Ledger) -> OpResult:
        res, m = finish_avg(L, self.op), self.m
        copy_into(self.out, res[L.me * m:(L.me + 1) * m].view(self.out.shape))
        return result_of(L)


class AllgatherOp:
    def __init__(self, outs: list[torch.Tensor], t: torch.Tensor, n0: int, sizing: select.Sizing,
                 check_group: GroupCheck) -> None:
        if len(outs) != n0:
            raise ConfigError(f"allgather needs one output per member ({n0}), got {len(outs)}")
        if any(o.device != t.device for o in outs):
            raise ConfigError(f"allgather outputs must be on the input's device ({t.device})")
        self.outs, self.t, self.n0, self.sizing, self.check_group = outs, t, n0, sizing.for_device(t.device), check_group
        self.m = t.numel()
        self.own = t.detach().reshape(-1).clone()

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]:
        self.check_group(self.n0, members, seq, "allgather", "output")
        n, m = self.n0, self.m
        lay = select.per_member("allgather", members, epoch, n, m, self.t.element_size(), self.sizing)
        out = torch.empty(n * m, dtype=self.t.dtype, device=self.t.device)
        L = Ledger(seq, "allgather", tuple(members), me, epoch.number, digest, self.own, out, lay.pieces,
                   piece_kind=PieceKind.COPY, owners=lay.owner, inp_offset=lay.offset)
        out[me * m:(me + 1) * m].copy_(self.own)
        for p, o in enumerate(lay.owner):
            if o == me:
                L.set(p, 1 << me)
        return ledger_on_device(L, lay.algorithm, self.t.device, self.sizing)

    def finish(self, L: Ledger) -> OpResult:
        m = self.m
        for i, o in enumerate(self.outs):
            copy_into(o, L.out[i * m:(i + 1) * m].view(o.shape))
        return OpResult(tuple(L.members))


class BroadcastOp:
    def __init__(self, t: torch.Tensor, root: int, members: list[str], sizing: select.Sizing) -> None:
        if not 0 <= root < len(members):
            raise ConfigError(f"broadcast root {root} is not a rank of this {len(members)}-member group")
        self.t, self.root_id, self.sizing = t, members[root], sizing.for_device(t.device)
        self.inp = t.detach().reshape(-1).clone()

    def layout(self, members: list[str], me: int, seq: int, digest: int, epoch: EpochLike) -> tuple[Ledger, Algorithm]:
        if self.root_id not in members:
            raise DataLost(f"broadcast #{seq}: the root {self.root_id} was lost before any survivor got its data")
        r = members.index(self.root_id)
        inp = self.inp
        pieces, algo = select.broadcast(inp.numel(), inp.element_size(), r, self.sizing)
        return ledger_on_device(Ledger(seq, "broadcast", tuple(members), me, epoch.number, digest, inp, torch.empty_like(inp),
                                pieces, piece_kind=PieceKind.COPY, owners=[r] * len(pieces)), algo, self.t.device,
                         self.sizing)

    def finish(self, L: Ledger) -> OpResult:
        copy_into(self.t, L.out.view(self.t.shape))
        return OpResult((self.root_id,))


def describe(kind: str, t: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """An op's descriptor (every member must call the same): kind, shape, dtype, extras."""
    return {"k": kind, "shape": list(t.shape), "dtype": str(t.dtype), **extra}
