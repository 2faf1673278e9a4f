"""One serving engine subprocess: start it, watch it warm, read its metrics, drain or stop it.

What differs between engines (command line, readiness, drain, metric names) is asked of
its adapter (agent/engines/); this module only runs the process and speaks HTTP to it.
Its output goes through the agent's logging (agent/engine_output.py); when it exits, is
killed, fails to become ready or says it failed, `EngineError` says why: a reason code
(contracts.streams.EngineFailure) and a bounded message with its first error and last lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from agent.engine_output import EngineOutput, engine_output_level
from agent.engines import EngineAdapter, EngineSpec, EngineStartError, Readiness
from agent.engines.base import DrainMethod
from agent.engines.prometheus import MetricsSnapshot, MetricsTextError
from contracts.streams import ENGINE_ERROR_MESSAGE_MAX_LENGTH, EngineError, EngineFailure

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
IDLE_POLL_S = 0.2
_keys = itertools.count(1)
# How long to wait for the rest of an exited engine's output before reporting why it failed.
OUTPUT_DRAIN_S = 2.0
# How long an engine that reported failed while starting gets to exit (ours exits at once).
FAILED_EXIT_GRACE_S = 3.0

__all__ = ["EngineProcess", "EngineSpec", "EngineStartError", "engine_error"]


def engine_error(
    reason: EngineFailure, summary: str, tail: str = "", lead: str = ""
) -> EngineError:
    """`summary: lead ... tail` within the message's bound: `lead` (a root cause) kept from
    its start, up to half the room, `tail` cut from its start to fit the rest."""
    room = ENGINE_ERROR_MESSAGE_MAX_LENGTH - len(summary) - 2
    if lead and room > 0 and lead not in tail:
        lead = lead[: room // 2]
        tail = f"{lead} ... {tail[-(room - len(lead) - 5) :]}" if tail else lead
    message = f"{summary}: {tail[-room:]}" if tail and room > 0 else summary
    return EngineError(reason, message.replace("\x00", "")[:ENGINE_ERROR_MESSAGE_MAX_LENGTH])


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
        endpoint: str,
        base_url: str | None = None,
    ) -> None:
        if spec.secrets is None:
            raise EngineStartError("an engine needs its serving and admin secrets")
        self.adapter = adapter
        self.spec = spec
        self.command = adapter.command(spec) if adapter.starts_process else []
        self.endpoint = endpoint
        self.is_stopping = False
        self._process: subprocess.Popen[bytes] | None = None
        self._output: EngineOutput | None = None
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
        try:
            self._process = subprocess.Popen(
                self.command,
                env={
                    **os.environ,
                    **self.adapter.environment(self.spec),
                    # The agent's level (its --log-level too): our engine writes what the
                    # agent logs, in the agent's LOG_FORMAT, which it inherits.
                    "LOG_LEVEL": logging.getLevelName(engine_output_level()),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # only calls prctl
                # Its own process group: a stop ends the engine's helpers too (vLLM's
                # engine core and workers), not only the process the agent started.
                start_new_session=True,
            )
        except OSError as exc:
            error = engine_error(
                EngineFailure.SPAWN_FAILED,
                f"could not run the {self.engine} engine ({self.command[0]}): {exc}",
            )
            raise EngineStartError(error.message, error) from exc
        assert self._process.stdout is not None
        self._output = EngineOutput(
            self._process.stdout,
            fields={
                "engine": self.engine,
                "engine_port": self.port,
                "engine_pid": self.pid,
                "version_id": self.spec.version_id,
            },
            name=f"engine-output-{self.port}",
        )
        self._output.start()
        logger.info(
            "engine started",
            extra={"engine": self.engine, "engine_pid": self.pid, "engine_port": self.port},
        )

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def is_running(self) -> bool:
        if not self.adapter.starts_process:
            return not self.is_stopping
        return self._process is not None and self._process.poll() is None

    def log_tail(self, characters: int = 400, *, wait_s: float = 0.0) -> str:
        """Its last warnings, errors and unstructured lines (`wait_s`: see EngineOutput.tail)."""
        return "" if self._output is None else self._output.tail(characters, wait_s=wait_s)

    def first_error(self) -> str:
        """The first exception line it wrote: the root cause, which a long traceback
        pushes far above its last lines."""
        return "" if self._output is None else self._output.first_error

    def exit_error(self, *, while_starting: bool = False) -> EngineError:
        """Why an engine that is no longer running stopped: its exit code or signal, and
        its first error and last lines."""
        code = self.exit_code()
        when = " while starting" if while_starting else ""
        tail = self.log_tail(ENGINE_ERROR_MESSAGE_MAX_LENGTH, wait_s=OUTPUT_DRAIN_S)
        first = self.first_error()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return engine_error(EngineFailure.KILLED, f"killed by {name}{when}", tail, first)
        return engine_error(EngineFailure.EXITED, f"exited with code {code}{when}", tail, first)

    def failed_error(self, *, while_starting: bool = False) -> EngineError:
        """Why a running engine says it failed (our engine's /health names its error)."""
        summary = "failed while starting" if while_starting else "step loop failed"
        detail = self.adapter.failure_detail(self._health_response())
        if detail:
            return engine_error(EngineFailure.STEP_FAILED, summary, detail)
        tail = self.log_tail(ENGINE_ERROR_MESSAGE_MAX_LENGTH)
        return engine_error(EngineFailure.STEP_FAILED, summary, tail, self.first_error())

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

    def _health_response(self) -> httpx.Response | None:
        try:
            return self._get(self.adapter.health_path)
        except (httpx.HTTPError, RuntimeError):
            return None

    def health(self) -> Readiness | None:
        """What its health endpoint says; None when it does not answer."""
        response = self._health_response()
        return None if response is None else self.adapter.readiness(response)

    def wait_ready(self, timeout_s: float, should_abort: Callable[[], bool]) -> None:
        """Block until it is ready; raise EngineStartError if it exits, fails or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if should_abort():
                raise EngineStartError("the agent is shutting down")
            if self.exit_code() is not None:
                error = self.exit_error(while_starting=True)
                raise EngineStartError(f"engine {error.message}", error)
            readiness = self.health()
            if readiness is Readiness.READY:
                self._apply_start_faults()
                return
            if readiness is Readiness.FAILED:
                raise EngineStartError(*self._start_failure())
            time.sleep(0.2)
        error = engine_error(
            EngineFailure.NOT_READY,
            f"not ready within {timeout_s:.0f}s",
            self.log_tail(ENGINE_ERROR_MESSAGE_MAX_LENGTH),
            self.first_error(),
        )
        raise EngineStartError(f"engine {error.message}", error)

    def _apply_start_faults(self) -> None:
        """The faults the load starts with, for an engine that takes them by request."""
        spec = self.spec
        if self.adapter.faults_on_command_line or not (
            spec.fault_latency_ms or spec.fault_error_rate
        ):
            return
        try:
            self.set_faults(
                latency_ms_per_token=spec.fault_latency_ms, error_rate=spec.fault_error_rate
            )
        except (httpx.HTTPError, RuntimeError) as exc:
            raise EngineStartError(f"the engine refused the agent's faults: {exc}") from exc

    def _start_failure(self) -> tuple[str, EngineError]:
        """An engine that says it failed while starting usually exits a moment later: wait
        for that, so one failure gets one reason (exited) whichever the agent sees first."""
        deadline = time.monotonic() + FAILED_EXIT_GRACE_S
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.exit_code() is not None:
            error = self.exit_error(while_starting=True)
        else:
            error = self.failed_error(while_starting=True)
        return f"engine {error.message}", error

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
