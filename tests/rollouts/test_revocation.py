"""Revoking a version stops it being served: its rollout ends with the reason, it leaves
the routing table, its agents are drained, and no transition gives it traffic again."""

import pytest
from django.utils import timezone

from contracts.commands import CommandKind, commands_stream, parse_command
from contracts.routing import parse_routing_table, routing_key
from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.registry.models import ModelVersion
from controlplane.rollouts import decisions, deployments, reconciler, transitions
from controlplane.rollouts.models import AnalysisRun, Rollout
from tests.rollouts.conftest import running_rollout
from tests.rollouts.test_reconciler import agent


@pytest.fixture(autouse=True)
def drain_at_once(settings) -> None:
    settings.ROLLOUTS_DRAIN_GRACE_S = 0


def weights(redis_client) -> dict[int, int]:
    table = parse_routing_table(redis_client.get(routing_key("smollm2")))
    return {version.version_id: version.weight for version in table.versions}


def revoke(api, version: ModelVersion, reason: str = "weights leaked") -> None:
    response = api(Role.RELEASE_MANAGER).post(
        f"/api/v1/versions/{version.pk}/revoke/", {"reason": reason}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "revoked"


def rollout_actions(rollout: Rollout) -> list[tuple[str, bool]]:
    events = AuditEvent.objects.filter(object_type="rollout", object_id=str(rollout.pk))
    return [(event.action, event.actor_id is None) for event in events.order_by("id")]


def test_revoking_the_canary_rolls_its_rollout_back_and_drains_it(
    api, deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    rollout = running_rollout(deployment, candidate)
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {stable.pk: 95, candidate.pk: 5}

    revoke(api, candidate)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)

    rollout.refresh_from_db()
    assert rollout.state == "rolled_back"
    assert rollout.state_reason == f"the candidate {candidate} was revoked: weights leaked"
    assert weights(redis_client) == {stable.pk: 100}
    assert rollout_actions(rollout)[-1] == ("rollout.rollback", True)  # decided by the system
    # The agent that served it is told to drain that version.
    assert report.drains == ["gpu-1"]
    [(_, fields)] = redis_client.xrange(commands_stream("gpu-1"))
    command = parse_command(fields)
    assert (command.kind, command.payload) == (CommandKind.DRAIN, {"version_id": candidate.pk})


def test_no_transition_gives_a_revoked_candidate_traffic(api, deployment, versions) -> None:
    _, candidate = versions
    rollout = running_rollout(deployment, candidate)
    revoke(api, candidate)
    manager = api(Role.RELEASE_MANAGER)
    url = f"/api/v1/rollouts/{rollout.pk}"
    before = Rollout.objects.get(pk=rollout.pk).snapshot()
    audited = AuditEvent.objects.count()
    for body in [{"reason": "next stage"}, {"reason": "ship it", "full": True}]:
        response = manager.post(f"{url}/promote/", body, format="json")
        assert response.status_code == 409, response.json()
        assert response.json()["error"]["code"] == "candidate_not_deployable"
    assert Rollout.objects.get(pk=rollout.pk).snapshot() == before
    assert AuditEvent.objects.count() == audited

    # Paused before the reconciler saw the revocation: it cannot be resumed either.
    transitions.rollout_pause(actor=None, rollout_id=rollout.pk, reason="look first")
    response = manager.post(f"{url}/resume/", {"reason": "carry on"}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "candidate_not_deployable"
    assert Rollout.objects.get(pk=rollout.pk).state == "paused"


def test_the_analysis_tick_rolls_back_instead_of_judging(deployment, versions) -> None:
    _, candidate = versions
    rollout = running_rollout(deployment, candidate)
    ModelVersion.objects.filter(pk=candidate.pk).update(status="revoked")
    assert decisions.rollout_analyze(rollout_id=rollout.pk, window_end=timezone.now()) is None
    assert Rollout.objects.get(pk=rollout.pk).state == "rolled_back"
    assert not AnalysisRun.objects.filter(rollout=rollout).exists()


def test_a_gating_rollout_of_a_revoked_candidate_fails_without_traffic(
    api, deployment, versions, suite, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    rollout = deployments.rollout_create(
        actor=None,
        deployment=deployment,
        candidate=candidate,
        required_suites=[suite],
        reason="gated",
    )
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    assert rollout.state == "gating"
    revoke(api, candidate, reason="bad artifact")
    # Until the reconciler ends it, the gate names the revocation and does not pass.
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    assert rollout.state == "gating"
    assert "the candidate is revoked" in rollout.gate_reasons
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    rollout.refresh_from_db()
    assert rollout.state == "failed"
    assert rollout.state_reason == f"the candidate {candidate} was revoked: bad artifact"
    assert weights(redis_client) == {stable.pk: 100}
    deployment.refresh_from_db()
    assert candidate.pk not in deployment.desired_routing["preload_version_ids"]


def test_a_revoked_stable_version_leaves_the_table_and_its_agents(
    api, deployment, versions, redis_client
) -> None:
    stable, _ = versions
    agent("gpu-0", stable)
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {stable.pk: 100}
    revoke(api, stable)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {}  # the gateway answers 503 for the model
    assert report.drains == ["gpu-0"]


def test_a_pending_rollout_of_a_revoked_candidate_is_aborted(api, deployment, versions) -> None:
    _, candidate = versions
    rollout = deployments.rollout_create(
        actor=None, deployment=deployment, candidate=candidate, reason="queued"
    )
    assert rollout.state == "pending"
    revoke(api, candidate)
    assert decisions.rollouts_stop_for_revoked_candidate(version_id=candidate.pk) == [rollout.pk]
    assert Rollout.objects.get(pk=rollout.pk).state == "aborted"
    # Done once: a second look ends nothing more.
    assert decisions.rollouts_stop_for_revoked_candidate(version_id=candidate.pk) == []
