"""Undo after promotion through the REST API: the revision history, who may undo, each
refusal (which changes nothing), the audit event, and the reconciler keeping the previous
stable version warm so the switch back is immediate."""

from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.test import override_settings
from django.utils import timezone

from contracts.commands import CommandKind, commands_stream, parse_command
from controlplane.audit.models import AuditEvent
from controlplane.registry.models import ModelVersion, SigningKey
from controlplane.rollouts import deployments, reconciler, transitions
from controlplane.rollouts.models import Deployment, DeploymentRevision, Rollout
from tests.api.support import Signer
from tests.rollouts.conftest import ROLES, make_version, running_rollout
from tests.rollouts.test_reconciler import agent, table, weights

UNDO = "/api/v1/deployments/smollm2/undo/"


def promote(deployment: Deployment, candidate: ModelVersion, actor=None) -> Rollout:
    rollout = running_rollout(deployment, candidate)
    return transitions.rollout_advance(
        actor=actor, rollout_id=rollout.pk, reason="bf16 held its SLOs", full=True
    )


def signed(*versions: ModelVersion) -> None:
    """Agents load signed versions only."""
    signer = Signer("release-key", Ed25519PrivateKey.generate())
    key = SigningKey.objects.create(
        key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
    )
    for version in versions:
        ModelVersion.objects.filter(pk=version.pk).update(
            signature=signer.sign(str(version.artifact_id), version.serving_config), signing_key=key
        )


def state() -> tuple:
    """Everything an undo changes: a refused one leaves all of it as it was."""
    deployment = Deployment.objects.get(name="smollm2")
    return (
        deployment.stable_version_id,
        deployment.routing_revision,
        deployment.desired_routing,
        DeploymentRevision.objects.count(),
        AuditEvent.objects.filter(action="deployment.undo").count(),
    )


def test_history_records_creation_promotion_and_undo(api, deployment, versions) -> None:
    stable, candidate = versions
    manager = api("release_manager")
    rollout = running_rollout(deployment, candidate)
    response = manager.post(
        f"/api/v1/rollouts/{rollout.pk}/promote/",
        {"reason": "bf16 held its SLOs", "full": True},
        format="json",
    )
    assert response.status_code == 200, response.json()

    response = api("on_call").post(UNDO, {"reason": "p95 TTFT doubled since"}, format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["switch"] == "after_load"  # no agent serves f32 here
    assert body["deployment"]["stable_version"] == stable.pk
    assert body["revision"]["source"] == "undo"

    history = api("viewer").get("/api/v1/deployments/smollm2/revisions/").json()["results"]
    rows = [(r["source"], r["version"], r["previous_version"], r["rollout"]) for r in history]
    assert rows == [
        ("undo", stable.pk, candidate.pk, None),
        ("promote", candidate.pk, stable.pk, rollout.pk),
        ("create", stable.pk, None, None),
    ]
    assert [(r["actor"], r["reason"]) for r in history] == [
        ("user-on_call", "p95 TTFT doubled since"),
        ("user-release_manager", "bf16 held its SLOs"),
        ("system", ""),
    ]

    # An undo of the undo puts the promoted version back.
    response = api("release_manager").post(UNDO, {"reason": "false alarm"}, format="json")
    assert response.status_code == 200, response.json()
    assert Deployment.objects.get(name="smollm2").stable_version_id == candidate.pk


def test_undo_switches_routing_and_is_audited(api, deployment, versions) -> None:
    stable, candidate = versions
    promote(deployment, candidate)
    before = Deployment.objects.get(pk=deployment.pk)

    response = api("on_call").post(UNDO, {"reason": "  errors on bf16  "}, format="json")
    assert response.status_code == 200, response.json()

    after = Deployment.objects.get(pk=deployment.pk)
    assert after.stable_version_id == stable.pk
    assert after.routing_revision == before.routing_revision + 1
    assert after.desired_routing == {
        "stable_version_id": stable.pk,
        "canary_version_id": None,
        "canary_weight": 0,
        "canary_tenants": [],
        "canary_shadow": False,
        "preload_version_ids": [stable.pk],
        "replicas": {str(stable.pk): 1},
    }
    revision = DeploymentRevision.objects.filter(deployment=deployment).first()
    assert revision is not None
    event = AuditEvent.objects.get(action="deployment.undo")
    assert (event.actor_name, event.object_type, event.object_id, event.object_repr) == (
        "user-on_call",
        "deployment",
        str(deployment.pk),
        "smollm2",
    )
    assert event.reason == "errors on bf16"
    assert event.before == {
        "stable_version_id": candidate.pk,
        "routing_revision": before.routing_revision,
    }
    assert event.after == {
        "stable_version_id": stable.pk,
        "routing_revision": after.routing_revision,
        "revision_id": revision.pk,
        "switch": "after_load",
    }


@pytest.mark.parametrize("role", [*ROLES, "tenant_member", "nobody"])
def test_only_on_call_release_managers_and_admins_undo(
    api, deployment, versions, tenant, role
) -> None:
    from rest_framework.test import APIClient

    from controlplane.accounts.services import access_token_create, user_create

    promote(deployment, versions[1])
    if role == "tenant_member":
        user = user_create(actor=None, username="member", password=None, role=role, tenant=tenant)
        client = APIClient()
        token = access_token_create(user=user, name="t").raw_token
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    elif role == "nobody":
        client = APIClient()
    else:
        client = api(role)
    before = state()
    response = client.post(UNDO, {"reason": "roll back the promotion"}, format="json")
    if role in {"admin", "release_manager", "on_call"}:
        assert response.status_code == 200, response.json()
        assert state() != before
        return
    assert response.status_code == (401 if role == "nobody" else 403)
    assert response.json()["error"]["code"] in {"not_authenticated", "permission_denied"}
    assert state() == before


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 400, "reason_required"),
        ({"reason": "   "}, 400, "reason_required"),
        ({"reason": "x" * 2001}, 400, "reason_too_long"),
        ({"reason": ["a list"]}, 400, "invalid"),
        ({"reason": "ok", "extra": 1}, 400, "unknown_fields"),
    ],
)
def test_a_bad_reason_is_refused(api, deployment, versions, body, status, code) -> None:
    promote(deployment, versions[1])
    before = state()
    response = api("on_call").post(UNDO, body, format="json")
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert state() == before


