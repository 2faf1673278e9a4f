"""Personal access tokens: created (shown once), stored hashed, listed, revoked; Bearer auth."""

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.models import AccessToken
from tests.api.support import assert_error, audit_count

pytestmark = pytest.mark.django_db


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_create_list_use_and_revoke_a_token(client_for, users) -> None:
    client = client_for("release_manager")
    response = client.post("/api/v1/tokens/", {"name": "ci"}, format="json")
    assert response.status_code == 201
    body = response.json()
    raw = body["token"]
    assert raw.startswith("cpt-") and len(raw) > 40
    assert body["prefix"] == raw[:12]
    stored = AccessToken.objects.get(pk=body["id"])
    assert stored.token_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert raw not in {stored.prefix, stored.token_hash, stored.name}

    listing = client.get("/api/v1/tokens/").json()
    assert listing["count"] == 1
    assert "token" not in listing["results"][0]

    me = bearer(raw).get("/api/v1/me/")
    assert me.status_code == 200
    assert me.json()["username"] == "release_manager"
    assert me.json()["role"] == "release_manager"
    stored.refresh_from_db()
    assert stored.last_used_at is not None

    revoked = client.post(f"/api/v1/tokens/{stored.pk}/revoke/", {}, format="json")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    assert_error(bearer(raw).get("/api/v1/me/"), 401, "authentication_failed")
    assert_error(
        client.post(f"/api/v1/tokens/{stored.pk}/revoke/", {}, format="json"),
        409,
        "already_revoked",
    )


def test_bad_expired_and_missing_tokens_are_401(users) -> None:
    response = bearer("cpt-not-a-token").get("/api/v1/me/")
    assert_error(response, 401, "authentication_failed")
    assert response["WWW-Authenticate"] == "Bearer"
    assert_error(APIClient().get("/api/v1/me/"), 401, "not_authenticated")

    token = AccessToken.objects.create(
        user=users["viewer"],
        name="old",
        prefix="cpt-expired",
        token_hash=hashlib.sha256(b"cpt-expired-raw").hexdigest(),
        expires_at=timezone.now() - timedelta(seconds=1),
    )
    assert_error(bearer("cpt-expired-raw").get("/api/v1/me/"), 401, "authentication_failed")
    token.expires_at = timezone.now() + timedelta(hours=1)
    token.save()
    assert bearer("cpt-expired-raw").get("/api/v1/me/").status_code == 200


def test_one_cannot_see_or_revoke_another_users_token(client_for, users) -> None:
    created = client_for("viewer").post("/api/v1/tokens/", {"name": "mine"}, format="json")
    token_id = created.json()["id"]
    other = client_for("on_call")
    assert other.get("/api/v1/tokens/").json()["count"] == 0
    before = audit_count()
    assert_error(
        other.post(f"/api/v1/tokens/{token_id}/revoke/", {}, format="json"), 404, "not_found"
    )
    assert AccessToken.objects.get(pk=token_id).revoked_at is None
    assert audit_count() == before


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"name": "x", "scope": "all"}, "unknown_fields"),
        ({"name": ["x"]}, "invalid"),
        ({}, "invalid"),
        ({"name": "x", "expires_at": "2000-01-01T00:00:00Z"}, "invalid_expiry"),
    ],
)
def test_bad_token_requests_change_nothing(client_for, body, code) -> None:
    before = audit_count()
    response = client_for("viewer").post("/api/v1/tokens/", body, format="json")
    assert_error(response, 400, code)
    assert AccessToken.objects.count() == 0
    assert audit_count() == before
