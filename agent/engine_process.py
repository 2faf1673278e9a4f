"""One serving engine subprocess: start it, watch it warm, read its stats, drain or stop it.

Its output goes through the agent's logging (agent/engine_output.py); when it exits, is
killed, fails to become ready or says its step loop failed, `EngineError` says why: a
reason code (contracts.streams.EngineFailure) and a bounded message with its last lines.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.engine_output import EngineOutput, engine_output_level
from contracts.engines import BUILTIN, engine_flags
from contracts.streams import ENGINE_ERROR_MESSAGE_MAX_LENGTH, EngineError, EngineFailure
from engine.config import AGENT_NAME_VARIABLE, EngineSecrets

logger = logging.getLogger(__name__)

# serving_config key (signed, from the registry) -> engine flag
SERVING_CONFIG_FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "kv_block_size": "--block-size",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}
DTYPES = {"float32", "bfloat16", "int8"}
PR_SET_PDEATHSIG = 1


# How long to wait for the rest of an exited engine's output before reporting why it failed.
OUTPUT_DRAIN_S = 2.0


class EngineStartError(RuntimeError):
    """The engine cannot be started; `error` is set when it was an engine failure (not a
    configuration the agent refused)."""

    def __init__(self, message: str, error: EngineError | None = None) -> None:
        super().__init__(message)
        self.error = error


def engine_error(reason: EngineFailure, summary: str, tail: str = "") -> EngineError:
    """`summary: tail`, the tail cut from its start to fit the message's bound."""
    room = ENGINE_ERROR_MESSAGE_MAX_LENGTH - len(summary) - 2
    message = f"{summary}: {tail[-room:]}" if tail and room > 0 else summary
    return EngineError(reason, message.replace("\x00", "")[:ENGINE_ERROR_MESSAGE_MAX_LENGTH])


