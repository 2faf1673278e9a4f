"""What the agent needs to know about a serving engine, whichever it is.

An adapter turns a version's serving configuration into a command line and environment,
tells warm from starting, says how a drain is asked for, and names the Prometheus series
its heartbeat figures come from. It holds no process: agent/engine_process.py runs one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import httpx

from agent.engines.prometheus import MetricNames, MetricsSnapshot, read_snapshot
from contracts.engines import BUILTIN, FORMAT_GGUF, FORMAT_HF_FOLDER, NO_ARTIFACT, SERVES
from contracts.streams import EngineError
from engine.config import ADMIN_SECRET_VARIABLE, AGENT_NAME_VARIABLE, EngineSecrets

# ASGI middleware of ours an engine that is not ours loads by import path (vLLM's
# --middleware, llama.cpp's launcher): GET /identity and /admin/faults as our engine has.
PLUGINS_DIR = Path(__file__).resolve().parent / "plugins"
IDENTITY_MIDDLEWARE = "fleet_engine_identity.IdentityMiddleware"
FAULT_MIDDLEWARE = "fleet_engine_faults.FaultMiddleware"


class EngineStartError(RuntimeError):
    """The engine cannot be started; `error` is set when it was an engine failure (not a
    configuration the agent refused)."""

    def __init__(self, message: str, error: EngineError | None = None) -> None:
        super().__init__(message)
        self.error = error


class Readiness(StrEnum):
    STARTING = "starting"  # not answering yet, or answering "not yet"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # it answers, and says it cannot serve


class DrainMethod(StrEnum):
    ADMIN_REQUEST = "admin_request"  # POST its drain endpoint, then wait for it to exit
    SIGTERM = "sigterm"  # the engine finishes in-flight requests on SIGTERM, then exits
    # No drain of its own: wait until its metrics show nothing running or waiting (no new
    # requests come: the agent reports draining), then SIGTERM.
    IDLE_THEN_SIGTERM = "idle_then_sigterm"
    NONE = "none"  # not the agent's process: it only stops routing to it


@dataclass
class EngineSpec:
    """One engine to start: what it serves, where, and with which secrets."""

    # A file (GGUF) or a folder (HF safetensors), verified before the start; None for an
    # openai version, which has no artifact.
    model_path: Path | None
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
    drain_timeout_s: float = 60.0
    # The version's engine and its arguments (signed; contracts/engines.py allows them).
    engine: str = BUILTIN
    engine_args: dict[str, Any] = field(default_factory=dict)
    version_id: int | None = None  # named in its log lines, not passed to it

    def model(self) -> str:
        """The artifact's path, for an engine that loads one."""
        if self.model_path is None:
            raise EngineStartError(f"the {self.engine} engine needs an artifact")
        return str(self.model_path)


def gpu_environment(gpu_index: int) -> dict[str, str]:
    """The engine sees only its agent's GPU (as its cuda:0), counted in PCI bus order as
    NVML counts, so that the GPU it runs on is the one the agent meters."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu_index)}


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineStartError(f"serving_config.{key} must be a positive integer")
    return value


def config_flags(
    serving_config: Mapping[str, Any],
    flags: Mapping[str, str],
    *,
    engine: str,
    dtypes: Mapping[str, str],
) -> list[str]:
    """Flags for a signed serving configuration: `flags` maps a key to its flag, `dtypes`
    our dtype names to the engine's. A key or dtype the engine cannot apply is refused."""
    unknown = sorted(set(serving_config) - set(flags))
    if unknown:
        raise EngineStartError(
            f"serving_config has keys the {engine} engine cannot apply: {unknown}"
        )
    arguments: list[str] = []
    for key, value in sorted(serving_config.items()):
        if key == "dtype":
            if value not in dtypes:
                raise EngineStartError(
                    f"serving_config.dtype {value!r}: the {engine} engine takes {sorted(dtypes)}"
                )
            arguments += [flags[key], dtypes[value]]
        else:
            arguments += [flags[key], str(positive_int(key, value))]
    return arguments


def address_flags(spec: EngineSpec, name_flag: str = "--served-model-name") -> list[str]:
    """Where it listens and the model name it answers to, as most engines spell them."""
    return ["--host", spec.host, "--port", str(spec.port), name_flag, spec.served_model_name]


def plugin_environment(spec: EngineSpec, api_key_variable: str) -> dict[str, str]:
    """For an engine that loads our middleware (PLUGINS_DIR on its path): the agent it
    proves it serves for, the admin secret it proves it with (and that opens
    /admin/faults), and the serving secret as the engine's API key in `api_key_variable`."""
    paths = [str(PLUGINS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {"PYTHONPATH": os.pathsep.join(paths), AGENT_NAME_VARIABLE: spec.agent_name}
    if spec.secrets is not None:
        environment[api_key_variable] = spec.secrets.serving
        environment[ADMIN_SECRET_VARIABLE] = spec.secrets.admin
    return environment


class EngineAdapter:
    """The shared interface; one subclass per backend (agent/engines/<backend>.py)."""

    name: ClassVar[str]  # its name in contracts.engines.ENGINES
    metric_names: ClassVar[MetricNames]
    drain_method: ClassVar[DrainMethod] = DrainMethod.SIGTERM
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"
    supports_faults: ClassVar[bool] = False  # it answers POST /admin/faults
    # The faults a load starts with go on its command line (ours); else they are posted
    # to /admin/faults once it is ready.
    faults_on_command_line: ClassVar[bool] = False
    starts_process: ClassVar[bool] = True

    def __init__(self, command: tuple[str, ...] | None = None) -> None:
        self.command_prefix = command or self.default_command()

    def default_command(self) -> tuple[str, ...]:
        raise NotImplementedError

    def arguments(self, spec: EngineSpec) -> list[str]:
        """The flags after the command prefix."""
        raise NotImplementedError

    def command(self, spec: EngineSpec) -> list[str]:
        return [*self.command_prefix, *self.arguments(spec)]

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        """Variables added to the agent's environment for the engine."""
        return gpu_environment(spec.gpu_index)

    def readiness(self, response: httpx.Response) -> Readiness:
        """Its health endpoint's answer read: 200 is ready, anything else not yet."""
        return Readiness.READY if response.status_code == 200 else Readiness.STARTING

    def failure_detail(self, response: httpx.Response | None) -> str:
        """What its health answer says went wrong, when it says; "" otherwise."""
        return ""

    def read_metrics(self, text: str) -> MetricsSnapshot:
        return read_snapshot(text, self.metric_names)

    @property
    def formats(self) -> frozenset[str]:
        """The artifact formats it loads (contracts.engines.SERVES, as the registry knows)."""
        return frozenset(SERVES[self.name])

    def check_model_path(self, path: Path | None) -> None:
        """Refuse a model it cannot load, before starting anything."""
        if NO_ARTIFACT in self.formats:
            return
        if path is None:
            raise EngineStartError(f"the {self.name} engine needs an artifact")
        is_folder = path.is_dir()
        if is_folder and FORMAT_HF_FOLDER not in self.formats:
            raise EngineStartError(f"the {self.name} engine loads a GGUF file, not a folder")
        if not is_folder and FORMAT_GGUF not in self.formats:
            raise EngineStartError(
                f"the {self.name} engine loads a Hugging Face folder, not a single file"
            )
