"""A pass over many deployments takes them a batch at a time: their locks, their rows read
together, their loads sent together. Each replica still gets exactly one load, a deployment
another pass holds is skipped, and one that fails leaves the rest of its batch to run."""

import logging

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.fleet import services as fleet_services
from controlplane.fleet.models import Agent, AgentCommand, CommandKind
from controlplane.registry.models import Model, SigningKey
from controlplane.rollouts import deployments, reconciler
from controlplane.rollouts.models import Deployment
from tests.api.support import Signer
from tests.api.support import signer as signer  # the fixture: a trusted release key
from tests.rollouts.conftest import make_version
from tests.rollouts.test_placement import footprint, spare


def deployments_of(count: int, signer: Signer) -> list[Deployment]:
    """`count` deployments, each of its own model with one signed 1 GiB version."""
    key = SigningKey.objects.get(key_id=signer.key_id)
    made = []
    for index in range(count):
        model = Model.objects.create(name=f"model-{index}", task="chat")
        version = make_version(model, "v1", "abcdef0123456789"[index % 16])
        assert version.artifact is not None
        version.signature = signer.sign(version.artifact.digest, version.serving_config)
        version.signing_key = key
        version.footprint = footprint(1)
        version.save()
        made.append(
            deployments.deployment_create(actor=None, name=f"model-{index}", stable_version=version)
        )
    return made


def spares(count: int) -> None:
    for index in range(count):
        spare(f"agent-{index:02d}", 2)


def test_every_replica_gets_one_load_across_batches(signer, redis_client, monkeypatch) -> None:
    made = deployments_of(7, signer)
    spares(8)
    monkeypatch.setattr(reconciler, "RECONCILE_BATCH", 3)
    sends = []
    real_send = fleet_services.agent_commands_send

    def counted(**kwargs):
        sends.append(len(kwargs["orders"]))
        return real_send(**kwargs)

    monkeypatch.setattr(fleet_services, "agent_commands_send", counted)
    reports = reconciler.reconcile_deployments(
        deployment_ids=[d.pk for d in made], client=redis_client
    )
    assert sends == [3, 3, 1]  # a transaction for each batch's loads
    assert [len(report.loads) for report in reports] == [1] * 7
    loads = AgentCommand.objects.filter(kind=CommandKind.LOAD)
    assert loads.count() == 7
    assert len(set(loads.values_list("agent_id", flat=True))) == 7  # no agent twice
    assert {(r.deployment, r.loads[0][1]) for r in reports} == {
        (d.name, d.stable_version_id) for d in made
    }
    again = reconciler.reconcile_deployments(
        deployment_ids=[d.pk for d in made], client=redis_client
    )
    assert [report.loads for report in again] == [[]] * 7  # the loads in flight count
    assert loads.count() == 7


def test_a_batch_costs_the_same_statements_whatever_its_deployments(
    signer, redis_client, monkeypatch
) -> None:
    made = deployments_of(8, signer)
    Agent.objects.all().delete()  # nothing to place: routing only
    ids = [d.pk for d in made]

    def statements(deployment_ids: list[int]) -> int:
        with CaptureQueriesContext(connection) as queries:
            reconciler.reconcile_deployments(deployment_ids=deployment_ids, client=redis_client)
        return len(queries.captured_queries)

    statements(ids)  # the applied revisions are written once
    assert statements(ids[:2]) == statements(ids)


def test_a_deployment_held_by_another_pass_is_skipped_and_its_batch_runs(
    signer, redis_client, settings
) -> None:
    made = deployments_of(3, signer)
    spares(3)
    settings.ROLLOUTS_RECONCILE_LOCK_S = 1  # how long a pass waits for a lock
    other = redis_client.lock(f"rollouts:reconcile:{made[1].name}", timeout=30)
    assert other.acquire()
    try:
        reports = reconciler.reconcile_deployments(
            deployment_ids=[d.pk for d in made], client=redis_client
        )
    finally:
        other.release()
    assert [report.skipped for report in reports] == ["", "another pass holds the lock", ""]
    assert [len(report.loads) for report in reports] == [1, 0, 1]


def test_a_deployment_whose_pass_fails_leaves_the_rest_of_its_batch(
    signer, redis_client, caplog
) -> None:
    made = deployments_of(3, signer)
    spares(3)
    broken = made[1]
    Deployment.objects.filter(pk=broken.pk).update(
        desired_routing={**broken.desired_routing, "canary_version_id": ["not", "an", "id"]}
    )
    with caplog.at_level(logging.ERROR, logger="controlplane.rollouts.reconciler"):
        reports = reconciler.reconcile_deployments(
            deployment_ids=[d.pk for d in made], client=redis_client
        )
    assert [report.deployment for report in reports] == [made[0].name, made[2].name]
    assert [len(report.loads) for report in reports] == [1, 1]
    [failed] = [r for r in caplog.records if r.getMessage() == "reconcile failed"]
    assert failed.deployment_id == broken.pk
    assert failed.exc_info is not None
    with pytest.raises(TypeError):
        reconciler.reconcile_deployment(deployment_id=broken.pk, client=redis_client)
