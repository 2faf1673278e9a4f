"""Gateway tasks for Celery beat."""

from celery import shared_task

from controlplane.gateway import services


@shared_task(name="gateway.attribute_energy")
def attribute_energy() -> int:
    """Attribute settled fleet energy rollups to tenants by tokens (idempotent)."""
    return services.energy_attribute_fleet_samples()
