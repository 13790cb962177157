"""Op-sequence namespaces: the top two bits of every ``op_seq`` a transport carries.

One responsibility: name the namespaces and compute/inspect them, so no module writes a
raw ``1 << 62`` or ``>> 62``. The transport layer (the lowest layer of the data plane)
owns them; the collectives' tag registry imports them from here (never the other way,
so there is no import cycle).

* namespace 0 (:data:`OP_NAMESPACE`): the collectives, numbered by the communicator;
* namespace 1 (:data:`P2P_NAMESPACE`): point-to-point ``send``/``recv`` of the user;
* namespace 2 (:data:`CONTROL_NAMESPACE`): control exchanges between members (e.g. the
  ledger summaries of a recovery). A transport matches control frames only with control
  receives, in their own order, so a control exchange never meets an op's data.

The low bits of a namespaced sequence number are ``n mod 2**40``.

Failure behaviour: pure integer functions; they raise nothing for any ``int``.
"""
from __future__ import annotations

#: bit position of the namespace in an op sequence number
NAMESPACE_SHIFT = 62
#: the low bits kept of a namespaced number
SEQ_MASK = (1 << 40) - 1

OP_NAMESPACE = 0
P2P_NAMESPACE = 1
CONTROL_NAMESPACE = 2


def namespace_of(op_seq: int) -> int:
    """The namespace (top two bits) of ``op_seq``."""
    return op_seq >> NAMESPACE_SHIFT


def in_namespace(namespace: int, n: int) -> int:
    """The op sequence number ``n`` (mod 2**40) of ``namespace``."""
    return (namespace << NAMESPACE_SHIFT) | (n & SEQ_MASK)


def is_control(op_seq: int) -> bool:
    """Whether ``op_seq`` belongs to the control namespace."""
    return namespace_of(op_seq) == CONTROL_NAMESPACE


def control_seq(n: int) -> int:
    """The op sequence number of control exchange ``n`` (e.g. an epoch number)."""
    return in_namespace(CONTROL_NAMESPACE, n)


def p2p_seq(n: int) -> int:
    """The op sequence number of the ``n``-th point-to-point message of a pair."""
    return in_namespace(P2P_NAMESPACE, n)


def same_namespace(a: int, b: int) -> bool:
    """Whether op sequence numbers ``a`` and ``b`` share a namespace."""
    return namespace_of(a) == namespace_of(b)
