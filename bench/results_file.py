"""One results file per benchmark: ``bench/results/<bench>.json``, rendered into the
README's results table by ``bench/render_results.py`` (tests/test_results_table.py fails
when a file changed and the table was not rendered again).

A file: ``{"bench", "command", "machine", "load", "date", "headline": [{"claim",
"figure"}], "results": [the bench's JSON lines]}``. ``load`` is the 1-minute load average
before → after the run.

Failure behaviour: :func:`write` raises ``ValueError`` for an empty headline (a table row
needs a figure); :func:`load_all` raises ``ValueError`` naming a file that is not such a
record.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("bench", "command", "machine", "load", "date", "headline", "results")


def machine() -> str:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    import torch

    return (f"{os.cpu_count()} vCPUs ({platform.machine()}), {mem:.0f} GiB, {platform.system()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def write(bench: str, command: str, load_before: float, headline: list[dict[str, str]],
          results: list[Any], directory: Path = RESULTS) -> Path:
    if not headline or not all(h.get("claim") and h.get("figure") for h in headline):
        raise ValueError(f"{bench}: a results file needs a headline of claims and figures")
    rec = {"bench": bench, "command": command, "machine": machine(),
           "load": f"{load_before:.1f} → {os.getloadavg()[0]:.1f}", "date": time.strftime("%Y-%m-%d"),
           "headline": headline, "results": results}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{bench}.json"
    path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return path


def load_all(directory: Path = RESULTS) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("*.json")):
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict) or any(k not in rec for k in KEYS) or not rec["headline"]:
            raise ValueError(f"{path}: not a results file (keys {', '.join(KEYS)}, a non-empty headline)")
        out.append(rec)
    return out
