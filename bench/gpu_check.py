#!/usr/bin/env python3
"""The whole GPU path in one run (issue 18), under 5 minutes on a GPU machine.

One JSON line per check, each with ``check``, ``gpu`` (whether it ran on a GPU) and
``passed`` (``null`` = could not run here, with ``skipped`` saying why)::

    python bench/gpu_check.py [--size-mib 256] [--ranks-mib 64] [--skip-compile] [--only NAME,...]

Checks, in order (docs/cuda.md):

``compile``          every ``kernels/cuda/*.cu`` compiles with nvcc for sm_80 and sm_90 (wherever nvcc is).
``kernels``          every reduce kernel (sum/avg/min/max/prod x float32/float64/float16/bfloat16/
                     int32/int64), aligned and unaligned, odd lengths, bit-exact (NaN-aware) against
                     torch on CPU and, where torch has CUDA, against torch's own CUDA op.
``bandwidth``        reduce kernel vs ``torch.add_`` on the same buffers: ``ratio`` (passed: >= 0.9).
``interrupted``      chunks 0..k-1 reduced, a gate holds the stream, k..n-1 queued: the marks name
                     exactly 0..k-1 while it is held and those chunks' data is already final.
``staging``          the host-staged pipeline (resilient.device.staging) through the device ops
                     (CudaOps; CpuOps where there is no GPU, reported ``gpu: false``): every receive
                     mode exact, and an abort mid-receive leaves marks and piece states exact.
``host_staged_allreduce``  4 ranks sharing one GPU, ``Communicator.allreduce(cuda_tensor)`` over the
                     host-staged path vs gloo's CUDA-tensor allreduce in the same processes:
                     ``busbw_ratio`` (ours / gloo), passed = every result exact.
``host_staged_sigkill``    the same 4 ranks, one SIGKILLs itself mid-allreduce: every survivor's
                     result equals the reduction over the contributors it reports.
``nccl_allreduce`` / ``nccl_sigkill``  the same two with one rank per GPU (needs >= 2 GPUs), where
                     the selection (resilient.device.select) picks NCCL from the members'
                     records: passed = every result exact and every member's ops went over
                     NCCL (``transport``; the host-staged checks must stay host-staged).

Exit status: 0 when every check that ran passed, 1 otherwise; without a GPU only
``compile`` and the CPU ``staging`` check run and the GPU checks print ``passed: null``.
The multi-rank checks call ``Communicator.allreduce`` on CUDA tensors (the host-staged
path); a refusal is reported as ``passed: false`` with the Communicator's message.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import zlib
from typing import Any, Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]
RANKS = 4
BANDWIDTH_TARGET = 0.9
Result = dict[str, Any]


def emit(obj: Result) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


def gpu_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy, a driver or a device)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return 0


def skipped(check: str, why: str, gpu: bool = False) -> Result:
    return {"check": check, "gpu": gpu, "passed": None, "skipped": why}


# -- compile ------------------------------------------------------------------------------


def check_compile(gpu: bool) -> Result:
    from resilient.kernels import nvcc

    if nvcc.find_nvcc() is None:
        return skipped("compile", "nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)", gpu)
    results = nvcc.compile_all(jobs=min(4, os.cpu_count() or 1))
    failed = [r.describe() for r in results if not r.ok]
    for text in failed:
        print(text, file=sys.stderr)
    return {"check": "compile", "gpu": gpu, "passed": not failed, "compiled": len(results) - len(failed),
            "failed": len(failed)}


# -- kernels vs torch ---------------------------------------------------------------------


def _inputs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        emax = 14 if dtype == torch.float16 else 20

        def mk() -> torch.Tensor:
            mant = torch.rand(n, generator=g, dtype=torch.float64) + 1
            exp = torch.randint(-emax, emax + 1, (n,), generator=g).double()
            sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
            return (mant * torch.pow(2.0, exp) * sign).to(dtype)

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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        x, y = a.double(), b.double()
        return bool(torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x.nan_to_num(0), y.nan_to_num(0)))
    return bool(torch.equal(a, b))


def check_kernels() -> Result:
    from resilient.kernels import reduce_into
    from resilient.kernels.cupy_impl import CupyChunkReducer

    red = CupyChunkReducer(1)
    cuda_torch = torch.cuda.is_available()
    failed: list[str] = []
    cases = 0
    for name in DTYPES:
        dtype = getattr(torch, name)
        for op in OPS:
            for offset, n in ((0, (1 << 20) + 3), (1, 4099)):      # aligned + tail, unaligned
                cases += 1
                d, s = _inputs(dtype, n + offset, zlib.crc32(f"{name}{op}{n}".encode()))
                want = d.clone()
                reduce_into(want[offset:], s[offset:], op)         # torch on CPU
                got, why = _run_kernel(red, d, s, offset, op, name, cases)
                if not _same(got, want):
                    failed.append(f"{op}/{name}/offset{offset}: differs from torch on CPU")
                if why:
                    failed.append(f"{op}/{name}/offset{offset}: {why}")
                if cuda_torch:
                    td, ts = d.cuda(), s.cuda()
                    reduce_into(td[offset:], ts[offset:], op)      # torch's own CUDA op
                    if not _same(got, td.cpu()):
                        failed.append(f"{op}/{name}/offset{offset}: differs from torch on CUDA")
    return {"check": "kernels", "gpu": True, "passed": not failed, "cases": cases, "failed": failed,
            "vs_torch_cuda": cuda_torch}


def _run_kernel(red: Any, d: torch.Tensor, s: torch.Tensor, offset: int, op: str, name: str,
                mark: int) -> tuple[torch.Tensor, str]:
    """The kernel's result on copies of ``d``/``s`` (CuPy arrays of their bits) + a mark problem."""
    import cupy

    def bits(t: torch.Tensor) -> Any:
        return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

    gd, gs = cupy.asarray(bits(d)), cupy.asarray(bits(s))
    red.reset()
    red.reduce_chunk(0, gd[offset:], gs[offset:], op, mark=mark, dtype=name)
    red.synchronize()
    got = torch.from_numpy(cupy.asnumpy(gd))
    if d.dtype == torch.bfloat16:
        got = got.view(torch.bfloat16)
    ok = red.marks.finished() == (0,) and red.marks.get(0) == mark
    return got, "" if ok else f"marks {red.marks.read().tolist()}, expected [{mark}]"


