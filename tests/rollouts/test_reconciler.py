"""The reconciler writes the gateway's routing table from the database, ready agents only."""

import uuid
from datetime import timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.test import override_settings
from django.utils import timezone

from contracts.commands import CommandKind, commands_stream, parse_command, parse_load_payload
from contracts.routing import ROUTING_INDEX_KEY, parse_routing_table, routing_key
from controlplane.core.errors import DomainError
from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.registry.models import ModelVersion, SigningKey
from controlplane.rollouts import deployments, reconciler, transitions
from controlplane.rollouts.models import Deployment, Rollout
from tests.api.support import Signer
from tests.fleet.support import mark_endpoint_verified
from tests.rollouts.conftest import running_rollout


def agent(name: str, version, state: str = "ready", seen_ago_s: float = 1.0) -> Agent:
    """An agent serving `version` since a load that succeeded an hour ago (its engine's
    secrets derive from that command)."""
    now = timezone.now()
    endpoint = f"http://127.0.0.1:{9000 + Agent.objects.count()}"
    created = Agent.objects.create(
        name=name,
        host="localhost",
        endpoint=endpoint,
        endpoints=[endpoint],
        state=state,
        loaded_version=version,
        last_seen=now - timedelta(seconds=seen_ago_s),
        registered_at=now,
    )
    mark_endpoint_verified(created, load(created, version, finished_ago_s=3600))
    created.refresh_from_db()
    return created


def load(
    on: Agent, version, *, finished_ago_s: float | None, status: str = "succeeded"
) -> AgentCommand:
    """A load command, created now (after the ones before it); None: not finished."""
    return AgentCommand.objects.create(
        command_id=uuid.uuid4().hex,
        agent=on,
        kind="load",
        version=version,
        status=status,
        finished_at=None
        if finished_ago_s is None
        else timezone.now() - timedelta(seconds=finished_ago_s),
    )


def secrets_of(command: AgentCommand) -> tuple[str, str]:
    """(serving, admin) as the engine started for this load command requires them."""
    payload = engine_secrets_payload(agent_name=command.agent.name, command_id=command.command_id)
    return payload["serving_secret"], payload["admin_secret"]


def table(redis_client, name="smollm2"):
    return parse_routing_table(redis_client.get(routing_key(name)))


def weights(redis_client) -> dict[int, tuple[int, tuple[str, ...]]]:
    return {v.version_id: (v.weight, v.endpoints) for v in table(redis_client).versions}


def test_stable_only_then_canary_when_its_agent_is_ready(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {stable.pk: (100, ("http://127.0.0.1:9000",))}
    assert table(redis_client).model == "smollm2"

    running_rollout(deployment, candidate)
    canary = agent("gpu-1", candidate, state="warming")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {stable.pk: (100, ("http://127.0.0.1:9000",))}  # not ready

    Agent.objects.filter(pk=canary.pk).update(state="ready")
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {
        stable.pk: (95, ("http://127.0.0.1:9000",)),
        candidate.pk: (5, ("http://127.0.0.1:9001",)),
    }
    # each version's context bounds the tokens the gateway reserves for a request
    assert [v.max_model_len for v in table(redis_client).versions] == [2048, 2048]
    deployment.refresh_from_db()
    assert deployment.applied_revision == deployment.routing_revision == report.revision


def test_a_stale_heartbeat_is_not_ready(deployment, versions, redis_client) -> None:
    agent("gpu-0", versions[0], seen_ago_s=60)
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {versions[0].pk: (100, ())}


def test_reconcile_repairs_a_lost_write_and_is_idempotent(
    deployment, versions, redis_client
) -> None:
    agent("gpu-0", versions[0])
    agent("gpu-1", versions[1])
    rollout = running_rollout(deployment, versions[1])
    transitions.rollout_rollback(actor=None, rollout_id=rollout.pk, reason="drill")
    # The transition committed but its reconcile never ran (a crash): Redis is stale or empty.
    redis_client.delete(routing_key("smollm2"))
    for _ in range(2):
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert weights(redis_client) == {versions[0].pk: (100, ("http://127.0.0.1:9000",))}
    # The same table is not written again: gateways re-read only what changed.
    first = table(redis_client).generation
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert table(redis_client).generation == first
    # A table dropped from the index, or changed behind the reconciler's back, is written.
    redis_client.srem(ROUTING_INDEX_KEY, "smollm2")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert table(redis_client).generation == first + 1
    assert redis_client.sismember(ROUTING_INDEX_KEY, "smollm2")
    redis_client.set(routing_key("smollm2"), "{}")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {versions[0].pk: (100, ("http://127.0.0.1:9000",))}


def test_every_canary_agent_lost_rolls_back(deployment, versions, redis_client) -> None:
    agent("gpu-0", versions[0])
    agent("gpu-1", versions[1], state="lost")
    rollout = running_rollout(deployment, versions[1])
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.rolled_back is True
    assert Rollout.objects.get(pk=rollout.pk).state == "rolled_back"
    assert Rollout.objects.get(pk=rollout.pk).state_reason == (
        "hard breach: every canary agent is lost: gpu-1"
    )
    assert weights(redis_client) == {versions[0].pk: (100, ("http://127.0.0.1:9000",))}
    assert Deployment.objects.get().desired_routing["canary_weight"] == 0


def test_a_tenant_scoped_stage_splits_only_the_named_tenants(
    deployment, versions, tenant, redis_client
) -> None:
    stable, candidate = versions
    tenant.allowed_models.add(candidate.model)
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    stages = [
        {"weight": 50, "min_duration_s": 60, "tenants": [tenant.slug]},
        {"weight": 100, "min_duration_s": 60},
    ]
    rollout = running_rollout(deployment, candidate, stages=stages)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)

    published = table(redis_client)
    # Every other tenant stays on the stable version; the canary is listed, unweighted.
    assert weights(redis_client) == {
        stable.pk: (100, ("http://127.0.0.1:9000",)),
        candidate.pk: (0, ("http://127.0.0.1:9001",)),
    }
    assert published.tenant_weights == {tenant.slug: {stable.pk: 50, candidate.pk: 50}}
    assert published.weights_for(tenant.slug) == {stable.pk: 50, candidate.pk: 50}
    assert published.weights_for("globex") == {stable.pk: 100, candidate.pk: 0}
    assert report.weights == {stable.pk: 100, candidate.pk: 0}

    # The next stage serves everyone: the tenant weights go.
    transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert weights(redis_client) == {candidate.pk: (100, ("http://127.0.0.1:9001",))}
    assert table(redis_client).tenant_weights == {}


