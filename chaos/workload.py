"""The verifying workload: deterministic inputs and the independent expected outputs.

Every input is a pure function of ``(member, op seq, seed)`` (and the op's spec), so the
expected output of any op for *any* contributor set the op reports can be recomputed here,
with numpy only — never with the library's kernels or collectives, so a bug there cannot
hide itself. Integer results are compared bitwise (integer sum/prod wrap modulo 2**bits
and are order independent); floating results to a reduction-order tolerance:

    |result - exact| <= (k + 1) * eps(dtype) * sum_i |x_i|     (sum; k contributors)

which bounds any summation order in the dtype itself (the classic gamma_{k-1} bound, with
margin for the final rounding). ``avg`` divides that by ``k`` and adds one rounding;
``prod`` is relative to ``|prod|``; ``min``/``max`` are exact for every dtype.

Inputs are chosen so the checker can *discriminate*: float magnitudes lie in [1, 2) with
random signs, so a missing or extra contributor moves an element by at least 1, far above
the tolerance, and ``avg`` divided by a wrong count is off by ~|sum|/k**2.

Semantics the verifier assumes (the collectives' contract, docs/design.md §3):

- ``allreduce``: output = reduce over the contributors' inputs (``avg``: sum / k).
- ``reduce_scatter``: output = that reduction, sliced ``[start:stop]`` as the member reports.
- ``allgather``: output = the contributors' inputs concatenated in the reported order.
- ``broadcast``: output = the root's input; the contributor set is exactly the root that
  broadcast — the spec's ``root``, or (when that member was lost before the op) the
  member the harness broadcast from instead.
- ``barrier``: no output; only completion is checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier")
REDUCING = frozenset({"allreduce", "reduce_scatter"})
#: The same names as ``resilient.kernels.ops.ReduceOp`` values (kept in sync by a test;
#: not imported, so parsing a scenario never imports torch).
REDUCE_OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("int32", "int64", "float16", "float32", "float64")

_SALT = 0x5EED_C4A0  # separates the op-mix stream from the input streams


@dataclass(frozen=True)
class OpSpec:
    """One entry of a workload's collective mix."""

    collective: str
    dtype: str = "float32"
    numel: int = 1024
    op: str | None = None  # reduce op for allreduce / reduce_scatter
    root: int = 0          # broadcast root member
    weight: float = 1.0

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype).kind == "f"


def op_spec_for(seq: int, seed: int, mix: Sequence[OpSpec]) -> OpSpec:
    """The spec op ``seq`` runs: a weighted choice from ``mix`` that every member computes
    identically from ``(seed, seq)`` alone."""
    if len(mix) == 1:
        return mix[0]
    rng = np.random.default_rng([seed, seq, _SALT])
    weights = np.array([s.weight for s in mix], dtype=np.float64)
    return mix[int(rng.choice(len(mix), p=weights / weights.sum()))]


#: The Communicator's default ``small_bytes``: allreduces up to it use recursive doubling.
SMALL_BYTES = 64 << 10


def ring_phases(spec: OpSpec, small_bytes: int = SMALL_BYTES) -> frozenset[str]:
    """The ring phases (``"rs"``, ``"ag"``) an op of ``spec`` runs through, as the
    Communicator picks its algorithm: allreduce above ``small_bytes`` = both, below =
    none (recursive doubling); reduce_scatter = ``rs``; allgather = ``ag``; broadcast and
    barrier = none. A phase trigger on an op without that phase could never fire."""
    if spec.collective == "allreduce":
        big = spec.numel * np.dtype(spec.dtype).itemsize > small_bytes
        return frozenset({"rs", "ag"}) if big else frozenset()
    return {"reduce_scatter": frozenset({"rs"}), "allgather": frozenset({"ag"})}.get(spec.collective, frozenset())


def make_input(member: int, seq: int, seed: int, spec: OpSpec) -> np.ndarray:
    """The input member ``member`` feeds op ``seq``: deterministic in its arguments,
    independent across members and ops. Shape ``(spec.numel,)``, dtype ``spec.dtype``."""
    if member < 0 or seq < 0 or seed < 0:
        raise ValueError(f"member, seq and seed must be >= 0, got {member}, {seq}, {seed}")
    rng = np.random.default_rng([seed, seq, member])
    n, dt = spec.numel, np.dtype(spec.dtype)
    sign = np.where(rng.integers(0, 2, n) == 0, -1, 1)
    if dt.kind == "f":
        if spec.op == "prod":  # keep products of many members finite: |x| in [0.9, 1.1)
            mag = rng.uniform(0.9, 1.1, n)
        else:
            mag = rng.uniform(1.0, 2.0, n)
        return (sign * mag).astype(dt)
    if spec.op == "prod":  # |x| in {1, 2}: products wrap modulo 2**bits, still exact
        return (sign * rng.integers(1, 3, n)).astype(dt)
    return rng.integers(-1000, 1001, n).astype(dt)


