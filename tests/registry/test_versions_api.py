"""Models and versions: registration, signature verification, override, lifecycle, evaluations."""

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.audit.models import AuditEvent
from controlplane.registry.models import EvalSuite, Evaluation, Model, ModelVersion, SigningKey
from tests.api.support import (
    SERVING_CONFIG,
    Signer,
    assert_error,
    audit_count,
    gguf_bytes,
    sha256_hex,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def stored_digest(admin_client, artifact_root) -> str:
    data = gguf_bytes(b"release")
    digest = sha256_hex(data)
    response = admin_client.generic(
        "PUT", f"/api/v1/artifacts/{digest}", data, content_type="application/octet-stream"
    )
    assert response.status_code == 201
    return digest


def register(client, model_id: int, digest: str, label: str = "v1", **overrides):
    body = {
        "model": model_id,
        "label": label,
        "artifact_digest": f"sha256:{digest}",
        "serving_config": SERVING_CONFIG,
        "source": "unit test",
        **overrides,
    }
    return client.post("/api/v1/versions/", body, format="json")


def test_release_manager_walks_a_version_to_approved(client_for, stored_digest, signer) -> None:
    client = client_for("release_manager")
    model = client.post("/api/v1/models/", {"name": "smol", "task": "chat"}, format="json")
    assert model.status_code == 201
    model_id = model.json()["id"]

    created = register(client, model_id, stored_digest)
    assert created.status_code == 201, created.content
    version = created.json()
    assert version["status"] == "registered"
    assert version["artifact_digest"] == f"sha256:{stored_digest}"
    assert version["format"] == "gguf"
    assert version["serving_config"] == SERVING_CONFIG
    url = f"/api/v1/versions/{version['id']}"

    signature = signer.sign(stored_digest, SERVING_CONFIG)
    verified = client.post(
        f"{url}/verify/", {"key_id": signer.key_id, "signature": signature}, format="json"
    )
    assert verified.status_code == 200, verified.content
    assert verified.json()["status"] == "verified"
    assert verified.json()["signing_key"] == signer.key_id
    assert verified.json()["signature"] == signature

    assert_error(client.post(f"{url}/approve/", {}, format="json"), 409, "invalid_status")

    suite = client.post(
        "/api/v1/eval-suites/",
        {
            "name": "capitals",
            "kind": "quality",
            "dataset": "capitals-v1",
            "metrics": [
                {"name": "exact_match", "threshold": 0.8},
                {"name": "p95_ms", "threshold": 500, "higher_is_better": False},
            ],
        },
        format="json",
    )
    assert suite.status_code == 201, suite.content
    failing = client.post(
        "/api/v1/evaluations/",
        {
            "version": version["id"],
            "suite": suite.json()["id"],
            "metrics": {"exact_match": 0.5, "p95_ms": 100},
        },
        format="json",
    )
    assert failing.status_code == 201
    assert failing.json()["passed"] is False
    assert client.get(f"{url}/").json()["status"] == "verified"

    passing = client.post(
        "/api/v1/evaluations/",
        {
            "version": version["id"],
            "suite": suite.json()["id"],
            "metrics": {"exact_match": 0.9, "p95_ms": 400},
        },
        format="json",
    )
    assert passing.json()["passed"] is True
    assert client.get(f"{url}/").json()["status"] == "evaluated"

    approved = client.post(f"{url}/approve/", {"reason": "looks good"}, format="json")
    assert approved.status_code == 200
    assert approved.json()["status"] == "approved"
    deprecated = client.post(f"{url}/deprecate/", {}, format="json")
    assert deprecated.json()["status"] == "deprecated"
    revoked = client.post(f"{url}/revoke/", {"reason": "superseded"}, format="json")
    assert revoked.json()["status"] == "revoked"
    assert_error(
        client.post(f"{url}/revoke/", {"reason": "again"}, format="json"), 409, "invalid_status"
    )

    actions = list(
        AuditEvent.objects.filter(object_type="model_version", object_id=str(version["id"]))
        .order_by("id")
        .values_list("action", flat=True)
    )
    assert actions == [
        "version.register",
        "version.verify",
        "version.evaluated",
        "version.approve",
        "version.deprecate",
        "version.revoke",
    ]
    approve_event = AuditEvent.objects.get(action="version.approve")
    assert approve_event.before["status"] == "evaluated"
    assert approve_event.after["status"] == "approved"
    assert approve_event.reason == "looks good"
    assert approve_event.actor_name == "release_manager"


def _verify_refused(client, version: ModelVersion, body: dict, status_code: int, code: str) -> None:
    before = audit_count()
    response = client.post(f"/api/v1/versions/{version.pk}/verify/", body, format="json")
    assert_error(response, status_code, code)
    version.refresh_from_db()
    assert version.status == "registered"
    assert version.signature == ""
    assert version.signing_key is None
    assert audit_count() == before


def test_bad_signatures_are_refused_without_change(client_for, make_version, signer) -> None:
    client = client_for("release_manager")
    version = make_version()
    digest = version.artifact_id
    good = signer.sign(digest, SERVING_CONFIG)
    other_config = signer.sign(digest, {**SERVING_CONFIG, "dtype": "bfloat16"})
    stranger = Signer("stranger", Ed25519PrivateKey.generate()).sign(digest, SERVING_CONFIG)
    _verify_refused(
        client, version, {"key_id": signer.key_id, "signature": other_config}, 400, "bad_signature"
    )
    _verify_refused(
        client, version, {"key_id": signer.key_id, "signature": stranger}, 400, "bad_signature"
    )
    _verify_refused(
        client, version, {"key_id": signer.key_id, "signature": "%%%"}, 400, "bad_signature"
    )
    _verify_refused(client, version, {"key_id": "nobody", "signature": good}, 400, "unknown_key")
    _verify_refused(
        client,
        version,
        {"key_id": signer.key_id, "signature": good, "force": True},
        400,
        "unknown_fields",
    )
    SigningKey.objects.filter(key_id=signer.key_id).update(is_trusted=False)
    _verify_refused(
        client, version, {"key_id": signer.key_id, "signature": good}, 400, "untrusted_key"
    )


def test_admin_override_verifies_with_an_audited_reason(client_for, make_version) -> None:
    version = make_version()
    url = f"/api/v1/versions/{version.pk}/override-verification/"
    assert_error(
        client_for("release_manager").post(url, {"reason": "trust me"}, format="json"),
        403,
        "permission_denied",
    )
    assert_error(client_for("admin").post(url, {}, format="json"), 400, "invalid")
    response = client_for("admin").post(url, {"reason": "signed offline, key lost"}, format="json")
    assert response.status_code == 200
    assert response.json()["status"] == "verified"
    assert response.json()["is_verification_override"] is True
    event = AuditEvent.objects.get(action="version.verify_override")
    assert event.reason == "signed offline, key lost"
    assert event.actor_name == "admin"


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"serving_config": {**SERVING_CONFIG, "dtype": "int4"}}, "invalid"),
        ({"serving_config": {**SERVING_CONFIG, "dtype": "float16"}}, "invalid"),  # not served
        ({"serving_config": {**SERVING_CONFIG, "max_model_len": "2048"}}, "invalid"),
        ({"serving_config": {**SERVING_CONFIG, "max_model_len": 0}}, "invalid"),
        ({"serving_config": {**SERVING_CONFIG, "temperature": 0.7}}, "unknown_fields"),
        ({"serving_config": {"dtype": "float32"}}, "invalid"),
        ({"label": 42.5}, "invalid"),
        ({"label": "has spaces"}, "invalid"),
        ({"artifact_digest": "md5:abc"}, "invalid"),
        ({"artifact_digest": "0" * 64}, "unknown_artifact"),
        ({"model": 999_999}, "invalid"),
        ({"tags": ["x"]}, "unknown_fields"),
    ],
)
def test_bad_registrations_change_nothing(
    client_for, stored_digest, chat_model, overrides, code
) -> None:
    before = audit_count()
    response = register(client_for("release_manager"), chat_model.pk, stored_digest, **overrides)
    assert_error(response, 400, code)
    assert ModelVersion.objects.count() == 0
    assert audit_count() == before


