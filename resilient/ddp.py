"""DDP communication hook: average gradients over the members that actually contributed.

**Plain DDP needs nothing.** Once a resilient process group exists,
``DistributedDataParallel(model)`` over it is made exact automatically
(:func:`install_auto_hook`, called when the backend creates a group; the mechanism and
why it was chosen: ``docs/ddp.md``):

* at the model's first forward, if the user has registered no comm hook by then,
  :func:`ddp_comm_hook` is registered (a hook the user registers before the first
  forward is left alone — DDP's C++ reducer accepts only one hook, so ours must come
  last); without it DDP's reducer divides every bucket by ``ProcessGroup.getSize()`` of
  the C++ object, the launch-time world size, so after a death the mean would be
  ``sum/launch_size`` instead of ``sum/contributors``;
* DDP's one-time bucket rebuild runs on the members the job started with, and is skipped
  (see :class:`_NoRebuildReducer`) on a joiner and on a model under
  :class:`resilient.elastic.State` (:func:`hold_layout`): every member then keeps the
  initial layout a joiner builds too;
* on a joiner that has not been admitted yet, the constructor's initial sync
  collectives are skipped (``init_sync=False``): the survivors never run them, and a
  joiner gets its state at admission (``resilient.elastic.State.sync()``) or leaves.

:func:`contributors` returns the member set of the model's last synchronised step.

Compressed gradients: :func:`compression_hook` with an :class:`ErrorFeedback` state (the
exact quantized allreduce, residuals with error feedback, optional adaptive bits and the
automatic switch; ``docs/compression.md``). Registered before the first forward, it
replaces the automatic hook like any user hook.

Explicit use (older code; still works, see :func:`make_elastic` for why the DDP arguments)::

    model = DistributedDataParallel(net, init_sync=False, forward_sync_buffers=False)
    resilient.ddp.make_elastic(model)          # = register_comm_hook(None, ddp_comm_hook) + no bucket rebuild

For every gradient bucket the hook runs a SUM allreduce on the resilient backend and
divides by the number of members whose gradients are in the sum (the op's
``contributors``), so a step during which a member died still yields the exact mean over
the members that were summed (not a sum divided by the launch-time world size, which is
what DDP's default would do).

The hook records each bucket's contributor set in a :class:`ContributorTracker` (the
module-wide :data:`tracker` unless one is passed as ``state``);
``tracker.step_contributors()`` is the set of members whose gradients are in *every*
bucket of the step — what :meth:`ElasticSampler.record_step` needs — and
``tracker.reset()`` starts the next step.

**Uneven members** (speed-weighted batch shares, ``resilient.coordinator.shares``):
:func:`weighted_ddp_comm_hook` with a :class:`SampleCount` state (:func:`make_weighted`)
divides ``sum n_i*g_i`` by ``sum n_i`` over the contributors, so the gradient stays the
exact mean per sample when members process different numbers of samples.

Failure behaviour: a member dying mid-bucket is absorbed by the collective (the bucket's
mean is exact over its contributors; different buckets of one step may then have
different sets, each exact). An op that cannot deliver its contract fails the bucket's
future, and DDP raises the :class:`~resilient.errors.CollectiveError` from ``backward()``;
``State.restore()`` then rolls back to the last commit.
"""


import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP passes a comm hook (dist.GradBucket)
from torch._C._distributed_c10d import Reducer

from resilient.collectives.work import OpOutcome, Work
from resilient.torch_backend import engine_of
from resilient.torch_backend.work import ResilientWork


