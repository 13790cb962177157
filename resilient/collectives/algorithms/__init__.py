"""One class per algorithm, each written against the transport interface and the ledger
(never sockets or etcd): :class:`RingReduceScatterAllgather` (pipelined ring, large
messages), :class:`RecursiveDoubling` (small messages, latency-optimal),
:class:`ChainBroadcast` (pipelined chain from the root)."""
from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.algorithms.chain import ChainBroadcast

__all__ = ["OpContext", "RingReduceScatterAllgather", "RecursiveDoubling", "ChainBroadcast"]
