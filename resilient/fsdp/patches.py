"""Where the resilient backend meets FSDP2: three wrappers around torch's own functions.

Installed by :func:`install` when the first resilient process group is created, into
torch's FSDP2 modules once they are imported (a script that never shards does not import
them; a script on another backend runs torch's FSDP untouched). Each wrapper calls
torch's function and only adds bookkeeping; none changes what FSDP computes in a
fault-free run:

- ``FSDPParamGroup.__init__``: an HSDP parameter group whose shard and replicate groups are
  resilient groups registers the mesh (:class:`~resilient.fsdp.layout.ReplicaLayout`):
  the replicate groups then show only whole replica groups, and both groups' ops end with
  the step-aside check (:mod:`resilient.fsdp.pause`);
- ``foreach_reduce`` and ``_get_gradient_divide_factors``: the reduction in progress, its
  divide factors (for the replicate size the step began with, ``|M_prev|``) and its
  replicate all-reduce are recorded for the step boundary (:mod:`resilient.fsdp.step_ledger`);
- a global optimizer step pre-hook settles the step before any optimizer reads a gradient.

torch keeps these functions private; :func:`install` checks they exist with the signature
it expects and, if not (another torch), logs a warning and installs nothing, so HSDP then
runs as over any backend (fault-free exact; a lost member fails the broken row's ops).

Failure behaviour: :func:`install` never raises; the wrappers re-raise torch's errors.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["install"]

_installed = False
_lock = threading.Lock()


class _Sized:
    """A stand-in group for ``_get_gradient_divide_factors``: only ``size()`` is read."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


#: the module whose import completes FSDP2 (its parameter group; it imports the collectives)
_FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def install() -> None:
    """Install the wrappers (idempotent; see the module docstring) — now if FSDP2 is
    imported, else the moment it is: importing torch's FSDP pulls in sympy and the
    tensor-parallel package (seconds of CPU), which a script that never shards must not pay
    at ``init_process_group``. The deferral is wrapt's post-import hook (the hook runs once
    the module is fully loaded, or at once if it already is)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import wrapt

    wrapt.register_post_import_hook(_install_now, _FSDP_MODULE)


def _install_now(_module: Any) -> None:
    """The wrappers, into the loaded FSDP2 modules (never raises: another torch logs why)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pgroup
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
        import torch.optim.optimizer as optim
    except ImportError as exc:  # pragma: no cover - another torch
        log.warning("resilient: FSDP2 not found (%s); HSDP runs without failure handling", exc)
        return
    for mod, name in ((coll, "_get_gradient_divide_factors"), (pgroup, "foreach_reduce"),
                      (pgroup, "foreach_all_gather"), (pgroup, "FSDPParamGroup")):
        if not hasattr(mod, name):  # pragma: no cover - another torch
            log.warning("resilient: torch's FSDP2 has no %s.%s; HSDP runs without failure handling",
                        mod.__name__, name)
            return
    _wrap_param_group(pgroup.FSDPParamGroup, HSDPMeshInfo, FSDPMeshInfo)
    _wrap_reduce(pgroup, coll)
    _wrap_all_gather(pgroup)
    optim.register_optimizer_step_pre_hook(_settle_hook)
    optim.register_optimizer_step_post_hook(_plain_hook)


def _settle_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    from resilient.fsdp.pause import PAUSER
    from resilient.fsdp.plain import PLAIN
    from resilient.fsdp.step_ledger import LEDGER

    if PLAIN.in_settle or getattr(optimizer, "_resilient_shadow", False):
        return  # a plain FSDP redo's step, or a hosted shard's shadow optimizer
    LEDGER.settle()
    PAUSER.step += 1


def _plain_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    from resilient.fsdp.plain import PLAIN
    from resilient.fsdp.plain_settle import after_step

    after_step(PLAIN, optimizer)


def _wrap_param_group(cls: Any, hsdp_info: type, fsdp_info: type) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        info = self.mesh_info
        if isinstance(info, hsdp_info):
            _register_mesh(info)
        elif isinstance(info, fsdp_info):
            _register_plain(self)

    cls.__init__ = __init__


def _register_plain(param_group: Any) -> None:
    """A 1-D FSDP parameter group over a resilient group: its shards get peer copies."""
    from resilient.fsdp.plain import PLAIN, check_supported
    from resilient.settings import Settings
    from resilient.torch_backend.process_group import ResilientProcessGroup

    pg = param_group.mesh_info.shard_process_group
    if not isinstance(pg, ResilientProcessGroup) or not Settings.from_env().fsdp_peer_copy:
        return
    why = check_supported(param_group)
    if why is not None:
        PLAIN.disabled = why
        log.warning("resilient: plain FSDP without peer copies (%s): a lost member's shards are lost", why)
        return
    PLAIN.register(pg, param_group.fsdp_params)


