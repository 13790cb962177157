"""Traffic shaping: a :class:`Transport` decorator that makes a member, or one of its
links, slow — for the chaos ``slow`` / ``drop_link`` faults and the straggler benchmark.

Spec (``RESILIENT_SHAPING``, items separated by ``,`` or ``;``)::

    slow=3x            every send takes 3x its reference time (the member is slow)
    link=m2:3x         sends to member m2 take 3x (repeatable: one slow link each)
    delay=5ms          fixed extra latency per message (us, ms, s)
    bw=100MB/s         bandwidth cap on this member's sends (B, KB, MB, GB; /s optional)
    ref_bw=1GB/s       reference bandwidth for slow=/link= (default 1GB/s)
    ref_lat=50us       reference per-message latency for slow=/link= (default 50us)
    drop=m3            the link to m3 is down: requests to/from it fail (TransportError)
    jitter=30%         every hold is scaled by a random factor in [0.7, 1.3] (noise, not
                       a straggler; seeded per member id, or by seed=N)

A send to ``peer`` of ``n`` bytes is held for
``delay + (slow * link[peer] - 1) * (ref_lat + n / ref_bw) + n / bw`` seconds before it
is handed to the wrapped transport; holds to one peer are serialised (a slow link is
busy while it carries a message) and messages to one peer keep their order. The hold is
spent inside the sender's :meth:`wait`, as a slow NIC would be: its peers see the
message late and wait on it, the sender itself is busy, not waiting.

``RESILIENT_SHAPING_FILE``: a file holding a spec, re-read when it changes (checked at
most every 0.2 s), so a running worker can be slowed and healed from outside.

Failure behaviour: held sends fail with :class:`~resilient.errors.TransportAborted` on
:meth:`abort` at once (they are never handed on) and are dropped by :meth:`configure`; a
dropped link fails its requests with :class:`~resilient.errors.TransportError` naming the
peer; a bad spec raises :class:`~resilient.errors.ConfigError` naming the item and the
syntax. Everything else is the wrapped transport's behaviour.
"""
from __future__ import annotations

import collections
import os
import random
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from resilient.errors import ConfigError, TransportAborted, TransportError
from resilient.transport.base import Buffer, Request, Transport, buffer_nbytes
from resilient.transport.wrapper import WrappedTransport

ENV = "RESILIENT_SHAPING"
ENV_FILE = "RESILIENT_SHAPING_FILE"
_SYNTAX = "use e.g. 'slow=3x', 'link=m2:3x', 'delay=5ms', 'bw=100MB/s', 'jitter=30%', 'drop=m3' (comma-separated)"
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1 << 20, "gib": 1 << 30}


@dataclass(frozen=True)
class ShapingSpec:
    slow: float = 1.0
    links: Mapping[str, float] = field(default_factory=dict)
    delay_s: float = 0.0
    bw: float = 0.0            # bytes/s; 0: no cap
    ref_bw: float = 1e9
    ref_lat: float = 50e-6
    drop: frozenset[str] = frozenset()
    jitter: float = 0.0        # fraction: hold *= uniform(1 - jitter, 1 + jitter)
    seed: int | None = None
    text: str = ""

    @property
    def active(self) -> bool:
        return self.slow != 1.0 or bool(self.links) or self.delay_s > 0 or self.bw > 0 or bool(self.drop)

    def hold_s(self, peer: str, nbytes: int) -> float:
        """Seconds a send of ``nbytes`` to ``peer`` is held."""
        factor = self.slow * self.links.get(peer, 1.0)
        hold = self.delay_s + max(0.0, factor - 1.0) * (self.ref_lat + nbytes / self.ref_bw)
        if self.bw > 0:
            hold += nbytes / self.bw
        return hold


def _factor(item: str, v: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)x?", v.strip().lower())
    if not m or float(m.group(1)) < 1.0:
        raise ConfigError(f"shaping item {item!r}: the slowdown must be a factor >= 1 like '3x'; {_SYNTAX}")
    return float(m.group(1))


