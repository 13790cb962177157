"""Transports: point-to-point, epoch-scoped, abortable messaging between members.

The interface and its contract are :mod:`resilient.transport.base`; the layers and which
file to touch to add a transport are listed in docs/internals.md ("Add a transport").
Importing this package imports nothing else (no sockets, no torch), so it never fails.
"""
