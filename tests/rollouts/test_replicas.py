"""Replicas: the reconciler serves each version on as many agents as asked (hosts spread
first), routes to all of them, replaces a lost one on a spare agent, retires the extra
ones after a scale-down; the bounds are validated and every change is recorded."""

from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from contracts.commands import CommandKind, commands_stream, parse_command
from controlplane.audit.models import AuditEvent
from controlplane.core.errors import DomainError
from controlplane.fleet.models import Agent
from controlplane.registry.models import Model, ModelVersion, SigningKey
from controlplane.rollouts import deployments, reconciler, scaling
from controlplane.rollouts.models import Deployment, ReplicaRole, ScalingDecision
from controlplane.rollouts.replicas import deployment_replicas_set, replicas_scale
from tests.api.support import Signer
from tests.fleet.support import heartbeat
from tests.rollouts.conftest import make_version, running_rollout
from tests.rollouts.test_reconciler import agent as serving_agent
from tests.rollouts.test_reconciler import load, table


def signed(*versions: ModelVersion) -> None:
    """Sign versions with a trusted key, as the fleet requires before it loads one."""
    signer = Signer("release-key", Ed25519PrivateKey.generate())
    key = SigningKey.objects.create(
        key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
    )
    for version in versions:
        ModelVersion.objects.filter(pk=version.pk).update(
            signature=signer.sign(str(version.artifact_id), version.serving_config),
            signing_key=key,
        )


def idle(name: str, host: str) -> Agent:
    now = timezone.now()
    return Agent.objects.create(
        name=name, host=host, state="idle", last_seen=now, registered_at=now
    )


def serving(name: str, version: ModelVersion, host: str) -> Agent:
    made = serving_agent(name, version)
    Agent.objects.filter(pk=made.pk).update(host=host)
    made.refresh_from_db()
    return made


def loads_sent(redis_client, *names: str) -> dict[str, int]:
    """Agent name -> the version a load sent to it names."""
    sent = {}
    for name in names:
        for _, fields in redis_client.xrange(commands_stream(name)):
            command = parse_command(fields)
            if command.kind == CommandKind.LOAD:
                sent[name] = int(command.payload["version_id"])
    return sent


def two_replicas(deployment: Deployment) -> Deployment:
    return deployment_replicas_set(
        actor=None, deployment=deployment, stable_min=2, stable_max=2, reason="test: two"
    )


def test_a_second_replica_goes_to_another_host_first(deployment, versions, redis_client) -> None:
    stable, _ = versions
    signed(stable)
    serving("gpu-0", stable, host="host-a")
    idle("gpu-1", host="host-a")
    idle("gpu-2", host="host-b")
    two_replicas(deployment)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-2", stable.pk)]
    assert loads_sent(redis_client, "gpu-1", "gpu-2") == {"gpu-2": stable.pk}
    # A load under way counts: the next pass sends none.
    again = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert again.loads == []


def test_every_ready_replica_is_routed(deployment, versions, redis_client) -> None:
    stable, _ = versions
    first = serving("gpu-0", stable, host="host-a")
    second = serving("gpu-1", stable, host="host-b")
    two_replicas(deployment)
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    [route] = table(redis_client).versions
    assert set(route.endpoints) == {first.endpoint, second.endpoint}
    assert set(route.endpoint_secrets) == {first.endpoint, second.endpoint}


def test_a_lost_replica_is_replaced_on_a_spare_agent(deployment, versions, redis_client) -> None:
    stable, _ = versions
    signed(stable)
    kept = serving("gpu-0", stable, host="host-a")
    lost = serving("gpu-1", stable, host="host-b")
    idle("gpu-2", host="host-c")
    two_replicas(deployment)
    assert (
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client).loads
        == []
    )

    Agent.objects.filter(pk=lost.pk).update(last_seen=timezone.now() - timedelta(seconds=60))
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-2", stable.pk)]
    [route] = table(redis_client).versions
    assert route.endpoints == (kept.endpoint,)  # the lost one is out of the table at once


@override_settings(ROLLOUTS_DRAIN_GRACE_S=0)
def test_after_a_scale_down_the_extra_replica_leaves_the_table_then_drains(
    deployment, versions, redis_client
) -> None:
    stable, _ = versions
    agents = [serving(f"gpu-{i}", stable, host=f"host-{i}") for i in range(3)]
    deployment_replicas_set(
        actor=None, deployment=deployment, stable_min=3, stable_max=3, reason="test: three"
    )
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert len(table(redis_client).versions[0].endpoints) == 3

    deployment_replicas_set(
        actor=None, deployment=deployment, stable_min=2, stable_max=2, reason="test: two"
    )
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    [route] = table(redis_client).versions
    assert set(route.endpoints) == {agents[0].endpoint, agents[1].endpoint}
    assert report.drains == ["gpu-2"]
    [(_, fields)] = redis_client.xrange(commands_stream("gpu-2"))
    assert parse_command(fields).payload == {"version_id": stable.pk}


