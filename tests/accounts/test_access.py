"""Every access function, for every role (and for a user without one, and for nobody)."""

import pytest
from django.contrib.auth.models import AnonymousUser

from controlplane.core import access
from controlplane.core.roles import Role

ALL = {"admin", "release_manager", "on_call", "viewer", "tenant_member", "agent", "no_role"}
STAFF = {"admin", "release_manager", "on_call", "viewer"}

# access function -> the principals it allows (user-only functions).
EXPECTED = {
    access.can_view_fleet: STAFF,
    access.can_command_agents: {"admin", "release_manager", "on_call"},
    access.can_register_agent: {"admin", "agent"},
    access.can_download_artifact: {"admin", "agent"},
    access.can_manage_versions: {"admin", "release_manager"},
    access.can_steer_rollouts: {"admin", "release_manager"},
    access.can_pause_or_rollback: {"admin", "release_manager", "on_call"},
    access.can_view_registry: STAFF,
    access.can_override_verification: {"admin"},
    access.can_manage_signing_keys: {"admin"},
    access.can_list_tenants: STAFF | {"tenant_member"},
    access.can_manage_tenants: {"admin"},
    access.can_manage_users: {"admin"},
    access.can_view_audit: STAFF | {"tenant_member"},
    access.can_manage_own_tokens: ALL,
}


@pytest.mark.django_db
@pytest.mark.parametrize("check", list(EXPECTED), ids=lambda check: check.__name__)
@pytest.mark.parametrize("principal", sorted(ALL))
def test_user_access_functions(users, check, principal) -> None:
    assert check(users[principal]) is (principal in EXPECTED[check])


@pytest.mark.parametrize("check", list(EXPECTED), ids=lambda check: check.__name__)
def test_anonymous_is_refused_everything(check) -> None:
    assert check(AnonymousUser()) is False


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("principal", "own", "other"),
    [
        ("admin", True, True),
        ("release_manager", True, True),
        ("on_call", True, True),
        ("viewer", True, True),
        ("tenant_member", True, False),
        ("agent", False, False),
        ("no_role", False, False),
    ],
)
def test_can_view_tenant(users, tenants, principal, own, other) -> None:
    assert access.can_view_tenant(users[principal], tenants["acme"]) is own
    assert access.can_view_tenant(users[principal], tenants["globex"]) is other


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("principal", "own", "other"),
    [
        ("admin", True, True),
        ("release_manager", False, False),
        ("on_call", False, False),
        ("viewer", False, False),
        ("tenant_member", True, False),
        ("agent", False, False),
        ("no_role", False, False),
    ],
)
def test_can_manage_api_keys(users, tenants, principal, own, other) -> None:
    assert access.can_manage_api_keys(users[principal], tenants["acme"]) is own
    assert access.can_manage_api_keys(users[principal], tenants["globex"]) is other


@pytest.mark.django_db
def test_role_of_and_tenant_for_user(users, tenants) -> None:
    assert access.role_of(AnonymousUser()) is None
    assert access.role_of(users["no_role"]) is None
    for role in Role:
        assert access.role_of(users[role.value]) is role
    assert access.tenant_for_user(users["tenant_member"]) == tenants["acme"]
    assert access.tenant_for_user(users["other_member"]) == tenants["globex"]
    assert access.tenant_for_user(users["admin"]) is None
    assert access.tenant_for_user(AnonymousUser()) is None


@pytest.mark.django_db
def test_a_superuser_without_membership_is_an_admin(django_user_model) -> None:
    root = django_user_model.objects.create_superuser("root", password="root-password-1")
    assert access.role_of(root) is Role.ADMIN
    assert access.can_override_verification(root)


@pytest.mark.django_db
def test_membership_requires_a_tenant_exactly_for_tenant_members(users, tenants) -> None:
    from django.db import IntegrityError, transaction

    from controlplane.accounts.models import Membership

    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.filter(user=users["viewer"]).update(tenant=tenants["acme"])
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.filter(user=users["tenant_member"]).update(tenant=None)
