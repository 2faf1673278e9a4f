"""Outside DEBUG the ASGI app serves the collected static files itself (WhiteNoise) under
content-hashed names, and the API docs load Swagger UI from them rather than a CDN."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# Requests go through the real ASGI application (gateway mount, Django, its middleware).
SERVE = textwrap.dedent(
    """
    import asyncio
    import json
    import re

    import httpx

    from controlplane.asgi import application
    from django.contrib.staticfiles.storage import staticfiles_storage


    async def main():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="https://testserver") as client:
            names = [
                "dashboard/dashboard.css", "dashboard/charts.js", "dashboard/live.js",
                "dashboard/fleet.js", "dashboard/rollout.js", "dashboard/usage.js",
            ]
            files = {}
            for name in names:
                url = staticfiles_storage.url(name)
                response = await client.get(url, headers={"Accept-Encoding": "gzip"})
                files[name] = {
                    "url": url,
                    "status": response.status_code,
                    "content_type": response.headers.get("content-type"),
                    "cache_control": response.headers.get("cache-control"),
                    "content_encoding": response.headers.get("content-encoding"),
                    "body": response.text,
                }
            login = await client.get("/accounts/login/")
            docs = await client.get("/api/docs/")
            linked = {}
            for url in re.findall(r'(?:href|src)="(/static/[^"]+)"', docs.text):
                linked[url] = (await client.get(url)).status_code
        print(json.dumps({
            "files": files,
            "login": {"status": login.status_code, "text": login.text},
            "docs": {"status": docs.status_code, "text": docs.text, "linked": linked},
        }))


    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    static_root = tmp_path_factory.mktemp("static-root")
    environment = {
        key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"
    }
    environment.update(
        {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DEBUG": "0",
            "SECRET_KEY": "static-files-test-secret-key-of-enough-length",
            "ALLOWED_HOSTS": "testserver",
            "STATIC_ROOT": str(static_root),
            "PYTHONPATH": str(REPO_ROOT),
            "LOG_LEVEL": "WARNING",
        }
    )
    collect = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput"],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert collect.returncode == 0, collect.stderr
    serve = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + SERVE],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 0, serve.stderr
    report = json.loads(serve.stdout.strip().splitlines()[-1])
    report["static_root"] = static_root
    return report


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("dashboard/dashboard.css", 'text/css; charset="utf-8"'),
        ("dashboard/charts.js", 'text/javascript; charset="utf-8"'),
        ("dashboard/live.js", 'text/javascript; charset="utf-8"'),
        ("dashboard/fleet.js", 'text/javascript; charset="utf-8"'),
        ("dashboard/rollout.js", 'text/javascript; charset="utf-8"'),
        ("dashboard/usage.js", 'text/javascript; charset="utf-8"'),
    ],
)
def test_dashboard_assets_are_served_under_hashed_names_without_debug(
    served: dict, name: str, content_type: str
) -> None:
    served_file = served["files"][name]
    stem, suffix = name.rsplit(".", 1)
    assert re.fullmatch(rf"/static/{stem}\.[0-9a-f]{{12}}\.{suffix}", served_file["url"])
    assert served_file["status"] == 200
    assert served_file["content_type"] == content_type
    # Hashed names never change content, so browsers keep them for good.
    assert served_file["cache_control"] == "max-age=315360000, public, immutable"
    assert served_file["content_encoding"] == "gzip"
    assert served_file["body"] == (REPO_ROOT / "static" / name).read_text()


def test_the_login_page_links_the_hashed_stylesheet(served: dict) -> None:
    assert served["login"]["status"] == 200
    assert f'href="{served["files"]["dashboard/dashboard.css"]["url"]}"' in served["login"]["text"]


def test_api_docs_load_swagger_ui_from_our_own_static_files(served: dict) -> None:
    docs = served["docs"]
    assert docs["status"] == 200
    assert re.findall(r"https?://", docs["text"]) == []
    assert "cdn" not in docs["text"].lower()
    linked = docs["linked"]
    assert sorted(re.sub(r"\.[0-9a-f]{12}\.", ".", url) for url in linked) == [
        "/static/drf_spectacular_sidecar/swagger-ui-dist/favicon-32x32.png",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-standalone-preset.js",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css",
    ]
    assert set(linked.values()) == {200}


def test_collectstatic_writes_a_manifest(served: dict) -> None:
    manifest = json.loads((Path(served["static_root"]) / "staticfiles.json").read_text())
    assert manifest["paths"]["dashboard/dashboard.css"] == (
        served["files"]["dashboard/dashboard.css"]["url"].removeprefix("/static/")
    )