@dataclass(frozen=True)
class Expected:
    """Expected output of one op for one contributor set: ``value`` (in the op's dtype,
    or float64 for float reductions) and ``tol`` (per element, ``None`` = bitwise)."""

    value: np.ndarray | None
    tol: np.ndarray | None = None


def expected_output(spec: OpSpec, seq: int, seed: int, contributors: Sequence[int],
                    out_range: tuple[int, int] | None = None) -> Expected:
    """Independent expected output of op ``seq`` for ``contributors``.

    Raises ``ValueError`` for an empty contributor set, a broadcast whose contributor set
    is not exactly one member, or an ``out_range`` outside the reduced vector.
    """
    if spec.collective == "barrier":
        return Expected(None)
    if not contributors:
        raise ValueError("an empty contributor set has no defined result")
    if spec.collective == "broadcast":
        if len(contributors) != 1:
            raise ValueError(f"broadcast (root {spec.root}) reported contributors {tuple(contributors)}; "
                             "a broadcast has exactly one: its root")
        return Expected(make_input(contributors[0], seq, seed, spec))
    inputs = np.stack([make_input(m, seq, seed, spec) for m in contributors])
    if spec.collective == "allgather":
        return Expected(inputs.reshape(-1))
    value, tol = _reduce(inputs, spec.op or "sum")
    if spec.collective == "reduce_scatter" and out_range is not None:
        start, stop = out_range
        if not 0 <= start <= stop <= spec.numel:
            raise ValueError(f"reduce_scatter range [{start}:{stop}] outside 0..{spec.numel}")
        value = value[start:stop]
        tol = None if tol is None else tol[start:stop]
    return Expected(value, tol)


def _reduce(inputs: np.ndarray, op: str) -> tuple[np.ndarray, np.ndarray | None]:
    dt, k = inputs.dtype, inputs.shape[0]
    if op in ("min", "max"):
        return (inputs.min(axis=0) if op == "min" else inputs.max(axis=0)), None
    if dt.kind in "iu":
        if op == "avg":
            raise ValueError("avg is defined for floating dtypes only (scenario validation rejects it)")
        if op == "prod":
            return np.multiply.reduce(inputs, axis=0, dtype=dt), None
        return np.add.reduce(inputs, axis=0, dtype=dt), None
    eps = float(np.finfo(dt).eps)
    x = inputs.astype(np.float64)
    if op == "prod":
        p = np.prod(x, axis=0)
        return p, (k + 1) * eps * np.abs(p)
    s = np.sum(x, axis=0)
    tol = (k + 1) * eps * np.sum(np.abs(x), axis=0)
    if op == "avg":
        a = s / k
        return a, tol / k + eps * np.abs(a)
    return s, tol


@dataclass(frozen=True)
class Mismatch:
    """Why a result is wrong: a readable reason and the first bad element, if any."""

    reason: str
    index: int | None = None
    got: float | None = None
    want: float | None = None


def compare(result: np.ndarray | None, expected: Expected, dtype: str) -> Mismatch | None:
    """``None`` when ``result`` matches ``expected``; else the first difference.
    Integers (and min/max, broadcast, allgather) bitwise; float reductions within ``tol``."""
    if expected.value is None:
        return None
    if result is None:
        return Mismatch("no output reported")
    result = np.asarray(result)
    if result.dtype != np.dtype(dtype):
        return Mismatch(f"dtype {result.dtype}, expected {dtype}")
    if result.shape != expected.value.shape:
        return Mismatch(f"shape {result.shape}, expected {expected.value.shape}")
    if expected.tol is None:
        want = expected.value.astype(result.dtype, copy=False)
        bad = result.view(np.uint8).reshape(result.shape + (-1,)) != want.view(np.uint8).reshape(want.shape + (-1,))
        bad = bad.any(axis=-1)
    else:
        got = result.astype(np.float64)
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(got - expected.value) <= expected.tol)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return Mismatch(f"{int(bad.sum())} of {bad.size} elements differ", i, float(result[i]), float(expected.value[i]))
