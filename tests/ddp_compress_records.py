"""Reading and checking the step records of tests/workers/ddp_compress_worker.py (the
multi-process tests of the DDP compression hook): each member's JSON lines, grouped by
step, and the reference a compressed bucket must equal bitwise."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from resilient.collectives.quantization import Segment, dequantize, quantize


def floats(h: str) -> torch.Tensor:
    """float32 values from the hex of their bytes (what the worker writes)."""
    return torch.frombuffer(bytearray(bytes.fromhex(h)), dtype=torch.float32)


def _record(line: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads(line))
    except ValueError:
        return None  # the line a kill cut


def records(d: Path) -> dict[str, list[dict[str, Any]]]:
    """Each member's step records (``DIR/<member>.jsonl``)."""
    return {f.stem: [r for r in map(_record, f.read_text().splitlines()) if r is not None] for f in d.glob("*.jsonl")}


def by_step(recs: dict[str, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """The members' records of each step."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rs in recs.values():
        for r in rs:
            out.setdefault(r["step"], []).append(r)
    return out


def reference(d: Path, rec: dict[str, Any], key: str) -> torch.Tensor:
    """fl32(sum over the contributors of s*q_i) / |C| from the inputs they wrote."""
    sc = floats(rec["scales"])
    segs = [Segment(a, b, k) for a, b, k in rec["segs"]]
    Q = None
    for m in rec["C"]:
        f = d / f"x_{m}_{rec['step']}_{key}.bin"
        assert f.exists(), f"contributor {m} of step {rec['step']} wrote no input"
        q = quantize(torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.float32), sc, segs, rec["bucket"],
                     rec["nb"])
        Q = q if Q is None else Q + q
    assert Q is not None
    return dequantize(Q, sc, segs, rec["bucket"]).div_(len(rec["C"]))
