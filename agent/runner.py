"""The agent: one engine for one accelerator, steered through Redis and the control plane.

Three threads share the state below under one lock, and none holds it while it waits:

- heartbeat: every interval, reads the engines' stats and the energy meter and adds a
  heartbeat to `telemetry:heartbeats` (signed, as results are, with the agent's stream
  key). While Redis is away the heartbeat is dropped (the totals it carries make the gap
  harmless), never buffered. It notices an engine that failed, for the command thread
  to restart.
- registration: registers over HTTP at start and again after every Redis outage.
- commands: reads `agent:<name>:commands` and runs one command at a time, answering on
  `agent:results`; it starts, restarts and stops the engines (agent/commands.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from agent.commands import AgentCommands
from agent.config import AgentConfig
from agent.control_plane import ControlPlaneClient, ControlPlaneError
from agent.energy import EnergyMeter, choose_energy_meter
from agent.engine_process import EngineProcess
from agent.engines import Readiness
from agent.http_server import AgentHttpServer
from agent.inventory import accelerator_inventory
from agent.metrics import AgentMetrics
from agent.redis_link import RedisLink, RedisUnavailable
from agent.restart_plan import RestartPlan
from agent.telemetry import TelemetryAccumulator
from contracts.agent_mac import agent_fields_sign
from contracts.commands import FaultsPayload, LoadPayload, commands_stream
from contracts.streams import (
    HEARTBEATS_MAXLEN,
    HEARTBEATS_STREAM,
    AgentState,
    EngineError,
    Heartbeat,
)

logger = logging.getLogger("agent")


class Agent(AgentCommands):
    """The agent's state and its threads; what the command thread does is AgentCommands'."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self.state = AgentState.IDLE
        self.detail = ""
        # The last engine failure, reported in every heartbeat until an engine next serves.
        self.engine_error: EngineError | None = None
        self.current: EngineProcess | None = None
        self.current_load: LoadPayload | None = None
        self.retiring: list[EngineProcess] = []  # old engines still finishing requests
        self.faults = FaultsPayload(latency_ms_per_token=0.0, error_rate=0.0)
        self.host = socket.gethostname()
        self.inventory = accelerator_inventory(config.gpu_index, config.memory_limit_bytes)
        self.telemetry = TelemetryAccumulator()
        self.metrics = AgentMetrics(current_state=lambda: self.state)
        self._threads: list[threading.Thread] = []
        self.energy: EnergyMeter = choose_energy_meter(
            preference=config.energy_source,
            gpu_index=config.gpu_index,
            rapl_root=config.rapl_root,
            watts_per_core=config.watts_per_core,
            root_pids=self._engine_pids,
        )
        self.link = RedisLink(config.redis_url, on_reconnect=self._on_redis_reconnect)
        self.control_plane = ControlPlaneClient(
            base_url=config.control_plane_url,
            token=config.token,
            timeout_s=config.http_timeout_s,
        )
        self._needs_registration = threading.Event()
        self._needs_registration.set()
        self._is_group_ready = False
        self._failed_engines: list[EngineProcess] = []  # to stop (the command thread does)
        self._restart = RestartPlan()
        self._seq = 0
        self._last_energy = (time.monotonic(), self.energy.joules())
        self.commands_stream = commands_stream(config.name)

    # Lifecycle.

    def run(self) -> None:
        logger.info(
            "agent %s starting: engine ports %d/%d, energy source %s, accelerator %s",
            self.config.name,
            self.config.port,
            self.config.port + 1,
            self.energy.source.value,
            self.inventory.get("accelerator"),
        )
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._registration_loop, name="registration", daemon=True),
            threading.Thread(target=self._command_loop, name="commands", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        http_server = self._start_http_server()
        self.stop_event.wait()
        for thread in self._threads:
            thread.join(timeout=self.config.drain_timeout_s + 15)
        if http_server is not None:
            http_server.stop()
        self.link.close()
        logger.info("agent %s stopped", self.config.name)

    def stop(self) -> None:
        self.stop_event.set()

    # The HTTP endpoint for orchestrators.

    def _start_http_server(self) -> AgentHttpServer | None:
        if self.config.http_port is None:
            return None
        server = AgentHttpServer(
            host=self.config.http_bind_host,
            port=self.config.http_port,
            is_alive=self.is_alive,
            readiness=self.readiness,
            registry=self.metrics.registry,
        )
        server.start()
        logger.info(
            "serving /healthz, /readyz and /metrics on %s:%d",
            self.config.http_bind_host,
            server.port,
        )
        return server

    def is_alive(self) -> bool:
        """Its threads run and it is not stopping."""
        is_running = bool(self._threads) and all(t.is_alive() for t in self._threads)
        return is_running and not self.stop_event.is_set()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: registered, and the current engine warm and serving (state ready)."""
        with self._lock:
            state, engine = self.state, self.current
        is_registered = not self._needs_registration.is_set()
        is_engine_ready = engine is not None and engine.is_running()
        is_ready = is_registered and is_engine_ready and state is AgentState.READY
        body = {"state": state.value, "is_registered": is_registered, "is_ready": is_ready}
        return is_ready, body

    def _on_redis_reconnect(self) -> None:
        self._needs_registration.set()
        self._is_group_ready = False

    def _engine_pids(self) -> list[int]:
        with self._lock:
            engines = [self.current, *self.retiring]
        return [engine.pid for engine in engines if engine is not None and engine.pid]

    # Registration.

    def registration(self) -> dict[str, Any]:
        with self._lock:
            endpoint = self.current.endpoint if self.current else ""
            version_id = self.current_load.version_id if self.current_load else None
            state = self.state
        return {
            "name": self.config.name,
            "host": self.host,
            "endpoint": endpoint,
            # Where its engines can be reached: the control plane routes to no other.
            "advertise_host": self.config.advertise_host,
            "ports": [self.config.port, self.config.port + 1],
            "inventory": self.inventory,
            "energy_source": self.energy.source.value,
            "state": state.value,
            "loaded_version_id": version_id,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
        }

    def _registration_loop(self) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            if not self._needs_registration.wait(timeout=0.5):
                continue
            try:
                answer = self.control_plane.register(self.registration())
            except ControlPlaneError as exc:
                logger.warning("registration failed (retrying in %.0fs): %s", backoff, exc)
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self._needs_registration.clear()
            backoff = 1.0
            logger.info("registered as %s (state %s)", self.config.name, answer.get("state"))

    # Heartbeats.

    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            self._check_engines()
            heartbeat = self.heartbeat()
            fields = self._signed(HEARTBEATS_STREAM, heartbeat.to_fields())
            # Dropped, not buffered, while Redis is away: the next one carries the totals.
            with contextlib.suppress(RedisUnavailable):
                self.link.call(
                    lambda client, fields=fields: client.xadd(  # type: ignore[misc]
                        HEARTBEATS_STREAM,
                        fields,
                        maxlen=HEARTBEATS_MAXLEN,
                        approximate=True,
                    )
                )
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # fell behind (a slow stats call): skip, do not burst
                next_at = now + interval
            self.stop_event.wait(next_at - now)

    def _check_engines(self) -> None:
        """Notice an engine that exited or says it failed (its step loop broke): report
        FAILED at once, so routing leaves it, and have the command thread restart it."""
        with self._lock:
            self.retiring = [engine for engine in self.retiring if engine.is_running()]
            engine, load = self.current, self.current_load
        if engine is None or engine.is_stopping:
            return
        if engine.is_running():
            if engine.health() is not Readiness.FAILED:
                return
            error = engine.failed_error()
            why = f"engine failed: {error.message}"
        else:
            error = engine.exit_error()
            why = f"engine exited unexpectedly: {error.message}"
        with self._lock:
            if self.current is not engine:
                return  # a command replaced it meanwhile
            self.current = None
            self.current_load = None
            self.state = AgentState.FAILED
            self.detail = why
            self._failed_engines.append(engine)
            if load is not None:
                self._restart.schedule(load, time.monotonic())
        self._engine_failed(error, engine)

    def _engine_failed(self, error: EngineError, engine: EngineProcess) -> None:
        """The one place an engine failure passes: counted and logged with its reason, and
        reported by every heartbeat until an engine next serves."""
        with self._lock:
            self.engine_error = error
        self.metrics.count_engine_failure(error.reason)
        logger.error(
            "engine failed (%s): %s",
            error.reason.value,
            error.message,
            extra={
                "engine_error": error.reason.value,
                "engine_port": engine.port,
                "version_id": engine.spec.version_id,
            },
        )

    def heartbeat(self) -> Heartbeat:
        with self._lock:
            current, retiring = self.current, list(self.retiring)
            state, detail, load, faults = self.state, self.detail, self.current_load, self.faults
            engine_error = self.engine_error
        engines = [engine for engine in [current, *retiring] if engine is not None]
        snapshots = {engine.key: engine.scrape() for engine in engines}
        figures = self.telemetry.observe(snapshots)
        now = time.monotonic()
        joules = self.energy.joules()
        last_time, last_joules = self._last_energy
        self._last_energy = (now, joules)
        interval = max(now - last_time, 1e-6)
        energy = max(0.0, joules - last_joules)
        current_snapshot = snapshots.get(current.key) if current else None
        running = sum(round(s.running) for s in snapshots.values() if s and s.running > 0)
        waiting = sum(round(s.waiting) for s in snapshots.values() if s and s.waiting > 0)
        kv_usage = current_snapshot.kv_cache_usage if current_snapshot else 0.0
        kv_cache_usage = min(1.0, max(0.0, kv_usage))
        self.metrics.observe_interval(
            running=running,
            waiting=waiting,
            kv_cache_usage=kv_cache_usage,
            prompt_tokens=figures.prompt_tokens,
            generated_tokens=figures.generated_tokens,
            preemptions=figures.preemptions,
            joules=energy,
            version_id=load.version_id if load else None,
        )
        self._seq += 1
        return Heartbeat(
            agent=self.config.name,
            seq=self._seq,
            sent_at=time.time(),
            host=self.host,
            endpoint=current.endpoint if current else "",
            state=state,
            version_id=load.version_id if load else None,
            version_digest=load.digest if load else "",
            detail=detail[:1000],
            running=running,
            waiting=waiting,
            kv_cache_usage=kv_cache_usage,
            interval_s=interval,
            tokens_per_second=figures.generated_tokens / interval,
            prompt_tokens=figures.prompt_tokens,
            generated_tokens=figures.generated_tokens,
            requests_ok=figures.requests_ok,
            requests_failed=figures.requests_failed,
            requests_aborted=figures.requests_aborted,
            ttft_p50_s=figures.ttft_p50_s,
            ttft_p95_s=figures.ttft_p95_s,
            itl_mean_s=figures.itl_mean_s,
            itl_p95_s=figures.itl_p95_s,
            prompt_tokens_total=self.telemetry.prompt_tokens_total,
            generated_tokens_total=self.telemetry.generated_tokens_total,
            requests_ok_total=self.telemetry.requests_ok_total,
            requests_failed_total=self.telemetry.requests_failed_total,
            power_watts=energy / interval,
            energy_joules=joules,
            energy_source=self.energy.source,
            joules_per_token=energy / figures.generated_tokens
            if figures.generated_tokens
            else None,
            fault_latency_ms=faults.latency_ms_per_token,
            fault_error_rate=faults.error_rate,
            engine_error=engine_error,
        )

    def _signed(self, stream: str, fields: dict[str, str]) -> dict[str, str]:
        """`fields` with `mac` under this agent's stream key; unsigned without one (ingest
        refuses them: the agent has no credentials yet)."""
        if not self.config.stream_key:
            return fields
        return agent_fields_sign(stream, fields, self.config.stream_key)
