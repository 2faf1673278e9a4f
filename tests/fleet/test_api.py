"""The fleet API over HTTP: reading agents, sending audited commands, agent registration."""

import pytest
from rest_framework.test import APIClient

from contracts.commands import CommandKind, commands_stream, parse_command, parse_load_payload
from contracts.streams import AgentState
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.registry import services as registry_services
from tests.api.support import assert_error, audit_count
from tests.fleet.support import REGISTRATION, enrol, heartbeat

pytestmark = pytest.mark.django_db


def stream_entries(redis_client, name: str = "agent-1") -> list[dict]:
    return [fields for _, fields in redis_client.xrange(commands_stream(name))]


@pytest.mark.parametrize("principal", ["admin", "release_manager", "on_call", "viewer"])
def test_staff_list_agents_with_state_and_latest_figures(client_for, agent, principal) -> None:
    Agent.objects.filter(pk=agent.pk).update(state=AgentState.READY, figures=heartbeat().figures())
    response = client_for(principal).get("/api/v1/fleet/agents/")
    assert response.status_code == 200
    [row] = response.json()["results"]
    assert row["name"] == "agent-1"
    assert row["state"] == "ready"
    assert row["accelerator"] == "Test CPU"
    assert row["figures"]["tokens_per_second"] == 20.0
    assert row["figures"]["energy_source"] == "estimate"


@pytest.mark.parametrize("principal", ["tenant_member", "agent", "no_role"])
def test_others_may_not_see_the_fleet(client_for, agent, principal) -> None:
    assert_error(client_for(principal).get("/api/v1/fleet/agents/"), 403, "permission_denied")
    assert_error(
        client_for(principal).get("/api/v1/fleet/agents/agent-1/history/"),
        403,
        "permission_denied",
    )


def test_history_of_an_unknown_agent_is_404(client_for) -> None:
    assert_error(client_for("viewer").get("/api/v1/fleet/agents/nobody/history/"), 404, "not_found")


@pytest.mark.parametrize("principal", ["release_manager", "on_call"])
def test_load_command_is_recorded_audited_and_queued_for_the_agent(
    client_for, users, agent, signed_version, signer, redis_client, principal
) -> None:
    response = client_for(principal).post(
        "/api/v1/fleet/agents/agent-1/commands/",
        {"kind": "load", "version_id": signed_version.pk, "reason": "stable"},
        format="json",
    )
    assert response.status_code == 202, response.content
    body = response.json()
    assert (body["kind"], body["status"], body["agent"]) == ("load", "pending", "agent-1")
    command = AgentCommand.objects.get(command_id=body["command_id"])
    assert command.issued_by == users[principal]
    event = AuditEvent.objects.get(action="agent.command.load")
    assert (event.actor_name, event.object_id, event.reason) == (principal, "agent-1", "stable")
    assert event.after["command_id"] == command.command_id
    [fields] = stream_entries(redis_client)
    wire = parse_command(fields)
    assert (wire.command_id, wire.kind) == (command.command_id, CommandKind.LOAD)
    load = parse_load_payload(wire.payload)
    assert load.digest == signed_version.artifact_id
    assert load.serving_config == signed_version.serving_config
    assert (load.key_id, load.public_key) == (signer.key_id, signer.public_key_b64)
    assert load.signature == signed_version.signature
    assert load.served_model_name == "smol"


@pytest.mark.parametrize("kind", ["drain", "unload"])
def test_drain_and_unload_commands(client_for, agent, redis_client, kind) -> None:
    response = client_for("on_call").post(
        "/api/v1/fleet/agents/agent-1/commands/", {"kind": kind}, format="json"
    )
    assert response.status_code == 202
    [fields] = stream_entries(redis_client)
    assert parse_command(fields).kind == CommandKind(kind)
    assert parse_command(fields).payload == {}


def test_a_drain_may_name_the_version_it_means(
    client_for, agent, make_version, redis_client
) -> None:
    url = "/api/v1/fleet/agents/agent-1/commands/"
    version = make_version("v1")
    response = client_for("on_call").post(
        url, {"kind": "drain", "version_id": version.pk}, format="json"
    )
    assert response.status_code == 202
    [fields] = stream_entries(redis_client)
    assert parse_command(fields).payload == {"version_id": version.pk}
    assert AgentCommand.objects.get().version_id == version.pk
    missing = client_for("on_call").post(
        url, {"kind": "drain", "version_id": 999999}, format="json"
    )
    assert_error(missing, 404, "not_found")
    assert AgentCommand.objects.count() == 1


