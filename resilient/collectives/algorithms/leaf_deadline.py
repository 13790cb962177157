"""The leaf path's deadline mode (``--straggler-policy deadline``): finish an op without a
leaf whose input is late, and say so in ``contributors`` on every member.

Same shape as the lossless leaf path (:mod:`.leaf`): the ring (or recursive doubling)
runs at once over the active members' own inputs; each leaf streams its input to its tree
parent, which forwards it around the actives against the ring's direction. What differs:

* **One decision per leaf, made by its parent.** After its inner algorithm is done, a
  parent waits for each of its leaves' input at most ``deadline_s`` (the epoch plan's
  ``leaf_deadline_ms``). A leaf whose every sub-slice has arrived by then is *included*
  (exactly as in the lossless path); otherwise it is *excluded* from this op. Nobody else
  decides: the decision travels with the data.
* **The chain is self-describing.** The parent forwards a leaf's sub-slices as they
  arrive, in *groups*: a 32-byte control frame ``[leaf, first, end, 1]`` followed by
  sub-slices ``first..end-1``; an exclusion is the control frame ``[leaf, 0, 0, 0]``.
  Receivers post one control receive at a time and the item receives it announces, so no
  receive is ever left posted for data that will not come. Every active forwards groups
  whole, in the order it got them. An active adds exactly the leaves that were included
  (all sub-slices arrived) and sets their bits; excluded leaves' partial data is ignored.
* **The leaf learns the outcome.** While the ring's all-gather completes pieces, the parent
  streams the actives' result ``R`` to its leaves (copied, so the parent may add to its
  own ``out`` meanwhile) in the order the ring finalises pieces on the parent (the leaf
  computes the same order); then a *decision* frame: the op's final contributor mask
  ``F``. The leaf adds its own input if ``F`` has its bit (same kernel, same order as the
  actives: identical bits); if ``F`` also names other leaves, the parent sends the final
  result instead. Every member sets ``ledger.need = [F] * pieces``, so ``contributors``
  (and ``AVG``'s divisor) is ``F`` everywhere — an exclusion is never silent.
* **Late data is discarded, never added to a later op.** The transport matches frames by
  ``(peer, op seq, tag)`` in posting order. A leaf always sends its whole input, and its
  parent posts a receive for every sub-slice at the op's start: those an exclusion left
  pending stay posted and absorb the late frames (into this op's private staging buffer,
  dropped afterwards). After its input the leaf sends an *ack* when it has finished the
  op; the parent awaits the pending receives and the acks when it starts its next
  deadline-mode op (``_LAGGING``: the actives run at most one op ahead of a late leaf,
  which bounds memory too) and in :func:`drain` when it closes (so a leaf is never left alone in an op the
  others have left). An epoch change drops them (``configure`` clears posted receives;
  frames of the old epoch are discarded).

Ledger: masks stay exact at every instant, as in the lossless path: chain data lives in
staging buffers (not in the ledger); a piece's mask is 0 while leaves' data is being added
to it and ``actives | included leaves`` after; on a leaf, a result piece is 0 until all its
sub-slices arrived, then ``actives``, then (0 while adding) ``F``. So recovery after any
failure works from the masks as everywhere else.

Failure behaviour: transport errors propagate (the communicator recovers); a malformed
control or decision frame raises :class:`~resilient.errors.CollectiveError` naming the
sender (a peer running another version). Nothing blocks past the transport's abort.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import OpContext, tag
from resilient.collectives.algorithms.leaf_common import ActiveLedger, LeafRoute
from resilient.errors import CollectiveError, TransportAborted
from resilient.kernels import reduce_into
from resilient.transport.base import Request

SPACE = tags.LEAF  # shared with leaf.py (the lossless path uses steps 0-2)
T_INPUT, T_RESULT, T_CHAIN, T_DECISION, T_FINAL, T_CTRL, T_ACK = 0, 1, 2, 3, 4, 5, 6
POLL_S = 0.005     # wake-up granularity while waiting on several streams at once

#: transport -> (epoch, a parent's receives still posted after its op: its leaves' late
#: input sub-slices and their acks), awaited at its next deadline-mode op or by drain()
_LAGGING: "weakref.WeakKeyDictionary[Any, tuple[int, list[Request]]]" = weakref.WeakKeyDictionary()


def _mask_bytes(n_members: int) -> int:
    return max(1, (n_members + 7) // 8)


def run_deadline(path: LeafRoute, ctx: OpContext, items: list[tuple[int, int, int]]) -> None:
    """Run one op of ``path`` (a :class:`~.leaf.LeafPath` with ``deadline_s`` set)."""
    L = ctx.ledger
    if L.members[L.me] in path.leaves:
        _Leaf(path, ctx, items).run()
    else:
        _Active(path, ctx, items).run()


class _Leaf:
    def __init__(self, path: LeafRoute, ctx: OpContext, items: list[tuple[int, int, int]]) -> None:
        self.path, self.ctx, self.items = path, ctx, items

    def run(self) -> None:
        path, ctx, items = self.path, self.ctx, self.items
        L, tr = ctx.ledger, ctx.transport
        me = L.members[L.me]
        parent = path.leaves[me]
        index = {m: i for i, m in enumerate(L.members)}
        actives_bits = sum(1 << index[a] for a in path.actives)
        leaf_bits = sum(1 << index[l] for l in path.leaves)
        by_piece: dict[int, list[int]] = {}
        for k, (q, _s, _e) in enumerate(items):
            by_piece.setdefault(q, []).append(k)
        order = path.inner.final_order(len(path.actives), path.actives.index(parent), len(L.pieces))
        # the actives' result R lands in ``out`` piece by piece (mask 0 until a piece is whole)
        results = [(q, [tr.irecv(parent, L.out[items[k][1]:items[k][2]], ctx.seq, tag(T_RESULT, k, SPACE), ctx.digest)
                        for k in by_piece.get(q, [])]) for q in order]
        fbuf = torch.zeros(_mask_bytes(len(L.members)), dtype=torch.uint8)
        decision = tr.irecv(parent, fbuf, ctx.seq, tag(T_DECISION, 0, SPACE), ctx.digest)
        if L.enabled:
            ctx.failpoint("leaf", 0.0)
        # always the whole input, late or not: the parent has a receive posted for every
        # sub-slice (what it does not use is discarded)
        sends = [tr.isend(parent, L.inp[s:e], ctx.seq, tag(T_INPUT, k, SPACE), ctx.digest)
                 for k, (_q, s, e) in enumerate(items)]
        ctx.wait(sends)
        for q, reqs in results:
            ctx.wait(reqs)
            L.set(q, actives_bits)
        ctx.wait([decision])
        F = int.from_bytes(bytes(fbuf.numpy()), "little")
        if F & ~L.full or F & actives_bits != actives_bits or F & ~(actives_bits | leaf_bits):
            raise CollectiveError(f"op #{ctx.seq}: member {parent} sent a malformed contributor mask {F:#x} to its "
                                  f"leaf {me} (members {list(L.members)}); are all members running the same version?")
        mine = 1 << L.me
        if F & leaf_bits & ~mine:
            # other leaves were included: the parent sends the final result (same bits as the actives)
            for q in range(len(L.pieces)):
                L.set(q, 0)
            finals = [tr.irecv(parent, L.out[s:e], ctx.seq, tag(T_FINAL, k, SPACE), ctx.digest)
                      for k, (_q, s, e) in enumerate(items)]
            ctx.wait(finals)
            for q in range(len(L.pieces)):
                L.set(q, F)
        elif F & mine:
            for q in range(len(L.pieces)):
                L.set(q, 0)
                reduce_into(L.view(q), L.input_view(q), ctx.op)
                L.set(q, F)
        else:
            for q in range(len(L.pieces)):
                L.set(q, F)
        L.need = [F] * len(L.pieces)
        # tell the parent this op is finished here: it does not leave (close) or start its
        # next deadline-mode op before that (the leaf lags the actives by at most one op)
        ctx.wait([tr.isend(parent, torch.ones(1, dtype=torch.uint8), ctx.seq, tag(T_ACK, 0, SPACE), ctx.digest)])


class _Active:
    """An active member's side: inner algorithm, chain, decisions for its own leaves."""

    def __init__(self, path: LeafRoute, ctx: OpContext, items: list[tuple[int, int, int]]) -> None:
        self.path, self.ctx, self.items = path, ctx, items
        L = ctx.ledger
        self.L, self.tr = L, ctx.transport
        self.me = L.members[L.me]
        self.index = {m: i for i, m in enumerate(L.members)}
        self.actives = list(path.actives)
        self.n_a = len(self.actives)
        self.ia = self.actives.index(self.me)
        self.concurrent = path.inner.capabilities.forward_ring_only and self.n_a >= 3
        d = -1 if self.concurrent else 1
        self.nxt, self.prv = self.actives[(self.ia + d) % self.n_a], self.actives[(self.ia - d) % self.n_a]
        self.leaves = sorted(path.leaves, key=self.index.__getitem__)
        self.li = {l: i for i, l in enumerate(self.leaves)}
        self.mine = [l for l in self.leaves if path.leaves[l] == self.me]
        self.incoming = [l for l in self.leaves if path.leaves[l] != self.me] if self.n_a >= 2 else []
        self.K = len(items)
        self.stage = {l: torch.empty_like(L.inp) for l in self.leaves}
        self.state: dict[str, bool | None] = {l: None for l in self.leaves}   # None: open; True in; False out
        self.got = {l: 0 for l in self.leaves}           # sub-slices of leaf l held here (a prefix)
        self.announced = {l: 0 for l in self.incoming}   # sub-slices announced to us so far
        self.closed = {l: False for l in self.incoming}  # its last group (or exclusion) announced
        self.sends: list[Any] = []
        self.ctrl_in = self.ctrl_out = 0
        self.ctrl_req: Any = None
        self.ctrl_buf: torch.Tensor | None = None
        self.groups: list[tuple[str, int, int, int, list[Request]]] = []   # announced, not yet complete
        self.live = self.concurrent
        self.leaf_reqs: dict[str, list[Request]] = {}

    # -- chain ----------------------------------------------------------------------------

    def _item(self, l: str, k: int) -> torch.Tensor:
        _q, s, e = self.items[k]
        return self.stage[l][s:e]

    def _forwards(self, l: str) -> bool:
        """Whether this member passes leaf ``l``'s data on (not the chain's last hop)."""
        if self.n_a < 2:
            return False
        d = -1 if self.concurrent else 1
        hop = ((self.ia - self.actives.index(self.path.leaves[l])) * d) % self.n_a
        return hop < self.n_a - 1

    def _send_group(self, l: str, a: int, b: int, flag: int) -> None:
        ctx = self.ctx
        ctrl = torch.tensor([self.li[l], a, b, flag], dtype=torch.int64)
        self.sends.append(self.tr.isend(self.nxt, ctrl, ctx.seq, tag(T_CTRL, self.ctrl_out, SPACE), ctx.digest))
        self.ctrl_out += 1
        for k in range(a, b):
            self.sends.append(self.tr.isend(self.nxt, self._item(l, k), ctx.seq,
                                            tag(T_CHAIN, k * len(self.leaves) + self.li[l], SPACE), ctx.digest))

    def _read_ctrl(self) -> None:
        assert self.ctrl_buf is not None
        li, a, b, flag = (int(x) for x in self.ctrl_buf.tolist())
        l = self.leaves[li] if 0 <= li < len(self.leaves) else None
        ok = (l is not None and l in self.closed and not self.closed[l]
              and ((flag == 1 and a == self.announced[l] and a < b <= self.K) or (flag == 0 and a == b == 0)))
        if not ok:
            raise CollectiveError(f"op #{self.ctx.seq}: member {self.prv} sent a malformed leaf-chain control frame "
                                  f"{[li, a, b, flag]} to {self.me}; are all members running the same version?")
        assert l is not None
        reqs = []
        if flag:
            self.announced[l] = b
            self.closed[l] = b == self.K
            reqs = [self.tr.irecv(self.prv, self._item(l, k), self.ctx.seq,
                                  tag(T_CHAIN, k * len(self.leaves) + li, SPACE), self.ctx.digest) for k in range(a, b)]
        else:
            self.closed[l] = True
        self.groups.append((l, a, b, flag, reqs))

    def pump(self) -> None:
        """Never blocks: take in what arrived, forward it, originate groups for own leaves."""
        if not self.live:
            return
        for l in self.mine:                      # own leaves: newly arrived sub-slices
            if self.state[l] is not None:
                continue
            k0 = self.got[l]
            k = self._take(l)
            if k > k0:
                self.got[l] = k
                if self._forwards(l):
                    self._send_group(l, k0, k, 1)
                if k == self.K:
                    self.state[l] = True
        while True:                              # incoming control frames, one posted at a time
            if self.ctrl_req is None:
                if all(self.closed.values()):
                    break
                self.ctrl_buf = torch.zeros(4, dtype=torch.int64)
                self.ctrl_req = self.tr.irecv(self.prv, self.ctrl_buf, self.ctx.seq, tag(T_CTRL, self.ctrl_in, SPACE),
                                              self.ctx.digest)
                self.ctrl_in += 1
            if not self.ctrl_req.done():
                break
            self.ctrl_req = None
            self._read_ctrl()
        while self.groups and all(r.done() for r in self.groups[0][4]):   # whole groups, in order
            l, a, b, flag, _reqs = self.groups.pop(0)
            if flag:
                self.got[l] = b
                if b == self.K:
                    self.state[l] = True
            else:
                self.state[l] = False
            if self._forwards(l):
                self._send_group(l, a, b, flag)

    def _take(self, l: str) -> int:
        """How many of leaf ``l``'s sub-slices arrived (a prefix)."""
        reqs, k = self.leaf_reqs[l], self.got[l]
        while k < len(reqs) and reqs[k].done():
            k += 1
        return k

    def _waiting_on(self) -> list[Any]:
        out = [self.leaf_reqs[l][self.got[l]] for l in self.mine if self.state[l] is None]
        if self.ctrl_req is not None:
            out.append(self.ctrl_req)
        if self.groups:
            out += [r for r in self.groups[0][4] if not r.done()][:1]
        return out

    # -- the op ---------------------------------------------------------------------------

    def run(self) -> None:
        ctx, L, tr = self.ctx, self.L, self.tr
        lag = _LAGGING.pop(tr, None)
        if lag is not None and lag[0] == ctx.epoch:
            # The previous op's late leaf input and acks, before anything else: not at the
            # end of this op, which must complete with the other actives' (if they left
            # while we waited, recovery would give us another contributor set than theirs).
            ctx.wait(lag[1])
        for l in self.mine:
            self.leaf_reqs[l] = [tr.irecv(l, self._item(l, k), ctx.seq, tag(T_INPUT, k, SPACE), ctx.digest)
                                 for k in range(self.K)]
        # the actives' result, streamed to my leaves in the order the ring finalises pieces
        order = self.path.inner.final_order(self.n_a, self.ia, len(L.pieces))
        is_final = [False] * len(L.pieces)
        cursor = [0]
        rbuf = torch.empty_like(L.out) if self.mine else None
        by_piece: dict[int, list[int]] = {}
        for k, (q, _s, _e) in enumerate(self.items):
            by_piece.setdefault(q, []).append(k)
        streaming = [True]

        def final(p: int) -> None:
            is_final[p] = True
            while streaming[0] and rbuf is not None and cursor[0] < len(order) and is_final[order[cursor[0]]]:
                q = order[cursor[0]]
                cursor[0] += 1
                s, e = L.pieces[q]
                rbuf[s:e].copy_(L.out[s:e])
                for k in by_piece.get(q, []):
                    _q, a, b = self.items[k]
                    for l in self.mine:
                        self.sends.append(tr.isend(l, rbuf[a:b], ctx.seq, tag(T_RESULT, k, SPACE), ctx.digest))

        inner = ActiveLedger(L.seq, L.kind, tuple(self.actives), self.ia, L.epoch, L.digest, L.inp, L.out, L.pieces)
        inner.enabled = L.enabled
        inner.outer = L
        inner.bits = [1 << self.index[a] for a in self.actives]
        inner.pump = self.pump
        inner.final = final
        sub = OpContext(tr, inner, ctx.op, ctx.op_timeout, ctx.on_suspect, ctx.epoch)
        try:
            self.path.inner.run(sub)
        except BaseException:
            streaming[0] = False
            sub.settle()
            raise
        for p in range(len(L.pieces)):    # e.g. a one-member ring: every piece is final now
            if not is_final[p]:
                final(p)
        self.live = True
        self._resolve()
        self._finish()

    def _resolve(self) -> None:
        """Wait until every leaf is decided: own leaves by the deadline, others by their
        parents' control frames (which come: every parent decides by its deadline)."""
        ctx = self.ctx
        assert self.path.deadline_s is not None   # run_deadline runs only in the deadline mode
        t_dead = time.monotonic() + self.path.deadline_s
        quiet_since, reported = time.monotonic(), set()
        while True:
            self.pump()
            if all(v is not None for v in self.state.values()):
                return
            now = time.monotonic()
            if now >= t_dead and any(self.state[l] is None for l in self.mine):
                for l in self.mine:
                    if self.state[l] is None:
                        self.state[l] = False
                        if self._forwards(l):
                            self._send_group(l, 0, 0, 0)
                continue
            waiting = self._waiting_on() or [r for r in self.sends if not r.done()][:1]
            if not waiting:   # (cannot happen: an open leaf always has a pending receive)
                time.sleep(POLL_S)
                continue
            step = POLL_S if len(waiting) > 1 else 0.05
            if any(self.state[l] is None for l in self.mine):
                step = min(step, max(0.0, t_dead - now))
            if waiting and not self.tr.wait(waiting[:1], timeout=step):
                if ctx.op_timeout is not None and time.monotonic() - quiet_since > ctx.op_timeout:
                    for r in waiting:
                        if r.peer not in reported:
                            reported.add(r.peer)
                            ctx.on_suspect(r.peer, f"op #{ctx.seq}: waited more than {ctx.op_timeout}s")
            else:
                quiet_since = time.monotonic()

    def _finish(self) -> None:
        ctx, L, tr = self.ctx, self.L, self.tr
        included = [l for l in self.leaves if self.state[l]]
        inc_bits = sum(1 << self.index[l] for l in included)
        F = sum(1 << self.index[a] for a in self.actives) | inc_bits
        last_of = {q: k for k, (q, _s, _e) in enumerate(self.items)}
        if included:
            for k, (q, s, e) in enumerate(self.items):
                if k == 0 or self.items[k - 1][0] != q:
                    done_mask = (L.masks[q] | inc_bits) if L.enabled else 0
                    L.set(q, 0)          # partly added: nothing usable
                for l in included:
                    reduce_into(L.out[s:e], self.stage[l][s:e], ctx.op)
                if last_of[q] == k:
                    L.set(q, done_mask)
        fb = F.to_bytes(_mask_bytes(len(L.members)), "little")
        for l in self.mine:
            fbuf = torch.tensor(list(fb), dtype=torch.uint8)
            self.sends.append(tr.isend(l, fbuf, ctx.seq, tag(T_DECISION, 0, SPACE), ctx.digest))
            if inc_bits & ~(1 << self.index[l]):
                for k, (_q, s, e) in enumerate(self.items):
                    self.sends.append(tr.isend(l, L.out[s:e], ctx.seq, tag(T_FINAL, k, SPACE), ctx.digest))
        L.need = [F] * len(L.pieces)
        self.pump()
        ctx.wait(self.sends)
        # The leaves finish this op after us (by up to one op): their acks — behind any late
        # input, which the posted receives absorb — are awaited at our next deadline-mode
        # op or when we close (:func:`drain`), never now.
        left = [r for l in self.mine for r in self.leaf_reqs[l] if not r.done()]
        left += [tr.irecv(l, torch.empty(1, dtype=torch.uint8), ctx.seq, tag(T_ACK, 0, SPACE), ctx.digest)
                 for l in self.mine]
        if left:
            _LAGGING[tr] = (ctx.epoch, left)


def drain(transport: Any, epoch: int, timeout: float) -> bool:
    """Before a parent leaves (``Communicator.close``): wait, at most ``timeout`` seconds,
    until its leaves finished the last deadline-mode op (their acks arrived), so none is
    left in an op its peers already left — it would then finish it alone, with other
    contributors than theirs. True when there was nothing to wait for or it all arrived;
    False after the timeout or a transport error (a leaf died: its lease ends it). Never
    raises."""
    lag = _LAGGING.pop(transport, None)
    if lag is None or lag[0] != epoch:
        return True
    try:
        return bool(transport.wait(lag[1], timeout=timeout))
    except (Exception, TransportAborted):  # noqa: BLE001 - best effort on the way out (an abort included)
        return False
