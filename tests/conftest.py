"""Shared fixtures: the session's private Redis (tests/redis_server.py) and helpers for
child processes."""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hypothesis
import pytest
import redis
from django.conf import settings

REPO_ROOT = Path(__file__).resolve().parent.parent

# Property tests draw the same examples every run, so a failure in `make test` reproduces
# instead of showing up once in many runs; FUZZ_RANDOM=1 explores new ones.
hypothesis.settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis.settings.register_profile("explore", derandomize=False)
IS_EXPLORING = os.environ.get("FUZZ_RANDOM") == "1"
hypothesis.settings.load_profile("explore" if IS_EXPLORING else "repeatable")


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker computes on its share of the cores, and so do the processes it
    starts (they inherit OMP_NUM_THREADS): two workers on two cores, each running torch on
    two threads, stall at every parallel region waiting for a thread the other holds."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers:
        return
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    import torch

    torch.set_num_threads(share)


@pytest.fixture(scope="session", autouse=True)
def redis_role_users() -> None:
    """The service roles' Redis users, as `manage.py redis_users` makes them (its own test
    runs the command; this needs no database)."""
    from contracts.redis_roles import ROLE_USERS
    from controlplane.fleet.redis_users import (
        redis_admin_client,
        redis_default_user_disable,
        redis_role_user_apply,
    )

    client = redis_admin_client()
    for role in ROLE_USERS:
        password = os.environ[f"REDIS_{role.upper()}_PASSWORD"]
        redis_role_user_apply(client=client, role=role, password=password)
    redis_default_user_disable(client=client)
    client.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """The test Redis (as its admin: a test looks at any key), emptied before and after."""
    client = redis.Redis.from_url(settings.REDIS_ADMIN_URL, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def child_environment(**overrides: str) -> dict[str, str]:
    """Environment for a child process that must see the same stores as the test."""
    env = dict(os.environ)
    db = settings.DATABASES["default"]
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings_test",
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "REDIS_URL": settings.REDIS_URL,
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(overrides)
    return env


def start_process(args: list[str], log_path: Path, **env: str) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the caller's stop_process
    return subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=child_environment(**env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_process(process: subprocess.Popen[bytes], timeout: float = 15) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    return process.returncode


def wait_until(
    predicate, timeout: float, interval: float = 0.05, message: str | Callable[[], str] = ""
) -> None:
    """Poll `predicate` until it holds; `message` may be a callable, read only on failure
    (so that log tails show the processes' state at the deadline, not at the call)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    text = message() if callable(message) else message
    raise AssertionError(text or f"condition not met within {timeout}s")


PYTHON = sys.executable


@pytest.fixture(scope="session")
def committed_db(django_db_setup, django_db_blocker) -> Iterator[None]:
    """The test database for fixtures whose rows other processes read (so they commit).

    pytest-django creates the test database only when a collected test asks for `db`,
    `transactional_db` or `live_server`; a module whose tests only use a fixture like this
    one, run on its own, would otherwise write to the configured database itself.
    """
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    # django-stubs omit this private method, which Django's own creation code uses.
    test_db_name = connection.creation._get_test_db_name()  # type: ignore[attr-defined]
    if connection.settings_dict["NAME"] == test_db_name:
        yield
        return
    with django_db_blocker.unblock():
        # django-stubs type `aliases` as a Mapping; Django only tests membership in it, and
        # pytest-django passes a set too.
        config = setup_databases(
            verbosity=0,
            interactive=False,
            aliases={"default"},  # type: ignore[arg-type]
        )
    try:
        yield
    finally:
        with django_db_blocker.unblock():
            teardown_databases(config, verbosity=0)
