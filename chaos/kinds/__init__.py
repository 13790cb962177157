"""The fault-kind registry: every :class:`~resilient.chaos.faults.FaultKind` subclass
defined in a module of this package (one file per kind) is a registered kind, found the
first time a kind is looked up; :func:`register` adds one more (tests, plugins).

Scenario parsing (:mod:`resilient.chaos.scenario`), the runner, the Chaos Mesh export
(:mod:`resilient.chaos.k8s`) and the verifier look kinds up here by name, so adding a
fault kind is one new file in ``chaos/kinds/``.

Failure behaviour: :func:`get` raises ``KeyError`` for an unknown name (the scenario
parser checks names against :func:`names` first and reports a ScenarioError);
:func:`register` raises ``ValueError`` when the name is taken; two modules defining the
same name raise ``ValueError`` at discovery.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading
from contextlib import contextmanager
from typing import Iterator

from resilient.chaos.faults import FaultKind

_lock = threading.Lock()
_builtin: dict[str, FaultKind] | None = None
_extra: dict[str, FaultKind] = {}


def _discover() -> dict[str, FaultKind]:
    """One instance of every concrete FaultKind subclass defined in this package's
    modules, by name (modules in name order)."""
    found: dict[str, FaultKind] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, FaultKind) and cls is not FaultKind and cls.__module__ == module.__name__:
                kind = cls()
                if kind.name in found:
                    raise ValueError(f"fault kind {kind.name!r} is defined twice ({module.__name__} and "
                                     f"{type(found[kind.name]).__module__}); rename one")
                found[kind.name] = kind
    return found


def _all() -> dict[str, FaultKind]:
    global _builtin
    with _lock:
        if _builtin is None:
            _builtin = _discover()
        return {**_builtin, **_extra}


def builtin() -> list[FaultKind]:
    """The kinds defined in this package (not those added by :func:`register`)."""
    _all()
    assert _builtin is not None
    return list(_builtin.values())


def names() -> list[str]:
    """Every registered kind's name, sorted."""
    return sorted(_all())


def get(name: str) -> FaultKind:
    """The kind called ``name``; ``KeyError`` when there is none."""
    return _all()[name]


def find(name: str) -> FaultKind | None:
    """The kind called ``name``, or ``None``."""
    return _all().get(name)


def register(kind: FaultKind) -> FaultKind:
    """Add ``kind`` (defined outside this package) to the registry; ``ValueError`` when
    its name is taken."""
    if kind.name in _all():
        raise ValueError(f"a fault kind named {kind.name!r} is already registered")
    with _lock:
        _extra[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind added by :func:`register` (built-in kinds stay)."""
    with _lock:
        _extra.pop(name, None)


@contextmanager
def registered(kind: FaultKind) -> Iterator[FaultKind]:
    """``kind`` registered for the duration of the ``with`` block."""
    register(kind)
    try:
        yield kind
    finally:
        unregister(kind.name)
