"""Every role against every action of the API: allowed ones succeed, the rest are refused
(401 for nobody, 403 for a role without the right, 404 where the object belongs to another
tenant) and leave no trace in the database.
"""

import io
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from controlplane.accounts.models import AccessToken
from controlplane.audit.models import AuditEvent
from controlplane.registry import services as registry_services
from controlplane.registry.models import EvalSuite, Model, ModelVersion, SigningKey
from controlplane.tenants.models import ApiKey, Tenant
from tests.api.support import (
    PRINCIPALS,
    SERVING_CONFIG,
    embedding_folder,
    gguf_bytes,
    sha256_hex,
    tar_bytes,
)

STAFF = {"admin", "release_manager", "on_call", "viewer"}
EVERYONE = {*STAFF, "tenant_member", "agent", "no_role"}
MANAGERS = {"admin", "release_manager"}


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str  # formatted with the world's ids
    allowed: set[str]
    body: Any = None  # a dict, or a callable of the world
    success: int = 200
    hidden_from: set[str] = field(default_factory=set)  # answered 404, not 403

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("me", "get", "/api/v1/me/", EVERYONE),
    Case("list tokens", "get", "/api/v1/tokens/", EVERYONE),
    Case("create token", "post", "/api/v1/tokens/", EVERYONE, {"name": "t"}, 201),
    Case("list users", "get", "/api/v1/users/", {"admin"}),
    Case(
        "create user",
        "post",
        "/api/v1/users/",
        {"admin"},
        {"username": "newbie", "role": "viewer", "password": "a-long-password-1"},
        201,
    ),
    Case("set role", "post", "/api/v1/users/{viewer}/role/", {"admin"}, {"role": "on_call"}),
    Case("list models", "get", "/api/v1/models/", STAFF),
    Case("create model", "post", "/api/v1/models/", MANAGERS, {"name": "new", "task": "chat"}, 201),
    Case("list versions", "get", "/api/v1/versions/", STAFF),
    Case("read version", "get", "/api/v1/versions/{version}/", STAFF),
    Case(
        "register version",
        "post",
        "/api/v1/versions/",
        MANAGERS,
        lambda w: {
            "model": w["model"],
            "label": "v2",
            "artifact_digest": w["digest"],
            "serving_config": SERVING_CONFIG,
        },
        201,
    ),
    Case(
        "verify version",
        "post",
        "/api/v1/versions/{version}/verify/",
        MANAGERS,
        lambda w: {"key_id": "release-key", "signature": w["signature"]},
    ),
    Case(
        "override verification",
        "post",
        "/api/v1/versions/{version}/override-verification/",
        {"admin"},
        {"reason": "offline check"},
    ),
    Case(
        "revoke version", "post", "/api/v1/versions/{version}/revoke/", MANAGERS, {"reason": "bad"}
    ),
    Case("list artifacts", "get", "/api/v1/artifacts/", STAFF),
    Case("download artifact", "get", "/api/v1/artifacts/{digest}", {"admin", "agent"}),
    Case("upload artifact", "put", "/api/v1/artifacts/{new_digest}", MANAGERS, "bytes", 201),
    Case("upload folder", "post", "/api/v1/artifacts/folders/", MANAGERS, "tar", 201),
    Case(
        "download folder file",
        "get",
        "/api/v1/artifacts/{folder}/files/{folder_file}",
        {"admin", "agent"},
    ),
    Case("list signing keys", "get", "/api/v1/signing-keys/", STAFF),
    Case(
        "create signing key",
        "post",
        "/api/v1/signing-keys/",
        {"admin"},
        lambda w: {"key_id": "another", "public_key": w["public_key"]},
        201,
    ),
    Case(
        "distrust signing key",
        "post",
        "/api/v1/signing-keys/{key}/trust/",
        {"admin"},
        {"is_trusted": False},
    ),
    Case("list eval suites", "get", "/api/v1/eval-suites/", STAFF),
    Case(
        "create eval suite",
        "post",
        "/api/v1/eval-suites/",
        MANAGERS,
        {
            "name": "lat",
            "kind": "latency",
            "dataset": "d",
            "metrics": [{"name": "p95", "threshold": 1}],
        },
        201,
    ),
    Case("list evaluations", "get", "/api/v1/evaluations/", STAFF),
    Case("list tenants", "get", "/api/v1/tenants/", {*STAFF, "tenant_member"}),
    Case("read own tenant", "get", "/api/v1/tenants/{acme}/", {*STAFF, "tenant_member"}),
    Case(
        "read other tenant",
        "get",
        "/api/v1/tenants/{globex}/",
        STAFF,
        hidden_from={"tenant_member"},
    ),
    Case(
        "create tenant",
        "post",
        "/api/v1/tenants/",
        {"admin"},
        {"slug": "initech", "name": "Initech"},
        201,
    ),
    Case(
        "update own tenant",
        "patch",
        "/api/v1/tenants/{acme}/",
        {"admin"},
        {"requests_per_minute": 5},
    ),
    Case(
        "update other tenant",
        "patch",
        "/api/v1/tenants/{globex}/",
        {"admin"},
        {"requests_per_minute": 5},
        hidden_from={"tenant_member"},
    ),
    Case("list own keys", "get", "/api/v1/tenants/{acme}/api-keys/", {*STAFF, "tenant_member"}),
    Case(
        "list other keys",
        "get",
        "/api/v1/tenants/{globex}/api-keys/",
        STAFF,
        hidden_from={"tenant_member"},
    ),
    Case(
        "create own key",
        "post",
        "/api/v1/tenants/{acme}/api-keys/",
        {"admin", "tenant_member"},
        {"name": "k"},
        201,
    ),
    Case(
        "create other key",
        "post",
        "/api/v1/tenants/{globex}/api-keys/",
        {"admin"},
        {"name": "k"},
        201,
        hidden_from={"tenant_member"},
    ),
    Case(
        "revoke own key",
        "post",
        "/api/v1/tenants/{acme}/api-keys/{acme_key}/revoke/",
        {"admin", "tenant_member"},
        {},
    ),
    Case(
        "revoke other key",
        "post",
        "/api/v1/tenants/{globex}/api-keys/{globex_key}/revoke/",
        {"admin"},
        {},
        hidden_from={"tenant_member"},
    ),
    Case("own usage", "get", "/api/v1/tenants/{acme}/usage/", {*STAFF, "tenant_member"}),
    Case(
        "other usage",
        "get",
        "/api/v1/tenants/{globex}/usage/",
        STAFF,
        hidden_from={"tenant_member"},
    ),
    Case("list audit events", "get", "/api/v1/audit-events/", {*STAFF, "tenant_member"}),
]


