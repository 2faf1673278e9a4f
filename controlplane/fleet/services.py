"""Writes to the fleet: registration, commands, command results from ingest, lost agents.

Command results arrive at least once and in any order across several ingest processes,
so applying them is idempotent and order-safe: a command's status only moves forward.
Heartbeats are written by controlplane.telemetry.heartbeats.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from contracts.capacity import footprint_total
from contracts.commands import (
    COMMANDS_MAXLEN,
    Command,
    CommandResult,
    command_refusal_reason,
    commands_stream,
    new_command,
)
from contracts.commands import CommandKind as WireCommandKind
from contracts.engine_identity import engine_endpoint, is_valid_host
from controlplane.audit.services import (
    Actor,
    acting_user,
    audit_event_new,
    audit_event_record,
    audit_events_record,
)
from controlplane.core import access
from controlplane.core.errors import Conflict, DomainError, Forbidden, NotFound, Unavailable
from controlplane.core.events import BROADCAST_GROUP, FLEET_LIVE_GROUP, publish_events
from controlplane.core.redis_clients import redis_client as make_redis_client
from controlplane.fleet.command_signing import command_sign
from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.fleet.inventory import inventory_validate
from controlplane.fleet.models import (
    FINAL_COMMAND_STATUSES,
    Agent,
    AgentCommand,
    AgentSample,
    AgentState,
    CommandKind,
    CommandStatus,
)
from controlplane.fleet.refusals import COMMANDS_REFUSED_TOTAL, agent_refusals_audit
from controlplane.registry.models import LOADABLE_STATUSES, ModelVersion

logger = logging.getLogger(__name__)


def fleet_event_publish(event: str, payload: dict[str, Any]) -> None:
    """Send one live event to the dashboard's fleet group (and the broadcast group for now)."""
    fleet_events_publish([(event, payload)])


