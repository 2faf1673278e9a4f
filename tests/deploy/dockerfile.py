"""deploy/Dockerfile read into its stages, for tests that check it without a Docker engine."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from tests.conftest import REPO_ROOT

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"


@dataclass
class Stage:
    name: str
    parent: str  # an image, or the name of an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments left out."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, rest = whole.partition(" ")
        found.append((keyword.upper(), " ".join(rest.split())))
    return found


def stages(text: str | None = None) -> dict[str, Stage]:
    by_name: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in instructions(DOCKERFILE.read_text() if text is None else text):
        if keyword == "FROM":
            words = rest.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"unnamed stage: FROM {rest}"
            current = Stage(name=words[2], parent=words[0])
            by_name[current.name] = current
        else:
            assert current is not None, f"{keyword} before FROM"
            current.instructions.append((keyword, rest))
    return by_name


def lineage(name: str, by_name: dict[str, Stage]) -> list[tuple[str, str]]:
    """A stage's instructions with those of the stages it is built on, earliest first."""
    stage = by_name[name]
    inherited = lineage(stage.parent, by_name) if stage.parent in by_name else []
    return inherited + stage.instructions


def copied(name: str, by_name: dict[str, Stage]) -> set[str]:
    """The paths of the build context a stage (with its ancestors) copies."""
    paths: set[str] = set()
    for keyword, rest in lineage(name, by_name):
        if keyword == "COPY" and not rest.startswith("--from"):
            sources = shlex.split(rest)[:-1]
            paths.update(source.rstrip("/") for source in sources)
    return paths


def runs(name: str, by_name: dict[str, Stage]) -> list[str]:
    return [rest for keyword, rest in lineage(name, by_name) if keyword == "RUN"]


def user(name: str, by_name: dict[str, Stage]) -> str:
    """The user the image runs as: the last USER, else root."""
    users = [rest for keyword, rest in lineage(name, by_name) if keyword == "USER"]
    return users[-1] if users else "root"
