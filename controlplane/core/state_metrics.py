"""Metrics read from the database when web's /metrics is scraped (not counted in memory):
decisions happen in Celery workers and ingest, which serve no /metrics of their own, so the
rows they write are the one place that knows them all. Apps add their collectors here
(`state_metrics_add`, from their AppConfig.ready); only web's sync /metrics view reads them.
"""

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

STATE_REGISTRY = CollectorRegistry(auto_describe=False)


def state_metrics_add(collector: Collector) -> None:
    STATE_REGISTRY.register(collector)
