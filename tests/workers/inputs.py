"""Deterministic op inputs from (member index, op seq, seed), shared by the worker
processes and the tests that check their outputs independently."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


def make_input(index: int, seq: int, seed: int, numel: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + seq * 1009 + index)
    dt = DTYPES[dtype]
    if dt.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dt)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dt)


def expected(op: str, indices: list[int], seq: int, seed: int, numel: int, dtype: str) -> torch.Tensor:
    """The reduction over ``indices`` in float64 (ints exactly in int64)."""
    xs = [make_input(i, seq, seed, numel, dtype) for i in indices]
    wide = [x.to(torch.float64) if x.is_floating_point() else x.to(torch.int64) for x in xs]
    acc = wide[0].clone()
    for x in wide[1:]:
        if op in ("sum", "avg"):
            acc += x
        elif op == "prod":
            acc *= x
        elif op == "min":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == "avg":
        acc = acc / len(xs) if acc.is_floating_point() else torch.div(acc, len(xs), rounding_mode="trunc")
    return acc
