"""The reconciler places a version only on an agent whose memory holds it, and says why
not, with the figures, where an operator looks (the deployment in the API)."""

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from contracts.commands import commands_stream, parse_command, parse_load_payload
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.registry.models import ModelVersion, SigningKey
from controlplane.rollouts import reconciler
from controlplane.rollouts.models import Deployment
from tests.api.support import Signer
from tests.rollouts.test_reconciler import agent as serving_agent

GIB = 2**30


def footprint(total_gib: float) -> dict[str, Any]:
    """A stored footprint of `total_gib`: weights 1/4, KV 2/3, headroom the rest."""
    total = int(total_gib * GIB)
    weights, kv = total // 4, total * 2 // 3
    return {
        "weight_bytes": weights,
        "kv_bytes": kv,
        "headroom_bytes": total - weights - kv,
        "total_bytes": total,
        "parameters": weights // 2,
        "bytes_per_parameter": 2.0,
        "kv_bytes_per_token": 23_040,
        "kv_tokens": kv // 23_040,
        "kv_basis": "max_model_len x max_num_seqs",
    }


def spare(name: str, offered_gib: float, *, total_gib: float = 64, **inventory: Any) -> Agent:
    now = timezone.now()
    return Agent.objects.create(
        name=name,
        host="host-a",
        state="idle",
        last_seen=now,
        registered_at=now,
        inventory={
            "kind": "cpu",
            "memory_total_bytes": int(total_gib * GIB),
            "memory_available_bytes": int(total_gib * GIB),
            "memory_offered_bytes": int(offered_gib * GIB),
            **inventory,
        },
    )


@pytest.fixture
def candidate(deployment, versions) -> ModelVersion:
    """The candidate, signed and named for preloading: the reconciler must place it."""
    _, candidate = versions
    signer = Signer("release-key", Ed25519PrivateKey.generate())
    key = SigningKey.objects.create(
        key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
    )
    ModelVersion.objects.filter(pk=candidate.pk).update(
        signature=signer.sign(candidate.artifact_id, candidate.serving_config),
        signing_key=key,
        footprint=footprint(1.5),
    )
    Deployment.objects.filter(pk=deployment.pk).update(
        desired_routing={**deployment.desired_routing, "preload_version_ids": [candidate.pk]}
    )
    candidate.refresh_from_db()
    return candidate


def test_the_smallest_agent_that_holds_the_version_gets_it_with_its_footprint(
    deployment, versions, candidate, redis_client
) -> None:
    serving_agent("gpu-0", versions[0])
    spare("small", 1)
    spare("large", 8)
    spare("medium", 2)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("medium", candidate.pk)]
    assert report.unplaced == []
    [(_, fields)] = redis_client.xrange(commands_stream("medium"))
    load = parse_load_payload(parse_command(fields).payload)
    assert load.footprint_bytes == int(1.5 * GIB)


def test_no_load_when_no_agent_holds_it_and_the_reason_names_the_figures(
    deployment, versions, candidate, redis_client, api
) -> None:
    serving_agent("gpu-0", versions[0])
    spare("agent-1", 0.5)
    spare("agent-2", 1)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == []
    assert not AgentCommand.objects.filter(kind="load", version=candidate).exists()
    message = (
        f"version {candidate.pk} needs 1.50 GiB (weights 0.38 GiB, KV 1.00 GiB, "
        "headroom 0.12 GiB); largest spare agent agent-2 offers 1.00 GiB"
    )
    assert report.unplaced == [message]
    body = api("viewer").get(f"/api/v1/deployments/{deployment.name}/").json()
    assert body["unplaced_versions"] == [
        {
            "version_id": candidate.pk,
            "needed_bytes": int(1.5 * GIB),
            "largest_offer_bytes": GIB,
            "largest_agent": "agent-2",
            "message": message,
        }
    ]
    updated_at = Deployment.objects.get(pk=deployment.pk).updated_at
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    # The same reason is not written again; room appears, the version is placed, the
    # reason goes.
    assert Deployment.objects.get(pk=deployment.pk).updated_at == updated_at
    spare("agent-3", 4)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("agent-3", candidate.pk)]
    assert Deployment.objects.get(pk=deployment.pk).unplaced_versions == []


def test_an_agent_that_reports_no_memory_is_offered_no_version_with_a_footprint(
    deployment, versions, candidate, redis_client
) -> None:
    now = timezone.now()
    Agent.objects.create(name="old", host="h", state="idle", last_seen=now, registered_at=now)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == []
    assert report.unplaced == [
        f"version {candidate.pk} needs 1.50 GiB (weights 0.38 GiB, KV 1.00 GiB, "
        "headroom 0.12 GiB); largest spare agent old offers 0.00 GiB"
    ]


def test_a_version_without_a_footprint_goes_to_the_first_spare_agent(
    deployment, versions, candidate, redis_client
) -> None:
    ModelVersion.objects.filter(pk=candidate.pk).update(footprint=None)
    now = timezone.now()
    Agent.objects.create(name="old", host="h", state="idle", last_seen=now, registered_at=now)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("old", candidate.pk)]


def test_no_second_engine_beyond_the_devices_memory(
    deployment, versions, candidate, redis_client
) -> None:
    stable, _ = versions
    ModelVersion.objects.filter(pk=stable.pk).update(footprint=footprint(3))
    # Two agents on one 4 GiB GPU: the one serving the stable version holds 3 GiB of it.
    device = {"kind": "gpu", "gpu_uuid": "GPU-1"}
    first = serving_agent("gpu-0", stable)
    Agent.objects.filter(pk=first.pk).update(
        inventory={
            **device,
            "memory_total_bytes": 4 * GIB,
            "memory_available_bytes": GIB,
            "memory_offered_bytes": 4 * GIB,
        }
    )
    spare("gpu-0b", 4, total_gib=4, **device)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == []
    assert report.unplaced == [
        f"version {candidate.pk} needs 1.50 GiB (weights 0.38 GiB, KV 1.00 GiB, "
        "headroom 0.12 GiB); largest spare agent gpu-0b offers 4.00 GiB, "
        "of which 1.00 GiB is free beside the engines on its device"
    ]
    # A CPU agent (its host's memory is its device) holds it.
    spare("cpu-1", 2)
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == [("cpu-1", candidate.pk)]


def test_an_agent_swapping_versions_holds_both_until_the_old_one_drains(
    deployment, versions, candidate, redis_client
) -> None:
    stable, _ = versions
    serving_agent("gpu-0", stable)
    # An agent still serving a version nobody needs (1 GiB) offers 2 GiB: the candidate
    # (1.5 GiB) would run beside it until it drains, so it is not loaded there.
    unneeded = ModelVersion.objects.create(
        model=stable.model,
        label="old",
        artifact=stable.artifact,
        serving_config=stable.serving_config,
        status="verified",
        footprint=footprint(1),
    )
    old = serving_agent("gpu-1", unneeded)
    Agent.objects.filter(pk=old.pk).update(
        inventory={
            "kind": "cpu",
            "memory_total_bytes": 64 * GIB,
            "memory_available_bytes": 64 * GIB,
            "memory_offered_bytes": 2 * GIB,
        },
        host="host-c",
    )
    report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert report.loads == []
    assert (
        "largest spare agent gpu-1 offers 2.00 GiB, of which 1.00 GiB is free"
        in (report.unplaced[0])
    )
