"""The direct shared-memory allreduce (resilient/collectives/algorithms/shm_direct.py): which
ops take it, exact results over every dtype and reduce op in both of its modes (every
member reduces everything; each member reduces its chunk, then copies the others'), for
sizes not divisible by the member count, the common fallback to the ring when one member
cannot map a peer's segment, and the segments released afterwards. Real Communicators
over real hybrid transports on loopback, one thread per member, one static epoch (kills:
tests/test_shm_direct_procs.py)."""
from __future__ import annotations

import gc
import os
import sys
import threading
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.collectives.algorithms import shm_direct
from resilient.collectives.algorithms.select import Sizing, allreduce as select_allreduce
from resilient.collectives.algorithms.shm_direct import ShmDirectAllreduce, eligible
from resilient.collectives.communicator import Communicator
from resilient.kernels import copy as stream_copy
from resilient.transport import shm_segment
from resilient.transport.hybrid import HybridTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info, StaticEpoch, run_communicators  # noqa: E402


@pytest.fixture(autouse=True)
def _shm_direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct algorithm is the default (RESILIENT_SHM_DIRECT=1): these tests set it
    explicitly (inherited by member processes), whatever the caller's environment says."""
    monkeypatch.setenv("RESILIENT_SHM_DIRECT", "1")

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm_segment.supported(), reason="direct shared memory needs Linux on x86-64")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "avg", "min", "max", "prod"]