def test_fault_command_carries_its_settings(client_for, agent, redis_client) -> None:
    response = client_for("on_call").post(
        "/api/v1/fleet/agents/agent-1/commands/",
        {"kind": "faults", "latency_ms_per_token": 50, "error_rate": 0.25, "reason": "drill"},
        format="json",
    )
    assert response.status_code == 202
    [fields] = stream_entries(redis_client)
    assert parse_command(fields).payload == {"latency_ms_per_token": 50.0, "error_rate": 0.25}
    assert AuditEvent.objects.get(action="agent.command.faults").after["faults"] == {
        "latency_ms_per_token": 50.0,
        "error_rate": 0.25,
    }


@pytest.mark.parametrize("principal", ["viewer", "tenant_member", "agent", "no_role"])
def test_a_denied_command_has_no_side_effect(client_for, agent, redis_client, principal) -> None:
    before = audit_count()
    response = client_for(principal).post(
        "/api/v1/fleet/agents/agent-1/commands/", {"kind": "drain"}, format="json"
    )
    assert_error(response, 403, "permission_denied")
    assert AgentCommand.objects.count() == 0
    assert audit_count() == before
    assert stream_entries(redis_client) == []


def test_unsigned_version_is_not_sent(client_for, agent, make_version, redis_client) -> None:
    version = make_version("v2")
    registry_services.version_verify_override(actor=None, version=version, reason="lab")
    before = audit_count()
    response = client_for("release_manager").post(
        "/api/v1/fleet/agents/agent-1/commands/",
        {"kind": "load", "version_id": version.pk},
        format="json",
    )
    assert_error(response, 409, "version_unsigned")
    assert (AgentCommand.objects.count(), audit_count()) == (0, before)
    assert stream_entries(redis_client) == []


def test_registered_but_unverified_version_is_not_sent(
    client_for, agent, make_version, redis_client
) -> None:
    version = make_version("v3")
    response = client_for("release_manager").post(
        "/api/v1/fleet/agents/agent-1/commands/",
        {"kind": "load", "version_id": version.pk},
        format="json",
    )
    assert_error(response, 409, "version_not_loadable")
    assert stream_entries(redis_client) == []


def test_a_lost_agent_cannot_be_commanded(client_for, agent, redis_client) -> None:
    Agent.objects.filter(pk=agent.pk).update(state="lost")
    response = client_for("on_call").post(
        "/api/v1/fleet/agents/agent-1/commands/", {"kind": "drain"}, format="json"
    )
    assert_error(response, 409, "agent_lost")
    assert AgentCommand.objects.count() == 0
    assert stream_entries(redis_client) == []


def test_invalid_commands_are_refused(client_for, agent, redis_client) -> None:
    client = client_for("on_call")
    url = "/api/v1/fleet/agents/agent-1/commands/"
    assert_error(client.post(url, {"kind": "load"}, format="json"), 400, "invalid")
    assert_error(client.post(url, {"kind": "reboot"}, format="json"), 400, "invalid")
    assert_error(
        client.post(url, {"kind": "faults", "error_rate": 2}, format="json"), 400, "invalid"
    )
    assert_error(
        client.post(url, {"kind": "drain", "force": True}, format="json"), 400, "unknown_fields"
    )
    assert stream_entries(redis_client) == []


def test_command_list_and_detail(client_for, agent, redis_client) -> None:
    sent = client_for("on_call").post(
        "/api/v1/fleet/agents/agent-1/commands/", {"kind": "drain"}, format="json"
    )
    command_id = sent.json()["command_id"]
    viewer = client_for("viewer")
    listed = viewer.get("/api/v1/fleet/agents/agent-1/commands/").json()["results"]
    assert [row["command_id"] for row in listed] == [command_id]
    detail = viewer.get(f"/api/v1/fleet/commands/{command_id}/")
    assert detail.json()["status"] == "pending"


