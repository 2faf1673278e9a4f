"""Before tenants are routed to an agent's endpoint, the engine there proves it serves for
that agent, with the admin secret of the load command that started it.

The challenge is `GET <endpoint>/identity?nonce=<fresh>`; the answer must name the agent
and carry HMAC-SHA256(admin secret, agent, nonce) (contracts.engine_identity). Only the
engine the agent started for that load holds the secret (derived from FLEET_ENGINE_KEY
and the command id, never stored), so a server that merely sits at the endpoint fails.
A success is remembered on the agent row per (load command, endpoint), so each is
challenged once; a failure is counted, audited at most once per agent per minute, and
challenged again on a later pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import httpx
import redis
from prometheus_client import Counter

from contracts.engine_identity import IDENTITY_PATH, is_identity_proof_valid, new_nonce
from controlplane.audit.services import audit_event_record
from controlplane.fleet import services
from controlplane.fleet.engine_secrets import ADMIN, engine_secret
from controlplane.fleet.models import Agent

logger = logging.getLogger(__name__)

TIMEOUT = httpx.Timeout(2.0, connect=1.0)  # a pass of the reconciler waits for these
PARALLEL_CHALLENGES = 8
REFUSED_AUDIT_EVERY_S = 60


class CheckResult(StrEnum):
    OK = "ok"
    UNREACHABLE = "unreachable"  # no HTTP answer, or not JSON
    WRONG_AGENT = "wrong_agent"  # an engine, serving for another agent (or none)
    BAD_PROOF = "bad_proof"  # an error status, or a proof the admin secret does not make


CHECKS_TOTAL = Counter(
    "fleet_endpoint_checks_total", "Identity challenges of agents' endpoints", ["result"]
)
for _result in CheckResult:
    CHECKS_TOTAL.labels(_result.value)


def endpoint_challenge(*, endpoint: str, agent_name: str, admin_secret: str) -> CheckResult:
    """Ask the engine at `endpoint` to prove it serves for `agent_name` with `admin_secret`."""
    nonce = new_nonce()
    try:
        response = httpx.get(
            endpoint.rstrip("/") + IDENTITY_PATH, params={"nonce": nonce}, timeout=TIMEOUT
        )
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return CheckResult.UNREACHABLE
    if response.status_code != 200 or not isinstance(body, dict):
        return CheckResult.BAD_PROOF
    if body.get("agent") != agent_name:
        return CheckResult.WRONG_AGENT
    proof = body.get("proof")
    if not isinstance(proof, str) or not is_identity_proof_valid(
        admin_secret=admin_secret, agent=agent_name, nonce=nonce, proof=proof
    ):
        return CheckResult.BAD_PROOF
    return CheckResult.OK


def is_endpoint_verified(agent: Agent, command_id: str) -> bool:
    """Whether the agent's endpoint, one it registered, proved itself for this load."""
    return (
        bool(agent.endpoint)
        and agent.endpoint in agent.endpoints
        and agent.verified_endpoint == agent.endpoint
        and agent.verified_load_command_id == command_id
    )


def endpoints_verify(
    *, agents: Sequence[Agent], loads: Mapping[int, str], client: redis.Redis
) -> set[int]:
    """The ids of those `agents` whose endpoint proved itself for their load (`loads`: agent
    id -> load command id), challenging those not verified yet (in parallel)."""
    verified: set[int] = set()
    pending: list[tuple[Agent, str]] = []
    for agent in agents:
        command_id = loads.get(agent.pk)
        if command_id is None or not agent.endpoint or agent.endpoint not in agent.endpoints:
            continue
        if is_endpoint_verified(agent, command_id):
            verified.add(agent.pk)
        else:
            pending.append((agent, command_id))
    if not pending:
        return verified

    def challenge(item: tuple[Agent, str]) -> CheckResult:
        agent, command_id = item
        secret = engine_secret(purpose=ADMIN, agent_name=agent.name, command_id=command_id)
        return endpoint_challenge(
            endpoint=agent.endpoint, agent_name=agent.name, admin_secret=secret
        )

    with ThreadPoolExecutor(max_workers=min(PARALLEL_CHALLENGES, len(pending))) as pool:
        results = list(pool.map(challenge, pending))
    for (agent, command_id), result in zip(pending, results, strict=True):
        CHECKS_TOTAL.labels(result.value).inc()
        if result == CheckResult.OK:
            services.agent_endpoint_mark_verified(
                agent_id=agent.pk, command_id=command_id, endpoint=agent.endpoint
            )
            # As recorded: a caller that holds these rows for more passes asks no more.
            agent.verified_endpoint, agent.verified_load_command_id = agent.endpoint, command_id
            verified.add(agent.pk)
            continue
        logger.warning(
            "endpoint not routed: its engine did not prove it serves for the agent",
            extra={"agent": agent.name, "endpoint": agent.endpoint, "result": result.value},
        )
        _audit_refused(agent, command_id, result, client)
    return verified


def _audit_refused(agent: Agent, command_id: str, result: CheckResult, client: redis.Redis) -> None:
    """At most once per agent per minute, across every process that reconciles."""
    key = f"fleet:endpoint-refused-audited:{agent.name}"
    if not client.set(key, "1", nx=True, ex=REFUSED_AUDIT_EVERY_S):
        return
    audit_event_record(
        actor=None,
        action="agent.endpoint_refused",
        object_type="agent",
        object_id=agent.name,
        object_repr=agent.name,
        after={"endpoint": agent.endpoint, "load_command_id": command_id, "reason": result.value},
        reason=f"the engine at {agent.endpoint} did not prove it serves for {agent.name}",
    )
