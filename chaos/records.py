"""The runner's side of a run's records directory (protocol in :mod:`resilient.chaos.worker`):
read the members' op records (``member-<i>.jsonl``, JSON lines, never pickle), the start
of op 0, how far the members got, and write the runner's own files (``go``, ``end``,
shaping files) atomically.

Failure behaviour: a record line that is not JSON (cut short by a SIGKILL) is skipped; a
missing file reads as "no records yet". Writing raises ``OSError`` when the directory is
not writable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilient.chaos.verifier import OpRecord

#: Duration workloads end this many ops past the furthest member when the time is up.
END_MARGIN_OPS = 5
END_MARGIN_S = 2.0


def member_records(records: Path, member: int) -> Path:
    return records / f"member-{member}.jsonl"


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader never sees half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def read_records(records: Path, world_size: int, t0: float) -> list[OpRecord]:
    """Every member's op records, times relative to ``t0``; a later line of the same op
    (its end) completes the earlier one (its start)."""
    out: list[OpRecord] = []
    for i in range(world_size):
        path = member_records(records, i)
        latest: dict[int, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    d = json.loads(line)
                except ValueError:
                    continue  # a line cut short by SIGKILL
                latest[d["seq"]] = {**latest.get(d["seq"], {}), **d}
        for seq, d in sorted(latest.items()):
            end = d.get("end")
            out.append(OpRecord(member=i, seq=seq, start_s=d["start"] - t0,
                                end_s=None if end is None else end - t0,
                                contributors=tuple(d["contributors"]) if d.get("contributors") else None,
                                epoch=d.get("epoch"), error=d.get("error"), check=d.get("check"),
                                control=bool(d.get("control")),
                                out_range=tuple(d["out_range"]) if d.get("out_range") else None,
                                recovered=bool(d.get("recovered")),
                                bytes_after_fault=d.get("bytes_after_fault")))
    return out


def op0_start(records: Path, member: int) -> float | None:
    """The ``start`` wall time of op 0 in a member's record file, once it is there."""
    try:
        with open(member_records(records, member)) as f:
            line = f.readline()
    except OSError:
        return None
    try:
        d = json.loads(line)
    except ValueError:
        return None  # not written yet, or written halfway
    return float(d["start"]) if d.get("seq") == 0 and "start" in d else None


def size(records: Path, member: int) -> int:
    """Bytes in a member's record file (-1 when there is none): grows with progress."""
    try:
        return member_records(records, member).stat().st_size
    except OSError:
        return -1


def end_op(records: Path, world_size: int) -> int:
    """The op count that ends a duration workload now: a few ops past the furthest
    member, so every member runs exactly the same ops (members read the ``end`` file
    before each op; one that started an op past the end before the file appeared would
    wait forever for the others). So the margin covers ``END_MARGIN_S`` of ops at the
    fastest member's rate (tiny ops run ~1000/s), at least ``END_MARGIN_OPS``."""
    furthest, rate = -1, 0.0
    for i in range(world_size):
        path = member_records(records, i)
        if path.exists():
            starts = []
            for line in path.read_text().splitlines()[-64:]:
                try:
                    rec = json.loads(line)
                    furthest = max(furthest, int(rec["seq"]))
                    if rec.get("start") is not None:
                        starts.append((float(rec["start"]), int(rec["seq"])))
                except (ValueError, KeyError, TypeError):
                    pass
            if len(starts) >= 2 and starts[-1][0] > starts[0][0]:
                rate = max(rate, (starts[-1][1] - starts[0][1]) / (starts[-1][0] - starts[0][0]))
    return furthest + max(END_MARGIN_OPS, int(rate * END_MARGIN_S) + 1)
