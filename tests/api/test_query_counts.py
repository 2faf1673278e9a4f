"""Every list endpoint runs the same number of queries for 1 row as for 20."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.accounts.services import access_token_create, user_create
from controlplane.audit.services import audit_event_record
from controlplane.registry import services as registry_services
from controlplane.registry.models import EvalSuite, Evaluation, Model, SigningKey
from controlplane.tenants.models import Tenant, UsageRecord
from controlplane.tenants.services import api_key_create
from tests.api.support import Signer, gguf_bytes, sha256_hex


def add_models(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        Model.objects.create(name=f"m{index}", task="chat")


def add_versions(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        version = world["make_version"](f"v{index}")
        if index % 2:
            version.signing_key = world["key"]
            version.base_version = world["base"]
            version.save()


def add_artifacts(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        data = gguf_bytes(f"artifact {index}".encode())
        registry_services.artifact_store(
            actor=world["user"], chunks=[data], declared_digest=sha256_hex(data)
        )


def add_signing_keys(world, start: int, count: int) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for index in range(start, start + count):
        signer = Signer(f"k{index}", Ed25519PrivateKey.generate())
        SigningKey.objects.create(
            key_id=signer.key_id, public_key=signer.public_key_b64, created_by=world["user"]
        )


def add_suites(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        EvalSuite.objects.create(name=f"s{index}", kind="quality", dataset="d", metrics=[])


def add_evaluations(world, start: int, count: int) -> None:
    suite = EvalSuite.objects.get_or_create(name="suite", kind="quality", dataset="d", metrics=[])[
        0
    ]
    for _ in range(count):
        Evaluation.objects.create(
            version=world["base"],
            suite=suite,
            baseline_version=world["base"],
            metrics={},
            passed=True,
            created_by=world["user"],
        )


def add_tenants(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        tenant = Tenant.objects.create(slug=f"t{index}", name="T")
        tenant.allowed_models.set([world["base"].model])


def add_api_keys(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        api_key_create(actor=world["user"], tenant=world["tenant"], name=f"k{index}")


def add_usage(world, start: int, count: int) -> None:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for index in range(start, start + count):
        UsageRecord.objects.create(
            tenant=world["tenant"],
            version=world["base"],
            minute=base + timedelta(hours=index),
            requests=1,
        )


def add_audit_events(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        audit_event_record(actor=world["user"], action="x.y", object_type="x", object_id=index)


def add_users(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        user_create(
            actor=None,
            username=f"u{index}",
            password=None,
            role="tenant_member",
            tenant=world["tenant"],
        )


def add_tokens(world, start: int, count: int) -> None:
    for index in range(start, start + count):
        access_token_create(user=world["user"], name=f"t{index}")


LISTS = {
    "/api/v1/models/": add_models,
    "/api/v1/versions/": add_versions,
    "/api/v1/artifacts/": add_artifacts,
    "/api/v1/signing-keys/": add_signing_keys,
    "/api/v1/eval-suites/": add_suites,
    "/api/v1/evaluations/": add_evaluations,
    "/api/v1/tenants/": add_tenants,
    "/api/v1/tenants/{tenant}/api-keys/": add_api_keys,
    "/api/v1/tenants/{tenant}/usage/": add_usage,
    "/api/v1/audit-events/": add_audit_events,
    "/api/v1/users/": add_users,
    "/api/v1/tokens/": add_tokens,
}


@pytest.mark.django_db
@pytest.mark.parametrize("path", list(LISTS))
def test_list_queries_do_not_grow_with_rows(
    client_for, users, tenants, make_version, signer, path, django_assert_max_num_queries
) -> None:
    world: dict[str, Any] = {
        "make_version": make_version,
        "user": users["admin"],
        "tenant": tenants["acme"],
        "base": make_version("base"),
        "key": SigningKey.objects.get(key_id=signer.key_id),
    }
    url = path.format(tenant=tenants["acme"].pk)
    client = client_for("admin")
    LISTS[path](world, 0, 1)
    with CaptureQueriesContext(connection) as one_row:
        response = client.get(url)
    assert response.status_code == 200
    rows_at_one = response.json()["count"]
    LISTS[path](world, 1, 19)
    with django_assert_max_num_queries(len(one_row.captured_queries)):
        response = client.get(url)
    assert response.status_code == 200
    assert response.json()["count"] == rows_at_one + 19
