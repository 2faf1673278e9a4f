"""Redis ACL users: the three service roles and one user per enrolled agent.

Applied through `REDIS_ADMIN_URL` only (`manage.py redis_users`, agent enrolment). Only
password hashes are sent (`#<sha256>`), so the control plane can apply an agent's user
again (a Redis that lost its users) without ever holding the agent's password.
"""

from __future__ import annotations

import hashlib
import logging

import redis
from django.conf import settings

from contracts.redis_roles import (
    agent_rules,
    agent_user,
    role_rules,
    setuser_arguments,
)
from controlplane.core.redis_clients import redis_client

logger = logging.getLogger(__name__)


def redis_admin_client() -> redis.Redis:
    return redis_client(url=settings.REDIS_ADMIN_URL)


def password_sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def redis_role_user_apply(*, client: redis.Redis, role: str, password: str) -> None:
    rules = role_rules(
        role,
        channels_prefix=settings.CHANNELS_PREFIX,
        celery_queue=settings.CELERY_TASK_DEFAULT_QUEUE,
    )
    client.execute_command(
        "ACL", "SETUSER", *setuser_arguments(role, rules, password_sha256=password_sha256(password))
    )


def redis_agent_user_apply(*, client: redis.Redis, agent_name: str, password_hash: str) -> None:
    arguments = setuser_arguments(
        agent_user(agent_name), agent_rules(agent_name), password_sha256=password_hash
    )
    client.execute_command("ACL", "SETUSER", *arguments)


def redis_default_user_disable(*, client: redis.Redis) -> None:
    """Nothing works without a user of its own."""
    client.execute_command("ACL", "SETUSER", "default", "reset", "off")


def redis_acl_save(*, client: redis.Redis) -> bool:
    """Persist the users where the server keeps an ACL file; False where it keeps none."""
    try:
        client.execute_command("ACL", "SAVE")
    except redis.ResponseError as exc:
        if "ACL file" in str(exc):  # the server was started without `aclfile`
            return False
        raise
    return True
