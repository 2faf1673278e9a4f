"""The audit log: filtered reads, tenant isolation, and no way to change it."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.audit.services import audit_event_record
from tests.api.support import assert_error

pytestmark = pytest.mark.django_db


@pytest.fixture
def events(users, tenants):
    acme, globex = tenants["acme"], tenants["globex"]
    return [
        audit_event_record(
            actor=users["admin"],
            action="tenant.update",
            object_type="tenant",
            object_id=acme.pk,
            tenant_id=acme.pk,
        ),
        audit_event_record(
            actor=users["admin"],
            action="tenant.update",
            object_type="tenant",
            object_id=globex.pk,
            tenant_id=globex.pk,
        ),
        audit_event_record(
            actor=users["release_manager"],
            action="version.approve",
            object_type="model_version",
            object_id=7,
            reason="ok",
        ),
        audit_event_record(
            actor=None, action="rollout.rollback", object_type="rollout", object_id=3
        ),
    ]


def ids(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def test_filters_by_actor_object_and_action(client_for, events) -> None:
    viewer = client_for("viewer")
    assert ids(viewer.get("/api/v1/audit-events/")) == [event.pk for event in reversed(events)]
    assert ids(viewer.get("/api/v1/audit-events/", {"actor": "release_manager"})) == [events[2].pk]
    assert ids(viewer.get("/api/v1/audit-events/", {"actor": "system"})) == [events[3].pk]
    assert ids(
        viewer.get("/api/v1/audit-events/", {"object_type": "model_version", "object_id": "7"})
    ) == [events[2].pk]
    assert ids(viewer.get("/api/v1/audit-events/", {"action": "tenant.update"})) == [
        events[1].pk,
        events[0].pk,
    ]
    assert ids(viewer.get("/api/v1/audit-events/", {"action_prefix": "rollout."})) == [events[3].pk]
    detail = viewer.get(f"/api/v1/audit-events/{events[2].pk}/").json()
    assert detail["actor"] == "release_manager"
    assert detail["reason"] == "ok"
    assert set(detail) == {
        "id",
        "created_at",
        "actor",
        "action",
        "object_type",
        "object_id",
        "object_repr",
        "before",
        "after",
        "reason",
        "tenant_id",
    }


def test_tenant_member_sees_only_their_tenants_events(client_for, events, tenants) -> None:
    member = client_for("tenant_member")
    assert ids(member.get("/api/v1/audit-events/")) == [events[0].pk]
    assert ids(member.get("/api/v1/audit-events/", {"tenant_id": tenants["globex"].pk})) == []
    assert_error(member.get(f"/api/v1/audit-events/{events[1].pk}/"), 404, "not_found")
    assert_error(member.get(f"/api/v1/audit-events/{events[2].pk}/"), 404, "not_found")


@pytest.mark.parametrize("method", ["put", "patch", "delete"])
def test_no_api_changes_an_event(client_for, events, method) -> None:
    response = getattr(client_for("admin"), method)(
        f"/api/v1/audit-events/{events[0].pk}/", {"reason": "x"}, format="json"
    )
    assert_error(response, 405, "method_not_allowed")
    assert_error(
        client_for("admin").post("/api/v1/audit-events/", {}, format="json"),
        405,
        "method_not_allowed",
    )
    assert AuditEvent.objects.count() == 4
    assert AuditEvent.objects.get(pk=events[0].pk).reason == ""


def test_the_model_itself_is_append_only(events) -> None:
    event = events[0]
    event.reason = "rewritten"
    with pytest.raises(TypeError):
        event.save()
    with pytest.raises(TypeError):
        event.delete()
    with pytest.raises(TypeError):
        AuditEvent.objects.filter(pk=event.pk).update(reason="x")
    with pytest.raises(TypeError):
        AuditEvent.objects.all().delete()


def test_agents_and_users_without_a_role_cannot_read_it(client_for, events) -> None:
    assert_error(client_for("agent").get("/api/v1/audit-events/"), 403, "permission_denied")
    assert_error(client_for("no_role").get("/api/v1/audit-events/"), 403, "permission_denied")
