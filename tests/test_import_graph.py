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
