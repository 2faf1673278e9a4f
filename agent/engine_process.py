"""One serving engine subprocess: start it, watch it warm, read its metrics, drain or stop it.

What differs between engines (command line, readiness, drain, metric names) is asked of
its adapter (agent/engines/); this module only runs the process and speaks HTTP to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agent.engines import EngineAdapter, EngineSpec, EngineStartError, Readiness
from agent.engines.base import DrainMethod
from agent.engines.prometheus import MetricsSnapshot, MetricsTextError

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
IDLE_POLL_S = 0.2
_keys = itertools.count(1)
ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): ")

__all__ = ["EngineProcess", "EngineSpec", "EngineStartError"]


def _die_with_parent() -> None:
    """Runs in the child: SIGTERM it when the agent thread that started it dies (even by -9)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class EngineProcess:
    def __init__(
        self,
        *,
        adapter: EngineAdapter,
        spec: EngineSpec,
        log_path: Path,
        endpoint: str,
        base_url: str | None = None,
    ) -> None:
        if spec.secrets is None:
            raise EngineStartError("an engine needs its serving and admin secrets")
        self.adapter = adapter
        self.spec = spec
        self.command = adapter.command(spec) if adapter.starts_process else []
        self.log_path = log_path
        self.endpoint = endpoint
        self.is_stopping = False
        self._process: subprocess.Popen[bytes] | None = None
        self._base_url = base_url or f"http://{spec.host}:{spec.port}"
        self._client = httpx.Client(base_url=self._base_url, timeout=2.0)
        self._secrets = spec.secrets
        self._lock = threading.Lock()
        self.key = f"{adapter.name}-{next(_keys)}"  # its telemetry's key, for its lifetime

    @property
    def engine(self) -> str:
        return self.adapter.name

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def port(self) -> int:
        return self.spec.port

    def start(self) -> None:
        if not self.adapter.starts_process:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command,
                env={**os.environ, **self.adapter.environment(self.spec)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # only calls prctl
                # Its own process group: a stop ends the engine's helpers too (vLLM's
                # engine core and workers), not only the process the agent started.
                start_new_session=True,
            )
        logger.info(
            "engine started", extra={"engine": self.engine, "pid": self.pid, "port": self.port}
        )

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def is_running(self) -> bool:
        if not self.adapter.starts_process:
            return not self.is_stopping
        return self._process is not None and self._process.poll() is None

    def log_tail(self, characters: int = 600) -> str:
        try:
            text = self.log_path.read_bytes()[-characters:].decode(errors="replace")
        except OSError:
            return ""
        return text.strip()

    def failure(self) -> str:
        """Why it failed, for a result's detail: the first exception line it logged (the
        root cause, which a long traceback pushes far above its tail), then the tail."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line.strip() for line in lines if ERROR_LINE.search(line)]
        tail = self.log_tail()
        return f"{errors[0][-300:]} ... {tail}" if errors and errors[0] not in tail else tail

    def _authorization(self, path: str) -> dict[str, str]:
        """The admin secret for /admin/* (ours), the serving secret for the rest."""
        is_admin = path.startswith("/admin/")
        secret = self._secrets.admin if is_admin else self._secrets.serving
        return {"Authorization": f"Bearer {secret}"}

    def _get(self, path: str) -> httpx.Response:
        with self._lock:
            return self._client.get(path, headers=self._authorization(path))

    def _post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        with self._lock:
            return self._client.post(path, json=body, headers=self._authorization(path))

    def health(self) -> Readiness | None:
        """What its health endpoint says; None when it does not answer."""
        try:
            return self.adapter.readiness(self._get(self.adapter.health_path))
        except (httpx.HTTPError, RuntimeError):
            return None

    def wait_ready(self, timeout_s: float, should_abort: Callable[[], bool]) -> None:
        """Block until it is ready; raise EngineStartError if it exits, fails or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if should_abort():
                raise EngineStartError("the agent is shutting down")
            code = self.exit_code()
            if code is not None:
                raise EngineStartError(f"engine exited with code {code}: {self.failure()}")
            readiness = self.health()
            if readiness is Readiness.READY:
                return
            if readiness is Readiness.FAILED:
                raise EngineStartError(f"engine failed while starting: {self.failure()}")
            time.sleep(0.2)
        raise EngineStartError(f"engine not ready within {timeout_s:.0f}s: {self.log_tail()}")

    def scrape(self) -> MetricsSnapshot | None:
        """Its /metrics read into the heartbeat's figures; None when it does not answer."""
        if not self.is_running():
            return None
        try:
            response = self._get(self.adapter.metrics_path)
            if response.status_code != 200:
                return None
            return self.adapter.read_metrics(response.text)
        except (httpx.HTTPError, RuntimeError, MetricsTextError):
            return None

    def set_faults(self, *, latency_ms_per_token: float, error_rate: float) -> None:
        if not self.adapter.supports_faults:
            raise RuntimeError(f"the {self.engine} engine takes no injected faults")
        response = self._post(
            "/admin/faults",
            {"latency_ms_per_token": latency_ms_per_token, "error_rate": error_rate},
        )
        if response.status_code != 200:
            raise RuntimeError(f"engine refused faults: HTTP {response.status_code}")
        self.spec.fault_latency_ms = latency_ms_per_token
        self.spec.fault_error_rate = error_rate

    def drain(self, timeout_s: float) -> bool:
        """Stop taking requests, finish in-flight ones, exit. True when it exited by itself."""
        self.is_stopping = True
        if self._process is None or self._process.poll() is not None:
            self._client.close()
            return True
        deadline = time.monotonic() + timeout_s
        method = self.adapter.drain_method
        try:
            if method is DrainMethod.ADMIN_REQUEST:
                try:
                    self._post("/admin/drain")
                except httpx.HTTPError as exc:
                    logger.warning("drain request failed", extra={"error": str(exc)})
            elif method is DrainMethod.IDLE_THEN_SIGTERM:
                self._wait_idle(deadline)
                self._process.send_signal(signal.SIGTERM)
            else:
                self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=max(0.0, deadline - time.monotonic()))
                self._kill_group(signal.SIGKILL)  # helpers it left behind, if any
                return True
            except subprocess.TimeoutExpired:
                self.stop()
                return False
        finally:
            self._client.close()

    def _wait_idle(self, deadline: float) -> None:
        """Until its metrics show nothing running or waiting (or it stops answering)."""
        while time.monotonic() < deadline and self.exit_code() is None:
            snapshot = self.scrape()
            if snapshot is None or snapshot.running + snapshot.waiting == 0:
                return
            time.sleep(IDLE_POLL_S)

    def _kill_group(self, signum: int) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signum)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.is_stopping = True
        if self._process is not None and self._process.poll() is None:
            self._kill_group(signal.SIGTERM)
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self._process.wait(timeout=5)
        self._kill_group(signal.SIGKILL)
        self._client.close()
