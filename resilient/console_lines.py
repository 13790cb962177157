"""Whole lines from workers that share one console.

``resilient-run`` starts every worker as ``python -u`` (as torchrun does) on the agent's own
stdout and stderr: all local workers write to one file. Under ``-u`` the text layer writes
through, so ``print(x)`` is two ``write`` calls — the text, then the newline — and a
sibling's line can land between them (``RESULT rank 2RESULT rank 1\\n\\n``): a reader that
parses lines finds one worker's line missing, as if it had stopped silently.
:func:`whole_lines` switches ``sys.stdout`` and ``sys.stderr`` of a worker started by
``resilient-run`` to line buffering without write-through: a line reaches the file in one
``write`` when it ends (lines up to the text layer's 8 KiB chunk; on a pipe, up to
``PIPE_BUF``, 4 KiB, are atomic), output still appears line by line, and an explicit
``flush()`` still writes a partial line at once (tqdm and logging flush after each write).

It acts only under ``resilient-run`` (``RESILIENT_EXIT_MARKER`` set,
:mod:`resilient.script_exit`) and only on a stream that writes through: a worker started
without ``-u`` (``--no-python`` wrappers, ``PYTHON_EXEC``), or a stream the script replaced,
keeps its own buffering. A script that never imports ``resilient`` is not changed.

Failure behaviour: never raises; a stream without ``reconfigure`` is left as it is.
"""
from __future__ import annotations

import os
import sys

__all__ = ["whole_lines"]


def whole_lines() -> None:
    """Line-buffer the worker's write-through stdout and stderr (idempotent; see the module)."""
    from resilient.script_exit import ENV

    if not os.environ.get(ENV):
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is None or not getattr(stream, "write_through", False):
            continue
        try:
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            continue
