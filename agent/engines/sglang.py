"""SGLang: `python -m sglang.launch_server` (GPU only).

It loads a Hugging Face folder and answers 200 on /health once the model is loaded.
--enable-metrics turns on /metrics (sglang:* series, read below). The serving secret is
its --api-key: SGLang reads it from its arguments only, so it shows in `ps` on the
engine's host. It has no drain request: the agent waits until nothing runs or waits, then
sends SIGTERM.
"""

from __future__ import annotations

from agent.engines.base import (
    DrainMethod,
    EngineAdapter,
    EngineSpec,
    address_flags,
    config_flags,
)
from agent.engines.prometheus import MetricNames
from contracts.engines import engine_flags

SGLANG_METRICS = MetricNames(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_cache_usage=("sglang:token_usage",),
    prompt_tokens=("sglang:prompt_tokens",),
    generation_tokens=("sglang:generation_tokens",),
    preemptions=("sglang:num_retracted_requests",),  # SGLang calls a preemption a retraction
    ttft=("sglang:time_to_first_token_seconds",),
    itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    requests_ok=("sglang:num_requests",),
    requests_aborted=("sglang:num_aborted_requests",),
)

SERVING_CONFIG_FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--context-length",
    "kv_block_size": "--page-size",
    "block_size": "--page-size",
    "max_num_seqs": "--max-running-requests",
    "max_num_batched_tokens": "--max-prefill-tokens",
}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


class SglangAdapter(EngineAdapter):
    name = "sglang"
    metric_names = SGLANG_METRICS
    drain_method = DrainMethod.IDLE_THEN_SIGTERM

    def default_command(self) -> tuple[str, ...]:
        return ("python3", "-m", "sglang.launch_server")

    def arguments(self, spec: EngineSpec) -> list[str]:
        arguments = [
            "--model-path",
            spec.model(),
            *config_flags(
                spec.serving_config, SERVING_CONFIG_FLAGS, engine=self.name, dtypes=DTYPES
            ),
            *address_flags(spec),
            "--enable-metrics",
            *engine_flags(self.name, spec.engine_args),
        ]
        if spec.secrets is not None:
            arguments += ["--api-key", spec.secrets.serving]
        return arguments
