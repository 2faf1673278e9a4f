"""Agent enrolment and each part's Redis user, through the REST API and the real Redis
(ACLs on, default user off: tests/redis_server.py)."""

import os
import stat
from datetime import timedelta
from io import StringIO

import pytest
import redis
from django.conf import settings
from django.core.management import CommandError, call_command
from django.utils import timezone
from rest_framework.test import APIClient

from contracts.commands import RESULTS_STREAM, commands_stream
from contracts.redis_roles import GATEWAY_USER, INGEST_USER, agent_user
from contracts.routing import REQUESTS_STREAM
from contracts.streams import HEARTBEATS_STREAM
from controlplane.audit.models import AuditEvent
from controlplane.fleet.command_signing import command_public_key_b64
from controlplane.fleet.models import Agent, AgentEnrolment
from controlplane.fleet.stream_keys import agent_stream_key
from tests.api.support import assert_error, audit_count
from tests.fleet.support import REGISTRATION

pytestmark = pytest.mark.django_db


def enrolment_token(client_for, name: str = "gpu-7") -> str:
    response = client_for("admin").post(
        "/api/v1/fleet/enrolments/", {"agent_name": name}, format="json"
    )
    assert response.status_code == 201, response.content
    return str(response.json()["token"])


def enrol(token: str):
    return APIClient().post("/api/v1/fleet/agents/enrol/", {"token": token}, format="json")


def bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def agent_redis(credentials: dict) -> redis.Redis:
    port = redis.Redis.from_url(settings.REDIS_ADMIN_URL).connection_pool.connection_kwargs["port"]
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        username=credentials["redis_username"],
        password=credentials["redis_password"],
        decode_responses=True,
    )


def test_an_admin_enrols_an_agent_which_gets_credentials_of_its_own_once(
    client_for, redis_client, signer
) -> None:
    token = enrolment_token(client_for)
    stored = AgentEnrolment.objects.get(agent_name="gpu-7")
    assert token.startswith("cpe-") and token not in stored.token_hash
    response = enrol(token)
    assert response.status_code == 201, response.content
    credentials = response.json()
    assert credentials["agent"] == "gpu-7"
    assert credentials["redis_username"] == agent_user("gpu-7")
    assert credentials["stream_key"] == agent_stream_key("gpu-7")
    assert credentials["command_public_key"] == command_public_key_b64()
    assert credentials["trusted_keys"] == {signer.key_id: signer.public_key_b64}
    agent = Agent.objects.get(name="gpu-7")
    assert agent.account is not None and agent.account.get_username() == "agent@gpu-7"
    assert credentials["redis_password"] not in agent.redis_password_hash
    assert AuditEvent.objects.filter(action="agent.enrol", object_id="gpu-7").count() == 1

    # Once only: the token is spent, and nothing changes.
    before = (audit_count(), agent.redis_password_hash)
    assert_error(enrol(token), 401, "enrolment_token_used")
    assert_error(enrol("cpe-unknown"), 401, "enrolment_token_invalid")
    agent.refresh_from_db()
    assert (audit_count(), agent.redis_password_hash) == before

    # Its own token registers it: first 201 (audited), then 200.
    client = bearer(credentials["api_token"])
    first = client.post("/api/v1/fleet/agents/register/", REGISTRATION, format="json")
    assert first.status_code == 201, first.content
    assert first.json()["accelerator"] == "NVIDIA H100"
    again = client.post("/api/v1/fleet/agents/register/", REGISTRATION, format="json")
    assert again.status_code == 200
    assert AuditEvent.objects.filter(action="agent.register").count() == 1
    moved = client.post(
        "/api/v1/fleet/agents/register/", {**REGISTRATION, "host": "node-4"}, format="json"
    )
    assert moved.status_code == 200
    assert AuditEvent.objects.filter(action="agent.register").count() == 2


def test_an_expired_enrolment_is_refused(client_for, redis_client) -> None:
    token = enrolment_token(client_for)
    AgentEnrolment.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert_error(enrol(token), 401, "enrolment_token_expired")
    assert not Agent.objects.filter(name="gpu-7").exists()


@pytest.mark.parametrize(
    "principal", ["release_manager", "on_call", "viewer", "agent", "anonymous"]
)
def test_only_admins_create_enrolments(client_for, principal) -> None:
    before = audit_count()
    response = client_for(principal).post(
        "/api/v1/fleet/enrolments/", {"agent_name": "gpu-7"}, format="json"
    )
    assert response.status_code in (401, 403)
    assert (AgentEnrolment.objects.count(), audit_count()) == (0, before)


def test_enrolments_are_validated(client_for) -> None:
    client = client_for("admin")
    url = "/api/v1/fleet/enrolments/"
    assert_error(client.post(url, {"agent_name": "Bad Name"}, format="json"), 400, "invalid")
    assert_error(client.post(url, {"agent_name": "register"}, format="json"), 400, "reserved_name")
    assert_error(
        client.post(url, {"agent_name": "gpu-7", "ttl_s": 1}, format="json"), 400, "invalid"
    )
    assert AgentEnrolment.objects.count() == 0


def test_only_the_agents_own_credentials_register_it(client_for, users, redis_client) -> None:
    mine = enrol(enrolment_token(client_for, "gpu-7")).json()
    other = enrol(enrolment_token(client_for, "gpu-8")).json()
    before = (audit_count(), Agent.objects.get(name="gpu-7").host)
    response = bearer(other["api_token"]).post(
        "/api/v1/fleet/agents/register/", REGISTRATION, format="json"
    )
    assert_error(response, 403, "permission_denied")
    # An agent-role account that was never enrolled registers nothing.
    response = client_for("agent").post(
        "/api/v1/fleet/agents/register/", {**REGISTRATION, "name": "gpu-9"}, format="json"
    )
    assert_error(response, 409, "agent_not_enrolled")
    assert (audit_count(), Agent.objects.get(name="gpu-7").host) == before
    assert not Agent.objects.filter(name="gpu-9").exists()
    assert mine["api_token"] != other["api_token"]


