"""Tenants, their API keys and usage; a tenant member never learns of another tenant."""

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.tenants.models import ApiKey, Tenant, UsageRecord
from controlplane.tenants.selectors import api_key_authenticate
from tests.api.support import assert_error, audit_count

pytestmark = pytest.mark.django_db


def test_admin_creates_and_updates_a_tenant(client_for, chat_model) -> None:
    admin = client_for("admin")
    created = admin.post(
        "/api/v1/tenants/",
        {
            "slug": "initech",
            "name": "Initech",
            "requests_per_minute": 60,
            "allowed_models": ["smol"],
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["prompt_logging"] == "off"
    assert body["retention_days"] == 30
    assert body["allowed_models"] == ["smol"]
    updated = admin.patch(
        f"/api/v1/tenants/{body['id']}/",
        {"tokens_per_minute": 5000, "prompt_logging": "full", "reason": "contract"},
        format="json",
    )
    assert updated.status_code == 200
    assert updated.json()["tokens_per_minute"] == 5000
    event = AuditEvent.objects.get(action="tenant.update")
    assert event.before["prompt_logging"] == "off"
    assert event.after["prompt_logging"] == "full"
    assert event.reason == "contract"
    assert event.tenant_id == body["id"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"slug": "x", "name": "X", "requests_per_minute": "many"}, "invalid"),
        ({"slug": "x", "name": "X", "retention_days": 0}, "invalid"),
        ({"slug": "x", "name": "X", "prompt_logging": "sometimes"}, "invalid"),
        ({"slug": "x", "name": "X", "allowed_models": ["nope"]}, "invalid"),
        ({"slug": "x", "name": "X", "owner": "me"}, "unknown_fields"),
        ({"slug": "acme", "name": "Again"}, "tenant_exists"),
    ],
)
def test_bad_tenant_input_changes_nothing(client_for, tenants, body, code) -> None:
    before = audit_count()
    response = client_for("admin").post("/api/v1/tenants/", body, format="json")
    assert_error(response, 409 if code == "tenant_exists" else 400, code)
    assert Tenant.objects.count() == 2
    assert audit_count() == before


def test_tenant_member_sees_only_their_tenant(client_for, tenants) -> None:
    member = client_for("tenant_member")
    listing = member.get("/api/v1/tenants/").json()
    assert [row["slug"] for row in listing["results"]] == ["acme"]
    assert member.get(f"/api/v1/tenants/{tenants['acme'].pk}/").status_code == 200
    globex = tenants["globex"].pk
    for url in (
        f"/api/v1/tenants/{globex}/",
        f"/api/v1/tenants/{globex}/api-keys/",
        f"/api/v1/tenants/{globex}/usage/",
        "/api/v1/tenants/999999/",
        "/api/v1/tenants/not-a-number/",
    ):
        assert_error(member.get(url), 404, "not_found")
    # Writing to another tenant is 404 too, not 403.
    before = audit_count()
    assert_error(
        member.post(f"/api/v1/tenants/{globex}/api-keys/", {"name": "x"}, format="json"),
        404,
        "not_found",
    )
    assert_error(
        member.patch(f"/api/v1/tenants/{globex}/", {"name": "x"}, format="json"), 404, "not_found"
    )
    # Their own tenant is visible but not theirs to reconfigure.
    assert_error(
        member.patch(f"/api/v1/tenants/{tenants['acme'].pk}/", {"name": "x"}, format="json"),
        403,
        "permission_denied",
    )
    assert ApiKey.objects.count() == 0
    assert audit_count() == before


def test_api_key_is_shown_once_stored_hashed_and_revocable(client_for, tenants) -> None:
    member = client_for("tenant_member")
    acme = tenants["acme"]
    created = member.post(
        f"/api/v1/tenants/{acme.pk}/api-keys/", {"name": "prod", "scopes": ["chat"]}, format="json"
    )
    assert created.status_code == 201, created.content
    raw = created.json()["key"]
    assert raw.startswith("sk-")
    assert len(raw) >= 3 + 43  # 32 random bytes in URL-safe base64
    key = ApiKey.objects.get(pk=created.json()["id"])
    assert key.key_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert key.prefix == raw[:11]
    assert key.scopes == ["chat"]

    listing = member.get(f"/api/v1/tenants/{acme.pk}/api-keys/").json()
    assert listing["count"] == 1
    assert "key" not in listing["results"][0]

    assert api_key_authenticate(raw) == (key, acme)
    assert api_key_authenticate(raw + "x") is None
    assert api_key_authenticate("") is None

    revoked = member.post(
        f"/api/v1/tenants/{acme.pk}/api-keys/{key.pk}/revoke/", {"reason": "leaked"}, format="json"
    )
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    assert api_key_authenticate(raw) is None
    event = AuditEvent.objects.get(action="api_key.revoke")
    assert event.tenant_id == acme.pk
    assert event.reason == "leaked"


