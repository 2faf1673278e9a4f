"""The rollout state machine through the REST API: transitions, reasons, roles, stale calls."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.registry.models import Evaluation
from controlplane.rollouts.models import Deployment, Rollout
from controlplane.rollouts.tasks import rollout_gate
from tests.rollouts.conftest import ROLES, running_rollout


def post(client, url, body=None):
    return client.post(url, body or {}, format="json")


def rollout_actions(rollout_id: int) -> list[str]:
    events = AuditEvent.objects.filter(object_type="rollout", object_id=str(rollout_id))
    return list(events.order_by("id").values_list("action", flat=True))


def test_a_rollout_walks_every_stage_to_promoted(api, deployment, versions) -> None:
    manager = api("release_manager")
    response = post(
        manager,
        "/api/v1/rollouts/",
        {"deployment": "smollm2", "candidate": versions[1].pk, "reason": "bf16"},
    )
    assert response.status_code == 201, response.json()
    rollout_id = response.json()["id"]
    assert response.json()["state"] == "pending"
    assert [stage["weight"] for stage in response.json()["stages"]] == [5, 25, 50, 100]

    rollout_gate.apply(args=[rollout_id])
    body = manager.get(f"/api/v1/rollouts/{rollout_id}/").json()
    assert (body["state"], body["stage_index"], body["canary_weight"]) == ("running", 0, 5)

    weights = []
    for stage in range(4):
        response = post(
            manager,
            f"/api/v1/rollouts/{rollout_id}/promote/",
            {"reason": "looks good", "expected_stage": stage},
        )
        assert response.status_code == 200, response.json()
        weights.append(Deployment.objects.get(name="smollm2").desired_routing["canary_weight"])
    assert weights == [25, 50, 100, 0]
    body = manager.get(f"/api/v1/rollouts/{rollout_id}/").json()
    assert body["state"] == "promoted"
    deployment = Deployment.objects.get(name="smollm2")
    assert deployment.stable_version_id == versions[1].pk
    assert deployment.desired_routing == {
        "stable_version_id": versions[1].pk,
        "canary_version_id": None,
        "canary_weight": 0,
        "canary_tenants": [],
        "canary_shadow": False,
        "preload_version_ids": [versions[1].pk],
        "replicas": {str(versions[1].pk): 1},
    }
    assert rollout_actions(rollout_id) == [
        "rollout.create",
        "rollout.start_gating",
        "rollout.stage_start",
        "rollout.stage_start",
        "rollout.stage_start",
        "rollout.stage_start",
        "rollout.promote",
    ]
    # One routing revision per routing change: create, gating (preload the candidate),
    # stage 0, three more stages, promoted.
    assert deployment.routing_revision == 7


def test_gating_blocks_until_the_required_suite_passes(api, deployment, versions, suite) -> None:
    manager = api("release_manager")
    response = post(
        manager,
        "/api/v1/rollouts/",
        {"deployment": "smollm2", "candidate": versions[1].pk, "required_suites": ["exact-match"]},
    )
    rollout_id = response.json()["id"]
    rollout_gate.apply(args=[rollout_id])
    body = manager.get(f"/api/v1/rollouts/{rollout_id}/").json()
    assert body["state"] == "gating"
    assert body["gate_reasons"] == ["exact-match: no evaluation of the candidate yet"]

    failed = Evaluation.objects.create(
        version=versions[1], suite=suite, metrics={"exact_match": 0.5}, passed=False
    )
    rollout_gate.apply(args=[rollout_id])
    body = manager.get(f"/api/v1/rollouts/{rollout_id}/").json()
    assert body["state"] == "gating"
    assert body["gate_reasons"] == [
        f"exact-match: failed (evaluation {failed.pk}: {{'exact_match': 0.5}})"
    ]
    # A candidate failing evaluation never receives traffic.
    assert Deployment.objects.get(name="smollm2").desired_routing["canary_weight"] == 0

    Evaluation.objects.create(
        version=versions[1], suite=suite, metrics={"exact_match": 0.9}, passed=True
    )
    rollout_gate.apply(args=[rollout_id])
    rollout_gate.apply(args=[rollout_id])  # delivered twice: nothing more happens
    body = manager.get(f"/api/v1/rollouts/{rollout_id}/").json()
    assert (body["state"], body["canary_weight"], body["gate_reasons"]) == ("running", 5, [])
    assert rollout_actions(rollout_id).count("rollout.stage_start") == 1


def test_pause_resume_rollback_retry(api, deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1])
    oncall = api("on_call")
    url = f"/api/v1/rollouts/{rollout.pk}"
    response = post(oncall, f"{url}/pause/", {"reason": "investigating"})
    assert response.json()["state"] == "paused"
    assert Deployment.objects.get().desired_routing["canary_weight"] == 5  # frozen, not removed
    response = post(api("release_manager"), f"{url}/resume/", {"reason": "fine"})
    assert (response.json()["state"], response.json()["stage_index"]) == ("running", 0)
    response = post(oncall, f"{url}/rollback/", {"reason": "errors in the logs"})
    assert response.json()["state"] == "rolled_back"
    assert response.json()["state_reason"] == "errors in the logs"
    assert Deployment.objects.get().desired_routing["canary_weight"] == 0
    response = post(api("release_manager"), f"{url}/retry/", {"reason": "fixed the config"})
    assert (response.json()["state"], response.json()["attempt"]) == ("pending", 2)
    event = AuditEvent.objects.filter(object_id=str(rollout.pk), action="rollout.rollback").get()
    assert (event.actor_name, event.reason) == ("user-on_call", "errors in the logs")
    assert (event.before["state"], event.after["state"]) == ("running", "rolled_back")


def test_every_action_requires_a_reason(api, deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1])
    response = post(api("admin"), f"/api/v1/rollouts/{rollout.pk}/rollback/", {})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid"
    assert list(response.json()["error"]["fields"]) == ["reason"]
    assert Rollout.objects.get().state == "running"


def test_a_stale_expected_state_is_refused_and_changes_nothing(api, deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1])
    manager = api("release_manager")
    url = f"/api/v1/rollouts/{rollout.pk}/promote/"
    assert post(manager, url, {"reason": "go", "expected_stage": 0}).status_code == 200
    revision = Deployment.objects.get().routing_revision
    audit_count = AuditEvent.objects.count()

    response = post(manager, url, {"reason": "go", "expected_stage": 0})  # a repeated click
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "stale_state"
    assert response.json()["error"]["fields"] == {
        "current": {"state": "running", "stage": 1, "revision": 3}
    }
    assert (Rollout.objects.get().stage_index, Deployment.objects.get().routing_revision) == (
        1,
        revision,
    )
    assert AuditEvent.objects.count() == audit_count


def test_a_transition_from_the_wrong_state_is_refused(api, deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1])
    manager = api("release_manager")
    assert (
        post(manager, f"/api/v1/rollouts/{rollout.pk}/abort/", {"reason": "no"}).status_code == 200
    )
    response = post(manager, f"/api/v1/rollouts/{rollout.pk}/resume/", {"reason": "yes"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "invalid_transition"
    assert response.json()["error"]["fields"]["allowed_from"] == ["paused"]


def test_one_active_rollout_per_deployment(api, deployment, versions) -> None:
    running_rollout(deployment, versions[1])
    response = post(
        api("admin"), "/api/v1/rollouts/", {"deployment": "smollm2", "candidate": versions[1].pk}
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "rollout_in_progress"


EXPECTED = {
    # action: roles allowed
    "promote": {"admin", "release_manager"},
    "resume": {"admin", "release_manager"},
    "abort": {"admin", "release_manager"},
    "retry": {"admin", "release_manager"},
    "pause": {"admin", "release_manager", "on_call"},
    "rollback": {"admin", "release_manager", "on_call"},
}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("action", sorted(EXPECTED))
def test_role_matrix(api, deployment, versions, role, action) -> None:
    rollout = running_rollout(deployment, versions[1])
    client = api(role)
    before = (Rollout.objects.get().revision, AuditEvent.objects.count())
    response = post(client, f"/api/v1/rollouts/{rollout.pk}/{action}/", {"reason": "because"})
    if role in EXPECTED[action]:
        # Allowed: refused only by the state machine (resume and retry need another state).
        assert response.status_code in {200, 409}, response.json()
        if response.status_code == 409:
            assert response.json()["error"]["code"] == "invalid_transition"
    else:
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
        assert (Rollout.objects.get().revision, AuditEvent.objects.count()) == before


@pytest.mark.parametrize("role", ROLES)
def test_everyone_on_staff_reads_but_only_steering_roles_create(
    api, deployment, versions, role
) -> None:
    client = api(role)
    assert client.get("/api/v1/rollouts/").status_code == 200
    assert client.get("/api/v1/deployments/").json()["results"][0]["name"] == "smollm2"
    response = post(
        client, "/api/v1/rollouts/", {"deployment": "smollm2", "candidate": versions[1].pk}
    )
    assert response.status_code == (201 if role in {"admin", "release_manager"} else 403)


def test_tenant_members_read_nothing(api, deployment, tenant) -> None:
    from rest_framework.test import APIClient

    from controlplane.accounts.services import access_token_create, user_create

    user = user_create(
        actor=None, username="member", password=None, role="tenant_member", tenant=tenant
    )
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {access_token_create(user=user, name='t').raw_token}"
    )
    assert client.get("/api/v1/rollouts/").status_code == 403
    assert client.get("/api/v1/deployments/").status_code == 403


def test_invalid_stage_plans_are_refused(api, deployment, versions) -> None:
    response = post(
        api("admin"),
        "/api/v1/rollouts/",
        {
            "deployment": "smollm2",
            "candidate": versions[1].pk,
            "stages": [{"weight": 10}, {"weight": 50, "tenants": ["acme"]}],
        },
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "invalid_stages",
        "message": "The last stage must serve every tenant (no tenant list).",
        "fields": {},
    }
    assert Rollout.objects.count() == 0


def test_a_stage_for_a_tenant_not_allowed_the_model_is_refused(
    api, deployment, versions, tenant
) -> None:
    body = {
        "deployment": "smollm2",
        "candidate": versions[1].pk,
        "stages": [{"weight": 10, "tenants": ["acme"]}, {"weight": 100}],
    }
    response = post(api("admin"), "/api/v1/rollouts/", body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_stages"
    assert response.json()["error"]["message"] == (
        "Tenants in stages not allowed this model: acme."
    )
    assert Rollout.objects.count() == 0
    tenant.allowed_models.add(versions[1].model)
    assert post(api("admin"), "/api/v1/rollouts/", body).status_code == 201


def test_the_analysis_history_is_listed(api, deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1])
    response = api("viewer").get(f"/api/v1/rollouts/{rollout.pk}/analysis-runs/")
    assert response.status_code == 200
    assert response.json()["results"] == []
