"""The agent's own HTTP endpoint for orchestrators: `/healthz`, `/readyz`, `/metrics`.

The standard library's ThreadingHTTPServer: three read-only routes need no framework.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

ROUTES = ("/healthz", "/readyz", "/metrics")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never holds up the agent's exit

    def __init__(
        self,
        address: tuple[str, int],
        *,
        is_alive: Callable[[], bool],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        registry: CollectorRegistry,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.is_alive = is_alive
        self.readiness = readiness
        self.registry = registry


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "agent"

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/healthz":
            is_alive = self.server.is_alive()
            self._send_json(200 if is_alive else 503, {"status": "ok" if is_alive else "stopping"})
        elif path == "/readyz":
            is_ready, body = self.server.readiness()
            self._send_json(200 if is_ready else 503, body)
        elif path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._send_json(404, {"error": "not_found"})

    def _method_not_allowed(self) -> None:
        if urlsplit(self.path).path not in ROUTES:
            self._send_json(404, {"error": "not_found"})
            return
        self._send_json(405, {"error": "method_not_allowed"}, headers={"Allow": "GET"})

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _method_not_allowed

    def _send_json(
        self, status: int, body: dict[str, Any], *, headers: dict[str, str] | None = None
    ) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers=headers)

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http %s", format % args)  # probes every few seconds: not for INFO


class AgentHttpServer:
    """Serves the three routes on a thread of its own until `stop`."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        is_alive: Callable[[], bool],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        registry: CollectorRegistry,
    ) -> None:
        self._server = _Server(
            (host, port), is_alive=is_alive, readiness=readiness, registry=registry
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
