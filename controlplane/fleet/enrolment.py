"""Agent enrolment: an admin issues a one-time token for an agent name; the agent trades
it, once, for credentials of its own.

What the agent receives: an API token of its own service account (only that account
registers the name), a Redis user limited to its own keys (contracts/redis_roles.py), the
key that authenticates its heartbeats and results, the public key every command is signed
with, and the release keys a version's signature must verify against, which it pins.
Enrolling a name again (a new token) rotates all of them: the old token and Redis password
stop working at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from contracts.redis_roles import agent_user
from contracts.streams import ContractError, validate_agent_name
from controlplane.accounts.models import AccessToken, Membership
from controlplane.accounts.services import access_token_create
from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core import access
from controlplane.core.credentials import secret_hash, secret_issue
from controlplane.core.errors import DomainError, Forbidden, Unavailable
from controlplane.core.roles import Role
from controlplane.fleet.command_signing import command_public_key_b64
from controlplane.fleet.models import Agent, AgentEnrolment, AgentState
from controlplane.fleet.redis_users import (
    password_sha256,
    redis_acl_save,
    redis_admin_client,
    redis_agent_user_apply,
)
from controlplane.fleet.stream_keys import agent_stream_key
from controlplane.registry.models import SigningKey

ENROLMENT_TOKEN_PREFIX = "cpe-"  # noqa: S105 - a visible prefix, not a secret
RESERVED_AGENT_NAMES = frozenset({"register", "enrol"})


@dataclass(frozen=True, slots=True)
class CreatedEnrolment:
    enrolment: AgentEnrolment
    raw_token: str  # shown once


def agent_account_username(agent_name: str) -> str:
    return f"agent@{agent_name}"


def agent_name_validate(name: str) -> None:
    try:
        validate_agent_name(name)
    except ContractError as exc:
        raise DomainError("invalid", str(exc), fields={"name": [str(exc)]}) from exc
    if name in RESERVED_AGENT_NAMES:
        raise DomainError("reserved_name", f"{name!r} is reserved.", fields={"name": [name]})


def agent_enrolment_create(
    *, actor: Actor, agent_name: str, ttl_s: float | None = None
) -> CreatedEnrolment:
    """A one-time enrolment token for `agent_name`. `actor=None` is an operator at the
    command line (`manage.py agent_enrol`)."""
    if actor is not None and not access.can_enrol_agents(actor):
        raise Forbidden("Only admins enrol agents.")
    agent_name_validate(agent_name)
    ttl_s = settings.FLEET_ENROLMENT_TTL_S if ttl_s is None else ttl_s
    if not 60 <= ttl_s <= 30 * 24 * 3600:
        raise DomainError(
            "invalid", "An enrolment lasts 60 s to 30 days.", fields={"ttl_s": [str(ttl_s)]}
        )
    secret = secret_issue(prefix=ENROLMENT_TOKEN_PREFIX)
    with transaction.atomic():
        enrolment = AgentEnrolment.objects.create(
            agent_name=agent_name,
            token_hash=secret.hash,
            created_by=acting_user(actor),
            expires_at=timezone.now() + timedelta(seconds=ttl_s),
        )
        audit_event_record(
            actor=actor,
            action="agent.enrolment.create",
            object_type="agent",
            object_id=agent_name,
            object_repr=agent_name,
            after={"expires_at": enrolment.expires_at.isoformat(), "prefix": secret.visible_prefix},
        )
    return CreatedEnrolment(enrolment=enrolment, raw_token=secret.raw)


def agent_enrol(*, token: str) -> dict[str, Any]:
    """Trade a valid, unused enrolment token for the agent's credentials (shown once)."""
    now = timezone.now()
    api_token_holder: dict[str, str] = {}
    redis_password = secrets.token_urlsafe(32)
    try:
        with transaction.atomic():
            enrolment = (
                AgentEnrolment.objects.select_for_update()
                .filter(token_hash=secret_hash(token))
                .first()
            )
            if enrolment is None:
                raise DomainError(
                    "enrolment_token_invalid", "No such enrolment token.", status_code=401
                )
            if enrolment.used_at is not None:
                raise DomainError(
                    "enrolment_token_used", "This enrolment token was used.", status_code=401
                )
            if enrolment.expires_at <= now:
                raise DomainError(
                    "enrolment_token_expired", "This enrolment token expired.", status_code=401
                )
            name = enrolment.agent_name
            account = _agent_account(name)
            # Rotation: the previous credentials stop working with this enrolment.
            AccessToken.objects.filter(user=account, revoked_at__isnull=True).update(revoked_at=now)
            api_token_holder["raw"] = access_token_create(
                user=account, name=f"enrolment {enrolment.pk}"
            ).raw_token
            agent, created = Agent.objects.select_for_update().get_or_create(
                name=name, defaults={"registered_at": now, "state": AgentState.IDLE}
            )
            before = None if created else agent.snapshot()
            agent.account = account
            agent.redis_password_hash = password_sha256(redis_password)
            agent.enrolled_at = now
            # Ordering starts again with the enrolled agent's own heartbeats.
            agent.last_sent_at, agent.last_seq = None, 0
            agent.save()
            enrolment.used_at = now
            enrolment.save(update_fields=["used_at"])
            audit_event_record(
                actor=account,
                action="agent.enrol",
                object_type="agent",
                object_id=name,
                object_repr=name,
                before=before,
                after={"enrolment_id": enrolment.pk, "redis_user": agent_user(name)},
            )
            # Last, inside the transaction: if Redis refuses, nothing is recorded (503).
            client = redis_admin_client()
            try:
                redis_agent_user_apply(
                    client=client, agent_name=name, password_hash=agent.redis_password_hash
                )
                redis_acl_save(client=client)
            finally:
                client.close()
    except redis.RedisError as exc:
        raise Unavailable("redis_unavailable", f"The agent's Redis user: {exc}") from exc
    return {
        "agent": name,
        "api_token": api_token_holder["raw"],
        "redis_username": agent_user(name),
        "redis_password": redis_password,
        "stream_key": agent_stream_key(name),
        "command_public_key": command_public_key_b64(),
        "trusted_keys": dict(
            SigningKey.objects.filter(is_trusted=True).values_list("key_id", "public_key")
        ),
    }


def _agent_account(name: str) -> Any:
    user_model = get_user_model()
    account, created = user_model.objects.get_or_create(username=agent_account_username(name))
    if created:
        account.set_unusable_password()
        account.save(update_fields=["password"])
        Membership.objects.create(user=account, role=Role.AGENT)
    return account
