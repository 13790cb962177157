"""The typed shapes of the etcd client objects that :mod:`.store` and :mod:`.lease_mux` use.

pyetcd (the etcd client) and its generated protobuf messages ship no type information, so
everything they return would be ``Any``. These Protocols state exactly which attributes and
methods of pyetcd's client, endpoints, gRPC stubs and etcd's v3 messages (``rpc.proto``,
``kv.proto``) the Store relies on; the Store annotates each value it receives from pyetcd
with one of them, at that boundary, and everything past it is checked.

Only declarations: nothing here runs or raises. A shape that drifts from pyetcd or etcd
shows as an ``AttributeError`` in the Store's integration tests (tests/test_cp_store.py),
which run against a real etcd.
"""
from __future__ import annotations

from typing import Iterator, Protocol, Sequence, TypeVar

import grpc

R = TypeVar("R", covariant=True)

#: gRPC call metadata as pyetcd keeps it: ``(("token", <token>),)`` once authenticated.
Metadata = tuple[tuple[str, str], ...]


class ResponseHeader(Protocol):
    @property
    def revision(self) -> int: ...


class KeyValue(Protocol):
    """``mvccpb.KeyValue``."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def create_revision(self) -> int: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def lease(self) -> int: ...


class RangeResponse(Protocol):
    @property
    def header(self) -> ResponseHeader: ...
    @property
    def kvs(self) -> Sequence[KeyValue]: ...
    @property
    def count(self) -> int: ...
    @property
    def more(self) -> bool: ...


class PutResponse(Protocol):
    @property
    def header(self) -> ResponseHeader: ...


class DeleteRangeResponse(Protocol):
    @property
    def header(self) -> ResponseHeader: ...
    @property
    def deleted(self) -> int: ...


class Lease(Protocol):
    """pyetcd's ``leases.Lease`` (what ``client.lease(ttl)`` returns)."""

    @property
    def id(self) -> int: ...


class LeaseKeepAliveResponse(Protocol):
    @property
    def ID(self) -> int: ...  # noqa: N802 - etcd's field name
    @property
    def TTL(self) -> int: ...  # noqa: N802 - etcd's field name


class LeaseTimeToLiveResponse(Protocol):
    @property
    def TTL(self) -> int: ...  # noqa: N802 - etcd's field name
    @property
    def grantedTTL(self) -> int: ...  # noqa: N802 - etcd's field name


class Event(Protocol):
    """``mvccpb.Event``: ``type`` is ``PUT`` or ``DELETE``; ``prev_kv`` is set only when
    the watch asked for it (:meth:`HasField`)."""

    @property
    def type(self) -> int: ...
    @property
    def DELETE(self) -> int: ...  # noqa: N802 - the enum value, as protobuf exposes it
    @property
    def kv(self) -> KeyValue: ...
    @property
    def prev_kv(self) -> KeyValue: ...
    def HasField(self, name: str) -> bool: ...  # noqa: N802 - protobuf's API


class WatchResponse(Protocol):
    @property
    def header(self) -> ResponseHeader: ...
    @property
    def created(self) -> bool: ...
    @property
    def canceled(self) -> bool: ...
    @property
    def cancel_reason(self) -> str: ...
    @property
    def compact_revision(self) -> int: ...
    @property
    def events(self) -> Sequence[Event]: ...


class AuthenticateResponse(Protocol):
    @property
    def token(self) -> str: ...


class AuthStub(Protocol):
    def Authenticate(self, request: object, timeout: float) -> AuthenticateResponse: ...  # noqa: N802


class StreamCall(Protocol[R]):
    """A streaming gRPC call: iterate the responses; :meth:`cancel` ends it (the iteration
    then raises :class:`grpc.RpcError` with ``CANCELLED``)."""

    def __iter__(self) -> Iterator[R]: ...
    def cancel(self) -> bool: ...


class Endpoint(Protocol):
    """pyetcd's ``Endpoint``: one etcd address and its channel."""

    @property
    def channel(self) -> grpc.Channel: ...
    def fail(self) -> None: ...


class Client(Protocol):
    """The subset of ``pyetcd.MultiEndpointEtcd3Client`` the Store calls. ``metadata`` and
    ``call_credentials`` are the client's own attributes, which the Store sets after it
    authenticated (see :meth:`.store.Store._authenticate`)."""

    metadata: Metadata | None
    call_credentials: grpc.CallCredentials | None

    @property
    def channel(self) -> grpc.Channel: ...
    @property
    def authstub(self) -> AuthStub: ...
    @property
    def endpoint_in_use(self) -> Endpoint: ...
    def _clear_old_stubs(self) -> None: ...
    def get_response(self, key: str) -> RangeResponse: ...
    def get_prefix_response(self, key_prefix: str, sort_order: str | None = None) -> RangeResponse: ...
    def get_range_response(self, range_start: str, range_end: bytes, sort_order: str | None = None,
                           limit: int | None = None, revision: int | None = None,
                           keys_only: bool = False) -> RangeResponse: ...
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> PutResponse: ...
    def delete(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> DeleteRangeResponse: ...
    def transaction(self, compare: Sequence[object], success: Sequence[object],
                    failure: Sequence[object]) -> tuple[bool, list[object]]: ...
    def lease(self, ttl: int) -> Lease: ...
    def refresh_lease(self, lease_id: int) -> Iterator[LeaseKeepAliveResponse]: ...
    def revoke_lease(self, lease_id: int) -> None: ...
    def get_lease_info(self, lease_id: int) -> LeaseTimeToLiveResponse: ...
    def close(self) -> None: ...
