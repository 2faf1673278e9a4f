"""Telemetry tasks for Celery beat."""

from celery import shared_task

from controlplane.telemetry import energy, retention


@shared_task(name="telemetry.attribute_energy")
def attribute_energy() -> int:
    """Attribute settled fleet energy rollups to tenants by tokens (idempotent)."""
    return energy.energy_attribute_fleet_samples()


@shared_task(name="telemetry.apply_retention")
def apply_retention() -> dict[str, int | bool]:
    """Delete prompt records and request samples past their tenant's retention (idempotent;
    batches of their own, a bounded run: what is left waits for the next run)."""
    result = retention.retention_apply()
    return {
        "prompt_records": result.prompt_records,
        "request_samples": result.request_samples,
        "is_complete": result.is_complete,
    }
