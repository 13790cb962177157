"""Moved: the retrying transport wrapper is :mod:`resilient.transport.retrying`.

Kept as the old import path for code outside the package; the package itself imports
from :mod:`resilient.transport.retrying` (and :class:`PeerUnreachable` from
:mod:`resilient.errors`). Nothing here can fail.
"""
from __future__ import annotations

from resilient.transport.retrying import PeerUnreachable, RetryingTransport, retryable

__all__ = ["PeerUnreachable", "RetryingTransport", "retryable"]
