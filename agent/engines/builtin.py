"""Our engine: `python -m engine serve`.

It loads a GGUF file or a Hugging Face folder, reports loading/ready/draining/failed on
/health, drains on POST /admin/drain (then exits), takes injected faults on /admin/faults,
and exports vLLM's metric names, so its heartbeat is read exactly as vLLM's is.
"""

from __future__ import annotations

import sys

import httpx

from agent.engines.base import (
    DrainMethod,
    EngineAdapter,
    EngineSpec,
    Readiness,
    address_flags,
    config_flags,
)
from agent.engines.vllm import VLLM_METRICS
from contracts.engines import engine_flags

# serving_config key (signed, from the registry) -> engine flag
SERVING_CONFIG_FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "kv_block_size": "--block-size",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8"}


class BuiltinAdapter(EngineAdapter):
    name = "builtin"
    metric_names = VLLM_METRICS
    drain_method = DrainMethod.ADMIN_REQUEST
    supports_faults = True
    faults_on_command_line = True

    def default_command(self) -> tuple[str, ...]:
        return (sys.executable, "-m", "engine", "serve")

    def arguments(self, spec: EngineSpec) -> list[str]:
        return [
            "--model",
            spec.model(),
            *config_flags(
                spec.serving_config, SERVING_CONFIG_FLAGS, engine=self.name, dtypes=DTYPES
            ),
            *address_flags(spec),
            "--threads",
            str(spec.threads),
            "--fault-latency-ms",
            repr(float(spec.fault_latency_ms)),
            "--fault-error-rate",
            repr(float(spec.fault_error_rate)),
            *engine_flags(self.name, spec.engine_args),
        ]

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        from engine.config import AGENT_NAME_VARIABLE

        secrets = spec.secrets.environment() if spec.secrets else {}
        return {**super().environment(spec), **secrets, AGENT_NAME_VARIABLE: spec.agent_name}

    def readiness(self, response: httpx.Response) -> Readiness:
        try:
            status = response.json().get("status")
        except (ValueError, AttributeError):
            return Readiness.STARTING
        if status in (Readiness.READY, Readiness.DRAINING, Readiness.FAILED):
            return Readiness(status)
        return Readiness.STARTING

    def failure_detail(self, response: httpx.Response | None) -> str:
        try:
            error = response.json().get("error") if response is not None else None
        except (ValueError, AttributeError):
            return ""
        return str(error) if error else ""
