"""The agent: one engine for one accelerator, steered through Redis and the control plane.

Three threads share the state below under one lock, and none holds it while it waits:

- heartbeat: every interval, reads the engines' stats and the energy meter and adds a
  heartbeat to `telemetry:heartbeats` (signed, as results are, with the agent's stream
  key). While Redis is away the heartbeat is dropped (the totals it carries make the gap
  harmless), never buffered.
- registration: registers over HTTP at start and again after every Redis outage.
- commands: reads `agent:<name>:commands` through a consumer group and runs one
  command at a time. A command not signed for this agent by the control plane's command
  key, an expired one, or a load signed by a release key not pinned here is refused
  unrun: one `rejected` result whose detail starts with the reason. Every other command
  gets an `accepted` and a final result on `agent:results`,
  recorded under `agent:<name>:completed:<command_id>` so that a redelivered command is
  answered from the record instead of running twice. This thread starts the engines
  (they die with it: PR_SET_PDEATHSIG) and stops them at shutdown.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from agent.config import AgentConfig
from agent.control_plane import (
    ArtifactError,
    ControlPlaneClient,
    ControlPlaneError,
    folder_discard,
)
from agent.energy import EnergyMeter, choose_energy_meter
from agent.engine_process import EngineProcess, EngineSpec, EngineStartError
from agent.engines import EngineAdapter, Readiness, adapter_for
from agent.http_server import AgentHttpServer
from agent.inventory import accelerator_inventory
from agent.metrics import AgentMetrics
from agent.redis_link import RedisLink, RedisUnavailable
from agent.telemetry import TelemetryAccumulator
from contracts import engines
from contracts.agent_mac import agent_fields_sign
from contracts.commands import (
    AGENT_COMMANDS_GROUP,
    RESULTS_MAXLEN,
    RESULTS_STREAM,
    Command,
    CommandKind,
    CommandRefused,
    CommandResult,
    CommandStatus,
    FaultsPayload,
    LoadPayload,
    command_record_key,
    command_signature_verify,
    commands_stream,
    parse_command,
    parse_drain_payload,
    parse_faults_payload,
    parse_load_payload,
)
from contracts.manifest import ManifestError, folder_verify
from contracts.signing import SignatureError, verify_signature
from contracts.streams import (
    HEARTBEATS_MAXLEN,
    HEARTBEATS_STREAM,
    AgentState,
    ContractError,
    EngineError,
    Heartbeat,
)
from engine.config import EngineSecrets

logger = logging.getLogger("agent")

COMPLETED_RECORD_TTL_S = 7 * 24 * 3600
ARTIFACT_SUFFIXES = {"gguf": ".gguf", "safetensors": ".safetensors"}


class CommandFailed(Exception):
    """A command was attempted and failed; the message is the reason reported."""


class RestartPlan:
    """When to load a failed engine's version again: at once the first time, then after
    1, 2, 4 ... 60 s while restarts keep failing or engines keep failing within 10
    minutes of their start (a crash loop waits, as Kubernetes' does)."""

    FIRST_DELAY_S = 1.0
    MAX_DELAY_S = 60.0
    STABLE_S = 600.0

    def __init__(self) -> None:
        self.load: LoadPayload | None = None
        self.not_before = 0.0
        self.delay_s = 0.0
        self.started_at: float | None = None

    def schedule(self, load: LoadPayload, now: float) -> None:
        """An engine for `load` failed."""
        if self.started_at is not None and now - self.started_at >= self.STABLE_S:
            self.delay_s = 0.0  # it had served a good while: not a loop
        self.load = load
        self.not_before = now + self.delay_s
        self.delay_s = min(max(self.delay_s * 2, self.FIRST_DELAY_S), self.MAX_DELAY_S)

    def due(self, now: float) -> LoadPayload | None:
        return self.load if self.load is not None and now >= self.not_before else None

    def failed(self, load: LoadPayload, now: float) -> None:
        self.started_at = None
        self.schedule(load, now)

    def succeeded(self, now: float) -> None:
        self.load = None
        self.started_at = now

    def cancel(self) -> None:
        self.load = None


class Agent:
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
        self.inventory = accelerator_inventory(config.gpu_index)
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

    # Commands.

    def _command_loop(self) -> None:
        is_pending_first = True
        try:
            while not self.stop_event.is_set():
                try:
                    if not self._is_group_ready:
                        self.link.call(self._ensure_group)
                        self._is_group_ready = True
                        is_pending_first = True
                    start = "0" if is_pending_first else ">"
                    response = self.link.call(
                        lambda client, start=start: client.xreadgroup(  # type: ignore[misc]
                            AGENT_COMMANDS_GROUP,
                            self.config.name,
                            {self.commands_stream: start},
                            count=1,
                            block=None if start == "0" else 1000,
                        )
                    )
                    entries = response[0][1] if response else []
                    if start == "0" and not entries:
                        is_pending_first = False
                    for entry_id, fields in entries:
                        self._handle_entry(entry_id, fields)
                    self._restart_failed_engine()
                except RedisUnavailable:
                    is_pending_first = True
                    self.stop_event.wait(0.5)
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        logger.exception("unexpected Redis error reading commands")
                        self.stop_event.wait(1.0)
                    self._is_group_ready = False
        finally:
            self._shutdown_engines()

    def _restart_failed_engine(self) -> None:
        """Stop engines that failed and, when due, load their version again (the command
        thread, so a restart never runs beside a command's load)."""
        with self._lock:
            failed, self._failed_engines = self._failed_engines, []
        for engine in failed:
            engine.stop()
        load = self._restart.due(time.monotonic())
        if load is None:
            return
        with self._lock:
            if self.current is not None:  # a command loaded something since
                self._restart.cancel()
                return
        logger.warning("restarting the engine for version %d", load.version_id)
        try:
            detail = self.load(load)
        except CommandFailed as exc:
            self._restart.failed(load, time.monotonic())
            logger.error("engine restart failed: %s", exc)
            return
        self._restart.succeeded(time.monotonic())
        logger.info("engine restarted: %s", detail)

    def _ensure_group(self, client: redis.Redis) -> None:
        try:
            client.xgroup_create(self.commands_stream, AGENT_COMMANDS_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _handle_entry(self, entry_id: str, fields: dict[str, str] | None) -> None:
        if not fields:  # trimmed away while pending
            self.link.call(lambda c: c.xack(self.commands_stream, AGENT_COMMANDS_GROUP, entry_id))
            return
        raw_id = fields.get("command_id", "")
        try:
            command = parse_command(fields)
        except ContractError as exc:
            logger.warning("rejecting malformed command %s: %s", entry_id, exc)
            if len(raw_id) == 32:
                result = self._result(raw_id, fields.get("kind", "load"), CommandStatus.REJECTED)
                self._finish(entry_id, _replace(result, detail=f"malformed command: {exc}"))
            else:
                self.link.call(
                    lambda c: c.xack(self.commands_stream, AGENT_COMMANDS_GROUP, entry_id)
                )
            return
        try:
            command_signature_verify(
                command, agent=self.config.name, public_key_b64=self.config.command_public_key
            )
        except CommandRefused as exc:
            # Not recorded: a forged command must not answer for the real one of its id.
            self._refuse(entry_id, command, exc, is_recorded=False)
            return
        record = self.link.call(
            lambda c: c.get(command_record_key(self.config.name, command.command_id))
        )
        if record:
            logger.info("command %s seen before: answering from the record", command.command_id)
            replay = CommandResult(**{**json.loads(record), "is_replay": True})
            replay = _replace(replay, status=CommandStatus(replay.status))
            self._finish(entry_id, replay, is_recorded=False)
            return
        if command.is_expired():
            age = time.time() - command.issued_at
            self._refuse(entry_id, command, CommandRefused("expired", f"issued {age:.0f}s ago"))
            return
        if command.kind is CommandKind.LOAD:
            try:
                self._check_pinned(parse_load_payload(command.payload))
            except CommandRefused as exc:
                self._refuse(entry_id, command, exc)
                return
        self._publish(self._result(command.command_id, command.kind, CommandStatus.ACCEPTED))
        logger.info("running command %s: %s", command.command_id, command.kind.value)
        try:
            detail = self._execute(command)
            status = CommandStatus.SUCCEEDED
        except CommandFailed as exc:
            detail, status = str(exc), CommandStatus.FAILED
        except Exception as exc:
            logger.exception("command %s failed unexpectedly", command.command_id)
            detail, status = f"{type(exc).__name__}: {exc}", CommandStatus.FAILED
        logger.info("command %s %s: %s", command.command_id, status.value, detail)
        self._finish(
            entry_id,
            _replace(self._result(command.command_id, command.kind, status), detail=detail),
        )

    def _refuse(
        self, entry_id: str, command: Command, refusal: CommandRefused, *, is_recorded: bool = True
    ) -> None:
        """Answer `rejected`, the detail led by the reason (the control plane counts it)."""
        logger.warning("refusing command %s: %s: %s", command.command_id, refusal.reason, refusal)
        result = self._result(command.command_id, command.kind, CommandStatus.REJECTED)
        detail = f"{refusal.reason}: {refusal}"
        self._finish(entry_id, _replace(result, detail=detail), is_recorded=is_recorded)

    def _signed(self, stream: str, fields: dict[str, str]) -> dict[str, str]:
        """`fields` with `mac` under this agent's stream key; unsigned without one (ingest
        refuses them: the agent has no credentials yet)."""
        if not self.config.stream_key:
            return fields
        return agent_fields_sign(stream, fields, self.config.stream_key)

    def _result(self, command_id: str, kind: str, status: CommandStatus) -> CommandResult:
        with self._lock:
            endpoint = self.current.endpoint if self.current else ""
            version_id = self.current_load.version_id if self.current_load else None
        return CommandResult(
            command_id=command_id,
            agent=self.config.name,
            kind=str(kind),
            status=status,
            detail="",
            finished_at=time.time(),
            endpoint=endpoint,
            version_id=version_id,
        )

    def _publish(self, result: CommandResult) -> None:
        try:
            self.link.call(
                lambda c: c.xadd(
                    RESULTS_STREAM,
                    self._signed(RESULTS_STREAM, result.to_fields()),  # type: ignore[arg-type]
                    maxlen=RESULTS_MAXLEN,
                    approximate=True,
                )
            )
        except RedisUnavailable:
            logger.warning("could not announce %s %s", result.command_id, result.status.value)

    def _finish(self, entry_id: str, result: CommandResult, *, is_recorded: bool = True) -> None:
        """Record the outcome, publish it and acknowledge the entry, in one transaction.

        Retried until Redis takes it: the entry stays pending until then, and the record
        makes a redelivery harmless.
        """
        record = json.dumps({**asdict(result), "status": result.status.value, "is_replay": False})

        def transaction(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=True)
            if is_recorded:
                pipe.set(
                    command_record_key(self.config.name, result.command_id),
                    record,
                    ex=COMPLETED_RECORD_TTL_S,
                )
            pipe.xadd(
                RESULTS_STREAM,
                self._signed(RESULTS_STREAM, result.to_fields()),  # type: ignore[arg-type]
                maxlen=RESULTS_MAXLEN,
                approximate=True,
            )
            pipe.xack(self.commands_stream, AGENT_COMMANDS_GROUP, entry_id)
            pipe.execute()

        while True:
            try:
                self.link.call(transaction)
                return
            except RedisUnavailable:
                if self.stop_event.wait(0.5):
                    return

    def _execute(self, command: Command) -> str:
        if command.kind is CommandKind.LOAD:
            return self.load(parse_load_payload(command.payload))
        if command.kind is CommandKind.DRAIN:
            return self.drain(parse_drain_payload(command.payload).version_id)
        if command.kind is CommandKind.UNLOAD:
            return self.unload()
        return self.set_faults(parse_faults_payload(command.payload))

    # What the commands do.

    def load(self, load: LoadPayload) -> str:
        with self._lock:
            current, previous_load = self.current, self.current_load
            if (
                current is not None
                and current.is_running()
                and previous_load is not None
                and previous_load.digest == load.digest
                and previous_load.serving_config == load.serving_config
                and previous_load.engine == load.engine
                and previous_load.engine_args == load.engine_args
                # The engine requires its own load's secrets: the routing table names the
                # newest load's, so a load with new ones starts a new engine.
                and previous_load.serving_secret == load.serving_secret
                and previous_load.admin_secret == load.admin_secret
            ):
                return f"already serving version {load.version_id} at {current.endpoint}"
            self.state, self.detail = AgentState.LOADING, ""
        try:
            engine = self._prepare_engine(load)
        except CommandFailed as exc:
            with self._lock:
                is_serving = self.current is not None and self.current.is_running()
                self.state = AgentState.READY if is_serving else AgentState.FAILED
                self.detail = f"load of version {load.version_id} failed: {exc}"
            raise
        # Before the heartbeat can see it: its warm-up is not traffic.
        self.telemetry.begin_engine(engine.key, engine.scrape())
        with self._lock:
            old, self.current, self.current_load = self.current, engine, load
            self.state, self.detail, self.engine_error = AgentState.READY, "", None
            if old is not None:
                self.retiring.append(old)
        if old is not None:
            old.drain(self.config.drain_timeout_s)
        return f"serving version {load.version_id} at {engine.endpoint}"

    def _check_pinned(self, load: LoadPayload) -> None:
        """Only a release key pinned here, with the same public key, may sign a load: with
        none pinned, nothing loads."""
        if self.config.pinned_keys.get(load.key_id) != load.public_key:
            raise CommandRefused(
                "untrusted_signing_key", f"signing key {load.key_id!r} is not pinned on this agent"
            )

    def _prepare_engine(self, load: LoadPayload) -> EngineProcess:
        """Verify the signature and the artifact, start the engine and wait until it is warm."""
        started = time.monotonic()
        try:
            self._check_pinned(load)
        except CommandRefused as exc:
            raise CommandFailed(f"{exc.reason}: {exc}") from exc
        try:
            verify_signature(
                public_key_b64=load.public_key,
                signature_b64=load.signature,
                digest=load.digest,
                serving_config=load.serving_config,
                engine=load.engine,
                engine_args=load.engine_args,
            )
        except SignatureError as exc:
            raise CommandFailed(f"signature refused: {exc}") from exc
        self.metrics.observe_load_phase("verify", time.monotonic() - started)
        started = time.monotonic()
        adapter = self._adapter(load.engine)
        path = None if load.engine == engines.OPENAI else self._fetch_artifact(load)
        try:
            adapter.check_model_path(path)
        except EngineStartError as exc:
            raise CommandFailed(str(exc)) from exc
        self.metrics.observe_load_phase("fetch", time.monotonic() - started)
        with self._lock:
            in_use = {engine.port for engine in [self.current, *self.retiring] if engine}
            faults = self.faults
        ports = [self.config.port, self.config.port + 1]
        free = [port for port in ports if port not in in_use]
        if not adapter.starts_process:
            free = self._external_port(load, ports)
        if not free:
            raise CommandFailed("both engine ports are busy (a previous engine is still draining)")
        port = free[0]
        if not adapter.supports_faults:
            faults = FaultsPayload(latency_ms_per_token=0.0, error_rate=0.0)
        spec = EngineSpec(
            model_path=path,
            serving_config=dict(load.serving_config),
            engine=load.engine,
            engine_args=dict(load.engine_args),
            served_model_name=load.served_model_name,
            host=self.config.bind_host,
            port=port,
            threads=self.config.engine_threads,
            fault_latency_ms=faults.latency_ms_per_token,
            fault_error_rate=faults.error_rate,
            secrets=EngineSecrets(serving=load.serving_secret, admin=load.admin_secret),
            agent_name=self.config.name,
            gpu_index=self.config.gpu_index,
            drain_timeout_s=self.config.drain_timeout_s,
            version_id=load.version_id,
        )
        endpoint = self.config.endpoint_for(port)
        base_url = None if adapter.starts_process else endpoint
        try:
            engine = EngineProcess(
                adapter=adapter,
                spec=spec,
                endpoint=endpoint,
                base_url=base_url,
            )
        except EngineStartError as exc:
            raise CommandFailed(str(exc)) from exc
        with self._lock:
            self.state = AgentState.WARMING
        started = time.monotonic()
        try:
            engine.start()
            engine.wait_ready(self.config.engine_ready_timeout_s, self.stop_event.is_set)
        except EngineStartError as exc:
            engine.stop()
            if exc.error is not None:  # None when the agent is shutting down: no failure
                self._engine_failed(exc.error, engine)
            raise CommandFailed(str(exc)) from exc
        self.metrics.observe_load_phase("warm", time.monotonic() - started)
        return engine

    def _fetch_artifact(self, load: LoadPayload) -> Path:
        """The artifact's local copy, every byte checked against the signed digest: a file's
        as it is fetched, a folder's files against its manifest just before the engine
        starts (a copy that fails is removed, and the load refused with the reason)."""
        try:
            if load.format != engines.FORMAT_HF_FOLDER:
                return self.control_plane.fetch_artifact(
                    digest=load.digest,
                    suffix=ARTIFACT_SUFFIXES.get(load.format, ""),
                    cache_dir=self.config.artifact_dir,
                )
            folder, files = self.control_plane.fetch_folder(
                digest=load.digest, cache_dir=self.config.artifact_dir
            )
        except ArtifactError as exc:
            raise CommandFailed(str(exc)) from exc
        try:
            folder_verify(folder, files)
        except ManifestError as exc:
            folder_discard(folder)
            raise CommandFailed(f"{exc.reason}: {exc}") from exc
        return folder

    def _external_port(self, load: LoadPayload, ports: list[int]) -> list[int]:
        """The port of the running server the `openai` engine stands for: it must be one of
        this agent's endpoints, the only ones the control plane routes to."""
        url = str(load.engine_args.get("base_url", "")).rstrip("/")
        matching = [port for port in ports if self.config.endpoint_for(port) == url]
        if not matching:
            endpoints = ", ".join(self.config.endpoint_for(port) for port in ports)
            raise CommandFailed(
                f"engine_args.base_url {url} is not one of this agent's endpoints ({endpoints}): "
                "the control plane routes to no other"
            )
        return matching

    def _adapter(self, engine: str) -> EngineAdapter:
        if engine == engines.BUILTIN:
            return adapter_for(engine, self.config.engine_command)
        return adapter_for(engine, self.config.engine_commands.get(engine))

    def drain(self, version_id: int | None = None) -> str:
        """Drain the engine; with `version_id`, only if that is the version it serves."""
        with self._lock:
            engine = self.current
            if engine is None:
                return "nothing to drain"
            serving = self.current_load.version_id if self.current_load else None
            if version_id is not None and serving != version_id:
                return f"not drained: serving version {serving}, the drain named {version_id}"
            self.state, self.detail = AgentState.DRAINING, ""
        has_exited = engine.drain(self.config.drain_timeout_s)
        with self._lock:
            if self.current is engine:
                self.current, self.current_load = None, None
            self.state = AgentState.IDLE
        if not has_exited:
            timeout = self.config.drain_timeout_s
            return f"drained; requests still in flight after {timeout:.0f}s were stopped"
        return "drained"

    def unload(self) -> str:
        with self._lock:
            engine, self.current, self.current_load = self.current, None, None
            self.state, self.detail = AgentState.IDLE, ""
        if engine is None:
            return "nothing loaded"
        engine.stop()
        return "unloaded"

    def set_faults(self, faults: FaultsPayload) -> str:
        with self._lock:
            engine = self.current
            if engine is not None and not engine.adapter.supports_faults:
                raise CommandFailed(f"the {engine.engine} engine takes no injected faults")
            self.faults = faults
        if engine is not None:
            try:
                engine.set_faults(
                    latency_ms_per_token=faults.latency_ms_per_token,
                    error_rate=faults.error_rate,
                )
            except Exception as exc:
                raise CommandFailed(f"engine refused the faults: {exc}") from exc
        return (
            f"faults set: {faults.latency_ms_per_token:g} ms per token, "
            f"error rate {faults.error_rate:g}"
        )

    def _shutdown_engines(self) -> None:
        with self._lock:
            engines = [engine for engine in [self.current, *self.retiring] if engine]
            self.current, self.current_load, self.retiring = None, None, []
        for engine in engines:
            engine.drain(min(self.config.drain_timeout_s, 20.0))


def _replace(result: CommandResult, **changes: Any) -> CommandResult:
    return CommandResult(**{**asdict(result), **changes})