def serving_config_arguments(serving_config: Mapping[str, Any]) -> list[str]:
    """Engine flags for a signed serving configuration; unknown keys are refused."""
    unknown = sorted(set(serving_config) - set(SERVING_CONFIG_FLAGS))
    if unknown:
        raise EngineStartError(f"serving_config has keys this agent cannot apply: {unknown}")
    arguments: list[str] = []
    for key, value in sorted(serving_config.items()):
        if key == "dtype":
            if value not in DTYPES:
                raise EngineStartError(f"serving_config.dtype {value!r} is not one of {DTYPES}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineStartError(f"serving_config.{key} must be a positive integer")
        arguments += [SERVING_CONFIG_FLAGS[key], str(value)]
    return arguments


def gpu_environment(gpu_index: int) -> dict[str, str]:
    """The engine sees only its agent's GPU (as its cuda:0), counted in PCI bus order as
    NVML counts, so that the GPU it runs on is the one the agent meters."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu_index)}


def _die_with_parent() -> None:
    """Runs in the child: SIGTERM it when the agent thread that started it dies (even by -9)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class EngineSpec:
    model_path: Path  # a file (GGUF) or a folder (HF safetensors), checked before the start
    serving_config: dict[str, Any]
    served_model_name: str
    host: str
    port: int
    threads: int
    fault_latency_ms: float = 0.0
    fault_error_rate: float = 0.0
    # Passed in the engine's environment, never its arguments (`ps` shows those).
    secrets: EngineSecrets | None = field(default=None, repr=False)
    agent_name: str = ""  # the engine answers it, with a proof, on GET /identity
    gpu_index: int = 0
    # The version's engine and its arguments (signed; contracts/engines.py allows them).
    engine: str = BUILTIN
    engine_args: dict[str, Any] = field(default_factory=dict)
    version_id: int | None = None  # named in its log lines, not passed to it

    def arguments(self) -> list[str]:
        return [
            "--model",
            str(self.model_path),
            *serving_config_arguments(self.serving_config),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
            "--threads",
            str(self.threads),
            "--fault-latency-ms",
            repr(float(self.fault_latency_ms)),
            "--fault-error-rate",
            repr(float(self.fault_error_rate)),
            *engine_flags(self.engine, self.engine_args),
        ]


class EngineProcess:
    def __init__(self, *, command: tuple[str, ...], spec: EngineSpec, endpoint: str) -> None:
        self.spec = spec
        self.command = [*command, *spec.arguments()]
        self.endpoint = endpoint
        self.is_stopping = False
        self._process: subprocess.Popen[bytes] | None = None
        self._output: EngineOutput | None = None
        self._base_url = f"http://{spec.host}:{spec.port}"
        self._client = httpx.Client(base_url=self._base_url, timeout=2.0)
        if spec.secrets is None:
            raise EngineStartError("an engine needs its serving and admin secrets")
        self._secrets = spec.secrets
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def port(self) -> int:
        return self.spec.port

    def start(self) -> None:
        try:
            self._process = subprocess.Popen(
                self.command,
                env={
                    **os.environ,
                    **self._secrets.environment(),
                    AGENT_NAME_VARIABLE: self.spec.agent_name,
                    **gpu_environment(self.spec.gpu_index),
                    # The agent's level (its --log-level too): the engine writes what the
                    # agent logs, in the agent's LOG_FORMAT, which it inherits.
                    "LOG_LEVEL": logging.getLevelName(engine_output_level()),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # only calls prctl
            )
        except OSError as exc:
            error = engine_error(
                EngineFailure.SPAWN_FAILED, f"could not run {self.command[0]}: {exc}"
            )
            raise EngineStartError(error.message, error) from exc
        assert self._process.stdout is not None
        self._output = EngineOutput(
            self._process.stdout,
            fields={
                "engine_port": self.port,
                "engine_pid": self.pid,
                "version_id": self.spec.version_id,
            },
            name=f"engine-output-{self.port}",
        )
        self._output.start()
        logger.info("engine started", extra={"engine_pid": self.pid, "engine_port": self.port})

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, characters: int = 400, *, wait_s: float = 0.0) -> str:
        """Its last warnings, errors and unstructured lines (`wait_s`: see EngineOutput.tail)."""
        return "" if self._output is None else self._output.tail(characters, wait_s=wait_s)

    def exit_error(self, *, while_starting: bool = False) -> EngineError:
        """Why an engine that is no longer running stopped: its exit code or signal, and
        its last lines."""
        code = self.exit_code()
        when = " while starting" if while_starting else ""
        tail = self.log_tail(ENGINE_ERROR_MESSAGE_MAX_LENGTH, wait_s=OUTPUT_DRAIN_S)
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return engine_error(EngineFailure.KILLED, f"killed by {name}{when}", tail)
        return engine_error(EngineFailure.EXITED, f"exited with code {code}{when}", tail)

    def failed_error(self) -> EngineError:
        """Why a running engine says it failed (its /health's error)."""
        reason = (self.health_detail() or {}).get("error") or self.log_tail()
        return engine_error(EngineFailure.STEP_FAILED, "step loop failed", str(reason))

    def _authorization(self, path: str) -> dict[str, str]:
        """The admin secret for /admin/*, the serving secret for the rest."""
        is_admin = path.startswith("/admin/")
        secret = self._secrets.admin if is_admin else self._secrets.serving
        return {"Authorization": f"Bearer {secret}"}

    def _get(self, path: str) -> httpx.Response:
        with self._lock:
            return self._client.get(path, headers=self._authorization(path))

    def _post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        with self._lock:
            return self._client.post(path, json=body, headers=self._authorization(path))

    def health(self) -> str | None:
        detail = self.health_detail()
        return None if detail is None else str(detail.get("status"))

    def health_detail(self) -> dict[str, Any] | None:
        """/health's answer: `{"status"}`, with `error` when failed; None when unreachable."""
        try:
            data = self._get("/health").json()
        except (httpx.HTTPError, RuntimeError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def wait_ready(self, timeout_s: float, should_abort: Callable[[], bool]) -> None:
        """Block until /health says ready; raise EngineStartError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if should_abort():
                raise EngineStartError("the agent is shutting down")
            if self.exit_code() is not None:
                error = self.exit_error(while_starting=True)
                raise EngineStartError(f"engine {error.message}", error)
            if self.health() == "ready":
                return
            time.sleep(0.2)
        error = engine_error(
            EngineFailure.NOT_READY, f"not ready within {timeout_s:.0f}s", self.log_tail()
        )
        raise EngineStartError(f"engine {error.message}", error)

    def stats(self) -> dict[str, Any] | None:
        if not self.is_running():
            return None
        try:
            response = self._get("/admin/stats")
            if response.status_code != 200:
                return None
            data = response.json()
        except (httpx.HTTPError, RuntimeError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def set_faults(self, *, latency_ms_per_token: float, error_rate: float) -> None:
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
        if not self.is_running():
            return True
        try:
            self._post("/admin/drain")
        except httpx.HTTPError as exc:
            logger.warning("drain request failed", extra={"error": str(exc), "port": self.port})
        assert self._process is not None
        try:
            self._process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.stop()
            return False
        finally:
            self._client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.is_stopping = True
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._client.close()