# -- bandwidth ----------------------------------------------------------------------------


def _time_gpu(fn: Callable[[], Any], iters: int) -> float:
    import cupy

    for _ in range(3):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return float(cupy.cuda.get_elapsed_time(start, end)) / 1e3 / iters


def check_bandwidth(size_mib: int) -> Result:
    import cupy

    from resilient.kernels.cupy_impl import CupyChunkReducer

    red = CupyChunkReducer(1)
    n = size_mib * (1 << 20) // 4
    a = cupy.ones(n, dtype=cupy.float32)
    b = cupy.ones(n, dtype=cupy.float32)
    moved = 3 * a.nbytes                        # 2 reads + 1 write per element
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        k = _time_gpu(lambda: red.reduce_into(a, b, "sum", stream=stream.ptr), 20)
        if torch.cuda.is_available():
            ta, tb = torch.utils.dlpack.from_dlpack(a), torch.utils.dlpack.from_dlpack(b)   # the same buffers
            ext = torch.cuda.ExternalStream(stream.ptr)  # type: ignore[no-untyped-call]  # unannotated in torch
            with torch.cuda.stream(ext):
                t = _time_gpu(lambda: ta.add_(tb), 20)
            baseline = "torch.add_"
        else:
            t = _time_gpu(lambda: cupy.add(a, b, out=a), 20)
            baseline = "cupy.add (this torch has no CUDA)"
    ratio = round(t / k, 3)
    return {"check": "bandwidth", "gpu": True, "passed": ratio >= BANDWIDTH_TARGET, "ratio": ratio,
            "target": BANDWIDTH_TARGET, "bytes": int(a.nbytes), "baseline": baseline,
            "kernel_gbps": round(moved / k / 1e9, 1), "torch_gbps": round(moved / t / 1e9, 1)}


# -- interrupted stream -------------------------------------------------------------------


def check_interrupted(n_chunks: int = 16, held_after: int = 7, chunk_elems: int = 1 << 22) -> Result:
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
    all_done = red.marks.finished() == tuple(range(n_chunks)) and bool(np.array_equal(cupy.asnumpy(acc), expect))
    passed = exact and data_final and marks_ok and all_done and not gate.timed_out
    return {"check": "interrupted", "gpu": True, "passed": passed, "chunks": n_chunks, "held_after": held_after,
            "marks_while_held": list(seen[-1]), "exact": exact, "finished_data_final": data_final,
            "all_done_after_release": all_done, "gate_timed_out": gate.timed_out}


