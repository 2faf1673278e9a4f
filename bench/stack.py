"""The demo's processes on a benchmark's own stores, for steps that need the whole product.

`DemoStack.start(tmp, database_url, redis_url)` empties the PostgreSQL database and the
Redis database it is given, runs `manage.py migrate` and `manage.py seed_demo` (DEMO_DIR
in `tmp`), then starts what `make demo` starts except the load generator and the story:
the web process (gateway and REST API, uvicorn), a Celery worker (threads) and beat,
`manage.py ingest`, and two agents. `django_setup()` points this process's Django at the
same stores; `stop()` ends every process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEPLOYMENT = "smollm2"  # seed_demo's chat deployment
MODEL = "SmolLM2-135M-Instruct"  # the public model name tenants send


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """The predicate's first truthy value; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def fresh_stores(database_url: str, redis_url: str) -> None:
    """Drop and create the PostgreSQL database named in the URL; empty the Redis db."""
    import psycopg
    import redis

    base, name = database_url.rsplit("/", 1)
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"database name {name!r}: letters, digits and '_' only")
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()


@dataclass
class DemoStack:
    tmp: Path
    env: dict[str, str]
    web_url: str
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path, database_url: str, redis_url: str, **extra_env: str) -> DemoStack:
        fresh_stores(database_url, redis_url)
        port = free_port()
        name = Path(tmp).name.replace("-", "_")
        env = {
            **os.environ,
            "DEBUG": "1",
            "LOG_FORMAT": "text",
            "LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "DEMO_DIR": str(tmp / "demo"),
            "CELERY_QUEUE": f"bench-{name}",
            "CHANNELS_PREFIX": f"bench-{name}",
            "WEB_PORT": str(port),
            **extra_env,
        }
        stack = cls(tmp=tmp, env=env, web_url=f"http://127.0.0.1:{port}")
        for command in (["migrate", "--noinput", "-v", "0"], ["seed_demo"]):
            subprocess.run(
                [PYTHON, "manage.py", *command], cwd=REPO_ROOT, env=env, check=True,
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        demo = tmp / "demo"
        try:
            stack._spawn("web", [PYTHON, "-m", "uvicorn", "controlplane.asgi:application",
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--no-access-log"])  # fmt: skip
            stack._spawn("worker", [PYTHON, "-m", "celery", "-A", "controlplane", "worker",
                                    "--pool", "threads", "--concurrency", "4", "--loglevel",
                                    "WARNING", "--without-gossip", "--without-mingle",
                                    "--without-heartbeat"])  # fmt: skip
            stack._spawn("beat", [PYTHON, "-m", "celery", "-A", "controlplane", "beat",
                                  "--loglevel", "WARNING", "--schedule",
                                  str(tmp / "beat-schedule")])  # fmt: skip
            stack._spawn("ingest", [PYTHON, "manage.py", "ingest"])
            # seed_demo wrote each demo agent a one-time enrolment token.
            for name in ("agent-1", "agent-2"):
                stack._spawn(name, [
                    PYTHON, "-m", "agent", "--name", name,
                    "--port", str(free_port()), "--redis", redis_url,
                    "--control-plane", stack.web_url,
                    "--enrolment-token-file", str(demo / "agents" / f"{name}.enrolment-token"),
                    "--state-dir", str(demo / "agents" / name), "--threads", "1",
                ])  # fmt: skip
        except BaseException:
            stack.stop()
            raise
        return stack

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        try:
            process = subprocess.Popen(
                args, cwd=REPO_ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        finally:
            out.close()
        self.processes.append((name, process))

    @property
    def credentials(self) -> dict[str, Any]:
        return json.loads((self.tmp / "demo" / "credentials.json").read_text())

    def django_setup(self) -> None:
        """Point this process's Django at the stack's stores (once per process)."""
        for key in (
            "DEBUG",
            "DATABASE_URL",
            "REDIS_URL",
            "DEMO_DIR",
            "CELERY_QUEUE",
            "CHANNELS_PREFIX",
        ):
            os.environ[key] = self.env[key]
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        os.environ.setdefault("LOG_LEVEL", "WARNING")
        import django

        django.setup()

    def check(self) -> None:
        """Raise, with its log's tail, if any process has exited."""
        for name, process in self.processes:
            if process.poll() is not None:
                tail = (self.tmp / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
