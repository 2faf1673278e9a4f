"""seed_demo: the demo's registry, tenants and users; a second run changes nothing."""

import json

import pytest
from django.core.management import call_command
from django.test import override_settings
from rest_framework.test import APIClient

from controlplane.accounts.models import AccessToken, Membership
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import AgentEnrolment
from controlplane.registry.models import Artifact, Model, ModelVersion, SigningKey
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.selectors import api_key_authenticate

COUNTED = [
    Model,
    ModelVersion,
    Artifact,
    SigningKey,
    Tenant,
    ApiKey,
    Membership,
    AccessToken,
    AgentEnrolment,
    AuditEvent,
]


def counts() -> dict[str, int]:
    return {model.__name__: model._default_manager.count() for model in COUNTED}


@pytest.mark.slow
@pytest.mark.django_db
def test_seed_demo_twice(tmp_path, capsys, redis_client) -> None:
    demo_dir = tmp_path / "demo"
    with override_settings(DEMO_DIR=demo_dir, ARTIFACT_ROOT=demo_dir / "artifacts"):
        call_command("seed_demo")
        first = counts()
        first_output = capsys.readouterr().out
        call_command("seed_demo")
        assert counts() == first
        assert capsys.readouterr().out == first_output

        assert first["Model"] == 2
        assert first["ModelVersion"] == 3
        assert first["Artifact"] == 2
        assert first["Tenant"] == 2
        assert first["ApiKey"] == 2
        assert first["Membership"] == 6
        assert first["AgentEnrolment"] == 2
        smol = ModelVersion.objects.filter(model__name="SmolLM2-135M-Instruct").order_by("label")
        assert [(v.label, v.serving_config["dtype"], v.status) for v in smol] == [
            ("q4_1-bf16", "bfloat16", "verified"),
            ("q4_1-fp32", "float32", "verified"),
        ]
        assert smol[0].artifact_id == smol[1].artifact_id
        assert smol[0].artifact is not None and smol[0].artifact.format == "gguf"
        minilm = ModelVersion.objects.get(model__name="all-MiniLM-L6-v2")
        assert minilm.artifact is not None and minilm.artifact.manifest is not None
        assert (minilm.artifact.format, minilm.engine, minilm.status) == (
            "hf-safetensors",
            "builtin",
            "verified",
        )
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            file["path"] for file in minilm.artifact.manifest
        }
        assert SigningKey.objects.get().is_trusted

        credentials = json.loads((demo_dir / "credentials.json").read_text())
        assert set(credentials["api_keys"]) == {"acme", "globex"}
        for slug, raw in credentials["api_keys"].items():
            assert raw in first_output
            authenticated = api_key_authenticate(raw)
            assert authenticated is not None
            assert authenticated[1].slug == slug
        assert credentials["users"]["release"]["role"] == "release_manager"

        # Each demo agent's one-time token enrols it; its own token then downloads (and
        # resumes) the artifact it will serve.
        token_file = demo_dir / "agents" / "agent-1.enrolment-token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        enrolled = APIClient().post(
            "/api/v1/fleet/agents/enrol/", {"token": token_file.read_text().strip()}, format="json"
        )
        assert enrolled.status_code == 201, enrolled.content
        agent = APIClient()
        agent.credentials(HTTP_AUTHORIZATION=f"Bearer {enrolled.json()['api_token']}")
        response = agent.get(f"/api/v1/artifacts/{smol[0].artifact_id}", HTTP_RANGE="bytes=0-3")
        assert response.status_code == 206
        assert b"".join(response.streaming_content) == b"GGUF"

        # Logins work with the printed passwords.
        assert APIClient().login(
            username="oncall", password=credentials["users"]["oncall"]["password"]
        )
