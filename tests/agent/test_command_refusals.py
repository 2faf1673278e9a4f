"""A real agent process refuses every command the control plane did not sign for it, and
every load signed by a release key it has not pinned: each is answered `rejected` with its
reason, reaches the control plane through a real ingest process (audited), and nothing runs.

No model is loaded here: every command is refused before an engine would start.
"""

import base64
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.test import override_settings

from contracts.commands import (
    RESULTS_STREAM,
    Command,
    CommandKind,
    CommandResult,
    command_record_key,
    command_signed_message,
    commands_stream,
    new_command,
    parse_command_result,
)
from controlplane.audit.models import AuditEvent
from controlplane.fleet.command_signing import command_sign
from controlplane.registry import services as registry_services
from controlplane.registry.models import SigningKey
from tests.agent.test_agent_processes import (
    SERVING_CONFIG,
    Fleet,
    agent_args,
    agent_row,
    command_row,
    find_agent,
    free_port_pair,
    ingest_args,
    is_final,
    is_listening,
    logs,
    running,
)
from tests.api.support import Signer, gguf_bytes
from tests.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAULTS = {"latency_ms_per_token": 7.0, "error_rate": 0.0}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with override_settings(ARTIFACT_ROOT=tmp_path / "store"):
        yield Fleet(tmp_path)


def results_of(client: redis.Redis, command_id: str) -> list[CommandResult]:
    entries: list[tuple[str, dict[str, str]]] = client.xrange(RESULTS_STREAM)  # type: ignore[assignment]
    return [
        result
        for result in (parse_command_result(fields) for _, fields in entries)
        if result.command_id == command_id
    ]


def sent(client: redis.Redis, agent: str, command: Command) -> str:
    client.xadd(commands_stream(agent), command.to_fields())  # type: ignore[arg-type]
    return command.command_id


def signed_by_another_key(command: Command, agent: str) -> Command:
    signature = Ed25519PrivateKey.generate().sign(command_signed_message(command, agent=agent))
    return dataclasses.replace(command, signature=base64.b64encode(signature).decode())


