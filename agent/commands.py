"""The agent's command thread: it reads `agent:<name>:commands` and runs one command at
a time, answering each on `agent:results`.

A command not signed for this agent by the control plane's command key, an expired one,
or a load signed by a release key not pinned here is refused unrun: one `rejected`
result whose detail starts with the reason. Every other command gets an `accepted` and a
final result, recorded under `agent:<name>:completed:<command_id>` so that a redelivered
command is answered from the record instead of running twice. This thread starts the
engines (they die with it: PR_SET_PDEATHSIG), restarts one that failed, and stops them at
shutdown.

`AgentCommands` is the part of `Agent` (agent/runner.py) that does this; it shares the
agent's state, under the agent's lock, with the heartbeat and registration threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from agent.artifacts import artifact_fetch
from agent.capacity import load_fit_check
from agent.config import AgentConfig
from agent.control_plane import ArtifactError, ControlPlaneClient
from agent.engine_process import EngineProcess, EngineSpec, EngineStartError
from agent.engines import EngineAdapter, adapter_for
from agent.metrics import AgentMetrics
from agent.redis_link import RedisLink, RedisUnavailable
from agent.restart_plan import RestartPlan
from agent.telemetry import TelemetryAccumulator
from contracts import engines
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
    parse_command,
    parse_drain_payload,
    parse_faults_payload,
    parse_load_payload,
)
from contracts.signing import SignatureError, verify_signature
from contracts.streams import AgentState, ContractError, EngineError
from engine.config import EngineSecrets

logger = logging.getLogger("agent")

COMPLETED_RECORD_TTL_S = 7 * 24 * 3600


class CommandFailed(Exception):
    """A command was attempted and failed; the message is the reason reported."""


class AgentCommands:
    """What the command thread does. The state it reads and changes is the agent's (set by
    Agent.__init__, agent/runner.py), shared with the other threads under `_lock`."""

    config: AgentConfig
    stop_event: threading.Event
    _lock: threading.Lock
    state: AgentState
    detail: str
    engine_error: EngineError | None
    current: EngineProcess | None
    current_load: LoadPayload | None
    retiring: list[EngineProcess]
    faults: FaultsPayload
    telemetry: TelemetryAccumulator
    metrics: AgentMetrics
    link: RedisLink
    control_plane: ControlPlaneClient
    commands_stream: str
    inventory: dict[str, Any]  # the memory it offers (agent/inventory.py)
    _is_group_ready: bool
    _failed_engines: list[EngineProcess]
    _restart: RestartPlan
    # Agent's methods, which the heartbeat thread calls too.
    _engine_failed: Callable[[EngineError, EngineProcess], None]
    _signed: Callable[[str, dict[str, str]], dict[str, str]]

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
                load = parse_load_payload(command.payload)
                self._check_pinned(load)
                load_fit_check(load, self.inventory)
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
        """The artifact's verified local copy (agent/artifacts.py); a failure fails the load."""
        try:
            return artifact_fetch(self.control_plane, load, cache_dir=self.config.artifact_dir)
        except ArtifactError as exc:
            raise CommandFailed(str(exc)) from exc

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
