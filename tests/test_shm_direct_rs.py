"""The direct shared-memory reduce-scatter (resilient/collectives/algorithms/shm_direct_rs.py):
exact results over every dtype and reduce op for per-member sizes of one element up,
interleaved with direct allreduces in one epoch (they share its session), the common
fallback to the ring reduce-scatter when one member cannot map a peer's segment, and which
ops select it. Real Communicators over real hybrid transports on loopback, one thread per
member, one static epoch (kills and stops: tests/test_shm_direct_procs.py)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.collectives.algorithms import shm_direct
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.algorithms.select import Sizing, per_member
from resilient.collectives.algorithms.shm_direct_rs import ShmDirectReduceScatter
from resilient.collectives.communicator import Communicator
from resilient.transport import shm_segment
from resilient.transport.hybrid import HybridTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info, StaticEpoch, run_communicators  # noqa: E402
from test_shm_direct import DTYPES, OPS, _input  # noqa: E402

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm_segment.supported(), reason="direct shared memory needs Linux on x86-64")]

#: (kind, per-member numel, dtype, op); kind "rs" (reduce_scatter) or "ar" (allreduce)
Spec = tuple[str, int, torch.dtype, str]


def _rs_input(i: int, seq: int, c: int, m: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Member ``i``'s input for member ``c``'s chunk of op ``seq``."""
    return _input(i, seq * 100 + c, m, dtype, op)


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction in member order, in the op's dtype (inputs are small integers: exact)."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("sum", "avg"):
            acc += x
        elif op == "prod":
            acc *= x
        else:
            acc = torch.minimum(acc, x) if op == "min" else torch.maximum(acc, x)
    if op == "avg":   # the communicator divides the exact sum once, at the end
        acc = acc.div_(len(xs)) if acc.is_floating_point() else torch.div(acc, len(xs), rounding_mode="trunc")
    return acc


def _run(n: int, specs: list[Spec], **comm_kw: Any) -> dict[str, list[tuple[torch.Tensor, tuple[str, ...]]]]:
    """``n`` members over hybrid transports running ``specs``; their outputs and contributors."""
    def body(mid: str, c: Communicator) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
        i, res = int(mid[1:]), []
        for seq, (kind, m, dtype, op) in enumerate(specs):
            if kind == "rs":
                out = torch.empty(m, dtype=dtype)
                w = c.reduce_scatter(out, [_rs_input(i, seq, q, m, dtype, op) for q in range(n)], op)
            else:
                out = _input(i, seq, m, dtype, op)
                w = c.allreduce(out, op)
            res.append((out, tuple(w.contributors)))
        return res

    _, out = run_communicators(n, "shmdrsjob", body, 90.0, transport=HybridTransport, small_bytes=1024,
                               shm_direct=True, **comm_kw)
    return out


def _check(n: int, specs: list[Spec], out: dict[str, list[Any]]) -> None:
    for seq, (kind, m, dtype, op) in enumerate(specs):
        for mid, results in out.items():
            c = int(mid[1:])
            got, contributors = results[seq]
            assert contributors == tuple(sorted(out)), (mid, seq, contributors)
            xs = ([_rs_input(i, seq, c, m, dtype, op) for i in range(n)] if kind == "rs"
                  else [_input(i, seq, m, dtype, op) for i in range(n)])
            assert torch.equal(got, _reduce(xs, op)), f"{mid} op {seq} ({kind} {m} x {dtype} {op}) differs"


def test_exact_for_every_dtype_and_op_and_odd_sizes(monkeypatch):
    # n = 3, per-member sizes 1 .. 20 011 (odd: total sizes not divisible by the slices);
    # small blocks: several per chunk
    monkeypatch.setattr(shm_direct, "BLOCK_BYTES", 4096)
    specs: list[Spec] = [("rs", (1, 5_003, 20_011)[i % 3], dt, op)
                         for i, (dt, op) in enumerate((dt, op) for dt in DTYPES for op in OPS)]
    before = shm_direct.COUNTS.direct
    out = _run(3, specs)
    _check(3, specs, out)
    assert shm_direct.COUNTS.direct - before == 3 * len(specs), "not every op ran through shared memory"


