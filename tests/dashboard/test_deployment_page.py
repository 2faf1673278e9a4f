"""The deployment page: its last stable versions, and an undo form for the roles that may
undo, with refusals shown next to the form and nothing changed."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.rollouts import replicas, transitions
from controlplane.rollouts.models import Deployment, DeploymentRevision
from tests.dashboard.conftest import STAFF_ROLES

PAGE = "/deployments/smollm2/"
UNDO = "/deployments/smollm2/undo/"


def promoted(world) -> None:
    transitions.rollout_advance(
        actor=world.users[Role.RELEASE_MANAGER],
        rollout_id=world.rollout.pk,
        reason="bf16 held its SLOs",
        full=True,
    )


def unchanged(world) -> tuple:
    return (
        Deployment.objects.get(pk=world.deployment.pk).stable_version_id,
        DeploymentRevision.objects.count(),
        AuditEvent.objects.filter(action="deployment.undo").count(),
    )


@pytest.mark.parametrize("role", STAFF_ROLES)
def test_staff_see_the_history_and_only_undoers_the_form(world, client_for, role) -> None:
    promoted(world)
    response = client_for(role).get(PAGE)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-source="promote"' in html and 'data-source="create"' in html
    assert "bf16 held its SLOs" in html
    assert ("Undo to f32" in html) == (role != Role.VIEWER)


def test_tenant_members_may_not_open_it(world, client_for) -> None:
    assert client_for(Role.TENANT_MEMBER).get(PAGE).status_code == 403


def test_on_call_undoes_a_promotion(world, client_for) -> None:
    promoted(world)
    response = client_for(Role.ON_CALL).post(UNDO, {"reason": "bf16 answers worse"}, follow=True)
    assert response.status_code == 200
    assert "smollm2 is back on f32: it takes the traffic now." in response.content.decode()
    assert Deployment.objects.get(pk=world.deployment.pk).stable_version_id == world.stable.pk
    event = AuditEvent.objects.get(action="deployment.undo")
    assert (event.actor_name, event.reason) == ("on-call", "bf16 answers worse")


def test_refusals_are_shown_next_to_the_form(world, client_for) -> None:
    client = client_for(Role.RELEASE_MANAGER)
    before = unchanged(world)
    response = client.post(UNDO, {"reason": "undo"})  # the world's rollout is running
    assert response.status_code == 409
    assert f"Rollout {world.rollout.pk} is running" in response.content.decode()
    assert 'data-testid="undo-error"' in response.content.decode()
    assert unchanged(world) == before
    promoted(world)
    before = unchanged(world)
    response = client.post(UNDO, {"reason": "  "})
    assert response.status_code == 400
    assert "A reason is required." in response.content.decode()
    assert unchanged(world) == before


def test_viewers_may_not_undo(world, client_for) -> None:
    promoted(world)
    before = unchanged(world)
    assert client_for(Role.VIEWER).post(UNDO, {"reason": "undo"}).status_code == 403
    assert unchanged(world) == before


def test_undo_requires_a_csrf_token(world, client_for) -> None:
    promoted(world)
    before = unchanged(world)
    client = client_for(Role.ON_CALL, enforce_csrf_checks=True)
    assert client.post(UNDO, {"reason": "undo"}).status_code == 403
    assert unchanged(world) == before


def test_the_page_shows_replicas_and_each_scaling_decision(world, client_for) -> None:
    replicas.deployment_replicas_set(
        actor=world.users[Role.RELEASE_MANAGER],
        deployment=world.deployment,
        stable_min=2,
        stable_max=3,
        reason="peak hours",
    )
    html = client_for(Role.VIEWER).get(PAGE).content.decode()
    assert 'data-role="stable"' in html and 'data-role="canary"' in html
    assert '<td data-testid="desired-replicas">2</td>' in html
    assert "bounds set to 2..3: peak hours" in html