def test_without_a_previous_stable_version_undo_is_refused(api, deployment) -> None:
    before = state()
    response = api("on_call").post(UNDO, {"reason": "undo"}, format="json")
    assert (response.status_code, response.json()["error"]["code"]) == (409, "no_previous_stable")
    assert state() == before
    response = api("on_call").post(
        "/api/v1/deployments/nothing-here/undo/", {"reason": "undo"}, format="json"
    )
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def test_during_a_rollout_undo_is_refused_and_names_it(api, deployment, versions) -> None:
    stable, candidate = versions
    promote(deployment, candidate)
    third = make_version(stable.model, "int8", "c")
    rollout = running_rollout(deployment, third)
    before = state()
    response = api("on_call").post(UNDO, {"reason": "undo"}, format="json")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "rollout_in_progress"
    assert error["fields"] == {"rollout_id": rollout.pk, "rollout_state": "running"}
    assert "roll it back or abort it instead" in error["message"]
    assert state() == before


@pytest.mark.parametrize(
    ("status", "code"),
    [("revoked", "previous_version_revoked"), ("deprecated", "previous_version_not_deployable")],
)
def test_a_withdrawn_previous_version_is_not_restored(
    api, deployment, versions, status, code
) -> None:
    stable, candidate = versions
    promote(deployment, candidate)
    ModelVersion.objects.filter(pk=stable.pk).update(status=status)
    before = state()
    response = api("on_call").post(UNDO, {"reason": "undo"}, format="json")
    assert (response.status_code, response.json()["error"]["code"]) == (409, code)
    assert response.json()["error"]["fields"]["previous_version"] == stable.pk
    assert state() == before


def test_the_schema_documents_undo_and_revisions(api) -> None:
    schema = api("viewer").get("/api/schema/?format=json").json()
    undo = schema["paths"]["/api/v1/deployments/{name}/undo/"]["post"]
    assert set(undo["responses"]) == {"200", "400", "404", "409"}
    assert "rollout_in_progress" in undo["responses"]["409"]["description"]
    assert "/api/v1/deployments/{name}/revisions/" in schema["paths"]