class ContributorTracker:
    """Contributor sets of the buckets of the current step (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: list[frozenset[str]] = []

    def add(self, contributors: tuple[str, ...]) -> None:
        with self._lock:
            self._sets.append(frozenset(contributors))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the model (``torch.save(ddp_model)``): the sets, not the lock."""
        with self._lock:
            return {"_sets": list(self._sets)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._sets = list(state.get("_sets", []))

    def reset(self) -> None:
        with self._lock:
            self._sets.clear()

    def bucket_sets(self) -> list[frozenset[str]]:
        with self._lock:
            return list(self._sets)

    def step_contributors(self) -> frozenset[str]:
        """Members in every bucket of the step so far (empty if no bucket ran)."""
        with self._lock:
            if not self._sets:
                return frozenset()
            out = self._sets[0]
            for s in self._sets[1:]:
                out = out & s
            return out


#: the tracker the hook uses when registered with ``state=None``
tracker = ContributorTracker()


def ddp_comm_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Allreduce-SUM the bucket, divide by the contributor count (see the module docstring).
    ``state``: ``None`` (default group, module :data:`tracker`), a
    :class:`ContributorTracker`, or a ``(process_group, tracker)`` pair."""
    group, track = None, tracker
    if isinstance(state, ContributorTracker):
        track = state
    elif isinstance(state, tuple):
        group, track = state
    pg = group if group is not None else dist.distributed_c10d._get_default_group()  # noqa: SLF001
    buf = bucket.buffer()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    work = pg.allreduce([buf], opts)

    def divide(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out: torch.Tensor = fut.value()[0]
        if isinstance(work, ResilientWork):  # other backends' Works name no contributors
            members = tuple(work.contributors)
            n = len(members)
        else:  # another backend: no contributor set; DDP's default mean
            members, n = (), pg.size()
        track.add(members)
        return out.div_(max(n, 1))

    return work.get_future().then(divide)


# -- compressed gradients with error feedback (docs/compression.md) --------------------

class ErrorFeedback:
    """State of :func:`compression_hook`: this member's residuals per DDP bucket, the bits
    per bucket (adaptive mode), the contributor tracker and the compression settings.

    Put it in :class:`resilient.elastic.State` as a user field (``State(..., ef=ef)``):
    ``commit()``/``restore()`` keep and roll back the residuals with the model. A state
    that comes from *another* member (a joiner's ``sync()``) loads the shared part only —
    the per-bucket bits — and the residuals start at zero: residuals are this member's
    own delayed gradient, never someone else's.

    ``bucket``: elements per quantization scale. The default, 128, is finer than the
    communicator's 1024: with 4 bits and Adam, 1024 cost 2 % of held-out loss
    (``bench/compression_quality.py``, ``docs/compression.md``); 128 sends 8x more
    scale maxima (at 4 members about 1 % of the fp32 ring's bytes, 4.5 % of q4's).

    ``bits``: 8, 4 or 2 for the compressed part of each bucket (parameters with one
    dimension or fewer than ``min_numel`` elements stay uncompressed, as 32-bit fixed
    point inside the same op); ``adaptive``: choose 8 or ``bits`` per bucket from the
    previous step's aggregate (identical on every member); ``switch``: ``"auto"`` lets
    the communicator's measured-link switch turn compression off where it does not pay.
    ``group``: the process group (default: the default group)."""

    def __init__(self, bits: int = 4, bucket: int = 128, min_numel: int = 1024, adaptive: bool = False,
                 switch: str | None = None, group: Any = None, tracker: "ContributorTracker | None" = None,
                 adaptive_threshold: float = 0.5) -> None:
        from resilient.collectives.compressed import Compression

        Compression(bits=bits, bucket=bucket)  # validates
        self.bits, self.bucket, self.min_numel, self.adaptive = bits, bucket, min_numel, adaptive
        self.switch, self.group = switch, group
        self.tracker = tracker if tracker is not None else ContributorTracker()
        self.adaptive_threshold = adaptive_threshold
        self.member_id: str | None = None
        self.residuals: dict[str, torch.Tensor] = {}
        self.bucket_bits: dict[str, int] = {}
        self._spare: dict[str, torch.Tensor] = {}   # per bucket: the buffer the next input goes in
        self._next: dict[str, torch.Tensor] = {}    # per bucket: the buffer the op writes the next residual in
        self._lock = threading.Lock()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"member": self.member_id or "", "bits": dict(self.bucket_bits),
                    "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with self._lock:
            self.bucket_bits = {str(k): int(v) for k, v in sd.get("bits", {}).items()}
            mine = bool(self.member_id) and sd.get("member") == self.member_id
            self.residuals = {str(k): v.clone() for k, v in sd.get("residuals", {}).items()} if mine else {}

    def residual(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        with self._lock:
            e = self.residuals.get(key)
        return e if e is not None and e.shape == like.shape and e.dtype == like.dtype else None

    def input_for(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """What the hook sends for bucket ``key`` this step: ``grad + e`` (a new tensor;
        ``grad`` and the residual are left as they are). Pure: calling it twice gives the
        same bits."""
        e = self.residual(key, grad)
        return grad + e if e is not None else grad.clone()

    def stage(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """:meth:`input_for` into this bucket's spare buffer (kept from the bucket's previous
        step: no allocation, no page faults; the same bits as ``input_for``). The buffer is
        this state's until :meth:`settle` takes it back; if the op fails, settle is never
        called and the residual stays as it was (the staged buffer is dropped)."""
        e = self.residual(key, grad)
        with self._lock:
            x = self._spare.pop(key, None)
        if x is None or x.shape != grad.shape or x.dtype != grad.dtype:
            x = torch.empty_like(grad)
        if e is None:
            x.copy_(grad)
        else:
            torch.add(grad, e, out=x)
        return x

    def residual_buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer (kept from the bucket's previous step, else new) for the op to write
        this step's residual in as it quantizes (``Compression.residual``); it becomes the
        residual only in :meth:`settle`, so a failed op leaves the residual as it was."""
        with self._lock:
            r = self._next.pop(key, None)
        return r if r is not None and r.shape == like.shape and r.dtype == like.dtype else torch.empty_like(like)

    def settle(self, key: str, x: torch.Tensor, agg: torch.Tensor, contributed: bool, res: OpOutcome,
               fresh: torch.Tensor | None = None) -> None:
        """:meth:`update` for a float32 ``x`` from :meth:`stage`, without temporaries.
        ``fresh``: the :meth:`residual_buffer` the op was given; when the op wrote
        ``x - s*q_own`` there (``info["residual"] is fresh``) it becomes the residual, no
        pass over ``q`` here. Otherwise the new residual is written over the old
        residual's storage (``x`` itself when left out; ``x - x`` when the op ran
        uncompressed). The buffers no longer needed are kept for the bucket's next step.
        The same bits as :meth:`update` with ``own`` = the op's dequantized input (``x``
        when uncompressed)."""
        from resilient.collectives.compressed import CompressedResult
        from resilient.collectives.quantization import dequantize

        info = res.compression if isinstance(res, CompressedResult) else None
        with self._lock:
            old = self.residuals.get(key)
        if old is not None and (old.shape != x.shape or old.dtype != x.dtype):
            old = None
        nxt = fresh
        if not contributed:   # delayed, not lost
            e, spare = x, old
        elif info is None:    # uncompressed: nothing held back
            e, spare = torch.sub(x, x, out=x), old
        elif fresh is not None and _same(info.get("residual"), fresh):   # written as the op quantized
            e, spare, nxt = fresh, x, old
        else:
            e = old if old is not None else torch.empty_like(x)
            dequantize(info["q"], info["scales"], info["segments"], info["bucket"], out=e)   # own = s*q
            torch.sub(x, e, out=e)
            spare = x
        with self._lock:
            self.residuals[key] = e
            if spare is not None:
                self._spare[key] = spare
            if nxt is not None:
                self._next[key] = nxt
        self._adapt(key, agg, info)

    def bits_for(self, key: str) -> int:
        return self.bucket_bits.get(key, self.bits) if self.adaptive else self.bits

    def segments(self, bucket: GradBucket, bits: int) -> tuple[tuple[int, int, int], ...]:
        """(start, end, bits) over the bucket's flat buffer: small or 1-D parameters at 32."""
        segs: list[list[int]] = []
        pos = 0
        for g in bucket.gradients():
            n = g.numel()
            b = bits if g.dim() >= 2 and n >= self.min_numel else 32
            if segs and segs[-1][2] == b:
                segs[-1][1] = pos + n
            elif n:
                segs.append([pos, pos + n, b])
            pos += n
        return tuple((x[0], x[1], x[2]) for x in segs)

    def update(self, key: str, x: torch.Tensor, own: torch.Tensor | None, agg: torch.Tensor,
               contributed: bool, res: OpOutcome | None) -> None:
        """After a bucket: residual ``x - s*q_own`` (``x`` if left out: delayed, not lost),
        and in adaptive mode the next step's bits from the aggregate and the scales (of
        ``res``, the op's result, when it is a compressed one)."""
        from resilient.collectives.compressed import CompressedResult

        e = (x - own) if contributed and own is not None else (torch.zeros_like(x) if contributed else x)
        with self._lock:
            self.residuals[key] = e
        self._adapt(key, agg, res.compression if isinstance(res, CompressedResult) else None)

    def _adapt(self, key: str, agg: torch.Tensor, info: dict[str, Any] | None) -> None:
        """Adaptive mode: the next step's bits for ``key`` from the aggregate and the
        scales of a compressed op (``info``; None: the op ran uncompressed, no change)."""
        if self.adaptive and info is not None:
            # noise of one member's quantization relative to the aggregate: sum over buckets
            # of n_b * s_b^2 / 12 against |agg|^2 (both identical on every member)
            sc = info["scales"].double()
            sizes = torch.cat([torch.tensor([min(info["bucket"], s.numel - j * info["bucket"])
                                             for j in range(s.n_buckets(info["bucket"]))], dtype=torch.float64)
                               for s in info["segments"]])
            noise = float((sizes * sc * sc).sum() / 12.0) ** 0.5
            ratio = noise / max(float(agg.double().norm()), 1e-30)
            cur = self.bits_for(key)
            if ratio > self.adaptive_threshold:
                nxt = 8
            elif ratio < self.adaptive_threshold / 16:
                nxt = self.bits
            else:
                nxt = cur
            with self._lock:
                self.bucket_bits[key] = nxt


def _same(a: object, b: object) -> bool:
    return a is b


def compression_hook(state: ErrorFeedback, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the exact compressed allreduce with error feedback (see
    :class:`ErrorFeedback`). The bucket becomes the exact mean over the op's contributors
    of their dequantized ``grad + residual``; every member gets the same bits. Register with
    ``ddp.register_comm_hook(ef, compression_hook)`` before the first forward (or
    ``make_elastic(ddp, ef, hook=compression_hook)``). Failure behaviour: as
    :func:`ddp_comm_hook` (the bucket's future carries the op's error); ConfigError on a
    group that is not resilient's."""
    from resilient.collectives.compressed import CompressedResult
    from resilient.errors import ConfigError

    pg = state.group if state.group is not None else dist.distributed_c10d._get_default_group()  # noqa: SLF001
    engine = engine_of(pg)
    comm = engine.comm if engine is not None else None
    if engine is None or comm is None:
        raise ConfigError("compression_hook needs a process group of the 'resilient' backend "
                          "(dist.init_process_group('resilient')); use torch's hooks on other backends")
    state.member_id = engine.member_id or state.member_id
    buf = bucket.buffer()
    key = str(bucket.index())
    # flat float32 (DDP's usual bucket): the op reads the staged x = grad + e as its source
    # and writes the result into the bucket's own buffer, and the residual bookkeeping
    # reuses this bucket's buffers from its previous step; any other dtype takes the
    # allocating path (the same arithmetic)
    inplace = buf.dtype == torch.float32 and buf.is_contiguous()
    fresh = None
    if inplace:
        x = state.stage(key, buf)
        inp = buf   # the op reads x (its source) and writes the result here: no copy of x into buf
        fresh = state.residual_buffer(key, buf)   # the op writes x - s*q_own here as it quantizes
    else:
        x = state.input_for(key, buf)
        inp = x.clone()
    from resilient.collectives.compressed import Compression

    segs = state.segments(bucket, state.bits_for(key))
    compression = Compression(bits=state.bits_for(key), bucket=state.bucket, segments=segs,
                              auto=state.switch == "auto", residual=fresh, source=x if inplace else None)
    work = comm.allreduce(inp, op="avg", async_op=True, compression=compression)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def done(w: Work) -> None:
        try:
            res = w.result()
            members = tuple(res.contributors)
            contributed = state.member_id in members
            if inplace:
                state.settle(key, x, inp, contributed, res, fresh)
            else:
                # the automatic switch may have run the op uncompressed: a plain result
                compressed = res if isinstance(res, CompressedResult) else None
                own = compressed.dequantized_input() if compressed is not None else None
                if own is None and contributed:
                    own = x  # uncompressed: nothing is held back
                state.update(key, x, own, inp, contributed, res)
                buf.copy_(inp)
            state.tracker.add(members)
            fut.set_result(buf)
        except BaseException as exc:  # noqa: BLE001 - delivered to DDP through the future
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result type T

    work.add_done_callback(done)
    return fut
class SampleCount:
    """State of :func:`weighted_ddp_comm_hook`: this member's number of samples in the
    current step (set it before ``backward()``, e.g. ``len(sampler.step_indices())``), the
    process group (``None``: default) and the :class:`ContributorTracker`.
    ``last_total`` is the sum of the counts of the last bucket's contributors."""

    def __init__(self, process_group: Any = None, tracker: ContributorTracker | None = None) -> None:
        self.group = process_group
        self.tracker = tracker if tracker is not None else ContributorTracker()
        self.samples: int | None = None
        self.last_total: float | None = None

    def set(self, samples: int) -> None:
        """This member's samples in the coming step (an integer >= 0)."""
        from resilient.errors import ConfigError

        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise ConfigError(f"samples per step must be an integer >= 0, got {samples!r}")
        self.samples = samples


def weighted_ddp_comm_hook(state: SampleCount, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact per-sample mean over the contributors when members process different numbers
    of samples (speed-weighted shares): member ``i`` sends ``n_i * g_i`` (``g_i`` its
    local mean gradient) with ``n_i`` appended as one extra element of the *same* SUM
    allreduce, and every member divides by the summed count. The count travels in-band so
    its contributor set is by construction the gradients' (one op, one set — a separate
    allreduce of the counts could complete over a different set when a member dies
    between the two, and a table of published shares could be a version behind). A member
    with ``n_i = 0`` sends zeros (its NaN mean over no samples never enters the sum).

    Failure behaviour: ``state.samples`` unset raises ConfigError (nothing is sent); a
    count the bucket's dtype cannot hold exactly (fp16 above 2048 summed samples, bf16
    above 256) raises ConfigError; an op failure fails the future (DDP raises it from
    ``backward()``, as with :func:`ddp_comm_hook`). Needs the ``default`` or ``strict``
    recovery policy (one contributor set per op)."""
    from resilient.errors import ConfigError

    n = state.samples
    if n is None:
        raise ConfigError("weighted_ddp_comm_hook: call state.set(samples) before backward()")
    pg = state.group if state.group is not None else dist.distributed_c10d._get_default_group()  # noqa: SLF001
    buf = bucket.buffer()
    exact_up_to = int(2 / torch.finfo(buf.dtype).eps) if buf.dtype.is_floating_point else 0
    if n * pg.size() > exact_up_to:
        raise ConfigError(f"weighted_ddp_comm_hook: {n} samples x {pg.size()} members is not exact in {buf.dtype}; "
                          "use float32 gradient buckets")
    flat = torch.empty(buf.numel() + 1, dtype=buf.dtype, device=buf.device)
    if n:
        torch.mul(buf, n, out=flat[:-1])
    else:
        flat[:-1].zero_()
    flat[-1] = n
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    work = pg.allreduce([flat], opts)

    def divide(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out: torch.Tensor = fut.value()[0]
        members = tuple(work.contributors) if isinstance(work, ResilientWork) else ()
        state.tracker.add(members)
        total = float(out[-1].item())
        state.last_total = total
        if total <= 0:
            return buf.zero_()
        return torch.div(out[:-1], total, out=buf)

    return work.get_future().then(divide)


def make_weighted(ddp: torch.nn.parallel.DistributedDataParallel, state: SampleCount) -> torch.nn.parallel.DistributedDataParallel:
    """:func:`make_elastic` with :func:`weighted_ddp_comm_hook` (register before the
    first forward, so the automatic hook stays out). Returns ``ddp``."""
    ddp.register_comm_hook(state, weighted_ddp_comm_hook)
    ddp.reducer = _no_rebuild(ddp.reducer)
    return ddp


class _NoRebuildReducer:
    """Proxy of DDP's C++ reducer whose ``_rebuild_buckets`` does nothing: the rebuild
    after DDP's first iteration broadcasts bucket indices, a collective that only a
    member in its first iteration issues — a joiner would then be out of step with the
    others. Every other attribute is the reducer's.

    Why a ``__getattr__`` proxy (the one delegation in the package, around torch's
    object, not ours): the reducer is a pybind11 ``torch._C._distributed_c10d.Reducer``
    that DDP builds inside its constructor. Its methods are read-only on the instance
    (``reducer._rebuild_buckets = ...`` raises AttributeError) and ``__class__`` cannot
    be set to a Python subclass (the deallocators differ), so overriding one method of
    the existing object is only possible by standing in front of it. An explicit list of
    forwarded methods would be a second copy of torch's private surface: torch 2.13's
    ``nn/parallel/distributed.py`` alone uses 21 reducer methods (``prepare_for_forward``,
    ``prepare_for_backward``, ``_set_forward_pass_work_handle``, ``_push_all_rebuilt_params``,
    ``_set_static_graph``, ``_delay_all_reduce``, ``_run_comm_hook``, ...), and torch's
    comm hooks and pipelining reach ``ddp.reducer`` too (``mixed_precision_hooks``,
    ``optimizer_overlap_hooks``, ``pipelining/stage.py``); a method missing from such a
    list would break those paths on the next torch release."""

    def __init__(self, reducer: Reducer) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # see the class docstring for why
        return getattr(self._reducer, name)


def _no_rebuild(reducer: Reducer) -> Reducer:
    """``reducer`` behind :class:`_NoRebuildReducer`, typed as what it stands in for (DDP
    only calls the reducer's methods; the C++ object cannot be changed or re-classed)."""
    return cast(Reducer, _NoRebuildReducer(reducer))


def make_elastic(ddp: torch.nn.parallel.DistributedDataParallel, state: Any = None,
                 hook: Any = None) -> torch.nn.parallel.DistributedDataParallel:
    """Make a DDP model safe for members that come and go: register :func:`ddp_comm_hook`
    (with ``state``, see there) and turn off DDP's one-time bucket rebuild (a collective
    only a fresh member would issue). Build the DDP with ``init_sync=False`` and
    ``forward_sync_buffers=False``: :meth:`resilient.elastic.State.sync` does the initial
    sync, and from a healthy member. Returns ``ddp``."""
    ddp.register_comm_hook(state, hook if hook is not None else ddp_comm_hook)
    ddp.reducer = _no_rebuild(ddp.reducer)
    return ddp


# -- automatic integration with unchanged DDP scripts ---------------------------------

_auto_lock = threading.Lock()
_auto_installed = False


@dataclass
class _Auto:
    """Automatic mode of one DDP model over a resilient group: its contributor tracker,
    whether our hook is registered and whether DDP's bucket rebuild may run (kept beside
    the model, not on it)."""

    tracker: ContributorTracker
    hooked: bool = False
    #: DDP's one-time bucket rebuild may run (a member the job started with, no State)
    rebuild: bool = True


_autos: "weakref.WeakKeyDictionary[torch.nn.Module, _Auto]" = weakref.WeakKeyDictionary()


def _auto_of(ddp: torch.nn.Module) -> _Auto | None:
    return _autos.get(ddp)


def _group_of(bound: inspect.BoundArguments) -> Any:
    pg = bound.arguments.get("process_group")
    if pg is None and dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()  # noqa: SLF001
    return pg


def contributors(ddp: torch.nn.parallel.DistributedDataParallel) -> frozenset[str]:
    """Members whose gradients are in every bucket of the model's last synchronised step
    (automatic mode; empty before the first backward or on another backend)."""
    auto = _autos.get(ddp)
    return auto.tracker.step_contributors() if auto is not None else frozenset()


#: modules handed to :func:`hold_layout`: a DDP built over one later keeps its initial layout
_held: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def hold_layout(model: torch.nn.Module) -> None:
    """Keep the DDP buckets of ``model`` (a DDP, or the module a DDP wraps or will wrap) in
    their initial layout, with no one-time rebuild: the model is under
    :class:`resilient.elastic.State`, which admits joiners, and a joiner builds the initial
    layout (its reducer could not follow a rebuild the others did before it came). Models
    not in automatic mode are untouched. Raises :class:`~resilient.errors.ConfigError` when
    a DDP over it already rebuilt its buckets (the State was built after the second
    training step: build it before training)."""
    from resilient.errors import ConfigError

    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    _held.add(inner)
    for ddp, auto in list(_autos.items()):
        if ddp is not model and getattr(ddp, "module", None) is not inner:
            continue
        if getattr(ddp, "_has_rebuilt_buckets", False):
            raise ConfigError("this DDP model rebuilt its gradient buckets before resilient.elastic.State was "
                              "built, so a joiner's buckets could never match: build the State before the "
                              "first training step")
        auto.rebuild = False


def install_auto_hook() -> None:
    """Patch ``DistributedDataParallel`` once so that a model built over a resilient group
    is exact without user code (see the module docstring). Idempotent; models over other
    backends are untouched. Failure behaviour: none at install time; a user hook
    registered *after* the first forward gets DDP's own "can only be called once" error."""
    global _auto_installed
    with _auto_lock:
        if _auto_installed:
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        original_init = DDP.__init__
        original_pre_forward = cast(Callable[..., Any], DDP._pre_forward)  # untyped in torch
        sig = inspect.signature(original_init)

        @functools.wraps(original_init)
        def __init__(self: DDP, *args: Any, **kwargs: Any) -> None:
            bound = sig.bind(self, *args, **kwargs)
            engine = engine_of(_group_of(bound))
            if engine is not None and not engine.admitted:
                # a joiner before admission: the survivors never run DDP's constructor
                # collectives with it (its state comes from a healthy member, or it leaves)
                bound.arguments["init_sync"] = False
            original_init(*bound.args, **bound.kwargs)
            if engine is not None:
                # a joiner never rebuilds: the members it meets built their buckets long ago
                _autos[self] = _Auto(ContributorTracker(), rebuild=engine.admitted and self.module not in _held)

        @functools.wraps(original_pre_forward)
        def _pre_forward(self: DDP, *inputs: Any, **kwargs: Any) -> Any:
            auto = _autos.get(self)
            if auto is None:
                return original_pre_forward(self, *inputs, **kwargs)
            if not self._comm_hooks and not auto.hooked:
                # no user hook by the first forward: ours (the reducer allows one hook)
                # over the default group the state is the tracker alone, so that the model
                # pickles (torch.save(ddp_model) drops DDP's own process_group, not a hook's)
                default = (dist.is_initialized()
                           and self.process_group is dist.distributed_c10d._get_default_group())  # noqa: SLF001
                self.register_comm_hook(auto.tracker if default else (self.process_group, auto.tracker),
                                        ddp_comm_hook)
                auto.hooked = True
            if torch.is_grad_enabled() and self.require_backward_grad_sync:
                auto.tracker.reset()
            if auto.rebuild:
                return original_pre_forward(self, *inputs, **kwargs)
            real = self.reducer
            self.reducer = _no_rebuild(real)
            try:
                return original_pre_forward(self, *inputs, **kwargs)
            finally:
                self.reducer = real

        DDP.__init__ = __init__  # type: ignore[method-assign]
        DDP._pre_forward = _pre_forward  # type: ignore[method-assign]
        _auto_installed = True
