"""The engines' secrets: derived per load command, sent to the agent on its stream only."""

import hashlib
import hmac
import json
import os
from unittest import mock

import pytest
from django.test import override_settings

from contracts.commands import commands_stream, parse_command, parse_load_payload
from controlplane.audit.models import AuditEvent
from controlplane.fleet.engine_secrets import ADMIN, SERVING, engine_secret
from controlplane.fleet.models import AgentCommand
from controlplane.settings import env_key

pytestmark = pytest.mark.django_db


def expected(key: bytes, label: str, agent: str, command_id: str) -> str:
    return hmac.new(key, f"{label}:{agent}:{command_id}".encode(), hashlib.sha256).hexdigest()


def test_secrets_are_an_hmac_of_the_agent_and_command_under_the_fleet_key() -> None:
    with override_settings(FLEET_ENGINE_KEY=b"fleet-key"):
        serving = engine_secret(purpose=SERVING, agent_name="gpu-1", command_id="c1")
        admin = engine_secret(purpose=ADMIN, agent_name="gpu-1", command_id="c1")
        assert serving == expected(b"fleet-key", "engine-serving", "gpu-1", "c1")
        assert admin == expected(b"fleet-key", "engine-admin", "gpu-1", "c1")
        assert engine_secret(purpose=SERVING, agent_name="gpu-1", command_id="c2") != serving
        assert engine_secret(purpose=SERVING, agent_name="gpu-2", command_id="c1") != serving
    # Unset: a key derived from SECRET_KEY under a fixed label, never SECRET_KEY itself.
    derived = hmac.new(b"django-secret", b"fleet-engine-key", hashlib.sha256).digest()
    environment = {k: v for k, v in os.environ.items() if k != "FLEET_ENGINE_KEY"}
    with mock.patch.dict(os.environ, environment, clear=True):
        key = env_key("FLEET_ENGINE_KEY", label=b"fleet-engine-key", secret_key="django-secret")
    assert key == derived
    with override_settings(FLEET_ENGINE_KEY=key):
        assert engine_secret(purpose=SERVING, agent_name="gpu-1", command_id="c1") == expected(
            derived, "engine-serving", "gpu-1", "c1"
        )
        assert engine_secret(purpose=SERVING, agent_name="gpu-1", command_id="c1") != expected(
            b"django-secret", "engine-serving", "gpu-1", "c1"
        )
    with pytest.raises(ValueError, match="unknown engine secret purpose"):
        engine_secret(purpose="engine-other", agent_name="gpu-1", command_id="c1")


def test_a_load_sends_its_secrets_on_the_stream_and_records_or_shows_neither(
    client_for, agent, signed_version, redis_client
) -> None:
    response = client_for("release_manager").post(
        "/api/v1/fleet/agents/agent-1/commands/",
        {"kind": "load", "version_id": signed_version.pk, "reason": "stable"},
        format="json",
    )
    assert response.status_code == 202, response.content
    command = AgentCommand.objects.get(command_id=response.json()["command_id"])
    serving = engine_secret(purpose=SERVING, agent_name="agent-1", command_id=command.command_id)
    admin = engine_secret(purpose=ADMIN, agent_name="agent-1", command_id=command.command_id)
    [(_, fields)] = redis_client.xrange(commands_stream("agent-1"))
    load = parse_load_payload(parse_command(fields).payload)
    assert (load.serving_secret, load.admin_secret) == (serving, admin)
    # Neither in the row, the API's answer, nor the audit trail.
    stored = json.dumps(
        [
            command.payload,
            response.json(),
            list(AuditEvent.objects.values("before", "after", "reason")),
        ],
        default=str,
    )
    assert serving not in stored and admin not in stored
    assert "serving_secret" not in command.payload
