"""A GGUF artifact as the Hugging Face folder that engines loading only folders need.

Until versions can be folders, a GGUF version served by such an engine (vLLM, SGLang) is
dequantized once into a safetensors folder (engine/hf_export.py, in a subprocess: the
agent itself never imports torch), cached beside the artifacts by the file's digest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.engines.base import EngineStartError

EXPORT_TIMEOUT_S = 900.0
EXPORT_DTYPE = "bfloat16"


def hf_folder_for(gguf_path: Path, *, digest: str, cache_dir: Path) -> Path:
    """The folder for `gguf_path` (written on first use; engine/hf_export.py is idempotent)."""
    folder = cache_dir / f"{digest}-{EXPORT_DTYPE}"
    command = [sys.executable, "-m", "engine.hf_export", str(gguf_path), str(folder)]
    command += ["--dtype", EXPORT_DTYPE]
    try:
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            text=True,
            timeout=EXPORT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip()[-400:]
        raise EngineStartError(f"could not write a folder for {gguf_path.name}: {tail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise EngineStartError(f"writing a folder for {gguf_path.name} timed out") from exc
    return folder
