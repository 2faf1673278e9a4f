"""The control plane's modules import each other without a circle.

Every import counts, function-local ones too: a local import that breaks a circle at
load time still ties the two modules together. A circle fails with its modules named.
"""

import ast
import graphlib
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = "controlplane"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the control-plane modules it imports (migrations left out)."""
    paths = {
        module_name(path): path
        for path in (REPO_ROOT / PACKAGE).rglob("*.py")
        if "migrations" not in path.parts
    }
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def test_the_graph_sees_the_imports_it_checks() -> None:
    graph = import_graph()
    assert "controlplane.rollouts.transitions" in graph["controlplane.rollouts.tasks"]
    assert "controlplane.rollouts.hooks" in graph["controlplane.rollouts.transitions"]


def test_no_module_of_the_control_plane_imports_itself_through_others() -> None:
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"import circle: {' -> '.join(error.args[1])}") from None


# The control plane's apps, lowest first: an app imports only apps below it.
FLOORS = (
    "core",
    "audit",
    "registry",
    "tenants",
    "accounts",
    "fleet",
    "gateway",
    "telemetry",
    "rollouts",
    "dashboard",
    "demo",
)


def app_of(module: str) -> str | None:
    """The app a module belongs to; None for the project's own (settings, celery, urls)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else None


def test_every_app_is_on_a_floor() -> None:
    apps = {path.parent.name for path in (REPO_ROOT / PACKAGE).glob("*/apps.py")}
    assert apps == set(FLOORS)


def test_no_app_imports_an_app_above_it() -> None:
    upward: dict[tuple[str, str], list[str]] = {}
    for module, imported in import_graph().items():
        source = app_of(module)
        for target_module in imported:
            target = app_of(target_module)
            if source is None or target is None or source == target:
                continue
            if FLOORS.index(target) > FLOORS.index(source):
                upward.setdefault((source, target), []).append(f"{module} -> {target_module}")
    assert upward == {}, "imports up a floor"
