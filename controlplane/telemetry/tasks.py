"""Telemetry tasks for Celery beat."""

from celery import shared_task

from controlplane.telemetry import energy


@shared_task(name="telemetry.attribute_energy")
def attribute_energy() -> int:
    """Attribute settled fleet energy rollups to tenants by tokens (idempotent)."""
    return energy.energy_attribute_fleet_samples()
