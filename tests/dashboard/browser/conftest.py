"""Browser tests: the real ASGI app under uvicorn against the test database, driven in
Debian's headless Chromium by Playwright (only as a driver: `playwright install` is never
run). scripts/ensure_browser.sh installs both."""

import os
import socket
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.db import connection

from tests.conftest import PYTHON, REPO_ROOT, start_process, stop_process, wait_until
from tests.dashboard.conftest import PASSWORD

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
TIMEOUT_MS = 10_000
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def server_url(committed_db, django_db_blocker, tmp_path_factory) -> Iterator[str]:
    """uvicorn serving controlplane.asgi:application on the test database and Redis."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("uvicorn") / "server.log"
    process = start_process(
        [
            PYTHON,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        log_path,
        DJANGO_ALLOW_ASYNC_UNSAFE="",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: process.poll() is not None or _answers(f"{url}/healthz"),
            timeout=30,
            message="uvicorn did not start",
        )
        assert process.poll() is None, log_path.read_text()
        yield url
    finally:
        stop_process(process)


# Package scope: Playwright's event loop on this thread is gone before other tests run.
@pytest.fixture(scope="package")
def browser(server_url: str) -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.fail("no /usr/bin/chromium: run scripts/ensure_browser.sh")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's own ORM calls
    # are still synchronous and safe.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    playwright = sync_playwright().start()
    chromium = playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
    )
    try:
        yield chromium
    finally:
        chromium.close()
        playwright.stop()
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def open_page(browser, server_url: str, transactional_db):
    """open_page(username) -> a Page logged in through the login form, in a fresh context."""
    contexts = []

    def login(username: str):
        context = browser.new_context(base_url=server_url, viewport={"width": 1400, "height": 900})
        context.set_default_timeout(TIMEOUT_MS)
        contexts.append(context)
        page = context.new_page()
        page.goto("/accounts/login/")
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(lambda url: "/accounts/login/" not in url)
        return page

    yield login
    for context in contexts:
        context.close()


def off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run domain code in a worker thread: Playwright's sync API keeps an event loop on the
    test's thread, where publish_event's async_to_sync refuses to run."""

    def call() -> T:
        try:
            return function(*args, **kwargs)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result(timeout=60)


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def wait_live(page) -> None:
    """The websocket is open (live.js sets body[data-live=open])."""
    page.wait_for_selector("body[data-live=open]")