def test_a_pass_over_every_deployment_reads_the_fleet_once_and_gives_each_agent_one_load(
    deployment, versions, redis_client
) -> None:
    stable, _ = versions
    other = make_version(Model.objects.create(name="other", task="chat"), "f32", "c")
    signed(stable, other)
    second = deployments.deployment_create(actor=None, name="other", stable_version=other)
    two_replicas(deployment)
    for index in range(4):
        idle(f"gpu-{index}", host=f"host-{index % 2}")
    with CaptureQueriesContext(connection) as queries:
        reports = reconciler.reconcile_deployments(
            deployment_ids=[deployment.pk, second.pk], client=redis_client
        )
    # The second deployment sees the first one's loads: gpu-0 and gpu-1 are taken.
    assert [report.loads for report in reports] == [
        [("gpu-0", stable.pk), ("gpu-1", stable.pk)],
        [("gpu-2", other.pk)],
    ]
    fleet_reads = [
        query["sql"]
        for query in queries.captured_queries
        if 'FROM "fleet_agent"' in query["sql"] and "WHERE" not in query["sql"]
    ]
    assert len(fleet_reads) == 1
    again = reconciler.reconcile_deployments(
        deployment_ids=[deployment.pk, second.pk], client=redis_client
    )
    assert [report.loads for report in again] == [[], []]


def test_a_rollout_asks_for_its_canary_replicas(deployment, versions, redis_client) -> None:
    stable, candidate = versions
    signed(candidate)
    serving("gpu-0", stable, host="host-a")
    for index in range(1, 4):
        idle(f"gpu-{index}", host=f"host-{index}")
    running_rollout(deployment, candidate, canary_replicas_min=2, canary_replicas_max=4)
    deployment.refresh_from_db()
    assert deployment.desired_routing["replicas"] == {str(stable.pk): 1, str(candidate.pk): 2}
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert sorted(report.loads) == [("gpu-1", candidate.pk), ("gpu-2", candidate.pk)]


@pytest.mark.parametrize(
    ("low", "high", "field"),
    [
        (0, 2, "stable_replicas_min"),
        (2, 1, "stable_replicas_min"),
        (1, 65, "stable_replicas_max"),
        (True, 2, "stable_replicas_min"),
        ("2", 2, "stable_replicas_min"),
    ],
)
def test_bad_bounds_are_refused_and_change_nothing(deployment, low, high, field) -> None:
    before = Deployment.objects.get(pk=deployment.pk)
    with pytest.raises(DomainError) as raised:
        deployment_replicas_set(
            actor=None, deployment=deployment, stable_min=low, stable_max=high, reason="test"
        )
    assert raised.value.code == "invalid_replicas"
    assert field in raised.value.fields
    after = Deployment.objects.get(pk=deployment.pk)
    assert (after.stable_replicas_min, after.stable_replicas_max, after.routing_revision) == (
        before.stable_replicas_min,
        before.stable_replicas_max,
        before.routing_revision,
    )


def test_new_bounds_move_the_count_recorded_with_the_reason(deployment, versions) -> None:
    deployment_replicas_set(
        actor=None, deployment=deployment, stable_min=2, stable_max=4, reason="peak hours"
    )
    deployment.refresh_from_db()
    assert deployment.stable_replicas == 2
    [decision] = ScalingDecision.objects.filter(deployment=deployment)
    assert (decision.role, decision.previous_replicas, decision.replicas) == ("stable", 1, 2)
    assert "peak hours" in decision.reason
    event = AuditEvent.objects.filter(action="deployment.replicas").latest("id")
    assert event.after["stable_replicas_max"] == 4


def test_a_scaling_decision_applies_only_to_the_count_it_saw(deployment, versions) -> None:
    deployment_replicas_set(
        actor=None, deployment=deployment, stable_min=1, stable_max=4, reason="test"
    )
    applied = replicas_scale(
        deployment_id=deployment.pk,
        role=ReplicaRole.STABLE,
        expected=1,
        replicas=3,
        reason="waiting 9.0 per replica > 4.0",
        figures={"waiting_per_replica": 9.0},
    )
    assert applied is not None
    deployment.refresh_from_db()
    assert deployment.stable_replicas == 3
    assert deployment.desired_routing["replicas"][str(deployment.stable_version_id)] == 3
    stale = replicas_scale(
        deployment_id=deployment.pk,
        role=ReplicaRole.STABLE,
        expected=1,
        replicas=2,
        reason="stale",
        figures={},
    )
    assert stale is None
    deployment.refresh_from_db()
    assert deployment.stable_replicas == 3