def test_enrolling_again_rotates_every_credential(client_for, redis_client) -> None:
    old = enrol(enrolment_token(client_for)).json()
    assert agent_redis(old).ping()
    new = enrol(enrolment_token(client_for)).json()
    assert new["api_token"] != old["api_token"]
    refused = bearer(old["api_token"]).post(
        "/api/v1/fleet/agents/register/", REGISTRATION, format="json"
    )
    assert refused.status_code == 401
    with pytest.raises(redis.AuthenticationError):
        agent_redis(old).ping()
    assert agent_redis(new).ping()
    accepted = bearer(new["api_token"]).post(
        "/api/v1/fleet/agents/register/", REGISTRATION, format="json"
    )
    assert accepted.status_code == 201


def test_an_agents_redis_user_reaches_only_its_own_keys(client_for, redis_client) -> None:
    credentials = enrol(enrolment_token(client_for, "gpu-7")).json()
    enrol(enrolment_token(client_for, "gpu-8"))
    redis_client.xadd(commands_stream("gpu-8"), {"kind": "drain"})
    redis_client.xadd(REQUESTS_STREAM, {"prompt": "secret"})
    redis_client.set("routing:chat", "{}")
    agent = agent_redis(credentials)
    # What it needs: append its heartbeats and results, read its own commands.
    assert agent.xadd(HEARTBEATS_STREAM, {"agent": "gpu-7"})
    assert agent.xadd(RESULTS_STREAM, {"agent": "gpu-7"})
    agent.xgroup_create(commands_stream("gpu-7"), "agent", id="0", mkstream=True)
    assert agent.xreadgroup("agent", "gpu-7", {commands_stream("gpu-7"): ">"}) == []
    # What it must not: read anyone's heartbeats or prompts, another agent's commands,
    # write commands or routing tables, or run anything administrative.
    refused = [
        lambda: agent.xrange(HEARTBEATS_STREAM),
        lambda: agent.xrange(REQUESTS_STREAM),
        lambda: agent.xrange(commands_stream("gpu-8")),
        lambda: agent.xadd(commands_stream("gpu-8"), {"kind": "unload"}),
        lambda: agent.set("routing:chat", "{}"),
        lambda: agent.get("routing:chat"),
        lambda: agent.keys("*"),
        lambda: agent.flushdb(),
        lambda: agent.execute_command("ACL", "SETUSER", agent_user("gpu-7"), "+@all"),
    ]
    for attempt in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert redis_client.xlen(commands_stream("gpu-8")) == 1
    assert redis_client.get("routing:chat") == "{}"


def test_each_service_role_reaches_only_what_it_needs(redis_client) -> None:
    redis_client.xadd(REQUESTS_STREAM, {"prompt": "secret"})
    redis_client.xadd(HEARTBEATS_STREAM, {"agent": "gpu-7"})
    controlplane = redis.Redis.from_url(settings.REDIS_URL)
    gateway = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    ingest = redis.Redis.from_url(settings.INGEST_REDIS_URL)
    # Prompts: only the gateway and ingest read the requests stream.
    assert gateway.xlen(REQUESTS_STREAM) == 1
    assert ingest.xlen(REQUESTS_STREAM) == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        controlplane.xrange(REQUESTS_STREAM)
    # The control plane reaches everything else, without administration.
    assert controlplane.set("rollouts:probe", "1")
    assert controlplane.xlen(HEARTBEATS_STREAM) == 1
    for role in (controlplane, gateway, ingest):
        with pytest.raises(redis.exceptions.NoPermissionError):
            role.flushdb()
        with pytest.raises(redis.exceptions.NoPermissionError):
            role.execute_command("ACL", "SETUSER", "intruder", "on", ">x", "~*", "+@all")
    # The gateway neither reads heartbeats nor writes routing tables.
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.xrange(HEARTBEATS_STREAM)
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.set("routing:chat", "{}")
    # Nothing works with the default user.
    port = controlplane.connection_pool.connection_kwargs["port"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()


def test_redis_users_command_applies_roles_and_enrolled_agents(
    client_for, redis_client, monkeypatch
) -> None:
    credentials = enrol(enrolment_token(client_for, "gpu-7")).json()
    redis_client.execute_command("ACL", "DELUSER", agent_user("gpu-7"), GATEWAY_USER)
    out = StringIO()
    call_command("redis_users", stdout=out)
    assert out.getvalue().startswith(
        "redis users: controlplane, ingest, gateway and 1 agent(s); default user off;"
    )
    for secret in (credentials["redis_password"], os.environ["REDIS_GATEWAY_PASSWORD"]):
        assert secret not in out.getvalue()
    assert agent_redis(credentials).ping()
    assert redis.Redis.from_url(settings.GATEWAY_REDIS_URL).ping()
    monkeypatch.delenv(f"REDIS_{INGEST_USER.upper()}_PASSWORD")
    with pytest.raises(CommandError, match="REDIS_INGEST_PASSWORD"):
        call_command("redis_users")


def test_agent_enrol_command_writes_the_token_once(tmp_path) -> None:
    path = tmp_path / "token"
    call_command("agent_enrol", "gpu-7", "--token-file", str(path), stdout=StringIO())
    token = path.read_text().strip()
    assert token.startswith("cpe-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert AgentEnrolment.objects.get(agent_name="gpu-7").used_at is None
    with pytest.raises(CommandError, match="invalid"):
        call_command("agent_enrol", "Bad Name", stdout=StringIO())