# -- staging pipeline through the device ops ----------------------------------------------


class _Loopback:
    """In-process wire: a send stores its slot's bytes, a receive fills its slot from the
    stored bytes; both complete when waited on; ``fail_at`` fails that receive."""

    class Req:
        def __init__(self, run: Callable[[], None]) -> None:
            self.run, self._done = run, False

        def done(self) -> bool:
            return self._done

        def complete(self) -> None:
            if not self._done:
                self.run()
                self._done = True

    def __init__(self, fail_at: int | None = None) -> None:
        self.net: dict[int, torch.Tensor] = {}
        self.fail_at = fail_at

    def send(self, chunk: Any, stage: torch.Tensor) -> "_Loopback.Req":
        return self.Req(lambda: self.net.__setitem__(chunk.index, stage.clone()))

    def recv(self, chunk: Any, stage: torch.Tensor) -> "_Loopback.Req":
        def run() -> None:
            if chunk.index == self.fail_at:
                from resilient.errors import TransportError

                raise TransportError(f"loopback: receive of chunk {chunk.index} failed")
            stage.copy_(self.net[chunk.index])
        return self.Req(run)

    def wait(self, reqs: Sequence[Any]) -> None:
        for r in reqs:
            r.complete()


def check_staging(gpu: bool) -> Result:
    from resilient.device import PieceState, RecvMode, StagingPipeline, device_ops, plan_chunks
    from resilient.errors import TransportError

    ops = device_ops("cuda:0" if gpu else "cpu")
    n, problems = 3 * (1 << 20) + 5, []
    pieces = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    chunks = plan_chunks(pieces, 1 << 18)
    src = torch.arange(n, dtype=torch.float32, device=ops.device) % 1000
    own = torch.ones(n, dtype=torch.float32, device=ops.device)
    ops.wait_for_caller()                     # src/own were made on the caller's stream
    wire = _Loopback()
    StagingPipeline(ops, chunks, torch.float32, wire.wait, slots=2).send(src, wire.send)
    for mark, mode in enumerate(RecvMode, start=1):
        dst = torch.full((n,), 5.0, device=ops.device)
        ops.wait_for_caller()
        pl = StagingPipeline(ops, chunks, torch.float32, wire.wait, slots=3)
        pl.recv(dst, wire.recv, mark=mark, mode=mode, own=own)
        ops.synchronize()
        want = {RecvMode.COPY: src, RecvMode.ACCUMULATE: src + 5.0, RecvMode.COMBINE: src + own}[mode]
        if not torch.equal(dst, want):
            problems.append(f"{mode.value}: wrong values")
        if pl.settle(mark) != {p: PieceState.COMPLETE for p in range(3)}:
            problems.append(f"{mode.value}: not every piece complete")
    fail = len(chunks) // 2
    broken = _Loopback(fail_at=fail)
    broken.net = wire.net
    dst = torch.full((n,), 5.0, device=ops.device)
    ops.wait_for_caller()
    pl = StagingPipeline(ops, chunks, torch.float32, broken.wait, slots=2)
    try:
        pl.recv(dst, broken.recv, mark=9, mode=RecvMode.ACCUMULATE)
        problems.append("abort: the failing receive did not raise")
    except TransportError:
        pass
    ops.synchronize()                         # let the enqueued reductions finish, then read
    states = pl.settle(9)
    marked = pl.reducer.marks.finished(mark=9)
    if marked != tuple(range(fail)):
        problems.append(f"abort: marks {marked}, expected chunks 0..{fail - 1}")
    for c in chunks[:fail]:
        if not torch.equal(dst[c.start:c.end], src[c.start:c.end] + 5.0):
            problems.append(f"abort: marked chunk {c.index} is not final")
    end = chunks[fail].start
    if not torch.equal(dst[end:], torch.full((n - end,), 5.0, device=ops.device)):
        problems.append("abort: a chunk after the failure was written")
    want_states = {p: (PieceState.COMPLETE if all(c.index < fail for c in chunks if c.piece == p) else
                       PieceState.UNTOUCHED if all(c.index >= fail for c in chunks if c.piece == p) else
                       PieceState.LOST) for p in range(3)}
    if states != want_states:
        problems.append(f"abort: piece states {states}, expected {want_states}")
    return {"check": "staging", "gpu": gpu, "passed": not problems, "problems": problems, "chunks": len(chunks),
            "ops": type(ops).__name__}


