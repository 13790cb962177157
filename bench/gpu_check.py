#!/usr/bin/env python3
"""The GPU path in one run (issue 7), under 5 minutes, printing one JSON object per check.

1. compile every CUDA source of resilient.kernels with nvcc for sm_80 and sm_90;
   without a GPU it prints ``{"compiled": N, "gpu": false}`` and exits 0 here.
Where a GPU exists (CuPy with a CUDA device), also:
2. correctness: every kernel (sum/avg/min/max/prod x float32/float64/float16/bfloat16/
   int32/int64), aligned and unaligned, odd lengths, against torch on CPU, bit-exact
   (NaN-aware) - the CPU path is itself checked against rounded float64 references;
3. bandwidth of the reduce kernel vs ``torch.add_`` on the same buffers:
   ``{"kernel_gbps", "torch_gbps", "ratio"}`` (bytes moved = 3 x buffer: 2 reads, 1 write;
   target ratio >= 0.9);
4. interruption: chunk reductions 0..k-1, then a gate that holds the stream, then k..n-1;
   while the stream is held the progress marks must name exactly chunks 0..k-1, and those
   chunks' data (copied on a second stream) must already be final.

Exit status: 0 when every check that could run passed (the bandwidth ratio is reported
with ``meets_target``, not enforced), 1 otherwise. Usage::

    python bench/gpu_check.py [--size-mib 256] [--skip-compile]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]


def emit(obj: dict) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


def check_compile() -> tuple[int, bool]:
    from resilient.kernels import nvcc

    if nvcc.find_nvcc() is None:
        print("gpu_check: nvcc not found; skipping the compile check", file=sys.stderr)
        return 0, True
    results = nvcc.compile_all(jobs=min(4, os.cpu_count() or 1))
    for r in results:
        if not r.ok:
            print(r.describe(), file=sys.stderr)
    return sum(r.ok for r in results), all(r.ok for r in results)


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


# -- 2. correctness ---------------------------------------------------------------------


def _inputs(dtype, n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        emax = 14 if dtype == torch.float16 else 20
        mk = lambda: ((torch.rand(n, generator=g, dtype=torch.float64) + 1)  # noqa: E731
                      * torch.pow(2.0, torch.randint(-emax, emax + 1, (n,), generator=g).double())
                      * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).to(dtype)
        d, s = mk(), mk()
        fi = torch.finfo(dtype)
        sp_d = [1.0, 1.0 + fi.eps, fi.max, float("inf"), float("nan"), 3.0, fi.tiny, 0.0]
        sp_s = [fi.eps / 2, fi.eps / 2, fi.max, float("-inf"), 2.0, float("nan"), fi.tiny / 4, -0.0]
        d[: len(sp_d)] = torch.tensor(sp_d, dtype=torch.float64).to(dtype)
        s[: len(sp_s)] = torch.tensor(sp_s, dtype=torch.float64).to(dtype)
        return d, s
    info = torch.iinfo(dtype)
    d = torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)
    s = torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)
    d[:2] = torch.tensor([info.max, info.min], dtype=dtype)
    s[:2] = torch.tensor([1, -1], dtype=dtype)
    return d, s


def _bits(t):
    """A numpy view of a CPU tensor's raw bits (numpy has no bfloat16)."""
    import torch

    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _same(a, b) -> bool:
    import torch

    if a.dtype.is_floating_point:
        x, y = a.double(), b.double()
        return bool(torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x.nan_to_num(0), y.nan_to_num(0)))
    return bool(torch.equal(a, b))


def check_correctness(red) -> dict:
    import cupy
    import torch

    from resilient.kernels import reduce_into

    failed, cases = [], 0
    for name in DTYPES:
        dtype = getattr(torch, name)
        for op in OPS:
            for offset, n in ((0, (1 << 20) + 3), (1, 4099)):      # aligned + tail, unaligned
                cases += 1
                d, s = _inputs(dtype, n + offset, zlib.crc32(f"{name}{op}{n}".encode()))
                want = d.clone()
                reduce_into(want[offset:], s[offset:], op)         # torch on CPU
                gd, gs = cupy.asarray(_bits(d)), cupy.asarray(_bits(s))
                red.reset()
                red.reduce_chunk(0, gd[offset:], gs[offset:], op, mark=cases, dtype=name)
                red.synchronize()
                got = torch.from_numpy(cupy.asnumpy(gd))
                if dtype == torch.bfloat16:
                    got = got.view(torch.bfloat16)
                if not _same(got, want) or red.marks.finished() != (0,) or red.marks.get(0) != cases:
                    failed.append(f"{op}/{name}/offset{offset}")
    return {"check": "correctness", "cases": cases, "failed": failed, "ok": not failed}


