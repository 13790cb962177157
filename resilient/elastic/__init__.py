"""Elastic training helpers: the elastic sampler (``resilient.elastic.sampler``); the
elastic ``State`` is added on top of the collectives."""
from resilient.elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