# -- multi-rank: the driver ---------------------------------------------------------------


def _cluster_check(name: str, devices: list[str], size_mib: int, kill: bool) -> Result:
    """``len(devices)`` real member processes (etcd, coordinator: bench/_common.py), rank
    ``i`` on ``devices[i]``; without ``kill`` time ours vs gloo, with it SIGKILL ``m1`` in
    op #2 and check every survivor."""
    from _common import BenchCluster, BenchError, busbw, median

    from resilient.device import choose_transport
    from resilient.device.probe import local_record

    world = len(devices)
    choice = choose_transport([local_record(f"m{i}", "localhost", d, nccl=True) for i, d in enumerate(devices)])
    victim = "m1"
    from resilient.coordinator.local_etcd import free_port

    args = ["--size-mib", str(size_mib), "--devices", ",".join(devices)]
    if not kill:
        args += ["--gloo-port", str(free_port())]
    env: Callable[[str], dict[str, str]] = (
        (lambda mid: {"RESILIENT_FAILPOINTS": "kill@op=2,phase=rs,frac=0.5"} if mid == victim else {})
        if kill else (lambda mid: {}))
    base: Result = {"check": name, "gpu": True, "world": world, "devices": devices,
                    "expected_transport": choice.kind, "selection_reason": choice.reason}
    try:
        with BenchCluster(os.path.abspath(__file__), world, job=f"gpu-check-{name.replace('_', '-')}",
                          worker_args=args, env_for=env) as cl:
            mids = sorted(cl.procs)
            if kill:
                cl.watch_exit(victim)
            cl.send(mids, json.dumps({"kill": kill}))
            survivors = [m for m in mids if not (kill and m == victim)]
            res = cl.expect_all(survivors, "result", timeout=240)
            cl.send(survivors, "quit")
    except BenchError as exc:
        return {**base, "passed": False, "error": str(exc)[-2000:]}
    refused = sorted({r["refused"] for r in res.values() if r.get("refused")})
    if refused:
        return {**base, "passed": False, "error": "the Communicator refused the CUDA tensor: " + refused[0]}
    exact = all(r["exact"] for r in res.values())
    # the ops went over the transport the selection names (NCCL: every survivor routed its ops there)
    used = "nccl" if all(r.get("nccl_ops", 0) > 0 for r in res.values()) else "host-staged"
    routed = used == choice.kind
    out = {**base, "passed": exact and routed, "exact": exact, "transport": used,
           "contributors": sorted({tuple(r["contributors"]) for r in res.values()})}
    if not kill:
        size = size_mib << 20
        t_ours = max(median(r["t_ours"]) for r in res.values())
        t_gloo = max(median(r["t_gloo"]) for r in res.values())
        ours, gloo = busbw(size, t_ours, world), busbw(size, t_gloo, world)
        out.update(busbw_resilient=round(ours), busbw_gloo=round(gloo), busbw_ratio=round(ours / gloo, 3),
                   ratio=round(ours / gloo, 3), size_bytes=size)
    return out


