"""docker-compose.yml's services as local processes, for the test that keeps compose honest
without Docker (tests/deploy/test_compose_stack.py).

Each service runs its own command with its own environment, interpolated as Compose does
(`${VAR}`, `${VAR:-default}`, `${VAR:?message}`, `$$`), with three translations a single
host needs: service hostnames become 127.0.0.1, every container port becomes a free local
port (in the service's own listening options and in every `service:port` reference), and
every volume mount becomes a directory of its own under the test's temporary directory.
Services of the `observability` profile (Prometheus and Grafana, third-party images that
run nothing of ours) are left out.
Compose's interpolation is written here because no maintained Python library does it.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"

# What each service listens on inside its container (the image's or the command's default).
CONTAINER_PORTS = {
    "redis": [6379],
    "postgres": [5432],
    "web": [8000],
    "gateway": [8001],
    "ingest": [8002],
}
AGENT_ENGINE_PORT, AGENT_HTTP_PORT = 8100, 8102
THIRD_PARTY_PROFILES = {"observability"}
LISTENING_PORT_OPTIONS = {"--port", "--http-port", "--metrics-port"}
LISTENING_HOST_OPTIONS = {"--bind-host", "--metrics-bind"}

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<rule>:[-?][^}]*)?\}")


class ComposeError(ValueError):
    pass


def interpolate(text: str, variables: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, rule = match.group("name"), match.group("rule") or ""
        current = variables.get(name, "")
        if rule.startswith(":-"):
            return current or rule[2:]
        if rule.startswith(":?") and not current:
            raise ComposeError(f"{name}: {rule[2:] or 'required'}")
        return current

    return _VARIABLE.sub(value, text)


def interpolated(node: Any, variables: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [interpolated(item, variables) for item in node]
    if isinstance(node, dict):
        return {key: interpolated(item, variables) for key, item in node.items()}
    return node


def load(variables: dict[str, str]) -> dict[str, Any]:
    return interpolated(yaml.safe_load(COMPOSE_FILE.read_text()), variables)


def example_variables() -> dict[str, str]:
    """`.env.example` as an operator copies it: name -> value (empty where a secret goes)."""
    variables = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            variables[name.strip()] = value.strip()
    return variables


@dataclass
class LocalService:
    name: str
    args: list[str]
    environment: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port


def is_agent(name: str, service: dict[str, Any]) -> bool:
    return service.get("command", [])[:3] == ["python", "-m", "agent"]


def is_third_party(service: dict[str, Any]) -> bool:
    return bool(THIRD_PARTY_PROFILES & set(service.get("profiles", [])))


def local_services(
    compose: dict[str, Any],
    *,
    ports: dict[str, dict[int, int]],
    volume_root: Path,
    base_environment: dict[str, str],
) -> dict[str, LocalService]:
    """Every service (the `gpu` profile's included, the third-party `observability`
    profile's not) as a local process; `ports` maps each service's container ports to free
    local ones."""
    host_ports = {
        f"{service}:{inside}": f"127.0.0.1:{outside}"
        for service, mapping in ports.items()
        for inside, outside in mapping.items()
    }
    services = {}
    for name, service in compose["services"].items():
        if is_third_party(service):
            continue
        mounts = {}
        for volume in service.get("volumes", []):
            source, _, target = volume.partition(":")
            mounts[target] = str(volume_root / source)
            (volume_root / source).mkdir(parents=True, exist_ok=True)

        def local(text: str, mounts: dict[str, str] = mounts) -> str:
            for reference, address in host_ports.items():
                text = text.replace(reference, address)
            for target, directory in mounts.items():
                text = re.sub(rf"(?<![\w/]){re.escape(target)}(?=/|\b|$)", directory, text)
            return text

        command = service.get("command", [])
        args = [local(argument) for argument in command]
        args = _listening_locally(_own_ports(args, ports.get(name, {})))
        if name == "redis":  # the image's default port: say it explicitly
            args[-1] = args[-1].replace(
                "exec redis-server",
                f"exec redis-server --port {ports[name][6379]} --bind 127.0.0.1",
            )
        if is_agent(name, service):
            args = _advertised_locally(args)
        environment = {
            key: local(str(value)) for key, value in service.get("environment", {}).items()
        }
        services[name] = LocalService(
            name=name,
            args=_local_executable(args),
            environment={**base_environment, **environment},
            ports=ports.get(name, {}),
        )
    return services


def _own_ports(args: list[str], own: dict[int, int]) -> list[str]:
    """The values of a service's own listening options, moved to its local ports."""
    moved = list(args)
    for index, argument in enumerate(args[:-1]):
        if argument in LISTENING_PORT_OPTIONS and int(args[index + 1]) in own:
            moved[index + 1] = str(own[int(args[index + 1])])
    return moved


def _listening_locally(args: list[str]) -> list[str]:
    """Listening addresses (0.0.0.0 in a container) moved to the loopback."""
    moved = list(args)
    for index, argument in enumerate(args[:-1]):
        if argument in LISTENING_HOST_OPTIONS:
            moved[index + 1] = "127.0.0.1"
    return moved


def _advertised_locally(args: list[str]) -> list[str]:
    moved = list(args)
    for index, argument in enumerate(args[:-1]):
        if argument == "--advertise-host":
            moved[index + 1] = "127.0.0.1"
    return moved


def _local_executable(args: list[str]) -> list[str]:
    if not args:
        return args
    bin_dir = Path(sys.executable).parent
    if args[0] == "python":
        return [sys.executable, *args[1:]]
    if (bin_dir / args[0]).exists():
        return [str(bin_dir / args[0]), *args[1:]]
    return args


def shell_steps(args: list[str]) -> list[list[str]]:
    """The commands of a `sh -c "a && b"` service, each as argv (for the parser check)."""
    if args[:2] != ["sh", "-c"]:
        return [args]
    return [shlex.split(step) for step in args[2].split("&&")]
