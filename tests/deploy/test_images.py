"""deploy/Dockerfile builds one image per role from the role's lock file; checked by parsing
(no Docker engine runs here), with the lock files checked against pyproject.toml."""

import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT
from tests.deploy.dockerfile import copied, lineage, runs, stages, user

STAGES = stages()
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def locked(role: str) -> dict[str, str]:
    lines = (REPO_ROOT / "requirements" / f"{role}.lock").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pins}


def direct_pins(*extras: str) -> dict[str, str]:
    lines = list(PYPROJECT["dependencies"])
    for extra in extras:
        lines += PYPROJECT["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for line in lines:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) != "fleet-control-plane":
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"{line} is not pinned"
            pins[canonicalize_name(requirement.name)] = specifier.version
    return pins


def test_the_dockerfile_has_a_target_per_role_on_a_shared_base() -> None:
    assert STAGES["controlplane"].parent == "base"
    assert STAGES["agent"].parent == "base"
    assert STAGES["base"].parent == "python:3.11-slim-bookworm"


@pytest.mark.parametrize(
    ("target", "packages"),
    [
        ("controlplane", {"contracts", "controlplane", "templates", "static", "manage.py"}),
        ("agent", {"contracts", "engine", "agent"}),
    ],
)
def test_each_target_copies_the_packages_its_role_runs_and_no_other(
    target: str, packages: set[str]
) -> None:
    product = {"contracts", "controlplane", "engine", "agent", "templates", "static"}
    copied_paths = copied(target, STAGES)
    assert copied_paths & (product | {"manage.py"}) == packages
    for package in packages:
        assert (REPO_ROOT / package).exists()


@pytest.mark.parametrize("target", ["controlplane", "agent"])
def test_each_target_installs_its_own_lock_file_and_nothing_loose(target: str) -> None:
    lock = {"controlplane": "requirements/controlplane.lock", "agent": "requirements/agent.lock"}
    assert lock[target] in copied(target, STAGES)
    installs = [command for command in runs(target, STAGES) if "pip install" in command]
    assert f"pip install --no-deps -r {lock[target]}" in " ".join(installs)
    for command in installs:
        # Every pip install takes exact versions and none of their dependencies.
        for part in command.split("pip install")[1:]:
            assert part.lstrip().startswith("--no-deps"), part


def test_the_control_plane_image_has_no_torch() -> None:
    assert "torch" not in locked("controlplane")
    assert not any("torch" in command for command in runs("controlplane", STAGES))
    assert "engine" not in copied("controlplane", STAGES)


def test_the_agent_image_takes_the_cpu_build_of_the_pinned_torch() -> None:
    assert locked("agent")["torch"] == direct_pins("engine")["torch"] == "2.13.0"
    arguments = [rest for keyword, rest in lineage("agent", STAGES) if keyword == "ARG"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in arguments
    (install,) = [command for command in runs("agent", STAGES) if "torch==" in command]
    assert '--index-url "$TORCH_INDEX_URL"' in install


def test_collectstatic_runs_when_the_control_plane_image_is_built() -> None:
    commands = runs("controlplane", STAGES)
    assert any(
        re.search(r"\bpython manage\.py collectstatic --noinput$", command) for command in commands
    )
    environment = [rest for keyword, rest in lineage("controlplane", STAGES) if keyword == "ENV"]
    assert "STATIC_ROOT=/app/static-collected" in environment


@pytest.mark.parametrize("target", ["controlplane", "agent"])
def test_each_image_runs_as_a_user_that_is_not_root(target: str) -> None:
    assert user(target, STAGES) == "fleet"
    assert any(
        "useradd --create-home --uid 1000 fleet" in command for command in runs(target, STAGES)
    )


def test_the_agent_state_directory_belongs_to_the_user() -> None:
    commands = runs("agent", STAGES)
    assert any("chown fleet /var/lib/agent" in command for command in commands)
    (command,) = [rest for keyword, rest in STAGES["agent"].instructions if keyword == "CMD"]
    assert "--state-dir /var/lib/agent" in command


@pytest.mark.parametrize(
    ("role", "extras"), [("controlplane", ("controlplane",)), ("agent", ("engine",))]
)
def test_lock_files_hold_every_pin_of_their_extra(role: str, extras: tuple[str, ...]) -> None:
    pins = locked(role)
    for name, version in direct_pins(*extras).items():
        assert pins.get(name) == version, name


def test_lock_files_match_the_environment_they_were_written_from() -> None:
    result = subprocess.run(
        [sys.executable, "requirements/lock.py", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
