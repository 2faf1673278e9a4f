"""Whose fault a failure is, on live traffic: a tenant's bad requests never roll back a
healthy canary; the canary's own server faults still do, through ingest's fast path.

Real engines (the canary on the second), a real gateway, the real ingest handler and
the rollout services on PostgreSQL; the fault is the engine's own error injector.
"""

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from controlplane.registry.models import ModelVersion
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import Rollout
from controlplane.rollouts.routing import routing_table_publish
from controlplane.telemetry.models import RequestSample
from controlplane.tenants.models import UsageRecord
from tests.gateway.conftest import (
    admin_headers,
    client_for,
    endpoint_secrets,
    error_body,
    ingest_all,
    make_setup,
    wait_for_model,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]


def set_faults(engine: str, error_rate: float) -> None:
    response = httpx.post(
        f"{engine}/admin/faults",
        json={"latency_ms_per_token": 0, "error_rate": error_rate},
        headers=admin_headers(engine),
        timeout=10,
    )
    assert response.status_code == 200, response.text


def test_tenant_errors_spare_a_healthy_canary_and_server_faults_roll_it_back(
    stores, engines, gateways
) -> None:
    hostile = make_setup()
    stable, candidate = hostile.versions
    ModelVersion.objects.filter(pk__in=[stable.pk, candidate.pk]).update(status="verified")
    stable.refresh_from_db()
    candidate.refresh_from_db()
    deployment = deployments.deployment_create(actor=None, name="smollm2", stable_version=stable)
    rollout = deployments.rollout_create(
        actor=None,
        deployment=deployment,
        candidate=candidate,
        reason="test",
        stages=[{"weight": 50, "min_duration_s": 600, "min_requests": 20}],
    )
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    assert rollout.state == "running"
    routing_table_publish(  # as the reconciler would, with the canary on the second engine
        deployment="smollm2",
        model="smollm2",
        versions=[
            {
                "version_id": stable.pk,
                "label": "v1",
                "weight": 50,
                "endpoints": [engines[0]],
                "endpoint_secrets": endpoint_secrets([engines[0]]),
            },
            {
                "version_id": candidate.pk,
                "label": "v2",
                "weight": 50,
                "endpoints": [engines[1]],
                "endpoint_secrets": endpoint_secrets([engines[1]]),
            },
        ],
        # this tenant's every request on the canary (a tenant-scoped stage's routing)
        tenant_weights={hostile.tenant.slug: {stable.pk: 0, candidate.pk: 100}},
    )
    gateway = gateways[0]
    wait_for_model(gateway, hostile.raw_key, "smollm2")
    client = client_for(gateway, hostile.raw_key)

    # A tenant's bad requests at a high rate: refused by the gateway (never recorded) or
    # by the engine (recorded with their cause, not as the version's errors).
    for _ in range(30):
        with pytest.raises(openai.BadRequestError) as at_gateway:
            client.chat.completions.create(model="smollm2", messages=MESSAGES, seed=2**64)
        assert error_body(at_gateway.value)["param"] == "seed"
        with pytest.raises(openai.BadRequestError) as at_engine:
            client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=10_000)
        assert error_body(at_engine.value)["code"] == "context_length_exceeded"
    ingest_all(stores)

    samples = RequestSample.objects.all()
    assert (
        list(samples.values_list("version_id", "status", "is_error", "error_code"))
        == [(candidate.pk, 400, False, "context_length_exceeded")] * 30
    )
    assert sum(UsageRecord.objects.values_list("errors", flat=True)) == 0
    assert Rollout.objects.get(pk=rollout.pk).state == "running"

    # The canary's engine fails every request: a server fault, which rolls it back.
    set_faults(engines[1], 1.0)
    try:
        failures = 0
        while failures < 20:  # the fast path's window
            try:
                client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
            except openai.InternalServerError as exc:
                assert error_body(exc)["code"] == "injected_fault"
                failures += 1
    finally:
        set_faults(engines[1], 0.0)
    ingest_all(stores)

    rollout = Rollout.objects.get(pk=rollout.pk)
    assert rollout.state == "rolled_back"
    assert rollout.state_reason.startswith("hard breach: error rate 1.00 in the last 20")
    faults = RequestSample.objects.filter(version_id=candidate.pk, is_error=True)
    assert set(faults.values_list("status", "error_code")) == {(500, "injected_fault")}
