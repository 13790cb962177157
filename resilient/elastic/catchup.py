"""A joiner's optimizer state, received in the background after its admission.

At admission the source streams a joiner's state in two parts (:mod:`.stream`, one
connection): first the model, the user fields and the optimizer's hyper-parameters —
what the joiner needs before its first forward pass — then the optimizer state (for
SGD-momentum or Adam as large as the parameters, or twice), which nothing reads before
the joiner's first ``optimizer.step()``. :class:`PendingOptimizerState` receives that
second part on a daemon thread while the joiner computes its first step, so the
survivors wait for the joiner (in their next gradient allreduce) only as long as the
first part took. :meth:`PendingOptimizerState.settle` — called by ``State`` before the
joiner's first ``optimizer.step()`` (a one-shot step pre-hook) and before anything that
reads or marks the whole state (``commit``, ``restore``, ``state_dict``, ``sync``) —
waits for the thread and loads the optimizer state, keeping the hyper-parameters the
optimizer has at that moment (those came with the first part; a scheduler may have
changed them since).

Failure behaviour: the stream cut short (the source died), a bad frame, or nothing within
the timeout -> ``settle`` raises :class:`~resilient.errors.DataLost` (the joiner restarts
and is synced again), every later ``settle`` too; the optimizer is left without state.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from resilient.elastic.stream import NextPart
from resilient.errors import DataLost, FrameError


class PendingOptimizerState:
    """The optimizer-state part of a joiner's stream, being received (see the module
    docstring)."""

    def __init__(self, rest: NextPart, timeout: float) -> None:
        self._got: list[Any] = []
        self._error: str | None = None
        self._settled = False

        def run() -> None:
            try:
                self._got.append(rest.read(timeout))
            except (DataLost, FrameError, OSError) as exc:
                self._error = str(exc)

        self._thread = threading.Thread(target=run, name="state-stream-optimizer", daemon=True)
        self._thread.start()

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for the part and load it into ``optimizer`` (once; later calls return at
        once). Raises DataLost if the part did not arrive whole."""
        if self._settled:
            return
        self._thread.join()
        if self._error is not None or not self._got:
            raise DataLost(f"State: the joiner's optimizer state did not arrive: {self._error or 'no data'} "
                           "(the source member died? the joiner restarts and is synced again)")
        sd = self._got[0]
        if not isinstance(sd, dict) or "optimizer" not in sd:
            raise DataLost("State: the joiner's optimizer-state part holds no optimizer state_dict")
        current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(sd["optimizer"])
        for g, hyper in zip(optimizer.param_groups, current):
            g.update(hyper)
        self._settled = True
        self._got.clear()
