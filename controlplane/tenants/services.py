import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core.credentials import secret_issue
from controlplane.core.errors import Conflict, DomainError
from controlplane.core.redis_clients import redis_client
from controlplane.registry.models import Model
from controlplane.tenants.models import ApiKey, ApiKeyScope, PromptLogging, Tenant

logger = logging.getLogger(__name__)

API_KEY_PREFIX = "sk-"
# Gateways cache key grants and limits; a message here makes them forget a tenant's
# ("tenant:<id>") or everyone's ("all") at once.
INVALIDATE_CHANNEL = "gateway:invalidate"

TENANT_FIELDS = (
    "name",
    "requests_per_minute",
    "tokens_per_minute",
    "prompt_logging",
    "retention_days",
    "is_active",
)


def _gateway_forget_tenant(tenant_id: int) -> None:
    """After commit: gateways drop cached keys and limits of this tenant at once.

    Without it a change still takes effect when the gateway's cache entry expires.
    """

    def announce() -> None:
        client = redis_client()
        try:
            client.publish(INVALIDATE_CHANNEL, f"tenant:{tenant_id}")
        except redis.RedisError:
            logger.warning("gateway cache invalidation not sent", extra={"tenant": tenant_id})
        finally:
            client.close()

    transaction.on_commit(announce)


def _tenant_snapshot(tenant: Tenant) -> dict[str, Any]:
    return {
        **tenant.snapshot(),
        "allowed_models": sorted(model.name for model in tenant.allowed_models.all()),
    }


@transaction.atomic
def tenant_create(
    *,
    actor: Actor,
    slug: str,
    name: str,
    requests_per_minute: int = 600,
    tokens_per_minute: int = 100_000,
    allowed_models: list[Model] | None = None,
    prompt_logging: str = PromptLogging.OFF,
    retention_days: int = 30,
) -> Tenant:
    if Tenant.objects.filter(slug=slug).exists():
        raise Conflict("tenant_exists", f"A tenant named {slug!r} exists.", fields={"slug": [slug]})
    tenant = Tenant.objects.create(
        slug=slug,
        name=name,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        prompt_logging=prompt_logging,
        retention_days=retention_days,
    )
    if allowed_models:
        tenant.allowed_models.set(allowed_models)
    audit_event_record(
        actor=actor,
        action="tenant.create",
        object_type="tenant",
        object_id=tenant.pk,
        object_repr=tenant.slug,
        after=_tenant_snapshot(tenant),
        tenant_id=tenant.pk,
    )
    return tenant


@transaction.atomic
def tenant_update(
    *,
    actor: Actor,
    tenant: Tenant,
    allowed_models: list[Model] | None = None,
    reason: str = "",
    **changes: Any,
) -> Tenant:
    """Change limits, policy, allowed models or the active flag; audited with before and after."""
    unknown = set(changes) - set(TENANT_FIELDS)
    if unknown:
        raise DomainError("invalid", f"Tenants have no field {sorted(unknown)}.")
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    before = _tenant_snapshot(tenant)
    for field, value in changes.items():
        setattr(tenant, field, value)
    if changes:
        tenant.save(update_fields=[*changes, "updated_at"])
    if allowed_models is not None:
        tenant.allowed_models.set(allowed_models)
    after = _tenant_snapshot(tenant)
    if after != before:
        audit_event_record(
            actor=actor,
            action="tenant.update",
            object_type="tenant",
            object_id=tenant.pk,
            object_repr=tenant.slug,
            before=before,
            after=after,
            reason=reason,
            tenant_id=tenant.pk,
        )
    _gateway_forget_tenant(tenant.pk)
    return tenant


@dataclass(frozen=True, slots=True)
class CreatedApiKey:
    key: ApiKey
    raw_key: str  # shown once, never stored


@transaction.atomic
def api_key_create(
    *,
    actor: Actor,
    tenant: Tenant,
    name: str,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    raw_key: str | None = None,
) -> CreatedApiKey:
    """A new key for the tenant. `raw_key` is for the demo seed only (reproducible credentials)."""
    scopes = sorted(set(scopes)) if scopes is not None else sorted(ApiKeyScope.values)
    if not scopes or not set(scopes) <= set(ApiKeyScope.values):
        raise DomainError(
            "invalid_scopes",
            f"Scopes must be a non-empty subset of {sorted(ApiKeyScope.values)}.",
            fields={"scopes": scopes},
        )
    if expires_at is not None and expires_at <= timezone.now():
        raise DomainError("invalid_expiry", "The expiry must be in the future.")
    secret = secret_issue(prefix=API_KEY_PREFIX, raw=raw_key)
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=secret.visible_prefix,
        key_hash=secret.hash,
        scopes=scopes,
        expires_at=expires_at,
        created_by=acting_user(actor),
    )
    audit_event_record(
        actor=actor,
        action="api_key.create",
        object_type="api_key",
        object_id=key.pk,
        object_repr=f"{tenant.slug}/{key.name}",
        after=key.snapshot(),
        tenant_id=tenant.pk,
    )
    return CreatedApiKey(key=key, raw_key=secret.raw)


@transaction.atomic
def api_key_revoke(*, actor: Actor, key: ApiKey, reason: str = "") -> ApiKey:
    key = ApiKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is not None:
        raise Conflict("already_revoked", "This key is already revoked.")
    before = key.snapshot()
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at"])
    audit_event_record(
        actor=actor,
        action="api_key.revoke",
        object_type="api_key",
        object_id=key.pk,
        object_repr=f"{key.prefix}…",
        before=before,
        after=key.snapshot(),
        reason=reason,
        tenant_id=key.tenant_id,
    )
    _gateway_forget_tenant(key.tenant_id)
    return key


def api_key_touch(*, key_id: int, used_at: datetime) -> bool:
    """Record that the key was used at `used_at`; False when it already has a later use.

    The gateway calls this off its request path, at most once a minute per key and
    gateway process. The time only moves forward, so gateways may write in any order.
    """
    updated = (
        ApiKey.objects.filter(pk=key_id)
        .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=used_at))
        .update(last_used_at=used_at)
    )
    return updated == 1
