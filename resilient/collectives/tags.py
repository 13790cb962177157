"""The one registry of wire identifiers: op-sequence namespaces and algorithm tag spaces.

A frame is matched to a receive by ``(peer, op_seq, tag)``. Two things keep unrelated
traffic apart, and both are allocated here, never picked by comment in an algorithm:

* the **namespace** of an ``op_seq`` (its top two bits): collectives (``COLLECTIVE``, the
  op's sequence number), point-to-point send/recv (``P2P``, a per-pair counter) and
  control exchanges between members (``CONTROL``, e.g. the ledger summaries of a
  recovery, numbered by epoch). A transport matches a frame only with receives of the same
  namespace (:func:`same_namespace`), so they never meet each other's data;
* the **tag space** of a tag (its bits 56..): one per algorithm that may post frames in
  the same op (:data:`SPACES`), so e.g. a recovery round never matches a ring step.

Adding an algorithm: add one entry to :data:`SPACES` and build its tags with
:func:`tag`. Pure constants and arithmetic: nothing here fails (a step or sub index out of
range raises ``ValueError`` naming it, as two tags would collide otherwise).
"""
from __future__ import annotations

from typing import Final

from resilient.transport.tags import (
    CONTROL_NAMESPACE, OP_NAMESPACE, P2P_NAMESPACE, control_seq, in_namespace, namespace_of, p2p_seq, same_namespace,
)

__all__ = [
    "CHAIN", "COLLECTIVE", "CONTROL", "LEAF", "P2P", "QUANTIZED_RING", "RECOVERY", "RECURSIVE_DOUBLING", "RING",
    "SHM_DIRECT", "SHM_DIRECT_RS", "SPACES", "STATUS_EXCHANGE", "control_seq", "in_namespace", "namespace_of", "p2p_seq",
    "same_namespace", "tag",
]

#: op_seq namespaces (top two bits of the 64-bit op sequence number): defined once, by the
#: transport layer (resilient/transport/tags.py, which never imports the collectives)
COLLECTIVE: Final = OP_NAMESPACE
P2P: Final = P2P_NAMESPACE
CONTROL: Final = CONTROL_NAMESPACE

#: tag spaces (bits 56..63 of a tag), one per algorithm; values are on the wire, never reuse one
RING: Final = 0
RECURSIVE_DOUBLING: Final = 1
CHAIN: Final = 2
RECOVERY: Final = 3
LEAF: Final = 4            # leaf path, lossless and deadline modes (disjoint steps)
STATUS_EXCHANGE: Final = 5  # ledger summaries of a recovery (CONTROL namespace)
QUANTIZED_RING: Final = 6
SHM_DIRECT: Final = 7       # direct shared-memory allreduce: segment locators and votes (algorithms/shm_direct.py)
SHM_DIRECT_RS: Final = 8    # direct shared-memory reduce-scatter: the same (algorithms/shm_direct_rs.py)

SPACES: Final[dict[str, int]] = {
    "ring": RING, "recursive_doubling": RECURSIVE_DOUBLING, "chain": CHAIN, "recovery": RECOVERY,
    "leaf": LEAF, "status_exchange": STATUS_EXCHANGE, "quantized_ring": QUANTIZED_RING,
    "shm_direct": SHM_DIRECT, "shm_direct_rs": SHM_DIRECT_RS,
}
assert len(set(SPACES.values())) == len(SPACES), "two algorithms share a tag space"

_STEP_BITS: Final = 28


def tag(step: int, sub: int, space: int = RING) -> int:
    """The tag of frame ``sub`` of step ``step`` in tag space ``space``."""
    if not 0 <= sub < (1 << _STEP_BITS) or not 0 <= step < (1 << (56 - _STEP_BITS)):
        raise ValueError(f"tag step {step} / sub {sub} out of range (step < 2**28, sub < 2**28)")
    return (space << 56) | (step << _STEP_BITS) | sub
