"""Elastic training helpers: :class:`State` (model, optimizer and user fields; commit /
restore / sync, joiners synced from a healthy member, membership-change callbacks) and the
:class:`ElasticSampler` (the rest of the epoch re-sharded over the live members)."""
from resilient.elastic.sampler import ElasticSampler
from resilient.elastic.state import State
from resilient.errors import TrainingFinished

__all__ = ["ElasticSampler", "State", "TrainingFinished"]
