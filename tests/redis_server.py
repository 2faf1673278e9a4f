"""A private Redis with ACLs for the test session (loaded with `-p tests.redis_server`).

The default user is off, as in production: the harness holds an admin user, every part
under test connects as its role's user (`manage.py redis_users` creates them at session
start, see tests/conftest.py) and each agent as the user its enrolment made. The server is
started when this plugin is imported, before Django reads its settings, so REDIS_URL and
the other role URLs below are the settings of the test process and of its children.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from contracts.redis_roles import CONTROLPLANE_USER, GATEWAY_USER, INGEST_USER


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class AclRedis:
    """One redis-server process whose users live in an ACL file (they survive a restart)."""

    def __init__(self, directory: Path, *, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.admin_password = secrets.token_hex(16)
        self.aclfile = directory / "users.acl"
        self.aclfile.write_text(
            f"user default off\nuser admin on >{self.admin_password} ~* &* +@all\n"
        )
        self.process: subprocess.Popen[bytes] | None = None

    def args(self) -> list[str]:
        return [
            shutil.which("redis-server") or "redis-server",
            *("--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
            *("--dir", str(self.directory), "--aclfile", str(self.aclfile)),
        ]

    def url(self, user: str, password: str, database: int = 0) -> str:
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/{database}"

    @property
    def admin_url(self) -> str:
        return self.url("admin", self.admin_password)

    def start(self, log_path: Path | None = None) -> None:
        log = open(log_path or self.directory / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.process = subprocess.Popen(
            self.args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        client = redis.Redis.from_url(self.admin_url, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.args()}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def _start_session_server() -> AclRedis:
    server = AclRedis(Path(tempfile.mkdtemp(prefix="test-redis-")))
    server.start()

    def stop_and_remove() -> None:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)

    atexit.register(stop_and_remove)
    roles = (CONTROLPLANE_USER, INGEST_USER, GATEWAY_USER)
    passwords = {role: secrets.token_hex(24) for role in roles}
    os.environ.update(
        {
            "REDIS_ADMIN_URL": server.admin_url,
            "REDIS_URL": server.url(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER]),
            "INGEST_REDIS_URL": server.url(INGEST_USER, passwords[INGEST_USER]),
            "GATEWAY_REDIS_URL": server.url(GATEWAY_USER, passwords[GATEWAY_USER]),
            **{f"REDIS_{role.upper()}_PASSWORD": value for role, value in passwords.items()},
        }
    )
    return server


SESSION_SERVER = _start_session_server()