@pytest.fixture
def world(users, tenants, signer, make_version) -> dict[str, Any]:
    from controlplane.tenants.services import api_key_create

    version = make_version("v1")
    new_artifact = gguf_bytes(b"brand new")
    files = embedding_folder()
    folder, _ = registry_services.artifact_store_archive(
        actor=None, stream=io.BytesIO(tar_bytes(files))
    )
    return {
        "folder": folder.digest,
        "folder_file": sha256_hex(files["config.json"]),
        "new_tar": tar_bytes(embedding_folder(**{"tokenizer.json": b'{"new": 1}'})),
        "model": version.model_id,
        "version": version.pk,
        "digest": version.artifact_id,
        "signature": signer.sign(version.artifact_id, SERVING_CONFIG),
        "public_key": signer.public_key_b64.replace(signer.public_key_b64[:4], "AAAA", 1),
        "key": SigningKey.objects.get(key_id=signer.key_id).pk,
        "new_bytes": new_artifact,
        "new_digest": sha256_hex(new_artifact),
        "acme": tenants["acme"].pk,
        "globex": tenants["globex"].pk,
        "acme_key": api_key_create(actor=None, tenant=tenants["acme"], name="a").key.pk,
        "globex_key": api_key_create(actor=None, tenant=tenants["globex"], name="g").key.pk,
        "viewer": users["viewer"].pk,
    }


def database_state() -> dict[str, Any]:
    return {
        "audit": AuditEvent.objects.count(),
        "models": Model.objects.count(),
        "versions": list(ModelVersion.objects.order_by("pk").values_list("status", flat=True)),
        "keys": list(SigningKey.objects.order_by("pk").values_list("is_trusted", flat=True)),
        "suites": EvalSuite.objects.count(),
        "tenants": list(
            Tenant.objects.order_by("pk").values_list("requests_per_minute", flat=True)
        ),
        "api_keys": list(ApiKey.objects.order_by("pk").values_list("revoked_at", flat=True)),
        "users": get_user_model().objects.count(),
        "tokens": AccessToken.objects.count(),
    }


def send(client, case: Case, world: dict[str, Any]):
    path = case.path.format(**world)
    if case.body == "bytes":
        return client.generic(
            "PUT", path, world["new_bytes"], content_type="application/octet-stream"
        )
    if case.body == "tar":
        return client.generic("POST", path, world["new_tar"], content_type="application/x-tar")
    body = case.body(world) if callable(case.body) else case.body
    return (
        getattr(client, case.method)(path, body, format="json")
        if body is not None
        else getattr(client, case.method)(path)
    )


@pytest.mark.django_db
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("principal", PRINCIPALS)
def test_role_matrix(client_for, world, case: Case, principal: str) -> None:
    # The tenant member's own tenant is acme; "other" paths are globex's.
    before = database_state()
    response = send(client_for(principal), case, world)
    if principal in case.allowed:
        assert response.status_code == case.success, response.content
        return
    expected = 401 if principal == "anonymous" else 404 if principal in case.hidden_from else 403
    assert response.status_code == expected, response.content
    assert response.json()["error"]["code"] in {
        "not_authenticated",
        "permission_denied",
        "not_found",
    }
    assert database_state() == before