def _wrap_all_gather(pgroup: Any) -> None:
    from resilient.fsdp.plain import PLAIN

    gather = pgroup.foreach_all_gather

    @functools.wraps(gather)
    def foreach_all_gather(fsdp_params: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(group, "shards", None) is None:
            return gather(fsdp_params, group, *args, **kwargs)
        PLAIN.begin(fsdp_params)
        try:
            return gather(fsdp_params, group, *args, **kwargs)
        finally:
            PLAIN.end()

    pgroup.foreach_all_gather = foreach_all_gather


def _register_mesh(info: Any) -> None:
    """Register an HSDP mesh whose groups are resilient ones (others are left alone)."""
    from resilient.fsdp.layout import ReplicaLayout
    from resilient.fsdp.pause import PAUSER
    from resilient.fsdp.step_ledger import LEDGER
    from resilient.torch_backend import current_engine
    from resilient.torch_backend.process_group import ResilientProcessGroup

    rs_pg, ar_pg = info.shard_process_group, info.replicate_process_group
    world = current_engine()
    if not (isinstance(rs_pg, ResilientProcessGroup) and isinstance(ar_pg, ResilientProcessGroup)) or world is None:
        return
    ranks = info.mesh.mesh
    if ranks.dim() != 2:  # pragma: no cover - fully_shard takes 1-D or 2-D meshes
        return
    if info.replicate_mesh_dim == 1:
        ranks = ranks.t()
    inner = getattr(world, "_inner", world)  # RESILIENT_OP_LOG wraps the engine (op_log.OpLogEngine)
    layout = ReplicaLayout.from_mesh(ranks.tolist(), list(inner.comm.members))
    view = getattr(ar_pg.engine.comm, "view", None)
    if view is not None and hasattr(view, "keep"):
        view.keep = layout.keep
    watcher = inner.watcher

    def members() -> tuple[str, ...] | None:
        epoch = watcher.current()
        return None if epoch is None else tuple(epoch.members)

    PAUSER.register(layout, inner.member_id, members)
    LEDGER.register(layout, rs_pg)
    for pg in (rs_pg, ar_pg):
        pg.after_op = PAUSER.maybe_pause
    ar_pg.before_allreduce = functools.partial(LEDGER.before_allreduce, ar_pg)


def _wrap_reduce(pgroup: Any, coll: Any) -> None:
    from resilient.fsdp.plain import PLAIN
    from resilient.fsdp.step_ledger import LEDGER, ReduceCall

    reduce, factors = pgroup.foreach_reduce, coll._get_gradient_divide_factors

    @functools.wraps(reduce)
    def foreach_reduce(fsdp_params: Any, unsharded_grads: Any, reduce_scatter_group: Any, *args: Any,
                       **kwargs: Any) -> Any:
        ar_group = args[6] if len(args) > 6 else kwargs.get("all_reduce_group")
        if ar_group is None and getattr(reduce_scatter_group, "shards", None) is not None:
            PLAIN.begin(fsdp_params)  # plain FSDP: the reduction is kept for a redo
            try:
                return reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs)
            finally:
                PLAIN.end()
        if ar_group is None or getattr(ar_group, "before_allreduce", None) is None:
            return reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs)
        params = list(fsdp_params)

        def grads() -> list[Any]:
            out = []
            for p in params:
                g = p.sharded_param.grad
                out.append(None if g is None else g.to_local())
            return out
        LEDGER.begin(ReduceCall(reduce_scatter_group, ar_group, grads_of=grads))
        try:
            return reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs)
        finally:
            LEDGER.end()

    @functools.wraps(factors)
    def get_factors(reduce_scatter_group: Any, all_reduce_group: Any, *args: Any, **kwargs: Any) -> Any:
        plain = PLAIN.current()
        if plain is not None and all_reduce_group is None and reduce_scatter_group is PLAIN.pg:
            def plain_for(n: int) -> Any:  # the mean over the members that contribute
                return factors(_Sized(n), None, *args, **kwargs)
            plain.factors_for = plain_for
            plain.factors = plain_for(len(PLAIN.live()))
            return plain.factors
        call = LEDGER.current()
        if call is None or all_reduce_group is not call.ar_group:
            return factors(reduce_scatter_group, all_reduce_group, *args, **kwargs)

        def factors_for(replicate: int) -> Any:
            return factors(reduce_scatter_group, _Sized(replicate), *args, **kwargs)
        call.factors_for = factors_for
        call.factors = factors_for(LEDGER.replicate_size)
        return call.factors

    pgroup.foreach_reduce = foreach_reduce
    coll._get_gradient_divide_factors = get_factors