def _input(i: int, seq: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Small integers (exact in every dtype whatever the order of reduction)."""
    g = torch.Generator().manual_seed(seq * 101 + i)
    lo, hi = (1, 4) if op == "prod" else (-20, 21)
    return torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _expected(n: int, seq: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    xs = [_input(i, seq, numel, dtype, op) for i in range(n)]
    wide = torch.stack([x.to(torch.int64) for x in xs])
    if op in ("sum", "avg"):
        acc = wide.sum(0)
    elif op == "prod":
        acc = wide.prod(0)
    else:
        acc = wide.amin(0) if op == "min" else wide.amax(0)
    res = acc.to(dtype)
    if op == "avg":   # the communicator divides the exact sum once, at the end
        res = res.div_(n) if dtype.is_floating_point else torch.div(res, n, rounding_mode="trunc")
    return res


def _run(n: int, specs: list[tuple[int, torch.dtype, str]], timeout: float = 90.0,
         **comm_kw: Any) -> dict[str, list[tuple[torch.Tensor, tuple[str, ...]]]]:
    """``n`` members over hybrid transports (shared memory between them), each running the
    allreduces ``specs`` = [(numel, dtype, op)]; their results and contributors."""
    def body(m: str, c: Communicator) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
        res = []
        for seq, (numel, dtype, op) in enumerate(specs):
            t = _input(int(m[1:]), seq, numel, dtype, op)
            res.append((t, tuple(c.allreduce(t, op).contributors)))
        return res

    _, out = run_communicators(n, "shmdjob", body, timeout, transport=HybridTransport, small_bytes=1024, **comm_kw)
    return out


def _check(n: int, specs: list[tuple[int, torch.dtype, str]], out: dict[str, list[Any]]) -> None:
    for seq, (numel, dtype, op) in enumerate(specs):
        exp = _expected(n, seq, numel, dtype, op)
        for m, results in out.items():
            got, contributors = results[seq]
            assert contributors == tuple(sorted(out)), (m, seq, contributors)
            assert torch.equal(got, exp), f"{m} op {seq} ({numel} x {dtype} {op}) differs"


@pytest.mark.parametrize("mode", ["every", "chunks", "chunks-streamed"])
def test_exact_for_every_dtype_and_op_in_both_modes(monkeypatch, mode):
    # n = 3 and odd sizes: chunks of unequal length; small blocks: several per chunk;
    # "streamed": every copy of any size (odd lengths, unaligned chunk starts) takes the
    # streaming copy of kernels/copy.py where this environment built it
    monkeypatch.setattr(shm_direct, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(shm_direct, "ALL_MAX_BYTES", 1 << 30 if mode == "every" else 1024)
    streamed = []
    if mode == "chunks-streamed":
        if not stream_copy.STREAMING:
            pytest.skip("the streaming copy's C extension is not built here")
        ext = stream_copy._stream_copy
        monkeypatch.setattr(stream_copy, "MIN_BYTES", 1)
        monkeypatch.setattr(stream_copy, "_stream_copy", SimpleNamespace(
            STREAMING=1, copy=lambda d, s, n: (streamed.append(n), ext.copy(d, s, n)),
            copy2=lambda d, d2, s, n: (streamed.append(n), ext.copy2(d, d2, s, n))))
    specs = [(numel, dt, op) for i, (dt, op) in enumerate((dt, op) for dt in DTYPES for op in OPS)
             for numel in [(5_003, 20_011, 997)[i % 3]]]
    before = shm_direct.COUNTS.direct
    out = _run(3, specs)
    _check(3, specs, out)
    assert shm_direct.COUNTS.direct - before == 3 * len(specs), "not every op ran through shared memory"
    assert bool(streamed) == (mode == "chunks-streamed")


def test_a_member_that_cannot_map_a_segment_takes_every_member_to_the_ring(monkeypatch):
    """m1 cannot open its peers' segments: the epoch's vote sends all four to the ring,
    whose results are exact too."""
    real = shm_segment.PeerSegment.open

    def refuse_in_m1(loc):
        if threading.current_thread().name.startswith("resilient-ops:m1"):
            return None, "refused by the test"
        return real(loc)

    monkeypatch.setattr(shm_segment.PeerSegment, "open", staticmethod(refuse_in_m1))
    specs = [(20_011, torch.float32, "sum"), (5_003, torch.int64, "max")]
    direct, ring = shm_direct.COUNTS.direct, shm_direct.COUNTS.ring
    out = _run(4, specs)
    _check(4, specs, out)
    assert shm_direct.COUNTS.direct == direct and shm_direct.COUNTS.ring - ring == 4 * len(specs)


def _shmd_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "resilient-shmd" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _shmd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("resilient-shmd" in line for line in f)


def test_segments_grow_and_are_released_with_their_communicators():
    """Ops of growing sizes (the areas move), then nothing of ours stays open or mapped;
    nothing is ever created in /dev/shm."""
    dev_shm = set(os.listdir("/dev/shm"))
    gc.collect()   # communicators of earlier tests (their segments go with them)
    fds, maps = _shmd_fds(), _shmd_maps()
    specs = [(997, torch.float32, "sum"), (300_007, torch.float32, "sum"), (20_011, torch.int32, "min"),
             (400_001, torch.float64, "sum")]
    _check(4, specs, _run(4, specs))
    gc.collect()
    assert (_shmd_fds(), _shmd_maps()) == (fds, maps)
    assert set(os.listdir("/dev/shm")) == dev_shm


# -- selection (pure) ---------------------------------------------------------------------

def _epoch(addresses: dict[str, str], **plan: Any) -> StaticEpoch:
    return StaticEpoch(3, tuple(addresses), "tok", {m: Info(a) for m, a in addresses.items()}, plan=plan)


def test_selected_only_when_every_member_shares_memory_on_one_planned_host():
    shm = {m: f"127.0.0.1:{9000 + i}#shm=boot.42/sock{i}" for i, m in enumerate(["a", "b", "c"])}
    members = list(shm)
    assert eligible(members, _epoch(shm))
    assert eligible(members, _epoch(shm, host_groups=[[0, 3]]))
    assert not eligible(members, _epoch(shm, host_groups=[[0, 2], [2, 1]]))   # emulated hosts
    assert not eligible(members, _epoch({**shm, "c": "127.0.0.1:9002#shm=other.7/sock2"}))
    assert not eligible(members, _epoch({**shm, "c": "127.0.0.1:9002"}))       # a TCP-only member
    assert not eligible(["a"], _epoch(shm))
    sizing = Sizing(small_bytes=1024)
    pieces, algo = select_allreduce(members, _epoch(shm), 100_000, 4, sizing)
    assert isinstance(algo, ShmDirectAllreduce) and pieces[0] == (0, pieces[0][1]) and pieces[-1][1] == 100_000
    assert not isinstance(select_allreduce(members, _epoch(shm), 100, 4, sizing)[1], ShmDirectAllreduce)
    assert not isinstance(select_allreduce(members, _epoch(shm), 100_000, 4, Sizing(small_bytes=1024, shm_direct=False))[1],
                          ShmDirectAllreduce)
    assert not isinstance(select_allreduce(members, _epoch(shm), 100_000, 4,
                                           Sizing(small_bytes=1024).for_device(torch.device("meta")))[1],
                          ShmDirectAllreduce)


class _RacingPeer:
    """A peer segment whose owner, right after this member's first header read,
    publishes the awaited word and finishes the whole op (``W_DONE``): what a member
    descheduled between two reads on a loaded host sees."""

    def __init__(self, word: int, old: int, want: int) -> None:
        self.values = {word: old, shm_segment.W_DONE: old}
        self.word_no, self.want, self.reads = word, want, 0

    def word(self, w: int) -> int:
        v = self.values[w]
        self.reads += 1
        if self.reads == 1:   # the owner moves on between our reads
            self.values[self.word_no] = self.want
            self.values[shm_segment.W_DONE] = self.want
        return v


def test_a_peer_that_finishes_between_two_reads_is_ready_not_gone():
    """A peer that publishes its input and finishes the op between this member's reads of
    its words has not given the op up: the wait sees it ready (it used to raise
    TransportError "gave it up" on every member, with no epoch to recover in)."""
    from types import SimpleNamespace

    from resilient.errors import TransportError

    word = shm_segment.area_word(0, shm_segment.A_IN)
    want = shm_direct.ticket(1, 7)
    ctx: Any = SimpleNamespace(seq=7, members=("m0", "m1"))
    peer = _RacingPeer(word, shm_direct.ticket(1, 5), want)
    ready = ShmDirectAllreduce._ready(ctx, 1, peer, word, want)
    first = ready()   # raised "gave it up" when the awaited word was read before W_DONE
    assert first in (False, True) and ready() is True and peer.reads >= 2

    gone = _RacingPeer(word, 0, want)   # the peer cleared its word and published W_DONE: it gave the op up
    gone.values[shm_segment.W_DONE] = want
    gone.reads = 1
    with pytest.raises(TransportError, match="gave it up"):
        ShmDirectAllreduce._ready(ctx, 1, gone, word, want)()


def test_time_waited_on_a_late_peer_counts_as_waiting_on_it():
    """The health reporter's windows (and so the straggler detector) read the transport's
    ``wait_s_by_peer``: the direct path adds its sleeps on a peer's words there, as the
    ring's receives do, so a member late to every op stands out on one host too. m2 enters
    op 1 half a second after the others: they have waited on m2 (and little on each other)."""
    late, before = 0.5, shm_direct.COUNTS.direct
    waits: dict[str, dict[str, float]] = {}

    def body(m: str, c: Communicator) -> None:
        c.allreduce(_input(int(m[1:]), 0, 300_007, torch.float32, "sum"))
        w0 = dict(c.transport.stats.wait_s_by_peer)
        if m == "m2":
            threading.Event().wait(late)
        c.allreduce(_input(int(m[1:]), 1, 300_007, torch.float32, "sum"))
        waits[m] = {p: s - w0.get(p, 0.0) for p, s in c.transport.stats.wait_s_by_peer.items()}

    run_communicators(3, "shmdwait", body, 90, transport=HybridTransport, small_bytes=1024)
    assert shm_direct.COUNTS.direct - before == 6, "the ops did not run through shared memory"
    for m, other in (("m0", "m1"), ("m1", "m0")):
        assert waits[m].get("m2", 0.0) >= late / 2, (m, waits)
        assert waits[m].get("m2", 0.0) > waits[m].get(other, 0.0), (m, waits)


@pytest.mark.parametrize("mode", ["every", "chunks"])
def test_a_finished_op_keeps_its_result_for_a_peer_s_recovery(monkeypatch, mode):
    """After a direct allreduce returns, the member's retained ledger (what it serves when
    a peer still recovers that op: ``RecoveryPath.serve_retained`` reads ``out`` where the
    masks say final) holds the result itself, in both modes: every mask final and ``out``
    equal to the exact result, also after the caller changed its tensor."""
    monkeypatch.setattr(shm_direct, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(shm_direct, "ALL_MAX_BYTES", 1 << 30 if mode == "every" else 1024)
    numel, n = 20_011, 3

    def body(m: str, c: Communicator) -> tuple[torch.Tensor, list[int], int, torch.Tensor]:
        t = _input(int(m[1:]), 0, numel, torch.int64, "sum")
        c.allreduce(t, "sum")
        t.fill_(-1)   # the caller reuses its tensor: the retained result must not follow it
        L = c.retained
        assert L is not None
        return L.out[:numel].clone(), list(L.masks), L.full, L.inp

    _, got = run_communicators(n, "shmdretained", body, 90.0, transport=HybridTransport, small_bytes=1024)
    exp = _expected(n, 0, numel, torch.int64, "sum")
    for m, (out, masks, full, _) in got.items():
        assert masks == [full] * len(masks), m
        assert torch.equal(out, exp), f"{m}: the retained result differs from the op's result"


@pytest.mark.parametrize("op", ["sum", "max"])
def test_the_result_goes_straight_into_the_callers_tensor_and_an_error_restores_the_input(monkeypatch, op):
    """Chunk mode writes each final value into the caller's tensor as it goes (``finish``
    copies nothing). An error after part of the result is in (here: raised on every member
    after its first peer chunk) leaves the caller's tensor holding its input again, so a
    recovery or a rerun of the op reads the input, never a half-written result."""
    from resilient.collectives import ops as ops_mod

    monkeypatch.setattr(shm_direct, "ALL_MAX_BYTES", 1024)
    monkeypatch.setattr(shm_direct, "BLOCK_BYTES", 4096)   # several blocks per chunk
    numel, n = 30_011, 3
    finished_copies = []
    real_finish = ops_mod.AllreduceOp.finish

    def finish(self, L):   # the op's own copy of out into t happens only when nothing was delivered
        finished_copies.append(L.delivered)
        return real_finish(self, L)

    monkeypatch.setattr(ops_mod.AllreduceOp, "finish", finish)
    out = _run(n, [(numel, torch.int64, op)])
    _check(n, [(numel, torch.int64, op)], out)
    assert finished_copies == [True] * n, "the direct chunk mode did not deliver into the caller's tensor"

    real_copy = shm_direct.copy_into
    local = threading.local()

    def failing_copy(dst, src, also=None, **kw):   # blocks of the result land in t, then the op fails
        real_copy(dst, src, also, **kw)
        if also is not None:
            local.n = getattr(local, "n", 0) + 1
            if local.n == 3:
                raise RuntimeError("injected after a delivered block")

    monkeypatch.setattr(shm_direct, "copy_into", failing_copy)

    def body(m: str, c: Communicator) -> tuple[torch.Tensor, torch.Tensor, str]:
        t = _input(int(m[1:]), 1, numel, torch.int64, op)
        before = t.clone()
        try:
            c.allreduce(t, op)
        except Exception as exc:   # whatever wraps it: the tensor is what matters
            return before, t, repr(exc)
        return before, t, "no error"

    # a member whose peer gave the op up waits for an epoch that never comes here (no
    # coordinator): 2 s, then CollectiveError; its tensor must be restored all the same
    _, got = run_communicators(n, "shmdrestore", body, 90.0, transport=HybridTransport, small_bytes=1024,
                               epoch_timeout=2.0)
    assert any("injected" in err for _, _, err in got.values()), got
    for m, (before, t, err) in got.items():
        assert err != "no error", m
        assert torch.equal(t, before), f"{m}: the caller's tensor was left half-written ({err})"