def test_duplicate_label_is_a_conflict(client_for, stored_digest, chat_model) -> None:
    client = client_for("release_manager")
    assert register(client, chat_model.pk, stored_digest).status_code == 201
    assert_error(register(client, chat_model.pk, stored_digest), 409, "version_exists")
    assert ModelVersion.objects.count() == 1


def test_versions_share_an_artifact_and_differ_in_config(
    client_for, stored_digest, chat_model
) -> None:
    client = client_for("release_manager")
    fp32 = register(client, chat_model.pk, stored_digest, label="fp32")
    # bfloat16, and the engine's weight-only int8: release pairs with the same artifact
    for label, dtype in (("bf16", "bfloat16"), ("int8", "int8")):
        pair = register(
            client,
            chat_model.pk,
            stored_digest,
            label=label,
            base_version=fp32.json()["id"],
            serving_config={**SERVING_CONFIG, "dtype": dtype},
        )
        assert pair.status_code == 201, pair.json()
        assert pair.json()["base_version"] == fp32.json()["id"]
    listing = client.get("/api/v1/versions/", {"artifact_digest": f"sha256:{stored_digest}"}).json()
    assert listing["count"] == 3
    assert client.get("/api/v1/versions/", {"status": "verified"}).json()["count"] == 0


def test_models_are_listed_and_duplicates_refused(client_for) -> None:
    client = client_for("release_manager")
    assert (
        client.post(
            "/api/v1/models/", {"name": "m", "task": "embedding"}, format="json"
        ).status_code
        == 201
    )
    assert_error(
        client.post("/api/v1/models/", {"name": "m", "task": "chat"}, format="json"),
        409,
        "model_exists",
    )
    assert_error(
        client.post("/api/v1/models/", {"name": "n", "task": "vision"}, format="json"),
        400,
        "invalid",
    )
    assert client.get("/api/v1/models/", {"task": "embedding"}).json()["count"] == 1
    assert Model.objects.count() == 1


