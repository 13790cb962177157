"""Codec micro-benchmark: each stage of the exact compressed allreduce's codec, the
current code against a baseline revision, side by side in one process.

    .venv/bin/python bench/codec.py [--sizes 16,64] [--bits 4,8] [--reps 7] [--base a3b7223]

The baseline is ``resilient/collectives/quantization.py`` as of ``--base`` (default: the
commit before the blocked codec), read with ``git show`` and loaded as a private module;
its ring receive (unpack, widen, add) is the one ``QuantizedRing`` had at that commit.
Stages, on ``size`` MiB of float32 (one quantization segment, bucket 1024, 4 members):
``maxima`` (bucket max |x|), ``quantize`` (into a given buffer), ``quantize_op`` (into
the buffer the op gets: a fresh one before, a reused one from the op's pool now), ``pack_b`` (b-bit wire of one input),
``pack_int8`` / ``pack_int16`` (wire of a partial sum), ``recv_b`` / ``recv_int8`` /
``recv_int16`` (a reduce-scatter receive: unpack, widen to int32, add this member's
input into the accumulator), ``dequantize`` (into the caller's float32 tensor).

Every stage's output is compared bitwise between the two codecs (``equal``). Rates are
MB/s of float32 input (``4 * numel / median seconds``), alternating before/after runs so
that both see the same load; report ``/proc/loadavg`` with them. One JSON line per
(size, bits). Fails (exit 1) when an output differs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from resilient.collectives import quantization as new  # noqa: E402
from resilient.collectives.compressed import _QBuffers  # noqa: E402

BUCKET, MEMBERS = 1024, 4


def load_baseline(rev: str) -> types.ModuleType:
    """The quantization module as of ``rev`` (raises CalledProcessError if git lacks it)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:resilient/collectives/quantization.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("quantization_baseline")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:quantization.py", "exec"), mod.__dict__)
    return mod


def old_recv(old: types.ModuleType, wire: torch.Tensor, count: int, w: int, out: torch.Tensor,
             inp: torch.Tensor) -> None:
    """The baseline ring's reduce-scatter receive."""
    vals = old.unpack(wire, count, w)
    if vals.dtype == out.dtype:
        torch.add(inp, vals, out=out)
    else:
        out.copy_(vals)
        out.add_(inp)


def median_s(f: Callable[[], object], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_case(old: types.ModuleType, size_mib: int, bits: int, reps: int) -> dict[str, object]:
    numel = size_mib * (1 << 20) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(size_mib * 31 + bits))
    segs_new = [new.Segment(0, numel, bits)]
    segs_old = [old.Segment(0, numel, bits)]
    m_new = new.bucket_maxima(x, segs_new, BUCKET)
    sc = new.scales(m_new, segs_new, BUCKET, MEMBERS)
    q = new.quantize(x, sc, segs_new, BUCKET, MEMBERS, finite=True)
    partial = q * 2  # a partial sum over two inputs (int8 wire for 2, 4, 8 bits... at most 254)
    w8, w16 = 8, 16
    acc = torch.empty(numel, dtype=torch.int32)
    qbuf = torch.empty(numel, dtype=torch.int32)
    dq = torch.empty(numel, dtype=torch.float32)
    qpool = _QBuffers()

    def pair(name: str, f_old: Callable[[], torch.Tensor], f_new: Callable[[], torch.Tensor]) -> tuple[str, dict[str, object]]:
        a = f_old().clone()
        b = f_new()
        equal = bool(torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                                 b.view(torch.uint8) if b.dtype != torch.uint8 else b))
        t_old = t_new = 0.0
        for _ in range(2):  # alternate so both codecs see the same load
            t_old += median_s(f_old, reps)
            t_new += median_s(f_new, reps)
        mb = 4 * numel / 1e6
        return name, {"before_mb_s": round(2 * mb / t_old), "after_mb_s": round(2 * mb / t_new),
                      "speedup": round(t_old / t_new, 2), "equal": equal}

    def recv_old(width: int, val: torch.Tensor) -> Callable[[], torch.Tensor]:
        wire = old.pack(val, width)

        def f() -> torch.Tensor:
            old_recv(old, wire, numel, width, acc, q)
            return acc
        return f

    def recv_new(width: int, val: torch.Tensor) -> Callable[[], torch.Tensor]:
        wire = new.pack(val, width)

        def f() -> torch.Tensor:
            new.unpack_add(wire, numel, width, acc, q)
            return acc
        return f

    def deq_old() -> torch.Tensor:
        dq.copy_(old.dequantize(q, sc, segs_old, BUCKET))  # the baseline op's dequantize + copy into t
        return dq

    stages = dict([
        pair("maxima", lambda: old.bucket_maxima(x, segs_old, BUCKET), lambda: new.bucket_maxima(x, segs_new, BUCKET)),
        pair("quantize", lambda: old.quantize(x, sc, segs_old, BUCKET, MEMBERS, out=qbuf, finite=True),
             lambda: new.quantize(x, sc, segs_new, BUCKET, MEMBERS, out=qbuf, finite=True)),
        pair("quantize_op", lambda: old.quantize(x, sc, segs_old, BUCKET, MEMBERS, finite=True),
             lambda: new.quantize(x, sc, segs_new, BUCKET, MEMBERS, out=qpool.take(numel), finite=True)),
        pair(f"pack_{bits}", lambda: old.pack(q, bits), lambda: new.pack(q, bits)),
        pair("pack_int8", lambda: old.pack(partial, w8), lambda: new.pack(partial, w8)),
        pair("pack_int16", lambda: old.pack(partial, w16), lambda: new.pack(partial, w16)),
        pair(f"recv_{bits}", recv_old(bits, q), recv_new(bits, q)),
        pair("recv_int8", recv_old(w8, partial), recv_new(w8, partial)),
        pair("recv_int16", recv_old(w16, partial), recv_new(w16, partial)),
        pair("dequantize", deq_old, lambda: new.dequantize(q, sc, segs_new, BUCKET, out=dq)),
    ])
    return {"size_mib": size_mib, "bits": bits, "threads": torch.get_num_threads(), "stages": stages,
            "equal": all(bool(s["equal"]) for s in stages.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64", help="MiB of float32, comma-separated")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--base", default="a3b7223", help="git revision of the baseline codec")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: as resilient-run sets for several workers per node)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = load_baseline(a.base)
    ok = True
    for size in [int(s) for s in a.sizes.split(",")]:
        for bits in [int(b) for b in a.bits.split(",")]:
            line = run_case(old, size, bits, a.reps)
            ok = ok and bool(line["equal"])
            print(json.dumps(line), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
