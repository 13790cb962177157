"""Worker log destinations: ``--log-dir``, ``--redirects``, ``--tee``, ``--local-ranks-filter``.

The layout and the console prefixes are torchrun's (``DefaultLogsSpecs`` and ``TailLog`` of
torch 2.13)::

    <log-dir>/<run id>_<random>/attempt_<restart count>/<local rank>/stdout.log
                                                                    /stderr.log
                                                                    /error.json
    <log-dir>/<run id>_<random>/attempt_<restart count>/filtered_stdout.log
                                                       /filtered_stderr.log

Without ``--log-dir`` the base is a fresh ``torchelastic_*`` temporary directory, as in
torchrun (so ``TORCHELASTIC_ERROR_FILE`` is always set). A redirected stream goes to its
file; a tee'd stream goes to its file and each line is also written to the agent's console
as ``[<role><local rank>]:<line>``. A local rank outside ``--local-ranks-filter`` shows
nothing on the console (its files are still written). Because resilient-run restarts one
worker at a time, ``attempt_<n>`` is that worker's own restart count: a restarted local
rank 1 writes ``attempt_1/1/`` while its siblings keep writing ``attempt_0/``.

Failure behaviour: an unwritable ``--log-dir`` raises :class:`~resilient.errors.ConfigError`
before any worker starts; tail threads stop when the worker's files are closed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from enum import IntFlag
from typing import IO, Callable, TextIO

from resilient.errors import ConfigError

_VALUE = re.compile(r"^[0-3]$")
_MAPPING = re.compile(r"^(\d:[0-3],)*(\d:[0-3])$")


class Std(IntFlag):
    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def parse_std(value: str, flag: str = "--redirects") -> Std | dict[int, Std]:
    """``"3"`` -> ``Std.ALL``; ``"0:1,1:2"`` -> ``{0: Std.OUT, 1: Std.ERR}`` (torchrun's syntax)."""
    value = value.strip()
    if _VALUE.match(value):
        return Std(int(value))
    if _MAPPING.match(value):
        return {int(k): Std(int(v)) for k, v in (item.split(":") for item in value.split(","))}
    raise ConfigError(
        f"{flag} {value!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank "
        "like 0:3,1:1"
    )


def std_for(spec: Std | dict[int, Std], local_rank: int) -> Std:
    return spec if isinstance(spec, Std) else spec.get(local_rank, Std.NONE)


def _tail(header: str, path: str, dst: TextIO, finished: threading.Event, interval: float,
          line_filter: Callable[[str], bool] | None, lock: threading.Lock) -> None:
    """torch's ``tail_logfile``: copy new lines of ``path`` to ``dst`` until ``finished``."""
    while not os.path.exists(path):
        if finished.wait(interval):
            if not os.path.exists(path):
                return
    with open(path, errors="replace") as fp:
        while True:
            line = fp.readline()
            if line:
                if line_filter is None or line_filter(line):
                    with lock:
                        dst.write(f"{header}{line}")
                        dst.flush()
            elif finished.is_set():
                return
            else:
                finished.wait(interval)


@dataclass
class WorkerStreams:
    """Where one worker process writes; pass ``stdout``/``stderr`` to ``Popen``."""

    stdout: int | IO[str] | None  # None (console), subprocess.DEVNULL, or an open file
    stderr: int | IO[str] | None
    error_file: str
    log_dir: str
    _finished: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _files: list[TextIO] = field(default_factory=list)

    def close(self) -> None:
        """After the worker exited: let the tailers drain the files, then close them."""
        self._finished.set()
        for t in self._threads:
            t.join(timeout=5)
        for f in self._files:
            f.close()


class WorkerLogs:
    """Creates the log layout and the console tailers for the workers of one agent."""

    def __init__(self, log_dir: str | None, run_id: str, role: str, redirects: str = "0",
                 tee: str = "0", local_ranks_filter: set[int] | None = None,
                 duplicate_stdout_filters: list[str] | None = None,
                 duplicate_stderr_filters: list[str] | None = None,
                 tail_interval: float = 0.1) -> None:
        self.role = role
        self.redirects = parse_std(redirects, "--redirects")
        self.tee = parse_std(tee, "--tee")
        self.filter = local_ranks_filter
        self.dup = {Std.OUT: duplicate_stdout_filters or [], Std.ERR: duplicate_stderr_filters or []}
        self.interval = tail_interval
        self._lock = threading.Lock()
        self._filtered: dict[str, TextIO] = {}
        try:
            base = log_dir or tempfile.mkdtemp(prefix="torchelastic_")
            if os.path.isfile(base):
                raise ConfigError(f"--log-dir {base} is a file; give a directory")
            os.makedirs(base, exist_ok=True)
            self.run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        except OSError as exc:
            raise ConfigError(f"--log-dir {log_dir}: cannot create the log directory ({exc}); pick a writable path") from exc

    def attempt_dir(self, restart_count: int) -> str:
        return os.path.join(self.run_log_dir, f"attempt_{restart_count}")

    def open(self, local_rank: int, restart_count: int) -> WorkerStreams:
        """Create ``attempt_<restart_count>/<local_rank>/`` and the worker's streams."""
        attempt = self.attempt_dir(restart_count)
        rank_dir = os.path.join(attempt, str(local_rank))
        shutil.rmtree(rank_dir, ignore_errors=True)
        os.makedirs(rank_dir)
        tee = std_for(self.tee, local_rank)
        redir = std_for(self.redirects, local_rank) | tee
        shown = self.filter is None or local_rank in self.filter
        streams = WorkerStreams(None, None, os.path.join(rank_dir, "error.json"), rank_dir)
        for which, name, console in ((Std.OUT, "stdout", sys.stdout), (Std.ERR, "stderr", sys.stderr)):
            if redir & which:
                path = os.path.join(rank_dir, f"{name}.log")
                f = open(path, "w")
                streams._files.append(f)
                target: int | IO[str] | None = f
                if tee & which:
                    if shown:
                        self._start_tail(streams, local_rank, path, console, None)
                    if self.dup[which]:
                        needles = list(self.dup[which])

                        def keep(line: str, n: list[str] = needles) -> bool:
                            return any(x in line for x in n)

                        self._start_tail(streams, local_rank, path, self._filtered_file(attempt, name), keep)
            else:
                target = None if shown else subprocess.DEVNULL
            setattr(streams, name, target)
        return streams

    def _filtered_file(self, attempt: str, name: str) -> TextIO:
        path = os.path.join(attempt, f"filtered_{name}.log")
        if path not in self._filtered:
            self._filtered[path] = open(path, "w", errors="replace", buffering=1)
        return self._filtered[path]

    def _start_tail(self, streams: WorkerStreams, local_rank: int, path: str, dst: TextIO,
                    line_filter: Callable[[str], bool] | None) -> None:
        t = threading.Thread(
            target=_tail,
            args=(f"[{self.role}{local_rank}]:", path, dst, streams._finished, self.interval, line_filter, self._lock),
            name=f"tail-{local_rank}-{os.path.basename(path)}",
            daemon=True,
        )
        t.start()
        streams._threads.append(t)

    def close(self) -> None:
        for f in self._filtered.values():
            f.close()
        self._filtered.clear()