# -- multi-rank: the member ---------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One member: join, take its CUDA device, answer one spec line, then "quit"."""
    import torch.distributed as dist
    from _common import emit as say
    from _common import join, wait_go

    from resilient.errors import ConfigError

    mine = torch.device(args.devices.split(",")[int(args.id.lstrip("m"))])
    torch.cuda.set_device(mine)
    # the member record carries the device and GPU UUID: the epoch selects NCCL or host staging
    comm, transport, session, index = join(args, op_timeout=30.0, device=str(mine))
    dev = torch.device(args.devices.split(",")[index])
    torch.cuda.set_device(dev)
    if args.gloo_port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=index,
                                world_size=args.world)
    say("ready")
    spec = json.loads(wait_go())
    numel = (args.size_mib << 20) // 4
    try:
        x = torch.full((numel,), float(index + 1), device=dev)
        comm.allreduce(x)                                            # op 0: warm-up, connections
        comm.barrier()                                               # op 1
        x = torch.full((numel,), float(index + 1), device=dev)
        w = comm.allreduce(x)                                        # op 2 (m1 dies here under kill)
        torch.cuda.synchronize(dev)
        contributors = list(w.contributors)
        expect = float(sum(int(m.lstrip("m")) + 1 for m in contributors))
        exact = bool(torch.all(x == expect).item())
        fields: dict[str, Any] = {"exact": exact, "contributors": contributors,
                                  "nccl_ops": comm.device_route.nccl_ops}
        if not spec["kill"]:
            fields.update(_timings(comm, dist, numel, dev))
        say("result", **fields)
    except ConfigError as exc:
        say("result", refused=str(exc), exact=False, contributors=[])
    wait_go()
    if args.gloo_port:
        dist.destroy_process_group()
    comm.close()
    session.close(revoke=True, reason="gpu_check done")
    transport.close()


def _timings(comm: Any, dist: Any, numel: int, dev: torch.device, rounds: int = 5, iters: int = 4) -> Result:
    """Seconds per allreduce, ours and gloo's, alternating, each after a gloo barrier."""
    x = torch.ones(numel, device=dev)
    t: dict[str, list[float]] = {"t_ours": [], "t_gloo": []}
    for r in range(rounds):
        for key in (("t_ours", "t_gloo") if r % 2 == 0 else ("t_gloo", "t_ours")):
            dist.barrier()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                if key == "t_gloo":
                    dist.all_reduce(x)
                else:
                    comm.allreduce(x)
            torch.cuda.synchronize(dev)
            t[key].append((time.perf_counter() - t0) / iters)
    return dict(t)


# -- main ---------------------------------------------------------------------------------

CHECKS = ("compile", "kernels", "bandwidth", "interrupted", "staging",
          "host_staged_allreduce", "host_staged_sigkill", "nccl_allreduce", "nccl_sigkill")


def run_checks(args: argparse.Namespace) -> list[Result]:
    n_gpus = gpu_count()
    gpu = n_gpus > 0
    wanted = set(args.only.split(",")) if args.only else None
    if wanted is not None and not wanted <= set(CHECKS):
        raise SystemExit(f"gpu_check: unknown check(s) {sorted(wanted - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    results: list[Result] = []

    def run(name: str, fn: Callable[[], Result]) -> None:
        if wanted is not None and name not in wanted:
            return
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            res = {"check": name, "gpu": gpu, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
        emit(res)
        results.append(res)

    if not args.skip_compile:
        run("compile", lambda: check_compile(gpu))
    why_not = "no CUDA device (CuPy sees none, or CuPy is missing: pip install -e '.[gpu]')"
    for name, fn in (("kernels", check_kernels), ("bandwidth", lambda: check_bandwidth(args.size_mib)),
                     ("interrupted", check_interrupted)):
        run(name, fn if gpu else functools.partial(skipped, name, why_not))
    run("staging", lambda: check_staging(gpu and torch.cuda.is_available()))
    ranks_ok = gpu and torch.cuda.is_available()
    no_ranks = why_not if not gpu else "this torch has no CUDA (gloo's CUDA allreduce and CUDA tensors need it)"
    shared = ["cuda:0"] * RANKS
    own = [f"cuda:{i}" for i in range(min(RANKS, n_gpus))]
    for name, devices, kill in (("host_staged_allreduce", shared, False), ("host_staged_sigkill", shared, True),
                                ("nccl_allreduce", own, False), ("nccl_sigkill", own, True)):
        if not ranks_ok:
            run(name, functools.partial(skipped, name, no_ranks))
        elif name.startswith("nccl") and len(own) < 2:
            run(name, functools.partial(skipped, name, f"{n_gpus} GPU(s): NCCL checks need >= 2", gpu=True))
        else:
            run(name, functools.partial(_cluster_check, name, devices, args.ranks_mib, kill))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="buffer size of the bandwidth check")
    ap.add_argument("--ranks-mib", type=int, default=64, help="allreduce size of the multi-rank checks")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--etcd", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    ap.add_argument("--lease-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=RANKS, help=argparse.SUPPRESS)
    ap.add_argument("--devices", default="", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        os._exit(0)
    results = run_checks(args)
    return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