def test_agent_refuses_commands_not_signed_for_it_and_loads_by_unpinned_keys(
    fleet, live_server, redis_client, tmp_path
) -> None:
    port = free_port_pair()
    ingest_log, agent_log = tmp_path / "ingest.log", tmp_path / "agent.log"
    with (
        running(ingest_args(), ingest_log),
        running(agent_args("agent-a", port, settings.REDIS_URL, live_server.url, fleet), agent_log),
    ):
        wait_until(
            lambda: (row := find_agent("agent-a")) is not None and row.last_seq > 0,
            timeout=60,
            message=lambda: logs(agent_log, ingest_log),
        )
        before = agent_row("agent-a")
        assert (before.state, before.detail) == ("idle", "")

        # The first refusal is audited; the others within the minute are only counted.
        unsigned = sent(redis_client, "agent-a", new_command(CommandKind.FAULTS, FAULTS))
        wait_until(
            lambda: AuditEvent.objects.filter(action="agent.command.refused").exists(),
            timeout=30,
            message=lambda: logs(agent_log, ingest_log),
        )
        expired = new_command(CommandKind.FAULTS, FAULTS)
        expired = dataclasses.replace(expired, expires_at=expired.issued_at - 1)
        refused = {
            "unsigned_command": unsigned,
            "bad_command_signature": sent(
                redis_client,
                "agent-a",
                signed_by_another_key(new_command(CommandKind.FAULTS, FAULTS), "agent-a"),
            ),
            # Signed by the control plane, for another agent, copied to this one's stream.
            "bad_command_signature for agent-b": sent(
                redis_client,
                "agent-a",
                command_sign(new_command(CommandKind.FAULTS, FAULTS), agent_name="agent-b"),
            ),
            "expired": sent(redis_client, "agent-a", command_sign(expired, agent_name="agent-a")),
        }

        def answered() -> bool:
            return all(results_of(redis_client, command_id) for command_id in refused.values())

        wait_until(answered, timeout=30, message=lambda: logs(agent_log))
        for label, command_id in refused.items():
            [result] = results_of(redis_client, command_id)
            reason = label.split(" ")[0]
            assert (result.status.value, result.detail.split(":")[0]) == ("rejected", reason)
        # Acknowledged: nothing left pending for the agent's group.
        assert redis_client.xpending(commands_stream("agent-a"), "agent")["pending"] == 0
        # A forged command leaves no record that would answer for a real one of its id.
        assert not redis_client.exists(command_record_key("agent-a", refused["unsigned_command"]))

        # The control plane heard of them all (ingest has nothing pending), auditing the first.
        last_result_id = redis_client.xrevrange(RESULTS_STREAM, count=1)[0][0]
        wait_until(
            lambda: _ingested_up_to(redis_client, last_result_id),
            timeout=15,
            message=lambda: logs(ingest_log),
        )
        [audit] = AuditEvent.objects.filter(action="agent.command.refused")
        assert (audit.object_type, audit.object_id, audit.actor_name) == (
            "agent",
            "agent-a",
            "system",
        )
        assert audit.after["by_reason"] == {"unsigned_command": 1}

        # A real command runs once; delivered again, it is answered from the record.
        faults = fleet.command("agent-a", kind="faults", latency_ms_per_token=5, error_rate=0.0)
        wait_until(lambda: is_final(faults["command_id"]), timeout=30, message=logs(agent_log))
        assert command_row(faults["command_id"]).status == "succeeded"
        [(_, fields)] = [
            entry
            for entry in redis_client.xrange(commands_stream("agent-a"))
            if entry[1]["command_id"] == faults["command_id"]
        ]
        redis_client.xadd(commands_stream("agent-a"), fields)

        def replays() -> list[CommandResult]:
            return [r for r in results_of(redis_client, faults["command_id"]) if r.is_replay]

        wait_until(lambda: replays(), timeout=30, message=lambda: logs(agent_log))
        ran = [r for r in results_of(redis_client, faults["command_id"]) if not r.is_replay]
        assert [r.status.value for r in ran] == ["accepted", "succeeded"]
        assert [r.status.value for r in replays()] == ["succeeded"]

        # A load signed by a release key the control plane trusts but the agent has not
        # pinned: refused before anything is fetched or started.
        other = Signer("other-release-key", Ed25519PrivateKey.generate())
        SigningKey.objects.create(
            key_id=other.key_id, public_key=other.public_key_b64, is_trusted=True
        )
        weights = tmp_path / "tiny.gguf"
        weights.write_bytes(gguf_bytes())
        version = _version_signed_by(fleet, other, weights)
        load = fleet.command("agent-a", kind="load", version_id=version.pk)
        wait_until(lambda: is_final(load["command_id"]), timeout=30, message=logs(agent_log))
        row = command_row(load["command_id"])
        assert row.status == "rejected"
        assert row.detail == (
            "untrusted_signing_key: signing key 'other-release-key' is not pinned on this agent"
        )
        assert [r.status.value for r in results_of(redis_client, load["command_id"])] == [
            "rejected"
        ]
        # Nothing ran: no engine, the agent as it was, the forged faults never applied.
        assert not is_listening(port) and not is_listening(port + 1)
        after = agent_row("agent-a")
        assert (after.state, after.detail, after.loaded_version_id) == ("idle", "", None)
        wait_until(
            lambda: agent_row("agent-a").figures.get("fault_latency_ms") == 5.0,
            timeout=10,
            message=lambda: logs(agent_log),
        )
        assert not (tmp_path / "agent-a" / "artifacts").exists() or not any(
            (tmp_path / "agent-a" / "artifacts").iterdir()
        )


def _ingested_up_to(client: redis.Redis, entry_id: str) -> bool:
    [group] = client.xinfo_groups(RESULTS_STREAM)
    delivered = tuple(int(part) for part in group["last-delivered-id"].split("-"))
    return group["pending"] == 0 and delivered >= tuple(int(p) for p in entry_id.split("-"))


def _version_signed_by(fleet: Fleet, signer: Signer, path: Path) -> Any:
    artifact, _ = registry_services.artifact_store_file(actor=None, path=path)
    version = registry_services.version_register(
        actor=None,
        model=fleet.model,
        label="unpinned",
        artifact_digest=artifact.digest,
        serving_config=SERVING_CONFIG,
    )
    return registry_services.version_verify(
        actor=None,
        version=version,
        key_id=signer.key_id,
        signature=signer.sign(artifact.digest, SERVING_CONFIG),
    )