def test_interleaved_with_direct_allreduces_in_one_epoch():
    """Reduce-scatters and allreduces of growing sizes alternate: one session, areas reused and moved."""
    specs: list[Spec] = [("rs", 997, torch.float32, "sum"), ("ar", 300_007, torch.float32, "sum"),
                         ("rs", 100_003, torch.int64, "max"), ("rs", 3, torch.float64, "prod"),
                         ("ar", 20_011, torch.int32, "min"), ("rs", 250_001, torch.bfloat16, "sum")]
    before = shm_direct.COUNTS.direct
    _check(4, specs, _run(4, specs))
    assert shm_direct.COUNTS.direct - before == 4 * len(specs)


def test_a_member_that_cannot_map_a_segment_takes_every_member_to_the_ring(monkeypatch):
    real = shm_segment.PeerSegment.open

    def refuse_in_m2(loc: shm_segment.Locator) -> tuple[shm_segment.PeerSegment | None, str]:
        if threading.current_thread().name.startswith("resilient-ops:m2"):
            return None, "refused by the test"
        return real(loc)

    monkeypatch.setattr(shm_segment.PeerSegment, "open", staticmethod(refuse_in_m2))
    specs: list[Spec] = [("rs", 20_011, torch.float32, "sum"), ("rs", 5_003, torch.int64, "max")]
    direct, ring = shm_direct.COUNTS.direct, shm_direct.COUNTS.ring
    _check(4, specs, _run(4, specs))
    assert shm_direct.COUNTS.direct == direct and shm_direct.COUNTS.ring - ring == 4 * len(specs)


# -- selection (pure) ---------------------------------------------------------------------

def _epoch(addresses: dict[str, str], **plan: Any) -> StaticEpoch:
    return StaticEpoch(3, tuple(addresses), "tok", {m: Info(a) for m, a in addresses.items()}, plan=plan)


def test_selected_for_reduce_scatter_only_when_every_member_shares_memory_on_one_planned_host():
    shm = {m: f"127.0.0.1:{9000 + i}#shm=boot.42/sock{i}" for i, m in enumerate(["a", "b", "c", "d"])}
    members = list(shm)
    on = Sizing(small_bytes=1024)

    def algo(kind: str, addresses: dict[str, str], sizing: Sizing = on, m: int = 1000, **plan: Any) -> object:
        return per_member(kind, members, _epoch(addresses, **plan), 4, m, 4, sizing).algorithm

    lay = per_member("reduce_scatter", members, _epoch(shm), 4, 1000, 4, on)
    assert isinstance(lay.algorithm, ShmDirectReduceScatter)
    ring = per_member("reduce_scatter", members, _epoch(shm), 4, 1000, 4, Sizing(small_bytes=1024, shm_direct=False))
    assert isinstance(ring.algorithm, RingReduceScatterAllgather)
    assert (lay.pieces, lay.owner, lay.offset) == (ring.pieces, ring.owner, ring.offset)   # the ring's layout
    assert isinstance(algo("reduce_scatter", shm, m=1), ShmDirectReduceScatter)        # any size
    assert not isinstance(algo("reduce_scatter", shm, m=0), ShmDirectReduceScatter)
    assert not isinstance(algo("allgather", shm), ShmDirectReduceScatter)
    assert not isinstance(algo("reduce_scatter", shm, host_groups=[[0, 2], [2, 2]]), ShmDirectReduceScatter)
    assert not isinstance(algo("reduce_scatter", {**shm, "d": "127.0.0.1:9003"}), ShmDirectReduceScatter)
    assert not isinstance(algo("reduce_scatter", shm, Sizing(small_bytes=1024, staging=True)), ShmDirectReduceScatter)
    assert not isinstance(algo("reduce_scatter", shm, on.for_device(torch.device("meta"))), ShmDirectReduceScatter)