def test_signing_keys_are_managed_by_admins_and_audited(client_for) -> None:
    public = Signer("k", Ed25519PrivateKey.generate()).public_key_b64
    assert_error(
        client_for("release_manager").post(
            "/api/v1/signing-keys/", {"key_id": "k", "public_key": public}, format="json"
        ),
        403,
        "permission_denied",
    )
    admin = client_for("admin")
    bad = admin.post(
        "/api/v1/signing-keys/",
        {"key_id": "k", "public_key": base64.b64encode(b"short").decode()},
        format="json",
    )
    assert_error(bad, 400, "invalid_public_key")
    created = admin.post(
        "/api/v1/signing-keys/", {"key_id": "k", "public_key": public}, format="json"
    )
    assert created.status_code == 201
    assert created.json()["is_trusted"] is False
    trusted = admin.post(
        f"/api/v1/signing-keys/{created.json()['id']}/trust/",
        {"is_trusted": True, "reason": "release key"},
        format="json",
    )
    assert trusted.json()["is_trusted"] is True
    assert list(
        AuditEvent.objects.filter(object_type="signing_key")
        .order_by("id")
        .values_list("action", flat=True)
    ) == [
        "signing_key.create",
        "signing_key.trust",
    ]


def test_evaluation_input_is_checked(client_for, make_version) -> None:
    client = client_for("release_manager")
    version = make_version()
    suite = EvalSuite.objects.create(
        name="s",
        kind="latency",
        dataset="d",
        metrics=[{"name": "p95_ms", "threshold": 5, "higher_is_better": False}],
    )
    before = audit_count()
    # The version is only registered: evaluation needs a verified one.
    refused = client.post(
        "/api/v1/evaluations/",
        {"version": version.pk, "suite": suite.pk, "metrics": {"p95_ms": 1}},
        format="json",
    )
    assert_error(refused, 409, "invalid_status")
    ModelVersion.objects.filter(pk=version.pk).update(status="verified")
    wrong = client.post(
        "/api/v1/evaluations/",
        {"version": version.pk, "suite": suite.pk, "metrics": {"other": 1}},
        format="json",
    )
    assert_error(wrong, 400, "invalid_metrics")
    typed = client.post(
        "/api/v1/evaluations/",
        {"version": version.pk, "suite": suite.pk, "metrics": {"p95_ms": "fast"}},
        format="json",
    )
    assert_error(typed, 400, "invalid")
    bad_suite = client.post(
        "/api/v1/eval-suites/",
        {
            "name": "x",
            "kind": "energy",
            "dataset": "d",
            "metrics": [{"name": "j", "threshold": "low"}],
        },
        format="json",
    )
    assert_error(bad_suite, 400, "invalid")
    assert Evaluation.objects.count() == 0
    assert EvalSuite.objects.count() == 1
    assert audit_count() == before
