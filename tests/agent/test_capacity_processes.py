"""A real agent that offers little memory is not given a version it cannot hold: the
reconciler sends no load and says why with the figures (API), and a load sent anyway is
refused by the agent itself. No engine starts, so it is quick."""

from pathlib import Path

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from contracts.capacity import footprint_describe
from controlplane.fleet.models import AgentCommand
from controlplane.rollouts import deployments, reconciler
from tests.agent.test_agent_processes import (
    MODEL_FILE,
    agent_args,
    agent_row,
    command_row,
    find_agent,
    fleet,  # noqa: F401 - the fixture
    free_port_pair,
    ingest_args,
    is_final,
    logs,
    running,
)
from tests.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LIMIT = 256 * 2**20


def test_an_agent_offering_too_little_memory_gets_no_version_and_refuses_one_sent_anyway(
    fleet,  # noqa: F811 - the fixture
    live_server,
    redis_client,
    tmp_path: Path,
) -> None:
    version = fleet.version("f32", MODEL_FILE)
    needed = version.footprint["total_bytes"]
    assert needed > LIMIT
    ingest_log, agent_log = tmp_path / "ingest.log", tmp_path / "agent.log"
    agent_command = agent_args(
        "agent-small", free_port_pair(), settings.REDIS_URL, live_server.url, fleet
    )
    with (
        running(ingest_args(), ingest_log),
        running([*agent_command, "--memory-limit-bytes", str(LIMIT)], agent_log),
    ):
        wait_until(
            lambda: (
                (row := find_agent("agent-small")) is not None
                and "memory_offered_bytes" in row.inventory
            ),
            timeout=60,
            message=logs(agent_log, ingest_log),
        )
        inventory = agent_row("agent-small").inventory
        assert inventory["memory_offered_bytes"] == LIMIT
        assert inventory["memory_total_bytes"] > LIMIT
        assert 0 < inventory["memory_available_bytes"] <= inventory["memory_total_bytes"]
        assert inventory["cpu_cores"] >= 1

        deployment = deployments.deployment_create(actor=None, name="smol", stable_version=version)
        report = reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert report.loads == []
        assert not AgentCommand.objects.filter(kind="load").exists()
        message = (
            f"version {version.pk} needs {footprint_describe(version.footprint)}; "
            "largest spare agent agent-small offers 0.25 GiB"
        )
        client = APIClient()
        client.force_login(fleet.release_manager)
        body = client.get(f"/api/v1/deployments/{deployment.name}/").json()
        assert [entry["message"] for entry in body["unplaced_versions"]] == [message]
        detail = client.get(f"/api/v1/versions/{version.pk}/").json()
        assert detail["footprint"]["total_bytes"] == needed

        # Sent by hand all the same: the agent refuses it unrun, with the figures.
        load = fleet.command("agent-small", kind="load", version_id=version.pk)
        wait_until(
            lambda: is_final(load["command_id"]), timeout=60, message=logs(agent_log, ingest_log)
        )
        refused = command_row(load["command_id"])
        assert refused.status == "rejected"
        assert refused.detail == (
            f"insufficient_memory: version {version.pk} needs "
            f"{needed / 2**30:.2f} GiB ({needed} bytes); "
            f"this agent offers 0.25 GiB ({LIMIT} bytes)"
        )
        assert agent_row("agent-small").state == "idle"
