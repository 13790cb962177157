"""Whether a worker's script finished, or its process ended early with exit code 0.

``resilient-run`` gives each worker ``RESILIENT_EXIT_MARKER=<path>``. ``import resilient``
(:func:`arm`) writes ``<path>.started`` and registers an ``atexit`` handler that writes
``<path>.finished`` when the interpreter exits normally (the script returned, or raised
``SystemExit``). A process that ends with exit code 0 but without that — ``os._exit(0)``
from library code, a thread calling it, an embedded interpreter torn down — has not
finished its script: the agent counts such a worker as failed and names it in its summary
(:func:`unfinished`). The two deliberate early exits of this package write the marker
themselves with their reason (:func:`deliberate`): a joiner that cannot be admitted
(``torch_backend.communicator_engine.leave_unadmitted``) and an HSDP replica group's
survivor that steps aside (``resilient.fsdp.pause``). A script that never imports
``resilient`` writes nothing and is not judged.

Failure behaviour: writing a marker never raises (an unwritable path is logged at debug
level: the worker is then judged as if it had not imported resilient).
"""
from __future__ import annotations

import atexit
import logging
import os

log = logging.getLogger(__name__)

__all__ = ["ENV", "arm", "deliberate", "left_early", "unfinished"]

ENV = "RESILIENT_EXIT_MARKER"
_armed = False


def _write(suffix: str, text: str) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        with open(f"{path}.{suffix}", "w") as f:
            f.write(text)
    except OSError as exc:
        log.debug("cannot write the exit marker %s.%s: %s", path, suffix, exc)


def arm() -> None:
    """Mark the script started and its normal exit finished (idempotent; no-op unset)."""
    global _armed
    if _armed or not os.environ.get(ENV):
        return
    _armed = True
    _write("started", str(os.getpid()))
    atexit.register(_write, "finished", NORMAL)


NORMAL = "normal exit"


def deliberate(reason: str) -> None:
    """Call right before a deliberate ``os._exit(0)``: the worker is done, for ``reason``."""
    _write("finished", reason)


def left_early(path: str) -> str | None:
    """The reason a worker whose marker is ``path`` gave for a deliberate early exit
    (:func:`deliberate`); None when it finished its script normally, or wrote nothing."""
    try:
        with open(f"{path}.finished") as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == NORMAL else (text or "no reason given")


def unfinished(path: str) -> bool:
    """Whether the worker whose marker is ``path`` started its script and did not finish it."""
    return os.path.exists(f"{path}.started") and not os.path.exists(f"{path}.finished")
