"""Training quality of the compression hook's arithmetic, emulated in one process.

    .venv/bin/python bench/compression_emulate.py --bits 4 --bucket 1024 [--rounding stochastic] [--steps 600]
    .venv/bin/python bench/compression_emulate.py --bits 32          # fp32

The model, text, batches, learning-rate schedule and held-out loss of
``bench/compression_quality.py``, with its 4 members emulated in one process: each
member's gradient is computed on its own batch, and the step's gradient is what
:func:`resilient.ddp.compression_hook` makes of them with error feedback — per-bucket
scales from the members' maxima (``quantization.scales``), ``q_i`` of ``grad_i + e_i``,
``e_i <- x_i - s*q_i``, the exact dequantized mean — using the same codec functions
(the flat layout is the parameters' order, not DDP's bucket order, so the figures are
close to, not bitwise those of, the distributed bench). ``--rounding stochastic`` rounds
the compressed elements stochastically instead (what the hook does not do). No
processes, no sockets: a quick way to try a scale, bucket or rounding choice before
running the distributed bench.

Prints one JSON line: ``bits``, ``bucket``, ``rounding``, ``seed``, ``steps``, ``loss``
(final held-out loss) and ``seconds``. Failure behaviour: bad arguments exit with argparse's
message; nothing else is caught.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression_quality as cq  # noqa: E402 - after the path insert

from resilient.collectives.quantization import (  # noqa: E402
    FINE, Segment, bucket_maxima, dequantize, qmax, quantize, scales,
)

WORLD = cq.WORLD


def layout(params: list[torch.Tensor], bits: int, min_numel: int = 1024) -> list[Segment]:
    """``ErrorFeedback.segments`` over the parameters in order: 2-D ones of at least
    ``min_numel`` elements at ``bits``, the rest fixed point."""
    segs: list[list[int]] = []
    pos = 0
    for p in params:
        b = bits if p.dim() >= 2 and p.numel() >= min_numel else FINE
        if segs and segs[-1][2] == b:
            segs[-1][1] = pos + p.numel()
        else:
            segs.append([pos, pos + p.numel(), b])
        pos += p.numel()
    return [Segment(a, e, b) for a, e, b in segs]


def stochastic(x: torch.Tensor, sc: torch.Tensor, segs: list[Segment], bucket: int, g: torch.Generator) -> torch.Tensor:
    """``quantize`` with the compressed segments rounded stochastically (fixed point as usual)."""
    q = quantize(x, sc, segs, bucket, WORLD)
    off = 0
    for s in segs:
        nb = s.n_buckets(bucket)
        if s.bits != FINE:
            per = sc[off:off + nb].repeat_interleave(bucket)[:s.numel]
            v = torch.where(per > 0, x[s.start:s.end] / per, torch.zeros_like(per))
            m = qmax(s.bits)
            q[s.start:s.end] = torch.floor(v + torch.rand(v.shape, generator=g)).clamp_(-m, m).to(torch.int32)
        off += nb
    return q


def run(bits: int, bucket: int, rounding: str, steps: int, seed: int) -> float:
    torch.set_num_threads(1)
    raw = torch.frombuffer(bytearray(cq._text()), dtype=torch.uint8)
    cut = int(len(raw) * 0.9)
    train, held = raw[:cut], raw[cut:]
    model = cq._model()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    segs = layout(params, bits)
    numel = sum(p.numel() for p in params)
    residuals = [torch.zeros(numel) for _ in range(WORLD)]
    g = torch.Generator().manual_seed(1234 + seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cq._lr(step, steps)
        grads = []
        for r in range(WORLD):
            x, y = cq._batch(train, step, r, seed)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if bits == FINE:
            agg = sum(grads) / WORLD
        else:
            xs = [gr + e for gr, e in zip(grads, residuals)]
            sc = scales(torch.stack([bucket_maxima(x, segs, bucket) for x in xs]).amax(0), segs, bucket, WORLD)
            qs = [stochastic(x, sc, segs, bucket, g) if rounding == "stochastic" else quantize(x, sc, segs, bucket, WORLD)
                  for x in xs]
            residuals = [x - dequantize(q, sc, segs, bucket) for x, q in zip(xs, qs)]
            agg = dequantize(sum(qs), sc, segs, bucket) / WORLD
        pos = 0
        for p in params:
            p.grad = agg[pos:pos + p.numel()].view_as(p).clone()
            pos += p.numel()
        opt.step()
    return cq._heldout(model, held, 2048)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4, 8, 32], help="32: fp32 (no quantization)")
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--rounding", default="nearest", choices=["nearest", "stochastic"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    loss = run(args.bits, args.bucket, args.rounding, args.steps, args.seed)
    print(json.dumps({"bits": args.bits, "bucket": args.bucket, "rounding": args.rounding, "seed": args.seed,
                      "steps": args.steps, "loss": loss, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
