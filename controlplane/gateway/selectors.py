"""Reads for the gateway: the grant of an API key."""

from dataclasses import dataclass

from controlplane.tenants.models import PromptLogging
from controlplane.tenants.selectors import api_key_authenticate


@dataclass(slots=True, frozen=True)
class KeyGrant:
    """What the gateway needs to know about a live API key, cached in memory."""

    key_id: int
    tenant_id: int
    tenant_slug: str
    requests_per_minute: int
    tokens_per_minute: int
    allowed_models: frozenset[str]
    scopes: frozenset[str]
    is_prompt_logging: bool
    expires_at: float | None  # unix time


def key_grant_for_raw_key(raw_key: str) -> KeyGrant | None:
    """The grant of a live key, or None (unknown, revoked, expired, inactive tenant)."""
    found = api_key_authenticate(raw_key)
    if found is None:
        return None
    key, tenant = found
    return KeyGrant(
        key_id=key.pk,
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        allowed_models=frozenset(tenant.allowed_models.values_list("name", flat=True)),
        scopes=frozenset(key.scopes or ()),
        is_prompt_logging=tenant.prompt_logging == PromptLogging.FULL,
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
    )
