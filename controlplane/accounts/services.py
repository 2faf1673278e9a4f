from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from controlplane.accounts.models import AccessToken, Membership
from controlplane.audit.services import Actor, audit_event_record
from controlplane.core.credentials import secret_issue
from controlplane.core.errors import Conflict, DomainError
from controlplane.core.events import publish_access_changed_after_commit
from controlplane.core.roles import Role
from controlplane.tenants.models import Tenant

ACCESS_TOKEN_PREFIX = "cpt-"  # noqa: S105 - a visible prefix, not a secret


@dataclass(frozen=True, slots=True)
class CreatedAccessToken:
    token: AccessToken
    raw_token: str  # shown once, never stored


@transaction.atomic
def access_token_create(
    *,
    user: Any,
    name: str,
    expires_at: datetime | None = None,
    raw_token: str | None = None,
) -> CreatedAccessToken:
    """A new personal token. `raw_token` is for the demo seed only (reproducible credentials)."""
    if expires_at is not None and expires_at <= timezone.now():
        raise DomainError("invalid_expiry", "The expiry must be in the future.")
    secret = secret_issue(prefix=ACCESS_TOKEN_PREFIX, raw=raw_token)
    token = AccessToken.objects.create(
        user=user,
        name=name,
        prefix=secret.visible_prefix,
        token_hash=secret.hash,
        expires_at=expires_at,
    )
    audit_event_record(
        actor=user,
        action="access_token.create",
        object_type="access_token",
        object_id=token.pk,
        object_repr=f"{user.get_username()}/{name}",
        after={"name": name, "prefix": token.prefix},
    )
    return CreatedAccessToken(token=token, raw_token=secret.raw)


@transaction.atomic
def access_token_revoke(*, actor: Actor, token: AccessToken) -> AccessToken:
    token = AccessToken.objects.select_for_update().get(pk=token.pk)
    if token.revoked_at is not None:
        raise Conflict("already_revoked", "This token is already revoked.")
    token.revoked_at = timezone.now()
    token.save(update_fields=["revoked_at"])
    audit_event_record(
        actor=actor,
        action="access_token.revoke",
        object_type="access_token",
        object_id=token.pk,
        object_repr=f"{token.prefix}…",
        before={"revoked_at": None},
        after={"revoked_at": token.revoked_at.isoformat()},
    )
    return token


def _check_role_and_tenant(role: str, tenant: Tenant | None) -> None:
    if role not in Role.values:
        raise DomainError("invalid_role", f"Unknown role {role!r}.", fields={"role": [role]})
    if role == Role.TENANT_MEMBER and tenant is None:
        raise DomainError(
            "tenant_required", "A tenant member needs a tenant.", fields={"tenant": ["Required."]}
        )
    if role != Role.TENANT_MEMBER and tenant is not None:
        raise DomainError(
            "tenant_not_allowed",
            "Only tenant members belong to a tenant.",
            fields={"tenant": ["Must be empty for this role."]},
        )


@transaction.atomic
def user_create(
    *,
    actor: Actor,
    username: str,
    password: str | None,
    role: str,
    tenant: Tenant | None = None,
    email: str = "",
) -> Any:
    """A user with one role. A password of None makes a service account (tokens only)."""
    _check_role_and_tenant(role, tenant)
    user_model = get_user_model()
    if user_model.objects.filter(username=username).exists():
        raise Conflict("user_exists", f"A user named {username!r} exists.")
    user = user_model.objects.create_user(username=username, password=password, email=email)
    Membership.objects.create(user=user, role=role, tenant=tenant)
    audit_event_record(
        actor=actor,
        action="user.create",
        object_type="user",
        object_id=user.pk,
        object_repr=username,
        after={"role": role, "tenant": tenant.slug if tenant else None},
        tenant_id=tenant.pk if tenant else None,
    )
    return user


@transaction.atomic
def membership_set(
    *, actor: Actor, user: Any, role: str, tenant: Tenant | None = None, reason: str = ""
) -> Membership:
    """Give a user a role (replacing the one they had)."""
    _check_role_and_tenant(role, tenant)
    membership = Membership.objects.select_for_update().filter(user=user).first()
    before = (
        {"role": membership.role, "tenant": membership.tenant.slug if membership.tenant else None}
        if membership
        else {}
    )
    if membership is None:
        membership = Membership.objects.create(user=user, role=role, tenant=tenant)
    else:
        membership.role = role
        membership.tenant = tenant
        membership.save(update_fields=["role", "tenant"])
    after = {"role": role, "tenant": tenant.slug if tenant else None}
    if before != after:
        audit_event_record(
            actor=actor,
            action="user.set_role",
            object_type="user",
            object_id=user.pk,
            object_repr=user.get_username(),
            before=before,
            after=after,
            reason=reason,
            tenant_id=tenant.pk if tenant else None,
        )
        # The user's open dashboard sockets leave the groups the old role could see.
        publish_access_changed_after_commit(user.pk)
    if hasattr(user, "_state"):
        user.membership = membership
    return membership