# The reconciler: the previous stable version warm, and a handover while a version loads.


@override_settings(ROLLOUTS_DRAIN_GRACE_S=0)
def test_the_previous_stable_stays_warm_and_the_undo_is_immediate(
    api, deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    promote(deployment, candidate)

    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.drains == []  # gpu-0 keeps f32 loaded, unrouted
    assert {k: v[0] for k, v in weights(redis_client).items()} == {candidate.pk: 100}

    response = api("on_call").post(UNDO, {"reason": "bf16 answers worse"}, format="json")
    assert response.json()["switch"] == "immediate"
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {stable.pk: (100, ("http://127.0.0.1:9000",))}
    assert report.drains == []  # now bf16 is the one kept warm


@override_settings(ROLLOUTS_DRAIN_GRACE_S=0, ROLLOUTS_PREVIOUS_STABLE_WARM_S=600)
def test_the_warm_version_is_drained_after_its_window(deployment, versions, redis_client) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    promote(deployment, candidate)
    DeploymentRevision.objects.filter(source="promote").update(
        created_at=timezone.now() - timedelta(seconds=601)
    )
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.drains == ["gpu-0"]


def test_an_idle_agent_loads_the_previous_stable(deployment, versions, redis_client) -> None:
    stable, candidate = versions
    agent("gpu-0", candidate)
    agent("gpu-1", None, state="idle")
    promote(deployment, candidate)
    signed(stable)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-1", stable.pk)]
    [(_, fields)] = redis_client.xrange(commands_stream("gpu-1"))
    command = parse_command(fields)
    assert (command.kind, command.payload["version_id"]) == (CommandKind.LOAD, stable.pk)
    # The table never routes it.
    assert {k: v[0] for k, v in weights(redis_client).items()} == {candidate.pk: 100}


@override_settings(ROLLOUTS_DRAIN_GRACE_S=0)
def test_an_agent_holding_an_unneeded_version_is_drained_before_it_warms(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    third = make_version(stable.model, "int8", "c")
    agent("gpu-0", candidate)
    agent("gpu-1", third)  # say, a revoked candidate: it must stop, not wait for a load
    promote(deployment, candidate)
    signed(stable)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert (report.loads, report.drains) == ([], ["gpu-1"])


def test_a_candidate_takes_the_warm_agent_when_no_other_is_free(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    promote(deployment, candidate)
    third = make_version(stable.model, "int8", "c")
    signed(third)
    running_rollout(deployment, third)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-0", third.pk)]


def test_a_candidate_prefers_an_idle_agent_to_the_warm_one(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    agent("gpu-2", None, state="idle")
    promote(deployment, candidate)
    third = make_version(stable.model, "int8", "c")
    signed(third)
    running_rollout(deployment, third)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-2", third.pk)]


def test_a_restored_version_loads_while_the_demoted_one_serves(
    api, deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", candidate)
    promote(deployment, candidate)
    deployments_before = Deployment.objects.get(pk=deployment.pk).routing_revision
    response = api("on_call").post(UNDO, {"reason": "bf16 answers worse"}, format="json")
    assert response.json()["switch"] == "after_load"
    assert Deployment.objects.get(pk=deployment.pk).routing_revision == deployments_before + 1

    # No agent serves f32 yet: bf16 keeps the traffic until one does.
    agent("gpu-1", None, state="idle")
    signed(stable)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.handover is True
    assert report.loads == [("gpu-1", stable.pk)]
    assert {k: v[0] for k, v in weights(redis_client).items()} == {candidate.pk: 100}
    [route] = table(redis_client).versions
    assert route.role == "stable"


def test_creation_records_the_first_revision(deployment, versions) -> None:
    third = make_version(versions[0].model, "int8", "c")
    created = deployments.deployment_create(actor=None, name="other", stable_version=third)
    [revision] = DeploymentRevision.objects.filter(deployment=created)
    assert (revision.source, revision.version_id, revision.previous_version_id) == (
        "create",
        third.pk,
        None,
    )
