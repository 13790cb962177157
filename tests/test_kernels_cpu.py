"""CPU reduction kernels and progress marks against independent references.

References are computed in float64 (numpy) from the same inputs and rounded once to the
tested dtype. Inputs are chosen so that the float64 computation is exact (magnitudes
within 2^±20 for the random part), so the rounded reference is the correctly rounded
result; the kernels must match it with **zero ulp** difference for every dtype, float16
and bfloat16 included (see resilient/kernels/cpu.py for why torch's float32-then-round
gives exactly that). Integer references wrap in numpy's unsigned arithmetic.
"""
from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from resilient.errors import ConfigError
from resilient.kernels import CpuChunkReducer, ProgressMarks, ReduceOp, chunk_reducer, reduce_into

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
OPS = list(ReduceOp)
N = 4096


def _specials(dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Pairs (dst, src) that exercise rounding ties, overflow, NaN/inf and subnormals."""
    fi = torch.finfo(dtype)
    big, tiny = float(fi.max), float(fi.smallest_normal)
    eps = float(fi.eps)          # ulp of 1.0
    d = [1.0, 1.0 + eps, 1.0, big, -big, big, float("inf"), float("-inf"), float("nan"), 3.0,
         tiny, tiny / 4, 0.0, -2.0, 65504.0 if dtype == torch.float16 else 1e4]
    s = [eps / 2, eps / 2, -eps / 4, big, -big, -big, float("-inf"), 1.0, 2.0, float("nan"),
         tiny, tiny / 4, -0.0, 0.5, 65504.0 if dtype == torch.float16 else 1e4]
    return d, s


def _random_float(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    emax = 14 if dtype == torch.float16 else 20
    mant = torch.rand(n, generator=gen, dtype=torch.float64) + 1.0
    exp = torch.randint(-emax, emax + 1, (n,), generator=gen).double()
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * mant * torch.pow(2.0, exp)).to(dtype)   # exactly representable in dtype


def _float_inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d, s = _random_float(dtype, N, gen), _random_float(dtype, N, gen)
    sd, ss = _specials(dtype)
    d[: len(sd)] = torch.tensor(sd, dtype=torch.float64).to(dtype)
    s[: len(ss)] = torch.tensor(ss, dtype=torch.float64).to(dtype)
    return d, s


def _float_reference(d: torch.Tensor, s: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    a, b = d.double().numpy(), s.double().numpy()
    with np.errstate(all="ignore"):
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            r = a + b
        elif op is ReduceOp.PROD:
            r = a * b
        elif op is ReduceOp.MIN:
            r = np.minimum(a, b)        # propagates NaN, like torch.minimum
        else:
            r = np.maximum(a, b)
    return torch.from_numpy(r).to(d.dtype)


def _assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    g, w = got.double().numpy(), want.double().numpy()
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert np.array_equal(nan_g, nan_w), f"NaN positions differ at {np.flatnonzero(nan_g != nan_w)[:10]}"
    bad = np.flatnonzero((g != w) & ~nan_g)
    assert bad.size == 0, f"{bad.size} elements differ, first: idx {bad[:5]} got {g[bad[:5]]} want {w[bad[:5]]}"


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda t: str(t).replace("torch.", ""))
def test_float_reduction_matches_rounded_float64_reference(dtype, op):
    d, s = _float_inputs(dtype, seed=zlib.crc32(f"{dtype}/{op.value}".encode()))
    want = _float_reference(d, s, op)
    src_before = s.clone()
    reduce_into(d, s, op)
    _assert_same_values(d, want)
    _assert_same_values(s, src_before)          # src is not modified


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_sum_rounds_ties_to_even(dtype):
    eps = torch.finfo(dtype).eps
    # 1 + eps/2 is exactly half-way between 1 and 1+eps: even mantissa (1.0) wins.
    # (1+eps) + eps/2 is half-way between 1+eps and 1+2eps: 1+2eps has the even mantissa.
    d = torch.tensor([1.0, 1.0 + eps, -1.0], dtype=dtype)
    s = torch.tensor([eps / 2, eps / 2, -eps / 2], dtype=dtype)
    reduce_into(d, s, "sum")
    assert d.tolist() == [1.0, 1.0 + 2 * eps, -1.0]


def _int_reference(d: np.ndarray, s: np.ndarray, op: ReduceOp) -> np.ndarray:
    u = np.uint64
    a, b = d.astype(np.int64).view(u), s.astype(np.int64).view(u)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        r = (a + b).view(np.int64)
    elif op is ReduceOp.PROD:
        r = (a * b).view(np.int64)
    elif op is ReduceOp.MIN:
        r = np.minimum(d.astype(np.int64), s.astype(np.int64))
    else:
        r = np.maximum(d.astype(np.int64), s.astype(np.int64))
    return r.astype(d.dtype)       # int64 -> int32 keeps the low 32 bits: wraps


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", INTS, ids=["int32", "int64"])
def test_integer_reduction_wraps_like_twos_complement(dtype, op):
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(7)
    d = torch.randint(info.min, info.max, (N,), generator=gen, dtype=dtype)
    s = torch.randint(info.min, info.max, (N,), generator=gen, dtype=dtype)
    d[:4] = torch.tensor([info.max, info.min, info.max, -1], dtype=dtype)
    s[:4] = torch.tensor([1, -1, info.max, info.min], dtype=dtype)
    want = _int_reference(d.numpy().copy(), s.numpy(), op)
    reduce_into(d, s, op)
    assert np.array_equal(d.numpy(), want)
    if op is ReduceOp.SUM:
        assert d[0].item() == info.min and d[1].item() == info.max     # wrapped, no error


def test_reduces_in_place_without_reallocating():
    d = torch.arange(1 << 16, dtype=torch.float32)
    s = torch.ones(1 << 16, dtype=torch.float32)
    ptr = d.data_ptr()
    reduce_into(d, s, "sum")
    assert d.data_ptr() == ptr and d[5].item() == 6.0


def test_numpy_arrays_are_reduced_in_place():
    d = np.arange(10, dtype=np.int64)
    view = d[2:6]                              # a chunk of a larger accumulator
    reduce_into(view, np.full(4, 100, dtype=np.int64), ReduceOp.MAX)
    assert d.tolist() == [0, 1, 100, 100, 100, 100, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "dst, src, match",
    [
        (torch.zeros(4), torch.zeros(5), "same shape"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64), "same shape and dtype"),
        (torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), "not supported"),
    ],
)
def test_bad_buffers_raise_clear_error_and_modify_nothing(dst, src, match):
    dst += 1
    before = dst.clone()
    with pytest.raises(ConfigError, match=match):
        reduce_into(dst, src, "sum")
    assert isinstance(ConfigError("x"), ValueError)
    assert torch.equal(dst, before)


def test_unknown_op_names_the_valid_ones():
    with pytest.raises(ConfigError, match="expected one of"):
        reduce_into(torch.zeros(2), torch.zeros(2), "mean")


# -- progress marks ----------------------------------------------------------------------


def test_cpu_chunk_reducer_marks_exactly_the_reduced_chunks():
    acc = torch.zeros(4, 8)
    red = CpuChunkReducer(4)
    for c in (0, 2):
        red.reduce_chunk(c, acc[c], torch.full((8,), float(c + 1)), "sum", mark=11)
    assert red.marks.finished() == (0, 2)
    assert red.marks.finished(mark=11) == (0, 2)
    assert red.marks.finished(mark=12) == ()
    assert acc[:, 0].tolist() == [1.0, 0.0, 3.0, 0.0]
    red.reduce_chunk(1, acc[1], torch.ones(8), "max", mark=12)
    assert red.marks.finished(mark=12) == (1,) and red.marks.get(1) == 12
    red.reset()
    assert red.marks.finished() == ()


def test_failed_chunk_reduction_leaves_its_mark_unset():
    red = chunk_reducer(2, "cpu")
    assert isinstance(red, CpuChunkReducer)
    with pytest.raises(ConfigError):
        red.reduce_chunk(1, torch.zeros(3), torch.zeros(4), "sum")
    assert red.marks.finished() == ()


@pytest.mark.parametrize("chunk, mark, match", [(4, 1, "out of range"), (-1, 1, "out of range"), (0, 0, "1..2")])
def test_bad_chunk_or_mark_is_rejected(chunk, mark, match):
    red = CpuChunkReducer(4)
    with pytest.raises(ConfigError, match=match):
        red.reduce_chunk(chunk, torch.zeros(1), torch.zeros(1), "sum", mark=mark)


def test_progress_marks_need_at_least_one_chunk():
    with pytest.raises(ConfigError, match="at least one chunk"):
        ProgressMarks(0)


def test_marks_snapshot_is_a_copy():
    m = ProgressMarks(3)
    snap = m.read()
    m.publish(1, 5)
    assert snap.tolist() == [0, 0, 0] and m.read().tolist() == [0, 5, 0]


def test_gpu_reducer_without_gpu_raises_config_error_naming_the_fix():
    try:
        import cupy  # noqa: F401

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device exists here; bench/gpu_check.py covers the GPU path")
    except ImportError:
        pass
    except Exception:   # cupy present, no driver/GPU
        pass
    with pytest.raises(ConfigError, match="CuPy|CUDA device"):
        chunk_reducer(2, "cuda:0")


def test_kernels_and_device_packages_do_not_import_cupy_or_compile_anything():
    code = ("import sys, resilient.kernels, resilient.kernels.cupy_impl, resilient.device, resilient.device.cuda; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