# -- 3. bandwidth -------------------------------------------------------------------------


def _time_gpu(fn, iters: int) -> float:
    import cupy

    for _ in range(3):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters


def check_bandwidth(red, size_mib: int) -> dict:
    import cupy
    import torch

    n = size_mib * (1 << 20) // 4
    a = cupy.ones(n, dtype=cupy.float32)
    b = cupy.ones(n, dtype=cupy.float32)
    moved = 3 * a.nbytes
    stream = cupy.cuda.Stream(non_blocking=True)     # one named stream for both, never the null one
    with stream:
        k = _time_gpu(lambda: red.reduce_into(a, b, "sum", stream=stream.ptr), 20)
        out = {"check": "bandwidth", "bytes": a.nbytes, "kernel_gbps": round(moved / k / 1e9, 1)}
        if torch.cuda.is_available():
            ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)       # the same buffers
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
                t = _time_gpu(lambda: ta.add_(tb), 20)
            out["baseline"] = "torch.add_"
        else:
            t = _time_gpu(lambda: cupy.add(a, b, out=a), 20)
            out["baseline"] = "cupy.add (this torch has no CUDA)"
    out["torch_gbps"] = round(moved / t / 1e9, 1)
    out["ratio"] = round(t / k, 3)
    out["meets_target"] = out["ratio"] >= 0.9
    out["ok"] = True
    return out


# -- 4. interrupted sequence -------------------------------------------------------------


def check_interrupted(n_chunks: int = 16, held_after: int = 7, chunk_elems: int = 1 << 22) -> dict:
    import cupy
    import numpy as np

    from resilient.kernels.cupy_impl import CupyChunkReducer, Gate

    red = CupyChunkReducer(n_chunks)
    acc = cupy.arange(n_chunks * chunk_elems, dtype=cupy.float32).reshape(n_chunks, chunk_elems)
    add = cupy.ones_like(acc)
    expect = cupy.asnumpy(acc) + 1
    gate = Gate()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for c in range(held_after):
            red.reduce_chunk(c, acc[c], add[c], "sum", mark=100 + c, stream=stream.ptr)
        gate.hold(stream.ptr, max_seconds=60)
        for c in range(held_after, n_chunks):
            red.reduce_chunk(c, acc[c], add[c], "sum", mark=100 + c, stream=stream.ptr)
    want = tuple(range(held_after))
    deadline = time.monotonic() + 30
    while red.marks.finished() != want and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = [red.marks.finished() for _ in range(200)]              # the stream is still held
    exact = all(s == want for s in seen) and not stream.done
    side = cupy.cuda.Stream(non_blocking=True)                     # read finished chunks meanwhile
    with side:
        early = cupy.asnumpy(acc[:held_after], stream=side)
    side.synchronize()
    data_final = bool(np.array_equal(early, expect[:held_after]))
    marks_ok = all(red.marks.get(c) == 100 + c for c in want)
    gate.open()
    stream.synchronize()
    all_done = red.marks.finished() == tuple(range(n_chunks))
    all_data = bool(np.array_equal(cupy.asnumpy(acc), expect))
    ok = exact and data_final and marks_ok and all_done and all_data and not gate.timed_out
    return {"check": "interrupted", "chunks": n_chunks, "held_after": held_after,
            "marks_while_held": list(seen[-1]), "exact": exact, "finished_data_final": data_final,
            "all_done_after_release": all_done and all_data, "gate_timed_out": gate.timed_out, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="buffer size for the bandwidth check")
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args(argv)
    ok = True
    compiled = 0
    if not args.skip_compile:
        compiled, ok = check_compile()
    if not gpu_available():
        emit({"compiled": compiled, "gpu": False})
        return 0 if ok else 1
    emit({"compiled": compiled, "gpu": True})
    from resilient.kernels.cupy_impl import CupyChunkReducer

    red = CupyChunkReducer(1)
    for check in (lambda: check_correctness(red), lambda: check_bandwidth(red, args.size_mib), check_interrupted):
        try:
            res = check()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            res = {"check": getattr(check, "__name__", "check"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        emit(res)
        ok = ok and res["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
