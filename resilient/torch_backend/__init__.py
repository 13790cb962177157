"""The ``resilient`` backend of ``torch.distributed``.

``import resilient`` registers it (``register()`` is idempotent), so after that::

    dist.init_process_group("resilient")          # under resilient-run: no arguments needed

creates a :class:`~.process_group.ResilientProcessGroup` whose collectives run on
:class:`resilient.collectives.Communicator` (built from the ``RESILIENT_*`` environment
the launcher sets: etcd endpoints, job, lease, member id; see :mod:`.communicator_engine`),
and installs the live view behind :func:`resilient.world`. Creating the group also makes
``DistributedDataParallel`` over it exact without user code
(:func:`resilient.ddp.install_auto_hook`, added by ``import resilient`` through
:func:`add_creation_hook`; ``docs/ddp.md``; FSDP2: ``docs/fsdp.md``), and with
``RESILIENT_OP_LOG=path`` every op is logged as a JSON line (:mod:`.op_log`). It is registered for the
``cpu`` and ``cuda`` devices: all_reduce, broadcast, all_gather, reduce_scatter and send/recv take CUDA
tensors (staged through the host, docs/cuda.md); the other ops refuse them with a clear
:class:`~resilient.errors.UnsupportedOperation`.

Failure behaviour of ``init_process_group``: missing ``RESILIENT_ETCD``/``RESILIENT_JOB``
-> :class:`~resilient.errors.ConfigError` naming the variables and that ``resilient-run``
sets them; etcd unreachable -> :class:`~resilient.errors.StoreUnavailable` after the
store's retry budget; no epoch admitting this member within the timeout ->
``TimeoutError`` naming the last epoch seen.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from datetime import timedelta
import types
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from resilient.torch_backend.engine import ElasticEngine

# torch is imported lazily: ``import resilient`` must stay cheap for ``resilient status``.
BACKEND_NAME = "resilient"

__all__ = ["BACKEND_NAME", "ResilientProcessGroup", "UnsupportedOperation", "register", "set_engine_factory",
           "current_engine", "engine_of", "add_creation_hook"]

#: ``factory(store, rank, size, timeout) -> Engine``; None = the Communicator-backed default
_engine_factory: Callable[..., Any] | None = None
_current: Any = None
_lock = threading.Lock()
_registered = False


def set_engine_factory(factory: Callable[..., Any] | None) -> None:
    """Use ``factory(store=, rank=, size=, timeout=) -> Engine`` for the next process groups
    (``None`` restores the Communicator-backed default). For tests and embedding."""
    global _engine_factory
    _engine_factory = factory


def current_engine() -> Any:
    """The engine of the most recently created resilient process group (or None)."""
    return _current


def engine_of(group: object) -> ElasticEngine | None:
    """The engine behind ``group`` when it is a resilient process group (what
    ``resilient.elastic`` and ``resilient.ddp`` call besides the collectives:
    :class:`~.engine.ElasticEngine`); None for any other object (another backend's group,
    None). Never raises."""
    from resilient.torch_backend.process_group import ResilientProcessGroup

    return group.engine if isinstance(group, ResilientProcessGroup) else None


def __getattr__(name: str) -> Any:
    if name == "UnsupportedOperation":  # lives in resilient.errors; this path kept for importers
        from resilient.errors import UnsupportedOperation

        return UnsupportedOperation
    if name == "ResilientProcessGroup":
        from resilient.torch_backend import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'resilient.torch_backend' has no attribute {name!r}")


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    global _current
    from resilient import live_world as world_mod
    from resilient.torch_backend.process_group import ResilientProcessGroup

    import torch.distributed as dist

    if dist.is_initialized() and _current is not None:  # dist.new_group(): see subgroup.py
        from resilient.torch_backend import subgroup

        return ResilientProcessGroup(subgroup.create(_current, store, rank, size, timeout), rank, size)
    factory = _engine_factory
    if factory is None:
        from resilient.torch_backend.communicator_engine import from_environment

        factory = from_environment
    engine = factory(store=store, rank=rank, size=size, timeout=timeout)
    from resilient.errors import RemovedFromGroup
    from resilient.torch_backend.op_log import wrap_from_environment

    try:
        live = engine.world()  # the C++ side gets the rank Python reports (the job's ring position)
        c_rank, c_size = live.rank, live.size
    except RemovedFromGroup:   # a joiner that is not admitted yet is in no op's ring
        c_rank, c_size = rank, size
    engine = wrap_from_environment(engine)  # RESILIENT_OP_LOG=path: one JSON line per op
    pg = ResilientProcessGroup(engine, c_rank, c_size)
    with _lock:
        _current = engine
    world_mod.install(engine.world)
    for hook in list(_creation_hooks):
        hook()
    return pg


#: called after the world group is created (``import resilient`` adds the DDP auto hook and
#: the FSDP2 wrappers: :func:`resilient._install_integrations`); kept here as callables so
#: that this package imports neither :mod:`resilient.ddp` nor :mod:`resilient.fsdp`, which
#: import it
_creation_hooks: list[Callable[[], None]] = []


def add_creation_hook(hook: Callable[[], None]) -> None:
    """Run ``hook()`` each time a world group is created (idempotent hooks; added once)."""
    with _lock:
        if hook not in _creation_hooks:
            _creation_hooks.append(hook)


def register() -> None:
    """Register the backend with ``torch.distributed`` under ``"resilient"`` (CPU and CUDA). Idempotent."""
    global _registered
    with _lock:
        if _registered:
            return
        import torch.distributed as dist

        if BACKEND_NAME.upper() not in dist.Backend._plugins:  # noqa: SLF001 - torch's registry
            dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        _registered = True


class _RegisterWhenTorchDistributedLoads(importlib.abc.MetaPathFinder):
    """Registers the backend right after ``torch.distributed`` is imported (so ``import
    resilient`` before ``import torch`` works without importing torch itself)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            _remove_hook()
            try:
                register()
            except Exception:  # pragma: no cover - never break ``import torch``
                pass

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_hook = _RegisterWhenTorchDistributedLoads()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def autoregister() -> None:
    """Register now if ``torch.distributed`` is loaded, else as soon as it is. Called by
    ``import resilient``; cheap (imports no torch)."""
    if "torch.distributed" in sys.modules:
        register()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