def test_a_shadow_stage_publishes_the_candidate_as_a_shadow_beside_a_stable_at_100(
    deployment, versions, tenant, redis_client
) -> None:
    stable, candidate = versions
    tenant.allowed_models.add(candidate.model)
    agent("gpu-0", stable)
    agent("gpu-1", candidate)
    stages = [
        {"weight": 30, "min_duration_s": 60, "shadow": True},
        {"weight": 40, "min_duration_s": 60, "shadow": True, "tenants": [tenant.slug]},
        {"weight": 100, "min_duration_s": 60},
    ]
    rollout = running_rollout(deployment, candidate, stages=stages)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)

    published = table(redis_client)
    assert [(v.version_id, v.role, v.weight, v.endpoints) for v in published.versions] == [
        (stable.pk, "stable", 100, ("http://127.0.0.1:9000",)),
        (candidate.pk, "shadow", 30, ("http://127.0.0.1:9001",)),
    ]
    assert set(published.versions[1].endpoint_secrets) == {"http://127.0.0.1:9001"}
    assert published.weights_for(None) == {stable.pk: 100}  # the shadow never answers
    assert published.shadow_shares_for(None) == [(published.versions[1], 30)]
    assert report.weights == {stable.pk: 100, candidate.pk: 30}

    # A tenant-scoped shadow stage mirrors the named tenants' requests only.
    transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    published = table(redis_client)
    assert [(v.version_id, v.role, v.weight) for v in published.versions] == [
        (stable.pk, "stable", 100),
        (candidate.pk, "shadow", 0),
    ]
    assert published.tenant_weights == {tenant.slug: {stable.pk: 100, candidate.pk: 40}}
    assert published.weights_for(tenant.slug) == {stable.pk: 100}
    assert published.shadow_shares_for(tenant.slug) == [(published.versions[1], 40)]
    assert published.shadow_shares_for("globex") == []

    # The last stage serves the candidate: an answering canary again.
    transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    published = table(redis_client)
    assert [(v.version_id, v.role, v.weight) for v in published.versions] == [
        (candidate.pk, "canary", 100)
    ]


def test_a_stage_naming_an_unknown_tenant_is_refused(deployment, versions, tenant) -> None:
    stages: list[dict[str, Any]] = [{"weight": 50, "tenants": ["acme", "nobody"]}, {"weight": 100}]
    with pytest.raises(DomainError) as refused:
        deployments.rollout_create(
            actor=None, deployment=deployment, candidate=versions[1], stages=stages, reason="t"
        )
    assert refused.value.code == "invalid_stages"
    assert "nobody" in str(refused.value.message)
    assert not Rollout.objects.exists()