def test_an_enrolled_agent_registers_its_endpoints_with_its_own_token(redis_client) -> None:
    token = enrol("gpu-7")["api_token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    created = client.post("/api/v1/fleet/agents/register/", REGISTRATION, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["accelerator"] == "NVIDIA H100"
    assert created.json()["state"] == "idle"
    assert created.json()["endpoints"] == [
        "http://node-3.example:9100",
        "http://node-3.example:9101",
    ]
    again = client.post("/api/v1/fleet/agents/register/", REGISTRATION, format="json")
    assert again.status_code == 200
    assert AuditEvent.objects.filter(action="agent.register").count() == 1
    moved = client.post(
        "/api/v1/fleet/agents/register/", {**REGISTRATION, "host": "node-4"}, format="json"
    )
    assert moved.status_code == 200
    assert AuditEvent.objects.filter(action="agent.register").count() == 2
    # New endpoints are a move too: audited, with the endpoints before and after.
    readvertised = client.post(
        "/api/v1/fleet/agents/register/",
        {**REGISTRATION, "host": "node-4", "advertise_host": "10.0.0.7", "ports": [9200, 9201]},
        format="json",
    )
    assert readvertised.status_code == 200
    event = AuditEvent.objects.filter(action="agent.register").order_by("id").last()
    assert event is not None
    assert (event.before["endpoints"], event.after["endpoints"]) == (
        ["http://node-3.example:9100", "http://node-3.example:9101"],
        ["http://10.0.0.7:9200", "http://10.0.0.7:9201"],
    )
    assert Agent.objects.get(name="gpu-7").endpoints == [
        "http://10.0.0.7:9200",
        "http://10.0.0.7:9201",
    ]


def test_an_ipv6_advertise_host_is_bracketed_in_the_endpoints(redis_client) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {enrol('gpu-7')['api_token']}")
    response = client.post(
        "/api/v1/fleet/agents/register/",
        {**REGISTRATION, "advertise_host": "fd00::7", "endpoint": "http://[fd00::7]:9101"},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["endpoints"] == ["http://[fd00::7]:9100", "http://[fd00::7]:9101"]
    assert response.json()["endpoint"] == "http://[fd00::7]:9101"


def test_registration_brings_a_lost_agent_back(agent) -> None:
    Agent.objects.filter(pk=agent.pk).update(state="lost")
    client = APIClient()
    client.force_login(agent.account)
    response = client.post(
        "/api/v1/fleet/agents/register/", {**REGISTRATION, "name": "agent-1"}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["state"] == "idle"


@pytest.mark.parametrize("principal", ["release_manager", "on_call", "viewer", "tenant_member"])
def test_only_the_agent_role_registers_agents(client_for, principal) -> None:
    before = audit_count()
    response = client_for(principal).post(
        "/api/v1/fleet/agents/register/", REGISTRATION, format="json"
    )
    assert_error(response, 403, "permission_denied")
    assert (Agent.objects.count(), audit_count()) == (0, before)


def test_registration_is_validated(client_for) -> None:
    client = client_for("agent")
    url = "/api/v1/fleet/agents/register/"
    assert_error(
        client.post(url, {**REGISTRATION, "name": "Bad Name"}, format="json"), 400, "invalid"
    )
    assert_error(
        client.post(url, {**REGISTRATION, "energy_source": "guess"}, format="json"), 400, "invalid"
    )
    assert Agent.objects.count() == 0


@pytest.mark.parametrize(
    ("changes", "code", "field"),
    [
        ({"advertise_host": "bad host"}, "invalid", "advertise_host"),
        ({"advertise_host": "evil.example/x"}, "invalid", "advertise_host"),
        ({"advertise_host": "-lead.example"}, "invalid", "advertise_host"),
        ({"advertise_host": ""}, "invalid", "advertise_host"),
        ({"ports": [9100]}, "invalid", "ports"),
        ({"ports": [9100, 9101, 9102]}, "invalid", "ports"),
        ({"ports": [9100, 9100]}, "invalid", "ports"),
        ({"ports": [0, 9101]}, "invalid", "ports"),
        ({"ports": [9100, 65536]}, "invalid", "ports"),
        ({"endpoint": "http://capture.example:9100"}, "unregistered_endpoint", "endpoint"),
        ({"endpoint": "http://node-3.example:9102"}, "unregistered_endpoint", "endpoint"),
    ],
)
def test_registration_refuses_endpoints_other_than_its_host_and_two_ports(
    client_for, changes, code, field
) -> None:
    before = audit_count()
    response = client_for("agent").post(
        "/api/v1/fleet/agents/register/", {**REGISTRATION, **changes}, format="json"
    )
    assert_error(response, 400, code)
    assert list(response.json()["error"]["fields"]) == [field]
    assert (Agent.objects.count(), audit_count()) == (0, before)