def _seconds(item: str, v: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(us|ms|s)", v.strip().lower())
    if not m:
        raise ConfigError(f"shaping item {item!r}: a time needs a unit (us, ms, s) like '5ms'; {_SYNTAX}")
    return float(m.group(1)) * _TIME[m.group(2)]


def _rate(item: str, v: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]?i?b?)(/s)?", v.strip().lower())
    if not m or m.group(2) not in _SIZE or float(m.group(1)) <= 0:
        raise ConfigError(f"shaping item {item!r}: a bandwidth looks like '100MB/s' (B, KB, MB, GB, KiB, MiB, GiB); {_SYNTAX}")
    return float(m.group(1)) * _SIZE[m.group(2)]


def parse_shaping(text: str | None) -> ShapingSpec:
    """Parse a spec (see the module docstring); empty or None: no shaping."""
    kw: dict[str, Any] = {"links": {}, "drop": set()}
    for item in re.split(r"[,;]", text or ""):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep:
            raise ConfigError(f"shaping item {item!r} has no '='; {_SYNTAX}")
        if key == "slow":
            kw["slow"] = _factor(item, value)
        elif key == "link":
            peer, sep2, f = value.rpartition(":")
            if not sep2 or not peer.strip():
                raise ConfigError(f"shaping item {item!r}: write link=PEER:FACTOR like 'link=m2:3x'; {_SYNTAX}")
            kw["links"][peer.strip()] = _factor(item, f)
        elif key == "delay":
            kw["delay_s"] = _seconds(item, value)
        elif key == "bw":
            kw["bw"] = _rate(item, value)
        elif key == "ref_bw":
            kw["ref_bw"] = _rate(item, value)
        elif key == "ref_lat":
            kw["ref_lat"] = _seconds(item, value)
        elif key == "jitter":
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)(%?)", value.strip())
            j = (float(m.group(1)) / (100.0 if m.group(2) else 1.0)) if m else -1.0
            if not 0.0 <= j < 1.0:
                raise ConfigError(f"shaping item {item!r}: jitter is a fraction in [0, 1) like '30%' or '0.3'; {_SYNTAX}")
            kw["jitter"] = j
        elif key == "seed":
            if not value.strip().isdigit():
                raise ConfigError(f"shaping item {item!r}: seed is a non-negative integer; {_SYNTAX}")
            kw["seed"] = int(value)
        elif key == "drop":
            if not value.strip():
                raise ConfigError(f"shaping item {item!r}: name the peer, like 'drop=m3'; {_SYNTAX}")
            kw["drop"].add(value.strip())
        else:
            raise ConfigError(f"unknown shaping item {item!r}; {_SYNTAX}")
    kw["drop"] = frozenset(kw["drop"])
    return ShapingSpec(text=(text or "").strip(), **kw)


class _Held(Request):
    """A send held by the shaper; ``inner`` is set once it is handed on."""

    __slots__ = ("peer", "nbytes", "buf", "op_seq", "tag", "digest", "due", "inner", "_error")

    def __init__(self, peer: str, buf: Buffer, nbytes: int, op_seq: int, tag: int, digest: int, due: float) -> None:
        self.peer, self.buf, self.nbytes = peer, buf, nbytes
        self.op_seq, self.tag, self.digest, self.due = op_seq, tag, digest, due
        self.inner: Request | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self.inner is not None and self.inner.done()

    @property
    def error(self) -> BaseException | None:
        return self._error or (self.inner.error if self.inner is not None else None)


class _Failed(Request):
    """A request on a dropped link: failed when posted."""

    def __init__(self, peer: str, nbytes: int, op_seq: int, exc: BaseException, is_send: bool) -> None:
        self.peer, self.nbytes, self.op_seq, self.failure, self.is_send = peer, nbytes, op_seq, exc, is_send

    def done(self) -> bool:
        return False

    @property
    def error(self) -> BaseException | None:
        return self.failure


