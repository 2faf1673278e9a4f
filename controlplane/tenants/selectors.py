from datetime import UTC, datetime
from typing import Any

from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour, TruncMinute
from django.utils import timezone

from controlplane.core import access
from controlplane.core.credentials import secret_hash
from controlplane.core.errors import NotFound
from controlplane.tenants.models import ApiKey, Tenant, UsageRecord


def api_key_authenticate(raw_key: str) -> tuple[ApiKey, Tenant] | None:
    """The live key and its tenant for a raw key, or None (unknown, revoked, expired, inactive).

    The lookup is by SHA-256, so no raw key is compared byte by byte.
    """
    key = ApiKey.objects.select_related("tenant").filter(key_hash=secret_hash(raw_key)).first()
    if key is None:
        return None
    if key.revoked_at is not None:
        return None
    if key.expires_at is not None and key.expires_at <= timezone.now():
        return None
    if not key.tenant.is_active:
        return None
    return key, key.tenant


def tenant_list(*, user: Any) -> QuerySet[Tenant]:
    """The tenants this user may see: all for staff, their own for a tenant member."""
    tenants = Tenant.objects.prefetch_related("allowed_models")
    if access.is_staff_reader(user):
        return tenants
    own = access.tenant_for_user(user)
    if own is None:
        return tenants.none()
    return tenants.filter(pk=own.pk)


def tenant_get_visible(*, user: Any, tenant_id: int | str) -> Tenant:
    """The tenant, or NotFound when it does not exist or the user may not learn of it."""
    tenant = (
        tenant_list(user=user).filter(pk=tenant_id).first() if str(tenant_id).isdigit() else None
    )
    if tenant is None or not access.can_view_tenant(user, tenant):
        raise NotFound("No such tenant.")
    return tenant


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by")


GRANULARITIES = {"minute": TruncMinute, "hour": TruncHour, "day": TruncDay}


def usage_aggregate(
    *,
    tenant: Tenant,
    granularity: str,
    since: datetime | None = None,
    until: datetime | None = None,
    model_id: int | None = None,
    version_id: int | None = None,
) -> QuerySet:
    """Usage summed per bucket (minute, hour or day), model and version, newest bucket first."""
    records = UsageRecord.objects.filter(tenant=tenant)
    if since is not None:
        records = records.filter(minute__gte=since)
    if until is not None:
        records = records.filter(minute__lt=until)
    if model_id is not None:
        records = records.filter(version__model_id=model_id)
    if version_id is not None:
        records = records.filter(version_id=version_id)
    truncate = GRANULARITIES[granularity]
    return (
        records.annotate(
            bucket=truncate("minute", tzinfo=UTC),
            model_name=F("version__model__name"),
            version_label=F("version__label"),
        )
        .values("bucket", "version__model_id", "model_name", "version_id", "version_label")
        .annotate(
            requests=Sum("requests"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            errors=Sum("errors"),
            energy_joules=Sum("energy_joules"),
        )
        .order_by("-bucket", "model_name", "version_label")
    )