def test_expired_keys_and_inactive_tenants_do_not_authenticate(tenants) -> None:
    from controlplane.tenants.services import api_key_create

    acme = tenants["acme"]
    created = api_key_create(
        actor=None, tenant=acme, name="k", expires_at=timezone.now() + timedelta(hours=1)
    )
    assert api_key_authenticate(created.raw_key) is not None
    ApiKey.objects.filter(pk=created.key.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert api_key_authenticate(created.raw_key) is None
    other = api_key_create(actor=None, tenant=acme, name="k2")
    Tenant.objects.filter(pk=acme.pk).update(is_active=False)
    assert api_key_authenticate(other.raw_key) is None


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"name": "k", "scopes": ["admin"]}, "invalid"),
        ({"name": "k", "scopes": []}, "invalid"),
        ({"name": "k", "scopes": "chat"}, "invalid"),
        ({"name": "k", "expires_at": "yesterday"}, "invalid"),
        ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "invalid_expiry"),
        ({"name": "k", "tenant": 2}, "unknown_fields"),
        ({"name": 7}, "invalid"),
    ],
)
def test_bad_api_key_requests_change_nothing(client_for, tenants, body, code) -> None:
    before = audit_count()
    response = client_for("admin").post(
        f"/api/v1/tenants/{tenants['acme'].pk}/api-keys/", body, format="json"
    )
    assert_error(response, 400, code)
    assert ApiKey.objects.count() == 0
    assert audit_count() == before


def test_usage_is_aggregated_per_hour_and_day(client_for, tenants, make_version) -> None:
    fp32 = make_version("fp32")
    bf16 = make_version("bf16", dtype="bfloat16")
    acme, globex = tenants["acme"], tenants["globex"]
    base = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)
    rows = [
        (acme, fp32, base, 10, 100, 50, 1, 2.0),
        (acme, fp32, base + timedelta(minutes=1), 5, 50, 25, 0, 1.0),
        (acme, bf16, base + timedelta(minutes=2), 3, 30, 15, 0, 0.5),
        (acme, fp32, base + timedelta(hours=1), 1, 10, 5, 0, 0.25),
        (globex, fp32, base, 100, 1000, 500, 9, 20.0),
    ]
    for tenant, version, minute, requests, prompt, completion, errors, joules in rows:
        UsageRecord.objects.create(
            tenant=tenant,
            version=version,
            minute=minute,
            requests=requests,
            prompt_tokens=prompt,
            completion_tokens=completion,
            errors=errors,
            energy_joules=joules,
        )
    with pytest.raises(IntegrityError), transaction.atomic():
        UsageRecord.objects.create(tenant=acme, version=fp32, minute=base)

    member = client_for("tenant_member")
    hourly = member.get(f"/api/v1/tenants/{acme.pk}/usage/", {"granularity": "hour"}).json()
    assert hourly["count"] == 3
    first, second, third = hourly["results"]
    assert (first["bucket"], first["version_label"], first["requests"]) == (
        "2026-03-01T11:00:00Z",
        "fp32",
        1,
    )
    assert (second["version_label"], second["requests"], second["energy_joules"]) == (
        "bf16",
        3,
        0.5,
    )
    assert (third["version_label"], third["requests"], third["prompt_tokens"], third["errors"]) == (
        "fp32",
        15,
        150,
        1,
    )
    assert third["model_name"] == "smol"

    daily = member.get(
        f"/api/v1/tenants/{acme.pk}/usage/", {"granularity": "day", "version": fp32.pk}
    ).json()
    assert daily["count"] == 1
    assert daily["results"][0]["bucket"] == "2026-03-01T00:00:00Z"
    assert daily["results"][0]["requests"] == 16
    assert daily["results"][0]["completion_tokens"] == 80

    windowed = member.get(
        f"/api/v1/tenants/{acme.pk}/usage/", {"since": "2026-03-01T11:00:00Z", "granularity": "day"}
    ).json()
    assert windowed["results"][0]["requests"] == 1

    assert_error(
        member.get(f"/api/v1/tenants/{acme.pk}/usage/", {"granularity": "week"}), 400, "invalid"
    )
    assert_error(
        member.get(f"/api/v1/tenants/{acme.pk}/usage/", {"colour": "red"}), 400, "unknown_fields"
    )