class ShapedTransport(WrappedTransport):
    """Wraps ``inner`` (any :class:`Transport`) and applies ``spec``; see the module
    docstring. Same thread model as the wrapped transport (one op thread; :meth:`abort`
    and :meth:`set_spec` from any thread)."""

    def __init__(self, inner: Transport, spec: ShapingSpec | str | None = None, spec_file: str | None = None) -> None:
        super().__init__(inner)
        self.spec = spec if isinstance(spec, ShapingSpec) else parse_shaping(spec)
        self.spec_file = spec_file
        self._file_seen: tuple[float, int] | None = None
        self._file_checked = 0.0
        self._queues: dict[str, collections.deque[_Held]] = {}
        self._busy_until: dict[str, float] = {}
        self._idle = 0.0
        self._rng = random.Random()
        self._rng_seed: object = object()
        self._reload()

    # -- shaping control ----------------------------------------------------------------

    def set_spec(self, spec: ShapingSpec | str | None) -> None:
        """Change the shaping from now on (already held sends keep their due time)."""
        self.spec = spec if isinstance(spec, ShapingSpec) else parse_shaping(spec)

    def _reload(self) -> None:
        if not self.spec_file:
            return
        now = time.monotonic()
        if now - self._file_checked < 0.2 and self._file_seen is not None:
            return
        self._file_checked = now
        try:
            st = os.stat(self.spec_file)
        except FileNotFoundError:
            if self._file_seen is not None:
                self._file_seen = None
                self.spec = ShapingSpec()
            return
        sig = (st.st_mtime, st.st_size)
        if sig != self._file_seen:
            with open(self.spec_file, encoding="utf-8") as f:
                self.spec = parse_shaping(f.read())
            self._file_seen = sig

    # -- Transport (what :class:`WrappedTransport` does not pass on unchanged) -------------

    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        self._fail_held(TransportAborted(f"shaped send dropped: the transport moved to epoch {epoch}"))
        self.inner.configure(epoch, token, addresses)

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        self._reload()
        spec = self.spec
        if peer in spec.drop:
            return _Failed(peer, buffer_nbytes(buf), op_seq,
                           TransportError(f"link to member {peer} is down (shaping drop={peer})"), True)
        q = self._queues.get(peer)
        nbytes = buffer_nbytes(buf)
        hold = spec.hold_s(peer, nbytes) if spec.active else 0.0
        if spec.jitter and hold > 0:
            seed = spec.seed if spec.seed is not None else zlib.crc32(self.member_id.encode())
            if seed != self._rng_seed:
                self._rng.seed(seed)
                self._rng_seed = seed
            hold *= 1.0 + spec.jitter * self._rng.uniform(-1.0, 1.0)
        if hold <= 0 and not q:
            return self.inner.isend(peer, buf, op_seq, tag, digest)
        if self.inner.aborted:
            return self.inner.isend(peer, buf, op_seq, tag, digest)   # fails with the abort reason
        now = time.monotonic()
        due = max(now, self._busy_until.get(peer, 0.0)) + hold
        self._busy_until[peer] = due
        req = _Held(peer, buf, nbytes, op_seq, tag, digest, due)
        self._queues.setdefault(peer, collections.deque()).append(req)
        return req

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        self._reload()  # a receive re-posted after a drop must see the healed link too
        if peer in self.spec.drop:
            return _Failed(peer, buffer_nbytes(buf), op_seq,
                           TransportError(f"link to member {peer} is down (shaping drop={peer})"), False)
        return self.inner.irecv(peer, buf, op_seq, tag, digest)

    def irecv_speculative(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        self._reload()
        if peer in self.spec.drop:
            return _Failed(peer, buffer_nbytes(buf), op_seq,
                           TransportError(f"link to member {peer} is down (shaping drop={peer})"), False)
        return self.inner.irecv_speculative(peer, buf, op_seq, tag, digest)

    def cancel_op(self, op_seq: int) -> None:
        for peer, q in self._queues.items():
            for req in [r for r in q if r.op_seq == op_seq]:
                req._error = TransportAborted(f"op #{op_seq} was cancelled")
                q.remove(req)
        self.inner.cancel_op(op_seq)

    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        self.inner.post_error([p for p in peers if p not in self.spec.drop], op_seq, message, timeout)

    def probe(self, peers: Sequence[str]) -> None:
        self.inner.probe([p for p in peers if p not in self.spec.drop])

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._idle = 0.0
        while True:
            self._release()
            if self.inner.aborted:
                self._fail_held(TransportAborted("transport aborted"))
            inner: list[Request] = []
            held_pending = False
            for r in requests:
                if r.error is not None:
                    raise r.error
                if isinstance(r, _Held):
                    if r.inner is None:
                        held_pending = True
                    else:
                        inner.append(r.inner)
                elif isinstance(r, _Failed):
                    raise r.failure
                else:
                    inner.append(r)
            next_due = self._next_due()
            now = time.monotonic()
            if next_due is None and not held_pending:
                left = None if deadline is None else max(0.0, deadline - now)
                return self._inner_wait(inner, left)
            slice_end = next_due if next_due is not None else now + 0.01
            if deadline is not None:
                if now >= deadline:
                    return False
                slice_end = min(slice_end, deadline)
            if inner and not held_pending:
                if self._inner_wait(inner, max(0.0, slice_end - now)):
                    return True
            else:
                # Nothing of ours is on the wire yet: keep the wrapped transport's other
                # requests moving while the held ones come due.
                if inner:
                    self._inner_wait(inner, max(0.0, slice_end - now))
                else:
                    time.sleep(max(0.0, min(slice_end - now, 0.01)))

    def idle(self, timeout: float) -> None:
        self._release()
        self.inner.idle(min(timeout, 0.01) if self._next_due() is not None else timeout)

    def close(self) -> None:
        self._fail_held(TransportError("transport closed"))
        self.inner.close()

    # -- internals ------------------------------------------------------------------------

    def _inner_wait(self, inner: list[Request], timeout: float | None) -> bool:
        """One slice of a wait. ``wait_s`` per peer (straggler detection) must mean "blocked
        on that peer while idle": time in which this member still had held sends queued
        is *busy* (a slow NIC transmitting), not waiting. The wrapped transport counts a
        receive's wait from the start of the slice it completed in; this corrects that to
        the idle slices of the whole call."""
        recvs = [r for r in inner if not r.is_send and not r.done()]
        busy = self._next_due() is not None
        t_slice = time.monotonic()
        try:
            return self.inner.wait(inner, timeout)
        finally:
            now = time.monotonic()
            for r in recvs:
                if r.done():
                    counted = max(0.0, min(r.done_at() or now, now) - t_slice)
                    fix = self._idle - (counted if busy else 0.0)
                    if fix:
                        self.inner.stats.add_wait(r.peer, fix)
            if not busy:
                self._idle += now - t_slice

    def _next_due(self) -> float | None:
        dues = [q[0].due for q in self._queues.values() if q]
        return min(dues) if dues else None

    def _release(self) -> None:
        now = time.monotonic()
        for peer, q in self._queues.items():
            while q and q[0].due <= now:
                req = q.popleft()
                req.inner = self.inner.isend(peer, req.buf, req.op_seq, req.tag, req.digest)

    def _fail_held(self, exc: BaseException) -> None:
        for q in self._queues.values():
            for req in q:
                req._error = exc
            q.clear()
        self._busy_until.clear()


def shaped_from_env(inner: Transport, environ: Mapping[str, str] | None = None) -> Transport:
    """``inner`` wrapped per ``RESILIENT_SHAPING`` / ``RESILIENT_SHAPING_FILE``, or
    ``inner`` itself when neither is set. ConfigError on a bad spec."""
    env = os.environ if environ is None else environ
    text, path = env.get(ENV, ""), env.get(ENV_FILE, "")
    if not text.strip() and not path:
        return inner
    return ShapedTransport(inner, parse_shaping(text), spec_file=path or None)
