"""`manage.py redis_users`: create or refresh Redis's ACL users through REDIS_ADMIN_URL.

The three service roles take their passwords from REDIS_CONTROLPLANE_PASSWORD,
REDIS_INGEST_PASSWORD and REDIS_GATEWAY_PASSWORD (each process then connects with its
role's user in its REDIS_URL); every enrolled agent's user is applied again from its stored
password hash; the default user is switched off; the users are saved to the server's ACL
file where it keeps one. Safe to run any number of times. Prints no secret.
"""

import os
from typing import Any

import redis
from django.core.management.base import BaseCommand, CommandError

from contracts.redis_roles import ROLE_USERS
from controlplane.fleet.models import Agent
from controlplane.fleet.redis_users import (
    redis_acl_save,
    redis_admin_client,
    redis_agent_user_apply,
    redis_default_user_disable,
    redis_role_user_apply,
)


def role_password_variable(role: str) -> str:
    return f"REDIS_{role.upper()}_PASSWORD"


class Command(BaseCommand):
    help = __doc__

    def handle(self, *args: Any, **options: Any) -> None:
        passwords = {role: os.environ.get(role_password_variable(role), "") for role in ROLE_USERS}
        missing = [role_password_variable(role) for role, value in passwords.items() if not value]
        if missing:
            raise CommandError(f"set {', '.join(missing)} (e.g. openssl rand -hex 32)")
        short = [role_password_variable(r) for r, value in passwords.items() if len(value) < 32]
        if short:
            raise CommandError(f"{', '.join(short)}: at least 32 characters")
        client = redis_admin_client()
        try:
            for role, password in passwords.items():
                redis_role_user_apply(client=client, role=role, password=password)
            agents = Agent.objects.exclude(redis_password_hash="").order_by("name")
            for agent in agents:
                redis_agent_user_apply(
                    client=client, agent_name=agent.name, password_hash=agent.redis_password_hash
                )
            redis_default_user_disable(client=client)
            is_saved = redis_acl_save(client=client)
        except redis.RedisError as exc:
            raise CommandError(f"Redis at REDIS_ADMIN_URL refused: {exc}") from exc
        finally:
            client.close()
        self.stdout.write(
            f"redis users: {', '.join(ROLE_USERS)} and {len(agents)} agent(s); default user off; "
            + ("saved to the ACL file" if is_saved else "the server keeps no ACL file")
        )
