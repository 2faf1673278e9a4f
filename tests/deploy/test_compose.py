"""docker-compose.yml is checked by parsing: no Docker engine runs here."""

from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.deploy.dockerfile import copied, stages

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
SERVICES: dict = COMPOSE["services"]
# Processes that answer on a port, and so must say how to probe them.
SERVING = {"postgres", "redis", "web", "agent1", "agent2"}
REQUIRED = {"postgres", "redis", "web", "worker", "beat", "ingest", "agent1", "agent2"}


def test_the_whole_stack_is_there() -> None:
    assert set(SERVICES) >= REQUIRED


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_has_an_image_or_build(name: str) -> None:
    service = SERVICES[name]
    assert "image" in service or "build" in service
    build = service.get("build")
    if build:
        assert (REPO_ROOT / build["context"] / build["dockerfile"]).is_file()


@pytest.mark.parametrize("name", sorted(REQUIRED - {"postgres", "redis"}))
def test_product_service_has_a_command(name: str) -> None:
    command = SERVICES[name].get("command")
    assert isinstance(command, list)
    assert command


@pytest.mark.parametrize("name", sorted(SERVING))
def test_serving_service_has_a_health_check(name: str) -> None:
    check = SERVICES[name].get("healthcheck")
    assert check
    assert check["test"][0] in {"CMD", "CMD-SHELL"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dependencies_exist_and_health_conditions_have_checks(name: str) -> None:
    depends_on = SERVICES[name].get("depends_on", {})
    names = depends_on if isinstance(depends_on, list) else list(depends_on)
    for dependency in names:
        assert dependency in SERVICES, f"{name} depends on unknown service {dependency}"
        options = depends_on[dependency] if isinstance(depends_on, dict) else {}
        condition = options.get("condition")
        if condition == "service_healthy":
            assert "healthcheck" in SERVICES[dependency], dependency


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_named_volumes_are_declared(name: str) -> None:
    for volume in SERVICES[name].get("volumes", []):
        source = volume.split(":", 1)[0]
        if not source.startswith((".", "/")):
            assert source in COMPOSE["volumes"], f"{name} mounts undeclared volume {source}"


def test_redis_keeps_an_append_only_file() -> None:
    # Usage entries waiting on the streams must survive a Redis restart.
    assert "--appendonly yes" in " ".join(SERVICES["redis"]["command"])


def test_redis_runs_with_acls_and_the_default_user_off() -> None:
    command = " ".join(SERVICES["redis"]["command"])
    assert "--aclfile /data/users.acl" in command
    assert "user default off" in command


@pytest.mark.parametrize("name", sorted(REQUIRED - {"postgres", "redis"}))
def test_each_process_connects_to_redis_as_its_roles_user(name: str) -> None:
    environment = SERVICES[name].get("environment", {})
    expected_user = {"ingest": "ingest", "agent1": None, "agent2": None}.get(name, "controlplane")
    if expected_user is None:  # agents: their own enrolled user, from their credentials
        assert not any("REDIS" in key and "URL" in key for key in environment)
        assert not {"SECRET_KEY", "DATABASE_URL"} & set(environment)
        assert "AGENT_ENROLMENT_TOKEN" in environment
        assert not any("token" in argument.lower() for argument in SERVICES[name]["command"])
        return
    assert environment["REDIS_URL"].startswith(f"redis://{expected_user}:")
    # Only the web process (agent enrolment) and the migration (user setup) hold the admin.
    assert ("REDIS_ADMIN_URL" in environment) == (name in {"web", "migrate"})


def test_dockerfile_copies_every_package_into_the_image_of_its_role() -> None:
    by_name = stages()
    copied_paths = copied("controlplane", by_name) | copied("agent", by_name)
    for package in ("controlplane", "engine", "agent", "contracts", "templates", "static"):
        assert package in copied_paths
    assert "Procfile" in copied("controlplane", by_name)
    assert Path(REPO_ROOT / "Procfile").is_file()


def test_docker_compose_config_accepts_the_file_where_compose_is_installed(tmp_path) -> None:
    import shutil
    import subprocess

    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True).returncode
    ):
        pytest.skip("Docker Compose is not installed here; the local stack test covers the file")
    env_file = tmp_path / ".env"
    lines = (REPO_ROOT / ".env.example").read_text().splitlines()
    env_file.write_text(
        "\n".join(line + "0123456789abcdef" * 4 if line.endswith("=") else line for line in lines)
    )
    result = subprocess.run(
        [docker, "compose", "--env-file", str(env_file),
         "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
