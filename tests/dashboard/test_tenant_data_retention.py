"""A tenant's own page states how long its prompts and request samples are kept and
whether its prompts are logged, as the policy says now."""

import re

import pytest

from controlplane.core.roles import Role
from controlplane.tenants.models import Tenant

pytestmark = pytest.mark.django_db


def _policy_line(html: str) -> str:
    match = re.search(r'<p class="muted" id="data-retention">(.*?)</p>', html)
    assert match is not None, "no retention line on the page"
    return match.group(1)


def test_tenant_member_sees_their_tenants_retention_and_prompt_logging(world, client_for) -> None:
    member = client_for(Role.TENANT_MEMBER)
    page = member.get(f"/tenants/{world.acme.pk}/")
    assert page.status_code == 200
    assert _policy_line(page.content.decode()) == (
        "Prompts and request samples are kept 30 days. "
        "Prompt logging is off: prompts and completions are not stored."
    )

    # An admin changes the policy through the REST API; the page says the new one.
    changed = client_for(Role.ADMIN).patch(
        f"/api/v1/tenants/{world.acme.pk}/",
        {"prompt_logging": "full", "retention_days": 1},
        content_type="application/json",
    )
    assert changed.status_code == 200
    page = member.get(f"/tenants/{world.acme.pk}/")
    assert _policy_line(page.content.decode()) == (
        "Prompts and request samples are kept 1 day. "
        "Prompt logging is on: prompts and completions are stored."
    )


def test_a_refused_retention_changes_neither_the_tenant_nor_the_page(world, client_for) -> None:
    refused = client_for(Role.ADMIN).patch(
        f"/api/v1/tenants/{world.acme.pk}/",
        {"retention_days": 0},
        content_type="application/json",
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid"
    assert refused.json()["error"]["fields"] == {
        "retention_days": ["Ensure this value is greater than or equal to 1."]
    }
    assert Tenant.objects.get(pk=world.acme.pk).retention_days == 30
    page = client_for(Role.TENANT_MEMBER).get(f"/tenants/{world.acme.pk}/")
    assert _policy_line(page.content.decode()).startswith(
        "Prompts and request samples are kept 30 days."
    )