@override_settings(ROLLOUTS_DRAIN_GRACE_S=0)
def test_an_unneeded_version_is_drained_by_name_unless_its_row_may_be_stale(
    deployment, versions, redis_client
) -> None:
    stable, old = versions
    agent("gpu-0", stable)
    spare = agent("gpu-1", old)
    # A load on gpu-1 finished a moment ago: its heartbeat row may predate it. No drain.
    AgentCommand.objects.create(
        command_id="c" * 32,
        agent=spare,
        kind="load",
        version=old,
        status="succeeded",
        finished_at=timezone.now() - timedelta(seconds=1),
    )
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.drains == []
    assert list(redis_client.xrange(commands_stream("gpu-1"))) == []

    AgentCommand.objects.filter(agent=spare).update(
        finished_at=timezone.now() - timedelta(seconds=60)
    )
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.drains == ["gpu-1"]
    [(_, fields)] = redis_client.xrange(commands_stream("gpu-1"))
    command = parse_command(fields)
    # The drain names the version it means; an agent serving another one keeps it.
    assert (command.kind, command.payload) == (CommandKind.DRAIN, {"version_id": old.pk})


def test_each_endpoint_carries_its_engines_serving_secret_and_never_the_admin_one(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    Deployment.objects.filter(pk=deployment.pk).update(
        desired_routing={**deployment.desired_routing, "replicas": {str(stable.pk): 2}}
    )
    gpu0 = agent("gpu-0", stable)
    gpu1 = agent("gpu-1", stable)
    first = AgentCommand.objects.get(agent=gpu0)
    # gpu-0 loaded the stable version again since (a new engine, new secrets); a later
    # load that failed, and a load of another version, leave its engine's secret alone.
    newer = load(gpu0, stable, finished_ago_s=600)
    load(gpu0, stable, finished_ago_s=300, status="failed")
    load(gpu0, candidate, finished_ago_s=1200)
    # gpu-1 reports the engine of a load whose result is not in yet (it follows the old
    # engine's drain): that load's secret.
    in_flight = load(gpu1, stable, finished_ago_s=None, status="accepted")
    # gpu-2 is ready but no load of its version is recorded: its engine's secret is unknown.
    unknown = agent("gpu-2", stable)
    AgentCommand.objects.filter(agent=unknown).delete()
    # Both engines proved themselves for the loads that started them.
    mark_endpoint_verified(gpu0, newer)
    mark_endpoint_verified(gpu1, in_flight)

    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    raw = redis_client.get(routing_key("smollm2"))
    [route] = table(redis_client).versions
    assert route.endpoints == (gpu0.endpoint, gpu1.endpoint)
    assert dict(route.endpoint_secrets) == {
        gpu0.endpoint: secrets_of(newer)[0],
        gpu1.endpoint: secrets_of(in_flight)[0],
    }
    for command in AgentCommand.objects.filter(kind="load"):
        serving, admin = secrets_of(command)
        assert admin not in raw
        assert (serving in raw) == (command.pk in {newer.pk, in_flight.pk})
    assert secrets_of(first)[0] not in raw
    assert unknown.endpoint not in raw


def test_a_load_command_carries_the_secrets_only_on_the_stream(
    deployment, versions, redis_client
) -> None:
    stable, candidate = versions
    agent("gpu-0", stable)
    spare = Agent.objects.create(
        name="gpu-1",
        host="localhost",
        endpoint="http://127.0.0.1:9001",
        state="idle",
        last_seen=timezone.now(),
        registered_at=timezone.now(),
    )
    signer = Signer("release-key", Ed25519PrivateKey.generate())
    key = SigningKey.objects.create(
        key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
    )
    ModelVersion.objects.filter(pk=candidate.pk).update(
        signature=signer.sign(candidate.artifact_id, candidate.serving_config), signing_key=key
    )
    Deployment.objects.filter(pk=deployment.pk).update(
        desired_routing={**deployment.desired_routing, "preload_version_ids": [candidate.pk]}
    )
    # Tenants send the model's name, not the deployment's: the engine must serve under it.
    Deployment.objects.filter(pk=deployment.pk).update(name="chat-prod")
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("gpu-1", candidate.pk)]
    [(_, fields)] = redis_client.xrange(commands_stream("gpu-1"))
    wire = parse_command(fields)
    assert wire.payload["served_model_name"] == table(redis_client, "chat-prod").model == "smollm2"
    command = AgentCommand.objects.get(agent=spare)
    serving, admin = secrets_of(command)
    assert (wire.payload["serving_secret"], wire.payload["admin_secret"]) == (serving, admin)
    assert parse_load_payload(wire.payload).serving_secret == serving
    # The recorded payload (which the API shows) holds neither.
    assert set(wire.payload) - set(command.payload) == {"serving_secret", "admin_secret"}
