"""``ResilientProcessGroup``: a ``torch.distributed.ProcessGroup`` over an :class:`~.engine.Engine`.

Supported (CPU tensors): ``all_reduce`` (SUM, AVG, MIN, MAX, PRODUCT), ``broadcast``,
``all_gather``, ``all_gather_into_tensor`` (torch 2.13 calls it ``all_gather_single``;
the older ``_allgather_base`` name is kept as an alias), ``reduce_scatter_tensor``
(``reduce_scatter_single`` / ``_reduce_scatter_base``), ``reduce_scatter`` (lists),
``barrier``, ``send``/``recv``, each sync or async (``async_op=True`` returns a
:class:`~.work.ResilientWork` whose ``contributors`` is the exact member set in the
result). Every other op raises :class:`UnsupportedOperation` naming the op and what to use
instead; so do CUDA tensors and reduce ops other than the five above.

Ranks and sizes: ``rank()`` / ``size()`` — hence ``dist.get_rank()`` /
``dist.get_world_size()`` — are the live values of the newest epoch (see
:mod:`resilient.live_world`), not the launch-time ones. Ranks passed to ``broadcast(src=)``,
``send(dst=)``, ``recv(src=)`` are ranks of that live world.

Failure behaviour: a member that dies during an op is handled by the engine (the op is
finished by the survivors; ``contributors`` shrinks). An op that cannot deliver its
contract raises :class:`~resilient.errors.CollectiveError` from ``wait()`` (and fails the
future of ``get_future()``). A member removed from the job gets
:class:`~resilient.errors.RemovedFromGroup` from every call.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from resilient.errors import ResilientError
from resilient.torch_backend.engine import Engine
from resilient.torch_backend.work import ResilientWork

BACKEND_NAME = "resilient"


class UnsupportedOperation(ResilientError, NotImplementedError):
    """A ``torch.distributed`` op or argument the resilient backend does not implement."""

    def __init__(self, op: str, hint: str = "") -> None:
        msg = f"the 'resilient' torch.distributed backend does not support {op}"
        super().__init__(msg + (f"; {hint}" if hint else ""))
        self.op = op


def _reduce_op_name(op: object, where: str) -> str:
    table = {
        dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "prod",
    }
    for k, v in table.items():
        if op == k:
            return v
    raise UnsupportedOperation(f"{where} with reduce op {op}",
                               "use ReduceOp.SUM, AVG, MIN, MAX or PRODUCT")


def _check_cpu(tensors: Sequence[torch.Tensor], where: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise UnsupportedOperation(f"{where} on a {t.device.type} tensor",
                                       "the resilient backend handles CPU tensors; move the tensor to CPU "
                                       "or use init_process_group('cpu:resilient,cuda:nccl')")


def _one(tensors: Sequence[torch.Tensor], where: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedOperation(f"{where} with {len(tensors)} tensors per call",
                                   "pass one tensor (multi-tensor-per-process calls are not supported)")
    _check_cpu(tensors, where)
    return tensors[0]


class ResilientProcessGroup(dist.ProcessGroup):
    """See the module docstring."""

    def __init__(self, engine: Engine, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.engine = engine

    # -- identity ---------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    @property
    def name(self) -> str:  # type: ignore[override]
        return BACKEND_NAME

    def rank(self) -> int:  # type: ignore[override]
        return self.engine.world().rank

    def size(self) -> int:  # type: ignore[override]
        return self.engine.world().size

    # -- collectives ------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        t = _one(tensors, "all_reduce")
        op = _reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        return ResilientWork(self.engine.allreduce(t, op), list(tensors))

    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        t = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        return ResilientWork(self.engine.broadcast(t, int(root)), list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        inp = _one(input_tensors, "all_gather")
        if len(output_tensors) != 1:
            raise UnsupportedOperation("all_gather with several input tensors per process")
        outs = output_tensors[0]
        _check_cpu(outs, "all_gather")
        return ResilientWork(self.engine.allgather(outs, inp), output_tensors)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        _check_cpu([output, input], "all_gather_into_tensor")
        n = self.size()
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, need world size "
                             f"{n} x input {input.numel()}; size the output from dist.get_world_size()")
        chunks = list(output.view(-1).chunk(n)) if input.numel() else [output.view(-1)[:0]] * n
        chunks = [c.view(input.shape) for c in chunks]
        return ResilientWork(self.engine.allgather(chunks, input), [output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        out = _one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1:
            raise UnsupportedOperation("reduce_scatter with several output tensors per process")
        ins = input_tensors[0]
        _check_cpu(ins, "reduce_scatter")
        op = _reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        return ResilientWork(self.engine.reduce_scatter(out, ins, op), output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        _check_cpu([output, input], "reduce_scatter_tensor")
        n = self.size()
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, need world size "
                             f"{n} x output {output.numel()}; size the input from dist.get_world_size()")
        op = _reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        ins = [c.view(output.shape) for c in input.reshape(-1).chunk(n)] if output.numel() else \
            [input.reshape(-1)[:0].view(output.shape)] * n
        return ResilientWork(self.engine.reduce_scatter(output, ins, op), [output])

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):  # type: ignore[override]
        return ResilientWork(self.engine.barrier(), None)

    def send(self, tensors, dst_rank, tag=0):  # type: ignore[override]
        t = _one(tensors, "send")
        return ResilientWork(self.engine.send(t, int(dst_rank), int(tag)), list(tensors))

    def recv(self, tensors, src_rank, tag=0):  # type: ignore[override]
        t = _one(tensors, "recv")
        return ResilientWork(self.engine.recv(t, int(src_rank), int(tag)), list(tensors))

    # -- not supported: name the op ----------------------------------------------------

    def recv_anysource(self, tensors, tag=0):  # type: ignore[override]
        raise UnsupportedOperation("recv from any source (recv with src=None)", "pass src=<rank>")

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        raise UnsupportedOperation("reduce", "use all_reduce (every rank gets the result)")

    def gather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        raise UnsupportedOperation("gather", "use all_gather")

    def scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        raise UnsupportedOperation("scatter", "use broadcast, or reduce_scatter_tensor")

    def alltoall(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("all_to_all")

    def alltoall_base(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("all_to_all_single")

    all_to_all_single = alltoall_base

    def allreduce_coalesced(self, tensors, opts=None):  # type: ignore[override]
        raise UnsupportedOperation("all_reduce_coalesced", "call all_reduce per tensor or flatten them")

    def allgather_coalesced(self, output_lists, input_list, opts=None):  # type: ignore[override]
        raise UnsupportedOperation("all_gather_coalesced", "call all_gather per tensor")

    def all_gather_single_coalesced(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("all_gather_into_tensor_coalesced", "call all_gather_into_tensor per tensor")

    def reduce_scatter_single_coalesced(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("reduce_scatter_tensor_coalesced", "call reduce_scatter_tensor per tensor")

    def monitored_barrier(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("monitored_barrier", "use barrier (a dead member is detected by the "
                                   "control plane and the barrier completes with the survivors)")

    def new_group(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("new_group / subgroups", "use the default (world) group")

    def split_group(self, *args, **kwargs):  # type: ignore[override]
        raise UnsupportedOperation("split_group", "use the default (world) group")

    def shutdown(self) -> None:  # type: ignore[override]
        self.engine.close()

    def abort(self) -> None:  # type: ignore[override]
        self.engine.close()

