"""The agent's configuration, validated on construction."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from contracts import engines
from contracts.engine_identity import engine_endpoint, is_valid_host
from contracts.streams import HEARTBEAT_INTERVAL_S, ContractError, validate_agent_name

ENERGY_SOURCE_CHOICES = ("auto", "nvml", "rapl", "estimate")


def default_engine_command() -> tuple[str, ...]:
    return (sys.executable, "-m", "engine", "serve")


@dataclass(slots=True, frozen=True)
class AgentConfig:
    name: str
    port: int  # the engine listens on `port` or `port + 1` (they alternate on each load)
    redis_url: str
    control_plane_url: str
    token: str
    state_dir: Path
    advertise_host: str = "127.0.0.1"  # how others reach this agent's engine
    bind_host: str = "127.0.0.1"
    engine_command: tuple[str, ...] = field(default_factory=default_engine_command)
    # engine name -> the command that starts it, instead of its adapter's default
    # (agent/engines/); `builtin`'s is engine_command.
    engine_commands: dict[str, tuple[str, ...]] = field(default_factory=dict)
    engine_threads: int = 1
    engine_ready_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    energy_source: str = "auto"
    gpu_index: int = 0  # the engine sees only this GPU (CUDA_VISIBLE_DEVICES), NVML meters it
    rapl_root: Path = Path("/sys/class/powercap")
    watts_per_core: float = 10.0
    # key_id -> base64 public key: a load must be signed by one of these.
    pinned_keys: dict[str, str] = field(default_factory=dict)
    stream_key: str = ""  # 64 hex: HMAC key of this agent's heartbeats and results
    command_public_key: str = ""  # base64 Ed25519: every command must verify against it
    http_timeout_s: float = 10.0
    http_port: int | None = None  # /healthz, /readyz, /metrics; None: not served
    http_bind_host: str = "127.0.0.1"
    # The most memory its engines may use (bytes), below the device's: None offers it all.
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            validate_agent_name(self.name)
        except ContractError as exc:
            raise ValueError(f"--name: {exc}") from exc
        if not 1 <= self.port <= 65534:
            raise ValueError(
                f"--port must be within 1..65534 (port+1 is used too), got {self.port}"
            )
        if not is_valid_host(self.advertise_host):
            raise ValueError(
                "--advertise-host must be a host name or an IP address, "
                f"got {self.advertise_host!r}"
            )
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis must be a redis:// URL, got {self.redis_url!r}")
        if not self.control_plane_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--control-plane must be an http(s) URL, got {self.control_plane_url!r}"
            )
        if not self.token:
            raise ValueError("a token is required (--token, --token-file or AGENT_TOKEN)")
        if not self.engine_command:
            raise ValueError("--engine-command must not be empty")
        for engine, command in self.engine_commands.items():
            if engine not in engines.ENGINES or engine in (engines.BUILTIN, engines.OPENAI):
                raise ValueError(
                    f"--engine-command-for: {engine!r} is not an engine the agent starts "
                    f"(vllm, sglang, llama.cpp; builtin's is --engine-command)"
                )
            if not command:
                raise ValueError(f"--engine-command-for {engine}: the command is empty")
        if self.engine_threads < 1:
            raise ValueError("--threads must be at least 1")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("--heartbeat-interval must be positive")
        if self.energy_source not in ENERGY_SOURCE_CHOICES:
            raise ValueError(f"--energy-source must be one of {', '.join(ENERGY_SOURCE_CHOICES)}")
        if self.watts_per_core <= 0:
            raise ValueError("--watts-per-core must be positive")
        if self.gpu_index < 0:
            raise ValueError(f"--gpu-index must be 0 or more, got {self.gpu_index}")
        if self.http_port is not None and not 1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be within 1..65535, got {self.http_port}")
        if self.http_port in (self.port, self.port + 1):
            raise ValueError(f"--http-port {self.http_port} is one of the engine ports")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(
                f"--memory-limit-bytes must be positive, got {self.memory_limit_bytes}"
            )
        if self.engine_ready_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def artifact_dir(self) -> Path:
        return self.state_dir / "artifacts"

    def endpoint_for(self, port: int) -> str:
        return engine_endpoint(self.advertise_host, port)


def parse_engine_command(text: str) -> tuple[str, ...]:
    return tuple(shlex.split(text))


def parse_engine_commands(values: list[str]) -> dict[str, tuple[str, ...]]:
    """ENGINE=COMMAND pairs (--engine-command-for, repeatable)."""
    commands = {}
    for value in values:
        engine, separator, command = value.partition("=")
        if not separator or not engine:
            raise ValueError(f"--engine-command-for must be ENGINE=COMMAND, got {value!r}")
        commands[engine] = parse_engine_command(command)
    return commands
