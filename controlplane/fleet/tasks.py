"""Fleet tasks for Celery beat (ingest also prunes every minute; this covers an ingest-less
deployment)."""

from celery import shared_task

from controlplane.fleet import services


@shared_task(name="fleet.prune_samples")
def prune_samples() -> int:
    return services.agent_samples_prune()