def fleet_events_publish(events: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Send live events to the dashboard's fleet group (and the broadcast group)."""
    publish_events([FLEET_LIVE_GROUP, BROADCAST_GROUP], events)


def agent_event_payload(agent: Agent) -> dict[str, Any]:
    return {
        "agent": agent.name,
        "state": agent.state,
        "detail": agent.detail,
        "endpoint": agent.endpoint,
        "loaded_version_id": agent.loaded_version_id,
        "last_seen": agent.last_seen.isoformat() if agent.last_seen else None,
    }


# Registration.

AGENT_PORT_COUNT = 2  # an agent's engine alternates between two ports on each load


def agent_endpoints(*, advertise_host: str, ports: Sequence[int]) -> list[str]:
    """The endpoints an agent's engines may serve at; DomainError("invalid") unless the host
    is a host name or an IP address and the ports are two distinct ports in 1..65535."""
    problems: dict[str, list[str]] = {}
    if not is_valid_host(advertise_host):
        problems["advertise_host"] = ["Must be a host name or an IP address."]
    is_port = [isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports]
    if len(ports) != AGENT_PORT_COUNT or not all(is_port) or len(set(ports)) != len(ports):
        problems["ports"] = ["Must be the agent's two distinct engine ports, each 1..65535."]
    if problems:
        raise DomainError("invalid", "The agent's endpoints are not valid.", fields=problems)
    return [engine_endpoint(advertise_host, port) for port in ports]


@transaction.atomic
def agent_register(
    *,
    actor: Actor,
    name: str,
    host: str,
    endpoint: str,
    advertise_host: str,
    ports: list[int],
    inventory: dict[str, Any],
    energy_source: str,
) -> tuple[Agent, bool]:
    """Refresh an enrolled agent's registration; (agent, is_first). Agents re-register at
    every start and after every Redis outage, so only the first registration, a changed host
    or changed endpoints are audited. Only the agent's own account (from its enrolment)
    registers its name.

    The endpoints (`advertise_host` x `ports`) are the only ones its heartbeats may name and
    the reconciler may route to; `endpoint`, the engine serving now, must be one of them.
    """
    if not access.can_register_agent(actor):
        raise Forbidden("Only an enrolled agent (or an admin) registers agents.")
    endpoints = agent_endpoints(advertise_host=advertise_host, ports=ports)
    inventory_validate(inventory)
    if endpoint and endpoint not in endpoints:
        raise DomainError(
            "unregistered_endpoint",
            "The endpoint is not one of the agent's advertise host and ports.",
            fields={"endpoint": [f"Must be empty or one of {', '.join(endpoints)}."]},
        )
    now = timezone.now()
    agent = Agent.objects.select_for_update().filter(name=name).first()
    if agent is None or agent.enrolled_at is None:
        raise Conflict("agent_not_enrolled", f"Agent {name!r} is not enrolled; enrol it first.")
    if not access.is_admin(actor) and agent.account_id != getattr(actor, "pk", None):
        raise Forbidden(f"These credentials are not agent {name!r}'s.")
    created = not agent.host
    before = None if created else {**agent.snapshot(), "endpoints": agent.endpoints}
    is_moved = not created and (agent.host != host or agent.endpoints != endpoints)
    agent.host = host
    agent.endpoint = endpoint
    agent.verified_endpoint = ""  # a new agent process: its engine proves itself again
    agent.ports = ports
    agent.advertise_host = advertise_host
    agent.endpoints = endpoints
    agent.inventory = inventory
    agent.accelerator = str(inventory.get("accelerator") or "")[:200]
    agent.energy_source = energy_source
    agent.registered_by = acting_user(actor)
    agent.registered_at = now if created or is_moved else agent.registered_at
    agent.last_seen = now  # lost detection starts counting from here
    # A new agent process starts its own sequence; ordering starts again from its first
    # heartbeat (and whatever was applied before, even a forged one, no longer counts).
    agent.last_sent_at, agent.last_seq = None, 0
    was_lost = agent.state == AgentState.LOST
    if was_lost:
        agent.state, agent.detail = AgentState.IDLE, ""
    agent.save()
    if created or is_moved:
        audit_event_record(
            actor=actor,
            action="agent.register",
            object_type="agent",
            object_id=agent.name,
            object_repr=agent.name,
            before=before,
            after={
                **agent.snapshot(),
                "endpoints": agent.endpoints,
                "accelerator": agent.accelerator,
            },
        )
    if created or was_lost:
        payload = agent_event_payload(agent)
        transaction.on_commit(lambda: fleet_event_publish("agent.state", payload))
    return agent, created


def agent_endpoint_mark_verified(*, agent_id: int, command_id: str, endpoint: str) -> None:
    """Remember that the engine at `endpoint` proved it holds the admin secret of load
    `command_id` of this agent (GET /identity): it is routed without being asked again."""
    Agent.objects.filter(pk=agent_id).update(
        verified_endpoint=endpoint, verified_load_command_id=command_id
    )


# Commands.


def _load_payload(version: ModelVersion, *, served_model_name: str) -> dict[str, Any]:
    if version.status not in LOADABLE_STATUSES:
        raise Conflict(
            "version_not_loadable",
            f"Version {version} is {version.status}; only verified versions can be loaded.",
        )
    key = version.signing_key
    if not version.signature or key is None:
        raise Conflict(
            "version_unsigned",
            f"Version {version} has no signature: agents verify one before loading.",
        )
    if not key.is_trusted:
        raise Conflict("signing_key_untrusted", f"Signing key {key.key_id} is not trusted.")
    return {
        "version_id": version.pk,
        "model": version.model.name,
        "label": version.label,
        "digest": version.artifact_digest,
        "format": version.artifact.format if version.artifact else "",
        "size_bytes": version.artifact.size_bytes if version.artifact else 0,
        "serving_config": version.serving_config,
        "engine": version.engine,
        "engine_args": version.engine_args,
        "signature": version.signature,
        "key_id": key.key_id,
        "public_key": key.public_key,
        "served_model_name": served_model_name or version.model.name,
        # The agent refuses a load it has not the memory for (0: unknown, not checked).
        "footprint_bytes": footprint_total(version.footprint) or 0,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class CommandOrder:
    """One command to send: to which agent, what, and why (`agent_commands_send`)."""

    agent_name: str
    kind: str
    version_id: int | None = None
    served_model_name: str = ""
    latency_ms_per_token: float | None = None
    error_rate: float | None = None
    reason: str = ""


@dataclasses.dataclass(slots=True)
class CommandsSent:
    commands: list[AgentCommand]  # in the orders' order, refused ones left out
    refused: list[tuple[CommandOrder, DomainError]]  # with why, in the orders' order


def agent_command_send(
    *,
    actor: Actor,
    agent_name: str,
    kind: str,
    version_id: int | None = None,
    served_model_name: str = "",
    latency_ms_per_token: float | None = None,
    error_rate: float | None = None,
    reason: str = "",
    redis_client: redis.Redis | None = None,
) -> AgentCommand:
    """Record, audit and send one command to an agent's stream, in one transaction; the
    DomainError when it is refused (`agent_commands_send`)."""
    order = CommandOrder(
        agent_name=agent_name,
        kind=kind,
        version_id=version_id,
        served_model_name=served_model_name,
        latency_ms_per_token=latency_ms_per_token,
        error_rate=error_rate,
        reason=reason,
    )
    sent = agent_commands_send(actor=actor, orders=[order], redis_client=redis_client)
    if sent.refused:
        raise sent.refused[0][1]
    return sent.commands[0]


def agent_commands_send(
    *,
    actor: Actor,
    orders: Sequence[CommandOrder],
    redis_client: redis.Redis | None = None,
) -> CommandsSent:
    """Record, audit and send commands to agents' streams, all in one transaction: one
    statement for each step whatever their number (a reconcile pass sends a deployment's
    loads together).

    An order the fleet refuses (an unknown command, agent or version, a lost agent, a
    version that cannot be loaded, bad fault settings) comes back with its error and the
    others are sent. The stream entries are added inside the transaction, together
    (MULTI/EXEC), before the rows that name them: if Redis refuses them nothing is
    recorded (Unavailable, 503). Each agent answers on `agent:results`, which ingest
    applies. `actor=None` is the control plane itself (the rollouts reconciler); views
    always pass the requesting user.
    """
    if actor is not None and not access.can_command_agents(actor):
        raise Forbidden("Only release managers and on-call engineers command agents.")
    refused: dict[int, DomainError] = {}  # order index -> why
    version_ids = {o.version_id for o in orders if o.version_id is not None}
    versions = {
        version.pk: version
        for version in ModelVersion.objects.select_related("model", "artifact", "signing_key")
        .filter(pk__in=version_ids)
        .order_by()
    }
    wires: dict[int, tuple[Command, dict[str, Any]]] = {}  # order index -> (sent, recorded payload)
    for index, order in enumerate(orders):
        try:
            payload = _command_payload(order, versions)
        except DomainError as exc:
            refused[index] = exc
            continue
        wire = new_command(WireCommandKind(order.kind), payload, ttl_s=settings.FLEET_COMMAND_TTL_S)
        sent_payload = payload
        if order.kind == CommandKind.LOAD:
            # Only the stream entry carries the engine's secrets; the recorded payload, which
            # the API shows, does not (they are derived again from the command id when needed).
            secrets = engine_secrets_payload(
                agent_name=order.agent_name, command_id=wire.command_id
            )
            sent_payload = {**payload, **secrets}
        # Signed last: the signature covers the payload as sent, and only this agent's name.
        wire = command_sign(
            dataclasses.replace(wire, payload=sent_payload), agent_name=order.agent_name
        )
        wires[index] = (wire, payload)
    client = redis_client or make_redis_client()
    commands: list[AgentCommand] = []
    try:
        with transaction.atomic():
            names = {orders[index].agent_name for index in wires}
            agents = {
                agent.name: agent
                for agent in Agent.objects.select_for_update()
                .filter(name__in=names)
                .order_by("id")  # the order ingest and heartbeats lock agents in: no deadlock
            }
            audit_events = []
            sending: list[tuple[Agent, Command]] = []
            for index, (wire, payload) in wires.items():
                order = orders[index]
                agent = agents.get(order.agent_name)
                if agent is None:
                    refused[index] = NotFound("No such agent.")
                    continue
                if agent.state == AgentState.LOST:
                    refused[index] = Conflict(
                        "agent_lost", f"Agent {agent.name} is lost; it cannot be commanded."
                    )
                    continue
                version = versions.get(order.version_id) if order.version_id else None
                commands.append(
                    AgentCommand(
                        command_id=wire.command_id,
                        agent=agent,
                        kind=order.kind,
                        payload=payload,
                        version=version,
                        reason=order.reason,
                        issued_by=acting_user(actor),
                    )
                )
                audit_events.append(
                    audit_event_new(
                        actor=actor,
                        action=f"agent.command.{order.kind}",
                        object_type="agent",
                        object_id=agent.name,
                        object_repr=agent.name,
                        before=agent.snapshot(),
                        after={
                            "command_id": wire.command_id,
                            "kind": order.kind,
                            "version_id": version.pk if version else None,
                            **({"faults": payload} if order.kind == CommandKind.FAULTS else {}),
                        },
                        reason=order.reason,
                    )
                )
                sending.append((agent, wire))
            if commands:
                # The agents' rows are locked: ingest applies no result of these commands
                # before the commit makes them visible.
                entries = client.pipeline(transaction=True)
                for agent, wire in sending:
                    entries.xadd(
                        commands_stream(agent.name),
                        wire.to_fields(),  # type: ignore[arg-type]
                        maxlen=COMMANDS_MAXLEN,
                        approximate=True,
                    )
                for command, entry_id in zip(commands, entries.execute(), strict=True):
                    command.stream_entry_id = (
                        entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    )
                AgentCommand.objects.bulk_create(commands)
                audit_events_record(audit_events)
    except redis.RedisError as exc:
        raise Unavailable("redis_unavailable", f"The command could not be queued: {exc}") from exc
    finally:
        if redis_client is None:
            client.close()
    events = [("agent.command", command_event_payload(command)) for command in commands]
    if events:
        transaction.on_commit(lambda: fleet_events_publish(events))
    return CommandsSent(
        commands=commands,
        refused=[(orders[index], refused[index]) for index in sorted(refused)],
    )


def _command_payload(order: CommandOrder, versions: dict[int, ModelVersion]) -> dict[str, Any]:
    """The payload recorded for `order`; DomainError when it cannot be sent."""
    kind = order.kind
    if kind not in CommandKind.values:
        raise DomainError("invalid", f"Unknown command {kind!r}.", fields={"kind": [kind]})
    if kind == CommandKind.LOAD:
        if order.version_id is None:
            raise DomainError("invalid", "A load names a version.", fields={"version_id": []})
        version = versions.get(order.version_id)
        if version is None:
            raise NotFound("No such version.")
        return _load_payload(version, served_model_name=order.served_model_name)
    if kind == CommandKind.DRAIN and order.version_id is not None:
        # Drain only if the agent still serves this version (it refuses otherwise): a
        # sender working from a stale heartbeat cannot drain a version just loaded.
        if order.version_id not in versions:
            raise NotFound("No such version.")
        return {"version_id": order.version_id}
    if kind == CommandKind.FAULTS:
        latency = 0.0 if order.latency_ms_per_token is None else float(order.latency_ms_per_token)
        rate = 0.0 if order.error_rate is None else float(order.error_rate)
        problems: dict[str, list[str]] = {}
        if not 0 <= latency <= 60_000:
            problems["latency_ms_per_token"] = ["Must be between 0 and 60000."]
        if not 0 <= rate <= 1:
            problems["error_rate"] = ["Must be between 0 and 1."]
        if problems:
            raise DomainError("invalid", "The fault settings are not valid.", fields=problems)
        return {"latency_ms_per_token": latency, "error_rate": rate}
    return {}


def command_event_payload(command: AgentCommand) -> dict[str, Any]:
    return {
        "command_id": command.command_id,
        "agent": command.agent.name,
        "kind": command.kind,
        "status": command.status,
        "detail": command.detail,
    }


def _command_status_rank(value: str) -> int:
    if value in FINAL_COMMAND_STATUSES:
        return 2
    return 1 if value == CommandStatus.ACCEPTED else 0


@transaction.atomic
def command_results_apply(*, results: Sequence[CommandResult]) -> list[dict[str, Any]]:
    """Apply results from `agent:results`; statuses only move forward. Returns the events."""
    by_id = {result.command_id: result for result in results}
    # A command's sender holds its agent's row lock until it commits, and the stream entry
    # is written just before: a quick agent's result can arrive first. Taking the same locks
    # waits for that commit, so the command row is visible below instead of the result
    # being dropped and the command looking in flight until it times out.
    list(
        Agent.objects.select_for_update()
        .filter(name__in={result.agent for result in results})
        .order_by("id")
        .values_list("id", flat=True)
    )
    commands = list(
        AgentCommand.objects.select_for_update()
        .select_related("agent")
        .filter(command_id__in=by_id)
        .order_by("id")
    )
    unknown = set(by_id) - {command.command_id for command in commands}
    if unknown:
        logger.warning("results for unknown commands dropped: %s", ", ".join(sorted(unknown)))
    _command_refusals_record(results, unknown=unknown)
    events = []
    for command in commands:
        # Several results for one command in a batch: apply them in order of rank.
        for result in sorted(
            (r for r in results if r.command_id == command.command_id),
            key=lambda r: _command_status_rank(r.status.value),
        ):
            if result.agent != command.agent.name:
                logger.warning("result for %s from the wrong agent", command.command_id)
                continue
            if _command_status_rank(result.status.value) <= _command_status_rank(command.status):
                continue  # a replay or an older result
            when = datetime.fromtimestamp(result.finished_at, tz=UTC)
            command.status = result.status.value
            command.detail = result.detail
            if result.status.value == CommandStatus.ACCEPTED:
                command.accepted_at = when
            else:
                command.finished_at = when
                command.accepted_at = command.accepted_at or when
            command.save(update_fields=["status", "detail", "accepted_at", "finished_at"])
            events.append(command_event_payload(command))
    return events


def _command_refusals_record(results: Sequence[CommandResult], *, unknown: set[str]) -> None:
    """Count the commands agents refused unrun, and the results for commands never sent (a
    forged command's refusal, or a forged result); audit each agent's at most once a minute."""
    by_agent: dict[str, dict[str, int]] = {}
    for result in results:
        reason = None
        if result.status == CommandStatus.REJECTED:
            reason = command_refusal_reason(result.detail)
        if reason is None and result.command_id in unknown:
            reason = "unknown_command"
        if reason is None:
            continue
        COMMANDS_REFUSED_TOTAL.labels(reason).inc()
        counts = by_agent.setdefault(result.agent, {})
        counts[reason] = counts.get(reason, 0) + 1
    for agent_name, counts in sorted(by_agent.items()):
        logger.warning("agent %s refused commands: %s", agent_name, counts)
        agent_refusals_audit(
            action="agent.command.refused",
            agent_name=agent_name,
            by_reason=counts,
            detail="the agent refused commands unrun, or answered commands never sent",
        )


def agents_mark_lost(*, now: datetime | None = None) -> list[dict[str, Any]]:
    """Mark `lost` every agent not heard of for FLEET_LOST_AFTER_S; returns the events.

    Rows another ingest process is updating are skipped (it will decide them next time).
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.FLEET_LOST_AFTER_S)
    events = []
    with transaction.atomic():
        agents = list(
            Agent.objects.select_for_update(skip_locked=True)
            .filter(last_seen__lt=cutoff)
            .exclude(state=AgentState.LOST)
            .order_by("id")
        )
        for agent in agents:
            before = agent.snapshot()
            seconds = (now - agent.last_seen).total_seconds() if agent.last_seen else 0.0
            agent.state = AgentState.LOST
            agent.detail = f"no heartbeat for {seconds:.1f}s (was {before['state']})"
            agent.verified_endpoint = ""  # should it come back, its engine proves itself again
            agent.save(update_fields=["state", "detail", "verified_endpoint", "updated_at"])
            audit_event_record(
                actor=None,
                action="agent.lost",
                object_type="agent",
                object_id=agent.name,
                object_repr=agent.name,
                before=before,
                after=agent.snapshot(),
                reason=agent.detail,
            )
            events.append({**agent_event_payload(agent), "previous": before["state"]})
    return events


def agent_samples_prune(*, now: datetime | None = None) -> int:
    """Delete rollups older than FLEET_SAMPLE_RETENTION_S; returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.FLEET_SAMPLE_RETENTION_S)
    deleted, _ = AgentSample.objects.filter(bucket_start__lt=cutoff).delete()
    return deleted
