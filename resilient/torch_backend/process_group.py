"""``ResilientProcessGroup``: a ``torch.distributed.ProcessGroup`` over an :class:`~.engine.Engine`.

Supported (CPU and CUDA tensors, every dtype torch takes — see :mod:`.dtypes`): ``all_reduce``
(SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR), ``broadcast``, ``all_gather``,
``all_gather_into_tensor`` (torch 2.13: ``all_gather_single``; alias ``_allgather_base``),
``reduce_scatter`` (lists), ``reduce_scatter_tensor`` (``reduce_scatter_single`` /
``_reduce_scatter_base``), ``reduce``, ``gather``, ``scatter``, ``all_to_all`` and
``all_to_all_single`` (even or uneven splits), the coalesced forms (``allreduce_coalesced``,
``allgather_coalesced``, ``all_gather_single_coalesced``, ``reduce_scatter_single_coalesced``
— what ``_coalescing_manager``, DDP and FSDP issue), ``barrier``, ``send``/``recv`` (``recv_anysource`` too: ``recv(src=None)``); the
object collectives run on these (torch pickles on the caller's side). Ops without a
Communicator primitive are composed in :mod:`.composed`. Each is sync or async
(``async_op=True`` returns a :class:`~.work.ResilientWork` whose ``contributors`` is the
exact member set in the result). ``monitored_barrier``, ``split_group``, tensors on other devices and reduce ops torch does not define for a dtype
raise :class:`UnsupportedOperation` naming the op and what to use instead. CUDA tensors of
the composed ops run on whole-tensor host copies (:mod:`resilient.device.whole`). ``dist.new_group``
is handled by :mod:`.subgroup`.

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

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed.distributed_c10d import GroupName

from resilient.device.whole import WholeStaging
from resilient.errors import UnsupportedOperation as UnsupportedOperation  # re-export: its old import path
from resilient.settings import Settings
from resilient.torch_backend import composed
from resilient.torch_backend.dtypes import NATIVE, Packed, for_reduce
from resilient.torch_backend.composed import Then
from resilient.torch_backend.engine import ElasticEngine, Handle
from resilient.torch_backend.work import ResilientWork, batch_work

if TYPE_CHECKING:  # pragma: no cover
    from resilient.fsdp.plain import PlainShards

BACKEND_NAME = "resilient"


#: torch's reduce ops and the names the engine takes
_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MIN, "min"),
        (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.PRODUCT, "prod"), (dist.ReduceOp.BAND, "band"),
        (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"))


_ReduceOpts = dist.AllreduceOptions | dist.ReduceOptions | dist.ReduceScatterOptions
_RootOpts = dist.BroadcastOptions | dist.ReduceOptions | dist.GatherOptions | dist.ScatterOptions


def _reduce_op_name(op: object, where: str) -> str:
    for torch_op, v in _OPS:
        if op == torch_op:
            return v
    raise UnsupportedOperation(f"{where} with reduce op {op}",
                               "use ReduceOp.SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR or BXOR")


def _op_of(opts: _ReduceOpts | None, where: str) -> str:
    return _reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, where)


def _root(opts: _RootOpts | None) -> int:
    return int(opts.rootRank) if opts is not None else 0


#: what takes CUDA tensors natively (host-staged per chunk or over NCCL; docs/cuda.md); the
#: others take them through whole-tensor host copies (:meth:`ResilientProcessGroup._staging`)
CUDA_OPS = "all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter(_tensor), send/recv"


def _check_cpu(tensors: Sequence[torch.Tensor], where: str, cuda: bool = False) -> None:
    """UnsupportedOperation unless every tensor is on the CPU (or, with ``cuda``, all on
    one CUDA device)."""
    devices = {t.device for t in tensors}
    bad = sorted({d.type for d in devices if d.type != "cpu" and not (cuda and d.type == "cuda")})
    if bad:
        fix = ("use CPU or CUDA tensors" if cuda else
               f"CUDA tensors are supported by {CUDA_OPS}; move the tensors of {where} to CPU")
        raise UnsupportedOperation(f"{where} on a {bad[0]} tensor", fix)
    if len(devices) > 1:
        raise UnsupportedOperation(f"{where} on tensors of several devices",
                                   f"put every tensor of one call on one device (got {sorted(map(str, devices))})")


def _one(tensors: Sequence[torch.Tensor], where: str, cuda: bool = False) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedOperation(f"{where} with {len(tensors)} tensors per call",
                                   "pass one tensor (multi-tensor-per-process calls are not supported)")
    _check_cpu(tensors, where, cuda)
    return tensors[0]


def _chunks(flat_owner: torch.Tensor, n: int, shape: torch.Size) -> list[torch.Tensor]:
    """``n`` views of ``shape`` over ``flat_owner`` (contiguous), in rank order."""
    m = shape.numel()
    flat = flat_owner.view(-1)
    return [flat[i * m:(i + 1) * m].view(shape) for i in range(n)]


class ResilientProcessGroup(dist.ProcessGroup):
    """See the module docstring."""

    def __init__(self, engine: ElasticEngine, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch binds (rank, size) too
        self.engine = engine
        #: the name torch gives the group once created (:meth:`_set_group_name`)
        self._group_name: str | None = None
        #: the Works issued since ``_start_coalescing`` (None: not coalescing)
        self._coalesced: list[ResilientWork] | None = None
        #: RESILIENT_STAGING, read once here rather than on every op
        self._stage_forced = Settings.from_env().staging
        #: ``after_op(error or None)``: called when each op of this group completes (set by
        #: :mod:`resilient.fsdp` on HSDP groups: a broken replica group's member steps aside)
        self.after_op: Callable[[BaseException | None], None] | None = None
        #: ``before_allreduce(tensor) -> issued(work) | None``: called before an all_reduce
        #: starts (set by :mod:`resilient.fsdp` on replicate groups: the step ledger)
        self.before_allreduce: Callable[[torch.Tensor], Callable[[ResilientWork], None] | None] | None = None
        #: a plain FSDP shard group's logical members and hosted shards (set by
        #: :mod:`resilient.fsdp.plain`): rank and size stay those FSDP sharded over
        self.shards: PlainShards | None = None

    def _staging(self) -> WholeStaging:
        """Host copies for a composed op (CUDA tensors; CPU ones too with RESILIENT_STAGING=1)."""
        return WholeStaging(self._stage_forced)

    # -- coalescing (``dist._coalescing_manager(group, device)``) ------------------------

    def _issued(self, work: ResilientWork) -> ResilientWork:
        work.after = self.after_op
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _start_coalescing(self, device: torch.device) -> None:
        """``_coalescing_manager(group, device)`` begins: the ops until
        :meth:`_end_coalescing` are issued as usual (each with its own fault contract)
        and collected. Raises ValueError when a coalescing block is already open."""
        if self._coalesced is not None:
            raise ValueError("ProcessGroup 'resilient' is already coalescing (nested _coalescing_manager)")
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> ResilientWork:
        """One Work over every op issued since :meth:`_start_coalescing` (torch's coalesced
        op, or a batch of isend/irecv): ``wait()`` completes them all and re-raises the
        first error; ``contributors`` is the union of theirs (a coalesced collective: its
        own set). Raises ValueError without a matching start."""
        works, self._coalesced = self._coalesced, None
        if works is None:
            raise ValueError("_end_coalescing without _start_coalescing on ProcessGroup 'resilient'")
        return batch_work(works)

    # -- identity ---------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    @property
    def name(self) -> str:  # type: ignore[override]  # torch: overloads
        return BACKEND_NAME

    def _set_group_name(self, name: GroupName) -> None:  # torch names every group after creating it
        self._group_name = name
        try:
            super()._set_group_name(name)
        except RuntimeError:  # no C++ backend registered under a Python process group
            pass

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch: overloads
        return self._group_name if self._group_name is not None else super().group_name

    def rank(self) -> int:
        return self.engine.world().rank if self.shards is None else self.shards.logical_rank

    def size(self) -> int:
        return self.engine.world().size if self.shards is None else self.shards.logical_size

    # -- collectives ------------------------------------------------------------------

    def _work(self, pair: tuple[Handle, Then], result: object, st: WholeStaging | None = None) -> ResilientWork:
        """``st``: the call's whole-tensor host copies, written back once it completed."""
        handle, then = pair
        return self._issued(ResilientWork(handle, result, then if st is None else st.then(then)))

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None) -> ResilientWork:  # type: ignore[override]  # torch: overloads
        t = _one(tensors, "all_reduce", cuda=True)
        wire, op, wb = for_reduce(t, _op_of(opts, "all_reduce"), "all_reduce")
        issued = None if self.before_allreduce is None else self.before_allreduce(t)
        work = self._issued(ResilientWork(self.engine.allreduce(wire, op), list(tensors), wb))
        if issued is not None:
            issued(work)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions | None = None) -> ResilientWork:  # type: ignore[override]  # torch: overloads
        t = _one(tensors, "broadcast", cuda=True)
        p = Packed(t)
        return self._issued(ResilientWork(self.engine.broadcast(p.wire, _root(opts)), list(tensors), None if p.native else p.unpack))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]  # torch: overloads
                  opts: AllgatherOptions | None = None) -> ResilientWork:
        inp = _one(input_tensors, "all_gather", cuda=True)
        if len(output_tensors) != 1:
            raise UnsupportedOperation("all_gather with several input tensors per process")
        _check_cpu([inp, *output_tensors[0]], "all_gather", cuda=True)
        return self._issued(self._work(composed.allgather_into(self.engine, output_tensors[0], inp), output_tensors))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> ResilientWork:  # noqa: A002 - torch's names
        _check_cpu([output, input], "all_gather_into_tensor", cuda=True)
        n = self.size()
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, need world size "
                             f"{n} x input {input.numel()}; size the output from dist.get_world_size()")
        target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        slots = _chunks(target, n, input.shape)
        back = None if target is output else (lambda: output.copy_(target))
        if self.shards is not None:  # plain FSDP: lost members' slots come from their hosts
            return self._issued(self.shards.all_gather(target, input, back,
                                                       lambda: composed.allgather_into(self.engine, slots, input)))
        h, then = composed.allgather_into(self.engine, slots, input)
        return self._issued(ResilientWork(h, [output], composed._chain(then, back)))

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]  # torch: overloads
                       opts: dist.ReduceScatterOptions | None = None) -> ResilientWork:
        out = _one(output_tensors, "reduce_scatter", cuda=True)
        if len(input_tensors) != 1:
            raise UnsupportedOperation("reduce_scatter with several output tensors per process")
        ins = input_tensors[0]
        _check_cpu([out, *ins], "reduce_scatter", cuda=True)
        op = _op_of(opts, "reduce_scatter")
        wire, wop, wb = for_reduce(out, op, "reduce_scatter")
        wires = [for_reduce(x, op, "reduce_scatter")[0] for x in ins]
        return self._issued(ResilientWork(self.engine.reduce_scatter(wire, wires, wop), output_tensors, wb))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: dist.ReduceScatterOptions | None = None) -> ResilientWork:  # noqa: A002
        _check_cpu([output, input], "reduce_scatter_tensor", cuda=True)
        n = self.size()
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, need world size "
                             f"{n} x output {output.numel()}; size the input from dist.get_world_size()")
        op = _op_of(opts, "reduce_scatter_tensor")

        def start() -> tuple[Handle, Then]:
            ins = _chunks(input.detach().contiguous(), n, output.shape)
            wire, wop, wb = for_reduce(output, op, "reduce_scatter_tensor")
            wires = [for_reduce(x, op, "reduce_scatter_tensor")[0] for x in ins]
            return self.engine.reduce_scatter(wire, wires, wop), wb
        if self.shards is not None:  # plain FSDP: kept for a redo; lost members' chunks to their hosts
            return self._issued(self.shards.reduce_scatter(output, input, op, start))
        return self._work(start(), [output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # torch: other param names

    def reduce(self, tensors: list[torch.Tensor], opts: dist.ReduceOptions | None = None) -> ResilientWork:  # type: ignore[override]  # torch: overloads
        t, st = _one(tensors, "reduce", cuda=True), self._staging()
        pair = composed.reduce(self.engine, st.host(t, True), _op_of(opts, "reduce"), _root(opts), self.rank())
        return self._issued(self._work(pair, list(tensors), st))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]  # torch: overloads
               opts: dist.GatherOptions | None = None) -> ResilientWork:
        inp, st = _one(input_tensors, "gather", cuda=True), self._staging()
        outs = output_tensors[0] if output_tensors else []
        _check_cpu([inp, *outs], "gather", cuda=True)
        pair = composed.gather(self.engine, st.hosts(outs, True), st.host(inp), _root(opts), self.rank(), self.size())
        return self._issued(self._work(pair, output_tensors, st))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]  # torch: overloads
                opts: dist.ScatterOptions | None = None) -> ResilientWork:
        out, st = _one(output_tensors, "scatter", cuda=True), self._staging()
        ins = input_tensors[0] if input_tensors else []
        _check_cpu([out, *ins], "scatter", cuda=True)
        pair = composed.scatter(self.engine, st.host(out, True), st.hosts(ins), _root(opts), self.rank(), self.size())
        return self._issued(self._work(pair, output_tensors, st))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,  # type: ignore[override]  # torch: overloads
                      input_split_sizes: list[int] | None, opts: dist.AllToAllOptions | None = None) -> ResilientWork:  # noqa: A002
        _check_cpu([output, input], "all_to_all_single", cuda=True)
        st = self._staging()
        pair = composed.all_to_all_single(self.engine, st.host(output, True), st.host(input),
                                          list(output_split_sizes or []), list(input_split_sizes or []),
                                          self.rank(), self.size())
        return self._issued(self._work(pair, [output], st))

    all_to_all_single = alltoall_base  # type: ignore[assignment]  # torch: other param names

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],  # type: ignore[override]  # torch: overloads
                 opts: dist.AllToAllOptions | None = None) -> ResilientWork:
        _check_cpu([*output_tensors, *input_tensors], "all_to_all", cuda=True)
        st = self._staging()
        pair = composed.all_to_all(self.engine, st.hosts(output_tensors, True), st.hosts(input_tensors),
                                   self.rank(), self.size())
        return self._issued(self._work(pair, output_tensors, st))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions | None = None) -> ResilientWork:
        _check_cpu(tensors, "all_reduce_coalesced", cuda=True)
        st = self._staging()
        pair = composed.allreduce_coalesced(self.engine, st.hosts(tensors, True), _op_of(opts, "all_reduce_coalesced"))
        return self._issued(self._work(pair, list(tensors), st))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: AllgatherOptions | None = None) -> ResilientWork:
        _check_cpu([*input_list, *[t for lst in output_lists for t in lst]], "all_gather_coalesced", cuda=True)
        st = self._staging()
        n = self.size()
        if len(output_lists) != n or any(len(lst) != len(input_list) for lst in output_lists):
            raise ValueError(f"all_gather_coalesced: need world size {n} output lists (one per rank) of "
                             f"{len(input_list)} tensors (one per input)")
        by_input = [st.hosts([output_lists[r][k] for r in range(n)], True) for k in range(len(input_list))]
        pair = composed.allgather_coalesced(self.engine, by_input, st.hosts(input_list), n, "all_gather_coalesced")
        return self._issued(self._work(pair, output_lists, st))

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: AllgatherOptions | None = None) -> ResilientWork:
        _check_cpu([*outputs, *inputs], "all_gather_into_tensor_coalesced", cuda=True)
        st = self._staging()
        n = self.size()
        for o, i in zip(outputs, inputs):
            if o.numel() != n * i.numel() or not o.is_contiguous():
                raise ValueError(f"all_gather_into_tensor_coalesced: each output must be contiguous with world size "
                                 f"{n} x its input's elements ({o.numel()} vs {i.numel()})")
        lists = [_chunks(st.host(o, True), n, i.shape) for o, i in zip(outputs, inputs)]
        pair = composed.allgather_coalesced(self.engine, lists, st.hosts(inputs), n, "all_gather_into_tensor_coalesced")
        return self._issued(self._work(pair, list(outputs), st))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # torch: other param names

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: dist.ReduceScatterOptions | None = None) -> ResilientWork:
        _check_cpu([*outputs, *inputs], "reduce_scatter_tensor_coalesced", cuda=True)
        st = self._staging()
        pair = composed.reduce_scatter_coalesced(self.engine, st.hosts(outputs, True), st.hosts(inputs),
                                                 _op_of(opts, "reduce_scatter_tensor_coalesced"), self.size())
        return self._issued(self._work(pair, list(outputs), st))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # torch: other param names

    def barrier(self, opts: dist.BarrierOptions | None = None) -> ResilientWork:  # type: ignore[override]  # torch: overloads
        return self._issued(ResilientWork(self.engine.barrier(), None))

    def _mailbox(self) -> composed.SelfMailbox:
        box = self.__dict__.get("_self_box")
        if box is None:
            box = self.__dict__["_self_box"] = composed.SelfMailbox(self.engine.world().member_id)
        return box

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> ResilientWork:
        t = _one(tensors, "send")
        if int(dst_rank) == self.rank():
            return self._issued(ResilientWork(self._mailbox().send(t, int(tag)), list(tensors)))
        # a native dtype goes as itself, contiguous or not (the point-to-point layer copies), so a
        # strided send matches a contiguous receive; other dtypes as bytes on both sides
        wire = t if t.dtype in NATIVE else Packed(t).wire
        return self._issued(ResilientWork(self.engine.send(wire, int(dst_rank), int(tag)), list(tensors)))

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> ResilientWork:
        t = _one(tensors, "recv")
        if int(src_rank) == self.rank():
            return self._issued(ResilientWork(self._mailbox().recv(t, int(tag)), list(tensors)))
        return self._issued(self._receive(tensors, lambda buf: self.engine.recv(buf, int(src_rank), int(tag))))

    def _receive(self, tensors: list[torch.Tensor], post: Callable[[torch.Tensor], Handle]) -> ResilientWork:
        """A receive into ``tensors[0]``: a native dtype as itself (as in send: written in place,
        or copied in when complete, strided), other dtypes as packed bytes unpacked after."""
        t = _one(tensors, "recv")
        if t.dtype in NATIVE:
            return ResilientWork(post(t), list(tensors))
        p = Packed(t, fill=False)
        return ResilientWork(post(p.wire), list(tensors), p.unpack)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> ResilientWork:
        """``recv(src=None)``: the first message from any other rank (``PointToPoint.recv_any``);
        ``work._source_rank()`` is the sender's rank in this group."""
        members = self.engine.world().members
        work = self._receive(tensors, lambda buf: self.engine.recv_any(buf, int(tag)))

        def sender() -> int:
            peer = work.contributors[0]
            live = self.engine.world().members
            return live.index(peer) if peer in live else members.index(peer)

        work.sender_rank = sender
        return self._issued(work)

    # -- not supported: name the op ----------------------------------------------------

    def monitored_barrier(self, *args: object, **kwargs: object) -> ResilientWork:
        raise UnsupportedOperation("monitored_barrier", "use barrier (a dead member is detected by the "
                                   "control plane and the barrier completes with the survivors)")

    def split_group(self, *args: object, **kwargs: object) -> ResilientProcessGroup:
        raise UnsupportedOperation("split_group", "use dist.new_group(ranks)")

    def shutdown(self) -> None:
        self.engine.close()

    def abort(self) -> None:
        self.engine.close()