def test_the_api_sets_bounds_for_steering_roles_only(deployment, api) -> None:
    url = f"/api/v1/deployments/{deployment.name}/replicas/"
    body = {"stable_replicas_min": 2, "stable_replicas_max": 3, "reason": "more room"}
    assert api("viewer").post(url, body, format="json").status_code == 403
    assert api("on_call").post(url, body, format="json").status_code == 403
    bad = api("release_manager").post(url, {**body, "stable_replicas_max": 1}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_replicas", bad.json()
    answer = api("release_manager").post(url, body, format="json")
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["stable_replicas"], answer.json()["stable_replicas_max"]) == (2, 3)
    decisions = api("viewer").get(f"/api/v1/deployments/{deployment.name}/scaling-decisions/")
    assert [d["replicas"] for d in decisions.json()["results"]] == [2]


def busy_replica(name: str, version: ModelVersion, host: str, waiting: int) -> Agent:
    """A ready agent whose latest heartbeat reports `waiting` queued requests."""
    made = serving(name, version, host)
    figures = heartbeat(name, waiting=waiting, running=4, kv_cache_usage=0.6).figures()
    Agent.objects.filter(pk=made.pk).update(figures=figures)
    return made


def test_the_autoscaler_scales_up_under_a_queue_with_its_reason_once_per_cooldown(
    deployment, versions
) -> None:
    stable, _ = versions
    deployment_replicas_set(
        actor=None,
        deployment=deployment,
        stable_min=2,
        stable_max=8,
        autoscaling={"enabled": True, "scale_up_cooldown_s": 600},
        reason="test: autoscale",
    )
    Deployment.objects.filter(pk=deployment.pk).update(
        created_at=timezone.now() - timedelta(hours=1)
    )
    ScalingDecision.objects.all().update(created_at=timezone.now() - timedelta(hours=1))
    busy_replica("gpu-0", stable, "host-a", waiting=10)
    busy_replica("gpu-1", stable, "host-b", waiting=10)

    [outcome] = scaling.autoscale_all()
    assert outcome.applied and outcome.decision.desired == 5
    deployment.refresh_from_db()
    assert deployment.stable_replicas == 5
    assert deployment.desired_routing["replicas"] == {str(stable.pk): 5}
    decision = ScalingDecision.objects.filter(deployment=deployment).latest("id")
    assert decision.actor is None and (decision.previous_replicas, decision.replicas) == (2, 5)
    assert decision.reason == "waiting 10.0 per replica > 4.0 on 2 replicas: 2 -> 5"
    assert decision.figures["waiting_per_replica"] == 10.0
    event = AuditEvent.objects.filter(action="deployment.scale").latest("id")
    assert event.actor is None and event.reason == decision.reason

    # The replicas on their way cover the same queue; a longer one waits for the cooldown.
    [again] = scaling.autoscale_all()
    assert not again.applied and again.decision.direction == "hold"
    assert "3 replicas still loading will cover it" in again.decision.reason
    Agent.objects.update(figures=heartbeat(waiting=30, running=4, kv_cache_usage=0.6).figures())
    [longer] = scaling.autoscale_all()
    assert not longer.applied and "scale-up cooldown (600.0 s)" in longer.decision.reason
    assert ScalingDecision.objects.filter(deployment=deployment).count() == 2


def test_a_deployment_without_a_policy_is_not_scaled(deployment, versions) -> None:
    busy_replica("gpu-0", versions[0], "host-a", waiting=50)
    assert scaling.autoscale_all() == []
    deployment.refresh_from_db()
    assert deployment.stable_replicas == 1


def test_a_bad_policy_is_refused_and_changes_nothing(deployment) -> None:
    with pytest.raises(DomainError) as raised:
        deployment_replicas_set(
            actor=None,
            deployment=deployment,
            stable_min=1,
            stable_max=2,
            autoscaling={"enabled": True, "kv_cache_high": 2},
            reason="test",
        )
    assert raised.value.code == "invalid_autoscaling"
    assert "kv_cache_high" in raised.value.fields
    deployment.refresh_from_db()
    assert (deployment.stable_replicas_max, deployment.autoscaling) == (1, {})


def test_a_spare_agent_whose_load_failed_is_tried_last(deployment, versions, redis_client) -> None:
    stable, _ = versions
    signed(stable)
    serving("gpu-0", stable, host="host-a")
    failing = idle("gpu-1", host="host-b")
    idle("gpu-2", host="host-b")
    load(failing, stable, finished_ago_s=5, status="failed")
    two_replicas(deployment)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-2", stable.pk)]
