"""Writes requirements/<role>.lock: every distribution a role's extra needs, at the version
installed in this environment (`make venv`), for the images and CI to install exactly
(`make venv` installs the `dev` extra constrained by ci.lock).

    .venv/bin/python requirements/lock.py            # rewrite both lock files
    .venv/bin/python requirements/lock.py --check    # exit 1 when one is out of date

The closure is read from the installed distributions' metadata, so nothing is downloaded.
PyTorch is locked at its public version: the agent image takes the CPU build of it.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT = "fleet-control-plane"
# lock file -> the extras it installs (ci: what `make venv` installs for `make test`)
ROLES = {"controlplane": ("controlplane",), "agent": ("engine",), "ci": ("dev",)}
# Installers, not dependencies of the product.
LEFT_OUT = {"pip", "setuptools", "wheel"}


def project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"]]
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == PROJECT:
                pending.extend(requirement.extras)
            else:
                requirements.append(requirement)
    return requirements


def applies(requirement: Requirement, extra: str) -> bool:
    if requirement.marker is None:
        return True
    environment = {key: str(value) for key, value in default_environment().items()}
    environment["extra"] = extra
    return requirement.marker.evaluate(environment)


def closure(extras: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version of everything the extras need, transitively."""
    locked: dict[str, str] = {}
    pending = [(requirement, "") for requirement in project_requirements(extras)]
    expanded: set[tuple[str, str]] = set()
    while pending:
        requirement, extra = pending.pop()
        if not applies(requirement, extra):
            continue
        name = canonicalize_name(requirement.name)
        if name in LEFT_OUT:
            continue
        distribution = metadata.distribution(name)
        locked[name] = distribution.version.split("+", 1)[0]
        for wanted in ("", *sorted(requirement.extras)):
            if (name, wanted) in expanded:
                continue
            expanded.add((name, wanted))
            for line in distribution.requires or []:
                pending.append((Requirement(line), wanted))
    return locked


def render(role: str) -> str:
    extras = ROLES[role]
    what = "`make venv`" if role == "ci" else f"The {role} image"
    lines = [
        f"# {what}'s packages at exact versions: pyproject.toml's [{','.join(extras)}] extra",
        "# and everything it needs. Written by requirements/lock.py; do not edit by hand.",
    ]
    lines += [f"{name}=={version}" for name, version in sorted(closure(extras).items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    options = parser.parse_args()
    stale = []
    for role in ROLES:
        path = REPO_ROOT / "requirements" / f"{role}.lock"
        text = render(role)
        if options.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run requirements/lock.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
