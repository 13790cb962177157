"""Moved: the retrying transport wrapper is :mod:`resilient.transport.retrying`.

Kept only as an import path for the communicator (another part of the package, which
imports :class:`RetryingTransport` and :class:`PeerUnreachable` from here); new code
imports from :mod:`resilient.transport.retrying`. Nothing here can fail.
"""
from __future__ import annotations

from resilient.transport.retrying import PeerUnreachable, RetryingTransport, retryable

__all__ = ["PeerUnreachable", "RetryingTransport", "retryable"]
