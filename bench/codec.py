"""Codec micro-benchmark: each stage of the exact compressed allreduce's codec, the
current code against a baseline revision, side by side in one process.

    .venv/bin/python bench/codec.py [--sizes 16,64] [--bits 4,8] [--reps 7] [--base 4e05003]
    RESILIENT_QCODEC=0 .venv/bin/python bench/codec.py ...   # the current torch code (no C codec)

The baseline is ``resilient/collectives/quantization.py`` as of ``--base`` (default: the
commit before the tight wire widths and the C codec), read with ``git show`` and loaded as a
private module; its ring steps are the ones ``QuantizedRing`` had at that commit.
Stages, on ``size`` MiB of float32 (one quantization segment, bucket 1024, 4 members):
``maxima`` (bucket max |x|), ``quantize`` (with error feedback's residual, into a given
buffer), ``pack_b`` (b-bit wire of one input), ``rs_first`` (the first reduce-scatter
receive: unpack the b-bit wire, add this member's input, pack the sum of two for the next
send), ``rs_second`` (the same for the sum of three), ``ag_recv`` (an all-gather receive:
unpack the final sum into int32), ``dequantize`` (into the caller's float32 tensor, with an
AVG's division by 4). The wire widths are each revision's own (before: int8/int16 for
partial sums; now: the narrowest width, e.g. 5 and 6 bits at q4).

Every stage's int32 or float32 output is compared bitwise between the two (``equal``: the
wire bytes differ by design, the values they carry must not); ``wire_bits`` gives each
revision's bits per element sent by one member over the ring's six steps. Rates are MB/s
of float32 input (``4 * numel / median seconds``), alternating before/after runs so that
both see the same load; report ``/proc/loadavg`` with them. One JSON line per (size,
bits). Fails (exit 1) when an output differs.
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
from resilient.kernels import qcodec  # noqa: E402

BUCKET, MEMBERS = 1024, 4


def load_baseline(rev: str) -> types.ModuleType:
    """The quantization module as of ``rev`` (raises CalledProcessError if git lacks it)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:resilient/collectives/quantization.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("quantization_baseline")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:quantization.py", "exec"), mod.__dict__)
    return mod


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
    two, three, four = q * 2, q * 3, q * 4   # partial sums over 2, 3 and 4 members
    qbuf, res = torch.empty(numel, dtype=torch.int32), torch.empty(numel, dtype=torch.float32)
    acc = torch.empty(numel, dtype=torch.int32)
    dq = torch.empty(numel, dtype=torch.float32)
    widths = {"old": [old.wire_bits(bits, k, MEMBERS) for k in (1, 2, 3, 4)],
              "new": [new.wire_bits(bits, k, MEMBERS) for k in (1, 2, 3, 4)]}

    def pair(name: str, f_old: Callable[[], torch.Tensor], f_new: Callable[[], torch.Tensor],
             decode: Callable[[types.ModuleType, torch.Tensor], torch.Tensor] | None = None) -> tuple[str, dict[str, object]]:
        a = f_old().clone()
        b = f_new()
        if decode is not None:   # wire bytes of two formats: compare what they carry
            a, b = decode(old, a), decode(new, b)
        equal = bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
        t_old = t_new = 0.0
        for _ in range(2):  # alternate so both codecs see the same load
            t_old += median_s(f_old, reps)
            t_new += median_s(f_new, reps)
        mb = 4 * numel / 1e6
        return name, {"before_mb_s": round(2 * mb / t_old), "after_mb_s": round(2 * mb / t_new),
                      "speedup": round(t_old / t_new, 2), "equal": equal}

    def rs(mod: types.ModuleType, k: int, val: torch.Tensor) -> Callable[[], torch.Tensor]:
        """One reduce-scatter receive of a sum over k, plus the pack of the sum over k + 1."""
        w_in, w_out = mod.wire_bits(bits, k, MEMBERS), mod.wire_bits(bits, k + 1, MEMBERS)
        wire = mod.pack(val, w_in)
        if mod is new:
            dst = torch.empty(new.wire_nbytes(numel, w_out), dtype=torch.uint8)
            return lambda: (new.unpack_add_pack(wire, numel, w_in, acc, q, dst, w_out), acc)[1]

        def f() -> torch.Tensor:   # the baseline ring: unpack, widen, add, then pack
            vals = old.unpack(wire, numel, w_in)
            if vals.dtype == acc.dtype:
                torch.add(q, vals, out=acc)
            else:
                acc.copy_(vals)
                acc.add_(q)
            old.pack(acc, w_out)
            return acc
        return f

    def ag(mod: types.ModuleType) -> Callable[[], torch.Tensor]:
        w = mod.wire_bits(bits, MEMBERS, MEMBERS)
        wire = mod.pack(four, w)
        if mod is new:
            return lambda: (new.unpack_add(wire, numel, w, acc), acc)[1]
        return lambda: acc.copy_(old.unpack(wire, numel, w))

    def deq_old() -> torch.Tensor:
        old.dequantize(four, sc, segs_old, BUCKET, out=dq)
        return dq.div_(MEMBERS)

    def quant_old() -> torch.Tensor:   # the residual x - s*q: equal residuals, equal q (s > 0 here)
        old.quantize(x, sc, segs_old, BUCKET, MEMBERS, out=qbuf, finite=True, residual=res)
        return res

    def quant_new() -> torch.Tensor:
        new.quantize(x, sc, segs_new, BUCKET, MEMBERS, out=qbuf, finite=True, residual=res)
        return res

    stages = dict([
        pair("maxima", lambda: old.bucket_maxima(x, segs_old, BUCKET), lambda: new.bucket_maxima(x, segs_new, BUCKET)),
        pair("quantize", quant_old, quant_new),
        pair(f"pack_{bits}", lambda: old.pack(q, bits), lambda: new.pack(q, bits),
             lambda mod, w: mod.unpack(w, numel, bits).to(torch.int32)),
        pair("rs_first", rs(old, 1, q), rs(new, 1, q)),
        pair("rs_second", rs(old, 2, two), rs(new, 2, two)),
        pair("ag_recv", ag(old), ag(new)),
        pair("dequantize", deq_old, lambda: new.dequantize(four, sc, segs_new, BUCKET, out=dq, divisor=MEMBERS)),
    ])
    del three
    return {"size_mib": size_mib, "bits": bits, "threads": torch.get_num_threads(),
            "c_codec": qcodec.codec() is not None, "wire_widths": widths,
            "wire_bits": {k: v[0] + v[1] + v[2] + 3 * v[3] for k, v in widths.items()},
            "stages": stages, "equal": all(bool(s["equal"]) for s in stages.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64", help="MiB of float32, comma-separated")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--base", default="4e05003", help="git revision of the baseline codec")
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
