"""`python -m agent --name NAME --port PORT --redis URL --control-plane URL
--enrolment-token-file FILE` (the token is needed once; the credentials it brings are kept)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from agent.config import (
    ENERGY_SOURCE_CHOICES,
    AgentConfig,
    parse_engine_command,
    parse_engine_commands,
)
from agent.credentials import CredentialsError, credentials_obtain
from contracts.logs import logging_configure
from contracts.tracing import tracing_configure


def _enrolment_token(options: argparse.Namespace) -> str:
    if options.enrolment_token_file:
        return Path(options.enrolment_token_file).read_text().strip()
    return os.environ.get("AGENT_ENROLMENT_TOKEN", "").strip()


def _pinned_keys(values: list[str]) -> dict[str, str]:
    keys = {}
    for value in values:
        key_id, separator, public_key = value.partition("=")
        if not separator or not key_id or not public_key:
            raise ValueError(f"--trusted-key must be KEY_ID=BASE64_PUBLIC_KEY, got {value!r}")
        keys[key_id] = public_key
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__)
    parser.add_argument("--name", required=True, help="unique agent name (a-z, 0-9, . _ -)")
    parser.add_argument(
        "--port", required=True, type=int, help="engine port; the next one is used too"
    )
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument(
        "--control-plane", default=os.environ.get("CONTROL_PLANE_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument(
        "--enrolment-token-file",
        help="one-time enrolment token (or AGENT_ENROLMENT_TOKEN); traded for the agent's "
        "own credentials, kept in STATE_DIR/credentials.json",
    )
    parser.add_argument("--state-dir", help="credentials and artifacts (default .demo/agents/NAME)")
    parser.add_argument("--advertise-host", default="127.0.0.1")
    parser.add_argument("--bind-host", default="127.0.0.1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--engine-command", default=f"{sys.executable} -m engine serve")
    parser.add_argument(
        "--engine-command-for",
        action="append",
        default=[],
        help="ENGINE=COMMAND: start vllm, sglang or llama.cpp with this command instead of "
        "its default (repeatable; docs/engines.md)",
    )
    parser.add_argument("--engine-ready-timeout", type=float, default=300.0)
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--energy-source", choices=ENERGY_SOURCE_CHOICES, default="auto")
    parser.add_argument(
        "--gpu-index",
        type=int,
        default=0,
        help="the GPU this agent's engine runs on (CUDA_VISIBLE_DEVICES) and meters (NVML)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve /healthz, /readyz and /metrics on this port (default: not served)",
    )
    parser.add_argument(
        "--memory-limit-bytes",
        type=int,
        # argparse applies `type` to a string default: a bad variable stops the agent
        default=os.environ.get("AGENT_MEMORY_LIMIT_BYTES") or None,
        help="offer at most this much of the device's memory to engines (default: "
        "AGENT_MEMORY_LIMIT_BYTES, else all of it); the rest stays reserved",
    )
    parser.add_argument("--http-bind", help="address of that endpoint (default: --bind-host)")
    parser.add_argument("--rapl-root", default="/sys/class/powercap")
    parser.add_argument("--watts-per-core", type=float, default=10.0)
    parser.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        help="KEY_ID=BASE64: only accept versions signed by these keys (repeatable)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LOG_LEVEL", "INFO"),
        help="default: LOG_LEVEL, else INFO; LOG_FORMAT chooses json (default) or text lines; "
        "its engines' lines come out here too",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        logging_configure(level=options.log_level, fields={"agent": options.name})
    except ValueError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state_dir = Path(options.state_dir or Path(".demo") / "agents" / options.name)
    try:
        tracing_configure("agent")  # its engine reads the same OTEL_* variables
        pinned = _pinned_keys(options.trusted_key)
        credentials = credentials_obtain(
            state_dir=state_dir,
            agent_name=options.name,
            enrolment_token=_enrolment_token(options),
            control_plane_url=options.control_plane,
        )
        pinned = {**credentials.trusted_keys, **pinned}
        config = AgentConfig(
            name=options.name,
            port=options.port,
            redis_url=credentials.redis_url(options.redis),
            control_plane_url=options.control_plane,
            token=credentials.api_token,
            state_dir=state_dir,
            advertise_host=options.advertise_host,
            bind_host=options.bind_host,
            engine_command=parse_engine_command(options.engine_command),
            engine_commands=parse_engine_commands(options.engine_command_for),
            engine_threads=options.threads,
            engine_ready_timeout_s=options.engine_ready_timeout,
            drain_timeout_s=options.drain_timeout,
            heartbeat_interval_s=options.heartbeat_interval,
            energy_source=options.energy_source,
            gpu_index=options.gpu_index,
            rapl_root=Path(options.rapl_root),
            watts_per_core=options.watts_per_core,
            pinned_keys=pinned,
            stream_key=credentials.stream_key,
            command_public_key=credentials.command_public_key,
            http_port=options.http_port,
            http_bind_host=options.http_bind or options.bind_host,
            memory_limit_bytes=options.memory_limit_bytes,
        )
    except (ValueError, OSError, CredentialsError) as exc:
        logging.getLogger("agent").error("agent: %s", exc)
        return 2
    from agent.runner import Agent

    agent = Agent(config)

    def request_stop(signum: int, frame: Any) -> None:
        logging.getLogger("agent").info("stopping on signal %d", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
