"""The bearer secrets of the engines the agents start, derived, never stored.

Each load command gets its own pair: the serving secret (the gateway, evaluations and the
agent present it on /v1/*, /health, /metrics) and the admin secret (only the agent, on
/admin/*). Both are HMAC-SHA256 of the load's agent and command id under
FLEET_ENGINE_KEY, so the control plane derives them again whenever it needs one instead
of keeping them: the command row's payload holds neither.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from django.conf import settings

from controlplane.fleet.models import Agent, AgentCommand, CommandKind, CommandStatus

SERVING = "engine-serving"
ADMIN = "engine-admin"


def engine_secret(*, purpose: str, agent_name: str, command_id: str) -> str:
    """64 hex characters; `purpose` is SERVING or ADMIN."""
    if purpose not in (SERVING, ADMIN):
        raise ValueError(f"unknown engine secret purpose {purpose!r}")
    message = f"{purpose}:{agent_name}:{command_id}".encode()
    return hmac.new(settings.FLEET_ENGINE_KEY, message, hashlib.sha256).hexdigest()


def engine_secrets_payload(*, agent_name: str, command_id: str) -> dict[str, str]:
    """The two secrets a load command's payload carries to the agent."""
    return {
        "serving_secret": engine_secret(
            purpose=SERVING, agent_name=agent_name, command_id=command_id
        ),
        "admin_secret": engine_secret(purpose=ADMIN, agent_name=agent_name, command_id=command_id),
    }


# An agent reports its new engine (ready, the load's version) as soon as it serves,
# before the load's result, which follows once the old engine has drained: an accepted
# load may already be the one serving.
SERVING_LOAD_STATUSES = (CommandStatus.ACCEPTED, CommandStatus.SUCCEEDED)


def serving_loads(agents: Iterable[Agent]) -> dict[int, str]:
    """{agent id: load command id} of the engine each agent runs for its loaded version: the
    one its latest load of that version started, accepted or succeeded (agents run their
    commands in order; a failed load left the previous engine serving). An agent without
    such a load is left out: its engine's secrets are unknown.
    """
    loaded = {agent.pk: agent.loaded_version_id for agent in agents if agent.loaded_version_id}
    if not loaded:
        return {}
    commands = (
        AgentCommand.objects.filter(
            agent_id__in=list(loaded),
            kind=CommandKind.LOAD,
            status__in=SERVING_LOAD_STATUSES,
            version_id__in=set(loaded.values()),
        )
        .order_by("agent_id", "-created_at", "-id")
        .values_list("agent_id", "version_id", "command_id")
    )
    loads: dict[int, str] = {}
    for agent_id, version_id, command_id in commands:
        if agent_id in loads or loaded[agent_id] != version_id:
            continue
        loads[agent_id] = command_id
    return loads


def serving_secrets(agents: Iterable[Agent], loads: dict[int, str] | None = None) -> dict[int, str]:
    """{agent id: serving secret} of the engine each agent runs for its loaded version (of
    the load `serving_loads` finds, or the given `loads`)."""
    agents = list(agents)
    loads = serving_loads(agents) if loads is None else loads
    return {
        agent.pk: engine_secret(purpose=SERVING, agent_name=agent.name, command_id=loads[agent.pk])
        for agent in agents
        if agent.pk in loads
    }
