"""The dashboard over HTTP (Django's test client): who may open and do what, and CSRF."""

import pytest
from django.test import Client

from controlplane.audit.models import AuditEvent
from controlplane.core.roles import Role
from controlplane.fleet.models import AgentCommand, AgentEnrolment
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.tenants.models import ApiKey
from tests.dashboard.conftest import STAFF_ROLES

pytestmark = pytest.mark.django_db

STAFF_PAGES = [
    "/",
    "/rollouts/",
    "/rollouts/{rollout}/",
    "/rollouts/{rollout}/series.json",
    "/registry/",
    "/registry/versions/{stable}/",
    "/registry/compare/?a={stable}&b={candidate}",
    "/fleet/",
    "/tenants/",
    "/tenants/{acme}/",
    "/tenants/{globex}/",
    "/audit/",
]


def _url(template: str, world) -> str:
    return template.format(
        rollout=world.rollout.pk,
        stable=world.stable.pk,
        candidate=world.candidate.pk,
        acme=world.acme.pk,
        globex=world.globex.pk,
    )


def test_anonymous_is_sent_to_login(world) -> None:
    response = Client().get("/fleet/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/fleet/"


@pytest.mark.parametrize("role", STAFF_ROLES)
def test_staff_open_every_page(world, client_for, role) -> None:
    client = client_for(role)
    for template in STAFF_PAGES:
        response = client.get(_url(template, world))
        assert response.status_code == 200, template


def test_tenant_member_sees_own_tenant_only(world, client_for) -> None:
    client = client_for(Role.TENANT_MEMBER)
    assert client.get("/").url == f"/tenants/{world.acme.pk}/"
    assert client.get("/tenants/").url == f"/tenants/{world.acme.pk}/"
    own = client.get(f"/tenants/{world.acme.pk}/")
    assert own.status_code == 200
    assert b"Acme Corp" in own.content
    assert client.get(f"/tenants/{world.globex.pk}/").status_code == 404
    assert client.get("/tenants/999999/").status_code == 404
    for template in ["/rollouts/{rollout}/", "/registry/", "/fleet/", "/rollouts/"]:
        assert client.get(_url(template, world)).status_code == 403, template


def test_tenant_member_audit_log_shows_only_their_tenant(world, client_for) -> None:
    client_for(Role.ADMIN).post(
        f"/tenants/{world.globex.pk}/keys/", {"name": "globex-ci", "scopes": ["chat"]}
    )
    client_for(Role.ADMIN).post(
        f"/tenants/{world.acme.pk}/keys/", {"name": "acme-ci", "scopes": ["chat"]}
    )
    page = client_for(Role.TENANT_MEMBER).get("/audit/").content.decode()
    assert "acme/acme-ci" in page
    assert "globex" not in page


def test_fragments_render_and_unknown_fragment_is_404(world, client_for) -> None:
    client = client_for(Role.VIEWER)
    status = client.get(f"/rollouts/{world.rollout.pk}/?fragment=status")
    assert status.status_code == 200
    assert b"<html" not in status.content
    assert b'data-testid="rollout-state"' in status.content
    assert client.get(f"/rollouts/{world.rollout.pk}/?fragment=nope").status_code == 404


def test_series_has_canary_and_baseline_per_run(world, client_for) -> None:
    data = client_for(Role.VIEWER).get(f"/rollouts/{world.rollout.pk}/series.json").json()
    assert len(data["times"]) == 6
    ttft = next(signal for signal in data["signals"] if signal["key"] == "ttft_p95_ms")
    assert ttft["canary"] == [150.0, 152.0, 154.0, 156.0, 158.0, 160.0]
    assert ttft["baseline"] == [180.0, 181.0, 182.0, 183.0, 184.0, 185.0]
    errors = next(signal for signal in data["signals"] if signal["key"] == "error_rate")
    assert errors["canary"] == [1.0] * 6  # percent


def test_actions_shown_by_role(world, client_for) -> None:
    def buttons(role: str) -> set[str]:
        page = client_for(role).get(f"/rollouts/{world.rollout.pk}/").content.decode()
        return {
            name
            for name in ("promote", "pause", "abort", "rollback")
            if f'data-action="{name}"' in page
        }

    assert buttons(Role.RELEASE_MANAGER) == {"promote", "pause", "abort", "rollback"}
    assert buttons(Role.ON_CALL) == {"pause", "rollback"}
    assert buttons(Role.VIEWER) == set()


def test_viewer_cannot_roll_back_and_nothing_changes(world, client_for) -> None:
    events_before = AuditEvent.objects.count()
    response = client_for(Role.VIEWER).post(
        f"/rollouts/{world.rollout.pk}/rollback/", {"reason": "I want to"}
    )
    assert response.status_code == 403
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    assert rollout.state == RolloutState.RUNNING
    assert AuditEvent.objects.count() == events_before


def test_on_call_cannot_promote(world, client_for) -> None:
    response = client_for(Role.ON_CALL).post(
        f"/rollouts/{world.rollout.pk}/promote/", {"reason": "ship it"}
    )
    assert response.status_code == 403
    assert Rollout.objects.get(pk=world.rollout.pk).stage_index == 0


def test_rollback_requires_a_reason(world, client_for) -> None:
    client = client_for(Role.ON_CALL)
    response = client.post(f"/rollouts/{world.rollout.pk}/rollback/", {"reason": "  "}, follow=True)
    assert b"A reason is required." in response.content
    assert Rollout.objects.get(pk=world.rollout.pk).state == RolloutState.RUNNING


def test_rollback_with_reason_records_audit(world, client_for) -> None:
    rollout = world.rollout
    response = client_for(Role.ON_CALL).post(
        f"/rollouts/{rollout.pk}/rollback/",
        {"reason": "latency alarm", "expected_revision": rollout.revision},
    )
    assert response.status_code == 302
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ROLLED_BACK
    event = AuditEvent.objects.filter(action="rollout.rollback").get()
    assert (event.actor_name, event.reason, event.object_id) == (
        "on-call",
        "latency alarm",
        str(rollout.pk),
    )


def test_stale_revision_is_refused_with_a_message(world, client_for) -> None:
    rollout = world.rollout
    response = client_for(Role.RELEASE_MANAGER).post(
        f"/rollouts/{rollout.pk}/promote/",
        {"reason": "next", "expected_revision": rollout.revision - 1},
        follow=True,
    )
    assert b"The rollout moved on" in response.content
    assert Rollout.objects.get(pk=rollout.pk).stage_index == 0


def test_promote_advances_one_stage(world, client_for) -> None:
    client_for(Role.RELEASE_MANAGER).post(
        f"/rollouts/{world.rollout.pk}/promote/", {"reason": "looks good"}
    )
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    assert (rollout.state, rollout.stage_index) == (RolloutState.RUNNING, 1)


def test_api_key_shown_once_then_only_prefix(world, client_for) -> None:
    client = client_for(Role.TENANT_MEMBER)
    response = client.post(
        f"/tenants/{world.acme.pk}/keys/", {"name": "ci", "scopes": ["chat", "embeddings"]}
    )
    assert response.status_code == 201
    assert response["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(tenant=world.acme, name="ci")
    raw = response.context["created_key"].raw_key
    assert raw.startswith(key.prefix)
    assert raw in response.content.decode()
    again = client.get(f"/tenants/{world.acme.pk}/").content.decode()
    assert raw not in again
    assert key.prefix in again


def test_tenant_member_cannot_touch_another_tenants_keys(world, client_for) -> None:
    client = client_for(Role.TENANT_MEMBER)
    response = client.post(f"/tenants/{world.globex.pk}/keys/", {"name": "x", "scopes": ["chat"]})
    assert response.status_code == 404
    assert not ApiKey.objects.filter(tenant=world.globex).exists()


def test_viewer_cannot_create_keys(world, client_for) -> None:
    response = client_for(Role.VIEWER).post(
        f"/tenants/{world.acme.pk}/keys/", {"name": "x", "scopes": ["chat"]}
    )
    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_revoke_key(world, client_for) -> None:
    client = client_for(Role.TENANT_MEMBER)
    client.post(f"/tenants/{world.acme.pk}/keys/", {"name": "ci", "scopes": ["chat"]})
    key = ApiKey.objects.get(name="ci")
    client.post(f"/tenants/{world.acme.pk}/keys/{key.pk}/revoke/", {"reason": "leaked"})
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert AuditEvent.objects.filter(action="api_key.revoke", reason="leaked").count() == 1


def test_viewer_cannot_command_agents(world, client_for) -> None:
    response = client_for(Role.VIEWER).post(
        "/fleet/agent-1/command/", {"kind": "drain", "reason": "maintenance"}
    )
    assert response.status_code == 403
    assert not AuditEvent.objects.filter(action__startswith="agent.command").exists()


def test_on_call_drains_an_agent(world, client_for, redis_client) -> None:
    response = client_for(Role.ON_CALL).post(
        "/fleet/agent-1/command/", {"kind": "drain", "reason": "maintenance"}
    )
    assert response.status_code == 302
    event = AuditEvent.objects.get(action="agent.command.drain")
    assert (event.object_id, event.reason) == ("agent-1", "maintenance")
    assert redis_client.xlen("agent:agent-1:commands") == 1


def test_on_call_starts_a_drill_on_an_agent(world, client_for, redis_client) -> None:
    response = client_for(Role.ON_CALL).post(
        "/fleet/agent-1/command/",
        {
            "kind": "faults",
            "latency_ms_per_token": "150",
            "error_rate": "0.25",
            "reason": "rollback drill",
        },
    )
    assert response.status_code == 302
    command = AgentCommand.objects.get(agent__name="agent-1", kind="faults")
    assert command.payload == {"latency_ms_per_token": 150.0, "error_rate": 0.25}
    assert (
        AuditEvent.objects.filter(action="agent.command.faults", reason="rollback drill").count()
        == 1
    )
    assert redis_client.xlen("agent:agent-1:commands") == 1


def test_drill_without_figures_changes_nothing(world, client_for, redis_client) -> None:
    response = client_for(Role.ON_CALL).post(
        "/fleet/agent-1/command/", {"kind": "faults", "error_rate": "0.5", "reason": "drill"}
    )
    assert response.status_code == 302
    assert not AgentCommand.objects.filter(kind="faults").exists()
    assert redis_client.xlen("agent:agent-1:commands") == 0


def test_audit_filters(world, client_for) -> None:
    client = client_for(Role.ADMIN)
    client.post(f"/rollouts/{world.rollout.pk}/pause/", {"reason": "look closer"})
    page = client.get("/audit/", {"actor": "admin", "action": "rollout."}).content.decode()
    assert "rollout.pause" in page
    assert "user.create" not in page
    page = client.get("/audit/", {"object_type": "tenant"}).content.decode()
    assert "rollout.pause" not in page


FORMS = [
    ("/rollouts/{rollout}/rollback/", {"reason": "r"}),
    ("/fleet/agent-1/command/", {"kind": "drain", "reason": "r"}),
    ("/tenants/{acme}/keys/", {"name": "k", "scopes": ["chat"]}),
    ("/accounts/logout/", {}),
]


@pytest.mark.parametrize(("template", "data"), FORMS)
def test_forms_refuse_a_missing_csrf_token(world, client_for, template, data) -> None:
    client = client_for(Role.ADMIN, enforce_csrf_checks=True)
    events_before = AuditEvent.objects.count()
    response = client.post(_url(template, world), data)
    assert response.status_code == 403
    assert AuditEvent.objects.count() == events_before
    assert Rollout.objects.get(pk=world.rollout.pk).state == RolloutState.RUNNING


def test_an_admin_enrols_an_agent_from_the_fleet_page_and_sees_the_token_once(
    world, client_for
) -> None:
    client = client_for(Role.ADMIN)
    assert 'id="enrol-agent"' in client.get("/fleet/").content.decode()
    response = client.post("/fleet/enrolments/", {"agent_name": "gpu-9"})
    assert response.status_code == 201
    assert response["Cache-Control"] == "no-store"
    raw = response.context["created_enrolment"].raw_token
    stored = AgentEnrolment.objects.get(agent_name="gpu-9")
    assert raw in response.content.decode() and raw not in stored.token_hash
    assert raw not in client.get("/fleet/").content.decode()
    assert AuditEvent.objects.filter(action="agent.enrolment.create", object_id="gpu-9").exists()


@pytest.mark.parametrize("role", [Role.RELEASE_MANAGER, Role.ON_CALL, Role.VIEWER])
def test_only_admins_enrol_agents_from_the_dashboard(world, client_for, role) -> None:
    client = client_for(role)
    assert 'id="enrol-agent"' not in client.get("/fleet/").content.decode()
    response = client.post("/fleet/enrolments/", {"agent_name": "gpu-9"})
    assert response.status_code == 403
    assert not AgentEnrolment.objects.exists()


def test_a_bad_agent_name_is_refused_with_a_message(world, client_for) -> None:
    response = client_for(Role.ADMIN).post("/fleet/enrolments/", {"agent_name": "Bad Name"})
    assert response.status_code == 302
    assert not AgentEnrolment.objects.exists()


def test_version_pages_show_the_engine_its_arguments_and_a_folders_files(world, client_for) -> None:
    from controlplane.registry.models import Artifact, Model, ModelVersion

    model = Model.objects.create(name="minilm", task="embedding")
    folder = Artifact.objects.create(
        digest="f" * 64,
        format="hf-safetensors",
        size_bytes=90_000_000,
        manifest=[
            {"path": "config.json", "sha256": "a" * 64, "size": 612},
            {"path": "model.safetensors", "sha256": "b" * 64, "size": 90_000_000 - 612},
        ],
    )
    embedding = ModelVersion.objects.create(
        model=model,
        label="folder",
        artifact=folder,
        serving_config={"dtype": "float32"},
        engine="vllm",
        engine_args={"gpu_memory_percent": 50},
    )
    endpoint = ModelVersion.objects.create(
        model=model,
        label="hosted",
        artifact=None,
        serving_config={"dtype": "float32"},
        engine="openai",
        engine_args={"base_url": "https://models.example.com/v1", "upstream_model": "e5"},
    )
    client = client_for(Role.VIEWER)
    page = client.get(f"/registry/versions/{embedding.pk}/").content.decode()
    assert 'data-engine="vllm">vLLM<' in page
    assert "in 2 files" in page
    assert "<code>model.safetensors</code>" in page
    assert "&quot;gpu_memory_percent&quot;: 50" in page
    hosted = client.get(f"/registry/versions/{endpoint.pk}/").content.decode()
    assert 'data-engine="openai">OpenAI-compatible endpoint<' in hosted
    assert "none: served by the endpoint in its engine arguments" in hosted
    registry = client.get("/registry/").content.decode()
    assert "hf-safetensors · float32 · vLLM" in registry
    assert "endpoint · float32 · OpenAI-compatible endpoint" in registry
    compare = client.get(f"/registry/compare/?a={embedding.pk}&b={endpoint.pk}")
    assert compare.status_code == 200
    assert "engine: base_url" in compare.content.decode()


def test_a_version_page_shows_its_footprint_and_the_agents_it_fits(world, client_for) -> None:
    from controlplane.fleet.models import Agent
    from controlplane.registry.models import ModelVersion
    from controlplane.rollouts.models import Deployment

    footprint = {
        "weight_bytes": 269_030_016,
        "kv_bytes": 47_185_920,
        "headroom_bytes": 31_621_594,
        "total_bytes": 347_837_530,
        "parameters": 134_515_008,
        "bytes_per_parameter": 2.0,
        "kv_bytes_per_token": 23_040,
        "kv_tokens": 2048,
        "kv_basis": "engine_args.num_blocks",
    }
    ModelVersion.objects.filter(pk=world.candidate.pk).update(footprint=footprint)
    small, large = world.agents[:2]
    Agent.objects.filter(pk=small.pk).update(inventory={"memory_offered_bytes": 2**28})
    Agent.objects.filter(pk=large.pk).update(inventory={"memory_offered_bytes": 2**30})
    client = client_for(Role.VIEWER)
    page = client.get(f"/registry/versions/{world.candidate.pk}/").content.decode()
    assert 'data-footprint-total="347837530">0.32 GiB<' in page
    assert '0.25 GiB <span class="muted">(134,515,008 parameters x 2.0 bytes)' in page
    assert "(2,048 tokens x 23,040 bytes; engine_args.num_blocks)" in page
    assert f'data-fit-agent="{small.name}"><td>{small.name}</td><td>0.25 GiB</td>' in page
    rows = page.split("data-fit-agent=")[1:]
    fits = {row.split('"')[1]: ">fits<" in row for row in rows}
    assert (fits[small.name], fits[large.name]) == (False, True)
    unknown = client.get(f"/registry/versions/{world.stable.pk}/").content.decode()
    assert "Unknown: computed at registration. Placed on any spare agent." in unknown

    message = "version 9 needs 1.50 GiB (...); largest spare agent agent-2 offers 1.00 GiB"
    Deployment.objects.filter(pk=world.deployment.pk).update(
        unplaced_versions=[
            {
                "version_id": 9,
                "needed_bytes": 1,
                "largest_offer_bytes": 1,
                "largest_agent": "agent-2",
                "message": message,
            }
        ]
    )
    rollouts = client.get("/rollouts/").content.decode()
    assert f'data-unplaced-version="9">Not placed: {message}</p>' in rollouts
