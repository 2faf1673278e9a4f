"""Every permission decision, in small functions with one condition per line.

Views and services call these; nothing else checks a role. A user without a membership
has no role (superusers are admins) and may do nothing but manage their own tokens.
"""

from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.db.models import Model

from controlplane.core.roles import Role

STAFF_ROLES = frozenset({Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL, Role.VIEWER})


def role_of(user: Any) -> Role | None:
    if user is None or not user.is_authenticated:
        return None
    if user.is_superuser:
        return Role.ADMIN
    try:
        membership = user.membership  # cached on the user instance after the first access
    except ObjectDoesNotExist:
        return None
    return Role(membership.role)


def tenant_for_user(user: Any) -> Model | None:
    """The tenant (a tenants.Tenant) a tenant member belongs to; None for every other role."""
    if role_of(user) != Role.TENANT_MEMBER:
        return None
    return user.membership.tenant


def is_admin(user: Any) -> bool:
    return role_of(user) == Role.ADMIN


def is_staff_reader(user: Any) -> bool:
    """Admins, release managers, on-call and viewers read everything that is not a secret."""
    return role_of(user) in STAFF_ROLES


# Fleet and rollouts.


def can_view_fleet(user: Any) -> bool:
    return is_staff_reader(user)


def can_command_agents(user: Any) -> bool:
    return role_of(user) in {Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL}


def can_enrol_agents(user: Any) -> bool:
    return is_admin(user)


def can_register_agent(user: Any) -> bool:
    return role_of(user) in {Role.ADMIN, Role.AGENT}


def can_steer_rollouts(user: Any) -> bool:
    return role_of(user) in {Role.ADMIN, Role.RELEASE_MANAGER}


def can_pause_or_rollback(user: Any) -> bool:
    return role_of(user) in {Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL}


def can_undo_deployment(user: Any) -> bool:
    """Put a deployment's previous stable version back (no rollout, no gate)."""
    return role_of(user) in {Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL}


# Registry.


def can_view_registry(user: Any) -> bool:
    return is_staff_reader(user)


def can_manage_versions(user: Any) -> bool:
    """Register models, versions, artifacts and evaluations; verify by signature; approve."""
    return role_of(user) in {Role.ADMIN, Role.RELEASE_MANAGER}


def can_override_verification(user: Any) -> bool:
    return is_admin(user)


def can_manage_signing_keys(user: Any) -> bool:
    return is_admin(user)


def can_download_artifact(user: Any) -> bool:
    return role_of(user) in {Role.ADMIN, Role.AGENT}


# Tenants.


def can_list_tenants(user: Any) -> bool:
    """Staff see every tenant; a tenant member sees their own (see tenants selectors)."""
    return is_staff_reader(user) or role_of(user) == Role.TENANT_MEMBER


def can_manage_tenants(user: Any) -> bool:
    return is_admin(user)


def can_view_tenant(user: Any, tenant: Model) -> bool:
    if is_staff_reader(user):
        return True
    own_tenant = tenant_for_user(user)
    return own_tenant is not None and own_tenant.pk == tenant.pk


def can_manage_api_keys(user: Any, tenant: Model) -> bool:
    if is_admin(user):
        return True
    own_tenant = tenant_for_user(user)
    return own_tenant is not None and own_tenant.pk == tenant.pk


# Accounts and audit.


def can_manage_users(user: Any) -> bool:
    return is_admin(user)


def can_view_audit(user: Any) -> bool:
    """Staff see every event; a tenant member sees their tenant's (see audit selectors)."""
    return is_staff_reader(user) or role_of(user) == Role.TENANT_MEMBER


def can_manage_own_tokens(user: Any) -> bool:
    return user is not None and user.is_authenticated
