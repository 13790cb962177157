"""The etcd v3 store adapter: the only module that imports the etcd client.

The client is ``pyetcd`` (PyPI ``etcd-sdk-python``), the maintained fork of python-etcd3
that imports under modern protobuf (docs/design.md §2). Everything else in resilient talks to etcd
through :class:`Store`, so the client can be swapped here alone.

What it adds on top of the raw client:

* **Bounded retries.** Transient errors (endpoint unreachable, deadline exceeded, no
  endpoint left) are retried with tenacity: exponential backoff with jitter, failing over
  between endpoints, for at most ``retry_timeout`` seconds. Then
  :class:`~resilient.errors.StoreUnavailable` names the endpoints and the last error —
  never a hang, never a gRPC traceback wall. Permanent errors (bad credentials, a request
  etcd rejects) raise :class:`~resilient.errors.StoreError` at once.
* **Watches that survive reconnects.** :meth:`Store.watch_prefix` runs one gRPC watch
  stream per handle in its own thread; when the stream breaks (etcd restarted, endpoint
  died) it re-creates the watch from the revision after the last event it delivered, on
  the next endpoint, so no event is missed. If that revision was compacted meanwhile, the
  callback receives a ``resync`` event (re-read the state) and the watch continues from
  the oldest revision etcd still has.
* **Credentials that outlive their token.** With ``user``/``password`` the Store
  authenticates itself and sends the token as call metadata (so password auth works on a
  plain loopback channel too, where gRPC refuses call credentials). When etcd answers
  "invalid auth token" — the token's TTL (``--auth-token-ttl``) passed while the client was
  idle, or etcd restarted and forgot its simple tokens — it re-authenticates once and
  retries the call; watches do the same when etcd cancels them for the token.
* **TLS problems named as such.** Missing or unreadable TLS files, a CA file without a
  PEM certificate and a key that does not match its certificate raise
  :class:`~resilient.errors.ConfigError` naming the file at construction; a handshake
  that fails (the server's certificate is not signed by the CA, etcd rejects the client
  certificate) raises ConfigError naming the file involved at once, instead of being
  retried as "etcd is not running".
* Small value types (:class:`KV`, :class:`WatchEvent`, :class:`Compare`, :class:`Put`,
  :class:`Delete`) so callers never see client classes.

Retried writes are at-least-once: a ``txn`` whose reply was lost is retried and may then
report that its comparison failed although the first attempt applied. Callers that CAS
(the coordinator) re-read and recompute after a failed CAS, which makes that harmless.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import queue
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar
from urllib.parse import urlparse

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd import transactions as etcd_txn
from pyetcd.utils import prefix_range_end
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from resilient.coordinator import etcd_wire as wire
from resilient.errors import ConfigError, LeaseExpired, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_TRANSIENT_EXC = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
)
# How long pyetcd keeps an endpoint marked failed before trying it again. Short: with one
# endpoint, a long value would turn a 1 s etcd restart into minutes of "no server".
_ENDPOINT_RETRY_S = 0.2
_GRPC_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]


# Markers of a failed TLS handshake or a TLS session the peer tore down (gRPC's transport
# security interface reports these as UNAVAILABLE, like an endpoint that is down).
_TLS_MARKERS = ("handshake", "tsi_", "ssl_error", "certificate", "wrong_version_number")
# etcd's answers to a token it does not know (expired, or etcd restarted) or one issued
# before the auth store changed: re-authenticate (as etcd's own client does).
_TOKEN_EXPIRED = ("invalid auth token", "revision of auth store is old")


def _rpc_details(exc: BaseException | None) -> str:
    """The gRPC details of ``exc`` or of the gRPC error pyetcd replaced by its own."""
    for e in (exc, getattr(exc, "__context__", None)):
        if isinstance(e, grpc.RpcError):
            return str(e.details() or "")
    return ""


def _tls_failure(exc: BaseException) -> str | None:
    details = _rpc_details(exc)
    return details if any(m in details.lower() for m in _TLS_MARKERS) else None


def _token_expired(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and any(m in _rpc_details(exc) for m in _TOKEN_EXPIRED)


def _is_transient(exc: BaseException) -> bool:
    if _tls_failure(exc):
        return False  # a bad CA or certificate does not heal by retrying
    if isinstance(exc, _TRANSIENT_EXC):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in _TRANSIENT_CODES


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_tls_files(ca_cert: str, cert_key: str | None, cert_cert: str | None) -> None:
    """Load the TLS files as Python's ``ssl`` would; :class:`ConfigError` naming the file
    (and its flag/variable) when one is missing, unreadable, not PEM, or the key does not
    match the certificate."""
    named = [(ca_cert, "CA file", "--etcd-ca-cert / RESILIENT_ETCD_CA_CERT"),
             (cert_cert, "client certificate", "--etcd-cert / RESILIENT_ETCD_CERT"),
             (cert_key, "client key", "--etcd-key / RESILIENT_ETCD_KEY")]
    for path, what, where in named:
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"TLS: cannot read the etcd {what} {path!r} ({where}): {exc.strerror}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_cert)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"TLS: the etcd CA file {ca_cert!r} (--etcd-ca-cert / RESILIENT_ETCD_CA_CERT) holds "
                          f"no usable PEM certificate ({exc}); point it at the CA bundle that signed etcd's "
                          f"server certificate") from None
    if cert_cert is not None:
        try:
            ctx.load_cert_chain(cert_cert, cert_key)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"TLS: the etcd client certificate {cert_cert!r} and key {cert_key!r} "
                              f"(--etcd-cert / --etcd-key) do not load as a PEM certificate with its matching "
                              f"private key ({exc})") from None


def _grpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """Parse ``host:port`` / ``http(s)://host:port`` endpoints (a list or one
    comma-separated string) into ``(host, port)`` pairs.

    Raises :class:`ConfigError` naming the bad entry and the expected form.
    """
    if isinstance(endpoints, str):
        items = [e for e in endpoints.split(",")]
    else:
        items = list(endpoints)
    out: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        url = urlparse(item if "://" in item else f"http://{item}")
        try:
            port = url.port
        except ValueError:
            port = None
        if not url.hostname or port is None:
            raise ConfigError(
                f"bad etcd endpoint {raw!r}: expected host:port or http://host:port "
                f"(e.g. 127.0.0.1:2379), several separated by commas"
            )
        out.append((url.hostname, port))
    if not out:
        raise ConfigError("no etcd endpoint given: pass --etcd host:port[,host:port...]")
    return out


@dataclass(frozen=True)
class KV:
    """One key's value and metadata, as read from etcd."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch.

    ``type`` is ``"put"``, ``"delete"`` or ``"resync"`` (history was compacted away: the
    receiver must re-read the state it derives from the watched keys; key/value empty).
    """

    type: str
    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    lease: int = 0
    prev_value: bytes | None = None


@dataclass(frozen=True)
class Compare:
    """One comparison of a transaction. ``target`` is ``value``, ``mod``, ``create`` or
    ``version``; ``op`` is ``==``, ``!=``, ``<`` or ``>``. A missing key compares as
    revision/version 0."""

    key: str
    target: str
    op: str
    operand: bytes | int

    def _build(self) -> object:
        cls = {"value": etcd_txn.Value, "mod": etcd_txn.Mod, "create": etcd_txn.Create,
               "version": etcd_txn.Version}[self.target]
        c = cls(self.key)
        return {"==": c.__eq__, "!=": c.__ne__, "<": c.__lt__, ">": c.__gt__}[self.op](self.operand)


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    """Delete ``key``; with ``prefix`` every key under it; with ``range_end`` every key
    in ``[key, range_end)``."""

    key: str
    prefix: bool = False
    range_end: str | None = None


def _kv(kv: wire.KeyValue) -> KV:
    return KV(
        key=kv.key.decode(), value=bytes(kv.value), create_revision=kv.create_revision,
        mod_revision=kv.mod_revision, version=kv.version, lease=kv.lease,
    )


class WatchHandle:
    """A running prefix watch. :meth:`cancel` stops it (idempotent); the callback is never
    called after ``cancel()`` returns, unless cancel was called from inside the callback."""

    def __init__(self, store: "Store", prefix: str, start_revision: int | None,
                 callback: Callable[[list[WatchEvent]], None], prev_kv: bool, is_prefix: bool = True) -> None:
        self._store = store
        self._prefix = prefix
        self._is_prefix = is_prefix
        self._next_rev = start_revision or 0
        self._callback = callback
        self._prev_kv = prev_kv
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._call: wire.StreamCall[wire.WatchResponse] | None = None
        self._requests: queue.Queue[object] | None = None
        self.connected = threading.Event()
        self.reconnects = 0
        self._refusals = 0  # consecutive cancels by etcd: each one backs off further
        self._thread = threading.Thread(target=self._run, name=f"watch:{prefix}", daemon=True)
        self._thread.start()

    @property
    def next_revision(self) -> int:
        """The revision the watch resumes from after a reconnect."""
        return self._next_rev

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            call, reqs = self._call, self._requests
        if reqs is not None:
            reqs.put(None)
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        attempt = 0
        while not self._cancelled.is_set():
            try:
                self._stream_once()
                attempt = 0
            except grpc.RpcError as exc:
                if self._cancelled.is_set():
                    return
                log.info("watch %s broke (%s); resuming from revision %d", self._prefix,
                         exc.code(), self._next_rev)
            except Exception:  # pragma: no cover - a bug in a callback must not kill the watch silently
                log.exception("watch %s failed; resuming", self._prefix)
            self.connected.clear()
            self.reconnects += 1
            attempt += 1 + self._refusals
            self._cancelled.wait(min(0.5, 0.02 * 2 ** min(attempt, 5)))

    def _on_cancel(self, reason: str, token_gen: int) -> None:
        """etcd cancelled the watch: for a token it no longer knows, re-authenticate (the
        next stream uses the new token); for a refusal, say so (then retry, backing off)."""
        if any(m in reason for m in _TOKEN_EXPIRED) and self._store._user is not None:
            try:
                self._store._refresh_token(token_gen)
            except Exception as exc:  # etcd down again, bad password now: retried with backoff
                log.warning("watch %s: re-authentication failed: %s", self._prefix, exc)
                self._refusals += 1
            return
        if reason:
            self._refusals += 1
            (log.error if self._refusals == 1 else log.debug)(
                "etcd cancelled the watch on %s: %s%s", self._prefix, reason,
                "; the etcd user needs read permission on the job's prefix (docs/security.md)"
                if "permission denied" in reason.lower() else "")

    def _stream_once(self) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=self._prefix.encode(),
            range_end=prefix_range_end(self._prefix.encode()) if self._is_prefix else b"",
            start_revision=self._next_rev, prev_kv=self._prev_kv, progress_notify=True,
        )
        reqs: queue.Queue[object] = queue.Queue()   # WatchRequests; None ends the request stream
        reqs.put(etcdrpc.WatchRequest(create_request=create))
        stub = etcdrpc.WatchStub(self._store._next_watch_channel())
        token_gen = self._store._token_gen
        call: wire.StreamCall[wire.WatchResponse] = stub.Watch(iter(reqs.get, None),
                                                              metadata=self._store._client.metadata)
        with self._lock:
            if self._cancelled.is_set():
                call.cancel()
                return
            self._call, self._requests = call, reqs
        try:
            for resp in call:
                if self._cancelled.is_set():
                    return
                if resp.compact_revision:
                    log.warning("watch %s: revision %d compacted (oldest kept %d); resyncing",
                                self._prefix, self._next_rev, resp.compact_revision)
                    self._next_rev = resp.compact_revision
                    self._callback([WatchEvent("resync", "", b"", resp.compact_revision)])
                    return  # re-create from the compact revision
                if resp.canceled:  # before `created`: a refused watch is both
                    self._on_cancel(str(resp.cancel_reason), token_gen)
                    return
                if resp.created:
                    self.connected.set()
                    self._refusals = 0
                    if self._next_rev == 0:
                        self._next_rev = resp.header.revision + 1
                if not resp.events:
                    continue
                events = []
                for ev in resp.events:
                    kv = ev.kv
                    events.append(WatchEvent(
                        type="delete" if ev.type == ev.DELETE else "put",
                        key=kv.key.decode(), value=bytes(kv.value), mod_revision=kv.mod_revision,
                        create_revision=kv.create_revision, lease=kv.lease,
                        prev_value=bytes(ev.prev_kv.value) if ev.HasField("prev_kv") else None,
                    ))
                self._next_rev = events[-1].mod_revision + 1
                self._callback(events)
        finally:
            reqs.put(None)
            with self._lock:
                self._call = self._requests = None
            call.cancel()


class Store:
    """etcd v3 key-value store, leases and watches, with bounded retries.

    ``endpoints``: ``host:port`` strings (or one comma-separated string); ``timeout``: per
    request, seconds; ``retry_timeout``: total budget for retrying one call across
    endpoints before :class:`StoreUnavailable`. TLS: ``ca_cert`` alone, or with
    ``cert_key`` + ``cert_cert`` for client authentication (the files are checked here:
    :class:`ConfigError` naming the file). ``user``/``password``: etcd RBAC — the token is
    fetched at construction, with the same retry budget, and fetched again whenever etcd
    no longer knows it (see the module docstring). Processes build these options from
    flags/variables with :class:`~resilient.coordinator.etcd_access.EtcdAccess`.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float = 2.0,
        ca_cert: str | None = None,
        cert_key: str | None = None,
        cert_cert: str | None = None,
        user: str | None = None,
        password: str | None = None,
        retry_timeout: float = 10.0,
    ) -> None:
        self.endpoints = [f"{h}:{p}" for h, p in parse_endpoints(endpoints)]
        self.timeout = float(timeout)
        self.retry_timeout = float(retry_timeout)
        if (cert_key is None) != (cert_cert is None):
            raise ConfigError("TLS client auth needs both cert_key and cert_cert (or neither)")
        if (cert_key or cert_cert) and not ca_cert:
            raise ConfigError("TLS client certificates need ca_cert too (the etcd CA bundle)")
        if (user is None) != (password is None):
            raise ConfigError("etcd authentication needs both user and password (or neither)")
        self.ca_cert, self.cert_key, self.cert_cert = ca_cert, cert_key, cert_cert
        creds: grpc.ChannelCredentials | None = None
        if ca_cert:
            check_tls_files(ca_cert, cert_key, cert_cert)
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(ca_cert, cert_key, cert_cert)
        self._user, self._password = user, password
        self._token_lock = threading.Lock()
        self._token_gen = 0  # bumped by every authentication (see _refresh_token)
        if user is not None and creds is None and not all(_is_loopback(h) for h, _ in parse_endpoints(endpoints)):
            log.warning("etcd password authentication without TLS to %s: the password and token cross the "
                        "network in clear text; pass --etcd-ca-cert (see docs/security.md)", ",".join(self.endpoints))
        self._eps: list[wire.Endpoint] = [
            pyetcd.Endpoint(h, p, secure=creds is not None, creds=creds,
                            time_retry=_ENDPOINT_RETRY_S, opts=_GRPC_OPTIONS)
            for h, p in parse_endpoints(endpoints)
        ]
        self._watches: "weakref.WeakSet[WatchHandle]" = weakref.WeakSet()
        self._watch_rr = 0
        self._watch_rr_lock = threading.Lock()
        # No credentials to the client: it would send the token as gRPC *call credentials*,
        # which gRPC refuses on a plain channel ("insufficient security level"). The Store
        # authenticates itself and sends the token as metadata, on any channel.
        self._client: wire.Client = pyetcd.MultiEndpointEtcd3Client(endpoints=self._eps, timeout=self.timeout,
                                                                     failover=True)
        if user is not None:
            try:
                self._retry("authenticate", self._authenticate)
            except BaseException:
                self._client.close()
                raise

    # -- authentication -------------------------------------------------------------------

    def _authenticate(self) -> None:
        """One Authenticate call; installs the token for every later call (and watch)."""
        client = self._client
        request = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
        try:
            resp = client.authstub.Authenticate(request, self.timeout)
        except grpc.RpcError as exc:
            if exc.code() in _TRANSIENT_CODES and not _tls_failure(exc):
                client.endpoint_in_use.fail()  # fail over, as pyetcd does for its own calls
                client._clear_old_stubs()
            raise
        client.metadata = (("token", resp.token),)
        client.call_credentials = None
        self._token_gen += 1

    def _refresh_token(self, seen_gen: int) -> None:
        """Re-authenticate, unless another thread already did since ``seen_gen``."""
        with self._token_lock:
            if self._token_gen == seen_gen:
                log.info("etcd auth token of user %s expired or unknown to etcd; re-authenticating", self._user)
                self._authenticate()

    def _with_fresh_token(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, re-run once after re-authenticating when etcd rejects our token."""
        if self._user is None:
            return fn

        def call() -> T:
            seen = self._token_gen
            try:
                return fn()
            except grpc.RpcError as exc:
                if not _token_expired(exc):
                    raise
            self._refresh_token(seen)
            return fn()

        return call

    # -- plumbing -------------------------------------------------------------------------

    def _retry(self, what: str, fn: Callable[[], T], budget: float | None = None) -> T:
        budget = self.retry_timeout if budget is None else budget
        fresh = self._with_fresh_token(fn)
        closed = []  # attempts whose connection the server closed (a TLS etcd, to a plain client)

        def once() -> T:
            try:
                return fresh()
            except Exception as exc:
                if "socket closed" in _rpc_details(exc).lower():
                    closed.append(exc)
                raise

        try:
            for attempt in Retrying(
                retry=retry_if_exception(_is_transient),
                stop=stop_after_delay(budget),
                wait=wait_random_exponential(multiplier=0.05, max=1.0),
                reraise=True,
            ):
                with attempt:
                    return once()
        except Exception as exc:
            tls = _tls_failure(exc)
            if tls:
                raise ConfigError(self._tls_message(what, tls)) from None
            if _is_transient(exc):
                details = _rpc_details(exc)
                hint = ""
                if self.ca_cert is None and closed:
                    hint = "; if etcd serves TLS (https), pass its CA with --etcd-ca-cert / RESILIENT_ETCD_CA_CERT"
                raise StoreUnavailable(
                    f"etcd {what}: no endpoint of {','.join(self.endpoints)} answered within "
                    f"{budget:.1f}s (last error: {type(exc).__name__}{': ' + details if details else ''}); "
                    f"check that etcd is running there and --etcd points at its client URL{hint}"
                ) from None
            if isinstance(exc, grpc.RpcError):
                raise StoreError(f"etcd {what} failed: {exc.code().name}: {exc.details()}"
                                 f"{self._auth_hint(exc)}") from None
            if isinstance(exc, pyetcd.Etcd3Exception):
                raise StoreError(f"etcd {what} failed: {type(exc).__name__}: {exc}") from None
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _auth_hint(self, exc: grpc.RpcError) -> str:
        details = str(exc.details() or "")
        if "authentication is not enabled" in details:
            return (f"; etcd has authentication off but user {self._user!r} was given: drop --etcd-user/"
                    f"RESILIENT_ETCD_USER, or enable auth in etcd")
        if "invalid user ID or password" in details:
            return (f"; check the user {self._user!r} and its password (--etcd-password-file / "
                    f"RESILIENT_ETCD_PASSWORD_FILE or RESILIENT_ETCD_PASSWORD)")
        if "user name is empty" in details:
            return "; etcd has authentication on: pass --etcd-user and --etcd-password-file (RESILIENT_ETCD_USER/...)"
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return (f"; user {self._user!r} needs a role with readwrite permission on the job's prefix "
                    f"/resilient/<job>/ (see docs/security.md)")
        return ""

    def _tls_message(self, what: str, details: str) -> str:
        eps = ",".join(self.endpoints)
        low = details.lower()
        if self.ca_cert is None:
            return (f"TLS problem with etcd {eps} ({what}): {details}; this client speaks plain gRPC: "
                    f"pass etcd's CA with --etcd-ca-cert / RESILIENT_ETCD_CA_CERT if it serves TLS")
        if "certificate_verify_failed" in low or "verify" in low:
            return (f"TLS handshake with etcd {eps} failed ({what}): its server certificate is not signed by "
                    f"the CA in {self.ca_cert!r} (--etcd-ca-cert / RESILIENT_ETCD_CA_CERT), or does not name the "
                    f"host you connect to; details: {details}")
        if "wrong_version_number" in low or "handshake read failed" in low:
            return (f"TLS handshake with etcd {eps} failed ({what}): the endpoint closed the connection during "
                    f"the handshake, so it likely does not serve TLS (a plain http etcd?); drop --etcd-ca-cert / "
                    f"RESILIENT_ETCD_CA_CERT ({self.ca_cert!r}) or give etcd's https client URL; details: {details}")
        if self.cert_cert is None:
            return (f"TLS session with etcd {eps} torn down by the server ({what}): it requires a client "
                    f"certificate; pass --etcd-cert and --etcd-key (RESILIENT_ETCD_CERT/KEY) signed by a CA that "
                    f"etcd trusts (its --trusted-ca-file); details: {details}")
        return (f"TLS session with etcd {eps} torn down by the server ({what}): it did not accept the client "
                f"certificate {self.cert_cert!r} (--etcd-cert / RESILIENT_ETCD_CERT; key {self.cert_key!r}): is it "
                f"signed by a CA in etcd's --trusted-ca-file? (the CA file {self.ca_cert!r} is only used to check "
                f"the server); details: {details}")

    def _next_watch_channel(self) -> grpc.Channel:
        with self._watch_rr_lock:
            ep = self._eps[self._watch_rr % len(self._eps)]
            self._watch_rr += 1
        return ep.channel

    def close(self) -> None:
        """Cancel this store's watches and close the client's channels."""
        for handle in list(self._watches):
            handle.cancel()
        self._client.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- key/value ------------------------------------------------------------------------

    def get(self, key: str) -> KV | None:
        """The key's value and metadata, or ``None`` when it does not exist."""
        resp = self._retry(f"get {key}", lambda: self._client.get_response(key))
        return _kv(resp.kvs[0]) if resp.count else None

    def get_with_revision(self, key: str) -> tuple[KV | None, int]:
        """The key (or None) and the store revision of that read: watch from
        ``revision + 1`` to see exactly the changes after it."""
        resp = self._retry(f"get {key}", lambda: self._client.get_response(key))
        return (_kv(resp.kvs[0]) if resp.count else None), resp.header.revision

    def get_prefix(self, prefix: str) -> list[KV]:
        """Every key under ``prefix``, sorted by key."""
        return self.snapshot(prefix)[0]

    def snapshot(self, prefix: str) -> tuple[list[KV], int]:
        """Every key under ``prefix`` and the store revision of that read (watch from
        ``revision + 1`` to see exactly the changes after it)."""
        resp = self._retry(f"get {prefix}*", lambda: self._client.get_prefix_response(prefix, sort_order="ascend"))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def snapshot_page(self, prefix: str, start: str, limit: int, revision: int = 0,
                      keys_only: bool = False) -> tuple[list[KV], int, bool]:
        """Up to ``limit`` keys under ``prefix`` from ``start`` on, at ``revision`` (0: now):
        ``(kvs, revision read, more keys follow)``. Paged reads stay under gRPC's receive
        limit whatever the prefix holds (:func:`~.directory.paged_snapshot`). No sort is
        asked: etcd returns a range in key order, and etcd 3.4 ignores ``limit`` on a sorted
        range (it reads every key to the range's end, sorts, then truncates: each page of
        a 12,500-node ``nodes/`` read cost up to the whole 12 MB prefix, 3x the CPU).
        ``keys_only``: every field but the value (``b""``), as etcd's ``keys_only`` range."""
        end = prefix_range_end(prefix.encode())
        resp = self._retry(f"get {prefix}* page", lambda: self._client.get_range_response(
            start, end, limit=limit, revision=revision or None, keys_only=keys_only))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision, bool(resp.more)

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        """Write ``key``; returns the new store revision. A ``lease`` that no longer exists
        raises :class:`LeaseExpired`."""
        try:
            resp = self._retry(f"put {key}", lambda: self._client.put(key, value, lease=lease))
        except StoreError as exc:
            if "lease not found" in str(exc):
                raise LeaseExpired(f"lease {lease:x} is gone (revoked or expired); cannot write {key}") from None
            raise
        return resp.header.revision

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return bool(self._retry(f"delete {key}", lambda: self._client.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many."""
        return self._retry(f"delete {prefix}*", lambda: self._client.delete_prefix(prefix)).deleted

    def txn(self, compare: Iterable[Compare], success: Iterable[Put | Delete],
            failure: Iterable[Put | Delete] = ()) -> bool:
        """Run a transaction; True if every comparison held (``success`` ops applied)."""
        cmp = [c._build() for c in compare]
        ok_ops = [self._op(o) for o in success]
        bad_ops = [self._op(o) for o in failure]
        try:
            ok, _ = self._retry("transaction", lambda: self._client.transaction(cmp, ok_ops, bad_ops))
        except StoreError as exc:
            if "lease not found" in str(exc):
                raise LeaseExpired(f"a lease used by the transaction is gone: {exc}") from None
            raise
        return bool(ok)

    @staticmethod
    def _op(op: Put | Delete) -> object:
        if isinstance(op, Put):
            return etcd_txn.Put(op.key, op.value, lease=op.lease)
        if isinstance(op, Delete):
            key = op.key.encode()
            if op.range_end is not None:
                return etcd_txn.Delete(key, range_end=op.range_end.encode())
            return etcd_txn.Delete(key, range_end=prefix_range_end(key) if op.prefix else None)
        raise TypeError(f"not a transaction op: {op!r}")

    def cas(self, key: str, expected_mod_revision: int, value: bytes | str, lease: int | None = None,
            extra: Iterable[Compare] = ()) -> bool:
        """Write ``key`` only if its mod revision is still ``expected_mod_revision`` (0: only
        if it does not exist) and every ``extra`` comparison holds."""
        first = (Compare(key, "create", "==", 0) if expected_mod_revision == 0
                 else Compare(key, "mod", "==", expected_mod_revision))
        return self.txn([first, *extra], [Put(key, value if isinstance(value, bytes) else value.encode(), lease)])

    def create(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        """Write ``key`` only if it does not exist; True if written."""
        return self.cas(key, 0, value, lease)

    # -- leases ---------------------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        """Grant a lease of ``ttl`` seconds (rounded up: etcd counts whole seconds, and
        raises tiny TTLs to its minimum, about 1.5x the election timeout). Returns its id."""
        seconds = max(1, math.ceil(ttl))
        return self._retry("lease grant", lambda: self._client.lease(seconds)).id

    def keepalive(self, lease_id: int, budget: float | None = None) -> float:
        """Refresh a lease once; returns its TTL. Raises :class:`LeaseExpired` when etcd
        says the lease is gone, :class:`StoreUnavailable` when etcd cannot be reached within
        ``budget`` seconds (default: the store's retry budget)."""

        def once() -> float:
            for resp in self._client.refresh_lease(lease_id):
                return float(resp.TTL)
            return 0.0

        ttl = self._retry("lease keep-alive", once, budget)
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired or was revoked")
        return ttl

    def revoke(self, lease_id: int) -> bool:
        """Revoke a lease (its keys are deleted at once). False if it was already gone."""
        try:
            self._retry("lease revoke", lambda: self._client.revoke_lease(lease_id))
            return True
        except StoreError as exc:
            if "lease not found" in str(exc):
                return False
            raise

    def lease_ttl(self, lease_id: int) -> tuple[float, float] | None:
        """``(remaining_seconds, granted_seconds)`` of a lease, or ``None`` if it is gone."""
        resp = self._retry("lease ttl", lambda: self._client.get_lease_info(lease_id))
        if resp.TTL < 0:
            return None
        return float(resp.TTL), float(resp.grantedTTL)

    # -- watches --------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int | None,
                     callback: Callable[[list[WatchEvent]], None], prev_kv: bool = False,
                     is_prefix: bool = True) -> WatchHandle:
        """Call ``callback(events)`` for every change under ``prefix`` from
        ``start_revision`` on (``None``: from now), in revision order, from one thread per
        watch. Reconnects transparently (see the module docstring); returns a handle whose
        ``cancel()`` stops it. Exceptions raised by the callback are logged, and the watch
        goes on. ``is_prefix=False`` watches the single key ``prefix`` (see :meth:`watch_key`)."""

        def safe(events: list[WatchEvent]) -> None:
            try:
                callback(events)
            except Exception:
                log.exception("watch callback for %s failed", prefix)

        handle = WatchHandle(self, prefix, start_revision, safe, prev_kv, is_prefix)
        self._watches.add(handle)
        return handle

    def watch_key(self, key: str, start_revision: int | None,
                  callback: Callable[[list[WatchEvent]], None]) -> WatchHandle:
        """Like :meth:`watch_prefix`, for exactly one key."""
        return self.watch_prefix(key, start_revision, callback, is_prefix=False)

    def revision(self, within: str = "/resilient/") -> int:
        """The store's current revision, read by a get of the key ``within``: pass a key
        under the prefix your etcd role may read (the job's ``/resilient/<job>/``)."""
        resp = self._retry("get revision", lambda: self._client.get_response(within))
        return resp.header.revision

    # -- RBAC administration (LocalEtcd, tests; a deployment uses etcdctl) ---------------

    def _auth_call(self, what: str, method: str, request: object) -> None:
        def call() -> None:   # the AuthStub method named ``method`` (a gRPC stub, not ours)
            getattr(etcdrpc.AuthStub(self._client.channel), method)(
                request, self.timeout, metadata=self._client.metadata)

        self._retry(what, call)

    def add_role(self, role: str, prefix: str | None = None) -> None:
        """Create ``role`` (``root``: etcd's all-powerful role); with ``prefix``, grant it
        read and write on every key under the prefix."""
        self._auth_call(f"add role {role}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role))
        if prefix is not None:
            perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE, key=prefix.encode(),
                                      range_end=prefix_range_end(prefix.encode()))
            self._auth_call(f"grant {prefix}* to role {role}", "RoleGrantPermission",
                            etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm))

    def add_user(self, user: str, password: str, roles: Sequence[str] = ()) -> None:
        """Create ``user`` with ``password`` and grant it ``roles``."""
        self._auth_call(f"add user {user}", "UserAdd", etcdrpc.AuthUserAddRequest(name=user, password=password))
        for role in roles:
            self._auth_call(f"grant role {role} to {user}", "UserGrantRole",
                            etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))

    def enable_auth(self) -> None:
        """Turn authentication on (needs a ``root`` user holding the ``root`` role). From
        then on, every client needs credentials — this Store included."""
        self._auth_call("enable auth", "AuthEnable", etcdrpc.AuthEnableRequest())
